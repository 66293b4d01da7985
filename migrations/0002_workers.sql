-- saga.workers: the live workers and the saga kinds (name:version) each can run.
-- A worker upserts its row when it starts and at every poll, and deletes it when it
-- stops; a row whose heartbeat is older than its stated lifetime belongs to a dead
-- worker. Operators read it to tell "waiting for a worker" from "no worker knows this".

CREATE TABLE saga.workers (
    owner        text PRIMARY KEY,
    kinds        text[] NOT NULL,
    concurrency  integer NOT NULL CHECK (concurrency > 0),
    started_at   timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now(),
    expires_at   timestamptz NOT NULL
);
