"""`start()` then `run()` in one orchestrator: the claim and the first attempt are one
statement, planned from the rows the start wrote, and applied only while the saga is
still exactly as started."""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import crash_app
import psycopg
from faults.proxy import LostReplyProxy
from support import (
    ChildApp,
    OrchestratorFactory,
    Order,
    events,
    lease_expired,
    record_step_call,
    wait_until,
)

from saga import AsyncOrchestrator, Ceilings, Orchestrator, Saga, StepContext


def _two_steps(url: str, name: str, ceilings: Ceilings | None = None) -> Saga[Order]:
    saga: Saga[Order] = Saga(
        name, version=1, input=Order, key=lambda o: o.order_id, ceilings=ceilings
    )

    def record(ctx: StepContext) -> None:
        record_step_call(url, ctx)

    @saga.step
    def reserve(ctx: StepContext, order: Order) -> dict[str, Any]:
        record(ctx)
        return {"reserved": order.order_id}

    @saga.step
    def charge(ctx: StepContext, order: Order) -> dict[str, Any]:
        record(ctx)
        return {"charged": order.amount_cents}

    return saga


def test_run_claims_the_saga_it_started_without_reading_it(
    database_url: str, calls: list[tuple[str, int]]
) -> None:
    """Between the start and the first step call, run() sends one statement: the claim
    with the first attempt. Nothing of the saga is read."""
    saga = _two_steps(database_url, "lean_run")
    with LostReplyProxy(database_url) as proxy, Orchestrator(proxy.url, sagas=[saga]) as orch:
        handle = orch.start(saga, Order(order_id="o-1"))
        sent = len(proxy.statements())
        state = orch.run(handle.id)
        ran = proxy.statements()[sent:]
        names = events(orch.history(handle.id))
    assert state.status == "completed", state.error
    assert list(calls) == [("reserve", 1), ("charge", 1)]
    # The claim, then the two outcomes (the first with the next attempt).
    writes = [s for s in ran if s.startswith("SELECT saga.")]
    assert writes[0].startswith("SELECT saga.claim_started_v1("), ran
    assert len(writes) == 3, ran
    assert not [s for s in ran if "saga.operations" in s or "claim_saga" in s], ran
    assert names[:3] == ["saga_started", "lease_acquired", "attempt_started"]


def test_a_saga_another_orchestrator_changed_since_its_start_is_claimed_as_it_now_is(
    database_url: str, calls: list[tuple[str, int]]
) -> None:
    """An operator raises the ceiling between start() and run(): the first move planned
    from the start's rows would write the old ceiling back, so it is not applied; the
    saga is claimed as it now stands, and runs to the end under the raised ceiling."""
    saga = _two_steps(database_url, "changed_before_run", Ceilings(max_operations=1))
    with Orchestrator(database_url, sagas=[saga]) as orch:
        handle = orch.start(saga, Order(order_id="o-1"))
        with Orchestrator(database_url, sagas=[saga]) as operator:
            operator.raise_ceilings(handle.id, actor="ops", max_operations=5)
        state = orch.run(handle.id)
        assert state.status == "completed", state.error
        assert state.max_operations == 5
        assert list(calls) == [("reserve", 1), ("charge", 1)]
        assert events(orch.history(handle.id)).count("lease_acquired") == 1


def test_a_saga_cancelled_since_its_start_runs_nothing(
    database_url: str, calls: list[tuple[str, int]]
) -> None:
    saga = _two_steps(database_url, "cancelled_before_run")
    with Orchestrator(database_url, sagas=[saga]) as orch:
        handle = orch.start(saga, Order(order_id="o-1"))
        with Orchestrator(database_url, sagas=[saga]) as operator:
            operator.cancel(handle.id, reason="customer withdrew", actor="ops")
        state = orch.run(handle.id)
        assert state.status == "compensated", state.error
        assert list(calls) == []
        assert all(op.attempts == 0 for op in state.operations)


def test_a_saga_a_worker_drove_since_its_start_is_not_run_again(
    database_url: str, calls: list[tuple[str, int]]
) -> None:
    saga = _two_steps(database_url, "driven_before_run")
    with Orchestrator(database_url, sagas=[saga]) as orch:
        handle = orch.start(saga, Order(order_id="o-1"))
        with Orchestrator(database_url, sagas=[saga]) as other:
            other.worker(concurrency=2, poll_seconds=0.1).run(until_idle=True)
        assert list(calls) == [("reserve", 1), ("charge", 1)]
        state = orch.run(handle.id)
        assert state.status == "completed", state.error
        assert list(calls) == [("reserve", 1), ("charge", 1)]
        assert events(orch.history(handle.id)).count("lease_acquired") == 1


def test_run_of_a_saga_started_long_before_is_claimed_the_usual_way(
    database_url: str, calls: list[tuple[str, int]]
) -> None:
    """The orchestrator remembers only its newest starts: a saga started before a few
    hundred others is read and claimed like any other, and runs once."""
    saga = _two_steps(database_url, "remembered")
    with Orchestrator(database_url, sagas=[saga]) as orch:
        handles = [orch.start(saga, Order(order_id=f"o-{i}")) for i in range(300)]
        oldest, newest = handles[0], handles[-1]
        assert orch.run(oldest.id).status == "completed"
        assert orch.run(newest.id).status == "completed"
        # Run again: terminal sagas are returned as they are.
        assert orch.run(newest.id).status == "completed"
    assert sorted(calls) == [("charge", 1)] * 2 + [("reserve", 1)] * 2


def test_the_asyncio_door_claims_its_started_saga_in_one_statement(
    database_url: str, calls: list[tuple[str, int]]
) -> None:
    saga = _two_steps(database_url, "lean_async_run")

    async def main(url: str) -> tuple[str, str]:
        async with AsyncOrchestrator(url, sagas=[saga]) as orch:
            handle = await orch.start(saga, Order(order_id="o-1"))
            state = await orch.run(handle.id)
            return state.status, handle.id

    with LostReplyProxy(database_url) as proxy:
        status, _ = asyncio.run(main(proxy.url))
        ran = proxy.statements()
    assert status == "completed"
    assert list(calls) == [("reserve", 1), ("charge", 1)]
    assert any(s.startswith("SELECT saga.claim_started_v1(") for s in ran)
    assert not [s for s in ran if "claim_saga" in s], ran


# ----- crashes around the one-statement claim ----------------------------------------------


def _calls_of(url: str, step: str) -> list[tuple[int, int]]:
    """(attempt, pid) of every call of `step` in the crash app, in call order."""
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT attempt, pid FROM step_calls WHERE step = %s ORDER BY id", (step,)
        ).fetchall()
    return [(int(a), int(p)) for a, p in rows]


def _killed_at(url: str, children: list[ChildApp], fault: str) -> str:
    """Start a saga in a child that runs it at once, SIGKILLed at the fault point."""
    child = ChildApp(url, crash_app.IDEMPOTENT.name, "o-1", SAGA_FAULT=fault)
    children.append(child)
    saga_id = child.expect("STARTED").split()[1]
    assert child.wait() == -signal.SIGKILL, child.output
    return saga_id


def test_killed_before_the_claim_the_saga_is_as_started(
    make_orch: OrchestratorFactory, app_url: str, children: list[ChildApp]
) -> None:
    """The child dies with its claim and first attempt planned, unsent: nothing of them is
    written, and the next run() takes the saga at once, as started."""
    saga_id = _killed_at(app_url, children, "before_record:action:reserve")
    orch = make_orch(*crash_app.ALL_SAGAS)
    before = orch.get(saga_id)
    assert before.status == "pending"
    assert before.lease_owner is None
    assert all(op.attempts == 0 for op in before.operations)
    state = orch.run(saga_id)
    assert state.status == "completed", state.error
    assert [a for a, _ in _calls_of(app_url, "reserve")] == [1]


def test_killed_after_the_claim_the_first_attempt_is_never_taken_for_not_called(
    make_orch: OrchestratorFactory, app_url: str, children: list[ChildApp]
) -> None:
    """The child dies right after the claim and the first attempt committed, before the
    step is called. The attempt may have happened for all the next owner knows: once the
    lease has expired it is settled as an unknown outcome (this step, neither idempotent
    nor reconcilable, parks for a human), never called again as if new."""
    saga_id = _killed_at(app_url, children, "before_call:action:reserve")
    orch = make_orch(*crash_app.ALL_SAGAS)
    before = orch.get(saga_id)
    assert before.status == "running"
    assert before.operation("reserve").status == "running"
    assert before.operation("reserve").attempts == 1
    wait_until(lambda: lease_expired(app_url, saga_id), timeout=15)
    state = orch.run(saga_id)
    assert state.status == "needs_review", state.error
    assert state.operation("reserve").status == "unknown"
    assert _calls_of(app_url, "reserve") == []
    assert "outcome_unknown" in events(orch.history(saga_id))
