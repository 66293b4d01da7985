-- Traces (saga.telemetry): the W3C trace context of the code that started a saga is kept
-- on its row, so that whichever worker drives it, in whatever process and after however
-- many crashes, continues the trace of the request that started it. The column holds the
-- propagation headers as JSON ({"traceparent": "00-...", "tracestate": "..."}); it is
-- NULL when the starter had no span (or no OpenTelemetry at all), and nothing but the
-- telemetry reads it.
--
-- saga.start_saga_v2 is saga.start_saga (migration 0008) with one more key in p->'row':
--   trace_context  the W3C trace context to store (absent or null: none)
-- written by the same INSERT, so a traced start costs what an untraced one does.
--
-- Compatibility (README, "Upgrades"): one nullable column and a new function; nothing the
-- previous release calls changes. The previous release starts sagas through
-- saga.start_saga, which leaves the column NULL (its sagas are traced from the worker's
-- span on), reads sagas by column name (SELECT * and claim_next's rows carry the column,
-- which it ignores), and never writes it.

ALTER TABLE saga.sagas ADD COLUMN trace_context jsonb;

CREATE FUNCTION saga.start_saga_v2(p jsonb) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    s        jsonb := p->'row';
    v_id     uuid := (s->>'id')::uuid;
    v_result jsonb;
BEGIN
    INSERT INTO saga.sagas (id, name, version, tenant_id, key, input, input_hash, status,
                            direction, error, lease_owner, lease_expires_at, fence,
                            max_operations, deadline_at, spend_budget, max_side_effects,
                            operations_executed, spent, side_effects, trace_context)
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
            CASE WHEN jsonb_typeof(s->'trace_context') = 'object' THEN s->'trace_context' END)
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

    PERFORM saga.write_saga(p - 'row' - 'saga' || jsonb_build_object('saga_id', v_id));
    RETURN v_result;
END
$$;
