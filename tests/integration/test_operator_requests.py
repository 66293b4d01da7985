"""Operator verbs on parked and finished sagas: explicit compensation requests raise a
failed compensation's ceiling; verbs refuse what the protocol could never reach."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from support import OrchestratorFactory, Order, compensations, order_saga

from saga import (
    PermanentError,
    RetryPolicy,
    Saga,
    StepContext,
    StepStateError,
    TransientError,
)

QUICK = RetryPolicy(max_attempts=2, initial_delay=0.01, max_delay=0.02)


class Provider:
    """A refund provider that is down (transient errors) until `fixed` is set."""

    def __init__(self) -> None:
        self.fixed = False
        self.calls: list[str] = []


def _refund_saga(provider: Provider, *, undo_ship: bool = False) -> Saga[Order]:
    """reserve and charge succeed, ship fails permanently; refund fails while the
    provider is down, release always works; with `undo_ship`, ship has a compensation."""
    saga = order_saga("refunds")

    @saga.step
    def reserve(ctx: StepContext, o: Order) -> dict[str, Any]:
        provider.calls.append("reserve")
        return {"sku": "x"}

    @reserve.compensation(retry=QUICK, idempotent=True)
    def release(ctx: StepContext, o: Order, result: Any) -> None:
        provider.calls.append("release")

    @saga.step
    def charge(ctx: StepContext, o: Order) -> dict[str, Any]:
        provider.calls.append("charge")
        return {"charge_id": f"ch-{o.order_id}"}

    @charge.compensation(retry=QUICK, idempotent=True)
    def refund(ctx: StepContext, o: Order, result: Any) -> None:
        provider.calls.append("refund")
        if not provider.fixed:
            raise TransientError("refund provider is down")

    @saga.step
    def ship(ctx: StepContext, o: Order) -> dict[str, Any]:
        provider.calls.append("ship")
        raise PermanentError("no carrier")

    if undo_ship:

        @ship.compensation(idempotent=True)
        def recall(ctx: StepContext, o: Order, result: Any) -> None:
            provider.calls.append("recall")

    return saga


def _rows(url: str) -> dict[str, list[tuple[Any, ...]]]:
    out: dict[str, list[tuple[Any, ...]]] = {}
    with psycopg.connect(url) as conn:
        for table, order in (
            ("sagas", "id"),
            ("operations", "saga_id, kind, step"),
            ("events", "id"),
        ):
            query = f"SELECT * FROM saga.{table} ORDER BY {order}"
            out[table] = conn.execute(query.encode()).fetchall()
    return out


def _parked_on_refund(orch: Any, saga: Saga[Order], order_id: str) -> str:
    saga_id: str = orch.start(saga, Order(order_id=order_id)).id
    state = orch.run(saga_id)
    assert state.status == "needs_review", state.error
    assert compensations(state)["charge"] == ("failed", 2)
    assert "refund provider is down" in (state.error or "")
    return saga_id


# ----- item: an explicit compensation request raises the failed compensation's ceiling ------


def test_compensate_gives_a_failed_compensation_a_fresh_budget(
    make_orch: OrchestratorFactory, database_url: str
) -> None:
    """Parked at refund's ceiling; once the provider is fixed, compensate() raises the
    ceiling (attempts kept, ceiling_raised with the actor) and finishes in reverse."""
    provider = Provider()
    saga = _refund_saga(provider)
    orch = make_orch(saga)
    saga_id = _parked_on_refund(orch, saga, "o-1")
    assert provider.calls == ["reserve", "charge", "ship", "refund", "refund"]

    # The automatic runtime never raises a ceiling: running it again changes nothing.
    assert orch.run(saga_id).status == "needs_review"
    assert provider.calls.count("refund") == 2

    provider.fixed = True
    state = orch.compensate(saga_id, actor="oncall")

    assert state.status == "compensated", state.error
    refund = state.operation("charge", "compensation")
    assert (refund.status, refund.attempts, refund.max_attempts) == ("succeeded", 3, 4)
    assert provider.calls == ["reserve", "charge", "ship"] + ["refund"] * 3 + ["release"]
    raised = [e for e in orch.history(saga_id) if e.event == "ceiling_raised"]
    assert len(raised) == 1
    assert (raised[0].step, raised[0].kind) == ("charge", "compensation")
    assert raised[0].detail["actor"] == "oncall"
    assert raised[0].detail["previous_max_attempts"] == 2
    assert raised[0].detail["max_attempts"] == 4

    # Compensations that succeeded never run again.
    again = orch.compensate(saga_id, actor="oncall")
    assert again.status == "compensated"
    assert provider.calls.count("refund") == 3 and provider.calls.count("release") == 1


def test_a_fresh_budget_that_runs_out_parks_again(make_orch: OrchestratorFactory) -> None:
    """The provider still down: the raised ceiling is used up and the saga parks again,
    its attempts all counted; the next explicit request raises it once more."""
    provider = Provider()
    saga = _refund_saga(provider)
    orch = make_orch(saga)
    saga_id = _parked_on_refund(orch, saga, "o-2")

    state = orch.compensate(saga_id, actor="oncall")
    assert state.status == "needs_review"
    assert compensations(state)["charge"] == ("failed", 4)
    assert state.operation("charge", "compensation").max_attempts == 4
    assert "release" not in provider.calls

    provider.fixed = True
    done = orch.compensate(saga_id, actor="oncall")
    assert done.status == "compensated"
    assert compensations(done) == {"charge": ("succeeded", 5), "reserve": ("succeeded", 1)}


def test_dry_run_plan_lists_what_really_runs(
    make_orch: OrchestratorFactory, database_url: str
) -> None:
    """The compensation plan of a saga parked at refund's ceiling names refund then
    release, changing nothing; the real request then runs exactly those."""
    from saga.cli import admin

    provider = Provider()
    saga = _refund_saga(provider)
    orch = make_orch(saga)
    saga_id = _parked_on_refund(orch, saga, "o-3")
    before = _rows(database_url)

    plan = admin.plan_compensation(orch, orch.get(saga_id), include_unknown=False)

    assert _rows(database_url) == before
    assert plan.stop is None
    state = orch.get(saga_id)
    keys = {op.step: op.idempotency_key for op in state.operations if op.kind == "compensation"}
    assert [step for step, _ in plan.compensations] == ["charge", "reserve"]
    assert plan.compensations[0] == ("charge", keys["charge"])
    assert plan.compensations[1][1].endswith(":reserve:compensate")

    provider.fixed = True
    done = orch.compensate(saga_id, actor="oncall")
    ran = [
        (op.step, op.idempotency_key)
        for op in sorted(
            (o for o in done.operations if o.kind == "compensation"),
            key=lambda o: o.finished_at or o.started_at,  # type: ignore[arg-type, return-value]
        )
    ]
    assert ran == plan.compensations


# ----- item: operator verbs refuse what the protocol could never reach ------------------


def test_resolve_refuses_a_compensated_saga_and_writes_nothing(
    make_orch: OrchestratorFactory, database_url: str
) -> None:
    """ship failed and the saga was compensated: resolving ship as succeeded would leave a
    succeeded step nothing will ever compensate. Refused, saying why; no row changes."""
    provider = Provider()
    provider.fixed = True
    saga = _refund_saga(provider)
    orch = make_orch(saga)
    saga_id = orch.start(saga, Order(order_id="o-c")).id
    assert orch.run(saga_id).status == "compensated"
    before = _rows(database_url)

    with pytest.raises(StepStateError, match="is compensated: it is final") as refused:
        orch.resolve(saga_id, "ship", outcome="succeeded", result={"x": 1}, actor="ops")
    assert "undo it at the provider" in str(refused.value)
    with pytest.raises(StepStateError, match="is compensated"):
        orch.resolve(saga_id, "ship", outcome="failed", actor="ops", force=True)
    with pytest.raises(StepStateError, match="is compensated"):
        orch.raise_ceilings(saga_id, actor="ops", max_operations=100)

    assert _rows(database_url) == before
    assert orch.get(saga_id).operation("ship").status == "failed"


def test_resolve_and_raise_ceilings_refuse_a_completed_saga(
    make_orch: OrchestratorFactory, database_url: str
) -> None:
    """A completed saga never runs again: resolve and raise_ceilings are refused, pointing
    at compensate; nothing is written (not even an audit event)."""
    saga = order_saga("done")

    @saga.step
    def only(ctx: StepContext, o: Order) -> dict[str, Any]:
        return {"ok": True}

    orch = make_orch(saga)
    saga_id = orch.start(saga, Order(order_id="o-d")).id
    assert orch.run(saga_id).status == "completed"
    before = _rows(database_url)

    with pytest.raises(StepStateError, match=r"is completed: .*compensate it"):
        orch.resolve(saga_id, "only", outcome="failed", actor="ops", reason="checked")
    with pytest.raises(StepStateError, match="is completed"):
        orch.raise_ceilings(saga_id, actor="ops", max_operations=100)
    assert _rows(database_url) == before


def test_resolve_refuses_success_of_a_step_compensation_has_gone_past(
    make_orch: OrchestratorFactory, database_url: str
) -> None:
    """Parked while compensating, refund (of a step before ship) has run: ship recorded as
    succeeded now would be recalled after the refund, out of order. Refused with what to
    do instead; resolving it as failed is accepted and compensation goes on."""
    provider = Provider()
    saga = _refund_saga(provider, undo_ship=True)
    orch = make_orch(saga)
    saga_id = _parked_on_refund(orch, saga, "o-p")
    before = _rows(database_url)

    with pytest.raises(StepStateError, match="already gone past step 'ship'") as refused:
        orch.resolve(saga_id, "ship", outcome="succeeded", result={}, actor="ops")
    assert "resolve it as failed" in str(refused.value)
    assert _rows(database_url) == before

    orch.resolve(saga_id, "ship", outcome="failed", actor="ops", reason="never shipped")
    provider.fixed = True
    state = orch.compensate(saga_id, actor="ops")
    assert state.status == "compensated"
    assert "recall" not in provider.calls


def test_resolve_success_before_compensation_reaches_the_step_is_compensated(
    make_orch: OrchestratorFactory,
) -> None:
    """Compensation stopped at an unknown step has not gone past it: resolving it as
    succeeded is accepted, and its compensation then runs first, in reverse order."""
    calls: list[str] = []
    saga = order_saga("stopped")

    @saga.step
    def reserve(ctx: StepContext, o: Order) -> dict[str, Any]:
        return {"sku": "x"}

    @reserve.compensation(idempotent=True)
    def release(ctx: StepContext, o: Order, result: Any) -> None:
        calls.append("release")

    @saga.step
    def charge(ctx: StepContext, o: Order) -> Any:
        return {"not", "json"}  # the outcome cannot be stored: unknown

    @charge.compensation(idempotent=True)
    def refund(ctx: StepContext, o: Order, result: Any) -> None:
        calls.append(f"refund:{result}")

    orch = make_orch(saga)
    saga_id = orch.start(saga, Order(order_id="o-u")).id
    assert orch.run(saga_id).status == "needs_review"
    assert orch.compensate(saga_id).status == "needs_review"  # stops at charge

    orch.resolve(saga_id, "charge", outcome="succeeded", result={"id": "ch"}, actor="ops")
    assert orch.run(saga_id).status == "compensated"
    assert calls == ["refund:{'id': 'ch'}", "release"]
