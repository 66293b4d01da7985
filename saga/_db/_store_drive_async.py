"""The store's part that drives sagas: claims and leases, starts, the writes the core
decides, and the reads a lease holder makes. The flows name these methods in
`saga._flows.store_ops.StoreOps` (generated from this module and `_store_verbs_async`);
`saga._db._store_drive` is generated from this module by tools/async_to_sync.py.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from datetime import datetime
from typing import Any

import psycopg
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from saga._core.planner import Event, OpRow, SagaRow, StartInSql, Write
from saga._core.rows import Loaded
from saga._db._store_base import (
    approval_params,
    batch_answers,
    batch_params,
    claim_started_params,
    claimed_started,
    loaded_batch,
    sql,
    start_answers,
    start_params,
    started,
    state_from,
    write_params,
    writes_of,
)
from saga._db._store_conn_async import (
    AConn,
    AsyncStoreConnections,
    DeferredRead,
    RowRead,
    read_loaded,
    state_answer,
    sync_pipeline,
)
from saga._db.group_async import GroupCommit
from saga.errors import SagaError
from saga.state import HistoryEvent, SagaState


class AsyncDriveStore(AsyncStoreConnections):
    """Claims, leases, starts and writes of the sagas the workers and doors drive."""

    def __init__(
        self,
        pool: AsyncConnectionPool[Any],
        *,
        transaction_settings: dict[str, str] | None = None,
        session_hash_version: bool = False,
    ) -> None:
        super().__init__(
            pool,
            transaction_settings=transaction_settings,
            session_hash_version=session_hash_version,
        )
        self.group: GroupCommit[Jsonb, SagaState | None] = GroupCommit(
            self._write_one, self._write_many
        )
        # The starts' own group commit (`start_saga`): saga.start_sagas_v1.
        # A start whose caller is cancelled before it is sent is never sent, as when starts
        # went alone.
        self.starts: GroupCommit[Jsonb, dict[str, Any]] = GroupCommit(
            self._start_one, self._start_many, withdraw_cancelled=True
        )

    async def assert_fence_txn(
        self, conn: AConn, saga_id: str, *, owner: str, fence: int, lease_seconds: float
    ) -> None:
        """Queue the fence check (and lease renewal) that fails the transaction when the
        saga is no longer ours; see `pipelined`."""
        await conn.execute(
            sql("assert_fence"),
            {"saga_id": saga_id, "owner": owner, "fence": fence, "lease_seconds": lease_seconds},
        )

    # ----- leases ----------------------------------------------------------------------

    async def claim_txn(
        self, conn: AConn, saga_id: str, *, owner: str, lease_seconds: float
    ) -> Loaded | None:
        """Take the lease of a runnable saga no live owner holds, and read what it has;
        None otherwise. In a pipeline, the claim and its reads cost one round trip."""
        claim = await conn.execute(
            sql("claim_saga"),
            {"saga_id": saga_id, "owner": owner, "lease_seconds": lease_seconds},
        )
        return await self._claimed_txn(conn, claim)

    async def claim_next_txn(
        self, conn: AConn, *, kinds: Sequence[str], owner: str, lease_seconds: float
    ) -> Loaded | None:
        """Take the lease of the longest-waiting runnable saga of the given name:version
        kinds, and read what it has; None when there is none (one round trip)."""
        claim = await conn.execute(
            sql("claim_next_saga"),
            {"kinds": list(kinds), "owner": owner, "lease_seconds": lease_seconds},
        )
        return await self._claimed_txn(conn, claim)

    async def _claimed_txn(
        self, conn: AConn, claim: psycopg.AsyncCursor[dict[str, Any]]
    ) -> Loaded | None:
        # Queued behind the claim before its row is fetched: they read the saga it claimed.
        ops = await conn.execute(sql("claimed_operations"))
        confirmations = await conn.execute(sql("claimed_confirmations"))
        await sync_pipeline(conn)
        return await read_loaded(claim, ops, confirmations)

    async def claim_batch_started_txn(
        self,
        conn: AConn,
        *,
        kinds: Sequence[str],
        owner: str,
        lease_seconds: float,
        now: datetime,
        tokens: Sequence[str],
        claim_tokens: Sequence[str],
        starts: Sequence[tuple[str, StartInSql]],
    ) -> DeferredRead[list[tuple[Loaded, bool]]]:
        """Queue a batch claim of up to `len(tokens)` sagas of these name:version kinds that
        also starts, in the same statement, the attempt of the next pending step of each
        saga whose first move is that alone (saga.claim_batch_v2, migration 0026): `starts`
        names the steps, by kind, that the database may start (`starts_in_sql`), `now` is
        the time of the decision. The reads of the claimed sagas' operations and
        confirmations are queued behind it: with the commit, one round trip.

        Returns the read, to call once the transaction has committed, of the sagas taken
        as their lease holder now has them, in run_after order, each with whether its
        attempt was started (its write token is one of `tokens`; a saga claimed only
        stores one of `claim_tokens`)."""
        claim = await conn.execute(
            sql("claim_saga_batch_started"),
            {
                "kinds": list(kinds),
                "owner": owner,
                "lease_seconds": lease_seconds,
                "limit": len(tokens),
                "now": now,
                "tokens": list(tokens),
                "claim_tokens": list(claim_tokens),
                "start_kinds": [kind for kind, _ in starts],
                "start_steps": [start.step for _, start in starts],
                "start_side_effects": [int(start.side_effect) for _, start in starts],
                "start_deadlines": [start.deadline_seconds for _, start in starts],
            },
        )
        ops = await conn.execute(sql("claimed_batch_operations"))
        confirmations = await conn.execute(sql("claimed_batch_confirmations"))
        return _DeferredClaim(claim, ops, confirmations, tokens)

    async def save_batch_txn(
        self,
        conn: AConn,
        writes: Sequence[tuple[Write, str]],
        *,
        owner: str,
        lease_seconds: float,
    ) -> DeferredRead[list[SagaState | SagaError | None]]:
        """Queue the first moves of the sagas a batch claim took, each (write, its token),
        in one statement (saga.write_sagas_v2): each write is answered on its own, so one
        that is refused (its error is its answer) leaves the others and every claim in the
        transaction. Returns the read of the answers, in order, to call once the
        transaction has committed: a saga's state when its write gave the lease back."""
        params = batch_params(writes, owner=owner, lease_seconds=lease_seconds)
        written = await conn.execute(self.hashed("write_sagas"), {"writes": params})
        conninfo = self._conninfo
        return RowRead(written, lambda row: batch_answers(row, conninfo))

    async def renew_leases(
        self, held: Collection[tuple[str, int]], *, owner: str, lease_seconds: float
    ) -> set[tuple[str, int]]:
        """Heartbeat of several leases, each a (saga id, fence); those still held."""
        params = {
            "saga_ids": [saga_id for saga_id, _ in held],
            "fences": [fence for _, fence in held],
            "owner": owner,
            "lease_seconds": lease_seconds,
        }
        async with self._connection() as conn:
            cur = await conn.execute(sql("renew_leases"), params)
            rows = await cur.fetchall()
        return {(r["id"], int(r["fence"])) for r in rows}

    async def release_lease(self, saga_id: str, *, owner: str, fence: int) -> None:
        """Give the lease back if still ours (error paths)."""
        params = {"saga_id": saga_id, "owner": owner, "fence": fence}
        async with self._connection() as conn:
            await conn.execute(sql("release_lease"), params)

    # ----- starting --------------------------------------------------------------------

    async def start_saga_txn(
        self,
        conn: AConn,
        saga: SagaRow,
        ops: Sequence[OpRow],
        events: Sequence[Event],
        *,
        lease_seconds: float,
        notify: bool,
        token: str | None = None,
    ) -> dict[str, Any]:
        """`start_saga` inside the caller's transaction."""
        start = start_params(
            saga, ops, events, lease_seconds=lease_seconds, notify=notify, token=token
        )
        return started(saga, await self._start_txn(conn, start))

    async def start_saga(
        self,
        saga: SagaRow,
        ops: Sequence[OpRow],
        events: Sequence[Event],
        *,
        lease_seconds: float,
        notify: bool,
        token: str | None = None,
    ) -> dict[str, Any]:
        """Create a saga, its operations (in their planned state) and first events in one
        statement, `token` as its write token. Returns `{"created": True, ...}`, or, when
        (tenant, name, key) exists, `{"created": False, "id", "version", "input_hash"}` of
        the existing saga.

        The statement and its commit are shared with the starts made at the same time
        (group commit, `saga._db.group`: by other threads for `Store`, other tasks of the
        event loop for `AsyncStore`): a start that finds no start on the wire goes out at
        once and alone; the starts made while one is on the wire leave together, in one
        statement (saga.start_sagas_v1), when its reply is in. Each is answered alone: a
        start refused for its own rows fails alone, and none is answered before the
        commit that made it durable."""
        start = start_params(
            saga, ops, events, lease_seconds=lease_seconds, notify=notify, token=token
        )
        return started(saga, await self.starts.write(start))

    async def _start_txn(self, conn: AConn, start: Jsonb) -> dict[str, Any]:
        cur = await conn.execute(self.hashed("start_saga"), {"start": start})
        row = await cur.fetchone()
        assert row is not None
        return dict(row["outcome"])

    async def _start_one(self, start: Jsonb) -> dict[str, Any]:
        async with self._connection() as conn:
            return await self._start_txn(conn, start)

    async def _start_many(self, batch: Sequence[Jsonb]) -> list[dict[str, Any] | SagaError]:
        async with self._connection() as conn:
            cur = await conn.execute(self.hashed("start_sagas"), {"starts": writes_of(batch)})
            row = await cur.fetchone()
        return start_answers(row, self._conninfo)

    async def claim_started(
        self, write: Write, *, start_token: str, owner: str, lease_seconds: float, token: str
    ) -> tuple[bool, SagaState | None]:
        """Claim a saga unclaimed and unchanged since the start that stored `start_token`,
        and apply `write`, its first move planned from the rows that start wrote (at fence
        1, for `owner`), in one statement (saga.claim_started_v1, migration 0020).
        `(False, None)` when the saga is no longer as started: nothing was written. Else
        `(True, its state as the write left it)`, the state None unless
        `write.return_state`."""
        claim = claim_started_params(
            write, start_token=start_token, owner=owner, lease_seconds=lease_seconds, token=token
        )
        async with self._connection() as conn:
            cur = await conn.execute(self.hashed("claim_started"), {"claim": claim})
            row = await cur.fetchone()
        assert row is not None
        return claimed_started(row["outcome"])

    async def own_claim(self, *, owner: str, token: str) -> tuple[str, str, int] | None:
        """(id, name, version) of the runnable saga leased to `owner` whose last write
        carries `token`: what a claim whose reply was lost took; None when there is none."""
        async with self._connection() as conn:
            cur = await conn.execute(sql("own_claim"), {"owner": owner, "token": token})
            row = await cur.fetchone()
        return None if row is None else (row["id"], row["name"], int(row["version"]))

    async def own_claims(self, *, owner: str, tokens: Sequence[str]) -> dict[str, str]:
        """Token by saga id of the runnable sagas leased to `owner` whose last write
        carries one of `tokens`: what a batch claim whose reply was lost took."""
        async with self._connection() as conn:
            cur = await conn.execute(sql("own_claims"), {"owner": owner, "tokens": list(tokens)})
            rows = await cur.fetchall()
        return {row["id"]: row["write_token"] for row in rows}

    async def write_token(self, saga_id: str) -> tuple[str | None, str | None] | None:
        """The token of the saga's last write and its lease owner; None when the saga
        does not exist."""
        async with self._connection() as conn:
            cur = await conn.execute(sql("write_token"), {"saga_id": saga_id})
            row = await cur.fetchone()
        if row is None:
            return None
        return row["write_token"], row["lease_owner"]

    # ----- persisting decisions --------------------------------------------------------

    async def save_txn(
        self,
        conn: AConn,
        write: Write,
        *,
        owner: str | None,
        lease_seconds: float | None = None,
        token: str | None = None,
    ) -> DeferredRead[SagaState | None]:
        """Queue a write the core decided, in one statement (saga.write_saga): the saga
        row (fenced when `owner` holds the lease; an operator passes None and holds the
        row lock instead), new and changed operations, events, and confirmations asked
        for, approved, or used up by the attempt they release. A lost fence (`LeaseLost`)
        or a confirmation that cannot be written (`StepStateError`: an approval that
        expired, or has released an attempt already) fails the transaction with
        everything in it.

        `token` (see `new_token`) is stored as the saga's write token: a writer that lost
        the reply learns from `write_token` whether this write landed.

        Returns the read of the saga's state as the write left it (None unless
        `write.return_state`), to call once the statement's result has arrived: at once
        in a plain transaction, after the block in a pipelined one."""
        params = write_params(write, owner=owner, lease_seconds=lease_seconds, token=token)
        written = await conn.execute(self.hashed("write_saga"), {"write": params})
        for approval in approval_params(write):
            await conn.execute(sql("record_approval"), approval)
        return RowRead(written, state_answer)

    async def apply_transition(
        self, write: Write, *, owner: str, lease_seconds: float, token: str | None = None
    ) -> SagaState | None:
        """Persist a lease holder's write in one statement and one round trip, shared with
        the writes other sagas driven at the same time have ready (group commit,
        `saga._db.group`: other threads for `Store`, other tasks of the event loop for
        `AsyncStore`); the saga's new state when `write.return_state`. `LeaseLost` when
        the fence no longer matches, `StepStateError` when a confirmation cannot be
        written: either fails this saga's write alone.

        A write that stores approval tokens beside it (`approval_params`) is never
        grouped: saga.write_sagas_v2 carries write_saga_v4's arguments only."""
        if approval_params(write):
            async with self._connection() as conn:
                read = await self.save_txn(
                    conn, write, owner=owner, lease_seconds=lease_seconds, token=token
                )
                return await read()
        params = write_params(write, owner=owner, lease_seconds=lease_seconds, token=token)
        return await self.group.write(params)

    async def _write_one(self, params: Jsonb) -> SagaState | None:
        async with self._connection() as conn:
            cur = await conn.execute(self.hashed("write_saga"), {"write": params})
            row = await cur.fetchone()
        return state_answer(row)

    async def _write_many(self, batch: Sequence[Jsonb]) -> list[SagaState | SagaError | None]:
        async with self._connection() as conn:
            cur = await conn.execute(self.hashed("write_sagas"), {"writes": writes_of(batch)})
            row = await cur.fetchone()
        return batch_answers(row, self._conninfo)

    async def report_spend(
        self,
        saga_id: str,
        *,
        step: str,
        kind: str,
        attempt: int,
        total: float,
        owner: str,
        fence: int,
    ) -> bool:
        """Persist `total`, what attempt `attempt` of an operation has reported with
        `ctx.spend()` so far, until its outcome counts it. Sending the same total again
        changes nothing. False when it was not written: the lease is no longer
        `owner`'s at `fence`, or that attempt's outcome is already recorded."""
        params = {
            "saga_id": saga_id,
            "step": step,
            "kind": kind,
            "attempt": attempt,
            "total": total,
            "owner": owner,
            "fence": fence,
        }
        async with self._connection() as conn:
            cur = await conn.execute(sql("report_spend"), params)
            return await cur.fetchone() is not None

    # ----- reading ---------------------------------------------------------------------

    async def load_txn(self, conn: AConn, saga_id: str) -> Loaded | None:
        """The saga row, its operations and its confirmations (in a pipeline, the three
        reads are sent together)."""
        params = {"saga_id": saga_id}
        saga = await conn.execute(sql("get_saga"), params)
        ops = await conn.execute(sql("get_operations"), params)
        confirmations = await conn.execute(sql("get_confirmations"), params)
        return await read_loaded(saga, ops, confirmations)

    async def get_state(self, saga_id: str) -> SagaState | None:
        """The user-facing state of one saga, or None."""
        async with self.transaction() as conn:
            return await self.get_state_txn(conn, saga_id)

    async def get_state_txn(self, conn: AConn, saga_id: str) -> SagaState | None:
        """The user-facing state of one saga as this transaction sees it, or None."""
        cur = await conn.execute(sql("get_saga"), {"saga_id": saga_id})
        row = await cur.fetchone()
        if row is None:
            return None
        cur = await conn.execute(sql("get_operations"), {"saga_id": saga_id})
        return state_from(row, await cur.fetchall())

    async def history(self, saga_id: str) -> list[HistoryEvent]:
        """The audit trail of a saga, oldest first."""
        async with self._connection() as conn:
            cur = await conn.execute(sql("get_history"), {"saga_id": saga_id})
            rows = await cur.fetchall()
        return [HistoryEvent.model_validate(r) for r in rows]


class _DeferredClaim:
    """The read of what `claim_batch_started_txn` took (a `DeferredRead`): the claimed
    rows, their operations and confirmations, and which sagas store one of the `started`
    tokens."""

    __slots__ = ("_claim", "_confirmations", "_ops", "_started")

    def __init__(
        self,
        claim: psycopg.AsyncCursor[dict[str, Any]],
        ops: psycopg.AsyncCursor[dict[str, Any]],
        confirmations: psycopg.AsyncCursor[dict[str, Any]],
        started: Sequence[str],
    ) -> None:
        self._claim = claim
        self._ops = ops
        self._confirmations = confirmations
        self._started = frozenset(started)

    async def __call__(self) -> list[tuple[Loaded, bool]]:
        rows = await self._claim.fetchall()
        started = {str(r["id"]) for r in rows if str(r["write_token"]) in self._started}
        batch = loaded_batch(rows, await self._ops.fetchall(), await self._confirmations.fetchall())
        return [(loaded, loaded[0].id in started) for loaded in batch]
