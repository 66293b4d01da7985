"""The snapshot of one saga the core decides on, and the write it hands back.

The rows mirror saga.sagas, saga.operations and saga.confirmations in memory, and carry
nothing but their columns: the core changes them through the planner, which notes each
row changed (`saga._core.writes.Changes`) and records audit `Event`s, and
`Planner.write` turns all of it into one `Write` for the store to persist in one
transaction.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from saga.keys import HASH_VERSION
from saga.state import OperationKind, OperationStatus, SagaStatus

Direction = Literal["forward", "backward"]
Kind = OperationKind


@dataclass(slots=True)
class OpRow:
    """In-memory mirror of one row of saga.operations."""

    step: str
    kind: Kind
    position: int
    idempotency_key: str
    request_hash: str
    status: OperationStatus
    attempts: int
    max_attempts: int
    next_attempt_at: datetime | None = None
    result: Any = None
    provider_reference: str | None = None
    error: str | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    request: Any = None
    deadline_at: datetime | None = None
    cost: float | None = None
    reconcile_started_at: datetime | None = None
    reconcile_asks: int = 0
    retrying_unknown: bool = False
    # Spend reported with ctx.spend(): counted over all attempts, reported by the attempt
    # in flight and not yet counted, and the most one attempt has reported (migration 0011).
    spent: float = 0.0
    attempt_spend: float = 0.0
    peak_spend: float = 0.0
    # The version request_hash was computed under (saga.keys.HASH_VERSIONS, migration 0023).
    hash_version: int = HASH_VERSION


@dataclass(slots=True)
class SagaRow:
    """In-memory mirror of one row of saga.sagas."""

    id: str
    name: str
    version: int
    tenant_id: str
    key: str
    input: dict[str, Any]
    input_hash: str
    status: SagaStatus
    error: str | None
    direction: Direction
    fence: int
    run_after: datetime | None
    lease_owner: str | None = None
    lease_expires_at: datetime | None = None
    created_at: datetime | None = None
    updated_at: datetime | None = None
    max_operations: int | None = None
    operations_executed: int = 0
    deadline_at: datetime | None = None
    spend_budget: float | None = None
    spent: float = 0.0
    max_side_effects: int | None = None
    side_effects: int = 0
    # The saga this one was forked from, and the saga it was forked to (`Orchestrator.fork`).
    forked_from: str | None = None
    forked_to: str | None = None
    # The W3C trace context of the code that started the saga (migration 0018), for the
    # drivers' telemetry: data to the core, which never reads it.
    trace_context: dict[str, str] | None = None
    # The version input_hash was computed under (saga.keys.HASH_VERSIONS, migration 0023).
    hash_version: int = HASH_VERSION


@dataclass(slots=True)
class ConfirmationRow:
    """In-memory mirror of one row of saga.confirmations."""

    step: str
    request_hash: str
    preview: dict[str, Any]
    expires_at: datetime
    approved_by: str | None = None
    approved_at: datetime | None = None
    # The attempt this confirmation's approval released (used it up), or None.
    consumed_attempt: int | None = None
    # The approval token given with the approval (migration 0017): with signed approvals,
    # the proof the planner verifies before the attempt; approved_at alone proves nothing.
    approval: str | None = None


@dataclass(frozen=True, slots=True)
class Event:
    """An audit event produced by a decision, persisted in the same transaction."""

    event: str
    step: str | None = None
    kind: Kind | None = None
    attempt: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)


def operation_event(name: str, op: OpRow, **detail: Any) -> Event:
    """Audit event `name` about `op` and its current attempt (None before its first)."""
    return Event(name, op.step, op.kind, op.attempts or None, detail)


def lease_acquired(owner: str, fence: int) -> Event:
    """The audit event of a lease taken by `owner`, at `fence`."""
    return Event("lease_acquired", detail={"owner": owner, "fence": fence})


@dataclass(frozen=True, slots=True)
class ConfirmationChange:
    """A confirmation to write: asked for (`ask`), approved (`approve`), or used up by
    the attempt it releases (`consume`, refused by the database when that approval has
    released an attempt already)."""

    action: Literal["ask", "approve", "consume"]
    row: ConfirmationRow


@dataclass(frozen=True, slots=True)
class Write:
    """Everything one transaction writes for a saga, as the core decided it: the saga's
    columns, the operations created and changed, the confirmations, the audit events,
    and what becomes of the lease (`release`: it ends with this write; otherwise the
    write renews it). `notify` wakes workers (the saga is runnable by anyone now), and
    `return_state` reads the saga's state back in the same statement."""

    saga: SagaRow
    new_ops: tuple[OpRow, ...]
    changed_ops: tuple[OpRow, ...]
    confirmations: tuple[ConfirmationChange, ...]
    events: tuple[Event, ...]
    release: bool
    notify: bool
    return_state: bool


def describe(op: OpRow) -> str:
    """How messages name an operation: its step, or the compensation of its step."""
    return f"step {op.step!r}" if op.kind == "action" else f"compensation of step {op.step!r}"


# One saga as read for the core: its row, its operations and its confirmations.
Loaded = tuple[SagaRow, list[OpRow], list[ConfirmationRow]]
