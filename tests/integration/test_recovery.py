"""Operator recovery: compensate() and resolve() on parked or pending sagas."""

from __future__ import annotations

from typing import Any

import pytest
from support import OrchestratorFactory, Order, compensations, events, order_saga

from saga import Saga, StepContext, StepStateError


def _parked_on_unknown(calls: list[str]) -> Saga[Order]:
    """reserve succeeds; charge's outcome ends unknown (a non-JSON result); ship never runs."""
    saga = order_saga("recover")

    @saga.step
    def reserve(ctx: StepContext, o: Order) -> dict:
        calls.append("reserve")
        return {"sku": "x"}

    @reserve.compensation(idempotent=True)
    def release(ctx: StepContext, o: Order, result: dict) -> None:
        calls.append(f"release:{result}")

    @saga.step
    def charge(ctx: StepContext, o: Order) -> Any:
        calls.append("charge")
        if ctx.attempt == 1:
            return {"not", "json"}
        return {"charge_id": "ch-1"}

    @charge.compensation(idempotent=True)
    def refund(ctx: StepContext, o: Order, result: Any) -> None:
        calls.append(f"refund:{result}")

    @saga.step
    def ship(ctx: StepContext, o: Order) -> dict:
        calls.append("ship")
        return {"ok": True}

    return saga


def test_compensate_stops_at_an_unknown_step(make_orch: OrchestratorFactory) -> None:
    """compensate() without include_unknown stops at an unknown step: nothing before it runs."""
    calls: list[str] = []
    saga = _parked_on_unknown(calls)
    orch = make_orch(saga)
    saga_id = orch.start(saga, Order(order_id="o-1")).id
    parked = orch.run(saga_id)
    assert parked.status == "needs_review"
    assert parked.operation("charge").status == "unknown"
    assert calls == ["reserve", "charge"]

    state = orch.compensate(saga_id)

    assert state.status == "needs_review"
    assert "charge" in (state.error or "")
    assert "unknown" in (state.error or "")
    assert calls == ["reserve", "charge"]
    assert all(op.attempts == 0 for op in state.operations if op.kind == "compensation")
    assert state.operation("charge").status == "unknown"


def test_compensate_with_include_unknown_undoes_everything(
    make_orch: OrchestratorFactory,
) -> None:
    """include_unknown=True compensates the unknown step with result=None, then the rest."""
    calls: list[str] = []
    saga = _parked_on_unknown(calls)
    orch = make_orch(saga)
    saga_id = orch.start(saga, Order(order_id="o-1")).id
    assert orch.run(saga_id).status == "needs_review"

    state = orch.compensate(saga_id, include_unknown=True, actor="ops@example")

    assert state.status == "compensated"
    assert calls == ["reserve", "charge", "refund:None", "release:{'sku': 'x'}"]
    assert compensations(state) == {"charge": ("succeeded", 1), "reserve": ("succeeded", 1)}
    names = events(orch.history(saga_id))
    assert "compensation_requested" in names
    requested = next(e for e in orch.history(saga_id) if e.event == "compensation_requested")
    assert requested.detail.get("actor") == "ops@example"
    assert "ship" not in calls


def test_compensate_a_pending_saga_undoes_nothing(make_orch: OrchestratorFactory) -> None:
    """compensate() on a saga that never ran compensates nothing and ends compensated."""
    calls: list[str] = []
    saga = _parked_on_unknown(calls)
    orch = make_orch(saga)
    saga_id = orch.start(saga, Order(order_id="o-1")).id

    state = orch.compensate(saga_id)

    assert state.status == "compensated"
    assert calls == []
    assert all(op.attempts == 0 for op in state.operations)
    # A compensated saga stays so: run() calls nothing.
    assert orch.run(saga_id).status == "compensated"
    assert calls == []


def test_resolve_failed_compensates_on_the_next_run(make_orch: OrchestratorFactory) -> None:
    """resolve(outcome="failed") on an unknown step makes the next run compensate the rest."""
    calls: list[str] = []
    saga = _parked_on_unknown(calls)
    orch = make_orch(saga)
    saga_id = orch.start(saga, Order(order_id="o-1")).id
    assert orch.run(saga_id).status == "needs_review"

    resolved = orch.resolve(
        saga_id, "charge", outcome="failed", actor="ops@example", reason="declined at provider"
    )
    assert resolved.operation("charge").status == "failed"
    assert calls == ["reserve", "charge"]  # resolve does not drive

    state = orch.run(saga_id)

    assert state.status == "compensated"
    assert calls == ["reserve", "charge", "release:{'sku': 'x'}"]
    assert compensations(state).get("reserve") == ("succeeded", 1)
    assert compensations(state).get("charge", ("pending", 0))[1] == 0
    event = next(e for e in orch.history(saga_id) if e.event == "operation_resolved")
    assert event.step == "charge"
    assert event.detail.get("actor") == "ops@example"
    assert event.detail.get("outcome") == "failed"
    assert event.detail.get("reason") == "declined at provider"


def test_resolve_succeeded_continues_forward(make_orch: OrchestratorFactory) -> None:
    """resolve(outcome="succeeded", result=...) records the result; the next run goes on."""
    calls: list[str] = []
    saga = _parked_on_unknown(calls)
    orch = make_orch(saga)
    saga_id = orch.start(saga, Order(order_id="o-1")).id
    assert orch.run(saga_id).status == "needs_review"

    orch.resolve(
        saga_id, "charge", outcome="succeeded", result={"charge_id": "ch-9"}, actor="ops@example"
    )
    state = orch.run(saga_id)

    assert state.status == "completed"
    assert calls == ["reserve", "charge", "ship"]
    assert state.operation("charge").result == {"charge_id": "ch-9"}
    assert state.operation("charge").status == "succeeded"


def test_resolve_a_settled_step_is_refused(make_orch: OrchestratorFactory) -> None:
    """resolve() on a step that already succeeded raises StepStateError and changes nothing."""
    calls: list[str] = []
    saga = _parked_on_unknown(calls)
    orch = make_orch(saga)
    saga_id = orch.start(saga, Order(order_id="o-1")).id
    before = orch.run(saga_id)

    with pytest.raises(StepStateError):
        orch.resolve(saga_id, "reserve", outcome="failed", actor="ops@example")

    after = orch.get(saga_id)
    assert after == before
    assert "operation_resolved" not in events(orch.history(saga_id))
