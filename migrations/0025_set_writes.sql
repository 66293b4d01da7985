-- Set-based group writes: saga.write_sagas_v2 takes what saga.write_sagas_v1 (0014) takes,
-- a JSON array of saga.write_saga_v4 (0013) arguments, and answers what it answers, one
-- object per write in order: {"state": ...} (the state when the write asked for it, else
-- null) or {"sqlstate": ..., "message": ...} for a write refused alone. Where v1 calls
-- saga.write_saga_v4 once per write, each in a subtransaction of its own, v2 applies the
-- ordinary writes of the batch as a few set statements in one subtransaction:
--   1. the batch is parsed once: each write's ordinal, saga id and argument, and whether
--      it goes the per-write way (below);
--   2. one UPDATE saga.sagas ... FROM the writes, each row fenced as write_saga_v4 fences
--      it (fence and lease_owner when an owner is given) and set with the same
--      expressions, the write token included; RETURNING says which writes landed. A
--      write whose row was not updated is refused alone with what write_saga_v4 raises
--      for it (SG001, the same message), and none of its operations or events is
--      written;
--   3. one INSERT of the new operations, one UPDATE ... FROM of the changed ones
--      (matched by saga, kind and step; spent, attempt_spend and peak_spend kept when a
--      write does not send them), one INSERT of the events in batch order then in each
--      write's order (ids are the audit trail's order), one pg_notify per write that
--      asks for it, and one SELECT of the states the writes asked for.
-- The saga rows and operations are reached through `id = ANY(...)` on their primary
-- keys, so the plan stays index lookups whatever the tables' size.
--
-- What goes the per-write way (saga.write_saga_v4 in a subtransaction, exactly as v1
-- applies it), after the set statements and answered in batch order:
--   - a write with confirmations: asking, approving and using up confirmations refuse
--     a write alone on their own terms (SG002), after its saga row is written;
--   - every write of a saga the batch names more than once: the later write must see
--     the earlier, which one set statement cannot do;
--   - a write without a `saga` object: it writes operations and events unfenced.
-- The writes of these sagas and of the set statements touch different sagas.
-- If any set statement raises (a unique violation, a deadlock, a value that does not
-- cast), its subtransaction is rolled back with everything the set part did and the
-- whole batch is applied by saga.write_sagas_v1, so that each write gets the answer v1
-- gives it. The write token stored on each written row is what a writer whose reply was
-- lost reads to learn that its write landed, as before. Every write shares the
-- statement's commit; nothing is unlogged and synchronous_commit is left as it is.
--
-- Compatibility (README, "Upgrades"): a new function; saga.write_sagas_v1 and
-- saga.write_saga_v4, which the previous release calls, are left unchanged.

CREATE FUNCTION saga.write_sagas_v2(p jsonb) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    v_routed      bigint[];  -- ordinals of the writes applied one by one
    v_set_n       bigint[];  -- ordinals of the writes applied as a set ...
    v_set_ids     uuid[];    -- ... their saga ids ...
    v_set_w       jsonb[];   -- ... and arguments
    v_written     bigint[];  -- ordinals of the set writes whose saga row was updated
    v_new_ids     uuid[];    -- written writes with new operations: saga ids, rows
    v_new         jsonb[];
    v_ops_ids     uuid[];    -- ... with changed operations
    v_ops         jsonb[];
    v_ev_ids      uuid[];    -- ... with events, in batch order
    v_events      jsonb[];
    v_notify      text[];    -- ... the notifications they ask for, in batch order
    v_ret_n       bigint[];  -- ... that ask for their state: ordinals, saga ids
    v_ret_ids     uuid[];
    v_returned    bigint[];  -- the states read: ordinals, states
    v_states      jsonb[];
    v_answers     jsonb[] := '{}';  -- answers of the routed writes, aligned with v_routed
    v_answer      jsonb;
    v_n           bigint;
    v_out         jsonb;
BEGIN
    IF jsonb_typeof(p) IS DISTINCT FROM 'array' THEN
        RETURN saga.write_sagas_v1(p);  -- which refuses it as before
    END IF;

    BEGIN
        SELECT array_agg(b.n ORDER BY b.n) FILTER (WHERE b.routed),
               array_agg(b.n ORDER BY b.n) FILTER (WHERE NOT b.routed),
               array_agg(b.id ORDER BY b.n) FILTER (WHERE NOT b.routed),
               array_agg(b.w ORDER BY b.n) FILTER (WHERE NOT b.routed)
        INTO v_routed, v_set_n, v_set_ids, v_set_w
        FROM (
            SELECT e.n, e.w, (e.w->>'saga_id')::uuid AS id,
                   jsonb_typeof(e.w->'saga') IS DISTINCT FROM 'object'
                   OR COALESCE(e.w->'confirmations', '[]'::jsonb) <> '[]'::jsonb
                   OR count(*) OVER (PARTITION BY (e.w->>'saga_id')::uuid) > 1 AS routed
            FROM jsonb_array_elements(p) WITH ORDINALITY AS e(w, n)
        ) AS b;

        IF v_set_n IS NOT NULL THEN
            WITH u AS (
                UPDATE saga.sagas AS s
                SET status = b.w->'saga'->>'status',
                    direction = b.w->'saga'->>'direction',
                    error = b.w->'saga'->>'error',
                    operations_executed = (b.w->'saga'->>'operations_executed')::integer,
                    spent = (b.w->'saga'->>'spent')::numeric,
                    side_effects = (b.w->'saga'->>'side_effects')::integer,
                    max_operations = (b.w->'saga'->>'max_operations')::integer,
                    spend_budget = (b.w->'saga'->>'spend_budget')::numeric,
                    max_side_effects = (b.w->'saga'->>'max_side_effects')::integer,
                    deadline_at = (b.w->'saga'->>'deadline_at')::timestamptz,
                    finished_at = CASE
                        WHEN b.w->'saga'->>'status' IN ('completed', 'compensated')
                        THEN COALESCE(s.finished_at, now()) END,
                    run_after = COALESCE((b.w->'saga'->>'run_after')::timestamptz, s.run_after),
                    lease_owner = CASE
                        WHEN COALESCE((b.w->>'release')::boolean, false) THEN NULL
                        ELSE s.lease_owner END,
                    -- GREATEST ignores NULLs: without lease_seconds or lease_until, unchanged.
                    lease_expires_at = CASE
                        WHEN COALESCE((b.w->>'release')::boolean, false) THEN NULL
                        ELSE GREATEST(s.lease_expires_at,
                                      now() + make_interval(
                                          secs => (b.w->>'lease_seconds')::double precision),
                                      (b.w->>'lease_until')::timestamptz)
                    END,
                    write_token = (b.w->>'token')::uuid,
                    updated_at = now()
                FROM unnest(v_set_n, v_set_ids, v_set_w) AS b(n, id, w)
                WHERE s.id = ANY(v_set_ids)
                  AND s.id = b.id
                  AND (b.w->>'owner' IS NULL
                       OR (s.fence = (b.w->>'fence')::bigint
                           AND s.lease_owner = b.w->>'owner'))
                RETURNING b.n, b.id, b.w
            )
            SELECT array_agg(u.n ORDER BY u.n),
                   array_agg(u.id ORDER BY u.n) FILTER (WHERE u.w->'new_ops' IS NOT NULL),
                   array_agg(u.w->'new_ops' ORDER BY u.n) FILTER (WHERE u.w->'new_ops' IS NOT NULL),
                   array_agg(u.id ORDER BY u.n) FILTER (WHERE u.w->'ops' IS NOT NULL),
                   array_agg(u.w->'ops' ORDER BY u.n) FILTER (WHERE u.w->'ops' IS NOT NULL),
                   array_agg(u.id ORDER BY u.n) FILTER (WHERE u.w->'events' IS NOT NULL),
                   array_agg(u.w->'events' ORDER BY u.n) FILTER (WHERE u.w->'events' IS NOT NULL),
                   array_agg(u.w->>'notify' ORDER BY u.n) FILTER (WHERE u.w->>'notify' IS NOT NULL),
                   array_agg(u.n ORDER BY u.n) FILTER (WHERE (u.w->>'return_state')::boolean),
                   array_agg(u.id ORDER BY u.n) FILTER (WHERE (u.w->>'return_state')::boolean)
            INTO v_written, v_new_ids, v_new, v_ops_ids, v_ops, v_ev_ids, v_events, v_notify,
                 v_ret_n, v_ret_ids
            FROM u;
        END IF;

        IF v_new_ids IS NOT NULL THEN
            INSERT INTO saga.operations (
                saga_id, step, kind, position, idempotency_key, request_hash, status,
                attempts, max_attempts, next_attempt_at, result, provider_reference, error,
                started_at, finished_at, request, deadline_at, cost, reconcile_started_at,
                reconcile_asks, retrying_unknown)
            SELECT u.id, x.step, x.kind, x.position, x.idempotency_key, x.request_hash,
                   x.status, x.attempts, x.max_attempts, x.next_attempt_at, x.result,
                   x.provider_reference, x.error, x.started_at, x.finished_at, x.request,
                   x.deadline_at, x.cost, x.reconcile_started_at, x.reconcile_asks,
                   x.retrying_unknown
            FROM unnest(v_new_ids, v_new) WITH ORDINALITY AS u(id, rows, k),
                 jsonb_populate_recordset(NULL::saga.operations, u.rows)
                     WITH ORDINALITY AS x
            ORDER BY u.k, x.ordinality;
        END IF;

        IF v_ops_ids IS NOT NULL THEN
            UPDATE saga.operations AS o
            SET status = x.status,
                attempts = x.attempts,
                max_attempts = x.max_attempts,
                next_attempt_at = x.next_attempt_at,
                result = x.result,
                provider_reference = x.provider_reference,
                error = x.error,
                started_at = x.started_at,
                finished_at = x.finished_at,
                request_hash = x.request_hash,
                request = x.request,
                deadline_at = x.deadline_at,
                cost = x.cost,
                reconcile_started_at = x.reconcile_started_at,
                reconcile_asks = x.reconcile_asks,
                retrying_unknown = x.retrying_unknown,
                -- Left as they are when a write does not send them.
                spent = COALESCE(x.spent, o.spent),
                attempt_spend = COALESCE(x.attempt_spend, o.attempt_spend),
                peak_spend = COALESCE(x.peak_spend, o.peak_spend),
                updated_at = now()
            FROM unnest(v_ops_ids, v_ops) AS u(id, rows),
                 jsonb_populate_recordset(NULL::saga.operations, u.rows) AS x
            WHERE o.saga_id = ANY(v_ops_ids)
              AND o.saga_id = u.id AND o.kind = x.kind AND o.step = x.step;
        END IF;

        IF v_ev_ids IS NOT NULL THEN
            INSERT INTO saga.events (saga_id, event, step, kind, attempt, detail)
            SELECT u.id, x.event, x.step, x.kind, x.attempt, COALESCE(x.detail, '{}'::jsonb)
            FROM unnest(v_ev_ids, v_events) WITH ORDINALITY AS u(id, rows, k),
                 jsonb_populate_recordset(NULL::saga.events, u.rows) WITH ORDINALITY AS x
            ORDER BY u.k, x.ordinality;
        END IF;

        IF v_notify IS NOT NULL THEN
            PERFORM pg_notify('saga_runnable', t.payload)
            FROM unnest(v_notify) WITH ORDINALITY AS t(payload, k)
            ORDER BY t.k;
        END IF;

        IF v_ret_n IS NOT NULL THEN
            SELECT array_agg(u.n ORDER BY u.n),
                   array_agg(jsonb_build_object(
                       'saga', to_jsonb(s),
                       'operations', COALESCE((
                           SELECT jsonb_agg(to_jsonb(o) ORDER BY o.kind = 'compensation',
                                            CASE WHEN o.kind = 'action' THEN o.position
                                                 ELSE -o.position END)
                           FROM saga.operations AS o
                           WHERE o.saga_id = s.id), '[]'::jsonb)) ORDER BY u.n)
            INTO v_returned, v_states
            FROM unnest(v_ret_n, v_ret_ids) AS u(n, id)
            JOIN saga.sagas AS s ON s.id = u.id
            WHERE s.id = ANY(v_ret_ids);
        END IF;
    EXCEPTION WHEN OTHERS THEN
        -- Everything the set statements did is rolled back: the v1 way, write by write.
        RETURN saga.write_sagas_v1(p);
    END;

    IF v_routed IS NOT NULL THEN
        FOREACH v_n IN ARRAY v_routed LOOP
            BEGIN
                v_answer := jsonb_build_object(
                    'state', saga.write_saga_v4(p->(v_n - 1)::integer));
            EXCEPTION WHEN OTHERS THEN
                v_answer := jsonb_build_object('sqlstate', SQLSTATE, 'message', SQLERRM);
            END;
            v_answers := v_answers || v_answer;
        END LOOP;
    END IF;

    SELECT COALESCE(jsonb_agg(a.answer ORDER BY a.n), '[]'::jsonb)
    INTO v_out
    FROM (
        SELECT r.n, r.answer
        FROM unnest(v_routed, v_answers) AS r(n, answer)
        UNION ALL
        SELECT b.n,
               CASE WHEN b.n = ANY(v_written)
                    THEN jsonb_build_object('state', st.state)
                    -- write_saga_v4's refusal, its RAISE printing NULL as <NULL>
                    ELSE jsonb_build_object(
                        'sqlstate', 'SG001',
                        'message', format('lease of saga %s (fence %s) is no longer held by %s',
                                          COALESCE(b.id::text, '<NULL>'),
                                          COALESCE(b.w->>'fence', '<NULL>'),
                                          COALESCE(b.w->>'owner', '<NULL>')))
               END
        FROM unnest(v_set_n, v_set_ids, v_set_w) AS b(n, id, w)
        LEFT JOIN unnest(v_returned, v_states) AS st(n, state) ON st.n = b.n
    ) AS a(n, answer);
    RETURN v_out;
END
$$;
