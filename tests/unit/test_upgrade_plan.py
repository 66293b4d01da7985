"""The planning of an upgrade in flight (saga.upgrade.plan_upgrade): pure, no database.

Which operations count as having taken effect, what becomes of each, and every refusal.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from saga import Saga, StepContext
from saga._core.planner import new_action_rows
from saga._core.rows import OpRow, SagaRow
from saga.state import OperationStatus, SagaStatus
from saga.upgrade import plan_upgrade


class Job(BaseModel):
    order_id: str


def saga(
    version: int, *steps: str, compensated: tuple[str, ...] = (), pivots: tuple[str, ...] = ()
) -> Saga[Job]:
    """A `pay` saga of `version` with these steps (those in `compensated` have one)."""
    made = Saga("pay", version=version, input=Job, key=lambda j: j.order_id)
    for name in steps:

        def fn(ctx: StepContext, job: Job) -> dict[str, Any]:
            return {}

        step = made.step(name=name, pivot=name in pivots)(fn)
        if name in compensated:
            step.compensation(lambda ctx, job, result: None)
    return made


def stored(source: Saga[Job], **statuses: tuple[str, int]) -> tuple[SagaRow, list[OpRow]]:
    """A saga of `source` in flight, its operations as `statuses` says (status, attempts)."""
    row = SagaRow(
        id="00000000-0000-0000-0000-000000000001",
        name="pay",
        version=source.version,
        tenant_id="",
        key="o-1",
        input={"order_id": "o-1"},
        input_hash="h",
        status=SagaStatus.NEEDS_REVIEW,
        error=None,
        direction="forward",
        fence=3,
        run_after=None,
    )
    ops = new_action_rows(source, "", "o-1", {"order_id": "o-1"})
    for op in ops:
        status, attempts = statuses.get(op.step, ("pending", 0))
        op.status, op.attempts = OperationStatus(status), attempts
    return row, ops


def moves(upgrade: Any) -> list[tuple[str, str | None, str | None, str]]:
    return [(m.move, m.step, m.to, m.key) for m in upgrade.plan.moves]


def test_attempted_operations_keep_their_keys_and_the_rest_take_the_new_version() -> None:
    """Succeeded `charge` is kept (key of v1); `ship`, failed, has no step in v2 and is
    dropped; `note`, never attempted, is created again under v2; `audit` is added."""
    v1 = saga(1, "charge", "ship", "note", compensated=("charge",))
    v2 = saga(2, "charge", "note", "audit", compensated=("charge",))
    row, ops = stored(v1, charge=("succeeded", 1), ship=("failed", 3))
    upgrade = plan_upgrade(row, ops, to_version=2, source=v1, target=v2)
    assert upgrade.plan.allowed, upgrade.plan.reasons
    assert moves(upgrade) == [
        ("kept", "charge", "charge", "pay:v1::o-1:charge"),
        ("replaced", "note", "note", "pay:v2::o-1:note"),
        ("added", None, "audit", "pay:v2::o-1:audit"),
        ("dropped", "ship", None, "pay:v1::o-1:ship"),
    ]
    assert upgrade.drop == (("action", "ship"), ("action", "note"))
    assert upgrade.renames == (("action", "charge", "charge", 0),)
    assert [op.step for op in upgrade.new_ops] == ["note", "audit"]


def test_steps_that_swap_names_keep_their_order() -> None:
    """step_map may swap two names: each operation keeps its row, under the other name."""
    v1 = saga(1, "a", "b")
    v2 = saga(2, "b", "a")
    row, ops = stored(v1, a=("succeeded", 1), b=("unknown", 1))
    upgrade = plan_upgrade(
        row, ops, to_version=2, source=v1, target=v2, step_map={"a": "b", "b": "a"}
    )
    assert upgrade.plan.allowed, upgrade.plan.reasons
    assert upgrade.plan.renamed == {"a": "b", "b": "a"}
    assert upgrade.renames == (("action", "a", "b", 0), ("action", "b", "a", 1))


def test_every_state_that_may_have_taken_effect_must_map() -> None:
    """Succeeded, running and unknown have nowhere to go: each named; a failed or a
    pending step (even retried) is not held against the upgrade."""
    v1 = saga(1, "a", "b", "c", "d", "e")
    v2 = saga(2, "z")
    row, ops = stored(
        v1,
        a=("succeeded", 1),
        b=("running", 1),
        c=("unknown", 2),
        d=("failed", 1),
        e=("pending", 2),
    )
    reasons = plan_upgrade(row, ops, to_version=2, source=v1, target=v2).plan.reasons
    assert [r.split(" and ")[0] for r in reasons] == [
        "step 'a' succeeded",
        "step 'b' is running (it may have taken effect)",
        "step 'c' has an unknown outcome (it may have taken effect)",
    ]
    assert all("step_map" in r for r in reasons)


def test_the_compensation_contract_and_the_order_are_kept() -> None:
    v1 = saga(1, "charge", "ship", compensated=("charge",), pivots=("ship",))
    row, ops = stored(v1, charge=("succeeded", 1), ship=("succeeded", 1))

    def reasons(target: Saga[Job], **kw: Any) -> tuple[str, ...]:
        return plan_upgrade(
            row, ops, to_version=target.version, source=v1, target=target, **kw
        ).plan.reasons

    assert reasons(saga(2, "charge", "ship", pivots=("ship",))) == (
        "step 'charge' succeeded and has a compensation, but step 'charge' of version 2 has "
        "none: it could no longer be undone",
    )
    assert reasons(saga(2, "charge", "ship", compensated=("charge", "ship"), pivots=("ship",))) == (
        "step 'ship' succeeded without a compensation, but step 'ship' of version 2 has one: "
        "it would undo what was never to be undone",
    )
    assert reasons(saga(2, "charge", "ship", compensated=("charge",))) == (
        "step 'ship' succeeded and is a pivot, but step 'ship' of version 2 is not",
    )
    assert reasons(
        saga(2, "charge", "check", "ship", compensated=("charge",), pivots=("ship",))
    ) == (
        "step 'check' of version 2 comes before 'ship', which has run already: the saga "
        "would run it out of order",
    )
    assert reasons(saga(2, "ship", "charge", compensated=("charge",), pivots=("ship",))) == (
        "steps 'charge' and 'ship' would change order: version 2 has 'ship' before 'charge'",
    )


def test_what_is_refused_before_any_step_is_compared() -> None:
    v1 = saga(1, "a")
    v2 = saga(2, "a")
    row, ops = stored(v1, a=("succeeded", 1))

    def reasons(**kw: Any) -> tuple[str, ...]:
        args: dict[str, Any] = {"to_version": 2, "source": v1, "target": v2, **kw}
        return plan_upgrade(row, ops, **args).plan.reasons

    assert reasons(to_version=1) == ("it is version 1 already",)
    assert reasons(target=None) == ("version 2 of 'pay' is not registered by this app",)
    assert reasons(source=None)[0].startswith("version 1 of 'pay' is not registered by this app")
    assert reasons(step_map={"nope": "a"}) == (
        "step_map names 'nope', which is not a step of version 1",
    )
    assert reasons(step_map={"a": "nope"})[0] == (
        "step_map maps 'a' onto 'nope', which is not a step of version 2"
    )
    row.lease_owner = "worker-1"
    assert reasons(live=True)[0].startswith("worker-1 holds its lease until")
    row.status = SagaStatus.COMPLETED
    assert reasons() == ("it is completed: nothing of it runs again",)
    row.status, row.name = SagaStatus.RUNNING, "session/pay"
    assert reasons()[0].startswith("it is a session or a ledger channel")
