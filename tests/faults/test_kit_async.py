"""saga.testing.crash_test through the async door: an app whose orchestrator is an
AsyncOrchestrator is driven by its children with `await orch.run(...)`, killed with
SIGKILL at every fault point, and resumed."""

from __future__ import annotations

import pytest

from faults import crash_app_async
from saga import Orchestrator
from saga.testing import FAULT_POINTS, CrashReport, crash_test

pytestmark = [pytest.mark.integration, pytest.mark.crash]

APP = "faults.crash_app_async:orch"


def _calls_per_operation(url: str, report: CrashReport) -> dict[str, dict[tuple[str, str], int]]:
    """For the baseline's saga and every run's: how many times each of its operations
    was called, by the ledger (which deduplicates nothing)."""
    counts = crash_app_async.executions(url)
    out: dict[str, dict[tuple[str, str], int]] = {}
    with Orchestrator(url, auto_migrate=False) as orch:
        for run in [report.baseline, *report.runs]:
            state = orch.get(run.saga_id)
            out[run.saga_id] = {
                (op.step, str(op.kind)): counts.get(op.idempotency_key, 0)
                for op in state.operations
            }
    return out


def test_async_app_survives_a_kill_at_every_fault_point_of_every_step(
    database_url: str,
) -> None:
    """A delivery (two coroutine steps around a plain one, a reconcile hook on each)
    killed at each of the 4 fault points of each of its 3 steps is resumed and completes;
    no step was executed twice, and every one exactly once. The children drove it through
    the async door: the baseline's coroutines were awaited on one event loop."""
    crash_app_async.create_ledger(database_url)
    report = crash_test(
        app=APP,
        saga="delivery",
        input=lambda run: {"key": f"d-{run}"},
        database_url=database_url,
        effects=lambda key: crash_app_async.executions(database_url).get(key, 0),
    )
    print(report.summary())
    assert report.baseline.status == "completed"
    assert len(report.runs) == 3 * len(FAULT_POINTS)
    assert len(report.killed) == len(report.runs), report.summary()
    assert report.parked == {}
    assert all(r.status == "completed" for r in report.runs), report.summary()
    once = {("book", "action"): 1, ("charge", "action"): 1, ("dispatch", "action"): 1}
    for saga_id, ops in _calls_per_operation(database_url, report).items():
        assert ops == once, saga_id
    with Orchestrator(database_url, auto_migrate=False) as orch:
        baseline = orch.get(report.baseline.saga_id)
    keys = [op.idempotency_key for op in baseline.operations]
    assert crash_app_async.most_calls_on_one_loop(database_url, keys) >= 2


def test_async_app_survives_a_kill_in_every_compensation(database_url: str) -> None:
    """A refused delivery is compensated (refund, a plain function, then cancel_booking,
    a coroutine); killed at each fault point of either compensation, it still ends
    compensated, and no compensation or step ran twice."""
    crash_app_async.create_ledger(database_url)
    report = crash_test(
        app=APP,
        saga="delivery",
        input=lambda run: {"key": f"r-{run}", "refuse": True},
        database_url=database_url,
        kinds=("compensation",),
        effects=lambda key: crash_app_async.executions(database_url).get(key, 0),
    )
    print(report.summary())
    assert report.baseline.status == "compensated"
    assert len(report.runs) == 2 * len(FAULT_POINTS)
    assert len(report.killed) == len(report.runs), report.summary()
    assert report.parked == {}
    assert all(r.status == "compensated" for r in report.runs), report.summary()
    for saga_id, ops in _calls_per_operation(database_url, report).items():
        assert ops == {
            ("book", "action"): 1,
            ("charge", "action"): 1,
            ("dispatch", "action"): 0,
            ("charge", "compensation"): 1,
            ("book", "compensation"): 1,
        }, saga_id
