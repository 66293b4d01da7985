-- saga.claim_next: take the lease of the runnable saga that has waited longest among the
-- given name:version kinds, as the next claim of a worker.
--
-- As a plain statement, the claim's plan followed the table's statistics. While they were
-- stale (a queue filling faster than autovacuum analyzes it, the usual case for a new
-- deployment or a burst), the planner took a bitmap scan of the runnable index and a sort:
-- every claim then read every runnable saga, and every not yet vacuumed index entry of
-- ended ones, and its cost grew with the backlog (1.9 ms a claim with 2,000 sagas
-- queued). Here the claim always walks the partial index of runnable sagas in run_after
-- order and stops at the first saga it can lock: it reads the sagas in flight ahead of
-- it and nothing more, and that index scan marks the dead entries it passes so that later
-- claims skip them.
--
-- Like claim_saga, it names the claimed saga in the transaction-local setting
-- saga.claimed, so the reads of its operations can be sent before its id is known.

CREATE FUNCTION saga.claim_next(
    p_kinds text[], p_owner text, p_lease_seconds double precision
) RETURNS SETOF saga.sagas
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
DECLARE
    v_row saga.sagas;
BEGIN
    UPDATE saga.sagas AS s
    SET lease_owner = p_owner,
        lease_expires_at = now() + make_interval(secs => p_lease_seconds),
        fence = s.fence + 1,
        updated_at = now()
    FROM (
        SELECT id
        FROM saga.sagas
        WHERE status IN ('pending', 'running', 'compensating')
          AND run_after <= now()
          AND (lease_owner IS NULL OR lease_expires_at <= now())
          AND name || ':' || version = ANY(p_kinds)
        ORDER BY run_after
        LIMIT 1
        FOR UPDATE SKIP LOCKED
    ) AS c
    WHERE s.id = c.id
    RETURNING s.* INTO v_row;
    IF FOUND THEN
        PERFORM set_config('saga.claimed', v_row.id::text, true);
        RETURN NEXT v_row;
    END IF;
END
$$;
