-- The ledger: operations claimed one by one by callers that own their control flow (an
-- agent loop, another engine's activity), on the same operations table as sagas and
-- sessions.
--
-- A ledger channel is a saga row named 'ledger/channel' whose key is the channel. Its
-- calls are action operations, each with a lease of its own: several calls of one
-- channel can be in flight at once, held by different processes, so the fence of a call
-- lives on its operation row (claim_fence) rather than on the saga row. Every write of a
-- holder names the fence it was given; once another holder has taken the call over (its
-- lease expired), the fence has grown and the old holder's writes fail with SQLSTATE
-- SG001, as a saga's lease holder's do.
--
-- Both functions lock the channel's saga row first (FOR NO KEY UPDATE, which operators'
-- FOR UPDATE also waits for), then the operation's: one order, no deadlock.
--
-- Compatibility (README, "Upgrades"): three columns with defaults, two functions. The
-- previous release reads operation rows whole and ignores the columns it does not know;
-- it never claims a channel (its name is no declared saga's).

ALTER TABLE saga.operations
    ADD COLUMN claim_owner      text,
    ADD COLUMN claim_fence      bigint NOT NULL DEFAULT 0,
    ADD COLUMN claim_expires_at timestamptz,
    -- What the attempt before the one in flight ended as: NULL (none), 'unknown' (its
    -- holder's lease expired, or it said so) or 'failed' (a transient failure).
    ADD COLUMN claim_previous   text CHECK (claim_previous IN ('unknown', 'failed'));

-- saga.ledger_claim: claim the call p_step of the channel (created when new) for p_owner.
--
-- Returns one row whose verdict is:
--   claimed      a new call, or the retry of one that failed transiently: call it
--   reclaimed    the previous holder's outcome is unknown (its lease expired, or it said
--                so): reconcile with the provider, or retry with the same key
--   replayed     the call succeeded before: result holds what it returned
--   in_progress  a live holder has it (holder, expires_at)
--   failed       the call failed for good (error)
--   conflict     the key was claimed with another request hash (request_hash: that one)
--   closed       the channel is no longer open (saga_status), so nothing new runs in it
--   parked       the channel waits for a human (error names the call); the call's own
--                unknown outcome can still be reclaimed, nothing else
--   exhausted    the call's attempts reached its ceiling without an outcome: it is now
--                unknown and the channel parked
-- A claim whose reply was lost and is sent again by the same p_owner finds its own claim
-- and gets the same verdict and fence again.
CREATE FUNCTION saga.ledger_claim(
    p_tenant text, p_name text, p_channel text, p_new_id uuid, p_input_hash text,
    p_step text, p_idempotency_key text, p_request_hash text, p_request jsonb,
    p_owner text, p_lease_seconds double precision, p_max_attempts integer
) RETURNS TABLE (
    verdict text, saga_id uuid, fence bigint, attempt integer, max_attempts integer,
    result jsonb, provider_reference text, error text, previous text, holder text,
    expires_at timestamptz, request_hash text, saga_status text
)
LANGUAGE plpgsql
AS $$
DECLARE
    v_saga saga.sagas;
    v_op saga.operations;
    v_position integer;
    v_previous text;
    v_why text;
BEGIN
    INSERT INTO saga.sagas (id, name, version, tenant_id, key, input, input_hash, status)
    VALUES (p_new_id, p_name, 1, p_tenant, p_channel, '{}'::jsonb, p_input_hash, 'running')
    ON CONFLICT ON CONSTRAINT sagas_identity DO NOTHING;
    IF FOUND THEN
        INSERT INTO saga.events (saga_id, event, detail)
        VALUES (p_new_id, 'saga_started', jsonb_build_object('ledger', true));
    END IF;
    SELECT * INTO v_saga FROM saga.sagas s
    WHERE s.tenant_id = p_tenant AND s.name = p_name AND s.key = p_channel
    FOR NO KEY UPDATE;

    SELECT * INTO v_op FROM saga.operations o
    WHERE o.idempotency_key = p_idempotency_key
    FOR UPDATE;

    IF NOT FOUND THEN
        IF v_saga.status = 'needs_review' THEN
            RETURN QUERY SELECT 'parked', v_saga.id, 0::bigint, 0, 0, NULL::jsonb, NULL::text,
                v_saga.error, NULL::text, NULL::text, NULL::timestamptz, NULL::text,
                v_saga.status;
            RETURN;
        END IF;
        IF v_saga.status NOT IN ('pending', 'running') OR v_saga.direction <> 'forward' THEN
            RETURN QUERY SELECT 'closed', v_saga.id, 0::bigint, 0, 0, NULL::jsonb, NULL::text,
                v_saga.error, NULL::text, NULL::text, NULL::timestamptz, NULL::text,
                v_saga.status;
            RETURN;
        END IF;
        SELECT count(*) INTO v_position
        FROM saga.operations o WHERE o.saga_id = v_saga.id AND o.kind = 'action';
        INSERT INTO saga.operations AS o (
            saga_id, step, kind, position, idempotency_key, request_hash, status, attempts,
            max_attempts, request, started_at, claim_owner, claim_fence, claim_expires_at)
        VALUES (
            v_saga.id, p_step, 'action', v_position, p_idempotency_key, p_request_hash,
            'running', 1, p_max_attempts, p_request, now(), p_owner, 1,
            now() + make_interval(secs => p_lease_seconds))
        RETURNING * INTO v_op;
        INSERT INTO saga.events (saga_id, event, step, kind, attempt, detail)
        VALUES (v_saga.id, 'attempt_started', p_step, 'action', 1,
                jsonb_build_object('ledger', true, 'owner', p_owner, 'fence', 1));
        UPDATE saga.sagas s SET updated_at = now() WHERE s.id = v_saga.id;
        RETURN QUERY SELECT 'claimed', v_saga.id, v_op.claim_fence, v_op.attempts,
            v_op.max_attempts, NULL::jsonb, NULL::text, NULL::text, NULL::text, NULL::text,
            v_op.claim_expires_at, v_op.request_hash, v_saga.status;
        RETURN;
    END IF;

    IF v_op.saga_id <> v_saga.id OR v_op.kind <> 'action' THEN
        RAISE EXCEPTION 'idempotency key % belongs to another saga''s operation',
            p_idempotency_key USING ERRCODE = 'SG002';
    END IF;
    IF v_op.request_hash <> p_request_hash THEN
        RETURN QUERY SELECT 'conflict', v_saga.id, v_op.claim_fence, v_op.attempts,
            v_op.max_attempts, NULL::jsonb, NULL::text, NULL::text, NULL::text, NULL::text,
            NULL::timestamptz, v_op.request_hash, v_saga.status;
        RETURN;
    END IF;
    IF v_op.status = 'succeeded' THEN
        RETURN QUERY SELECT 'replayed', v_saga.id, v_op.claim_fence, v_op.attempts,
            v_op.max_attempts, v_op.result, v_op.provider_reference, NULL::text,
            NULL::text, NULL::text, NULL::timestamptz, v_op.request_hash, v_saga.status;
        RETURN;
    END IF;
    IF v_op.status = 'failed' THEN
        RETURN QUERY SELECT 'failed', v_saga.id, v_op.claim_fence, v_op.attempts,
            v_op.max_attempts, NULL::jsonb, NULL::text, v_op.error, NULL::text, NULL::text,
            NULL::timestamptz, v_op.request_hash, v_saga.status;
        RETURN;
    END IF;
    IF v_op.status = 'running' AND v_op.claim_owner = p_owner THEN
        -- This claim landed before and its reply was lost: the same claim again.
        RETURN QUERY SELECT CASE WHEN v_op.claim_previous = 'unknown' THEN 'reclaimed'
                                 ELSE 'claimed' END,
            v_saga.id, v_op.claim_fence, v_op.attempts, v_op.max_attempts, NULL::jsonb,
            NULL::text, v_op.error, v_op.claim_previous, NULL::text, v_op.claim_expires_at,
            v_op.request_hash, v_saga.status;
        RETURN;
    END IF;
    IF v_op.status = 'running' AND v_op.claim_expires_at > now() THEN
        RETURN QUERY SELECT 'in_progress', v_saga.id, v_op.claim_fence, v_op.attempts,
            v_op.max_attempts, NULL::jsonb, NULL::text, NULL::text, NULL::text,
            v_op.claim_owner, v_op.claim_expires_at, v_op.request_hash, v_saga.status;
        RETURN;
    END IF;

    -- No live holder, no outcome: running with an expired lease, unknown, or pending
    -- after a transient failure.
    IF v_saga.status NOT IN ('pending', 'running', 'needs_review')
            OR v_saga.direction <> 'forward' THEN
        RETURN QUERY SELECT 'closed', v_saga.id, v_op.claim_fence, v_op.attempts,
            v_op.max_attempts, NULL::jsonb, NULL::text, v_saga.error, NULL::text, NULL::text,
            NULL::timestamptz, v_op.request_hash, v_saga.status;
        RETURN;
    END IF;
    -- A parked channel lets its unknown calls be reclaimed (to be reconciled), nothing else.
    IF v_saga.status = 'needs_review' AND v_op.status <> 'unknown' THEN
        RETURN QUERY SELECT 'parked', v_saga.id, v_op.claim_fence, v_op.attempts,
            v_op.max_attempts, NULL::jsonb, NULL::text, v_saga.error, NULL::text, NULL::text,
            NULL::timestamptz, v_op.request_hash, v_saga.status;
        RETURN;
    END IF;
    v_previous := CASE WHEN v_op.status = 'pending' THEN 'failed' ELSE 'unknown' END;
    IF v_op.status = 'running' THEN
        v_why := format('the lease of %s (attempt %s) expired before it recorded an outcome',
                        v_op.claim_owner, v_op.attempts);
        INSERT INTO saga.events (saga_id, event, step, kind, attempt, detail)
        VALUES (v_saga.id, 'outcome_unknown', v_op.step, 'action', v_op.attempts,
                jsonb_build_object('ledger', true, 'error', v_why, 'owner', v_op.claim_owner));
    ELSE
        v_why := v_op.error;
    END IF;
    IF v_op.attempts >= v_op.max_attempts THEN
        v_why := format('call %s: %s attempts of %s ended without an outcome (last: %s)',
                        v_op.step, v_op.attempts, v_op.max_attempts, v_why);
        UPDATE saga.operations o
        SET status = 'unknown', error = v_why, claim_expires_at = NULL, updated_at = now()
        WHERE o.saga_id = v_op.saga_id AND o.kind = 'action' AND o.step = v_op.step;
        UPDATE saga.sagas s
        SET status = 'needs_review', error = v_why, updated_at = now()
        WHERE s.id = v_saga.id;
        INSERT INTO saga.events (saga_id, event, step, kind, attempt, detail)
        VALUES (v_saga.id, 'saga_parked', v_op.step, 'action', v_op.attempts,
                jsonb_build_object('ledger', true, 'error', v_why));
        RETURN QUERY SELECT 'exhausted', v_saga.id, v_op.claim_fence, v_op.attempts,
            v_op.max_attempts, NULL::jsonb, NULL::text, v_why, v_previous, NULL::text,
            NULL::timestamptz, v_op.request_hash, 'needs_review'::text;
        RETURN;
    END IF;

    UPDATE saga.operations o
    SET status = 'running', attempts = o.attempts + 1, claim_owner = p_owner,
        claim_fence = o.claim_fence + 1, claim_previous = v_previous,
        claim_expires_at = now() + make_interval(secs => p_lease_seconds),
        error = v_why, started_at = now(), finished_at = NULL, updated_at = now()
    WHERE o.saga_id = v_op.saga_id AND o.kind = 'action' AND o.step = v_op.step
    RETURNING * INTO v_op;
    INSERT INTO saga.events (saga_id, event, step, kind, attempt, detail)
    VALUES (v_saga.id, 'attempt_started', v_op.step, 'action', v_op.attempts,
            jsonb_build_object('ledger', true, 'owner', p_owner, 'fence', v_op.claim_fence,
                               'previous', v_previous));
    IF v_saga.status = 'needs_review' AND NOT EXISTS (
            SELECT 1 FROM saga.operations o
            WHERE o.saga_id = v_saga.id AND o.status = 'unknown') THEN
        UPDATE saga.sagas s SET status = 'running', error = NULL, updated_at = now()
        WHERE s.id = v_saga.id;
        v_saga.status := 'running';
    ELSE
        UPDATE saga.sagas s SET updated_at = now() WHERE s.id = v_saga.id;
    END IF;
    RETURN QUERY SELECT CASE WHEN v_previous = 'unknown' THEN 'reclaimed' ELSE 'claimed' END,
        v_saga.id, v_op.claim_fence, v_op.attempts, v_op.max_attempts, NULL::jsonb, NULL::text,
        v_why, v_previous, NULL::text, v_op.claim_expires_at, v_op.request_hash,
        v_saga.status;
END
$$;

-- saga.ledger_settle: the holder of a claim (p_owner, p_fence) records what its call did,
-- or extends its lease. p_outcome is one of:
--   succeeded  the result (and the provider's reference)
--   failed     failed for good (p_error)
--   retry      failed transiently: the next claim retries it, unless its attempts reached
--              the ceiling, and then it failed for good
--   unknown    the holder cannot tell (p_error): the channel parks until the call is
--              reclaimed (and reconciled) or an operator resolves it
--   heartbeat  the lease is extended by p_lease_seconds
-- Raises SG001 when the claim is no longer the caller's (another holder took it over, or an
-- operator settled the call), and changes nothing. A settle whose reply was lost and is
-- sent again finds its own write and returns 'landed'.
CREATE FUNCTION saga.ledger_settle(
    p_saga_id uuid, p_step text, p_owner text, p_fence bigint, p_outcome text,
    p_result jsonb, p_provider_reference text, p_error text, p_lease_seconds double precision
) RETURNS TABLE (verdict text, status text, attempt integer, expires_at timestamptz)
LANGUAGE plpgsql
AS $$
DECLARE
    v_saga saga.sagas;
    v_op saga.operations;
    v_status text;
    v_error text := p_error;
BEGIN
    SELECT * INTO v_saga FROM saga.sagas s WHERE s.id = p_saga_id FOR NO KEY UPDATE;
    SELECT * INTO v_op FROM saga.operations o
    WHERE o.saga_id = p_saga_id AND o.kind = 'action' AND o.step = p_step
    FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'call % of channel % no longer exists', p_step, p_saga_id
            USING ERRCODE = 'SG001';
    END IF;
    IF v_op.claim_fence <> p_fence OR v_op.claim_owner IS DISTINCT FROM p_owner THEN
        RAISE EXCEPTION 'the claim of call % (fence %) was taken over by % (fence %); '
            'nothing was recorded', p_step, p_fence, v_op.claim_owner, v_op.claim_fence
            USING ERRCODE = 'SG001';
    END IF;
    IF v_op.status <> 'running' THEN
        IF (p_outcome = 'succeeded' AND v_op.status = 'succeeded'
                AND v_op.result IS NOT DISTINCT FROM p_result)
           OR (p_outcome = 'failed' AND v_op.status = 'failed')
           OR (p_outcome = 'retry' AND v_op.status IN ('pending', 'failed'))
           OR (p_outcome = 'unknown' AND v_op.status = 'unknown') THEN
            RETURN QUERY SELECT 'landed', v_op.status, v_op.attempts, NULL::timestamptz;
            RETURN;
        END IF;
        RAISE EXCEPTION 'call % is % now (settled outside this claim); nothing was recorded',
            p_step, v_op.status USING ERRCODE = 'SG001';
    END IF;

    IF p_outcome = 'heartbeat' THEN
        UPDATE saga.operations o
        SET claim_expires_at = now() + make_interval(secs => p_lease_seconds)
        WHERE o.saga_id = p_saga_id AND o.kind = 'action' AND o.step = p_step
        RETURNING * INTO v_op;
        RETURN QUERY SELECT 'extended', v_op.status, v_op.attempts, v_op.claim_expires_at;
        RETURN;
    END IF;

    v_status := CASE p_outcome
        WHEN 'succeeded' THEN 'succeeded'
        WHEN 'failed' THEN 'failed'
        WHEN 'unknown' THEN 'unknown'
        WHEN 'retry' THEN CASE WHEN v_op.attempts >= v_op.max_attempts THEN 'failed'
                               ELSE 'pending' END
    END;
    IF v_status IS NULL THEN
        RAISE EXCEPTION 'unknown ledger outcome %', p_outcome USING ERRCODE = 'SG002';
    END IF;
    IF p_outcome = 'retry' AND v_status = 'failed' THEN
        v_error := format('gave up after %s attempts: %s', v_op.attempts, p_error);
    END IF;
    UPDATE saga.operations o
    SET status = v_status,
        result = CASE WHEN v_status = 'succeeded' THEN p_result END,
        provider_reference = CASE WHEN v_status = 'succeeded' THEN p_provider_reference END,
        error = CASE WHEN v_status = 'succeeded' THEN NULL ELSE v_error END,
        finished_at = CASE WHEN v_status IN ('succeeded', 'failed') THEN now() END,
        claim_expires_at = NULL,
        updated_at = now()
    WHERE o.saga_id = p_saga_id AND o.kind = 'action' AND o.step = p_step;
    INSERT INTO saga.events (saga_id, event, step, kind, attempt, detail)
    VALUES (p_saga_id,
            CASE v_status WHEN 'succeeded' THEN 'attempt_succeeded'
                          WHEN 'unknown' THEN 'outcome_unknown'
                          ELSE 'attempt_failed' END,
            p_step, 'action', v_op.attempts,
            jsonb_strip_nulls(jsonb_build_object(
                'ledger', true, 'owner', p_owner, 'error', v_error,
                'provider_reference', p_provider_reference,
                'permanent', CASE WHEN v_status = 'failed' THEN true
                                  WHEN v_status = 'pending' THEN false END)));
    IF v_status = 'unknown' THEN
        UPDATE saga.sagas s
        SET status = 'needs_review',
            error = format('%s: outcome unknown: %s', p_step, p_error),
            updated_at = now()
        WHERE s.id = p_saga_id AND s.status IN ('pending', 'running', 'needs_review');
        INSERT INTO saga.events (saga_id, event, step, kind, attempt, detail)
        VALUES (p_saga_id, 'saga_parked', p_step, 'action', v_op.attempts,
                jsonb_build_object('ledger', true, 'error', p_error));
    ELSE
        UPDATE saga.sagas s SET updated_at = now() WHERE s.id = p_saga_id;
    END IF;
    RETURN QUERY SELECT 'recorded', v_status, v_op.attempts, NULL::timestamptz;
END
$$;

-- saga.ledger_close: end a channel whose calls are all settled: it becomes completed (and
-- is purged after the retention period like any finished saga); later claims in it are
-- refused. Returns 'closed', 'missing' (no such channel), 'already' (not open: its
-- status is returned), or 'unsettled' with the first call still in flight or unknown.
CREATE FUNCTION saga.ledger_close(p_tenant text, p_name text, p_channel text, p_actor text)
RETURNS TABLE (verdict text, saga_id uuid, saga_status text, step text, status text)
LANGUAGE plpgsql
AS $$
DECLARE
    v_saga saga.sagas;
    v_op saga.operations;
BEGIN
    SELECT * INTO v_saga FROM saga.sagas s
    WHERE s.tenant_id = p_tenant AND s.name = p_name AND s.key = p_channel
    FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'missing', NULL::uuid, NULL::text, NULL::text, NULL::text;
        RETURN;
    END IF;
    IF v_saga.status NOT IN ('pending', 'running', 'needs_review') THEN
        RETURN QUERY SELECT 'already', v_saga.id, v_saga.status, NULL::text, NULL::text;
        RETURN;
    END IF;
    SELECT * INTO v_op FROM saga.operations o
    WHERE o.saga_id = v_saga.id AND o.status IN ('running', 'unknown', 'pending')
    ORDER BY o.position LIMIT 1;
    IF FOUND THEN
        RETURN QUERY SELECT 'unsettled', v_saga.id, v_saga.status, v_op.step, v_op.status;
        RETURN;
    END IF;
    UPDATE saga.sagas s
    SET status = 'completed', error = NULL, finished_at = now(), updated_at = now()
    WHERE s.id = v_saga.id;
    INSERT INTO saga.events (saga_id, event, detail)
    VALUES (v_saga.id, 'saga_completed', jsonb_build_object('ledger', true, 'actor', p_actor));
    RETURN QUERY SELECT 'closed', v_saga.id, 'completed'::text, NULL::text, NULL::text;
END
$$;
