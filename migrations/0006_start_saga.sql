-- saga.start_saga: create a saga instance with its operations and first audit events in
-- one statement (one round trip), idempotently on (tenant, name, key). When the identity
-- exists already nothing is written and the existing saga's id, version and input hash
-- come back, for the caller's conflict check. A saga started to run at once comes leased
-- to its starter (fence 1) with its first attempt already recorded.

CREATE FUNCTION saga.start_saga(p jsonb) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    s        jsonb := p->'saga';
    v_id     uuid := (s->>'id')::uuid;
    v_result jsonb;
BEGIN
    INSERT INTO saga.sagas (id, name, version, tenant_id, key, input, input_hash, status,
                            direction, error, lease_owner, lease_expires_at, fence,
                            max_operations, deadline_at, spend_budget, max_side_effects,
                            operations_executed, spent, side_effects)
    VALUES (v_id, s->>'name', (s->>'version')::integer, s->>'tenant_id', s->>'key',
            s->'input', s->>'input_hash', s->>'status', s->>'direction', s->>'error',
            s->>'lease_owner',
            CASE WHEN s->>'lease_owner' IS NULL THEN NULL
                 ELSE now() + make_interval(secs => (p->>'lease_seconds')::double precision)
            END,
            (s->>'fence')::bigint, (s->>'max_operations')::integer,
            (s->>'deadline_at')::timestamptz, (s->>'spend_budget')::numeric,
            (s->>'max_side_effects')::integer, (s->>'operations_executed')::integer,
            (s->>'spent')::numeric, (s->>'side_effects')::integer)
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

    INSERT INTO saga.operations (saga_id, step, kind, position, idempotency_key,
                                 request_hash, status, attempts, max_attempts,
                                 next_attempt_at, started_at, request, deadline_at, cost)
    SELECT v_id, x.step, x.kind, x.position, x.idempotency_key, x.request_hash, x.status,
           x.attempts, x.max_attempts, x.next_attempt_at, x.started_at, x.request,
           x.deadline_at, x.cost
    FROM jsonb_to_recordset(p->'ops') AS x(
        step text, kind text, position integer, idempotency_key text, request_hash text,
        status text, attempts integer, max_attempts integer, next_attempt_at timestamptz,
        started_at timestamptz, request jsonb, deadline_at timestamptz, cost numeric);

    PERFORM saga.append_events(v_id, p->'events');

    IF p->>'notify' IS NOT NULL THEN
        PERFORM pg_notify('saga_runnable', p->>'notify');
    END IF;
    RETURN v_result;
END
$$;
