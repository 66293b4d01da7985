-- saga.claim_batch: take the leases of up to p_limit runnable sagas of the given
-- name:version kinds in one statement, the ones that have waited longest first, as a
-- worker with that many idle drivers claims them.
--
-- The same walk as saga.claim_next (migration 0009): the partial index of runnable sagas
-- in run_after order, stopping once p_limit sagas are locked (SKIP LOCKED passes over
-- those other claims hold), so that a claim reads the sagas in flight ahead of it and the
-- ones it takes, never the backlog behind them. Each saga claimed gets its own lease and
-- its fence grows by one, as in a claim of that saga alone.
--
-- The claimed sagas are named in the transaction-local setting saga.claimed_batch (their
-- ids, comma-separated; empty when none was claimed), so that the reads of their
-- operations and confirmations can be sent before the ids are known.
--
-- Compatibility (README, "Upgrades"): a new function; nothing the previous release calls
-- changes.

CREATE FUNCTION saga.claim_batch(
    p_kinds text[], p_owner text, p_lease_seconds double precision, p_limit integer
) RETURNS SETOF saga.sagas
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
DECLARE
    v_row saga.sagas;
    v_ids text[] := '{}';
BEGIN
    FOR v_row IN
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
            LIMIT p_limit
            FOR UPDATE SKIP LOCKED
        ) AS c
        WHERE s.id = c.id
        RETURNING s.*
    LOOP
        v_ids := v_ids || v_row.id::text;
        RETURN NEXT v_row;
    END LOOP;
    PERFORM set_config('saga.claimed_batch', array_to_string(v_ids, ','), true);
END
$$;
