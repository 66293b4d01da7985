"""All SQL of the orchestrator: named queries from sql/queries.sql run over a connection pool."""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from decimal import Decimal
from typing import Any, LiteralString, cast

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from psycopg_pool import ConnectionPool

from saga._core.live_calls import RunningCall
from saga._core.planner import ConfirmationChange, ConfirmationRow, Event, OpRow, SagaRow, Write
from saga._db.database import describe_url
from saga._db.dbretry import is_transient
from saga._db.group import GroupCommit
from saga._db.roles import RoleKind, check_privileges, privileges_query
from saga._db.sqlfiles import load_queries
from saga.errors import (
    DatabaseError,
    DatabaseInterrupted,
    InsufficientPrivilege,
    LeaseLost,
    SagaError,
    SchemaMissing,
    StepStateError,
)
from saga.redact import scrub
from saga.state import (
    Confirmation,
    HistoryEvent,
    OperationState,
    OperationStatus,
    SagaState,
    SagaStatus,
    WorkerInfo,
)

Conn = psycopg.Connection[dict[str, Any]]
# A saga as read for its lease holder: its row, operations and confirmations.
Loaded = tuple[SagaRow, list[OpRow], list[ConfirmationRow]]
# SQLSTATE raised by saga.assert_fence and saga.write_saga when the lease is no longer
# the caller's.
FENCE_SQLSTATE = "SG001"
# SQLSTATE raised by saga.write_saga_v4 when a confirmation cannot be written as asked: an
# approval that expired, or that has released an attempt already.
CONFIRMATION_SQLSTATE = "SG002"


QUERIES = load_queries()


def _q(name: str) -> LiteralString:
    return QUERIES[name]


# SQLSTATEs of a statement that names a table, schema or function the database lacks.
_SCHEMA_MISSING = (
    psycopg.errors.UndefinedTable,
    psycopg.errors.InvalidSchemaName,
    psycopg.errors.UndefinedFunction,
)


def translate(exc: psycopg.Error, conninfo: str) -> SagaError:
    """The orchestrator's error for what PostgreSQL or the pool raised; the server's own
    words, with any password of `conninfo` scrubbed out.

    A refusal of the saga's SQL functions (`refused`) keeps its meaning; a missing schema
    says to run `saga migrate`; a transient failure (`is_transient`: a lost connection, a
    restart, a pool timeout, a deadlock) becomes `DatabaseInterrupted`, which the retry
    loops still recognise as transient; anything else is `DatabaseError` naming its
    SQLSTATE.
    """
    refusal = refused(exc)
    if refusal is not None:
        return refusal
    where = describe_url(conninfo) if conninfo else "the configured database"
    said = scrub(" ".join(str(exc.diag.message_primary or exc).split()), conninfo)
    if isinstance(exc, _SCHEMA_MISSING):
        return SchemaMissing(
            f"the saga schema is missing from the database at {where} ({said}); run `saga migrate`"
        )
    if is_transient(exc):
        reason = said or type(exc).__name__
        return DatabaseInterrupted(f"database work at {where} was cut off: {reason}")
    code = f" [SQLSTATE {exc.sqlstate}]" if exc.sqlstate else ""
    if isinstance(exc, psycopg.errors.InsufficientPrivilege):
        return InsufficientPrivilege(
            f"PostgreSQL at {where} refused a statement{code}: {said}; the owner of the saga "
            "schema grants a role what it needs with `saga grant reader|worker|operator ROLE`",
            sqlstate=exc.sqlstate,
        )
    return DatabaseError(
        f"PostgreSQL at {where} refused a statement{code}: {said or type(exc).__name__}",
        sqlstate=exc.sqlstate,
    )


@contextmanager
def _translated(conninfo: str) -> Iterator[None]:
    """Raise what PostgreSQL or the pool raised inside the block as the orchestrator's
    error (`translate`); the transaction was rolled back with it."""
    try:
        yield
    except psycopg.Error as exc:
        raise translate(exc, conninfo) from exc


def refusal_of(sqlstate: str, message: str, conninfo: str) -> SagaError:
    """The orchestrator's error for one write of a batch that saga.write_sagas_v1 reports
    refused, by its SQLSTATE and message (`translate`, for an error raised as a value)."""
    if sqlstate == FENCE_SQLSTATE:
        return LeaseLost(message)
    if sqlstate == CONFIRMATION_SQLSTATE:
        return StepStateError(message)
    try:
        error_class = psycopg.errors.lookup(sqlstate)
    except KeyError:
        return DatabaseError(
            f"PostgreSQL refused a write [SQLSTATE {sqlstate}]: {message}", sqlstate=sqlstate
        )
    return translate(error_class(message), conninfo)


def refused(exc: psycopg.Error) -> LeaseLost | StepStateError | None:
    """The orchestrator's error for a refusal raised by its SQL functions: a failed fence
    check (SQLSTATE SG001, from saga.assert_fence and saga.write_saga) is `LeaseLost`, a
    confirmation saga.write_saga cannot write as asked (SG002) is `StepStateError`;
    else None."""
    message = str(exc.diag.message_primary or exc)
    if exc.sqlstate == FENCE_SQLSTATE:
        return LeaseLost(message)
    if exc.sqlstate == CONFIRMATION_SQLSTATE:
        return StepStateError(message)
    return None


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


def new_token() -> str:
    """A fresh write token: each write of a saga carries its own (see `write_token`)."""
    return str(uuid.uuid4())


def parse_id(saga_id: str) -> uuid.UUID | None:
    """The UUID of a saga id string, or None when it is malformed."""
    try:
        return uuid.UUID(str(saga_id))
    except ValueError:
        return None


class Store:
    """Reads and writes sagas, operations and events; the only place that speaks SQL.

    The pool's connections are in autocommit mode (as `Orchestrator` makes them): a
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
            conn.execute(_q("transaction_settings"), self.transaction_settings)

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
            _q("assert_fence"),
            {"saga_id": saga_id, "owner": owner, "fence": fence, "lease_seconds": lease_seconds},
        )

    # ----- leases ----------------------------------------------------------------------

    def claim_txn(
        self, conn: Conn, saga_id: str, *, owner: str, lease_seconds: float
    ) -> Loaded | None:
        """Take the lease of a runnable saga no live owner holds, and read what it has;
        None otherwise. In a pipeline, the claim and its reads cost one round trip."""
        claim = conn.execute(
            _q("claim_saga"),
            {"saga_id": saga_id, "owner": owner, "lease_seconds": lease_seconds},
        )
        return self._claimed_txn(conn, claim)

    def claim_next_txn(
        self, conn: Conn, *, kinds: Sequence[str], owner: str, lease_seconds: float
    ) -> Loaded | None:
        """Take the lease of the longest-waiting runnable saga of the given name:version
        kinds, and read what it has; None when there is none (one round trip)."""
        claim = conn.execute(
            _q("claim_next_saga"),
            {"kinds": list(kinds), "owner": owner, "lease_seconds": lease_seconds},
        )
        return self._claimed_txn(conn, claim)

    def _claimed_txn(self, conn: Conn, claim: psycopg.Cursor[dict[str, Any]]) -> Loaded | None:
        # Queued behind the claim before its row is fetched: they read the saga it claimed.
        reads = conn.execute(_q("claimed_operations")), conn.execute(_q("claimed_confirmations"))
        _sync(conn)
        return _loaded(claim, *reads)

    def claim_batch_txn(
        self, conn: Conn, *, kinds: Sequence[str], owner: str, lease_seconds: float, limit: int
    ) -> list[Loaded]:
        """Take the leases of up to `limit` runnable sagas of the given name:version kinds,
        the longest-waiting first, and read what each has (saga.claim_batch, migration
        0019): one statement, and with its reads one round trip. In run_after order."""
        claim = conn.execute(
            _q("claim_saga_batch"),
            {"kinds": list(kinds), "owner": owner, "lease_seconds": lease_seconds, "limit": limit},
        )
        ops = conn.execute(_q("claimed_batch_operations"))
        confirmations = conn.execute(_q("claimed_batch_confirmations"))
        _sync(conn)
        return loaded_batch(claim.fetchall(), ops.fetchall(), confirmations.fetchall())

    def save_batch_txn(
        self,
        conn: Conn,
        writes: Sequence[tuple[Write, str]],
        *,
        owner: str,
        lease_seconds: float,
    ) -> Callable[[], list[SagaState | SagaError | None]]:
        """Queue the first moves of the sagas a batch claim took, each (write, its token),
        in one statement (saga.write_sagas_v1): each write is applied on its own, so one
        that is refused (its error is its answer) leaves the others and every claim in the
        transaction. Returns the read of the answers, in order, to call once the
        transaction has committed: a saga's state when its write gave the lease back."""
        params = batch_params(writes, owner=owner, lease_seconds=lease_seconds)
        written = conn.execute(_q("write_sagas"), {"writes": params})
        conninfo = self._conninfo

        def read() -> list[SagaState | SagaError | None]:
            return batch_answers(written.fetchone(), conninfo)

        return read

    def renew_leases(
        self, held: Collection[tuple[str, int]], *, owner: str, lease_seconds: float
    ) -> set[tuple[str, int]]:
        """Heartbeat of several leases, each a (saga id, fence); those still held."""
        ids = [saga_id for saga_id, _ in held]
        fences = [fence for _, fence in held]
        with self._connection() as conn:
            rows = conn.execute(
                _q("renew_leases"),
                {"saga_ids": ids, "fences": fences, "owner": owner, "lease_seconds": lease_seconds},
            ).fetchall()
        return {(r["id"], int(r["fence"])) for r in rows}

    def release_lease(self, saga_id: str, *, owner: str, fence: int) -> None:
        """Give the lease back if still ours (error paths)."""
        with self._connection() as conn:
            conn.execute(_q("release_lease"), {"saga_id": saga_id, "owner": owner, "fence": fence})

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
        row = conn.execute(_q("start_saga"), {"start": start}).fetchone()
        assert row is not None
        return started(saga, ops, row["outcome"])

    def record_fork_txn(self, conn: Conn, source: str, fork: str) -> None:
        """Make the fork and its source name each other."""
        conn.execute(_q("record_fork"), {"source": source, "fork": fork})

    def lock_saga_txn(self, conn: Conn, saga_id: str) -> tuple[SagaRow, bool] | None:
        """The saga row locked for an operator change, and whether a live lease holds it.
        `StepStateError` when another transaction holds the row past the lock timeout (a
        lease, see `Orchestrator`): the saga is busy, and the change is not waited for."""
        try:
            row = conn.execute(_q("lock_saga"), {"saga_id": saga_id}).fetchone()
        except psycopg.errors.LockNotAvailable:
            raise StepStateError(
                f"saga {saga_id} is busy: another transaction has held it locked longer than "
                "the lock timeout (a worker planning its next move, or frozen doing so); "
                "try again"
            ) from None
        if row is None:
            return None
        return _saga_row(row), bool(row["live_lease"])

    # ----- persisting decisions ---------------------------------------------------------

    def save_txn(
        self,
        conn: Conn,
        write: Write,
        *,
        owner: str | None,
        lease_seconds: float | None = None,
        token: str | None = None,
    ) -> Callable[[], SagaState | None]:
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
        params = _write(write, owner=owner, lease_seconds=lease_seconds, token=token)
        written = conn.execute(_q("write_saga"), {"write": params})
        for approval in approval_params(write):
            conn.execute(_q("record_approval"), approval)

        def read() -> SagaState | None:
            row = written.fetchone()
            state = row["state"] if row else None
            return None if state is None else _state(state["saga"], state["operations"])

        return read

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
            row = conn.execute(_q("claim_started"), {"claim": claim}).fetchone()
        assert row is not None
        return claimed_started(row["outcome"])

    def apply_transition(
        self, write: Write, *, owner: str, lease_seconds: float, token: str | None = None
    ) -> SagaState | None:
        """Persist a lease holder's write in one statement and one round trip, shared with
        the writes other threads have ready at the same moment (group commit,
        `saga._db.group`); the saga's new state when `write.return_state`. `LeaseLost` when
        the fence no longer matches, `StepStateError` when a confirmation cannot be
        written: either fails this saga's write alone.

        A write that stores approval tokens beside it (`approval_params`) is never
        grouped: saga.write_sagas_v1 carries write_saga_v4's arguments only."""
        if approval_params(write):
            with self._connection() as conn:
                return self.save_txn(
                    conn, write, owner=owner, lease_seconds=lease_seconds, token=token
                )()
        params = _write(write, owner=owner, lease_seconds=lease_seconds, token=token)
        return self.group.write(params)

    def _write_one(self, params: Jsonb) -> SagaState | None:
        with self._connection() as conn:
            row = conn.execute(_q("write_saga"), {"write": params}).fetchone()
        return state_of(row["state"] if row else None)

    def _write_many(self, batch: Sequence[Jsonb]) -> list[SagaState | SagaError | None]:
        with self._connection() as conn:
            row = conn.execute(_q("write_sagas"), {"writes": writes_of(batch)}).fetchone()
        return batch_answers(row, self._conninfo)

    def write_token(self, saga_id: str) -> tuple[str | None, str | None] | None:
        """The token of the saga's last write and its lease owner; None when the saga
        does not exist."""
        with self._connection() as conn:
            row = conn.execute(_q("write_token"), {"saga_id": saga_id}).fetchone()
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
            return conn.execute(_q("report_spend"), params).fetchone() is not None

    def own_claim(self, *, owner: str, token: str) -> tuple[str, str, int] | None:
        """(id, name, version) of the runnable saga leased to `owner` whose last write
        carries `token`: what a claim whose reply was lost took; None when there is none."""
        with self._connection() as conn:
            row = conn.execute(_q("own_claim"), {"owner": owner, "token": token}).fetchone()
        return None if row is None else (row["id"], row["name"], int(row["version"]))

    def own_claims(self, *, owner: str, tokens: Sequence[str]) -> dict[str, str]:
        """Token by saga id of the runnable sagas leased to `owner` whose last write
        carries one of `tokens`: what a batch claim whose reply was lost took."""
        with self._connection() as conn:
            rows = conn.execute(_q("own_claims"), {"owner": owner, "tokens": list(tokens)})
            return {row["id"]: row["write_token"] for row in rows.fetchall()}

    def database_gauges(self) -> list[DatabaseGauges]:
        """What the telemetry's gauges report of the database, per saga name that has
        something to report: parked sagas, unknown outcomes to settle, and the age of the
        longest-waiting claimable saga (one small query; see `database_gauges` in
        sql/queries.sql)."""
        with self._connection() as conn:
            rows = conn.execute(_q("database_gauges")).fetchall()
        return gauges_of(rows)

    def check_privileges(self, kind: RoleKind) -> None:
        """Raise `InsufficientPrivilege` when the connected role lacks what `kind` needs
        (`saga._db.roles`), naming what it lacks and the `saga grant` that gives it."""
        query, params = privileges_query(kind)
        with self._connection() as conn:
            rows = conn.execute(query, params).fetchall()
        check_privileges(rows, kind, self._conninfo)

    # ----- the ledger ------------------------------------------------------------------

    def ledger_claim(self, params: dict[str, Any]) -> dict[str, Any]:
        """Claim one call of a ledger channel (saga.ledger_claim, one statement): the
        verdict row."""
        with self._connection() as conn:
            row = conn.execute(_q("ledger_claim"), ledger_params(params)).fetchone()
        assert row is not None
        return row

    def ledger_close(self, params: dict[str, Any]) -> dict[str, Any]:
        """End a ledger channel whose calls are all settled (saga.ledger_close)."""
        with self._connection() as conn:
            row = conn.execute(_q("ledger_close"), params).fetchone()
        assert row is not None
        return row

    def ledger_settle(self, params: dict[str, Any]) -> dict[str, Any]:
        """Record a ledger call's outcome (saga.ledger_settle), or extend its claim without
        shortening it (saga.ledger_heartbeat_v1); `LeaseLost` when the claim is no longer
        the caller's."""
        with self._connection() as conn:
            row = conn.execute(_q(settle_query(params)), ledger_params(params)).fetchone()
        assert row is not None
        return row

    # ----- reading ---------------------------------------------------------------------

    def load_txn(self, conn: Conn, saga_id: str) -> Loaded | None:
        """The saga row, its operations and its confirmations (in a pipeline, the three
        reads are sent together)."""
        params = {"saga_id": saga_id}
        return _loaded(
            conn.execute(_q("get_saga"), params),
            conn.execute(_q("get_operations"), params),
            conn.execute(_q("get_confirmations"), params),
        )

    def confirmations_txn(self, conn: Conn, saga_id: str) -> list[ConfirmationRow]:
        """The confirmation rows of a saga."""
        rows = conn.execute(_q("get_confirmations"), {"saga_id": saga_id}).fetchall()
        return [_confirmation_row(r) for r in rows]

    def confirmations(self, saga_id: str) -> list[Confirmation]:
        """The confirmations of a saga, oldest first."""
        with self._connection() as conn:
            rows = conn.execute(_q("get_confirmations"), {"saga_id": saga_id}).fetchall()
        return [Confirmation.model_validate({**r, "saga_id": saga_id}) for r in rows]

    def purge_finished(self, *, retention_seconds: float, batch_size: int) -> int:
        """Delete one batch of sagas that ended before the retention cutoff; how many."""
        with self._connection() as conn:
            row = conn.execute(
                _q("purge_finished_sagas"),
                {"retention_seconds": retention_seconds, "batch_size": batch_size},
            ).fetchone()
        return int(row["purged"]) if row else 0

    def purgeable(
        self, *, retention_seconds: float, limit: int
    ) -> tuple[list[dict[str, Any]], int]:
        """The sagas `purge_finished` would delete with this cutoff, oldest first (at most
        `limit`: id, name, version, status, finished_at), and how many in all."""
        with self._connection() as conn:
            rows = conn.execute(
                _q("list_purgeable_sagas"),
                {"retention_seconds": retention_seconds, "limit": limit},
            ).fetchall()
        return rows, int(rows[0]["total"]) if rows else 0

    def operations_txn(self, conn: Conn, saga_id: str) -> list[OpRow]:
        """The operation rows of a saga."""
        rows = conn.execute(_q("get_operations"), {"saga_id": saga_id}).fetchall()
        return [_op_row(r) for r in rows]

    def get_state(self, saga_id: str) -> SagaState | None:
        """The user-facing state of one saga, or None."""
        with self.transaction() as conn:
            return self.get_state_txn(conn, saga_id)

    def get_state_txn(self, conn: Conn, saga_id: str) -> SagaState | None:
        """The user-facing state of one saga as this transaction sees it, or None."""
        row = conn.execute(_q("get_saga"), {"saga_id": saga_id}).fetchone()
        if row is None:
            return None
        ops = conn.execute(_q("get_operations"), {"saga_id": saga_id}).fetchall()
        return _state(row, ops)

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
        with self.transaction() as conn:
            rows = conn.execute(
                _q("list_sagas" if key is None else "list_sagas_by_key"),
                {
                    "status": status,
                    "name": name,
                    "tenant_id": tenant_id,
                    "limit": limit,
                    "older_than_seconds": older_than_seconds,
                    "key": key,
                },
            ).fetchall()
            ops = conn.execute(
                _q("get_operations_many"), {"saga_ids": [r["id"] for r in rows]}
            ).fetchall()
        by_saga: dict[str, list[dict[str, Any]]] = {}
        for op in ops:
            by_saga.setdefault(op["saga_id"], []).append(op)
        return [_state(r, by_saga.get(r["id"], [])) for r in rows]

    def history(self, saga_id: str) -> list[HistoryEvent]:
        """The audit trail of a saga, oldest first."""
        with self._connection() as conn:
            rows = conn.execute(_q("get_history"), {"saga_id": saga_id}).fetchall()
        return [HistoryEvent.model_validate(r) for r in rows]

    def get_state_page(
        self, saga_id: str, *, limit: int, offset: int
    ) -> tuple[SagaState, int] | None:
        """The saga with one page of its operations (`limit` of them from `offset`, in
        the order `get_state` gives them), and how many operations it has; None when
        there is no such saga."""
        with self.transaction() as conn:
            row = conn.execute(_q("get_saga"), {"saga_id": saga_id}).fetchone()
            if row is None:
                return None
            counted = conn.execute(_q("count_operations"), {"saga_id": saga_id}).fetchone()
            ops = conn.execute(
                _q("get_operations_page"), {"saga_id": saga_id, "limit": limit, "offset": offset}
            ).fetchall()
        return _state(row, ops), int(counted["total"]) if counted else 0

    def count_live_claims(self, saga_id: str) -> int:
        """How many calls of the ledger channel `saga_id` are held under a live claim
        (`saga.state.display_status` of a channel whose operations are read a page at a
        time)."""
        with self._connection() as conn:
            row = conn.execute(_q("count_live_claims"), {"saga_id": saga_id}).fetchone()
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
            rows = conn.execute(_q("get_history_of_operations"), params).fetchall()
        return [HistoryEvent.model_validate(r) for r in rows]

    def next_claimable_at(self, kinds: Sequence[str]) -> datetime | None:
        """When the earliest saga of these kinds becomes claimable; None when none is open."""
        with self._connection() as conn:
            row = conn.execute(_q("next_claimable_at"), {"kinds": list(kinds)}).fetchone()
        return row["at"] if row else None

    def upsert_worker(
        self, *, owner: str, kinds: Sequence[str], concurrency: int, ttl_seconds: float
    ) -> None:
        """Record (or refresh) a live worker and the kinds it runs."""
        with self._connection() as conn:
            conn.execute(
                _q("upsert_worker"),
                {
                    "owner": owner,
                    "kinds": list(kinds),
                    "concurrency": concurrency,
                    "ttl_seconds": ttl_seconds,
                },
            )

    def delete_worker(self, owner: str) -> None:
        """Remove a stopping worker's row (and long-dead workers' rows)."""
        with self._connection() as conn:
            conn.execute(_q("delete_worker"), {"owner": owner})

    def live_workers(self) -> list[WorkerInfo]:
        """Workers whose heartbeat is still believed, newest first."""
        with self._connection() as conn:
            rows = conn.execute(_q("live_workers")).fetchall()
        return [WorkerInfo.model_validate(r) for r in rows]

    def count_open(self, kinds: Sequence[str]) -> int:
        """How many sagas of these name:version kinds are pending, running or compensating."""
        with self._connection() as conn:
            row = conn.execute(_q("count_open_sagas"), {"kinds": list(kinds)}).fetchone()
        return int(row["count"]) if row else 0

    # ----- operator jobs ---------------------------------------------------------------

    def break_lease_txn(self, conn: Conn, saga_id: str) -> int:
        """End a live lease for an operator: the fence grows, so its holder's writes fail."""
        row = conn.execute(_q("break_lease"), {"saga_id": saga_id}).fetchone()
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
            conn.execute(_q(name), params)
        row = conn.execute(_q("upgrade_saga"), {"saga_id": saga_id, "version": version}).fetchone()
        assert row is not None  # the caller holds the saga row locked
        return int(row["fence"])

    def running_calls_txn(self, conn: Conn, saga_id: str) -> list[RunningCall]:
        """The saga's operations left running, with the live claims that hold them."""
        rows = conn.execute(_q("running_calls"), {"saga_id": saga_id}).fetchall()
        return [RunningCall(**r) for r in rows]

    def operator_resolved_steps_txn(self, conn: Conn, saga_id: str) -> set[str]:
        """The steps of the saga whose action an operator resolved as succeeded."""
        rows = conn.execute(_q("operator_resolved_steps"), {"saga_id": saga_id}).fetchall()
        return {str(r["step"]) for r in rows}

    def break_claims_txn(self, conn: Conn, saga_id: str, steps: Sequence[str]) -> dict[str, int]:
        """End the live claims of these calls for an operator: each fence grows, so the
        holders' writes fail. The new fence of each call, by name."""
        rows = conn.execute(
            _q("break_claims"), {"saga_id": saga_id, "steps": list(steps)}
        ).fetchall()
        return {r["step"]: int(r["claim_fence"]) for r in rows}

    def find_unsettled(self, kinds: Sequence[str], *, limit: int) -> list[dict[str, Any]]:
        """Runnable sagas of these kinds with an operation running under an expired lease,
        or unknown: id, name, version and that operation's step, kind, status and key."""
        with self._connection() as conn:
            return conn.execute(
                _q("find_unsettled_sagas"), {"kinds": list(kinds), "limit": limit}
            ).fetchall()

    def ids_with_prefix(self, prefix: str, *, limit: int) -> list[str]:
        """Ids of sagas that start with `prefix` (lowercase hex, dashes where a full id has
        them), in id order, at most `limit`; read through the primary key index."""
        digits = prefix.replace("-", "")
        low = str(uuid.UUID(digits.ljust(32, "0")))
        high = str(uuid.UUID(digits.ljust(32, "f")))
        with self._connection() as conn:
            rows = conn.execute(
                _q("saga_ids_by_prefix"),
                {"low": low, "high": high, "pattern": prefix + "%", "limit": limit},
            ).fetchall()
        return [str(r["id"]) for r in rows]

    def saga_refs(
        self, *, key: str | None = None, ids: Sequence[str] = (), limit: int = 0
    ) -> list[dict[str, Any]]:
        """Id, name, version, tenant_id, key and status of the sagas of business key
        `key` (at most `limit`, newest first), else of the sagas with these `ids`."""
        with self._connection() as conn:
            if key is not None:
                params: dict[str, Any] = {"key": key, "limit": limit}
                return conn.execute(_q("saga_refs_by_key"), params).fetchall()
            return conn.execute(_q("saga_refs_by_id"), {"ids": list(ids)}).fetchall()

    def in_flight_by_version(self) -> list[tuple[str, int, str, int]]:
        """(name, version, status, how many) of the sagas not ended yet, by name and
        version."""
        with self._connection() as conn:
            rows = conn.execute(_q("in_flight_by_version")).fetchall()
        return [(r["name"], int(r["version"]), r["status"], int(r["sagas"])) for r in rows]


_FIELD_NAMES: dict[type[Any], tuple[str, ...]] = {}


def settle_query(params: dict[str, Any]) -> str:
    """The statement of a ledger holder's write: a heartbeat, or an outcome."""
    return "ledger_heartbeat" if params["outcome"] == "heartbeat" else "ledger_settle"


def ledger_params(params: dict[str, Any]) -> dict[str, Any]:
    """The parameters of a ledger statement, its JSON values (`request`, `result`) as
    jsonb."""
    return {
        name: Jsonb(value) if name in ("request", "result") and value is not None else value
        for name, value in params.items()
    }


def _columns(cls: type[Any], row: dict[str, Any]) -> dict[str, Any]:
    """The columns of `row` that are fields of the dataclass `cls`, numerics as floats."""
    names = _FIELD_NAMES.get(cls)
    if names is None:
        # dataclasses.fields() rebuilds its answer on every call; rows come by the thousand.
        names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
    out = {name: row[name] for name in names if name in row}
    for name, value in out.items():
        if isinstance(value, Decimal):
            # numeric columns (budgets, costs) are plain floats in Python.
            out[name] = float(value)
    return out


def _saga_row(row: dict[str, Any]) -> SagaRow:
    fields = _columns(SagaRow, row)
    fields["id"], fields["status"] = str(row["id"]), SagaStatus(row["status"])
    for name in ("forked_from", "forked_to"):
        if name in fields:
            fields[name] = _text(fields[name])
    return SagaRow(**fields)


def _loaded(
    saga: psycopg.Cursor[dict[str, Any]],
    ops: psycopg.Cursor[dict[str, Any]],
    confirmations: psycopg.Cursor[dict[str, Any]],
) -> Loaded | None:
    """A saga as its lease holder reads it, from the results of its three reads."""
    return loaded_from_rows(saga.fetchone(), ops.fetchall(), confirmations.fetchall())


def loaded_from_rows(
    row: dict[str, Any] | None,
    ops: Sequence[dict[str, Any]],
    confirmations: Sequence[dict[str, Any]],
) -> Loaded | None:
    """A saga as its lease holder reads it, from the rows of its three reads."""
    if row is None:
        return None
    return (
        _saga_row(row),
        [_op_row(r) for r in ops],
        [_confirmation_row(r) for r in confirmations],
    )


def loaded_batch(
    rows: Sequence[dict[str, Any]],
    ops: Sequence[dict[str, Any]],
    confirmations: Sequence[dict[str, Any]],
) -> list[Loaded]:
    """The sagas a batch claim took, as their lease holder reads them, in run_after order,
    from the claimed rows and the operations and confirmations of all of them."""
    ops_of: dict[str, list[dict[str, Any]]] = {}
    for op in ops:
        ops_of.setdefault(str(op["saga_id"]), []).append(op)
    confirmations_of: dict[str, list[dict[str, Any]]] = {}
    for confirmation in confirmations:
        confirmations_of.setdefault(str(confirmation["saga_id"]), []).append(confirmation)
    batch: list[Loaded] = []
    for row in sorted(rows, key=lambda r: (r["run_after"], str(r["id"]))):
        saga_id = str(row["id"])
        loaded = loaded_from_rows(row, ops_of.get(saga_id, []), confirmations_of.get(saga_id, []))
        assert loaded is not None
        batch.append(loaded)
    return batch


def upgrade_params(
    saga_id: str,
    version: int,
    drop: Sequence[tuple[str, str]],
    renames: Sequence[tuple[str, str, str, int]],
) -> list[tuple[str, dict[str, Any]]]:
    """The statements (query name, parameters) that change an upgraded saga's operations,
    in order: drop, then rename in two halves (see saga/sql/queries.sql)."""
    dropped = [{"kind": kind, "step": step} for kind, step in drop]
    renamed = [
        {"kind": kind, "step": step, "to_step": to, "position": position}
        for kind, step, to, position in renames
    ]
    statements: list[tuple[str, dict[str, Any]]] = []
    if dropped:
        statements.append(("upgrade_drop_operations", {"saga_id": saga_id, "ops": Jsonb(dropped)}))
    if renamed:
        statements.append(("upgrade_park_operations", {"saga_id": saga_id, "ops": Jsonb(renamed)}))
        statements.append(
            ("upgrade_rename_operations", {"saga_id": saga_id, "ops": Jsonb(renamed)})
        )
    return statements


def batch_params(writes: Sequence[tuple[Write, str]], *, owner: str, lease_seconds: float) -> Jsonb:
    """The argument of saga.write_sagas_v1 for lease holders' writes, each with its token."""
    return Jsonb(
        [
            _write(write, owner=owner, lease_seconds=lease_seconds, token=token).obj
            for write, token in writes
        ],
        dumps=_dumps,
    )


def batch_answers(row: dict[str, Any] | None, conninfo: str) -> list[SagaState | SagaError | None]:
    """What saga.write_sagas_v1 answered for each write, in order: the saga's state (None
    unless the write asked for it), or the error that refused that write alone."""
    assert row is not None
    return [
        refusal_of(result["sqlstate"], result["message"], conninfo)
        if "sqlstate" in result
        else state_of(result["state"])
        for result in row["results"]
    ]


def _confirmation_row(row: dict[str, Any]) -> ConfirmationRow:
    return ConfirmationRow(
        step=row["step"],
        request_hash=row["request_hash"],
        preview=row["preview"],
        expires_at=row["expires_at"],
        approved_by=row["approved_by"],
        approved_at=row["approved_at"],
        consumed_attempt=row["consumed_attempt"],
        approval=row.get("approval"),
    )


def _op_row(row: dict[str, Any]) -> OpRow:
    fields = _columns(OpRow, row)
    fields["status"] = OperationStatus(row["status"])
    return OpRow(**fields)


def _write(
    write: Write, *, owner: str | None, lease_seconds: float | None, token: str | None
) -> Jsonb:
    """The argument of saga.write_saga_v4 (migration 0013) for a write of the core."""
    saga = write.saga
    params = _compact(
        {
            "saga_id": saga.id,
            "owner": owner,
            "fence": saga.fence if owner is not None else None,
            "lease_seconds": lease_seconds,
            "release": write.release,
            "notify": f"{saga.name}:{saga.version}" if write.notify else None,
            "return_state": write.return_state,
            "token": token,
            "saga": _compact(
                {
                    "status": saga.status.value,
                    "direction": saga.direction,
                    "error": saga.error,
                    "run_after": saga.run_after,
                    "operations_executed": saga.operations_executed,
                    "spent": saga.spent,
                    "side_effects": saga.side_effects,
                    "max_operations": saga.max_operations,
                    "spend_budget": saga.spend_budget,
                    "max_side_effects": saga.max_side_effects,
                    "deadline_at": saga.deadline_at,
                }
            ),
            "new_ops": [_new_op_params(op) for op in write.new_ops] or None,
            "ops": [_op_params(op) for op in write.changed_ops] or None,
            "events": _event_rows(write.events) or None,
            "confirmations": [_confirmation_params(c) for c in write.confirmations] or None,
        }
    )
    return Jsonb(params, dumps=_dumps)


def _confirmation_params(change: ConfirmationChange) -> dict[str, Any]:
    """A confirmation to ask for, approve or use up, for saga.write_saga_v4 (0013)."""
    row = change.row
    return _compact(
        {
            "action": change.action,
            "step": row.step,
            "request_hash": row.request_hash,
            "preview": row.preview if change.action == "ask" else None,
            "expires_at": row.expires_at if change.action == "ask" else None,
            "actor": (row.approved_by or "") if change.action == "approve" else None,
            "attempt": row.consumed_attempt if change.action == "consume" else None,
        }
    )


def approval_params(write: Write) -> list[dict[str, Any]]:
    """The approval tokens of the confirmations `write` approves, for `record_approval`.

    Only an operator's change approves (`confirm`), in a transaction of its own, so the
    token is stored in the transaction that approves its confirmation."""
    saga_id = write.saga.id
    return [
        {
            "saga_id": saga_id,
            "step": change.row.step,
            "request_hash": change.row.request_hash,
            "approval": change.row.approval,
        }
        for change in write.confirmations
        if change.action == "approve"
    ]


def _new_op_params(op: OpRow) -> dict[str, Any]:
    """Every column of an operation row to create, for a JSON batch (NULLs left out)."""
    return {
        "position": op.position,
        "idempotency_key": op.idempotency_key,
        **_op_params(op),
    }


def _op_params(op: OpRow) -> dict[str, Any]:
    """The mutable columns of an operation row, for a JSON batch. A missing key reads as
    NULL there (jsonb_to_recordset), so NULL columns are left out of what is sent."""
    row = {
        "kind": op.kind,
        "step": op.step,
        "status": op.status.value,
        "attempts": op.attempts,
        "max_attempts": op.max_attempts,
        "next_attempt_at": op.next_attempt_at,
        "result": op.result,
        "provider_reference": op.provider_reference,
        "error": op.error,
        "started_at": op.started_at,
        "finished_at": op.finished_at,
        "request_hash": op.request_hash,
        "request": op.request,
        "deadline_at": op.deadline_at,
        "cost": op.cost,
        "reconcile_started_at": op.reconcile_started_at,
        "reconcile_asks": op.reconcile_asks,
        "retrying_unknown": op.retrying_unknown,
        "spent": op.spent,
        "attempt_spend": op.attempt_spend,
        "peak_spend": op.peak_spend,
    }
    return _compact(row)


def _compact(row: dict[str, Any]) -> dict[str, Any]:
    # For JSON read by jsonb_to_recordset or ->>, where a missing key is NULL.
    return {k: v for k, v in row.items() if v is not None}


def _event_rows(events: Sequence[Event]) -> list[dict[str, Any]]:
    """Audit events for a JSON batch; NULL columns and an empty detail are left out."""
    rows: list[dict[str, Any]] = []
    for e in events:
        row: dict[str, Any] = {"event": e.event}
        if e.step is not None:
            row["step"] = e.step
            row["kind"] = e.kind
        if e.attempt is not None:
            row["attempt"] = e.attempt
        if e.detail:
            row["detail"] = e.detail
        rows.append(row)
    return rows


def _dumps(value: Any) -> str:
    return json.dumps(value, default=_encode_extra, separators=(",", ":"))


def _encode_extra(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"cannot store {type(value).__name__} in a batch row")


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


def writes_of(batch: Sequence[Jsonb]) -> Jsonb:
    """The argument of saga.write_sagas_v1 (migration 0014): the `_write` arguments of
    several sagas' writes, in order."""
    return Jsonb([params.obj for params in batch], dumps=_dumps)


def state_of(written: dict[str, Any] | None) -> SagaState | None:
    """The state saga.write_saga_v4 returned (`return_state`), or None."""
    return None if written is None else _state(written["saga"], written["operations"])


def _state(row: dict[str, Any], ops: Sequence[dict[str, Any]]) -> SagaState:
    return SagaState.model_validate(
        {
            **row,
            "id": str(row["id"]),
            "saga": row["name"],
            "forked_from": _text(row.get("forked_from")),
            "forked_to": _text(row.get("forked_to")),
            "operations": [OperationState.model_validate(op) for op in ops],
        }
    )


@dataclasses.dataclass(frozen=True, slots=True)
class DatabaseGauges:
    """What the telemetry's gauges report of the sagas of one name (`database_gauges`)."""

    saga: str
    needs_review: int
    unknown_outcomes: int
    oldest_runnable_seconds: float


def gauges_of(rows: Sequence[dict[str, Any]]) -> list[DatabaseGauges]:
    """The rows of the `database_gauges` query, typed."""
    return [
        DatabaseGauges(
            saga=str(r["name"]),
            needs_review=int(r["needs_review"]),
            unknown_outcomes=int(r["unknown_outcomes"]),
            oldest_runnable_seconds=float(r["oldest_runnable_seconds"]),
        )
        for r in rows
    ]


def start_params(
    saga: SagaRow,
    ops: Sequence[OpRow],
    events: Sequence[Event],
    *,
    lease_seconds: float,
    notify: bool,
    token: str | None = None,
) -> Jsonb:
    """The argument of saga.start_saga_v3 for a new saga, its operations and first events;
    `token` is the start's write token (migration 0020)."""
    start = {
        "lease_seconds": lease_seconds,
        "token": token,
        "notify": f"{saga.name}:{saga.version}" if notify else None,
        "row": {
            "id": saga.id,
            "name": saga.name,
            "version": saga.version,
            "tenant_id": saga.tenant_id,
            "key": saga.key,
            "input": saga.input,
            "input_hash": saga.input_hash,
            "status": saga.status.value,
            "direction": saga.direction,
            "error": saga.error,
            "lease_owner": saga.lease_owner,
            "fence": saga.fence,
            "max_operations": saga.max_operations,
            "deadline_at": saga.deadline_at,
            "spend_budget": saga.spend_budget,
            "max_side_effects": saga.max_side_effects,
            "operations_executed": saga.operations_executed,
            "spent": saga.spent,
            "side_effects": saga.side_effects,
            "trace_context": saga.trace_context,
        },
        "new_ops": [_new_op_params(op) for op in ops],
        "events": _event_rows(events),
    }
    return Jsonb(start, dumps=_dumps)


def claim_started_params(
    write: Write, *, start_token: str, owner: str, lease_seconds: float, token: str
) -> Jsonb:
    """The argument of saga.claim_started_v1 (migration 0020)."""
    saga_id = write.saga.id
    claim = {
        "saga_id": saga_id,
        "start_token": start_token,
        "owner": owner,
        "lease_seconds": lease_seconds,
        "write": _write(write, owner=owner, lease_seconds=lease_seconds, token=token).obj,
    }
    return Jsonb(claim, dumps=_dumps)


def claimed_started(outcome: dict[str, Any]) -> tuple[bool, SagaState | None]:
    """What saga.claim_started_v1 answered: whether it claimed, and the state its write
    returned (`return_state`)."""
    if not outcome["claimed"]:
        return False, None
    return True, state_of(outcome["state"])


def started(saga: SagaRow, ops: Sequence[OpRow], outcome: dict[str, Any]) -> dict[str, Any]:
    """What saga.start_saga answered, with the new rows marked as written when it created
    the saga (see `Store.start_saga`)."""
    if not outcome["created"] and str(outcome["id"]) == saga.id:
        # This very start, retried after its reply was lost: it had landed. The saga
        # is ours, created as planned (its id is new to every start).
        outcome = {"created": True}
    if outcome["created"]:
        for op in ops:
            op.new = op.dirty = False
        for name in ("run_after", "created_at", "updated_at"):
            if name in outcome:
                setattr(saga, name, datetime.fromisoformat(outcome[name]))
    return outcome
