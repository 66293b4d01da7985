-- run() of a saga its caller has just started claims it and records its first move in
-- one statement (saga.claim_started_v1), where a claim otherwise reads the saga first:
-- the caller planned that move from the rows its start wrote, and the statement applies
-- it only when the saga is still exactly those rows.
--
-- saga.start_saga_v3 is saga.start_saga_v2 (migration 0018) with one more key in p:
--   token   the start's write token, stored in write_token (absent or null: none)
-- Every later write of the saga either stores a token of its own (saga.write_saga_v2 and
-- after, migration 0010, which store NULL when given none) or takes the lease and grows
-- the fence (a claim, an operator's takeover). So a saga whose fence is still 0 and whose
-- write_token is still the start's has been neither claimed nor changed since the start.
--
-- saga.claim_started_v1(p) takes
--   saga_id        the saga
--   start_token    the token its start stored
--   owner          who claims it
--   lease_seconds  the lease to take
--   write          the first move, as saga.write_saga_v4 (migration 0013) takes it: fenced
--                  at fence 1 for `owner`
-- and when the saga is unclaimed and unchanged since that start (none of its operations
-- attempted either, whatever wrote them), takes its lease (fence 0 to 1) and applies the
-- write, both in this statement; it returns {"claimed": true, "state": what
-- write_saga_v4 returned}. Otherwise it writes nothing and returns
-- {"claimed": false}: the caller claims the saga as any other (reading it first).
--
-- Compatibility (README, "Upgrades"): new functions; nothing the previous release calls
-- changes. The previous release starts sagas through saga.start_saga_v2, whose rows have
-- no start token: run() of this release claims those the usual way.

CREATE FUNCTION saga.start_saga_v3(p jsonb) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    s        jsonb := p->'row';
    v_id     uuid := (s->>'id')::uuid;
    v_result jsonb;
BEGIN
    INSERT INTO saga.sagas (id, name, version, tenant_id, key, input, input_hash, status,
                            direction, error, lease_owner, lease_expires_at, fence,
                            max_operations, deadline_at, spend_budget, max_side_effects,
                            operations_executed, spent, side_effects, trace_context,
                            write_token)
    VALUES (v_id, s->>'name', (s->>'version')::integer, s->>'tenant_id', s->>'key',
            s->'input', s->>'input_hash', s->>'status', s->>'direction', s->>'error',
            s->>'lease_owner',
            CASE WHEN s->>'lease_owner' IS NULL THEN NULL
                 ELSE now() + make_interval(secs => (p->>'lease_seconds')::double precision)
            END,
            (s->>'fence')::bigint, (s->>'max_operations')::integer,
            (s->>'deadline_at')::timestamptz, (s->>'spend_budget')::numeric,
            (s->>'max_side_effects')::integer, (s->>'operations_executed')::integer,
            (s->>'spent')::numeric, (s->>'side_effects')::integer,
            CASE WHEN jsonb_typeof(s->'trace_context') = 'object' THEN s->'trace_context' END,
            (p->>'token')::uuid)
    ON CONFLICT ON CONSTRAINT sagas_identity DO NOTHING
    RETURNING jsonb_build_object('created', true, 'run_after', run_after,
                                 'created_at', created_at, 'updated_at', updated_at)
    INTO v_result;

    IF v_result IS NULL THEN
        SELECT jsonb_build_object('created', false, 'id', id, 'version', version,
                                  'input_hash', input_hash)
        INTO v_result
        FROM saga.sagas
        WHERE tenant_id = s->>'tenant_id' AND name = s->>'name' AND key = s->>'key';
        RETURN v_result;
    END IF;

    PERFORM saga.write_saga(p - 'row' - 'saga' - 'token' || jsonb_build_object('saga_id', v_id));
    RETURN v_result;
END
$$;

CREATE FUNCTION saga.claim_started_v1(p jsonb) RETURNS jsonb
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE saga.sagas AS s
    SET lease_owner = p->>'owner',
        lease_expires_at = now() + make_interval(secs => (p->>'lease_seconds')::double precision),
        fence = 1,
        updated_at = now()
    WHERE s.id = (p->>'saga_id')::uuid
      AND s.fence = 0
      AND s.write_token = (p->>'start_token')::uuid
      AND s.status = 'pending'
      AND s.lease_owner IS NULL
      -- No operation touched since (by anything but saga.write_saga*, which would have
      -- replaced the token): a start leaves each one pending, never attempted.
      AND NOT EXISTS (SELECT 1
                      FROM saga.operations AS o
                      WHERE o.saga_id = s.id AND (o.status <> 'pending' OR o.attempts <> 0));
    IF NOT FOUND THEN
        RETURN jsonb_build_object('claimed', false);
    END IF;
    RETURN jsonb_build_object('claimed', true, 'state', saga.write_saga_v4(p->'write'));
END
$$;
