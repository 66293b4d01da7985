-- saga.assert_fence: the fence check of a lease holder's write, as a statement that fails
-- the whole transaction when the lease is no longer the caller's. A transition can then be
-- sent to the server in one round trip (fence check, writes, commit), and a stale owner's
-- writes are rolled back with it. SQLSTATE SG001 is this project's "lease lost".

CREATE FUNCTION saga.assert_fence(
    p_saga_id uuid, p_owner text, p_fence bigint, p_lease_seconds double precision
) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE saga.sagas
    SET lease_expires_at = GREATEST(lease_expires_at,
                                    now() + make_interval(secs => p_lease_seconds))
    WHERE id = p_saga_id AND fence = p_fence AND lease_owner = p_owner;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'lease of saga % (fence %) is no longer held by %',
            p_saga_id, p_fence, p_owner
            USING ERRCODE = 'SG001';
    END IF;
END
$$;
