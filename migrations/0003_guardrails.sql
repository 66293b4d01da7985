-- Guardrails: persisted saga ceilings and their counters, per-operation requests,
-- deadlines and reconcile windows, confirmations, and the end time that retention
-- counts from.

ALTER TABLE saga.sagas
    ADD COLUMN max_operations      integer CHECK (max_operations > 0),
    ADD COLUMN operations_executed integer NOT NULL DEFAULT 0,
    ADD COLUMN deadline_at         timestamptz,
    ADD COLUMN spend_budget        numeric CHECK (spend_budget >= 0),
    ADD COLUMN spent               numeric NOT NULL DEFAULT 0,
    ADD COLUMN max_side_effects    integer CHECK (max_side_effects >= 0),
    ADD COLUMN side_effects        integer NOT NULL DEFAULT 0,
    -- Set when the saga becomes completed or compensated; retention counts from it.
    ADD COLUMN finished_at         timestamptz;

ALTER TABLE saga.sagas DROP CONSTRAINT sagas_status_check;
ALTER TABLE saga.sagas ADD CONSTRAINT sagas_status_check CHECK (status IN
    ('pending', 'running', 'compensating', 'completed', 'compensated', 'needs_review',
     'awaiting_confirmation'));

-- Purging walks terminal sagas by age without touching the rest.
CREATE INDEX sagas_finished ON saga.sagas (finished_at)
    WHERE status IN ('completed', 'compensated');

ALTER TABLE saga.operations
    -- The request an attempt acts on (from the step's prepare function), persisted
    -- with its hash before the call.
    ADD COLUMN request              jsonb,
    -- The step's overall deadline, waits between retries included.
    ADD COLUMN deadline_at          timestamptz,
    ADD COLUMN cost                 numeric,
    ADD COLUMN reconcile_started_at timestamptz,
    ADD COLUMN reconcile_asks       integer NOT NULL DEFAULT 0,
    -- True while an unknown attempt is being retried with the same key: the request
    -- must not change until an outcome is known.
    ADD COLUMN retrying_unknown     boolean NOT NULL DEFAULT false;

-- A pending confirmation: what was previewed, and until when it may be approved.
CREATE TABLE saga.confirmations (
    saga_id      uuid NOT NULL REFERENCES saga.sagas (id) ON DELETE CASCADE,
    step         text NOT NULL,
    request_hash text NOT NULL,
    preview      jsonb NOT NULL,
    requested_at timestamptz NOT NULL DEFAULT now(),
    expires_at   timestamptz NOT NULL,
    approved_by  text,
    approved_at  timestamptz,
    PRIMARY KEY (saga_id, step, request_hash)
);
