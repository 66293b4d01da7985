-- saga-orchestrator schema, version 1.
--
-- saga.sagas       one row per saga instance: identity (tenant, name, key), input and
--                  its hash, status, the lease (owner, expiry, fencing token) and when
--                  it may run next.
-- saga.operations  one row per step ("action") or compensation of an instance, each with
--                  its own idempotency key, request hash, status, attempts and ceiling.
-- saga.events      append-only audit trail of every transition.
--
-- Statuses mirror saga.state.SagaStatus and saga.state.OperationStatus.

CREATE TABLE saga.sagas (
    id               uuid PRIMARY KEY,
    name             text NOT NULL,
    version          integer NOT NULL CHECK (version > 0),
    tenant_id        text NOT NULL,
    key              text NOT NULL,
    input            jsonb NOT NULL,
    input_hash       text NOT NULL,
    status           text NOT NULL DEFAULT 'pending' CHECK (status IN
                     ('pending', 'running', 'compensating', 'completed', 'compensated',
                      'needs_review')),
    error            text,
    -- 'forward' runs steps; 'backward' runs compensations (kept apart from status so an
    -- operator's resolve returns a parked saga to the direction it was going).
    direction        text NOT NULL DEFAULT 'forward' CHECK (direction IN ('forward', 'backward')),
    lease_owner      text,
    lease_expires_at timestamptz,
    -- Grows at every claim; every write of the lease holder checks it.
    fence            bigint NOT NULL DEFAULT 0,
    run_after        timestamptz NOT NULL DEFAULT now(),
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT sagas_identity UNIQUE (tenant_id, name, key)
);

-- Only runnable sagas are indexed, so claiming does not slow down as history grows.
CREATE INDEX sagas_runnable ON saga.sagas (run_after)
    WHERE status IN ('pending', 'running', 'compensating');

CREATE INDEX sagas_status_created ON saga.sagas (status, created_at DESC);

CREATE TABLE saga.operations (
    saga_id            uuid NOT NULL REFERENCES saga.sagas (id) ON DELETE CASCADE,
    step               text NOT NULL,
    kind               text NOT NULL CHECK (kind IN ('action', 'compensation')),
    position           integer NOT NULL,
    idempotency_key    text NOT NULL UNIQUE,
    request_hash       text NOT NULL,
    status             text NOT NULL DEFAULT 'pending' CHECK (status IN
                       ('pending', 'running', 'succeeded', 'failed', 'unknown')),
    attempts           integer NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    max_attempts       integer NOT NULL CHECK (max_attempts > 0),
    next_attempt_at    timestamptz,
    result             jsonb,
    provider_reference text,
    error              text,
    started_at         timestamptz,
    finished_at        timestamptz,
    updated_at         timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (saga_id, kind, step)
);

CREATE TABLE saga.events (
    id      bigserial PRIMARY KEY,
    saga_id uuid NOT NULL REFERENCES saga.sagas (id) ON DELETE CASCADE,
    at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    event   text NOT NULL,
    step    text,
    kind    text,
    attempt integer,
    detail  jsonb NOT NULL DEFAULT '{}'::jsonb
);

CREATE INDEX events_saga ON saga.events (saga_id, id);
