"""What the store and its twin share that is not I/O: the named queries, the mapping of
rows to the core's row types and of the core's writes to the SQL functions' arguments, and
the translation of PostgreSQL's errors into the orchestrator's.

The store's modules (`saga._db.store_async` and its parts, the sources, and the twins
generated from them) import these; nothing here opens a connection or waits.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Callable, Sequence
from datetime import datetime
from decimal import Decimal
from typing import Any, LiteralString, TypeVar

import orjson
import psycopg
from psycopg.types.json import Jsonb

from saga._core.planner import ConfirmationChange, ConfirmationRow, Event, OpRow, SagaRow, Write
from saga._core.rows import Loaded
from saga._db.database import describe_url
from saga._db.dbretry import is_transient
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
    DatabaseGauges,
    OperationState,
    OperationStatus,
    SagaState,
    SagaStatus,
)

# SQLSTATE raised by saga.assert_fence and saga.write_saga when the lease is no longer
# the caller's.
FENCE_SQLSTATE = "SG001"
# SQLSTATE raised by saga.write_saga_v4 when a confirmation cannot be written as asked: an
# approval that expired, or that has released an attempt already.
CONFIRMATION_SQLSTATE = "SG002"


QUERIES = load_queries()

T = TypeVar("T")


def sql(name: str) -> LiteralString:
    """The text of the named query `name` (saga/sql/queries.sql)."""
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


def refusal_of(sqlstate: str, message: str, conninfo: str) -> SagaError:
    """The orchestrator's error for one write of a batch that saga.write_sagas_v2 reports
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


def id_bounds(prefix: str) -> tuple[str, str]:
    """The lowest and the highest saga id that start with `prefix` (lowercase hex, dashes
    where a full id has them): the range of the primary key index to read."""
    digits = prefix.replace("-", "")
    return str(uuid.UUID(digits.ljust(32, "0"))), str(uuid.UUID(digits.ljust(32, "f")))


def parse_id(saga_id: str) -> uuid.UUID | None:
    """The UUID of a saga id string, or None when it is malformed."""
    try:
        return uuid.UUID(str(saga_id))
    except ValueError:
        return None


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


# The numeric columns of each row the core reads (budgets, costs, spend): psycopg reads
# them as Decimal, the rows hold floats. Named here, and checked against the rows' float
# fields by the unit tests, so that a new float field is not read as a Decimal unseen.
NUMERIC_COLUMNS: dict[type[Any], frozenset[str]] = {
    SagaRow: frozenset({"spend_budget", "spent"}),
    OpRow: frozenset({"cost", "spent", "attempt_spend", "peak_spend"}),
}
# The field names of each row, read once: dataclasses.fields() rebuilds its answer on
# every call, and rows come by the thousand.
_FIELD_NAMES: dict[type[Any], tuple[str, ...]] = {
    cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in NUMERIC_COLUMNS
}


def _columns(cls: type[Any], row: dict[str, Any]) -> dict[str, Any]:
    """The columns of `row` that are fields of the row `cls`, numerics as floats."""
    out = {name: row[name] for name in _FIELD_NAMES[cls] if name in row}
    for name in NUMERIC_COLUMNS[cls]:
        value = out.get(name)
        if isinstance(value, Decimal):
            out[name] = float(value)
    return out


def saga_row(row: dict[str, Any]) -> SagaRow:
    """The core's row of a saga, from a `saga.sagas` row."""
    fields = _columns(SagaRow, row)
    fields["id"], fields["status"] = str(row["id"]), SagaStatus(row["status"])
    for name in ("forked_from", "forked_to"):
        if name in fields:
            fields[name] = _text(fields[name])
    return SagaRow(**fields)


def loaded_from_rows(
    row: dict[str, Any] | None,
    ops: Sequence[dict[str, Any]],
    confirmations: Sequence[dict[str, Any]],
) -> Loaded | None:
    """A saga as its lease holder reads it, from the rows of its three reads."""
    if row is None:
        return None
    return (
        saga_row(row),
        [op_row(r) for r in ops],
        [confirmation_row(r) for r in confirmations],
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
    """The argument of saga.write_sagas_v2 for lease holders' writes, each with its token."""
    return Jsonb(
        [
            write_params(write, owner=owner, lease_seconds=lease_seconds, token=token).obj
            for write, token in writes
        ],
        dumps=_dumps,
    )


def batch_answers(row: dict[str, Any] | None, conninfo: str) -> list[SagaState | SagaError | None]:
    """What saga.write_sagas_v2 answered for each write, in order: the saga's state (None
    unless the write asked for it), or the error that refused that write alone."""
    return _each_answer(row, conninfo, lambda result: state_of(result["state"]))


def start_answers(row: dict[str, Any] | None, conninfo: str) -> list[dict[str, Any] | SagaError]:
    """What saga.start_sagas_v1 answered for each start, in order: its outcome, as
    saga.start_saga_v3 answers it (see `started`), or the error that refused that start
    alone."""
    return _each_answer(row, conninfo, lambda result: dict(result["outcome"]))


def _each_answer(
    row: dict[str, Any] | None, conninfo: str, answer: Callable[[dict[str, Any]], T]
) -> list[T | SagaError]:
    """The results of a grouped statement, in order: `answer` of each, or the error that
    refused it alone (`{"sqlstate", "message"}`)."""
    assert row is not None
    return [
        refusal_of(result["sqlstate"], result["message"], conninfo)
        if "sqlstate" in result
        else answer(result)
        for result in row["results"]
    ]


def confirmation_row(row: dict[str, Any]) -> ConfirmationRow:
    """The core's row of a confirmation, from a `saga.confirmations` row."""
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


def op_row(row: dict[str, Any]) -> OpRow:
    """The core's row of an operation, from a `saga.operations` row."""
    fields = _columns(OpRow, row)
    fields["status"] = OperationStatus(row["status"])
    return OpRow(**fields)


def write_params(
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
        "status": op.status._value_,
        "attempts": op.attempts,
        "max_attempts": op.max_attempts,
        "request_hash": op.request_hash,
        "reconcile_asks": op.reconcile_asks,
        "retrying_unknown": op.retrying_unknown,
        "spent": op.spent,
        "attempt_spend": op.attempt_spend,
        "peak_spend": op.peak_spend,
    }
    # The columns above are never None (a None there would read as NULL all the same);
    # those that are often NULL are looked at one by one (building every column and then
    # dropping the NULLs costs twice as much, for every operation of every write).
    for name in _NULLABLE_OP_COLUMNS:
        value = getattr(op, name)
        if value is not None:
            row[name] = value
    return row


_NULLABLE_OP_COLUMNS = (
    "next_attempt_at",
    "result",
    "provider_reference",
    "error",
    "started_at",
    "finished_at",
    "request",
    "deadline_at",
    "cost",
    "reconcile_started_at",
)


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


def _dumps(value: Any) -> bytes | str:
    """The JSON text of a write's parameters: orjson's, which costs a tenth of the json
    module's here (datetimes included, as isoformat() writes them), else the json
    module's for what orjson refuses (an integer beyond 64 bits, a non-str key, a string
    that is not valid Unicode, deeper nesting), which it encodes or refuses as before.
    Every float reaching here is finite (amounts, input and results are checked so): a
    NaN would be null in orjson's text, not refused."""
    try:
        return orjson.dumps(value, default=_encode_extra, option=orjson.OPT_PASSTHROUGH_DATACLASS)
    except orjson.JSONEncodeError:
        return _ENCODER.encode(value)


def _encode_extra(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"cannot store {type(value).__name__} in a batch row")


# What `json.dumps(value, default=_encode_extra, separators=(",", ":"))` makes anew on
# every call (it holds no state between calls): made once, every write encodes with it.
_ENCODER = json.JSONEncoder(default=_encode_extra, separators=(",", ":"))


def _text(value: Any) -> str | None:
    return None if value is None else str(value)


def writes_of(batch: Sequence[Jsonb]) -> Jsonb:
    """The argument of a grouped statement: of saga.write_sagas_v2 (migration 0025), the
    `_write` arguments of several sagas' writes; of saga.start_sagas_v1 (migration 0029),
    the `start_params` of several starts; in order."""
    return Jsonb([params.obj for params in batch], dumps=_dumps)


def state_of(written: dict[str, Any] | None) -> SagaState | None:
    """The state saga.write_saga_v4 returned (`return_state`), or None."""
    return None if written is None else state_from(written["saga"], written["operations"])


def state_from(row: dict[str, Any], ops: Sequence[dict[str, Any]]) -> SagaState:
    """The user-facing state of a saga, from its row and its operations' rows."""
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
        "write": write_params(write, owner=owner, lease_seconds=lease_seconds, token=token).obj,
    }
    return Jsonb(claim, dumps=_dumps)


def claimed_started(outcome: dict[str, Any]) -> tuple[bool, SagaState | None]:
    """What saga.claim_started_v1 answered: whether it claimed, and the state its write
    returned (`return_state`)."""
    if not outcome["claimed"]:
        return False, None
    return True, state_of(outcome["state"])


def started(saga: SagaRow, outcome: dict[str, Any]) -> dict[str, Any]:
    """What saga.start_saga answered, with the columns the server set read into `saga`
    when it created the saga (see the store's `start_saga`)."""
    if not outcome["created"] and str(outcome["id"]) == saga.id:
        # This very start, retried after its reply was lost: it had landed. The saga
        # is ours, created as planned (its id is new to every start).
        outcome = {"created": True}
    if outcome["created"]:
        for name in ("run_after", "created_at", "updated_at"):
            if name in outcome:
                setattr(saga, name, datetime.fromisoformat(outcome[name]))
    return outcome
