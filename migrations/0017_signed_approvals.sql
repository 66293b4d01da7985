-- Signed approvals: the approval a confirmation was given is stored with it, so that a
-- worker configured with the approvers' Ed25519 public key verifies the approval itself
-- before every attempt it releases, instead of trusting approved_at, which anything
-- holding the database credentials can write. The column holds the token `confirm()`
-- was given (a signed approval, or an HMAC token in the weaker confirmation_key mode);
-- it is written by the record_approval query in the transaction that approves, and read
-- with the confirmation (get_confirmations). A new ask of the same confirmation clears
-- approved_at, which withdraws the approval; the next approval overwrites the token.
--
-- Compatibility (README, "Upgrades"): one nullable column; no function changes. The
-- previous release reads confirmations by column name and never writes this one: its
-- approvals leave it NULL, which a worker of this release that requires signed approvals
-- refuses (the confirmation is asked for again), and which one without a public key
-- ignores, as before.

ALTER TABLE saga.confirmations
    ADD COLUMN approval text;
