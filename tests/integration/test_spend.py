"""Spend and costs under careless or hostile step code: reported spend counts before the
next attempt, survives a crash, is refused when it is not a finite non-negative number;
declared costs are checked; a guard that fails never loses an earlier outcome."""

from __future__ import annotations

import asyncio
import math
import signal
from typing import Any

import crash_app
import pytest
from pydantic import BaseModel
from support import (
    ChildApp,
    OrchestratorFactory,
    Order,
    events,
    lease_expired,
    order_saga,
    scalar,
    wait_until,
)

from saga import (
    Ceilings,
    RetryPolicy,
    Saga,
    SagaDefinitionError,
    StepContext,
    TransientError,
)

RETRY5 = RetryPolicy(max_attempts=5, initial_delay=0.01, max_delay=0.01)


def _budgeted(name: str, budget: float | None) -> Saga[Order]:
    return Saga(
        name,
        input=Order,
        key=lambda o: o.order_id,
        ceilings=Ceilings(spend_budget=budget) if budget is not None else None,
    )


def _spent(url: str, saga_id: str) -> float:
    return float(scalar(url, "SELECT spent FROM saga.sagas WHERE id = %s", (saga_id,)))


# ----- item 1: reported spend counts before the next attempt -------------------------------


def test_reported_spend_counts_against_the_budget_before_the_next_attempt(
    make_orch: OrchestratorFactory,
) -> None:
    """A step without a declared cost that reports 10 per attempt and fails transiently
    is not retried past a budget of 15: the next attempt is expected to spend what the
    last one did."""
    saga = _budgeted("spend_retried", 15)
    calls: list[int] = []

    @saga.step(retry=RETRY5)
    def buy(ctx: StepContext, order: Order) -> dict[str, Any]:
        calls.append(ctx.attempt)
        ctx.spend(10)
        raise TransientError("the provider timed out after charging")

    orch = make_orch(saga)
    state = orch.execute(saga, Order(order_id="o-1"))

    assert calls == [1]
    assert state.status == "needs_review"
    assert state.spent == 10
    assert state.error is not None and "spend_budget" in state.error
    assert _spent(orch.database_url, state.id) == 10


def test_a_budget_already_spent_blocks_a_step_that_declares_nothing(
    make_orch: OrchestratorFactory,
) -> None:
    """Once reported spend is past the budget, no further step starts."""
    saga = _budgeted("spend_over", 15)
    called: list[str] = []

    @saga.step
    def buy(ctx: StepContext, order: Order) -> dict[str, Any]:
        called.append("buy")
        ctx.spend(20)  # more than the whole budget, found out while acting
        return {"ok": True}

    @saga.step
    def buy_more(ctx: StepContext, order: Order) -> dict[str, Any]:
        called.append("buy_more")
        return {"ok": True}

    orch = make_orch(saga)
    state = orch.execute(saga, Order(order_id="o-1"))

    assert called == ["buy"]
    assert state.status == "needs_review"
    assert state.operation("buy").status == "succeeded"
    assert state.spent == 20
    assert state.error is not None and "spend_budget" in state.error


# ----- item 3: non-finite or negative spend ---------------------------------------------------


@pytest.mark.parametrize("amount", [math.inf, -math.inf, math.nan, -5.0, True])
@pytest.mark.parametrize("budget", [None, 100.0])
def test_invalid_spend_is_refused_at_the_call_and_parks_keeping_the_outcome(
    make_orch: OrchestratorFactory, amount: float, budget: float | None
) -> None:
    """ctx.spend() refuses what is not a finite non-negative number with a ValueError; the
    attempt's outcome (here a success: the step caught the error) is recorded, the refusal
    is in the audit trail, and the saga parks for a human to count the spend."""
    saga = _budgeted(f"spend_invalid_{budget is None}", budget)
    refusals: list[str] = []

    @saga.step
    def pay(ctx: StepContext, order: Order) -> dict[str, Any]:
        ctx.spend(3)
        try:
            ctx.spend(amount)
        except ValueError as exc:
            refusals.append(str(exc))
        return {"paid": True}

    @saga.step
    def ship(ctx: StepContext, order: Order) -> dict[str, Any]:
        return {"shipped": True}

    orch = make_orch(saga)
    state = orch.execute(saga, Order(order_id="o-1"))

    assert len(refusals) == 1 and "finite" in refusals[0] and repr(amount) in refusals[0]
    pay_op = state.operation("pay")
    assert pay_op.status == "succeeded" and pay_op.result == {"paid": True}
    assert state.operation("ship").status == "pending"
    assert state.status == "needs_review"
    assert state.error is not None and "spend" in state.error and repr(amount) in state.error
    assert state.spent == 3
    assert "spend_refused" in events(orch.history(state.id))


def test_invalid_spend_left_uncaught_is_an_unknown_outcome_never_a_stranded_attempt(
    make_orch: OrchestratorFactory,
) -> None:
    """A step that lets the refusal propagate may have had its effect: its outcome is
    unknown and the saga parks; nothing is left `running`."""
    saga = _budgeted("spend_invalid_uncaught", None)

    @saga.step(idempotent=True)
    def pay(ctx: StepContext, order: Order) -> dict[str, Any]:
        ctx.spend(float("inf"))
        return {"paid": True}

    orch = make_orch(saga)
    state = orch.execute(saga, Order(order_id="o-1"))

    assert state.status == "needs_review"
    assert state.operation("pay").status == "unknown"
    assert state.operation("pay").attempts == 1
    assert state.error is not None and "inf" in state.error


# ----- item 4: declared costs -------------------------------------------------------------


@pytest.mark.parametrize("cost", [-1000, math.inf, math.nan])
def test_a_declared_cost_number_must_be_finite_and_non_negative(cost: float) -> None:
    saga = order_saga("bad_cost")
    with pytest.raises(SagaDefinitionError, match="cost"):

        @saga.step(cost=cost)
        def pay(ctx: StepContext, order: Order) -> dict[str, Any]:
            return {}


@pytest.mark.parametrize("cost", [-1000.0, math.inf, math.nan, "12"])
def test_a_cost_function_returning_a_bad_cost_parks_before_the_attempt(
    make_orch: OrchestratorFactory, cost: Any
) -> None:
    """A negative cost would let a 500 step run under a budget of 100; it parks instead,
    naming the step and the value, and the step is never called."""
    saga = _budgeted(f"bad_cost_fn_{abs(hash(repr(cost)))}", 100)
    called: list[str] = []

    @saga.step(cost=lambda order: cost)
    def pay(ctx: StepContext, order: Order) -> dict[str, Any]:
        called.append("pay")
        ctx.spend(500)
        return {}

    orch = make_orch(saga)
    state = orch.execute(saga, Order(order_id="o-1"))

    assert called == []
    assert state.status == "needs_review"
    assert state.operation("pay").attempts == 0
    assert state.error is not None and "'pay'" in state.error and "cost" in state.error
    assert state.spent == 0


# ----- item 5: a guard's failure never loses an earlier outcome ---------------------------


class _Boom(Exception):
    pass


def _raising_cost(order: Order) -> float:
    raise _Boom("price service down")


def _nan_cost(order: Order) -> float:
    return math.nan


@pytest.mark.parametrize("cost", [_raising_cost, _nan_cost])
def test_a_failing_cost_of_step_two_keeps_step_ones_outcome(
    make_orch: OrchestratorFactory, cost: Any
) -> None:
    """Step 2's cost function raises (or returns NaN) after step 1 succeeded: step 1's
    outcome is recorded, and the saga parks naming step 2 and the guard's error."""
    saga = _budgeted(f"guard_fails{cost.__name__}", 1000)
    calls: list[str] = []

    @saga.step
    def reserve(ctx: StepContext, order: Order) -> dict[str, Any]:
        calls.append("reserve")
        return {"reserved": True}

    @saga.step(cost=cost)
    def pay(ctx: StepContext, order: Order) -> dict[str, Any]:
        calls.append("pay")
        return {}

    orch = make_orch(saga)
    state = orch.execute(saga, Order(order_id="o-1"))

    assert calls == ["reserve"]
    assert state.status == "needs_review"
    assert state.operation("reserve").status == "succeeded"
    assert state.operation("reserve").result == {"reserved": True}
    assert state.operation("pay").status == "pending"
    assert state.error is not None and "'pay'" in state.error
    # Running it again calls nothing twice and never turns step 1 into an unknown.
    again = make_orch(saga).run(state.id)
    assert calls == ["reserve"]
    assert again.operation("reserve").status == "succeeded"
    assert "outcome_unknown" not in events(orch.history(state.id))


# ----- item 8: replan safety survives a transient prepare failure -------------------------


class Payment(BaseModel):
    amount_cents: int


def test_a_changed_request_after_an_unknown_outcome_parks_even_after_a_failed_prepare(
    make_orch: OrchestratorFactory,
) -> None:
    """Attempt 1 sends 100 and its outcome is unknown; the re-prepare fails transiently,
    then computes 200: the saga parks with request_changed, never sending 200 under the
    same key."""
    saga = order_saga("replan_after_failure")
    plans = iter([100, TransientError("pricing unavailable"), 200, 200, 200])
    sent: list[int] = []

    @saga.step(idempotent=True, retry=RETRY5, timeout_seconds=0.2)
    async def pay(ctx: StepContext, order: Order) -> dict[str, Any]:
        sent.append(ctx.request.amount_cents)
        if len(sent) == 1:
            await asyncio.sleep(5)  # sent, and no reply before the timeout: unknown
        return {"paid": ctx.request.amount_cents}

    @pay.prepare
    def plan(ctx: StepContext, order: Order) -> Payment:
        nxt = next(plans)
        if isinstance(nxt, Exception):
            raise nxt
        return Payment(amount_cents=nxt)

    orch = make_orch(saga)
    state = orch.execute(saga, Order(order_id="o-1"))

    assert sent == [100]
    assert state.status == "needs_review"
    assert "request_changed" in events(orch.history(state.id))
    assert state.operation("pay").status == "unknown"
    assert state.operation("pay").request == {"amount_cents": 100}


# ----- item 2: spend reported before a crash or a timeout is still spent -------------------


def _crash_after_charging(url: str, children: list[ChildApp], saga: str) -> str:
    child = ChildApp(url, saga, "o-1", CRASH_APP_BLOCK="after_effect")
    children.append(child)
    saga_id = child.expect("STARTED").split()[1]
    child.expect("CHARGED")
    child.signal(signal.SIGKILL)
    assert child.wait() == -signal.SIGKILL
    return saga_id


@pytest.mark.crash
@pytest.mark.parametrize(
    ("saga", "status", "spent"),
    [
        # attempt 1 reported 10 and declared a worst case of 15; attempt 2 reports 10.
        ("crash_spend_worst", "completed", 25.0),
        # no budget: what attempt 1 reported before the kill, then attempt 2's.
        ("crash_spend_unbudgeted", "completed", 20.0),
        # a budget, and no declared worst case: a human counts the lost attempt.
        ("crash_spend_undeclared", "needs_review", 10.0),
    ],
)
def test_spend_reported_before_a_sigkill_is_counted_after_it(
    make_orch: OrchestratorFactory,
    app_url: str,
    children: list[ChildApp],
    saga: str,
    status: str,
    spent: float,
) -> None:
    saga_id = _crash_after_charging(app_url, children, saga)
    assert (
        float(
            scalar(
                app_url,
                "SELECT attempt_spend FROM saga.operations WHERE saga_id = %s AND step = 'charge'",
                (saga_id,),
            )
        )
        == 10.0
    )  # persisted when it was reported, before the kill
    orch = make_orch(*crash_app.ALL_SAGAS)
    wait_until(lambda: lease_expired(app_url, saga_id), timeout=15)
    state = orch.run(saga_id)

    assert state.status == status
    assert state.spent == spent
    assert _spent(app_url, saga_id) == spent
    if status == "needs_review":
        assert state.error is not None and "neither cost nor max_cost" in state.error
        assert state.operation("charge").status == "unknown"
        assert state.operation("charge").attempts == 1
    else:
        assert state.operation("charge").attempts == 2
        assert state.operation("charge").spent == spent


@pytest.mark.parametrize(
    ("max_cost", "status", "spent"), [(10.0, "completed", 12.0), (None, "needs_review", 4.0)]
)
def test_an_attempt_abandoned_at_its_timeout_is_counted_at_its_worst_case(
    make_orch: OrchestratorFactory, max_cost: float | None, status: str, spent: float
) -> None:
    """The first attempt reports 4, then outlives its timeout (it may spend more): it is
    counted at its max_cost; without one, under a budget, the saga parks."""
    saga = _budgeted(f"spend_timeout_{max_cost is None}", 100)

    @saga.step(idempotent=True, timeout_seconds=0.2, max_cost=max_cost, retry=RETRY5)
    async def pay(ctx: StepContext, order: Order) -> dict[str, Any]:
        ctx.spend(4 if ctx.attempt == 1 else 2)
        if ctx.attempt == 1:
            await asyncio.sleep(5)
        return {"paid": True}

    orch = make_orch(saga)
    state = orch.execute(saga, Order(order_id="o-1"))

    assert state.status == status
    assert state.spent == spent


@pytest.mark.parametrize(
    ("max_cost", "status", "spent"), [(50.0, "completed", 70.0), (None, "needs_review", 0.0)]
)
def test_an_exception_that_is_no_verdict_counts_the_attempt_at_its_worst_case(
    make_orch: OrchestratorFactory, max_cost: float | None, status: str, spent: float
) -> None:
    """The charge may have gone through before the connection reset, unreported: the
    unknown attempt is counted at its max_cost before the retry; without one, under a
    budget, the saga parks rather than retry a spend it cannot count."""
    saga = _budgeted(f"spend_reset_{max_cost is None}", 100)
    calls: list[int] = []

    @saga.step(idempotent=True, max_cost=max_cost, retry=RETRY5)
    def pay(ctx: StepContext, order: Order) -> dict[str, Any]:
        calls.append(ctx.attempt)
        if ctx.attempt == 1:
            raise RuntimeError("the gateway client crashed after sending the request")
        ctx.spend(20)
        return {"paid": True}

    orch = make_orch(saga)
    state = orch.execute(saga, Order(order_id="o-1"))

    assert state.status == status
    assert state.spent == spent
    assert calls == ([1, 2] if max_cost is not None else [1])
    if max_cost is None:
        assert state.error is not None and "neither cost nor max_cost" in state.error
