"""Confirmations in the planner (no database): one approval releases exactly one attempt,
and the preview covers everything the step reads."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from pydantic import BaseModel

from saga import RetryPolicy, Saga, StepContext
from saga._core import confirmations
from saga._core import requests as interventions
from saga._core.planner import (
    ConfirmationRow,
    Invoke,
    Next,
    Planner,
    SagaRow,
    Stop,
    new_action_rows,
)
from saga.approvals import preview_hash
from saga.state import OperationStatus, SagaStatus


class Payout(BaseModel):
    payout_id: str
    amount_cents: int
    memo: str = ""


INPUT = Payout(payout_id="p-1", amount_cents=500, memo="wire to 999")


def _saga(
    *, idempotent: bool = False, reconcile: bool = False, pivot: bool = False
) -> Saga[Payout]:
    saga: Saga[Payout] = Saga(
        "payouts", input=Payout, key=lambda p: p.payout_id, volatile=("memo",)
    )
    if pivot:

        @saga.step(pivot=True)
        def open_account(ctx: StepContext, p: Payout) -> dict[str, Any]:
            return {}

    @saga.step(
        confirm=True,
        confirm_ttl_seconds=60,
        idempotent=idempotent,
        retry=RetryPolicy(max_attempts=3, initial_delay=0.01, max_delay=0.01),
    )
    def pay(ctx: StepContext, p: Payout) -> dict[str, Any]:
        return {}

    if reconcile:
        pay.reconcile(lambda ctx, p: None)
    return saga


def _planner(saga: Saga[Payout]) -> Planner:
    tenant, key = saga.identity(INPUT)
    row = SagaRow(
        id="saga-1",
        name=saga.name,
        version=saga.version,
        tenant_id=tenant,
        key=key,
        input=INPUT.model_dump(mode="json"),
        input_hash=saga.input_hash(INPUT),
        status=SagaStatus.PENDING,
        error=None,
        direction="forward",
        fence=1,
        run_after=None,
    )
    ops = new_action_rows(saga, tenant, key, saga.business_fields(INPUT))
    return Planner(saga, row, ops, now=datetime.now().astimezone())


def _later(seconds: float = 1.0) -> datetime:
    return datetime.now().astimezone() + timedelta(seconds=seconds)


def _waits(planner: Planner, now: datetime | None = None) -> ConfirmationRow:
    nxt: Next = planner.advance(now)
    assert isinstance(nxt, Stop) and nxt.status == SagaStatus.AWAITING_CONFIRMATION, nxt
    pending = confirmations.pending_confirmation(planner.confirmations)
    assert pending is not None
    return pending


def _approve(planner: Planner, pending: ConfirmationRow) -> None:
    _written(planner)  # the confirmation asked for, written by the worker
    interventions.approve_confirmation(
        planner, "pay", pending.request_hash, actor="ops", now=planner.now
    )
    assert _written(planner) == [("approve", pending)]  # by the operator's transaction


def _written(planner: Planner) -> list[tuple[str, ConfirmationRow]]:
    """The confirmation changes the next write hands over (its events are left to read)."""
    write = planner.write(None, owner=None)
    planner.events.extend(write.events)
    return [(change.action, change.row) for change in write.confirmations]


def _released(planner: Planner, now: datetime | None = None) -> int:
    nxt = planner.advance(now)
    assert isinstance(nxt, Invoke), nxt
    return nxt.op.attempts


def test_the_released_attempt_uses_the_approval_up() -> None:
    planner = _planner(_saga())
    pending = _waits(planner)
    assert pending.preview["attempt"] == 1
    _approve(planner, pending)
    assert _released(planner) == 1
    assert pending.consumed_attempt == 1 and _written(planner) == [("consume", pending)]
    names = [e.event for e in planner.take_events()]
    assert names.index("approval_used") < names.index("attempt_started")


def test_a_retry_after_a_transient_failure_asks_again() -> None:
    planner = _planner(_saga())
    first = _waits(planner)
    _approve(planner, first)
    op = planner.op("pay", "action")
    assert _released(planner) == 1
    planner.record_failure(op, "busy", retryable=True, delay=0.0)
    second = _waits(planner, _later())
    assert second is not first and second.request_hash != first.request_hash
    assert second.preview["attempt"] == 2 and ("ask", second) in _written(planner)


def test_a_retry_after_an_unknown_outcome_asks_again() -> None:
    planner = _planner(_saga(idempotent=True))
    _approve(planner, _waits(planner))
    op = planner.op("pay", "action")
    assert _released(planner) == 1
    planner.record_unknown(op, "timed out", park=False)
    assert _waits(planner).preview["attempt"] == 2
    assert op.status == OperationStatus.UNKNOWN  # stays unknown until the retry starts


def test_a_retry_after_a_reconcile_absent_asks_again() -> None:
    planner = _planner(_saga(reconcile=True))
    _approve(planner, _waits(planner))
    op = planner.op("pay", "action")
    assert _released(planner) == 1
    planner.record_unknown(op, "timed out", park=False)
    planner.record_absent(op)
    assert _waits(planner).preview["attempt"] == 2


def test_an_operator_retry_asks_again() -> None:
    planner = _planner(_saga(pivot=True))
    assert _released(planner) == 1  # the pivot
    planner.record_success(planner.op("open_account", "action"), {})
    _approve(planner, _waits(planner))
    op = planner.op("pay", "action")
    assert _released(planner) == 1
    planner.record_failure(op, "declined", retryable=False, delay=0.0)
    assert isinstance(planner.advance(), Stop) and planner.saga.status == SagaStatus.NEEDS_REVIEW
    interventions.request_retry(planner, extra_attempts=0, actor="ops", now=planner.now)
    assert _waits(planner).preview["attempt"] == 2


def test_an_expired_approval_releases_nothing_and_is_withdrawn() -> None:
    planner = _planner(_saga())
    pending = _waits(planner)
    _approve(planner, pending)
    expired_at = pending.expires_at
    later = expired_at + timedelta(seconds=1)
    again = _waits(planner, later)
    assert again is pending  # the same request: the same row, asked for again
    assert (again.approved_by, again.approved_at, again.consumed_attempt) == (None, None, None)
    assert _written(planner) == [("ask", again)] and again.expires_at > later
    names = [e.event for e in planner.take_events()]
    assert "approval_expired" in names and "attempt_started" not in names


def test_the_preview_is_the_whole_input_and_its_hash_covers_it() -> None:
    planner = _planner(_saga())
    pending = _waits(planner)
    assert pending.preview["payload"] == INPUT.model_dump(mode="json")
    assert pending.request_hash == pending.preview["request_hash"]
    assert pending.request_hash == preview_hash(pending.preview)
    op = planner.op("pay", "action")
    assert op.request_hash != pending.request_hash  # the idempotency hash leaves memo out
