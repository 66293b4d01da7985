-- saga.write_saga: the one statement that writes a saga's decisions, for every write path
-- (a step transition, a claim's first move, an operator's change, a saga's creation). It
-- replaces saga.apply_transition and the two functions it called, saga.write_operations
-- and saga.append_events: a transition is now three statements inside one function call
-- (the saga row, its operations, its events) instead of seven, each of which paid for its
-- own executor start, and parts with nothing to write are skipped.
--
-- p is a JSON object; a missing key reads as NULL:
--   saga_id       the saga
--   saga          its new columns (status, direction, error, counters, ceilings,
--                 deadline_at, run_after); absent when the row itself is not rewritten
--   owner, fence  the lease holder's fence: the write fails with SQLSTATE SG001, and
--                 nothing is written, unless the saga is still leased to owner at fence.
--                 Absent for an operator's change, made under the row's lock instead.
--   lease_seconds renew the lease until now() + this (lease holders)
--   lease_until   keep the lease at least until then (a short backoff waited out)
--   release       end the lease
--   new_ops       operation rows to create, every column given
--   ops           operation rows to update: kind, step and their mutable columns
--   events        audit events to append, in order
--   notify        name:version to announce on the saga_runnable channel at commit
--   return_state  return the saga with its operations as they now stand

CREATE FUNCTION saga.write_saga(p jsonb) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    v_id      uuid := (p->>'saga_id')::uuid;
    v_saga    jsonb := p->'saga';
    v_owner   text := p->>'owner';
    v_release boolean := COALESCE((p->>'release')::boolean, false);
    v_state   jsonb;
BEGIN
    IF v_saga IS NOT NULL THEN
        UPDATE saga.sagas
        SET status = v_saga->>'status',
            direction = v_saga->>'direction',
            error = v_saga->>'error',
            operations_executed = (v_saga->>'operations_executed')::integer,
            spent = (v_saga->>'spent')::numeric,
            side_effects = (v_saga->>'side_effects')::integer,
            max_operations = (v_saga->>'max_operations')::integer,
            spend_budget = (v_saga->>'spend_budget')::numeric,
            max_side_effects = (v_saga->>'max_side_effects')::integer,
            deadline_at = (v_saga->>'deadline_at')::timestamptz,
            finished_at = CASE WHEN v_saga->>'status' IN ('completed', 'compensated')
                               THEN COALESCE(finished_at, now()) END,
            run_after = COALESCE((v_saga->>'run_after')::timestamptz, run_after),
            lease_owner = CASE WHEN v_release THEN NULL ELSE lease_owner END,
            -- GREATEST ignores NULLs: without lease_seconds or lease_until, unchanged.
            lease_expires_at = CASE
                WHEN v_release THEN NULL
                ELSE GREATEST(lease_expires_at,
                              now() + make_interval(
                                  secs => (p->>'lease_seconds')::double precision),
                              (p->>'lease_until')::timestamptz)
            END,
            updated_at = now()
        WHERE id = v_id
          AND (v_owner IS NULL OR (fence = (p->>'fence')::bigint AND lease_owner = v_owner));
        IF NOT FOUND THEN
            RAISE EXCEPTION 'lease of saga % (fence %) is no longer held by %',
                v_id, p->>'fence', v_owner
                USING ERRCODE = 'SG001';
        END IF;
    END IF;

    -- jsonb_array_length of a missing array is NULL, and the branch is skipped.
    IF jsonb_array_length(p->'new_ops') > 0 THEN
        INSERT INTO saga.operations (
            saga_id, step, kind, position, idempotency_key, request_hash, status, attempts,
            max_attempts, next_attempt_at, result, provider_reference, error, started_at,
            finished_at, request, deadline_at, cost, reconcile_started_at, reconcile_asks,
            retrying_unknown)
        SELECT v_id, x.step, x.kind, x.position, x.idempotency_key, x.request_hash, x.status,
               x.attempts, x.max_attempts, x.next_attempt_at, x.result, x.provider_reference,
               x.error, x.started_at, x.finished_at, x.request, x.deadline_at, x.cost,
               x.reconcile_started_at, x.reconcile_asks, x.retrying_unknown
        FROM jsonb_populate_recordset(NULL::saga.operations, p->'new_ops') AS x;
    END IF;

    IF jsonb_array_length(p->'ops') > 0 THEN
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
            updated_at = now()
        FROM jsonb_populate_recordset(NULL::saga.operations, p->'ops') AS x
        WHERE o.saga_id = v_id AND o.kind = x.kind AND o.step = x.step;
    END IF;

    IF jsonb_array_length(p->'events') > 0 THEN
        INSERT INTO saga.events (saga_id, event, step, kind, attempt, detail)
        SELECT v_id, x.event, x.step, x.kind, x.attempt, COALESCE(x.detail, '{}'::jsonb)
        FROM jsonb_populate_recordset(NULL::saga.events, p->'events') WITH ORDINALITY AS x
        ORDER BY x.ordinality;
    END IF;

    IF p->>'notify' IS NOT NULL THEN
        PERFORM pg_notify('saga_runnable', p->>'notify');
    END IF;

    IF (p->>'return_state')::boolean THEN
        SELECT jsonb_build_object(
                   'saga', to_jsonb(s),
                   'operations', COALESCE((
                       SELECT jsonb_agg(to_jsonb(o) ORDER BY o.kind = 'compensation',
                                        CASE WHEN o.kind = 'action' THEN o.position
                                             ELSE -o.position END)
                       FROM saga.operations AS o
                       WHERE o.saga_id = v_id), '[]'::jsonb))
        INTO v_state
        FROM saga.sagas AS s
        WHERE s.id = v_id;
    END IF;
    RETURN v_state;
END
$$;

-- saga.start_saga: create a saga instance idempotently on (tenant, name, key): its row
-- from p->'row', then its operations and first events through saga.write_saga (p without
-- 'saga', so the new row is not rewritten). When the identity exists already nothing is
-- written and the existing saga's id, version and input hash come back, for the caller's
-- conflict check. A saga started to run at once comes leased to its starter (fence 1)
-- with its first attempt already recorded.

DROP FUNCTION saga.start_saga(jsonb);

CREATE FUNCTION saga.start_saga(p jsonb) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    s        jsonb := p->'row';
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

    PERFORM saga.write_saga(p - 'row' - 'saga' || jsonb_build_object('saga_id', v_id));
    RETURN v_result;
END
$$;

DROP FUNCTION saga.apply_transition(jsonb);
DROP FUNCTION saga.write_operations(uuid, jsonb);
DROP FUNCTION saga.append_events(uuid, jsonb);
