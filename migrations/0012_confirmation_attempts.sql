-- One approval, one attempt: a confirmation's approval is used up by the attempt it
-- releases, recorded here in the transaction that records that attempt as running (see
-- the consume_confirmation query). A retry previews again and needs a new approval.
--
-- Compatibility (README, "Upgrades"): two nullable columns; the previous release neither
-- reads nor writes them.

ALTER TABLE saga.confirmations
    -- The attempt this confirmation's approval released; NULL while it released none.
    ADD COLUMN consumed_attempt integer CHECK (consumed_attempt > 0),
    ADD COLUMN consumed_at      timestamptz;
