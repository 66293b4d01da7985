-- The ledger keeps a claim's lease the way a declared saga's lease is kept: a heartbeat
-- extends a claim by the lease the caller gives (the claim's own, see saga/ledger.py) and
-- never shortens it (saga.ledger_heartbeat_v1), where a heartbeat through
-- saga.ledger_settle set the lease to whatever it was given.
--
-- Compatibility (README, "Upgrades"): one function added, none changed. The previous
-- release keeps calling saga.ledger_settle for its heartbeats.

-- saga.ledger_heartbeat_v1: the holder of a claim (p_owner, p_fence) extends its lease to
-- p_lease_seconds from now, or leaves it where it is when it already ends later: a
-- heartbeat never shortens a claim. Refused (SG001) like saga.ledger_settle.
CREATE FUNCTION saga.ledger_heartbeat_v1(
    p_saga_id uuid, p_step text, p_owner text, p_fence bigint, p_lease_seconds double precision
) RETURNS TABLE (verdict text, status text, attempt integer, expires_at timestamptz)
LANGUAGE plpgsql
AS $$
DECLARE
    v_expires timestamptz;
BEGIN
    -- The lock order of saga.ledger_settle: the channel's row, then the call's.
    PERFORM 1 FROM saga.sagas s WHERE s.id = p_saga_id FOR NO KEY UPDATE;
    SELECT o.claim_expires_at INTO v_expires FROM saga.operations o
    WHERE o.saga_id = p_saga_id AND o.kind = 'action' AND o.step = p_step
    FOR UPDATE;
    RETURN QUERY
    SELECT * FROM saga.ledger_settle(
        p_saga_id, p_step, p_owner, p_fence, 'heartbeat', NULL, NULL, NULL,
        GREATEST(p_lease_seconds, COALESCE(extract(epoch FROM v_expires - now()), 0)));
END
$$;
