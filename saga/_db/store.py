# WARNING: generated from saga/_db/store_async.py by tools/async_to_sync.py:
# edit the source, then run `python tools/async_to_sync.py`. CI fails on any difference.
"""All SQL of the orchestrator: named queries from sql/queries.sql run over a connection pool.

The store is written once: `AsyncStore` (`saga._db.store_async`, over an
`AsyncConnectionPool`) is the source, and `Store` (`saga._db.store`, over a
`ConnectionPool`) is generated from it by tools/async_to_sync.py; edit the source and
regenerate (CI checks the twin). What is not I/O (the queries, the mapping of rows and
writes, the translation of errors) is `saga._db._store_base`, which both import.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any, Generic, TypeVar, cast

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from psycopg_pool import ConnectionPool

from saga._core.live_calls import RunningCall
from saga._core.planner import ConfirmationRow, Event, OpRow, SagaRow, Write
from saga._core.rows import Loaded
from saga._db._store_base import (
    DatabaseGauges,
    approval_params,
    batch_answers,
    batch_params,
    claim_started_params,
    claimed_started,
    confirmation_row,
    gauges_of,
    id_bounds,
    ledger_params,
    loaded_batch,
    loaded_from_rows,
    op_row,
    saga_row,
    settle_query,
    sql,
    start_params,
    started,
    state_from,
    state_of,
    translate,
    upgrade_params,
    write_params,
    writes_of,
)
from saga._db.group import GroupCommit
from saga._db.roles import RoleKind, check_privileges, privileges_query
from saga.errors import SagaError, StepStateError
from saga.state import Confirmation, HistoryEvent, SagaState, WorkerInfo

Conn = psycopg.Connection[dict[str, Any]]
T = TypeVar("T")


@contextmanager
def _translated(conninfo: str) -> Iterator[None]:
    """Raise what PostgreSQL or the pool raised inside the block as the orchestrator's
    error (`translate`); the transaction was rolled back with it."""
    try:
        yield
    except psycopg.Error as exc:
        raise translate(exc, conninfo) from exc


def _sync(conn: Conn) -> None:
    """End a pipeline's batch with a Sync and collect its results (the round trip a fetch
    would make anyway). A claim's transaction then waits for its client, which plans the
    first move (user code) with the saga row locked: synced, the server counts that wait
    as idle in transaction, and ends the transaction of a frozen client once it exceeds
    idle_in_transaction_session_timeout (unsynced, the server waits for the rest of the
    batch with no timeout at all)."""
    pipeline = conn._pipeline
    if isinstance(pipeline, psycopg.Pipeline):
        pipeline.sync()


def _loaded(
    saga: psycopg.Cursor[dict[str, Any]],
    ops: psycopg.Cursor[dict[str, Any]],
    confirmations: psycopg.Cursor[dict[str, Any]],
) -> Loaded | None:
    """A saga as its lease holder reads it, from the results of its three reads."""
    return loaded_from_rows(saga.fetchone(), ops.fetchall(), confirmations.fetchall())


class DeferredRead(Generic[T]):
    """The answer of a statement queued in a transaction (`save_txn`, `save_batch_txn`),
    read by calling this once the transaction has committed: at once in a plain
    transaction, after the block in a pipelined one."""

    __slots__ = ("_answer", "_cursor")

    def __init__(
        self,
        cursor: psycopg.Cursor[dict[str, Any]],
        answer: Callable[[dict[str, Any] | None], T],
    ) -> None:
        self._cursor = cursor
        self._answer = answer

    def __call__(self) -> T:
        """The statement's answer, from its result row."""
        return self._answer(self._cursor.fetchone())


def _state_answer(row: dict[str, Any] | None) -> SagaState | None:
    """The state saga.write_saga returned, from its result row (see `save_txn`)."""
    return state_of(row["state"] if row else None)


class Store:
    """Reads and writes sagas, operations and events; the only place that speaks SQL.

    The pool's connections are in autocommit mode (as the orchestrator makes them): a
    single statement commits on its own, and `transaction` or `pipelined` group several.
    """

    def __init__(
        self, pool: ConnectionPool[Any], *, transaction_settings: dict[str, str] | None = None
    ) -> None:
        self.pool = pool
        # Through a transaction pooler: the timeouts each transaction sets for itself.
        self.transaction_settings = transaction_settings
        # The pool's URL, for errors that say which database (never its password).
        self._conninfo = pool.conninfo if isinstance(pool.conninfo, str) else ""
        self.group: GroupCommit[Jsonb, SagaState | None] = GroupCommit(
            self._write_one, self._write_many
        )

    @contextmanager
    def transaction(self) -> Iterator[Conn]:
        """A connection inside one transaction, committed when the block exits cleanly."""
        with self._connection() as conn, conn.transaction():
            self._set_timeouts(conn)
            yield conn

    def _set_timeouts(self, conn: Conn) -> None:
        """The transaction's own timeouts, when the connection may not carry them
        (`transaction_settings`); queued without a round trip in a pipeline."""
        if self.transaction_settings is not None:
            conn.execute(sql("transaction_settings"), self.transaction_settings)

    @contextmanager
    def _connection(self) -> Iterator[Conn]:
        # An autocommit connection: one statement is one transaction, and costs no
        # BEGIN and COMMIT of its own (for statements that need no company). Whatever
        # psycopg raises inside leaves as the orchestrator's error (`translate`).
        with _translated(self._conninfo), self.pool.connection() as conn:
            conn.row_factory = dict_row
            yield cast(Conn, conn)

    @contextmanager
    def pipelined(self) -> Iterator[Conn]:
        """One transaction sent in a pipeline: statements go out without waiting, and the
        whole of it (BEGIN to COMMIT) costs one round trip unless a result is fetched
        inside. Results of deferred reads are fetched after the block. A failed fence check
        (`assert_fence_txn`, or a fenced `save_txn`) becomes `LeaseLost`, with everything
        queued rolled back."""
        with self._connection() as conn, conn.pipeline(), conn.transaction():
            self._set_timeouts(conn)
            yield conn

    def assert_fence_txn(
        self, conn: Conn, saga_id: str, *, owner: str, fence: int, lease_seconds: float
    ) -> None:
        """Queue the fence check (and lease renewal) that fails the transaction when the
        saga is no longer ours; see `pipelined`."""
        conn.execute(
            sql("assert_fence"),
            {"saga_id": saga_id, "owner": owner, "fence": fence, "lease_seconds": lease_seconds},
        )

    # ----- leases ----------------------------------------------------------------------

    def claim_txn(
        self, conn: Conn, saga_id: str, *, owner: str, lease_seconds: float
    ) -> Loaded | None:
        """Take the lease of a runnable saga no live owner holds, and read what it has;
        None otherwise. In a pipeline, the claim and its reads cost one round trip."""
        claim = conn.execute(
            sql("claim_saga"),
            {"saga_id": saga_id, "owner": owner, "lease_seconds": lease_seconds},
        )
        return self._claimed_txn(conn, claim)

    def claim_next_txn(
        self, conn: Conn, *, kinds: Sequence[str], owner: str, lease_seconds: float
    ) -> Loaded | None:
        """Take the lease of the longest-waiting runnable saga of the given name:version
        kinds, and read what it has; None when there is none (one round trip)."""
        claim = conn.execute(
            sql("claim_next_saga"),
            {"kinds": list(kinds), "owner": owner, "lease_seconds": lease_seconds},
        )
        return self._claimed_txn(conn, claim)

    def _claimed_txn(self, conn: Conn, claim: psycopg.Cursor[dict[str, Any]]) -> Loaded | None:
        # Queued behind the claim before its row is fetched: they read the saga it claimed.
        ops = conn.execute(sql("claimed_operations"))
        confirmations = conn.execute(sql("claimed_confirmations"))
        _sync(conn)
        return _loaded(claim, ops, confirmations)

    def claim_batch_txn(
        self, conn: Conn, *, kinds: Sequence[str], owner: str, lease_seconds: float, limit: int
    ) -> list[Loaded]:
        """Take the leases of up to `limit` runnable sagas of the given name:version kinds,
        the longest-waiting first, and read what each has (saga.claim_batch, migration
        0019): one statement, and with its reads one round trip. In run_after order."""
        claim = conn.execute(
            sql("claim_saga_batch"),
            {"kinds": list(kinds), "owner": owner, "lease_seconds": lease_seconds, "limit": limit},
        )
        ops = conn.execute(sql("claimed_batch_operations"))
        confirmations = conn.execute(sql("claimed_batch_confirmations"))
        _sync(conn)
        return loaded_batch(claim.fetchall(), ops.fetchall(), confirmations.fetchall())

    def save_batch_txn(
        self,
        conn: Conn,
        writes: Sequence[tuple[Write, str]],
        *,
        owner: str,
        lease_seconds: float,
    ) -> DeferredRead[list[SagaState | SagaError | None]]:
        """Queue the first moves of the sagas a batch claim took, each (write, its token),
        in one statement (saga.write_sagas_v1): each write is applied on its own, so one
        that is refused (its error is its answer) leaves the others and every claim in the
        transaction. Returns the read of the answers, in order, to call once the
        transaction has committed: a saga's state when its write gave the lease back."""
        params = batch_params(writes, owner=owner, lease_seconds=lease_seconds)
        written = conn.execute(sql("write_sagas"), {"writes": params})
        conninfo = self._conninfo
        return DeferredRead(written, lambda row: batch_answers(row, conninfo))

    def renew_leases(
        self, held: Collection[tuple[str, int]], *, owner: str, lease_seconds: float
    ) -> set[tuple[str, int]]:
        """Heartbeat of several leases, each a (saga id, fence); those still held."""
        params = {
            "saga_ids": [saga_id for saga_id, _ in held],
            "fences": [fence for _, fence in held],
            "owner": owner,
            "lease_seconds": lease_seconds,
        }
        with self._connection() as conn:
            cur = conn.execute(sql("renew_leases"), params)
            rows = cur.fetchall()
        return {(r["id"], int(r["fence"])) for r in rows}

    def release_lease(self, saga_id: str, *, owner: str, fence: int) -> None:
        """Give the lease back if still ours (error paths)."""
        params = {"saga_id": saga_id, "owner": owner, "fence": fence}
        with self._connection() as conn:
            conn.execute(sql("release_lease"), params)

    def start_saga_txn(
        self,
        conn: Conn,
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
        cur = conn.execute(sql("start_saga"), {"start": start})
        row = cur.fetchone()
        assert row is not None
        return started(saga, row["outcome"])

    def record_fork_txn(self, conn: Conn, source: str, fork: str) -> None:
        """Make the fork and its source name each other."""
        conn.execute(sql("record_fork"), {"source": source, "fork": fork})

    def lock_saga_txn(self, conn: Conn, saga_id: str) -> tuple[SagaRow, bool] | None:
        """The saga row locked for an operator change, and whether a live lease holds it.
        `StepStateError` when another transaction holds the row past the lock timeout (a
        lease, see the orchestrator): the saga is busy, and the change is not waited for."""
        try:
            cur = conn.execute(sql("lock_saga"), {"saga_id": saga_id})
            row = cur.fetchone()
        except psycopg.errors.LockNotAvailable:
            raise StepStateError(
                f"saga {saga_id} is busy: another transaction has held it locked longer than "
                "the lock timeout (a worker planning its next move, or frozen doing so); "
                "try again"
            ) from None
        if row is None:
            return None
        return saga_row(row), bool(row["live_lease"])

    # ----- persisting decisions ---------------------------------------------------------

    def save_txn(
        self,
        conn: Conn,
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
        written = conn.execute(sql("write_saga"), {"write": params})
        for approval in approval_params(write):
            conn.execute(sql("record_approval"), approval)
        return DeferredRead(written, _state_answer)

    def start_saga(
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
        the existing saga."""
        with self._connection() as conn:
            return self.start_saga_txn(
                conn, saga, ops, events, lease_seconds=lease_seconds, notify=notify, token=token
            )

    def claim_started(
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
        with self._connection() as conn:
            cur = conn.execute(sql("claim_started"), {"claim": claim})
            row = cur.fetchone()
        assert row is not None
        return claimed_started(row["outcome"])

    def apply_transition(
        self, write: Write, *, owner: str, lease_seconds: float, token: str | None = None
    ) -> SagaState | None:
        """Persist a lease holder's write in one statement and one round trip, shared with
        the writes other sagas driven at the same time have ready (group commit,
        `saga._db.group`: other threads for `Store`, other tasks of the event loop for
        `AsyncStore`); the saga's new state when `write.return_state`. `LeaseLost` when
        the fence no longer matches, `StepStateError` when a confirmation cannot be
        written: either fails this saga's write alone.

        A write that stores approval tokens beside it (`approval_params`) is never
        grouped: saga.write_sagas_v1 carries write_saga_v4's arguments only."""
        if approval_params(write):
            with self._connection() as conn:
                read = self.save_txn(
                    conn, write, owner=owner, lease_seconds=lease_seconds, token=token
                )
                return read()
        params = write_params(write, owner=owner, lease_seconds=lease_seconds, token=token)
        return self.group.write(params)

    def _write_one(self, params: Jsonb) -> SagaState | None:
        with self._connection() as conn:
            cur = conn.execute(sql("write_saga"), {"write": params})
            row = cur.fetchone()
        return _state_answer(row)

    def _write_many(self, batch: Sequence[Jsonb]) -> list[SagaState | SagaError | None]:
        with self._connection() as conn:
            cur = conn.execute(sql("write_sagas"), {"writes": writes_of(batch)})
            row = cur.fetchone()
        return batch_answers(row, self._conninfo)

    def write_token(self, saga_id: str) -> tuple[str | None, str | None] | None:
        """The token of the saga's last write and its lease owner; None when the saga
        does not exist."""
        with self._connection() as conn:
            cur = conn.execute(sql("write_token"), {"saga_id": saga_id})
            row = cur.fetchone()
        if row is None:
            return None
        return row["write_token"], row["lease_owner"]

    def report_spend(
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
        with self._connection() as conn:
            cur = conn.execute(sql("report_spend"), params)
            return cur.fetchone() is not None

    def own_claim(self, *, owner: str, token: str) -> tuple[str, str, int] | None:
        """(id, name, version) of the runnable saga leased to `owner` whose last write
        carries `token`: what a claim whose reply was lost took; None when there is none."""
        with self._connection() as conn:
            cur = conn.execute(sql("own_claim"), {"owner": owner, "token": token})
            row = cur.fetchone()
        return None if row is None else (row["id"], row["name"], int(row["version"]))

    def own_claims(self, *, owner: str, tokens: Sequence[str]) -> dict[str, str]:
        """Token by saga id of the runnable sagas leased to `owner` whose last write
        carries one of `tokens`: what a batch claim whose reply was lost took."""
        with self._connection() as conn:
            cur = conn.execute(sql("own_claims"), {"owner": owner, "tokens": list(tokens)})
            rows = cur.fetchall()
        return {row["id"]: row["write_token"] for row in rows}

    def database_gauges(self) -> list[DatabaseGauges]:
        """What the telemetry's gauges report of the database, per saga name that has
        something to report: parked sagas, unknown outcomes to settle, and the age of the
        longest-waiting claimable saga (one small query; see `database_gauges` in
        sql/queries.sql)."""
        with self._connection() as conn:
            cur = conn.execute(sql("database_gauges"))
            rows = cur.fetchall()
        return gauges_of(rows)

    def check_privileges(self, kind: RoleKind) -> None:
        """Raise `InsufficientPrivilege` when the connected role lacks what `kind` needs
        (`saga._db.roles`), naming what it lacks and the `saga grant` that gives it."""
        query, params = privileges_query(kind)
        with self._connection() as conn:
            cur = conn.execute(query, params)
            rows = cur.fetchall()
        check_privileges(rows, kind, self._conninfo)

    # ----- the ledger ------------------------------------------------------------------

    def ledger_claim(self, params: dict[str, Any]) -> dict[str, Any]:
        """Claim one call of a ledger channel (saga.ledger_claim, one statement): the
        verdict row."""
        with self._connection() as conn:
            cur = conn.execute(sql("ledger_claim"), ledger_params(params))
            row = cur.fetchone()
        assert row is not None
        return row

    def ledger_close(self, params: dict[str, Any]) -> dict[str, Any]:
        """End a ledger channel whose calls are all settled (saga.ledger_close)."""
        with self._connection() as conn:
            cur = conn.execute(sql("ledger_close"), params)
            row = cur.fetchone()
        assert row is not None
        return row

    def ledger_settle(self, params: dict[str, Any]) -> dict[str, Any]:
        """Record a ledger call's outcome (saga.ledger_settle), or extend its claim without
        shortening it (saga.ledger_heartbeat_v1); `LeaseLost` when the claim is no longer
        the caller's."""
        with self._connection() as conn:
            cur = conn.execute(sql(settle_query(params)), ledger_params(params))
            row = cur.fetchone()
        assert row is not None
        return row

    # ----- reading ---------------------------------------------------------------------

    def load_txn(self, conn: Conn, saga_id: str) -> Loaded | None:
        """The saga row, its operations and its confirmations (in a pipeline, the three
        reads are sent together)."""
        params = {"saga_id": saga_id}
        saga = conn.execute(sql("get_saga"), params)
        ops = conn.execute(sql("get_operations"), params)
        confirmations = conn.execute(sql("get_confirmations"), params)
        return _loaded(saga, ops, confirmations)

    def confirmations_txn(self, conn: Conn, saga_id: str) -> list[ConfirmationRow]:
        """The confirmation rows of a saga."""
        cur = conn.execute(sql("get_confirmations"), {"saga_id": saga_id})
        return [confirmation_row(r) for r in cur.fetchall()]

    def confirmations(self, saga_id: str) -> list[Confirmation]:
        """The confirmations of a saga, oldest first."""
        with self._connection() as conn:
            cur = conn.execute(sql("get_confirmations"), {"saga_id": saga_id})
            rows = cur.fetchall()
        return [Confirmation.model_validate({**r, "saga_id": saga_id}) for r in rows]

    def purge_finished(self, *, retention_seconds: float, batch_size: int) -> int:
        """Delete one batch of sagas that ended before the retention cutoff; how many."""
        params = {"retention_seconds": retention_seconds, "batch_size": batch_size}
        with self._connection() as conn:
            cur = conn.execute(sql("purge_finished_sagas"), params)
            row = cur.fetchone()
        return int(row["purged"]) if row else 0

    def purgeable(
        self, *, retention_seconds: float, limit: int
    ) -> tuple[list[dict[str, Any]], int]:
        """The sagas `purge_finished` would delete with this cutoff, oldest first (at most
        `limit`: id, name, version, status, finished_at), and how many in all."""
        params = {"retention_seconds": retention_seconds, "limit": limit}
        with self._connection() as conn:
            cur = conn.execute(sql("list_purgeable_sagas"), params)
            rows = cur.fetchall()
        return rows, int(rows[0]["total"]) if rows else 0

    def operations_txn(self, conn: Conn, saga_id: str) -> list[OpRow]:
        """The operation rows of a saga."""
        cur = conn.execute(sql("get_operations"), {"saga_id": saga_id})
        return [op_row(r) for r in cur.fetchall()]

    def get_state(self, saga_id: str) -> SagaState | None:
        """The user-facing state of one saga, or None."""
        with self.transaction() as conn:
            return self.get_state_txn(conn, saga_id)

    def get_state_txn(self, conn: Conn, saga_id: str) -> SagaState | None:
        """The user-facing state of one saga as this transaction sees it, or None."""
        cur = conn.execute(sql("get_saga"), {"saga_id": saga_id})
        row = cur.fetchone()
        if row is None:
            return None
        cur = conn.execute(sql("get_operations"), {"saga_id": saga_id})
        return state_from(row, cur.fetchall())

    def list_states(
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
        query = sql("list_sagas" if key is None else "list_sagas_by_key")
        with self.transaction() as conn:
            cur = conn.execute(query, params)
            rows = cur.fetchall()
            saga_ids = {"saga_ids": [r["id"] for r in rows]}
            cur = conn.execute(sql("get_operations_many"), saga_ids)
            ops = cur.fetchall()
        by_saga: dict[str, list[dict[str, Any]]] = {}
        for op in ops:
            by_saga.setdefault(op["saga_id"], []).append(op)
        return [state_from(r, by_saga.get(r["id"], [])) for r in rows]

    def history(self, saga_id: str) -> list[HistoryEvent]:
        """The audit trail of a saga, oldest first."""
        with self._connection() as conn:
            cur = conn.execute(sql("get_history"), {"saga_id": saga_id})
            rows = cur.fetchall()
        return [HistoryEvent.model_validate(r) for r in rows]

    def get_state_page(
        self, saga_id: str, *, limit: int, offset: int
    ) -> tuple[SagaState, int] | None:
        """The saga with one page of its operations (`limit` of them from `offset`, in
        the order `get_state` gives them), and how many operations it has; None when
        there is no such saga."""
        page = {"saga_id": saga_id, "limit": limit, "offset": offset}
        with self.transaction() as conn:
            cur = conn.execute(sql("get_saga"), {"saga_id": saga_id})
            row = cur.fetchone()
            if row is None:
                return None
            cur = conn.execute(sql("count_operations"), {"saga_id": saga_id})
            counted = cur.fetchone()
            cur = conn.execute(sql("get_operations_page"), page)
            ops = cur.fetchall()
        return state_from(row, ops), int(counted["total"]) if counted else 0

    def count_live_claims(self, saga_id: str) -> int:
        """How many calls of the ledger channel `saga_id` are held under a live claim
        (`saga.state.display_status` of a channel whose operations are read a page at a
        time)."""
        with self._connection() as conn:
            cur = conn.execute(sql("count_live_claims"), {"saga_id": saga_id})
            row = cur.fetchone()
        return int(row["total"]) if row else 0

    def history_of_operations(
        self, saga_id: str, operations: Sequence[tuple[str, str]]
    ) -> list[HistoryEvent]:
        """The audit trail of a saga, oldest first, narrowed to its saga-level events and
        those of `operations` (pairs of step and kind)."""
        params = {
            "saga_id": saga_id,
            "steps": [step for step, _ in operations],
            "kinds": [kind for _, kind in operations],
        }
        with self._connection() as conn:
            cur = conn.execute(sql("get_history_of_operations"), params)
            rows = cur.fetchall()
        return [HistoryEvent.model_validate(r) for r in rows]

    # ----- workers ---------------------------------------------------------------------

    def next_claimable_at(self, kinds: Sequence[str]) -> datetime | None:
        """When the earliest saga of these kinds becomes claimable; None when none is open."""
        with self._connection() as conn:
            cur = conn.execute(sql("next_claimable_at"), {"kinds": list(kinds)})
            row = cur.fetchone()
        return row["at"] if row else None

    def upsert_worker(
        self, *, owner: str, kinds: Sequence[str], concurrency: int, ttl_seconds: float
    ) -> None:
        """Record (or refresh) a live worker and the kinds it runs."""
        params = {
            "owner": owner,
            "kinds": list(kinds),
            "concurrency": concurrency,
            "ttl_seconds": ttl_seconds,
        }
        with self._connection() as conn:
            conn.execute(sql("upsert_worker"), params)

    def delete_worker(self, owner: str) -> None:
        """Remove a stopping worker's row (and long-dead workers' rows)."""
        with self._connection() as conn:
            conn.execute(sql("delete_worker"), {"owner": owner})

    def live_workers(self) -> list[WorkerInfo]:
        """Workers whose heartbeat is still believed, newest first."""
        with self._connection() as conn:
            cur = conn.execute(sql("live_workers"))
            rows = cur.fetchall()
        return [WorkerInfo.model_validate(r) for r in rows]

    def count_open(self, kinds: Sequence[str]) -> int:
        """How many sagas of these name:version kinds are pending, running or compensating."""
        with self._connection() as conn:
            cur = conn.execute(sql("count_open_sagas"), {"kinds": list(kinds)})
            row = cur.fetchone()
        return int(row["count"]) if row else 0

    # ----- operator jobs ---------------------------------------------------------------

    def break_lease_txn(self, conn: Conn, saga_id: str) -> int:
        """End a live lease for an operator: the fence grows, so its holder's writes fail."""
        cur = conn.execute(sql("break_lease"), {"saga_id": saga_id})
        row = cur.fetchone()
        assert row is not None  # the caller holds the saga row locked
        return int(row["fence"])

    def upgrade_saga_txn(
        self,
        conn: Conn,
        saga_id: str,
        version: int,
        drop: Sequence[tuple[str, str]],
        renames: Sequence[tuple[str, str, str, int]],
    ) -> int:
        """Move a saga the caller holds locked to `version` (see `saga.upgrade`): delete
        the `drop` rows (kind, step), rename the kept ones (kind, step, new step, new
        position), grow the fence and end any lease. Returns the new fence."""
        for name, params in upgrade_params(saga_id, version, drop, renames):
            conn.execute(sql(name), params)
        cur = conn.execute(sql("upgrade_saga"), {"saga_id": saga_id, "version": version})
        row = cur.fetchone()
        assert row is not None  # the caller holds the saga row locked
        return int(row["fence"])

    def running_calls_txn(self, conn: Conn, saga_id: str) -> list[RunningCall]:
        """The saga's operations left running, with the live claims that hold them."""
        cur = conn.execute(sql("running_calls"), {"saga_id": saga_id})
        return [RunningCall(**r) for r in cur.fetchall()]

    def operator_resolved_steps_txn(self, conn: Conn, saga_id: str) -> set[str]:
        """The steps of the saga whose action an operator resolved as succeeded."""
        cur = conn.execute(sql("operator_resolved_steps"), {"saga_id": saga_id})
        return {str(r["step"]) for r in cur.fetchall()}

    def break_claims_txn(self, conn: Conn, saga_id: str, steps: Sequence[str]) -> dict[str, int]:
        """End the live claims of these calls for an operator: each fence grows, so the
        holders' writes fail. The new fence of each call, by name."""
        cur = conn.execute(sql("break_claims"), {"saga_id": saga_id, "steps": list(steps)})
        return {r["step"]: int(r["claim_fence"]) for r in cur.fetchall()}

    def find_unsettled(self, kinds: Sequence[str], *, limit: int) -> list[dict[str, Any]]:
        """Runnable sagas of these kinds with an operation running under an expired lease,
        or unknown: id, name, version and that operation's step, kind, status and key."""
        with self._connection() as conn:
            cur = conn.execute(sql("find_unsettled_sagas"), {"kinds": list(kinds), "limit": limit})
            return cur.fetchall()

    def ids_with_prefix(self, prefix: str, *, limit: int) -> list[str]:
        """Ids of sagas that start with `prefix` (lowercase hex, dashes where a full id has
        them), in id order, at most `limit`; read through the primary key index."""
        low, high = id_bounds(prefix)
        params = {"low": low, "high": high, "pattern": prefix + "%", "limit": limit}
        with self._connection() as conn:
            cur = conn.execute(sql("saga_ids_by_prefix"), params)
            rows = cur.fetchall()
        return [str(r["id"]) for r in rows]

    def saga_refs(
        self, *, key: str | None = None, ids: Sequence[str] = (), limit: int = 0
    ) -> list[dict[str, Any]]:
        """Id, name, version, tenant_id, key and status of the sagas of business key
        `key` (at most `limit`, newest first), else of the sagas with these `ids`."""
        with self._connection() as conn:
            if key is not None:
                cur = conn.execute(sql("saga_refs_by_key"), {"key": key, "limit": limit})
            else:
                cur = conn.execute(sql("saga_refs_by_id"), {"ids": list(ids)})
            return cur.fetchall()

    def in_flight_by_version(self) -> list[tuple[str, int, str, int]]:
        """(name, version, status, how many) of the sagas not ended yet, by name and
        version."""
        with self._connection() as conn:
            cur = conn.execute(sql("in_flight_by_version"))
            rows = cur.fetchall()
        return [(r["name"], int(r["version"]), r["status"], int(r["sagas"])) for r in rows]
