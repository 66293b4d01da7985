"""Operator verbs from Python: a ceiling is only ever raised (unlimited is the highest),
and every verb names a non-empty actor, the OS user when none is given."""

from __future__ import annotations

import getpass
import os
from typing import Any

import pytest
from support import OrchestratorFactory, Order
from test_operator_requests import Provider, _refund_saga, _rows

from saga import Ceilings, Saga, StepContext, StepStateError


def _os_user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no login name in some containers
        return f"uid-{os.getuid()}"


def _capped(name: str, ceilings: Ceilings) -> tuple[Saga[Order], list[str]]:
    """Two steps under these ceilings; `calls` says which ran."""
    saga = Saga(name, input=Order, key=lambda o: o.order_id, ceilings=ceilings)
    calls: list[str] = []

    @saga.step
    def first(ctx: StepContext, o: Order) -> dict[str, Any]:
        calls.append("first")
        return {"ok": 1}

    @saga.step
    def second(ctx: StepContext, o: Order) -> dict[str, Any]:
        calls.append("second")
        return {"ok": 2}

    return saga, calls


# ----- item 9: unlimited is the highest ceiling ---------------------------------------------


def test_raise_ceilings_refuses_a_limit_where_the_saga_has_none(
    make_orch: OrchestratorFactory, database_url: str
) -> None:
    """A saga parked at max_side_effects has no max_operations and no spend_budget: setting
    either would lower it from unlimited, and is refused like any lowering, writing nothing.
    Raising the ceiling it has still works, and the others stay unlimited."""
    saga, calls = _capped("side_capped", Ceilings(max_side_effects=1))
    orch = make_orch(saga)
    saga_id = orch.execute(saga, Order(order_id="o-1")).id
    assert orch.get(saga_id).status == "needs_review" and calls == ["first"]
    before = _rows(database_url)

    with pytest.raises(
        StepStateError, match="max_operations can only be raised: it is unlimited, not 1"
    ):
        orch.raise_ceilings(saga_id, actor="ops", max_operations=1)
    with pytest.raises(
        StepStateError, match="spend_budget can only be raised: it is unlimited, not 5"
    ):
        orch.raise_ceilings(saga_id, actor="ops", spend_budget=5)
    # One refused ceiling refuses the whole request: max_side_effects is not raised either.
    with pytest.raises(StepStateError, match="max_operations can only be raised"):
        orch.raise_ceilings(saga_id, actor="ops", max_side_effects=3, max_operations=10)
    assert _rows(database_url) == before

    raised = orch.raise_ceilings(saga_id, actor="ops", max_side_effects=2)
    assert (raised.max_side_effects, raised.max_operations, raised.spend_budget) == (2, None, None)
    assert orch.run(saga_id).status == "completed" and calls == ["first", "second"]


def test_raise_ceilings_refuses_max_side_effects_where_there_is_none(
    make_orch: OrchestratorFactory, database_url: str
) -> None:
    """A saga parked at max_operations has no max_side_effects: even 0 would lower it."""
    saga, calls = _capped("ops_capped", Ceilings(max_operations=1))
    orch = make_orch(saga)
    saga_id = orch.execute(saga, Order(order_id="o-2")).id
    assert orch.get(saga_id).status == "needs_review"
    before = _rows(database_url)

    with pytest.raises(
        StepStateError, match="max_side_effects can only be raised: it is unlimited, not 0"
    ):
        orch.raise_ceilings(saga_id, actor="ops", max_side_effects=0, max_operations=2)
    assert _rows(database_url) == before
    assert orch.get(saga_id).status == "needs_review" and calls == ["first"]


# ----- item 10: every verb names who acted ---------------------------------------------------


def _parked(orch_factory: OrchestratorFactory) -> tuple[Any, str]:
    """A saga parked while compensating: refund failed at its ceiling."""
    saga = _refund_saga(Provider())
    orch = orch_factory(saga)
    saga_id = orch.execute(saga, Order(order_id="o-p")).id
    state = orch.get(saga_id)
    assert state.status == "needs_review", state.error
    return orch, saga_id


VERBS = ["raise_ceilings", "resolve", "retry", "compensate", "cancel", "approval"]


@pytest.mark.parametrize("verb", VERBS)
@pytest.mark.parametrize("blank", ["", "   "])
def test_every_operator_verb_refuses_an_empty_actor_and_writes_nothing(
    make_orch: OrchestratorFactory,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    verb: str,
    blank: str,
) -> None:
    """raise_ceilings, resolve, retry, compensate, cancel and approval each refuse an empty
    or blank actor with a ValueError naming the verb, before anything is written."""
    monkeypatch.setenv("SAGA_CONFIRMATION_KEY", "actor-test-key")
    orch, saga_id = _parked(make_orch)
    pending = orch.start(_refund_saga(Provider()), Order(order_id="o-q")).id
    before = _rows(database_url)

    calls = {
        "raise_ceilings": lambda: orch.raise_ceilings(saga_id, actor=blank, max_operations=50),
        "resolve": lambda: orch.resolve(
            saga_id, "charge", kind="compensation", outcome="succeeded", actor=blank
        ),
        "retry": lambda: orch.retry(saga_id, extra_attempts=1, actor=blank),
        "compensate": lambda: orch.compensate(saga_id, actor=blank),
        "cancel": lambda: orch.cancel(pending, reason="customer asked", actor=blank),
        "approval": lambda: orch.approval(saga_id, "ship", "0" * 64, actor=blank),
    }
    with pytest.raises(ValueError, match=rf"^{verb}\(\) needs an actor: ") as refused:
        calls[verb]()
    assert "audit trail" in str(refused.value)
    assert _rows(database_url) == before


def test_verbs_without_an_actor_record_the_os_user(make_orch: OrchestratorFactory) -> None:
    """retry, compensate and cancel keep `actor` optional: None records the OS user running
    the call in the audit event (and in the cancelled saga's error)."""
    user = _os_user()
    orch, saga_id = _parked(make_orch)

    retried = orch.retry(saga_id, extra_attempts=1)
    assert retried.status == "compensating"
    event = [e for e in orch.history(saga_id) if e.event == "retry_requested"][-1]
    assert event.detail["actor"] == user

    second = orch.execute(_refund_saga(Provider()), Order(order_id="o-r")).id
    orch.compensate(second)
    event = [e for e in orch.history(second) if e.event == "compensation_requested"][-1]
    assert event.detail["actor"] == user
    raised = [e for e in orch.history(second) if e.event == "ceiling_raised"]
    assert raised and all(e.detail["actor"] == user for e in raised)

    pending = orch.start(_refund_saga(Provider()), Order(order_id="o-s")).id
    cancelled = orch.cancel(pending, reason="customer asked")
    event = [e for e in orch.history(pending) if e.event == "cancel_requested"][-1]
    assert event.detail["actor"] == user
    assert cancelled.error == f"cancelled by {user}: customer asked"
