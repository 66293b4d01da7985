"""The sync Orchestrator inside a running event loop, and machinery errors around a call.

Calling it from a coroutine is refused at once, writing nothing; `asyncio.to_thread` is the
way to call it from async code. An error of the orchestrator's own machinery (an event loop
that cannot be started for an async step) is never recorded as the step's outcome: when
nothing of the step ran, the attempt is recorded as not called and the saga parks, without
compensating.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from support import (
    OrchestratorFactory,
    Order,
    actions,
    compensations,
    count_rows,
    events,
    order_saga,
)

from saga import (
    Orchestrator,
    RetryPolicy,
    Saga,
    SagaError,
    StepContext,
    SyncCallInEventLoop,
)
from saga._drivers import ownloop as saga_runner
from saga.state import SagaState

# A policy under which a RuntimeError fails the step at once: if the machinery's
# RuntimeError were taken for the step's, the saga would compensate.
FAIL_ON_RUNTIME = RetryPolicy(
    max_attempts=2, initial_delay=0.01, max_delay=0.01, fail_on=(RuntimeError,)
)


def _async_saga(name: str, calls: list[str]) -> Saga[Order]:
    """reserve (sync, compensable) then charge (async), RuntimeError failing charge."""
    saga = order_saga(name)

    @saga.step
    def reserve(ctx: StepContext, o: Order) -> dict[str, str]:
        calls.append("reserve")
        return {"sku": "x"}

    @reserve.compensation
    def release(ctx: StepContext, o: Order, result: dict[str, str] | None) -> None:
        calls.append("release")

    @saga.step(retry=FAIL_ON_RUNTIME)
    async def charge(ctx: StepContext, o: Order) -> dict[str, str]:
        await asyncio.sleep(0)
        calls.append("charge")
        return {"charge": "c-1"}

    return saga


TABLES = ("sagas", "operations", "events", "confirmations", "workers")


def _counts(url: str) -> dict[str, int]:
    return {table: count_rows(url, table) for table in TABLES}


def test_every_sync_entry_point_refuses_inside_a_running_loop(
    make_orch: OrchestratorFactory, database_url: str
) -> None:
    """Each call that talks to the database or runs steps raises SyncCallInEventLoop naming
    itself, AsyncOrchestrator and asyncio.to_thread, before anything is written."""
    calls: list[str] = []
    saga = _async_saga("in-loop", calls)
    orch = make_orch(saga)
    handle = orch.start(saga, Order(order_id="o-1"))
    before_state = orch.get(handle.id)
    before = _counts(database_url)
    fresh = make_orch(saga)  # not connected yet: the refusal comes before connecting too
    sid = handle.id
    entry_points: dict[str, Callable[[], object]] = {
        "start": lambda: orch.start(saga, Order(order_id="o-2")),
        "execute": lambda: orch.execute(saga, Order(order_id="o-3")),
        "fresh execute": lambda: fresh.execute(saga, Order(order_id="o-4")),
        "run": lambda: orch.run(sid),
        "compensate": lambda: orch.compensate(sid, actor="ops"),
        "resolve": lambda: orch.resolve(sid, "reserve", outcome="failed", actor="ops"),
        "retry": lambda: orch.retry(sid, actor="ops"),
        "cancel": lambda: orch.cancel(sid, reason="no", actor="ops"),
        "confirm": lambda: orch.confirm(sid, "charge", "0" * 64, "token"),
        "raise_ceilings": lambda: orch.raise_ceilings(sid, actor="ops", max_operations=9),
        "purge": lambda: orch.purge(),
        "get": lambda: orch.get(sid),
        "list": lambda: orch.list(),
        "history": lambda: orch.history(sid),
        "workers": lambda: orch.workers(),
        "confirmations": lambda: orch.confirmations(sid),
        "preview": lambda: orch.preview(sid),
        "ensure_pool_size": lambda: orch.ensure_pool_size(20),
        "worker.run": lambda: orch.worker(concurrency=1).run(until_idle=True),
    }
    refused: dict[str, SyncCallInEventLoop] = {}

    async def main() -> None:
        for what, call in entry_points.items():
            with pytest.raises(SyncCallInEventLoop) as caught:
                call()
            refused[what] = caught.value

    asyncio.run(main())

    assert set(refused) == set(entry_points)
    for what, exc in refused.items():
        message = str(exc)
        method = what.split()[-1]
        owner = "Worker" if method == "worker.run" else "Orchestrator"
        assert f"{owner}.{method.removeprefix('worker.')}()" in message, message
        assert "running event loop" in message
        assert "AsyncOrchestrator" in message
        assert "asyncio.to_thread" in message
        assert isinstance(exc, RuntimeError) and isinstance(exc, SagaError)
    assert calls == []
    assert _counts(database_url) == before
    after_state = orch.get(handle.id)
    assert after_state.updated_at == before_state.updated_at
    assert after_state.status == "pending"
    assert fresh._store is None  # never connected


def test_the_refusal_names_the_call_and_the_way_out() -> None:
    """The message, in full, for one method (no database needed to refuse)."""
    orch = Orchestrator("postgresql://nobody@127.0.0.1:1/none")

    async def main() -> str:
        with pytest.raises(SyncCallInEventLoop) as caught:
            orch.execute(order_saga("msg"), Order(order_id="o-1"))
        return str(caught.value)

    assert asyncio.run(main()) == (
        "Orchestrator.execute() was called from a running event loop; it blocks the loop "
        "and cannot run async steps there. Use AsyncOrchestrator, or call it in a thread: "
        "await asyncio.to_thread(orch.execute, ...)"
    )


def test_calls_that_touch_nothing_still_work_in_a_loop(make_orch: OrchestratorFactory) -> None:
    """Declaring, registering and signing approvals neither block nor run steps."""
    saga = _async_saga("pure", [])
    orch = make_orch()

    async def main() -> None:
        orch.register(saga)
        assert orch.registered() == [saga]
        assert orch.definition("pure", 1) is saga
        orch.worker(concurrency=1)  # building a worker is fine; running it is not

    asyncio.run(main())


def test_to_thread_runs_async_steps_from_async_code(make_orch: OrchestratorFactory) -> None:
    """The way out the message names: the sync call in a thread, async steps and all."""
    calls: list[str] = []
    saga = _async_saga("threaded", calls)
    orch = make_orch(saga)

    async def main() -> SagaState:
        return await asyncio.to_thread(orch.execute, saga, Order(order_id="o-1"))

    state = asyncio.run(main())
    assert state.status == "completed"
    assert calls == ["reserve", "charge"]


def _assert_not_called(orch: Orchestrator, state: SagaState, calls: list[str], step: str) -> None:
    """Parked at `step`, its attempt recorded as not called; nothing compensated."""
    assert state.status == "needs_review", state.error
    assert "not called" in (state.error or "")
    assert "AsyncOrchestrator" not in (state.error or "")
    op = state.operation(step)
    assert op.status == "pending", op
    assert "not called" in (op.error or "")
    assert compensations(state) == {}
    assert "release" not in calls and "charge" not in calls
    names = events(orch.history(state.id))
    assert "attempt_not_called" in names
    assert "attempt_failed" not in names
    assert "outcome_unknown" not in names
    assert "compensation_started" not in names


def test_a_loop_that_cannot_start_is_not_the_steps_failure(make_orch: OrchestratorFactory) -> None:
    """A runner driven from a thread with a running loop cannot start one for an async step:
    asyncio.run() raises before the step's coroutine runs. That RuntimeError is not the
    step's (whose policy fails it on RuntimeError): the saga parks, the attempt recorded as
    not called, nothing compensated, and a retry from a plain thread completes it."""
    calls: list[str] = []
    saga = _async_saga("no-loop", calls)
    orch = make_orch(saga)
    handle = orch.start(saga, Order(order_id="o-1"))

    runner = orch._runner()

    async def main() -> SagaState | None:
        # Below the public guard, as any code driving a runner on a loop's thread would.
        return runner.claim_and_drive(saga, handle.id)

    state = asyncio.run(main())
    assert state is not None
    _assert_not_called(orch, state, calls, "charge")
    assert actions(state)[0] == ("reserve", "succeeded", 1)
    assert "asyncio.run() cannot be called from a running event loop" in (state.error or "")

    orch.retry(handle.id, actor="ops")
    done = orch.run(handle.id)
    assert done.status == "completed"
    assert calls == ["reserve", "charge"]


def test_asyncio_run_failing_before_a_timed_step_is_not_its_outcome(
    make_orch: OrchestratorFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same through the timeout path: asyncio.run itself raises (a machinery fault),
    so the bounded call never started. Nothing is recorded as failed or unknown."""
    calls: list[str] = []
    saga = order_saga("timed")

    @saga.step
    def reserve(ctx: StepContext, o: Order) -> dict[str, str]:
        calls.append("reserve")
        return {"sku": "x"}

    @reserve.compensation
    def release(ctx: StepContext, o: Order, result: dict[str, str] | None) -> None:
        calls.append("release")

    @saga.step(retry=FAIL_ON_RUNTIME, timeout_seconds=5)
    async def charge(ctx: StepContext, o: Order) -> dict[str, str]:
        calls.append("charge")
        return {"charge": "c-1"}

    real_run = asyncio.run

    def broken_run(main: Any, **kwargs: Any) -> Any:
        main.close()
        raise RuntimeError("event loop policy is broken")

    orch = make_orch(saga)
    monkeypatch.setattr(saga_runner.asyncio, "run", broken_run)
    state = orch.execute(saga, Order(order_id="o-1"))
    monkeypatch.setattr(saga_runner.asyncio, "run", real_run)

    _assert_not_called(orch, state, calls, "charge")
    assert "event loop policy is broken" in (state.error or "")


def test_async_prepare_that_cannot_run_does_not_fail_the_step(
    make_orch: OrchestratorFactory,
) -> None:
    """An async prepare hook whose loop cannot start: parked, not failed (which would
    compensate under fail_on=RuntimeError)."""
    calls: list[str] = []
    saga = _async_saga("prep", calls)
    charge = saga.step_named("charge")
    assert charge is not None

    @charge.prepare
    async def quote(ctx: StepContext, o: Order) -> dict[str, int]:
        calls.append("quote")
        return {"amount": o.amount_cents}

    orch = make_orch(saga)
    handle = orch.start(saga, Order(order_id="o-1"))

    runner = orch._runner()

    async def main() -> SagaState | None:
        return runner.claim_and_drive(saga, handle.id)

    state = asyncio.run(main())
    assert state is not None
    assert "quote" not in calls
    _assert_not_called(orch, state, calls, "charge")
