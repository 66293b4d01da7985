"""One saga never takes its driver down: what cannot be planned or driven is parked."""

from __future__ import annotations

from typing import Any

from support import OrchestratorFactory, Order, Receipt, order_saga, scalar

from saga import StepContext


def test_run_parks_a_saga_whose_driving_raises(make_orch: OrchestratorFactory) -> None:
    """A stored result that the step's return model no longer accepts makes building the
    next step's context raise while the saga is driven: run() parks the saga with the
    reason and returns it, rather than raising with the lease held."""
    saga = order_saga("undecodable")

    @saga.step
    def charge(ctx: StepContext, order: Order) -> Receipt:
        return Receipt(receipt_id="r-1", amount_cents=order.amount_cents)

    @saga.step
    def ship(ctx: StepContext, order: Order) -> dict[str, Any]:
        return {"receipt": ctx.results["charge"].receipt_id}

    orch = make_orch(saga)
    saga_id = orch.start(saga, Order(order_id="o-1")).id
    scalar(
        orch.database_url,
        "UPDATE saga.operations SET status = 'succeeded', attempts = 1,"
        " result = '{\"bogus\": true}' WHERE saga_id = %s AND step = 'charge' RETURNING 1",
        (saga_id,),
    )
    state = orch.run(saga_id)
    assert state.status == "needs_review"
    assert state.error is not None and "ValidationError" in state.error, state.error
    assert state.lease_owner is None
    events = [e.event for e in orch.history(saga_id)]
    assert events[-2:] == ["saga_parked", "lease_released"]


def test_run_parks_a_saga_whose_cost_function_raises(make_orch: OrchestratorFactory) -> None:
    """A cost function that raises while the claim plans the first attempt parks the saga
    in the claim's transaction: nothing is started, the reason is recorded."""
    saga = order_saga("costly")

    def cost(order: Order) -> float:
        raise ZeroDivisionError("no price list")

    @saga.step(cost=cost)
    def charge(ctx: StepContext, order: Order) -> dict[str, Any]:
        raise AssertionError("never called")

    orch = make_orch(saga)
    saga_id = orch.start(saga, Order(order_id="o-1")).id
    state = orch.run(saga_id)
    assert state.status == "needs_review"
    assert state.error is not None
    assert "ZeroDivisionError: no price list" in state.error
    assert [(op.status, op.attempts) for op in state.operations] == [("pending", 0)]
    assert state.lease_owner is None
