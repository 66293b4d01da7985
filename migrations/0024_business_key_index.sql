-- Sagas by their business key alone (`saga show KEY`, `saga list --key`, `orch.list(key=)`):
-- the identity constraint UNIQUE (tenant_id, name, key) leads with the tenant, so a lookup
-- by key without tenant and name cannot use it. The tenant follows, for `--key --tenant`.
-- On a large table, build it beforehand without blocking writes, and this is then a no-op:
--   CREATE INDEX CONCURRENTLY IF NOT EXISTS sagas_key ON saga.sagas (key, tenant_id);
CREATE INDEX IF NOT EXISTS sagas_key ON saga.sagas (key, tenant_id);
