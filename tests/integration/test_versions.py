"""Deploying a new version while sagas are in flight, as docs/deploying.md tells it.

A saga is planned from the operations stored at its start, by the definition registered
under its (name, version): a definition changed under the same version parks the sagas
it no longer fits; the old version kept registered beside the new one drains them.
"""

from __future__ import annotations

from typing import Any

import pytest
from support import OrchestratorFactory, Order, order_saga, scalar

from saga import IdempotencyConflict, NotRegistered, Saga, StepContext

DRIFT = "cannot plan saga 'signup' v1 under its registered definition"
NO_STEP = "has no step {!r}; was the definition changed without bumping its version?"


def signup(version: int, steps: list[str], calls: list[str]) -> Saga[Order]:
    """A saga named `signup` of the given version whose steps record their calls."""
    saga = order_saga("signup", version=version)
    for name in steps:

        def step(ctx: StepContext, o: Order, name: str = name) -> dict[str, Any]:
            calls.append(f"v{version}:{name}:{o.order_id}")
            return {"done": name}

        saga.step(name=name)(step)
    return saga


def test_a_definition_changed_under_the_same_version_parks_its_sagas(
    make_orch: OrchestratorFactory,
) -> None:
    """A v1 saga started with steps (account, mail), then driven by a v1 whose step list
    renamed `mail` to `welcome` without a new version, parks with the reason when it
    reaches the operation the definition no longer declares; nothing of it is run. With the
    old definition back under v1, `retry` resumes it."""
    calls: list[str] = []
    v1 = signup(1, ["account", "mail"], calls)
    drifted = signup(1, ["account", "welcome"], calls)
    saga_id = make_orch(v1).start(v1, Order(order_id="u-1")).id

    state = make_orch(drifted).run(saga_id)

    assert state.status == "needs_review"
    assert state.error is not None and state.error.startswith(DRIFT), state.error
    assert NO_STEP.format("mail") in state.error
    assert calls == ["v1:account:u-1"]
    assert [(op.step, op.status) for op in state.operations] == [
        ("account", "succeeded"),
        ("mail", "pending"),
    ]
    assert state.lease_owner is None

    # The fix: the old definition back under its version; `retry` resumes the saga.
    restored = make_orch(v1)
    restored.retry(saga_id, actor="ops")
    assert restored.run(saga_id).status == "completed"
    assert calls == ["v1:account:u-1", "v1:mail:u-1"]


def test_a_step_renamed_after_it_succeeded_parks_before_the_next_call(
    make_orch: OrchestratorFactory,
) -> None:
    """A step that already succeeded, renamed under the same version, is missed when the
    next step is about to run (its context reads the earlier results): the saga parks
    naming it, and the next step is not called: its attempt, recorded as started before
    the miss, is recorded as not called (never as running, never as unknown)."""
    calls: list[str] = []
    v1 = signup(1, ["account", "mail"], calls)
    renamed = signup(1, ["create_account", "mail"], calls)
    saga_id = make_orch(v1).start(v1, Order(order_id="u-1")).id
    # As if the previous release's worker had run the first step before the deploy.
    scalar(
        make_orch().database_url,
        "UPDATE saga.operations SET status = 'succeeded', attempts = 1,"
        """ result = '{"done": "account"}' WHERE saga_id = %s AND step = 'account'"""
        " RETURNING 1",
        (saga_id,),
    )

    state = make_orch(renamed).run(saga_id)

    assert state.status == "needs_review"
    assert state.error is not None, state.error
    assert "was not called" in state.error, state.error
    assert NO_STEP.format("account") in state.error
    assert calls == []
    assert [(op.step, op.status, op.attempts) for op in state.operations] == [
        ("account", "succeeded", 1),
        ("mail", "pending", 1),
    ]
    history = make_orch(renamed).history(saga_id)
    assert "attempt_not_called" in [e.event for e in history]
    assert "outcome_unknown" not in [e.event for e in history]


def test_the_old_version_kept_registered_drains_its_sagas(
    make_orch: OrchestratorFactory,
) -> None:
    """With v1 and v2 registered together, a saga started under v1 completes under v1's
    steps and one started under v2 under v2's, each by the definition `start` was given."""
    calls: list[str] = []
    v1 = signup(1, ["account", "mail"], calls)
    v2 = signup(2, ["account", "welcome", "mail"], calls)
    old_id = make_orch(v1).start(v1, Order(order_id="u-1")).id

    orch = make_orch(v1, v2)
    new = orch.start(v2, Order(order_id="u-2"))
    assert (new.saga, new.version) == ("signup", 2)
    with pytest.raises(IdempotencyConflict, match="version 1"):
        orch.start(v2, Order(order_id="u-1"))  # the key is taken by the v1 saga
    orch.worker(concurrency=2).run(until_idle=True)

    old, fresh = orch.get(old_id), orch.get(new.id)
    assert (old.version, old.status) == (1, "completed")
    assert [op.step for op in old.operations] == ["account", "mail"]
    assert (fresh.version, fresh.status) == (2, "completed")
    assert [op.step for op in fresh.operations] == ["account", "welcome", "mail"]
    assert sorted(calls) == [
        "v1:account:u-1",
        "v1:mail:u-1",
        "v2:account:u-2",
        "v2:mail:u-2",
        "v2:welcome:u-2",
    ]


def test_a_version_nobody_registers_waits_and_run_refuses_it(
    make_orch: OrchestratorFactory,
) -> None:
    """A worker of an app that registers only v2 never claims a v1 saga: it stays pending,
    untouched; `run(id)` there raises NotRegistered and writes nothing. Registering v1
    again drains it."""
    calls: list[str] = []
    v1 = signup(1, ["account", "mail"], calls)
    v2 = signup(2, ["account", "welcome", "mail"], calls)
    old_id = make_orch(v1).start(v1, Order(order_id="u-1")).id

    only_v2 = make_orch(v2)
    only_v2.worker(concurrency=2).run(until_idle=True)
    with pytest.raises(NotRegistered, match="saga 'signup' version 1 is not registered"):
        only_v2.run(old_id)
    state = only_v2.get(old_id)
    assert (state.status, state.updated_at) == ("pending", state.created_at)
    assert calls == []

    assert make_orch(v1, v2).run(old_id).status == "completed"
    assert calls == ["v1:account:u-1", "v1:mail:u-1"]


def test_a_step_added_under_the_same_version_is_not_run_by_sagas_in_flight(
    make_orch: OrchestratorFactory,
) -> None:
    """Only the stored operations are checked against the definition: a step added without
    a new version is unknown to the sagas started before, which complete without it."""
    calls: list[str] = []
    v1 = signup(1, ["account", "mail"], calls)
    grown = signup(1, ["account", "mail", "survey"], calls)
    saga_id = make_orch(v1).start(v1, Order(order_id="u-1")).id

    state = make_orch(grown).run(saga_id)

    assert state.status == "completed"
    assert [op.step for op in state.operations] == ["account", "mail"]
    assert calls == ["v1:account:u-1", "v1:mail:u-1"]


def test_steps_reordered_under_the_same_version_run_in_their_stored_order(
    make_orch: OrchestratorFactory,
) -> None:
    """Nor is the order compared: a saga started before the steps were swapped runs them in
    the order stored at its start, with the code now registered."""
    calls: list[str] = []
    v1 = signup(1, ["account", "mail"], calls)
    swapped = signup(1, ["mail", "account"], calls)
    saga_id = make_orch(v1).start(v1, Order(order_id="u-1")).id

    assert make_orch(swapped).run(saga_id).status == "completed"
    assert calls == ["v1:account:u-1", "v1:mail:u-1"]
