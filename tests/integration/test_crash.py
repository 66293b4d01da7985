"""Crash and resume: a real child process is SIGKILLed mid-saga, the parent resumes it."""

from __future__ import annotations

import os
import signal

import crash_app
import psycopg
import pytest
from crash_app import CrashOrder
from support import ChildApp, OrchestratorFactory, events, lease_expired, wait_until

from saga import Orchestrator, SagaState

pytestmark = pytest.mark.crash


def _calls(url: str, step: str) -> list[tuple[str, int, int]]:
    """(idempotency_key, attempt, pid) of every call of `step`, in call order."""
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT idempotency_key, attempt, pid FROM step_calls WHERE step = %s ORDER BY id",
            (step,),
        ).fetchall()
    return [(str(k), int(a), int(p)) for k, a, p in rows]


def _provider_rows(url: str) -> list[tuple[str, str, int]]:
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT idempotency_key, charge_id, pid FROM provider_charges"
        ).fetchall()
    return [(str(k), str(c), int(p)) for k, c, p in rows]


def _crash_in_charge(
    url: str, children: list[ChildApp], saga: str, block: str, signal_line: str
) -> tuple[str, int]:
    """Start `saga` in a child, wait for `signal_line` from its charge step, SIGKILL it."""
    child = ChildApp(url, saga, "o-1", CRASH_APP_BLOCK=block)
    children.append(child)
    saga_id = child.expect("STARTED").split()[1]
    child.expect(signal_line)
    child.signal(signal.SIGKILL)
    assert child.wait() == -signal.SIGKILL
    return saga_id, child.proc.pid


def _resume(
    make_orch: OrchestratorFactory, url: str, saga_id: str
) -> tuple[Orchestrator, SagaState]:
    """Wait for the dead child's lease to expire, then run the saga in this process."""
    orch = make_orch(*crash_app.ALL_SAGAS)
    before = orch.get(saga_id)
    assert before.status == "running"
    assert before.operation("reserve").status == "succeeded"
    assert before.operation("charge").status == "running"
    wait_until(lambda: lease_expired(url, saga_id), timeout=15)
    return orch, orch.run(saga_id)


def test_unknown_charge_is_settled_by_reconcile(
    make_orch: OrchestratorFactory, app_url: str, children: list[ChildApp]
) -> None:
    """Killed after charging: reconcile finds the charge by key, it is not charged again."""
    saga_id, child_pid = _crash_in_charge(
        app_url, children, crash_app.RECONCILED.name, "after_effect", "CHARGED"
    )
    orch, state = _resume(make_orch, app_url, saga_id)

    assert state.status == "completed"
    key = "crash_reconciled:v1::o-1:charge"
    assert _calls(app_url, "reserve") == [("crash_reconciled:v1::o-1:reserve", 1, child_pid)]
    assert _calls(app_url, "charge") == [(key, 1, child_pid)]
    assert [c[0] for c in _calls(app_url, "reconcile")] == [key]
    assert len(_calls(app_url, "confirm")) == 1
    assert _provider_rows(app_url) == [(key, "ch_o-1", child_pid)]
    charge = state.operation("charge")
    assert charge.status == "succeeded"
    assert charge.result == {"charge_id": "ch_o-1", "pid": child_pid}
    assert charge.provider_reference == "ch_o-1"
    assert charge.attempts == 1
    assert state.operation("confirm").result == {"confirmed": "ch_o-1"}
    names = events(orch.history(saga_id))
    assert "outcome_unknown" in names
    assert "reconcile_found" in names
    unknown = [e for e in orch.history(saga_id) if e.event == "outcome_unknown"]
    assert [e.step for e in unknown] == ["charge"]


def test_unknown_idempotent_charge_is_retried_with_the_same_key(
    make_orch: OrchestratorFactory, app_url: str, children: list[ChildApp]
) -> None:
    """Killed after charging: an idempotent step is retried with its key; one charge results."""
    saga_id, child_pid = _crash_in_charge(
        app_url, children, crash_app.IDEMPOTENT.name, "after_effect", "CHARGED"
    )
    orch, state = _resume(make_orch, app_url, saga_id)

    assert state.status == "completed"
    key = "crash_idempotent:v1::o-1:charge"
    assert len(_calls(app_url, "reserve")) == 1
    assert _calls(app_url, "charge") == [(key, 1, child_pid), (key, 2, os.getpid())]
    assert _provider_rows(app_url) == [(key, "ch_o-1", child_pid)]
    charge = state.operation("charge")
    assert charge.status == "succeeded"
    assert charge.attempts == 2  # the unknown attempt counts
    assert "outcome_unknown" in events(orch.history(saga_id))


def test_unknown_charge_without_reconcile_waits_for_a_human(
    make_orch: OrchestratorFactory, app_url: str, children: list[ChildApp]
) -> None:
    """Killed after charging, neither reconcile nor idempotent: parked until resolved."""
    saga_id, child_pid = _crash_in_charge(
        app_url, children, crash_app.PLAIN.name, "after_effect", "CHARGED"
    )
    orch, state = _resume(make_orch, app_url, saga_id)

    assert state.status == "needs_review"
    assert state.error
    assert state.operation("charge").status == "unknown"
    assert len(_calls(app_url, "charge")) == 1
    assert _calls(app_url, "confirm") == []
    assert "outcome_unknown" in events(orch.history(saga_id))

    orch.resolve(
        saga_id,
        "charge",
        outcome="succeeded",
        result={"charge_id": "ch_o-1", "pid": child_pid},
        actor="ops@example",
        reason="found in the provider dashboard",
    )
    state = orch.run(saga_id)

    assert state.status == "completed"
    assert state.operation("charge").status == "succeeded"
    assert state.operation("charge").result == {"charge_id": "ch_o-1", "pid": child_pid}
    assert state.operation("confirm").result == {"confirmed": "ch_o-1"}
    assert len(_calls(app_url, "charge")) == 1
    assert len(_calls(app_url, "reserve")) == 1
    assert len(_provider_rows(app_url)) == 1
    resolved = [e for e in orch.history(saga_id) if e.event == "operation_resolved"]
    assert len(resolved) == 1
    assert resolved[0].step == "charge"
    assert resolved[0].detail.get("actor") == "ops@example"


def test_unknown_last_attempt_parks_instead_of_failing(
    make_orch: OrchestratorFactory, app_url: str, children: list[ChildApp]
) -> None:
    """An unknown attempt at the ceiling parks the saga; it never turns failed or compensates."""
    saga_id, _ = _crash_in_charge(
        app_url, children, crash_app.AT_CEILING.name, "after_effect", "CHARGED"
    )
    orch, state = _resume(make_orch, app_url, saga_id)

    assert state.status == "needs_review"
    charge = state.operation("charge")
    assert (charge.status, charge.attempts, charge.max_attempts) == ("unknown", 1, 1)
    assert len(_calls(app_url, "charge")) == 1
    assert _calls(app_url, "confirm") == []
    assert all(op.kind == "action" for op in state.operations)
    assert "outcome_unknown" in events(orch.history(saga_id))


def test_kill_before_the_effect_resumes_without_rerunning_step_one(
    make_orch: OrchestratorFactory, app_url: str, children: list[ChildApp]
) -> None:
    """Killed after step 1 was recorded, before step 2's effect: step 1 never runs again."""
    saga_id, child_pid = _crash_in_charge(
        app_url, children, crash_app.RECONCILED.name, "before_effect", "IN_CHARGE"
    )
    assert _provider_rows(app_url) == []
    orch, state = _resume(make_orch, app_url, saga_id)

    assert state.status == "completed"
    key = "crash_reconciled:v1::o-1:charge"
    assert _calls(app_url, "reserve") == [("crash_reconciled:v1::o-1:reserve", 1, child_pid)]
    assert _calls(app_url, "charge") == [(key, 1, child_pid), (key, 2, os.getpid())]
    assert _provider_rows(app_url) == [(key, "ch_o-1", os.getpid())]
    assert state.operation("reserve").attempts == 1
    assert state.operation("charge").result == {"charge_id": "ch_o-1", "pid": os.getpid()}
    names = events(orch.history(saga_id))
    assert "outcome_unknown" in names
    assert "reconcile_absent" in names


def test_resume_input_is_the_stored_input(
    make_orch: OrchestratorFactory, app_url: str, children: list[ChildApp]
) -> None:
    """The resumed saga keeps the identity and input the crashed process stored."""
    saga_id, _ = _crash_in_charge(
        app_url, children, crash_app.IDEMPOTENT.name, "before_effect", "IN_CHARGE"
    )
    _orch, state = _resume(make_orch, app_url, saga_id)

    assert state.status == "completed"
    assert state.key == "o-1"
    assert CrashOrder.model_validate(state.input) == CrashOrder(order_id="o-1")
