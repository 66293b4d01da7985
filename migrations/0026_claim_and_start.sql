-- saga.claim_batch_v2: a batch claim that also records, in the same statement, the first
-- move of each saga it takes when that move is to start the attempt of the next pending
-- step and nothing but the rows decides it. A worker then calls each such step right after
-- the claim's commit; every other saga it takes is claimed only, and the worker plans and
-- writes its first move as after saga.claim_batch (migration 0019).
--
-- It takes what saga.claim_batch takes, and
--   p_now              the time of the decision, on the worker's clock (the core reads no
--                      clock: an attempt's started_at is its driver's time, as when the
--                      worker writes it)
--   p_tokens           one write token per saga the claim may take: the i-th saga taken (in
--                      run_after, then id order) whose attempt is started stores p_tokens[i]
--   p_claim_tokens     likewise, stored by the i-th saga taken that is claimed only
--   p_start_kinds,     parallel arrays, one element per step the worker's core lets the
--   p_start_steps,     database start (name:version, step name, 1 when an attempt counts
--   p_start_side_effects,  as a side effect else 0, the step's deadline_seconds or NULL): a
--   p_start_deadlines  step without a prepare hook, a declared cost or a confirmation rule
-- The walk and the lease are saga.claim_batch's: the partial index of runnable sagas in
-- run_after order, stopping once p_limit sagas are locked (SKIP LOCKED passes over those
-- other claims hold); each saga taken gets its own lease and its fence grows by one, so a
-- previous owner's writes are refused from then on.
--
-- An attempt is started here only where the worker's planner would start it with nothing
-- to decide beyond the rows: the saga runs forward (pending or running), sets none of the
-- saga-level ceilings (deadline, max_operations, max_side_effects, spend budget) and has no
-- confirmation; none of its operations is a compensation, running (a previous owner's
-- attempt, whose outcome the planner marks unknown), unknown, failed or retrying an
-- unknown outcome; and its first action not succeeded, in step order, is pending, below
-- its ceiling of attempts, out of its backoff (next_attempt_at) and before its deadline,
-- and is one of the p_start steps of the saga's kind. Its write is the planner's: the
-- saga running, its operations_executed and side_effects counted, the operation running
-- with its attempt counted (started_at p_now, its deadline set from the step's
-- deadline_seconds when it has none yet), the events lease_acquired and attempt_started.
-- The intent is committed with the claim, before the worker calls anything.
--
-- Each saga is answered on its own: the starts are applied as a few set statements in one
-- subtransaction, and if any of them raises (a trigger, a constraint, a value that does
-- not cast), everything they did is rolled back and every saga of the batch is claimed
-- only, so that the worker plans and writes each first move itself, each refused alone
-- (saga.write_sagas_v2) as after saga.claim_batch. The row locks of the walk are taken
-- before the subtransaction, and kept.
--
-- A worker whose reply was lost finds what the claim took by the tokens (own_claims): a
-- saga holding one of p_tokens has its attempt started (the running operation is the one
-- the claim started), one holding one of p_claim_tokens is claimed only.
--
-- The claimed sagas are named in saga.claimed_batch, as by saga.claim_batch, for the reads
-- of their operations and confirmations (claimed_batch_operations,
-- claimed_batch_confirmations) sent behind this statement in the same transaction.
--
-- Compatibility (README, "Upgrades"): a new function; saga.claim_batch and saga.claim_next,
-- which the previous release calls, are left unchanged.

CREATE FUNCTION saga.claim_batch_v2(
    p_kinds text[], p_owner text, p_lease_seconds double precision, p_limit integer,
    p_now timestamptz, p_tokens uuid[], p_claim_tokens uuid[],
    p_start_kinds text[], p_start_steps text[], p_start_side_effects integer[],
    p_start_deadlines double precision[]
) RETURNS SETOF saga.sagas
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
    v_ids    uuid[];     -- the sagas taken, in run_after then id order
    v_moved  uuid[];     -- those whose attempt is started: ids, steps, ordinals,
    v_steps  text[];     -- side effects counted (0 or 1), steps' deadline_seconds
    v_n      bigint[];
    v_side   integer[];
    v_dead   double precision[];
    v_fence  bigint[];   -- ... and their fences and attempts as this claim leaves them
    v_att    integer[];
BEGIN
    SELECT array_agg(c.id ORDER BY c.run_after, c.id)
    INTO v_ids
    FROM (
        SELECT id, run_after
        FROM saga.sagas
        WHERE status IN ('pending', 'running', 'compensating')
          AND run_after <= now()
          AND (lease_owner IS NULL OR lease_expires_at <= now())
          AND name || ':' || version = ANY(p_kinds)
        ORDER BY run_after
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED
    ) AS c;

    PERFORM set_config('saga.claimed_batch', COALESCE(array_to_string(v_ids, ','), ''), true);
    IF v_ids IS NULL THEN
        RETURN;
    END IF;

    IF p_start_steps IS NOT NULL AND cardinality(p_start_steps) > 0 THEN
        BEGIN
            -- The rows of the sagas taken are read by their primary key (materialized: the
            -- planner would otherwise read them through the partial index of runnable
            -- sagas, which the conditions below match, and walk the whole queue).
            WITH s AS MATERIALIZED (
                SELECT id, name, version, status, direction, deadline_at, max_operations,
                       max_side_effects, spend_budget, fence
                FROM saga.sagas
                WHERE id = ANY(v_ids)
            )
            SELECT array_agg(m.id ORDER BY m.n), array_agg(m.step ORDER BY m.n),
                   array_agg(m.n ORDER BY m.n), array_agg(m.side_effect ORDER BY m.n),
                   array_agg(m.deadline ORDER BY m.n), array_agg(m.fence ORDER BY m.n),
                   array_agg(m.attempt ORDER BY m.n)
            INTO v_moved, v_steps, v_n, v_side, v_dead, v_fence, v_att
            FROM (
                SELECT k.id, k.n, o.step, st.side_effect, st.deadline, s.fence + 1 AS fence,
                       o.attempts + 1 AS attempt
                FROM unnest(v_ids) WITH ORDINALITY AS k(id, n)
                JOIN s ON s.id = k.id
                JOIN LATERAL (
                    SELECT x.step, x.status, x.retrying_unknown, x.attempts, x.max_attempts,
                           x.next_attempt_at, x.deadline_at
                    FROM saga.operations AS x
                    WHERE x.saga_id = s.id AND x.kind = 'action' AND x.status <> 'succeeded'
                    ORDER BY x.position
                    LIMIT 1
                ) AS o ON true
                JOIN unnest(p_start_kinds, p_start_steps, p_start_side_effects,
                            p_start_deadlines) AS st(kind, step, side_effect, deadline)
                    ON st.kind = s.name || ':' || s.version AND st.step = o.step
                WHERE s.status IN ('pending', 'running')
                  AND s.direction = 'forward'
                  AND s.deadline_at IS NULL
                  AND s.max_operations IS NULL
                  AND s.max_side_effects IS NULL
                  AND s.spend_budget IS NULL
                  AND o.status = 'pending'
                  AND NOT o.retrying_unknown
                  AND o.attempts < o.max_attempts
                  AND (o.next_attempt_at IS NULL OR o.next_attempt_at <= p_now)
                  AND (o.deadline_at IS NULL OR p_now < o.deadline_at)
                  AND NOT EXISTS (
                      SELECT 1
                      FROM saga.operations AS x
                      WHERE x.saga_id = s.id
                        AND (x.kind <> 'action' OR x.retrying_unknown
                             OR x.status IN ('running', 'unknown', 'failed')))
                  AND NOT EXISTS (SELECT 1 FROM saga.confirmations AS f WHERE f.saga_id = s.id)
            ) AS m;

            IF v_moved IS NOT NULL THEN
                -- The lease and the first move of each saga whose attempt starts.
                UPDATE saga.sagas AS s
                SET lease_owner = p_owner,
                    lease_expires_at = now() + make_interval(secs => p_lease_seconds),
                    fence = s.fence + 1,
                    status = 'running',
                    operations_executed = s.operations_executed + 1,
                    side_effects = s.side_effects + m.side_effect,
                    finished_at = NULL,
                    write_token = p_tokens[m.n],
                    updated_at = now()
                FROM unnest(v_moved, v_n, v_side) AS m(id, n, side_effect)
                WHERE s.id = ANY(v_moved) AND s.id = m.id;

                UPDATE saga.operations AS o
                SET status = 'running',
                    attempts = o.attempts + 1,
                    next_attempt_at = NULL,
                    started_at = p_now,
                    finished_at = NULL,
                    cost = NULL,
                    deadline_at = COALESCE(o.deadline_at,
                                           p_now + make_interval(secs => m.deadline)),
                    updated_at = now()
                FROM unnest(v_moved, v_steps, v_dead) AS m(id, step, deadline)
                WHERE o.saga_id = ANY(v_moved)
                  AND o.saga_id = m.id AND o.kind = 'action' AND o.step = m.step;

                INSERT INTO saga.events (saga_id, event, step, kind, attempt, detail)
                SELECT e.saga_id, e.event, e.step, e.kind, e.attempt, e.detail
                FROM unnest(v_moved, v_steps, v_n, v_fence, v_att) AS m(id, step, n, fence, attempt)
                CROSS JOIN LATERAL (
                    VALUES (1, m.id, 'lease_acquired', NULL::text, NULL::text, NULL::integer,
                            jsonb_build_object('owner', p_owner, 'fence', m.fence)),
                           (2, m.id, 'attempt_started', m.step, 'action', m.attempt,
                            '{}'::jsonb)
                ) AS e(k, saga_id, event, step, kind, attempt, detail)
                ORDER BY m.n, e.k;
            END IF;
        EXCEPTION WHEN OTHERS THEN
            -- Everything the starts did is rolled back: every saga is claimed only.
            v_moved := NULL;
        END;
    END IF;

    -- The lease of every saga claimed only.
    UPDATE saga.sagas AS s
    SET lease_owner = p_owner,
        lease_expires_at = now() + make_interval(secs => p_lease_seconds),
        fence = s.fence + 1,
        write_token = p_claim_tokens[k.n],
        updated_at = now()
    FROM unnest(v_ids) WITH ORDINALITY AS k(id, n)
    WHERE s.id = ANY(v_ids)
      AND s.id = k.id
      AND NOT (k.id = ANY(COALESCE(v_moved, '{}')));

    RETURN QUERY
    SELECT s.*
    FROM saga.sagas AS s
    WHERE s.id = ANY(v_ids);
END
$$;
