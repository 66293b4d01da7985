"""The one write a transition makes, and the lease decision in it, decided by the core.

Time is an input, so every timestamp below is exact and nothing sleeps.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic import BaseModel

from saga import RetryPolicy, Saga
from saga._core import inputs
from saga._core.planner import Invoke, Planner, SagaRow, Sleep, Stop, Yield, new_action_rows
from saga.state import OperationStatus, SagaStatus

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
OWNER = "host:1:abcd"


class Order(BaseModel):
    order_id: str


def _planner(backoff_seconds: float = 2.0) -> Planner:
    saga: Saga[Order] = Saga("order", version=1, input=Order, key=lambda o: o.order_id)
    policy = RetryPolicy(
        max_attempts=3, initial_delay=backoff_seconds, max_delay=backoff_seconds, jitter=0.0
    )

    @saga.step(retry=policy)
    def reserve(ctx: Any, order: Order) -> None: ...

    @reserve.compensation
    def release(ctx: Any, order: Order, reserved: None) -> None: ...

    @saga.step
    def charge(ctx: Any, order: Order) -> None: ...

    row = SagaRow(
        id="saga-1",
        name="order",
        version=1,
        tenant_id="",
        key="o-1",
        input={"order_id": "o-1"},
        input_hash="h",
        status=SagaStatus.PENDING,
        error=None,
        direction="forward",
        fence=1,
        run_after=None,
    )
    ops = new_action_rows(saga, "", "o-1", {"order_id": "o-1"})
    return Planner(saga, row, ops, now=T0)


def _fail_first_attempt(planner: Planner, at: datetime) -> Sleep:
    first = planner.advance(T0)
    assert isinstance(first, Invoke)
    planner.write(first, owner=OWNER)
    failure = inputs.Raised("reserve", "action", "TransientError: busy", "retry", 2.0)
    inputs.apply(planner, failure, at)
    nxt = planner.advance(at)
    assert isinstance(nxt, Sleep)
    return nxt


def test_a_write_hands_each_change_over_once_and_keeps_the_lease() -> None:
    """Starting an attempt renews the lease; the rows a planner is given are as stored,
    and a write hands over the rows changed since the last one, so the next write sends
    only what changed after it."""
    planner = _planner()
    nxt = planner.advance(T0)
    assert isinstance(nxt, Invoke)
    write = planner.write(nxt, owner=OWNER)
    assert not write.release and not write.notify and not write.return_state
    assert write.new_ops == ()
    assert [(op.step, op.status) for op in write.changed_ops] == [
        ("reserve", OperationStatus.RUNNING)
    ]
    assert write.events[-1].event == "attempt_started"
    again = planner.write(nxt, owner=OWNER)
    assert again.new_ops == again.changed_ops == again.events == ()
    inputs.apply(planner, inputs.Returned("reserve", "action", None), T0)
    after = planner.write(planner.advance(T0), owner=OWNER)
    assert [op.step for op in after.changed_ops] == ["reserve", "charge"]
    assert after.new_ops == ()


def test_a_row_the_planner_adds_is_written_new_once_then_as_changed() -> None:
    """A compensation the planner adds is created by the next write, in the order of
    the rows, and updated by the writes after it."""
    planner = _planner()
    assert isinstance(planner.advance(T0), Invoke)
    inputs.apply(planner, inputs.Returned("reserve", "action", None), T0)
    assert isinstance(planner.advance(T0), Invoke)
    planner.write(None, owner=OWNER)
    failure = inputs.Raised("charge", "action", "PermanentError: declined", "failed", 0.0)
    inputs.apply(planner, failure, T0)
    nxt = planner.advance(T0)
    assert isinstance(nxt, Invoke) and nxt.op.kind == "compensation"
    write = planner.write(nxt, owner=OWNER)
    assert [(op.step, op.kind, op.status) for op in write.new_ops] == [
        ("reserve", "compensation", OperationStatus.RUNNING)
    ]
    assert [(op.step, op.kind) for op in write.changed_ops] == [("charge", "action")]
    inputs.apply(planner, inputs.Returned("reserve", "compensation", None), T0)
    after = planner.write(planner.advance(T0), owner=OWNER)
    assert after.new_ops == ()
    assert [(op.step, op.kind) for op in after.changed_ops] == [("reserve", "compensation")]


def test_a_backoff_longer_than_the_inline_wait_releases_the_lease() -> None:
    """A backoff past `max_inline_sleep` is persisted as run_after and gives the lease
    back, recorded as lease_released for a backoff."""
    planner = _planner()
    failed_at = T0 + timedelta(seconds=1)
    nxt = _fail_first_attempt(planner, failed_at)
    assert nxt.until == failed_at + timedelta(seconds=2)
    write = planner.write(nxt, owner=OWNER, max_inline_sleep=0.5)
    assert write.release and write.return_state and not write.notify
    assert write.saga.run_after == failed_at + timedelta(seconds=2)
    released = [e for e in write.events if e.event == "lease_released"]
    assert [e.detail for e in released] == [{"owner": OWNER, "reason": "backoff"}]


def test_a_short_backoff_keeps_the_lease() -> None:
    """A backoff within `max_inline_sleep` keeps the lease (waited out under the
    heartbeat), with its end persisted as run_after all the same."""
    planner = _planner()
    failed_at = T0 + timedelta(seconds=1)
    nxt = _fail_first_attempt(planner, failed_at)
    write = planner.write(nxt, owner=OWNER, max_inline_sleep=5.0)
    assert not write.release and not write.return_state
    assert write.saga.run_after == nxt.until
    assert not [e for e in write.events if e.event == "lease_released"]


def test_a_shutdown_hands_the_saga_back_runnable_now_and_wakes_workers() -> None:
    """Yield (the driver is stopping) releases the lease, makes the saga runnable at the
    time of the decision, and notifies the other workers."""
    planner = _planner()
    later = T0 + timedelta(minutes=3)
    nxt = planner.advance(later, may_call=False)
    assert isinstance(nxt, Yield)
    write = planner.write(nxt, owner=OWNER)
    assert write.release and write.notify
    assert write.saga.run_after == later
    assert write.events[-1].detail == {"owner": OWNER, "reason": "shutdown"}


def test_a_stop_releases_the_lease() -> None:
    """A terminal or parked saga gives its lease back in the write that stops it."""
    planner = _planner()
    planner.park("a human decides")
    nxt = planner.advance(T0)
    assert isinstance(nxt, Stop)
    write = planner.write(nxt, owner=OWNER)
    assert write.release and not write.notify
    assert write.events[-1].event == "lease_released"


def test_an_operators_write_notifies_only_when_the_saga_is_runnable() -> None:
    """An operator's change (no owner, under the row lock) ends any lease; workers are
    told only when it leaves the saga runnable, and no lease event is recorded."""
    planner = _planner()
    planner.park("a human decides")
    parked = planner.write(None, owner=None)
    assert parked.release and not parked.notify
    assert not [e for e in parked.events if e.event == "lease_released"]
    inputs.request(planner, inputs.RequestRetry(extra_attempts=0, actor="ops"), T0)
    resumed = planner.write(None, owner=None)
    assert resumed.release and resumed.notify
