"""Ceilings and spend: what stops an attempt before it starts, and what it is charged.

Before each attempt the planner checks its declared cost (`declared_cost`) and the
saga's ceilings and the step's cost limit (`ceiling_breach`); what the attempt spent,
declared or reported with `ctx.spend()`, is counted into the operation and the saga
once its outcome is recorded. Like the rest of the core, this module does no I/O and
reads no clock: the time is the planner's `now`. The checks take rows and values, never
the planner: they answer verdicts (a cost, a breach, why the saga must park), and the
planner applies them.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from saga._core.rows import OpRow, SagaRow, describe
from saga.amounts import finite_amount
from saga.definition import OperationSpec
from saga.state import OperationStatus


def declared_cost(
    op: OpRow, spec: OperationSpec, arguments: Callable[[], tuple[Any, ...]]
) -> tuple[float | None, str | None]:
    """The declared cost of the operation's next attempt, and why it cannot be used
    (a cost function that raises, or a cost that is not a finite, non-negative
    number); the reason parks the saga before anything is called. `arguments` gives
    what a cost function receives (asked only when the cost is a function)."""
    declared = spec.guards.cost
    if declared is None:
        return None, None
    what = describe(op)
    if isinstance(declared, int | float):
        value: object = declared
    else:
        try:
            value = declared(*arguments())
        except Exception as exc:
            return None, (
                f"the cost function of {what} raised {type(exc).__name__}: {exc}; "
                f"{what} not started"
            )
    cost = finite_amount(value)
    if cost is None:
        return None, (
            f"the cost of {what} is {value!r}: a cost must be a finite, non-negative "
            f"number; {what} not started"
        )
    return cost, None


def _expected_spend(op: OpRow, spec: OperationSpec, cost: float | None) -> float:
    """What the next attempt of `op` is expected to spend: its declared cost, else
    its declared max_cost, plus, at least, what one earlier attempt of it reported."""
    if cost is not None:
        return cost + op.peak_spend
    if spec.guards.max_cost is not None:
        return max(spec.guards.max_cost, op.peak_spend)
    return op.peak_spend


def ceiling_breach(
    saga: SagaRow, now: datetime, op: OpRow, spec: OperationSpec, cost: float | None
) -> dict[str, Any] | None:
    """The ceiling the attempt of `op` about to start (of declared `cost`) would go past,
    as the detail recorded when the saga parks for it (`reason` says it in words), or
    None when the attempt may start: the saga's deadline, max_operations and
    max_side_effects, the step's max_cost, then the spend budget, at time `now`."""
    what = describe(op)
    if saga.deadline_at is not None and now >= saga.deadline_at:
        return {
            "ceiling": "deadline",
            "deadline_at": str(saga.deadline_at),
            "reason": f"ceiling deadline reached: the saga's deadline passed at "
            f"{saga.deadline_at:%Y-%m-%d %H:%M:%S%z}; {what} not started",
        }
    if saga.max_operations is not None and saga.operations_executed >= saga.max_operations:
        return {
            "ceiling": "max_operations",
            "limit": saga.max_operations,
            "executed": saga.operations_executed,
            "reason": f"ceiling max_operations reached: {saga.operations_executed} of "
            f"{saga.max_operations} operations executed; {what} not started",
        }
    if (
        spec.guards.side_effect
        and saga.max_side_effects is not None
        and saga.side_effects >= saga.max_side_effects
    ):
        return {
            "ceiling": "max_side_effects",
            "limit": saga.max_side_effects,
            "executed": saga.side_effects,
            "reason": f"ceiling max_side_effects reached: {saga.side_effects} of "
            f"{saga.max_side_effects} side effects performed; {what} not started",
        }
    if cost is not None and spec.guards.max_cost is not None and cost > spec.guards.max_cost:
        return {
            "ceiling": "max_cost",
            "limit": spec.guards.max_cost,
            "cost": cost,
            "reason": f"per-step limit max_cost: {what} would cost {cost:g}, above its "
            f"limit of {spec.guards.max_cost:g}",
        }
    if saga.spend_budget is None:
        return None
    expected = _expected_spend(op, spec, cost)
    # An action that declares and has reported nothing is stopped only by a budget
    # already exceeded; a compensation (an undo) only by what it is expected to spend.
    if (expected > 0 or op.kind == "action") and saga.spent + expected > saga.spend_budget:
        return {
            "ceiling": "spend_budget",
            "limit": saga.spend_budget,
            "spent": saga.spent,
            "cost": expected,
            "reason": f"ceiling spend_budget reached: {saga.spent:g} spent + {expected:g} "
            f"expected for {what} exceeds the budget of {saga.spend_budget:g}",
        }
    return None


def note_spend(op: OpRow, amount: float) -> bool:
    """Spend that step code reported with `ctx.spend()` during the attempt in flight
    (its running total, persisted or not yet), counted when its outcome is recorded;
    whether it changed `op` (the planner notes the row changed)."""
    if amount > op.attempt_spend:
        op.attempt_spend = amount
        return True
    return False


def refused_spend(op: OpRow, reason: str) -> str:
    """Why the saga parks when step code reported a spend that is not a finite,
    non-negative number (`reason`): it was refused and not counted; the attempt's
    outcome is recorded as it is, and a human counts what was spent."""
    return (
        f"{describe(op)} attempt {op.attempts} reported a spend that was refused ("
        f"{reason}); its outcome is recorded, the spend is not counted: check what it "
        "spent, then retry, resolve or compensate"
    )


def count_spend(saga: SagaRow, op: OpRow, amount: float) -> None:
    """Count what an attempt of `op` reported into the operation and `saga`, once (the
    planner, which records the attempt's outcome, notes the row changed)."""
    if amount <= 0:
        return
    saga.spent += amount
    op.spent += amount
    op.peak_spend = max(op.peak_spend, amount)
    op.attempt_spend = 0.0


def unknown_spend_counted(op: OpRow) -> bool:
    """Whether the spend of `op`'s attempt of unknown outcome was counted already: when
    it became unknown (a reconcile answer now)."""
    return op.status == OperationStatus.UNKNOWN and op.attempt_spend == 0


def count_unknown_spend(saga: SagaRow, op: OpRow, spec: OperationSpec | None) -> str | None:
    """Count the spend of an attempt whose outcome is unknown (lost to a crash, past its
    timeout, or ended by an exception that is not a verdict), once: what it reported,
    raised to its declared max_cost when it declared no cost (a declared cost was
    counted as it started). Returns why the saga must park instead, when a spend budget
    is set and the step (`spec`; None for a compensation not declared) declares neither
    cost nor max_cost."""
    if unknown_spend_counted(op):
        return None
    reported = op.attempt_spend
    max_cost = spec.guards.max_cost if spec is not None else None
    declares_cost = op.cost is not None  # counted as the attempt started
    if not declares_cost and max_cost is not None:
        count_spend(saga, op, max(reported, max_cost))
        return None
    count_spend(saga, op, reported)
    if declares_cost or saga.spend_budget is None:
        return None
    return (
        f"what attempt {op.attempts} of {describe(op)} spent is unknown ({reported:g} "
        "reported before it was lost) and it declares neither cost nor max_cost, so the "
        "spend budget cannot count it: check with the provider, then retry, resolve or "
        "compensate"
    )
