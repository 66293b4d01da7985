-- get_saga --
-- One saga row.
SELECT *
FROM saga.sagas
WHERE id = %(saga_id)s

-- lock_saga --
-- One saga row, locked for an operator's change; live_lease tells whether a worker holds it.
SELECT *,
       (lease_owner IS NOT NULL AND lease_expires_at > now()) AS live_lease
FROM saga.sagas
WHERE id = %(saga_id)s
FOR UPDATE

-- get_operations --
-- Every operation of a saga: actions in step order, then compensations.
SELECT *
FROM saga.operations
WHERE saga_id = %(saga_id)s
ORDER BY kind = 'compensation', CASE WHEN kind = 'action' THEN position ELSE -position END

-- claimed_operations --
-- get_operations of the saga the current transaction has just claimed (saga.claimed, set
-- by claim_saga or claim_next_saga); none when nothing was claimed.
SELECT *
FROM saga.operations
WHERE saga_id = NULLIF(current_setting('saga.claimed', true), '')::uuid
ORDER BY kind = 'compensation', CASE WHEN kind = 'action' THEN position ELSE -position END

-- get_operations_many --
-- Operations of several sagas, for list().
SELECT *
FROM saga.operations
WHERE saga_id = ANY(%(saga_ids)s::uuid[])
ORDER BY saga_id, kind = 'compensation',
         CASE WHEN kind = 'action' THEN position ELSE -position END

-- list_sagas --
-- Sagas filtered by status, name, tenant and time since their last change (each
-- optional), newest first. The age is taken by the database clock, not the caller's.
SELECT *
FROM saga.sagas
WHERE (%(status)s::text IS NULL OR status = %(status)s)
  AND (%(name)s::text IS NULL OR name = %(name)s)
  AND (%(tenant_id)s::text IS NULL OR tenant_id = %(tenant_id)s)
  AND (%(older_than_seconds)s::float8 IS NULL
       OR updated_at <= now() - make_interval(secs => %(older_than_seconds)s::float8))
ORDER BY created_at DESC, id DESC
LIMIT %(limit)s

-- list_sagas_by_key --
-- list_sagas for one business key: read through the key index (sagas_key), so the cost
-- does not grow with the finished history; the other filters as in list_sagas.
SELECT *
FROM saga.sagas
WHERE key = %(key)s
  AND (%(status)s::text IS NULL OR status = %(status)s)
  AND (%(name)s::text IS NULL OR name = %(name)s)
  AND (%(tenant_id)s::text IS NULL OR tenant_id = %(tenant_id)s)
  AND (%(older_than_seconds)s::float8 IS NULL
       OR updated_at <= now() - make_interval(secs => %(older_than_seconds)s::float8))
ORDER BY created_at DESC, id DESC
LIMIT %(limit)s

-- get_history --
-- The audit trail of a saga, oldest first.
SELECT at, event, step, kind, attempt, detail
FROM saga.events
WHERE saga_id = %(saga_id)s
ORDER BY id

-- count_operations --
-- How many operations a saga has (the dashboard's pages of them).
SELECT count(*) AS total
FROM saga.operations
WHERE saga_id = %(saga_id)s

-- count_live_claims --
-- How many calls of a ledger channel are held under a live claim (the channel is open),
-- by the database clock.
SELECT count(*) AS total
FROM saga.operations
WHERE saga_id = %(saga_id)s AND kind = 'action' AND status = 'running'
  AND claim_expires_at > now()

-- get_operations_page --
-- One page of a saga's operations, in get_operations' order (the step breaks ties, so
-- that pages never overlap).
SELECT *
FROM saga.operations
WHERE saga_id = %(saga_id)s
ORDER BY kind = 'compensation', CASE WHEN kind = 'action' THEN position ELSE -position END,
         step
LIMIT %(limit)s OFFSET %(offset)s

-- get_history_of_operations --
-- The audit trail of a saga, oldest first, narrowed to its saga-level events and those of
-- the operations given as parallel arrays of steps and kinds (a page of them); an event
-- without a kind belongs to the action.
SELECT at, event, step, kind, attempt, detail
FROM saga.events
WHERE saga_id = %(saga_id)s
  AND (step IS NULL
       OR (step, COALESCE(kind, 'action')) IN (
           SELECT * FROM unnest(%(steps)s::text[], %(kinds)s::text[])))
ORDER BY id

-- claim_saga --
-- Take the lease of one runnable saga unless another owner's lease is still live;
-- the fence grows so the previous owner's writes are refused from now on.
UPDATE saga.sagas
SET lease_owner = %(owner)s,
    lease_expires_at = now() + make_interval(secs => %(lease_seconds)s),
    fence = fence + 1,
    updated_at = now()
WHERE id = %(saga_id)s
  AND status IN ('pending', 'running', 'compensating')
  AND (lease_owner IS NULL OR lease_expires_at <= now())
RETURNING *, set_config('saga.claimed', id::text, true) AS claimed

-- claim_next_saga --
-- Take the lease of the runnable saga that has waited longest, among the given
-- (name:version) pairs; SKIP LOCKED lets many workers claim without blocking each other.
-- The claimed saga is named in saga.claimed, as by claim_saga (see migration 0009).
SELECT * FROM saga.claim_next(%(kinds)s::text[], %(owner)s, %(lease_seconds)s::float8)

-- claim_saga_batch --
-- Take the leases of up to `limit` runnable sagas among the given (name:version) pairs,
-- those that have waited longest first, in one statement (migration 0019); the claimed
-- sagas are named in saga.claimed_batch for the reads below.
SELECT * FROM saga.claim_batch(%(kinds)s::text[], %(owner)s, %(lease_seconds)s::float8,
                               %(limit)s::integer)

-- claim_saga_batch_started --
-- claim_saga_batch that also starts, in the same statement, the attempt of the next
-- pending step of each saga taken whose first move is only that (migration 0026): the
-- steps the database may start come from the worker's core, by kind; every other saga is
-- claimed only. The claimed sagas are named in saga.claimed_batch for the reads below.
SELECT * FROM saga.claim_batch_v2(%(kinds)s::text[], %(owner)s, %(lease_seconds)s::float8,
                                  %(limit)s::integer, %(now)s::timestamptz,
                                  %(tokens)s::uuid[], %(claim_tokens)s::uuid[],
                                  %(start_kinds)s::text[], %(start_steps)s::text[],
                                  %(start_side_effects)s::integer[],
                                  %(start_deadlines)s::float8[])

-- claimed_batch_operations --
-- get_operations of every saga the current transaction has just claimed with
-- claim_saga_batch, saga by saga; none when nothing was claimed.
SELECT *
FROM saga.operations
WHERE saga_id = ANY(string_to_array(
          NULLIF(current_setting('saga.claimed_batch', true), ''), ',')::uuid[])
ORDER BY saga_id, kind = 'compensation',
         CASE WHEN kind = 'action' THEN position ELSE -position END

-- claimed_batch_confirmations --
-- get_confirmations of every saga the current transaction has just claimed with
-- claim_saga_batch.
SELECT saga_id, step, request_hash, preview, requested_at, expires_at, approved_by,
       approved_at, consumed_attempt, consumed_at, approval
FROM saga.confirmations
WHERE saga_id = ANY(string_to_array(
          NULLIF(current_setting('saga.claimed_batch', true), ''), ',')::uuid[])
ORDER BY saga_id, requested_at

-- next_claimable_at --
-- When the earliest saga of these kinds becomes claimable (backoff over, lease expired).
SELECT min(GREATEST(run_after, COALESCE(lease_expires_at, run_after))) AS at
FROM saga.sagas
WHERE status IN ('pending', 'running', 'compensating')
  AND name || ':' || version = ANY(%(kinds)s::text[])

-- count_open_sagas --
-- Sagas among the given (name:version) pairs that are not yet terminal or parked.
SELECT count(*)
FROM saga.sagas
WHERE status IN ('pending', 'running', 'compensating')
  AND name || ':' || version = ANY(%(kinds)s::text[])

-- renew_leases --
-- Heartbeat of the attempts in flight: extend each lease this owner still holds at that
-- fence; the (id, fence) pairs returned are the leases still ours.
UPDATE saga.sagas AS s
SET lease_expires_at = GREATEST(s.lease_expires_at, now() + make_interval(secs => %(lease_seconds)s))
FROM unnest(%(saga_ids)s::uuid[], %(fences)s::bigint[]) AS h(id, fence)
WHERE s.id = h.id AND s.fence = h.fence AND s.lease_owner = %(owner)s
RETURNING s.id::text, s.fence

-- release_lease --
-- Give the lease back (on error paths), if still ours.
UPDATE saga.sagas
SET lease_owner = NULL, lease_expires_at = NULL
WHERE id = %(saga_id)s AND fence = %(fence)s AND lease_owner = %(owner)s

-- break_lease --
-- An operator forces a change on a saga a live worker holds: the fence grows and the
-- lease ends, so that worker's next write (and heartbeat) is refused.
UPDATE saga.sagas
SET fence = fence + 1, lease_owner = NULL, lease_expires_at = NULL, updated_at = now()
WHERE id = %(saga_id)s
RETURNING fence

-- running_calls --
-- The operations of a saga left running, with the claim that holds each (ledger calls:
-- claimed is true while that claim is live, by the database's clock), for an operator's
-- change to refuse or break (see saga/live_calls.py).
SELECT step, kind, claim_owner, claim_expires_at,
       (claim_owner IS NOT NULL AND claim_expires_at > now()) AS claimed
FROM saga.operations
WHERE saga_id = %(saga_id)s AND status = 'running'
ORDER BY kind = 'compensation', position

-- operator_resolved_steps --
-- The steps of a saga whose action an operator resolved as succeeded (`resolve
-- --succeeded`), rather than a provider call completing it: their result may be amended
-- until their compensation uses it.
SELECT DISTINCT step
FROM saga.events
WHERE saga_id = %(saga_id)s AND event = 'operation_resolved' AND kind = 'action'
  AND detail ->> 'outcome' = 'succeeded'

-- break_claims --
-- An operator forces a change on calls held by live claims: each claim's fence grows and
-- its lease ends, so its holder's next write (and heartbeat) is refused.
UPDATE saga.operations
SET claim_fence = claim_fence + 1, claim_owner = NULL, claim_expires_at = NULL,
    updated_at = now()
WHERE saga_id = %(saga_id)s AND kind = 'action' AND step = ANY(%(steps)s)
RETURNING step, claim_fence

-- find_unsettled_sagas --
-- Runnable sagas of the given (name:version) pairs with an operation left running under
-- an expired lease, or already unknown: the reconcile job's work list, oldest first. The
-- limit counts sagas (not operations); each saga's unsettled operations follow it, actions
-- in step order, then compensations.
WITH picked AS (
    SELECT s.id, s.updated_at
    FROM saga.sagas AS s
    WHERE s.status IN ('pending', 'running', 'compensating')
      AND (s.lease_owner IS NULL OR s.lease_expires_at <= now())
      AND s.name || ':' || s.version = ANY(%(kinds)s::text[])
      AND EXISTS (
          SELECT 1
          FROM saga.operations AS o
          WHERE o.saga_id = s.id AND o.status IN ('running', 'unknown')
      )
    ORDER BY s.updated_at, s.id
    LIMIT %(limit)s
)
SELECT s.id::text, s.name, s.version, o.step, o.kind, o.status, o.idempotency_key
FROM picked AS p
JOIN saga.sagas AS s ON s.id = p.id
JOIN saga.operations AS o ON o.saga_id = s.id AND o.status IN ('running', 'unknown')
ORDER BY p.updated_at, p.id, o.kind = 'compensation',
         CASE WHEN o.kind = 'action' THEN o.position ELSE -o.position END

-- saga_ids_by_prefix --
-- Ids of sagas that start with a prefix, in id order (at most the limit): the bounds are
-- the prefix padded with 0s and fs, so the primary key index finds them on a large table;
-- the LIKE keeps only ids written with the prefix as given (dashes included).
SELECT id::text AS id
FROM saga.sagas
WHERE id >= %(low)s::uuid AND id <= %(high)s::uuid
  AND id::text LIKE %(pattern)s
ORDER BY id
LIMIT %(limit)s

-- saga_refs_by_key --
-- The sagas a business key names (the key index finds them), newest first, at most the
-- limit: what an operator is shown to pick from when a key names several.
SELECT id::text AS id, name, version, tenant_id, key, status
FROM saga.sagas
WHERE key = %(key)s
ORDER BY created_at DESC, id DESC
LIMIT %(limit)s

-- saga_refs_by_id --
-- The same of the sagas with these ids (read through the primary key).
SELECT id::text AS id, name, version, tenant_id, key, status
FROM saga.sagas
WHERE id = ANY(%(ids)s::uuid[])
ORDER BY created_at DESC, id DESC

-- in_flight_by_version --
-- How many sagas of each name and version are not ended yet, by status.
SELECT name, version, status, count(*) AS sagas
FROM saga.sagas
WHERE status IN ('pending', 'running', 'compensating', 'awaiting_confirmation', 'needs_review')
GROUP BY name, version, status
ORDER BY name, version, status

-- upsert_worker --
-- A worker says it is alive, which kinds it runs, and until when to believe it.
INSERT INTO saga.workers (owner, kinds, concurrency, expires_at)
VALUES (%(owner)s, %(kinds)s::text[], %(concurrency)s,
        now() + make_interval(secs => %(ttl_seconds)s))
ON CONFLICT (owner) DO UPDATE
SET kinds = EXCLUDED.kinds,
    concurrency = EXCLUDED.concurrency,
    heartbeat_at = now(),
    expires_at = EXCLUDED.expires_at

-- delete_worker --
-- A worker stopping takes its row away; dead workers' rows are removed by the living.
DELETE FROM saga.workers WHERE owner = %(owner)s OR expires_at < now() - interval '1 hour'

-- live_workers --
-- Workers whose last heartbeat is still believed, newest first.
SELECT owner, kinds, concurrency, started_at, heartbeat_at, expires_at
FROM saga.workers
WHERE expires_at >= now()
ORDER BY started_at DESC

-- get_confirmations --
-- The confirmations of a saga, pending, approved and used up (by the attempt named), with
-- the approval token each was given (migration 0017).
SELECT step, request_hash, preview, requested_at, expires_at, approved_by, approved_at,
       consumed_attempt, consumed_at, approval
FROM saga.confirmations
WHERE saga_id = %(saga_id)s
ORDER BY requested_at

-- claimed_confirmations --
-- get_confirmations of the saga the current transaction has just claimed.
SELECT step, request_hash, preview, requested_at, expires_at, approved_by, approved_at,
       consumed_attempt, consumed_at, approval
FROM saga.confirmations
WHERE saga_id = NULLIF(current_setting('saga.claimed', true), '')::uuid
ORDER BY requested_at

-- record_approval --
-- The approval token a confirmation was approved with, stored beside it in the operator's
-- transaction that approves it (after saga.write_saga_v4, which checked that it was still
-- pending): workers with the approvers' public key verify it before the attempt it
-- releases. A later ask of the same confirmation clears approved_at, which withdraws it;
-- the next approval overwrites it.
UPDATE saga.confirmations
SET approval = %(approval)s
WHERE saga_id = %(saga_id)s AND step = %(step)s AND request_hash = %(request_hash)s

-- purge_finished_sagas --
-- Delete a batch of completed, compensated or forked sagas that ended before the cutoff, with
-- their operations, events and confirmations; sagas still running or parked are never
-- touched. SKIP LOCKED lets a purge run beside workers. Events have no foreign key
-- (migration 0007), so they are deleted here with their sagas. Returns how many.
WITH doomed AS (
    SELECT id
    FROM saga.sagas
    WHERE status IN ('completed', 'compensated', 'forked')
      AND finished_at < now() - make_interval(secs => %(retention_seconds)s::float8)
    ORDER BY finished_at
    LIMIT %(batch_size)s
    FOR UPDATE SKIP LOCKED
), gone AS (
    DELETE FROM saga.sagas WHERE id IN (SELECT id FROM doomed) RETURNING id
), gone_events AS (
    DELETE FROM saga.events WHERE saga_id IN (SELECT id FROM gone)
)
SELECT count(*) AS purged FROM gone

-- list_purgeable_sagas --
-- The sagas purge_finished_sagas would delete with this cutoff, oldest first, and how many
-- there are in all: a dry run, which neither locks nor deletes anything.
SELECT id::text AS id, name, version, status, finished_at, count(*) OVER () AS total
FROM saga.sagas
WHERE status IN ('completed', 'compensated', 'forked')
  AND finished_at < now() - make_interval(secs => %(retention_seconds)s::float8)
ORDER BY finished_at
LIMIT %(limit)s

-- assert_fence --
-- The fence check of a pipelined transition: fails the transaction (SQLSTATE SG001) when
-- another owner has claimed the saga, so the writes queued after it are rolled back.
SELECT saga.assert_fence(%(saga_id)s, %(owner)s, %(fence)s, %(lease_seconds)s)

-- write_saga --
-- A saga's decisions in one statement: its row (fenced for a lease holder), operations,
-- events, confirmations, wake-up, the write's token and, when asked, its state as it now
-- stands (see migrations 0008, 0010, 0011 and 0013).
-- saga.hashed_under(2, ...): the rows it writes record request hash version 2
-- (saga.keys.HASH_VERSION, migration 0023).
SELECT saga.write_saga_v4(saga.hashed_under(2, %(write)s::jsonb)) AS state

-- write_saga_direct --
-- `write_saga` on a direct connection, whose session says the request hash version
-- (a startup option, saga._db.database.session_options): no saga.hashed_under.
SELECT saga.write_saga_v4(%(write)s::jsonb) AS state

-- write_sagas --
-- The writes of several sagas in one statement and one commit (group commit): one
-- result per write, in order, each its state or the error that refused it. Applied as a
-- few set statements (migration 0025; 0014's saga.write_sagas_v1 takes the same argument
-- and answers the same). saga.hashed_under(2, ...): the rows it writes record request
-- hash version 2 (saga.keys.HASH_VERSION, migration 0023).
SELECT saga.write_sagas_v2(saga.hashed_under(2, %(writes)s::jsonb)) AS results

-- write_sagas_direct --
-- `write_sagas` on a direct connection, whose session says the request hash version
-- (a startup option, saga._db.database.session_options): no saga.hashed_under.
SELECT saga.write_sagas_v2(%(writes)s::jsonb) AS results

-- own_claim --
-- The saga this owner's claim took, found by the token of the claim's first write: a worker
-- whose claim reply was lost learns which saga it holds (none when the claim did not land,
-- or its first move already gave the lease back).
SELECT id::text AS id, name, version
FROM saga.sagas
WHERE status IN ('pending', 'running', 'compensating')
  AND lease_owner = %(owner)s
  AND write_token = %(token)s::uuid

-- own_claims --
-- The sagas this owner's batch claim took, found by the tokens of their first writes
-- (one token per saga the claim could take): a worker whose claim reply was lost learns
-- which sagas it holds (none when the claim did not land, or their first moves already
-- gave the leases back).
SELECT id::text AS id, write_token::text AS write_token
FROM saga.sagas
WHERE status IN ('pending', 'running', 'compensating')
  AND lease_owner = %(owner)s
  AND write_token = ANY(%(tokens)s::uuid[])

-- write_token --
-- The token of a saga's last write and its lease owner: whether a write whose reply was
-- lost landed.
SELECT write_token::text AS write_token, lease_owner
FROM saga.sagas
WHERE id = %(saga_id)s

-- start_saga --
-- Create a saga with its operations and first events in one statement (migration 0008),
-- the trace context of its starter (migration 0018) and the start's write token
-- (migration 0020).
-- saga.hashed_under(2, ...): the rows it writes record request hash version 2
-- (saga.keys.HASH_VERSION, migration 0023).
SELECT saga.start_saga_v3(saga.hashed_under(2, %(start)s::jsonb)) AS outcome

-- start_saga_direct --
-- `start_saga` on a direct connection, whose session says the request hash version
-- (a startup option, saga._db.database.session_options): no saga.hashed_under.
SELECT saga.start_saga_v3(%(start)s::jsonb) AS outcome

-- start_sagas --
-- Several sagas' starts in one statement and one commit (group commit, migration 0029):
-- one result per start, in order, each what start_saga answers or the error that refused
-- that start alone. saga.hashed_under(2, ...): the rows it writes record request hash
-- version 2 (saga.keys.HASH_VERSION, migration 0023).
SELECT saga.start_sagas_v1(saga.hashed_under(2, %(starts)s::jsonb)) AS results

-- start_sagas_direct --
-- `start_sagas` on a direct connection, whose session says the request hash version
-- (a startup option, saga._db.database.session_options): no saga.hashed_under.
SELECT saga.start_sagas_v1(%(starts)s::jsonb) AS results

-- claim_started --
-- Claim a saga unclaimed and unchanged since the start that stored `start_token`, and
-- record the first move its starter planned, in one statement (migration 0020).
-- saga.hashed_under(2, ...): the rows it writes record request hash version 2
-- (saga.keys.HASH_VERSION, migration 0023).
SELECT saga.claim_started_v1(saga.hashed_under(2, %(claim)s::jsonb)) AS outcome

-- claim_started_direct --
-- `claim_started` on a direct connection, whose session says the request hash version
-- (a startup option, saga._db.database.session_options): no saga.hashed_under.
SELECT saga.claim_started_v1(%(claim)s::jsonb) AS outcome

-- database_gauges --
-- What the telemetry's gauges report of the database, per saga name (saga.telemetry): sagas
-- parked in needs_review; operations whose outcome is unknown in sagas still open or parked
-- (the ones somebody has to settle); and how long the longest-waiting claimable saga has
-- waited (runnable since run_after, its lease free or expired). Each part reads an index
-- (sagas_status_created, sagas_runnable) and the open sagas' operations by primary key:
-- its cost grows with the sagas in flight or parked, never with finished history.
WITH parked AS (
    SELECT name, count(*) AS sagas
    FROM saga.sagas
    WHERE status = 'needs_review'
    GROUP BY name
), unknown AS (
    SELECT s.name, count(*) AS operations
    FROM saga.sagas AS s
    JOIN saga.operations AS o ON o.saga_id = s.id
    WHERE s.status IN ('pending', 'running', 'compensating', 'awaiting_confirmation',
                       'needs_review')
      AND o.status = 'unknown'
    GROUP BY s.name
), waiting AS (
    SELECT name, extract(epoch FROM now() - min(run_after))::float8 AS seconds
    FROM saga.sagas
    WHERE status IN ('pending', 'running', 'compensating')
      AND run_after <= now()
      AND (lease_owner IS NULL OR lease_expires_at <= now())
    GROUP BY name
)
SELECT name,
       COALESCE(parked.sagas, 0)::bigint AS needs_review,
       COALESCE(unknown.operations, 0)::bigint AS unknown_outcomes,
       COALESCE(waiting.seconds, 0.0)::float8 AS oldest_runnable_seconds
FROM parked
FULL JOIN unknown USING (name)
FULL JOIN waiting USING (name)
ORDER BY name

-- report_spend --
-- Spend that the running attempt of an operation has reported so far (its running total,
-- so that sending it again changes nothing), kept until the attempt's outcome counts it
-- (migration 0011). Only the lease holder's attempt in flight is written: no row when the
-- lease is lost or the attempt's outcome is already recorded. The saga row is share-locked,
-- so a claim by another owner either waits for this write (and then reads it) or has
-- already moved the fence (and this writes nothing).
WITH holder AS (
    SELECT id
    FROM saga.sagas
    WHERE id = %(saga_id)s AND fence = %(fence)s AND lease_owner = %(owner)s
    FOR SHARE
)
UPDATE saga.operations AS o
SET attempt_spend = GREATEST(o.attempt_spend, %(total)s::numeric)
FROM holder
WHERE o.saga_id = holder.id
  AND o.step = %(step)s
  AND o.kind = %(kind)s
  AND o.attempts = %(attempt)s
  AND o.status = 'running'
RETURNING o.attempt_spend

-- record_fork --
-- Each side of a fork names the other: the fork its source, the source its fork (in the
-- transaction that created the fork and made the source `forked`); the source, final, is
-- purged after the retention period like a completed saga.
UPDATE saga.sagas
SET forked_from = CASE WHEN id = %(fork)s THEN %(source)s::uuid ELSE forked_from END,
    forked_to = CASE WHEN id = %(source)s THEN %(fork)s::uuid ELSE forked_to END,
    finished_at = CASE WHEN id = %(source)s THEN now() ELSE finished_at END
WHERE id IN (%(source)s, %(fork)s)

-- ledger_claim --
-- Claim one call of a ledger channel (the channel created when new); see migration 0016
-- for the verdicts, and 0022 for the call's name (step), short unless another key's
-- call has it.
-- saga.hashed_under(2, ...): the rows it writes record request hash version 2
-- (saga.keys.HASH_VERSION, migration 0023).
SELECT *
FROM saga.ledger_claim_v2(%(tenant)s, %(name)s, %(channel)s, %(new_id)s, %(input_hash)s,
                          %(step)s, %(long_step)s, %(idempotency_key)s,
                          saga.hashed_under(2, %(request_hash)s::text),
                          %(request)s::jsonb, %(owner)s, %(lease_seconds)s::float8,
                          %(max_attempts)s::integer)

-- ledger_claim_direct --
-- `ledger_claim` on a direct connection, whose session says the request hash version
-- (a startup option, saga._db.database.session_options): no saga.hashed_under.
SELECT *
FROM saga.ledger_claim_v2(%(tenant)s, %(name)s, %(channel)s, %(new_id)s, %(input_hash)s,
                          %(step)s, %(long_step)s, %(idempotency_key)s,
                          %(request_hash)s::text,
                          %(request)s::jsonb, %(owner)s, %(lease_seconds)s::float8,
                          %(max_attempts)s::integer)

-- ledger_settle --
-- The holder of a ledger claim records its call's outcome, or extends its lease; SG001
-- when the claim is no longer the holder's.
SELECT *
FROM saga.ledger_settle(%(saga_id)s::uuid, %(step)s, %(owner)s, %(fence)s::bigint,
                        %(outcome)s, %(result)s::jsonb, %(provider_reference)s, %(error)s,
                        %(lease_seconds)s::float8)

-- ledger_heartbeat --
-- The holder of a ledger claim extends its lease, never shortening it (migration 0021);
-- SG001 when the claim is no longer the holder's.
SELECT *
FROM saga.ledger_heartbeat_v1(%(saga_id)s::uuid, %(step)s, %(owner)s, %(fence)s::bigint,
                              %(lease_seconds)s::float8)

-- ledger_close --
-- End a ledger channel whose calls are all settled (see migration 0016).
SELECT *
FROM saga.ledger_close(%(tenant)s, %(name)s, %(channel)s, %(actor)s)

-- transaction_settings --
-- The connections' timeouts for this transaction only, its first statement through a
-- transaction pooler (which refuses them as startup options, and would carry a session
-- setting over to other clients): a frozen client's transaction is ended once it has
-- waited a lease, and a wait for a row lock ends after a lease too. The request hash
-- version the rows it writes are hashed under (migration 0023) goes the same way.
SELECT set_config('idle_in_transaction_session_timeout', %(idle_ms)s, true),
       set_config('lock_timeout', %(lock_ms)s, true),
       set_config('saga.hash_version', %(hash_version)s, true)

-- session_hash_version --
-- The request hash version a connection's session says (its startup options on a direct
-- connection, saga._db.database.session_options); empty when it says none.
SELECT current_setting('saga.hash_version', true)

-- upgrade_saga --
-- An operator moves a saga no worker holds to a newer version of its definition (under
-- its row lock, see saga/upgrade.py): the fence grows and any expired lease ends, so the
-- holder of that lease can no longer write.
UPDATE saga.sagas
SET version = %(version)s, fence = fence + 1, lease_owner = NULL, lease_expires_at = NULL,
    updated_at = now()
WHERE id = %(saga_id)s
RETURNING fence

-- upgrade_drop_operations --
-- The operations an upgrade drops, or creates again under the new version: never
-- attempted, or failed with no step left to carry them.
DELETE FROM saga.operations AS o
USING jsonb_to_recordset(%(ops)s::jsonb) AS x(kind text, step text)
WHERE o.saga_id = %(saga_id)s AND o.kind = x.kind AND o.step = x.step

-- upgrade_park_operations --
-- First half of an upgrade's renames: the operations kept take a name no step can have
-- ('#' is not allowed in a step name), so that two renamed ones may swap names.
UPDATE saga.operations AS o
SET step = '#' || o.step
FROM jsonb_to_recordset(%(ops)s::jsonb) AS x(kind text, step text)
WHERE o.saga_id = %(saga_id)s AND o.kind = x.kind AND o.step = x.step

-- upgrade_rename_operations --
-- Second half: each kept operation takes the name and position of its step in the new
-- version; its idempotency key, request hash and attempts stay as stored.
UPDATE saga.operations AS o
SET step = x.to_step, position = x.position, updated_at = now()
FROM jsonb_to_recordset(%(ops)s::jsonb) AS x(kind text, step text, to_step text, position integer)
WHERE o.saga_id = %(saga_id)s AND o.kind = x.kind AND o.step = '#' || x.step
