-- Two keys are two calls. A ledger call's operation is named `<tool>.<first 48 bits of
-- sha256(key)>`, a short name for people; its identity is its idempotency key, which holds
-- the whole key. Two keys whose short names collide are two calls: the second one is named
-- `<tool>.<whole sha256(key)>` (saga.ledger_claim_v2), where saga.ledger_claim refused it
-- with a raw unique violation of the operations' primary key.
--
-- Compatibility (README, "Upgrades"): one function added, none changed. The previous
-- release keeps calling saga.ledger_claim, which still works on every row (a call found by
-- its idempotency key is claimed under its stored name); only a colliding key stays
-- refused there, as it was.

-- saga.ledger_claim_v2: saga.ledger_claim, with the call named p_step unless that name is
-- already another call's in the channel, then p_long_step; returns saga.ledger_claim's
-- row and the call's name (step). The channel's row is created and locked first, so two
-- claims of colliding keys in one channel cannot both take the short name.
CREATE FUNCTION saga.ledger_claim_v2(
    p_tenant text, p_name text, p_channel text, p_new_id uuid, p_input_hash text,
    p_step text, p_long_step text, p_idempotency_key text, p_request_hash text,
    p_request jsonb, p_owner text, p_lease_seconds double precision, p_max_attempts integer
) RETURNS TABLE (
    verdict text, saga_id uuid, fence bigint, attempt integer, max_attempts integer,
    result jsonb, provider_reference text, error text, previous text, holder text,
    expires_at timestamptz, request_hash text, saga_status text, step text
)
LANGUAGE plpgsql
AS $$
DECLARE
    v_saga_id uuid;
    v_step text;
BEGIN
    INSERT INTO saga.sagas (id, name, version, tenant_id, key, input, input_hash, status)
    VALUES (p_new_id, p_name, 1, p_tenant, p_channel, '{}'::jsonb, p_input_hash, 'running')
    ON CONFLICT ON CONSTRAINT sagas_identity DO NOTHING;
    IF FOUND THEN
        INSERT INTO saga.events (saga_id, event, detail)
        VALUES (p_new_id, 'saga_started', jsonb_build_object('ledger', true));
    END IF;
    SELECT s.id INTO v_saga_id FROM saga.sagas s
    WHERE s.tenant_id = p_tenant AND s.name = p_name AND s.key = p_channel
    FOR NO KEY UPDATE;

    SELECT o.step INTO v_step FROM saga.operations o
    WHERE o.idempotency_key = p_idempotency_key AND o.saga_id = v_saga_id;
    IF v_step IS NULL THEN
        v_step := CASE WHEN EXISTS (
                           SELECT 1 FROM saga.operations o
                           WHERE o.saga_id = v_saga_id AND o.kind = 'action'
                             AND o.step = p_step)
                       THEN p_long_step ELSE p_step END;
    END IF;
    RETURN QUERY
    SELECT c.verdict, c.saga_id, c.fence, c.attempt, c.max_attempts, c.result,
           c.provider_reference, c.error, c.previous, c.holder, c.expires_at,
           c.request_hash, c.saga_status, v_step
    FROM saga.ledger_claim(p_tenant, p_name, p_channel, p_new_id, p_input_hash, v_step,
                           p_idempotency_key, p_request_hash, p_request, p_owner,
                           p_lease_seconds, p_max_attempts) AS c;
END
$$;
