-- Fork from a step: a parked saga continued by a new one that inherits the results of
-- the steps before a given step. The source becomes `forked` (terminal: nothing of it
-- runs again, and operators act on the fork, which now owns the inherited effects and
-- their compensations); each side names the other.
--
-- A forked saga is final: it is purged after the retention period like a completed one,
-- so the partial index purging walks covers it too.
--
-- Compatibility (README, "Upgrades"): two nullable columns and one more status. The
-- previous release reads saga rows whole and ignores columns it does not know; it never
-- sees `forked` unless this release forked a saga, and then treats it as not runnable.

ALTER TABLE saga.sagas
    ADD COLUMN forked_from uuid,
    ADD COLUMN forked_to   uuid;

ALTER TABLE saga.sagas DROP CONSTRAINT sagas_status_check;
ALTER TABLE saga.sagas ADD CONSTRAINT sagas_status_check CHECK (status IN
    ('pending', 'running', 'compensating', 'completed', 'compensated', 'needs_review',
     'awaiting_confirmation', 'forked'));

DROP INDEX saga.sagas_finished;
CREATE INDEX sagas_finished ON saga.sagas (finished_at)
    WHERE status IN ('completed', 'compensated', 'forked');
