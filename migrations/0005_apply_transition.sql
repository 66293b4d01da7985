-- saga.apply_transition: one step transition of a lease holder as one statement (and so,
-- in autocommit, one transaction and one round trip): the fenced update of the saga row,
-- new and changed operations, audit events, an optional NOTIFY, and optionally the saga's
-- state as it now stands. The decisions are made in Python (saga.protocol); this only
-- writes them. A lease that is no longer the caller's raises SQLSTATE SG001 and nothing
-- is written.

-- saga.write_operations and saga.append_events are the one place where operation rows
-- are updated and audit events appended from a JSON array, for every write path
-- (PL/pgSQL rather than SQL functions, so that their plans are cached per session).

CREATE FUNCTION saga.write_operations(p_saga_id uuid, p_ops jsonb) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
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
    FROM jsonb_to_recordset(COALESCE(p_ops, '[]'::jsonb)) AS x(
        kind text, step text, status text, attempts integer, max_attempts integer,
        next_attempt_at timestamptz, result jsonb, provider_reference text, error text,
        started_at timestamptz, finished_at timestamptz, request_hash text, request jsonb,
        deadline_at timestamptz, cost numeric, reconcile_started_at timestamptz,
        reconcile_asks integer, retrying_unknown boolean)
    WHERE o.saga_id = p_saga_id AND o.kind = x.kind AND o.step = x.step;
END
$$;

CREATE FUNCTION saga.append_events(p_saga_id uuid, p_events jsonb) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO saga.events (saga_id, event, step, kind, attempt, detail)
    SELECT p_saga_id, x.event, x.step, x.kind, x.attempt, COALESCE(x.detail, '{}'::jsonb)
    FROM ROWS FROM (
             jsonb_to_recordset(COALESCE(p_events, '[]'::jsonb))
             AS (event text, step text, kind text, attempt integer, detail jsonb)
         ) WITH ORDINALITY AS x(event, step, kind, attempt, detail, n)
    ORDER BY x.n;
END
$$;

CREATE FUNCTION saga.apply_transition(p jsonb) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    v_id      uuid := (p->>'saga_id')::uuid;
    v_saga    jsonb := p->'saga';
    v_release boolean := (p->>'release')::boolean;
    v_state   jsonb;
BEGIN
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
        lease_expires_at = CASE
            WHEN v_release THEN NULL
            ELSE GREATEST(lease_expires_at,
                          now() + make_interval(secs => (p->>'lease_seconds')::double precision),
                          (p->>'lease_until')::timestamptz)
        END,
        updated_at = now()
    WHERE id = v_id AND fence = (p->>'fence')::bigint AND lease_owner = p->>'owner';
    IF NOT FOUND THEN
        RAISE EXCEPTION 'lease of saga % (fence %) is no longer held by %',
            v_id, p->>'fence', p->>'owner'
            USING ERRCODE = 'SG001';
    END IF;

    INSERT INTO saga.operations (saga_id, step, kind, position, idempotency_key,
                                 request_hash, status, attempts, max_attempts)
    SELECT v_id, x.step, x.kind, x.position, x.idempotency_key, x.request_hash, x.status,
           x.attempts, x.max_attempts
    FROM jsonb_to_recordset(COALESCE(p->'new_ops', '[]'::jsonb)) AS x(
        step text, kind text, position integer, idempotency_key text, request_hash text,
        status text, attempts integer, max_attempts integer);

    PERFORM saga.write_operations(v_id, p->'ops');

    PERFORM saga.append_events(v_id, p->'events');

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
