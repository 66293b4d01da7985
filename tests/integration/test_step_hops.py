"""How many calls one step of a saga makes from the driving loop into other parts.

The driving loop is the flows (`saga._flows`) and the sync driver (`saga._drivers.driver`):
what decides and carries out each move. The effect boundary (`saga._drivers.boundary`),
which runs a flow and observes each effect it yields (fault points, spans, the log of
committed events), calls into the loop and is not part of it: one place, whatever the
step, that a reader of the loop reads once.

A profile hook (`sys.setprofile`) sees every call while `Orchestrator.execute` runs a
3-step saga on the real database; the middle step is the segment from the call of its step
function to the call of the next one. A hop is a call from a loop frame into a module
outside the loop (the step function counts as one), consecutive calls into the same module
counted once, value constructors (`__init__` and the like) left out. Each hop is a place a
reader of the loop must go to learn what one step does: the figure may only go down.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

from support import Order, order_saga

from saga import Orchestrator, StepContext

# The hops of the middle step; lower it when the loop asks less of other modules. 23 when
# the flows asked the planner for each piece of a call, recorded an outcome in three calls
# and fired fault points, spans and event logs themselves; 17 once the core answered a
# transition in one call. 6 since the effect boundary (`saga._drivers.boundary`) observes
# each effect (fault points, spans, committed events), the declaration says whether a
# function is async, and the abandoned-attempt lookup is skipped when nothing is abandoned:
# the step, the lease keeper (on and off), the core (`outcome_of` and `transition` in a row),
# the store's write, and the self-fence rule.
HOPS = 6

STEPS = ("hops_first", "hops_middle", "hops_last")
_CONSTRUCTORS = {"__init__", "__new__", "__post_init__", "__init_subclass__"}


def _module(frame: FrameType) -> str | None:
    """The part a frame runs in: `saga`'s module path (without `saga.`), `USER` for a
    step function of the measured saga, else None (the standard library, psycopg, ...)."""
    name = str(frame.f_globals.get("__name__", ""))
    if name == "saga" or name.startswith("saga."):
        return name[5:] or "__init__"
    return "USER" if frame.f_code.co_name in STEPS else None


def _caller(frame: FrameType | None) -> str | None:
    """The part of the innermost saga (or step) frame at or below `frame`."""
    while frame is not None:
        part = _module(frame)
        if part is not None:
            return part
        frame = frame.f_back
    return None


def _in_loop(part: str | None) -> bool:
    return part is not None and (part.startswith("_flows.") or part == "_drivers.driver")


def _calls(run: Any) -> list[tuple[str, str, str]]:
    """(caller, callee, callee's qualified name) of every call into saga or step code
    while `run()` runs."""
    seen: list[tuple[str, str, str]] = []

    def hook(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        callee = _module(frame)
        if callee is None:
            return
        caller = _caller(frame.f_back)
        seen.append((caller or "", callee, frame.f_code.co_qualname))

    sys.setprofile(hook)
    try:
        run()
    finally:
        sys.setprofile(None)
    return seen


def middle_step_hops(calls: list[tuple[str, str, str]]) -> list[str]:
    """The hops of the segment from the middle step's call to the last step's call."""
    starts = [i for i, (_, callee, name) in enumerate(calls) if callee == "USER"]
    names = [calls[i][2].rsplit(".", 1)[-1] for i in starts]
    assert names == list(STEPS), names
    hops: list[str] = []
    for caller, callee, name in calls[starts[1] : starts[2]]:
        if not _in_loop(caller) or _in_loop(callee):
            continue
        if name.rsplit(".", 1)[-1] in _CONSTRUCTORS:
            continue
        if hops and hops[-1].split(":")[0] == callee:
            continue
        hops.append(f"{callee}:{name} (from {caller})")
    return hops


def test_a_middle_step_makes_few_calls_from_the_loop_into_other_modules(
    database_url: str,
) -> None:
    saga = order_saga("hops")

    @saga.step(name="first")
    def hops_first(ctx: StepContext, order: Order) -> dict[str, Any]:
        return {"step": 1}

    @saga.step(name="middle")
    def hops_middle(ctx: StepContext, order: Order) -> dict[str, Any]:
        return {"step": 2}

    @saga.step(name="last")
    def hops_last(ctx: StepContext, order: Order) -> dict[str, Any]:
        return {"step": 3}

    with Orchestrator(database_url, sagas=[saga]) as orch:
        orch.execute(saga, Order(order_id="warm"))  # imports and prepared statements
        states: list[Any] = []
        calls = _calls(lambda: states.append(orch.execute(saga, Order(order_id="o-1"))))
    assert states[0].status == "completed"
    hops = middle_step_hops(calls)
    print("\n".join(hops))
    assert len(hops) <= HOPS, hops
