"""A compensation of a step whose outcome is unknown gets result=None (include_unknown).

No result was ever recorded for such a step: its compensation, and a cost function of it,
receive None where a succeeded step's result would be, even when the step returns a model.
"""

from __future__ import annotations

from typing import Any

from support import OrchestratorFactory, Order, Receipt, order_saga

from saga import StepContext
from saga.definition import Step


def test_a_compensation_of_an_unknown_step_gets_none(make_orch: OrchestratorFactory) -> None:
    saga = order_saga("unknown-result")
    seen: dict[str, Any] = {}

    @saga.step
    def charge(ctx: StepContext, o: Order) -> Receipt:
        raise KeyError("receipt_id")  # after the effect, maybe: its outcome is unknown

    def refund_cost(o: Order, result: Receipt | None) -> float:
        seen["cost"] = result
        return 1.0

    @charge.compensation(cost=refund_cost)
    def refund(ctx: StepContext, o: Order, result: Receipt | None) -> None:
        seen["refund"] = result

    orch = make_orch(saga)
    state = orch.execute(saga, Order(order_id="o-1"))
    assert state.status == "needs_review"
    assert state.operation("charge").status == "unknown"

    state = orch.compensate(state.id, include_unknown=True, actor="ops")

    assert state.status == "compensated", state.error
    assert seen == {"cost": None, "refund": None}


def test_the_compensation_docstring_says_result_may_be_none() -> None:
    """Where compensations are declared, the None result is documented."""
    doc = Step.compensation.__doc__ or ""
    assert "(ctx, input, result)" in doc
    assert "result=None" in doc and "include_unknown=True" in doc
    assert "| None" in doc
