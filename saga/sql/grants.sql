-- The privileges of the three roles `saga grant` gives (README, "Running in production").
-- Each section is run by the owner of the saga schema (the role that runs the
-- migrations), with {role} the role being granted, as an identifier. The ALTER DEFAULT
-- PRIVILEGES lines cover what later migrations create, as long as the same owner runs
-- them. A role's privileges are those of its section and of the sections it builds on:
-- reader, then worker, then operator.

-- reader --
-- `saga list`, `saga show`, the dashboard: read every table, nothing else.
GRANT USAGE ON SCHEMA saga TO {role};
GRANT SELECT ON ALL TABLES IN SCHEMA saga TO {role};
ALTER DEFAULT PRIVILEGES IN SCHEMA saga GRANT SELECT ON TABLES TO {role};

-- worker --
-- Orchestrators and workers: start, claim and drive sagas (insert and update their
-- rows, register and unregister themselves as workers); no DDL, no migrations, no purge.
GRANT INSERT, UPDATE ON ALL TABLES IN SCHEMA saga TO {role};
REVOKE INSERT, UPDATE ON saga.schema_migrations FROM {role};
GRANT DELETE ON saga.workers TO {role};
GRANT USAGE ON ALL SEQUENCES IN SCHEMA saga TO {role};
GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA saga TO {role};
ALTER DEFAULT PRIVILEGES IN SCHEMA saga GRANT INSERT, UPDATE ON TABLES TO {role};
ALTER DEFAULT PRIVILEGES IN SCHEMA saga GRANT USAGE ON SEQUENCES TO {role};
ALTER DEFAULT PRIVILEGES IN SCHEMA saga GRANT EXECUTE ON FUNCTIONS TO {role};

-- operator --
-- The `saga` command's verbs besides migrate: what a worker does, and `saga purge`
-- (delete finished sagas).
GRANT DELETE ON ALL TABLES IN SCHEMA saga TO {role};
REVOKE DELETE ON saga.schema_migrations FROM {role};
ALTER DEFAULT PRIVILEGES IN SCHEMA saga GRANT DELETE ON TABLES TO {role};

-- missing_privileges --
-- What the connected role lacks of the table privileges %(privileges)s on every table of
-- the saga schema but schema_migrations (DELETE only on saga.workers unless
-- %(delete_all)s): one row per table ("INSERT, UPDATE on saga.sagas"), saga.sagas first,
-- after one for the schema when it lacks USAGE on it; each row with the role's name.
SELECT current_user AS role, 'USAGE on schema saga' AS missing, 0 AS rank, '' AS relname
WHERE NOT has_schema_privilege('saga', 'USAGE')
UNION ALL
SELECT current_user, string_agg(privilege, ', ' ORDER BY privilege) || ' on saga.' || c.relname,
       CASE c.relname WHEN 'sagas' THEN 1 ELSE 2 END, c.relname
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace AND n.nspname = 'saga'
CROSS JOIN unnest(%(privileges)s::text[]) AS privilege
WHERE c.relkind IN ('r', 'p')
  AND c.relname <> 'schema_migrations'
  AND (privilege <> 'DELETE' OR %(delete_all)s OR c.relname = 'workers')
  AND NOT has_table_privilege(c.oid, privilege)
GROUP BY c.relname
ORDER BY rank, relname
