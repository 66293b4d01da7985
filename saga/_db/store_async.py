"""The store's asyncio twin: the same named queries over an `AsyncConnectionPool`.

Each method is the coroutine twin of the `Store` method of the same name: same queries,
same parameters (built by the same functions of `saga._db.store`), same answers, same errors
(a lost fence is `LeaseLost`, a row locked too long is `StepStateError`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Any, cast

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from saga._core.live_calls import RunningCall
from saga._core.planner import ConfirmationRow, Event, OpRow, SagaRow, Write
from saga._db.group_async import GroupCommit
from saga._db.roles import RoleKind, check_privileges, privileges_query
from saga._db.store import (
    DatabaseGauges,
    Loaded,
    _confirmation_row,
    _op_row,
    _q,
    _saga_row,
    _state,
    _write,
    approval_params,
    batch_answers,
    batch_params,
    claim_started_params,
    claimed_started,
    gauges_of,
    ledger_params,
    loaded_batch,
    loaded_from_rows,
    settle_query,
    start_params,
    started,
    state_of,
    translate,
    upgrade_params,
    writes_of,
)
from saga.errors import SagaError, StepStateError
from saga.state import Confirmation, HistoryEvent, SagaState, WorkerInfo

AConn = psycopg.AsyncConnection[dict[str, Any]]


@asynccontextmanager
async def _translated(conninfo: str) -> AsyncIterator[None]:
    """What PostgreSQL or the pool raised, as the orchestrator's error (`store.translate`)."""
    try:
        yield
    except psycopg.Error as exc:
        raise translate(exc, conninfo) from exc


class AsyncStore:
    """Reads and writes sagas, operations and events for the asyncio door (autocommit
    connections, as `Store`)."""

    def __init__(
        self, pool: AsyncConnectionPool[Any], *, transaction_settings: dict[str, str] | None = None
    ) -> None:
        self.pool = pool
        # Through a transaction pooler: the timeouts each transaction sets for itself.
        self.transaction_settings = transaction_settings
        # The pool's URL, for errors that say which database (never its password).
        self._conninfo = pool.conninfo if isinstance(pool.conninfo, str) else ""
        self.group: GroupCommit[Jsonb, SagaState | None] = GroupCommit(
            self._write_one, self._write_many
        )

    @asynccontextmanager
    async def _connection(self) -> AsyncIterator[AConn]:
        async with _translated(self._conninfo), self.pool.connection() as conn:
            conn.row_factory = dict_row
            yield cast(AConn, conn)

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[AConn]:
        """A connection inside one transaction, committed when the block exits cleanly."""
        async with self._connection() as conn, conn.transaction():
            await self._set_timeouts(conn)
            yield conn

    async def _set_timeouts(self, conn: AConn) -> None:
        """The transaction's own timeouts, when the connection may not carry them (see
        `Store.transaction_settings`); queued without a round trip in a pipeline."""
        if self.transaction_settings is not None:
            await conn.execute(_q("transaction_settings"), self.transaction_settings)

    @asynccontextmanager
    async def pipelined(self) -> AsyncIterator[AConn]:
        """One transaction sent in a pipeline (see `Store.pipelined`)."""
        async with self._connection() as conn, conn.pipeline(), conn.transaction():
            await self._set_timeouts(conn)
            yield conn

    # ----- leases ----------------------------------------------------------------------

    async def assert_fence_txn(
        self, conn: AConn, saga_id: str, *, owner: str, fence: int, lease_seconds: float
    ) -> None:
        """Queue the fence check that fails the transaction when the saga is not ours."""
        await conn.execute(
            _q("assert_fence"),
            {"saga_id": saga_id, "owner": owner, "fence": fence, "lease_seconds": lease_seconds},
        )

    async def claim_txn(
        self, conn: AConn, saga_id: str, *, owner: str, lease_seconds: float
    ) -> Loaded | None:
        """Take the lease of a runnable saga no live owner holds, and read what it has."""
        claim = await conn.execute(
            _q("claim_saga"),
            {"saga_id": saga_id, "owner": owner, "lease_seconds": lease_seconds},
        )
        return await self._claimed_txn(conn, claim)

    async def claim_next_txn(
        self, conn: AConn, *, kinds: Sequence[str], owner: str, lease_seconds: float
    ) -> Loaded | None:
        """Take the lease of the longest-waiting runnable saga of these kinds."""
        claim = await conn.execute(
            _q("claim_next_saga"),
            {"kinds": list(kinds), "owner": owner, "lease_seconds": lease_seconds},
        )
        return await self._claimed_txn(conn, claim)

    async def _claimed_txn(
        self, conn: AConn, claim: psycopg.AsyncCursor[dict[str, Any]]
    ) -> Loaded | None:
        ops = await conn.execute(_q("claimed_operations"))
        confirmations = await conn.execute(_q("claimed_confirmations"))
        pipeline = conn._pipeline
        if isinstance(pipeline, psycopg.AsyncPipeline):
            await pipeline.sync()
        return loaded_from_rows(
            await claim.fetchone(), await ops.fetchall(), await confirmations.fetchall()
        )

    async def claim_batch_txn(
        self, conn: AConn, *, kinds: Sequence[str], owner: str, lease_seconds: float, limit: int
    ) -> list[Loaded]:
        """Take the leases of up to `limit` runnable sagas of these kinds, and read what
        each has (see `Store.claim_batch_txn`)."""
        claim = await conn.execute(
            _q("claim_saga_batch"),
            {"kinds": list(kinds), "owner": owner, "lease_seconds": lease_seconds, "limit": limit},
        )
        ops = await conn.execute(_q("claimed_batch_operations"))
        confirmations = await conn.execute(_q("claimed_batch_confirmations"))
        pipeline = conn._pipeline
        if isinstance(pipeline, psycopg.AsyncPipeline):
            await pipeline.sync()
        return loaded_batch(
            await claim.fetchall(), await ops.fetchall(), await confirmations.fetchall()
        )

    async def save_batch_txn(
        self,
        conn: AConn,
        writes: Sequence[tuple[Write, str]],
        *,
        owner: str,
        lease_seconds: float,
    ) -> Callable[[], Awaitable[list[SagaState | SagaError | None]]]:
        """Queue the first moves of a batch claim's sagas in one statement (see
        `Store.save_batch_txn`); returns the read of the answers, to await once the
        transaction committed."""
        params = batch_params(writes, owner=owner, lease_seconds=lease_seconds)
        written = await conn.execute(_q("write_sagas"), {"writes": params})
        conninfo = self._conninfo

        async def read() -> list[SagaState | SagaError | None]:
            return batch_answers(await written.fetchone(), conninfo)

        return read

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
            rows = await (await conn.execute(_q("renew_leases"), params)).fetchall()
        return {(r["id"], int(r["fence"])) for r in rows}

    async def release_lease(self, saga_id: str, *, owner: str, fence: int) -> None:
        """Give the lease back if still ours (error paths)."""
        async with self._connection() as conn:
            await conn.execute(
                _q("release_lease"), {"saga_id": saga_id, "owner": owner, "fence": fence}
            )

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
        row = await (await conn.execute(_q("start_saga"), {"start": start})).fetchone()
        assert row is not None
        return started(saga, ops, row["outcome"])

    async def record_fork_txn(self, conn: AConn, source: str, fork: str) -> None:
        """Make the fork and its source name each other."""
        await conn.execute(_q("record_fork"), {"source": source, "fork": fork})

    async def lock_saga_txn(self, conn: AConn, saga_id: str) -> tuple[SagaRow, bool] | None:
        """The saga row locked for an operator change, and whether a live lease holds it."""
        try:
            row = await (await conn.execute(_q("lock_saga"), {"saga_id": saga_id})).fetchone()
        except psycopg.errors.LockNotAvailable:
            raise StepStateError(
                f"saga {saga_id} is busy: another transaction has held it locked longer than "
                "the lock timeout (a worker planning its next move, or frozen doing so); "
                "try again"
            ) from None
        if row is None:
            return None
        return _saga_row(row), bool(row["live_lease"])

    async def break_lease_txn(self, conn: AConn, saga_id: str) -> int:
        """End a live lease for an operator: the fence grows."""
        row = await (await conn.execute(_q("break_lease"), {"saga_id": saga_id})).fetchone()
        assert row is not None  # the caller holds the saga row locked
        return int(row["fence"])

    async def upgrade_saga_txn(
        self,
        conn: AConn,
        saga_id: str,
        version: int,
        drop: Sequence[tuple[str, str]],
        renames: Sequence[tuple[str, str, str, int]],
    ) -> int:
        """Move a locked saga to `version`; see `Store.upgrade_saga_txn`."""
        for name, params in upgrade_params(saga_id, version, drop, renames):
            await conn.execute(_q(name), params)
        cur = await conn.execute(_q("upgrade_saga"), {"saga_id": saga_id, "version": version})
        row = await cur.fetchone()
        assert row is not None  # the caller holds the saga row locked
        return int(row["fence"])

    async def running_calls_txn(self, conn: AConn, saga_id: str) -> list[RunningCall]:
        """The saga's operations left running (see `Store.running_calls_txn`)."""
        cur = await conn.execute(_q("running_calls"), {"saga_id": saga_id})
        return [RunningCall(**r) for r in await cur.fetchall()]

    async def operator_resolved_steps_txn(self, conn: AConn, saga_id: str) -> set[str]:
        """The steps of the saga whose action an operator resolved as succeeded (see
        `Store.operator_resolved_steps_txn`)."""
        cur = await conn.execute(_q("operator_resolved_steps"), {"saga_id": saga_id})
        return {str(r["step"]) for r in await cur.fetchall()}

    async def break_claims_txn(
        self, conn: AConn, saga_id: str, steps: Sequence[str]
    ) -> dict[str, int]:
        """End the live claims of these calls (see `Store.break_claims_txn`)."""
        cur = await conn.execute(_q("break_claims"), {"saga_id": saga_id, "steps": list(steps)})
        return {r["step"]: int(r["claim_fence"]) for r in await cur.fetchall()}

    # ----- persisting decisions ---------------------------------------------------------

    async def save_txn(
        self,
        conn: AConn,
        write: Write,
        *,
        owner: str | None,
        lease_seconds: float | None = None,
        token: str | None = None,
    ) -> Callable[[], Awaitable[SagaState | None]]:
        """Queue a write the core decided in a transaction (see `Store.save_txn`);
        returns the read of the saga's state, to await once the transaction committed."""
        params = _write(write, owner=owner, lease_seconds=lease_seconds, token=token)
        written = await conn.execute(_q("write_saga"), {"write": params})
        for approval in approval_params(write):
            await conn.execute(_q("record_approval"), approval)

        async def read() -> SagaState | None:
            row = await written.fetchone()
            state = row["state"] if row else None
            return None if state is None else _state(state["saga"], state["operations"])

        return read

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
        """Create a saga, its operations and first events in one statement."""
        async with self._connection() as conn:
            return await self.start_saga_txn(
                conn, saga, ops, events, lease_seconds=lease_seconds, notify=notify, token=token
            )

    async def claim_started(
        self, write: Write, *, start_token: str, owner: str, lease_seconds: float, token: str
    ) -> tuple[bool, SagaState | None]:
        """Claim a saga as its start left it and apply its first move, in one statement
        (see `Store.claim_started`)."""
        claim = claim_started_params(
            write, start_token=start_token, owner=owner, lease_seconds=lease_seconds, token=token
        )
        async with self._connection() as conn:
            row = await (await conn.execute(_q("claim_started"), {"claim": claim})).fetchone()
        assert row is not None
        return claimed_started(row["outcome"])

    async def apply_transition(
        self, write: Write, *, owner: str, lease_seconds: float, token: str | None = None
    ) -> SagaState | None:
        """Persist a lease holder's write in one statement and one round trip, shared with
        the writes other sagas of this loop have ready at the same moment (group commit,
        `saga._db.group_async`): a write refused for its own saga fails that saga alone."""
        params = _write(write, owner=owner, lease_seconds=lease_seconds, token=token)
        return await self.group.write(params)

    async def _write_one(self, params: Jsonb) -> SagaState | None:
        async with self._connection() as conn:
            cursor = await conn.execute(_q("write_saga"), {"write": params})
            row = await cursor.fetchone()
        return state_of(row["state"] if row else None)

    async def _write_many(self, batch: Sequence[Jsonb]) -> list[SagaState | SagaError | None]:
        async with self._connection() as conn:
            cursor = await conn.execute(_q("write_sagas"), {"writes": writes_of(batch)})
            row = await cursor.fetchone()
        return batch_answers(row, self._conninfo)

    async def write_token(self, saga_id: str) -> tuple[str | None, str | None] | None:
        """The token of the saga's last write and its lease owner."""
        async with self._connection() as conn:
            row = await (await conn.execute(_q("write_token"), {"saga_id": saga_id})).fetchone()
        if row is None:
            return None
        return row["write_token"], row["lease_owner"]

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
        """Persist an attempt's running spend total (see `Store.report_spend`)."""
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
            return await (await conn.execute(_q("report_spend"), params)).fetchone() is not None

    async def own_claim(self, *, owner: str, token: str) -> tuple[str, str, int] | None:
        """(id, name, version) of the saga a claim whose reply was lost took."""
        async with self._connection() as conn:
            cur = await conn.execute(_q("own_claim"), {"owner": owner, "token": token})
            row = await cur.fetchone()
        return None if row is None else (row["id"], row["name"], int(row["version"]))

    async def own_claims(self, *, owner: str, tokens: Sequence[str]) -> dict[str, str]:
        """Token by saga id of the sagas a batch claim whose reply was lost took."""
        async with self._connection() as conn:
            cur = await conn.execute(_q("own_claims"), {"owner": owner, "tokens": list(tokens)})
            return {row["id"]: row["write_token"] for row in await cur.fetchall()}

    async def database_gauges(self) -> list[DatabaseGauges]:
        """What the telemetry's gauges report of the database, per saga name."""
        async with self._connection() as conn:
            cur = await conn.execute(_q("database_gauges"))
            rows = await cur.fetchall()
        return gauges_of(rows)

    async def check_privileges(self, kind: RoleKind) -> None:
        """Raise `InsufficientPrivilege` when the connected role lacks what `kind` needs
        (see `Store.check_privileges`)."""
        query, params = privileges_query(kind)
        async with self._connection() as conn:
            cur = await conn.execute(query, params)
            rows = await cur.fetchall()
        check_privileges(rows, kind, self._conninfo)

    # ----- the ledger ------------------------------------------------------------------

    async def ledger_claim(self, params: dict[str, Any]) -> dict[str, Any]:
        """Claim one call of a ledger channel (see `Store.ledger_claim`)."""
        async with self._connection() as conn:
            cur = await conn.execute(_q("ledger_claim"), ledger_params(params))
            row = await cur.fetchone()
        assert row is not None
        return row

    async def ledger_close(self, params: dict[str, Any]) -> dict[str, Any]:
        """End a ledger channel whose calls are all settled (see `Store.ledger_close`)."""
        async with self._connection() as conn:
            cur = await conn.execute(_q("ledger_close"), params)
            row = await cur.fetchone()
        assert row is not None
        return row

    async def ledger_settle(self, params: dict[str, Any]) -> dict[str, Any]:
        """Record a ledger call's outcome, or extend its claim (see `Store.ledger_settle`)."""
        async with self._connection() as conn:
            cur = await conn.execute(_q(settle_query(params)), ledger_params(params))
            row = await cur.fetchone()
        assert row is not None
        return row

    # ----- reading ---------------------------------------------------------------------

    async def load_txn(self, conn: AConn, saga_id: str) -> Loaded | None:
        """The saga row, its operations and its confirmations."""
        params = {"saga_id": saga_id}
        saga = await conn.execute(_q("get_saga"), params)
        ops = await conn.execute(_q("get_operations"), params)
        confirmations = await conn.execute(_q("get_confirmations"), params)
        return loaded_from_rows(
            await saga.fetchone(), await ops.fetchall(), await confirmations.fetchall()
        )

    async def operations_txn(self, conn: AConn, saga_id: str) -> list[OpRow]:
        """The operation rows of a saga."""
        cur = await conn.execute(_q("get_operations"), {"saga_id": saga_id})
        return [_op_row(r) for r in await cur.fetchall()]

    async def confirmations_txn(self, conn: AConn, saga_id: str) -> list[ConfirmationRow]:
        """The confirmation rows of a saga."""
        cur = await conn.execute(_q("get_confirmations"), {"saga_id": saga_id})
        return [_confirmation_row(r) for r in await cur.fetchall()]

    async def confirmations(self, saga_id: str) -> list[Confirmation]:
        """The confirmations of a saga, oldest first."""
        async with self._connection() as conn:
            cur = await conn.execute(_q("get_confirmations"), {"saga_id": saga_id})
            rows = await cur.fetchall()
        return [Confirmation.model_validate({**r, "saga_id": saga_id}) for r in rows]

    async def get_state(self, saga_id: str) -> SagaState | None:
        """The user-facing state of one saga, or None."""
        async with self.transaction() as conn:
            return await self.get_state_txn(conn, saga_id)

    async def get_state_txn(self, conn: AConn, saga_id: str) -> SagaState | None:
        """The user-facing state of one saga as this transaction sees it, or None."""
        row = await (await conn.execute(_q("get_saga"), {"saga_id": saga_id})).fetchone()
        if row is None:
            return None
        cur = await conn.execute(_q("get_operations"), {"saga_id": saga_id})
        return _state(row, await cur.fetchall())

    async def list_states(
        self,
        *,
        status: str | None,
        name: str | None,
        tenant_id: str | None,
        limit: int,
        older_than_seconds: float | None = None,
        key: str | None = None,
    ) -> list[SagaState]:
        """Sagas matching the filters, newest first, with their operations; with `key`,
        only those of that business key (read through the key index)."""
        params = {
            "status": status,
            "name": name,
            "tenant_id": tenant_id,
            "limit": limit,
            "older_than_seconds": older_than_seconds,
            "key": key,
        }
        query = _q("list_sagas" if key is None else "list_sagas_by_key")
        async with self.transaction() as conn:
            rows = await (await conn.execute(query, params)).fetchall()
            cur = await conn.execute(
                _q("get_operations_many"), {"saga_ids": [r["id"] for r in rows]}
            )
            ops = await cur.fetchall()
        by_saga: dict[str, list[dict[str, Any]]] = {}
        for op in ops:
            by_saga.setdefault(op["saga_id"], []).append(op)
        return [_state(r, by_saga.get(r["id"], [])) for r in rows]

    async def history(self, saga_id: str) -> list[HistoryEvent]:
        """The audit trail of a saga, oldest first."""
        async with self._connection() as conn:
            cur = await conn.execute(_q("get_history"), {"saga_id": saga_id})
            rows = await cur.fetchall()
        return [HistoryEvent.model_validate(r) for r in rows]

    async def purge_finished(self, *, retention_seconds: float, batch_size: int) -> int:
        """Delete one batch of sagas that ended before the retention cutoff; how many."""
        params = {"retention_seconds": retention_seconds, "batch_size": batch_size}
        async with self._connection() as conn:
            row = await (await conn.execute(_q("purge_finished_sagas"), params)).fetchone()
        return int(row["purged"]) if row else 0

    # ----- workers ---------------------------------------------------------------------

    async def next_claimable_at(self, kinds: Sequence[str]) -> datetime | None:
        """When the earliest saga of these kinds becomes claimable; None when none is open."""
        async with self._connection() as conn:
            cur = await conn.execute(_q("next_claimable_at"), {"kinds": list(kinds)})
            row = await cur.fetchone()
        return row["at"] if row else None

    async def upsert_worker(
        self, *, owner: str, kinds: Sequence[str], concurrency: int, ttl_seconds: float
    ) -> None:
        """Record (or refresh) a live worker and the kinds it runs."""
        params = {
            "owner": owner,
            "kinds": list(kinds),
            "concurrency": concurrency,
            "ttl_seconds": ttl_seconds,
        }
        async with self._connection() as conn:
            await conn.execute(_q("upsert_worker"), params)

    async def delete_worker(self, owner: str) -> None:
        """Remove a stopping worker's row (and long-dead workers' rows)."""
        async with self._connection() as conn:
            await conn.execute(_q("delete_worker"), {"owner": owner})

    async def live_workers(self) -> list[WorkerInfo]:
        """Workers whose heartbeat is still believed, newest first."""
        async with self._connection() as conn:
            rows = await (await conn.execute(_q("live_workers"))).fetchall()
        return [WorkerInfo.model_validate(r) for r in rows]

    async def count_open(self, kinds: Sequence[str]) -> int:
        """How many sagas of these kinds are pending, running or compensating."""
        async with self._connection() as conn:
            cur = await conn.execute(_q("count_open_sagas"), {"kinds": list(kinds)})
            row = await cur.fetchone()
        return int(row["count"]) if row else 0
