-- Spend reported by step code (ctx.spend) is persisted as it is reported, so that money
-- spent before a crash is still counted after it:
--   attempt_spend  what the operation's running attempt has reported so far, written by
--                  each ctx.spend() call (query report_spend), not yet counted in the
--                  saga's spent; the write that records the attempt's outcome counts it
--                  and sets it back to 0
--   spent          the reported spend of all of the operation's attempts, counted
--   peak_spend     the most one attempt of it has reported: what its next attempt is
--                  expected to spend, checked against the saga's budget before it starts
--
-- saga.write_saga_v3 is saga.write_saga_v2 writing the three columns too (left as they are
-- when a write does not send them). saga.write_saga_v2, which the previous release calls,
-- is left unchanged (README, "Upgrades"); it writes none of them, so an attempt whose
-- outcome the previous release records keeps its reported spend uncounted in
-- attempt_spend. saga.write_saga_v2 is to be dropped one release after this one.

ALTER TABLE saga.operations
    ADD COLUMN spent         numeric NOT NULL DEFAULT 0,
    ADD COLUMN attempt_spend numeric NOT NULL DEFAULT 0,
    ADD COLUMN peak_spend    numeric NOT NULL DEFAULT 0;

CREATE FUNCTION saga.write_saga_v3(p jsonb) RETURNS jsonb
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
            write_token = (p->>'token')::uuid,
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
            -- Left as they are when a write does not send them.
            spent = COALESCE(x.spent, o.spent),
            attempt_spend = COALESCE(x.attempt_spend, o.attempt_spend),
            peak_spend = COALESCE(x.peak_spend, o.peak_spend),
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
