"""Statuses and the read models returned to users: SagaState, OperationState, events."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class SagaStatus(StrEnum):
    """Lifecycle of a saga instance (mirrors the CHECK constraint in the schema)."""

    PENDING = "pending"
    RUNNING = "running"
    COMPENSATING = "compensating"
    COMPLETED = "completed"
    COMPENSATED = "compensated"
    NEEDS_REVIEW = "needs_review"
    AWAITING_CONFIRMATION = "awaiting_confirmation"
    FORKED = "forked"

    @property
    def is_terminal(self) -> bool:
        """Completed, compensated or forked (continued by another saga): nothing will ever
        run again."""
        return self in (SagaStatus.COMPLETED, SagaStatus.COMPENSATED, SagaStatus.FORKED)

    @property
    def is_runnable(self) -> bool:
        """A worker or `run()` may drive a saga in this status."""
        return self in (SagaStatus.PENDING, SagaStatus.RUNNING, SagaStatus.COMPENSATING)


class OperationStatus(StrEnum):
    """Lifecycle of one operation (a step or a compensation)."""

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    UNKNOWN = "unknown"


OperationKind = Literal["action", "compensation"]


class OperationState(BaseModel):
    """One step or compensation of a saga, as stored."""

    model_config = ConfigDict(frozen=True)

    step: str
    kind: OperationKind
    status: OperationStatus
    attempts: int
    max_attempts: int
    idempotency_key: str
    request_hash: str
    result: Any = None
    error: str | None = None
    provider_reference: str | None = None
    next_attempt_at: datetime | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    request: Any = None
    deadline_at: datetime | None = None
    cost: float | None = None
    reconcile_asks: int = 0
    spent: float = 0.0
    # The version `request_hash` was computed under (`saga.keys.HASH_VERSIONS`): 1 for
    # rows written before RFC 8785 request hashes, 2 after.
    hash_version: int = 1
    # A ledger call's claim: when its holder's lease ends (None when no one holds it).
    claim_expires_at: datetime | None = None


class SagaState(BaseModel):
    """A saga instance and its operations, as stored."""

    model_config = ConfigDict(frozen=True)

    id: str
    saga: str
    version: int
    tenant_id: str
    key: str
    status: SagaStatus
    error: str | None = None
    input: dict[str, Any]
    created_at: datetime
    updated_at: datetime
    run_after: datetime | None = None
    lease_owner: str | None = None
    lease_expires_at: datetime | None = None
    fence: int = 0
    max_operations: int | None = None
    operations_executed: int = 0
    deadline_at: datetime | None = None
    spend_budget: float | None = None
    spent: float = 0.0
    max_side_effects: int | None = None
    side_effects: int = 0
    finished_at: datetime | None = None
    forked_from: str | None = None
    forked_to: str | None = None
    operations: list[OperationState] = []

    @property
    def display_status(self) -> str:
        """The status to show people: see `display_status`."""
        return display_status(self)

    def operation(self, step: str, kind: OperationKind = "action") -> OperationState:
        """The operation of `step` of the given kind; `KeyError` when there is none."""
        for op in self.operations:
            if op.step == step and op.kind == kind:
                return op
        raise KeyError(f"saga {self.id} has no {kind} operation for step {step!r}")


class SagaHandle(BaseModel):
    """What `Orchestrator.start` returns: the saga's id and whether this call created it."""

    model_config = ConfigDict(frozen=True)

    id: str
    saga: str
    version: int
    tenant_id: str
    key: str
    created: bool


class HistoryEvent(BaseModel):
    """One entry of a saga's append-only audit trail."""

    model_config = ConfigDict(frozen=True)

    at: datetime
    event: str
    step: str | None = None
    kind: OperationKind | None = None
    attempt: int | None = None
    detail: dict[str, Any] = {}


class WorkerInfo(BaseModel):
    """A live worker as it last reported itself."""

    model_config = ConfigDict(frozen=True)

    owner: str
    kinds: list[str]
    concurrency: int
    started_at: datetime
    heartbeat_at: datetime
    expires_at: datetime


class Confirmation(BaseModel):
    """A step's attempt waiting for (or given) a human's approval of its exact preview.

    `request_hash` is the hash of `preview` (`saga.approvals.preview_hash`), the one an
    approval is bound to; it is not the operation's idempotency `request_hash`, which
    leaves volatile input fields out. One approval releases one attempt.
    """

    model_config = ConfigDict(frozen=True)

    saga_id: str
    step: str
    request_hash: str
    preview: dict[str, Any]
    requested_at: datetime
    expires_at: datetime
    approved_by: str | None = None
    approved_at: datetime | None = None
    # The attempt whose start used the approval up (one approval, one attempt), and when.
    consumed_attempt: int | None = None
    consumed_at: datetime | None = None


# Names of the saga rows of sessions and ledger channels begin so (as
# `saga.session.SESSION_PREFIX` and `LEDGER_PREFIX`).
_CODE_FIRST_PREFIXES = ("session/", "ledger/")


def display_status(
    state: SagaState, *, now: datetime | None = None, live_claims: int | None = None
) -> str:
    """The status of a saga as `saga list`, `saga show` and the dashboard show it.

    A declared saga's is its stored `status`. A session or a ledger channel is stored
    `running` for as long as it is open, whatever its calls did, so its status is told
    from its rows instead:

    - `open`: a call is in flight. A session's `with` block holds its lease (live); a
      ledger channel has a call claimed under a live claim.
    - `idle`: open, but nothing is in flight and no call waits for a human: the next
      entry of the session (or claim in the channel) goes on. A call left `running` by
      a holder that stopped is settled by that next entry or claim.
    - `parked`: a call needs a human (`needs_review`, or `awaiting_confirmation`).
    - `compensating`: its calls are being undone (a `PermanentError` left the block, or
      an operator's `compensate` or `cancel`).
    - `closed`: it ended: the block exited (or `run.fail`), `ledger.close` closed the
      channel, or it was compensated or forked; the stored status says which.

    `now` is the time leases are compared with (the current time by default);
    `live_claims` is how many of the channel's calls are held under a live claim, when
    `state` holds only some of its operations (one page of them).
    """
    if not state.saga.startswith(_CODE_FIRST_PREFIXES):
        return state.status.value
    if state.status.is_terminal:
        return "closed"
    if state.status in (SagaStatus.NEEDS_REVIEW, SagaStatus.AWAITING_CONFIRMATION):
        return "parked"
    if state.status == SagaStatus.COMPENSATING:
        return "compensating"
    moment = now or datetime.now(UTC)
    if state.saga.startswith("session/"):
        held = state.lease_owner is not None and (
            state.lease_expires_at is not None and state.lease_expires_at > moment
        )
        return "open" if held else "idle"
    if live_claims is None:
        live_claims = sum(
            1
            for op in state.operations
            if op.kind == "action"
            and op.status == OperationStatus.RUNNING
            and op.claim_expires_at is not None
            and op.claim_expires_at > moment
        )
    return "open" if live_claims else "idle"


@dataclass(frozen=True, slots=True)
class DatabaseGauges:
    """What the telemetry's gauges report of the sagas of one name, as the database
    answers it (the store's `database_gauges`): parked sagas, unknown outcomes to settle,
    and the age of the longest-waiting claimable saga."""

    saga: str
    needs_review: int
    unknown_outcomes: int
    oldest_runnable_seconds: float
