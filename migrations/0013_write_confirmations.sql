-- One write statement per transition, confirmations included: saga.write_saga_v4 is
-- saga.write_saga_v3 (0011) that also asks for, approves or uses up confirmations, given
-- as `confirmations`: [{action: ask | approve | consume, step, request_hash, preview,
-- expires_at, actor, attempt}], after the fenced saga write. What it refuses (an approval
-- that expired, or that has released an attempt already) fails the statement, and the
-- transaction with it, with SQLSTATE SG002 and the reason as the message. Before, those
-- were statements of their own, sent in a pipeline after the write.
--
-- Compatibility (README, "Upgrades"): a new function; saga.write_saga_v3 and the
-- confirmation queries, which the previous release calls, are left unchanged.

CREATE FUNCTION saga.write_saga_v4(p jsonb) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    v_id      uuid := (p->>'saga_id')::uuid;
    v_saga    jsonb := p->'saga';
    v_owner   text := p->>'owner';
    v_release boolean := COALESCE((p->>'release')::boolean, false);
    v_state   jsonb;
    v_c       jsonb;
    v_what    text;
    v_found   record;
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

    -- Confirmations, after the fenced saga write: a lost lease has failed the statement
    -- before any of them is written.
    FOR v_c IN SELECT value FROM jsonb_array_elements(COALESCE(p->'confirmations', '[]'))
    LOOP
        v_what := format('the approval of step ''%s'' (request %s)',
                         v_c->>'step', left(v_c->>'request_hash', 12));
        IF v_c->>'action' = 'ask' THEN
            -- Ask (again): a new ask renews the preview and expiry, and withdraws any
            -- earlier approval of it (used up or not).
            INSERT INTO saga.confirmations (saga_id, step, request_hash, preview, expires_at)
            VALUES (v_id, v_c->>'step', v_c->>'request_hash', v_c->'preview',
                    (v_c->>'expires_at')::timestamptz)
            ON CONFLICT (saga_id, step, request_hash) DO UPDATE
            SET preview = EXCLUDED.preview,
                requested_at = now(),
                expires_at = EXCLUDED.expires_at,
                approved_by = NULL,
                approved_at = NULL,
                consumed_attempt = NULL,
                consumed_at = NULL;
        ELSIF v_c->>'action' = 'approve' THEN
            UPDATE saga.confirmations
            SET approved_by = v_c->>'actor', approved_at = now()
            WHERE saga_id = v_id AND step = v_c->>'step'
              AND request_hash = v_c->>'request_hash'
              AND approved_at IS NULL AND expires_at > now();
            IF NOT FOUND THEN  -- expired meanwhile, by the database clock
                RAISE EXCEPTION 'the confirmation of step ''%'' is no longer pending',
                    v_c->>'step' USING ERRCODE = 'SG002';
            END IF;
        ELSIF v_c->>'action' = 'consume' THEN
            -- One approval, one attempt, whatever a stale snapshot believes (0012).
            UPDATE saga.confirmations
            SET consumed_attempt = (v_c->>'attempt')::integer, consumed_at = now()
            WHERE saga_id = v_id AND step = v_c->>'step'
              AND request_hash = v_c->>'request_hash'
              AND approved_at IS NOT NULL AND consumed_attempt IS NULL;
            IF NOT FOUND THEN
                SELECT c.approved_at IS NOT NULL AS approved, c.consumed_attempt AS released
                INTO v_found
                FROM saga.confirmations AS c
                WHERE c.saga_id = v_id AND c.step = v_c->>'step'
                  AND c.request_hash = v_c->>'request_hash';
                IF v_found.released IS NOT NULL THEN
                    v_what := format('%s already released attempt %s', v_what, v_found.released);
                ELSIF v_found.approved THEN
                    v_what := v_what || ' was used up meanwhile';
                ELSE
                    v_what := v_what || ' is not approved (any more)';
                END IF;
                RAISE EXCEPTION '%: one approval releases one attempt, so attempt % is not started',
                    v_what, v_c->>'attempt' USING ERRCODE = 'SG002';
            END IF;
        ELSE
            RAISE EXCEPTION 'unknown confirmation action %', v_c->>'action';
        END IF;
    END LOOP;

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
