"""AsyncOrchestrator and AsyncWorker: the same rows and events as the sync door, many sagas
in one event loop, async steps on the caller's loop, sync steps off it, timeouts that
cancel, and workers of both doors sharing one database.

pytest-asyncio is not used: each test runs its coroutine with `asyncio.run`, and every
await that could hang is bounded (`within`), so a deadlock fails the test instead of
stalling the suite.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import pytest
from async_support import (
    QUICK3,
    SHAPES,
    Calls,
    error_shape,
    event_rows,
    happy_shape,
    operation_rows,
)
from support import Order, events, order_saga

from saga import (
    AsyncOrchestrator,
    AsyncWorker,
    Found,
    HistoryEvent,
    Orchestrator,
    PermanentError,
    Saga,
    SagaHandle,
    SagaState,
    StepContext,
)

T = TypeVar("T")

# Longest any single await of these tests may take before it counts as a hang (seconds).
HANG_SECONDS = 30.0


def arun(main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run `main()` in a fresh event loop, as an application's `asyncio.run` would."""
    return asyncio.run(main())


async def within(awaitable: Awaitable[T], seconds: float = HANG_SECONDS) -> T:
    """Await `awaitable`, failing the test if it takes longer than `seconds`."""
    return await asyncio.wait_for(awaitable, seconds)


def _async_orch(url: str, *sagas: Saga[Any], **options: Any) -> AsyncOrchestrator:
    return AsyncOrchestrator(url, sagas=list(sagas), **options)


# ----- 1. one protocol, two drivers ----------------------------------------------------------


@pytest.mark.parametrize("shape", list(SHAPES))
def test_both_doors_write_the_same_operations_and_events(shape: str, database_url: str) -> None:
    """The same saga driven by Orchestrator.execute and by AsyncOrchestrator.execute (two
    keys, one database) ends in the same status with the same operations (status, attempts,
    ceilings, results, errors) and the same audit trail (event, step, kind, attempt,
    details other than owners, fences and timings); its functions are called in the same
    order, each as often."""
    factory, expected = SHAPES[shape]
    calls = Calls()
    saga = factory(calls)

    with Orchestrator(database_url, sagas=[saga]) as sync_orch:
        sync_state = sync_orch.execute(saga, Order(order_id="sync-1"))
        sync_history = sync_orch.history(sync_state.id)
        assert sync_orch.get(sync_state.id) == sync_state

    async def drive() -> tuple[SagaState, SagaState, list[HistoryEvent]]:
        async with _async_orch(database_url, saga) as orch:
            state = await within(orch.execute(saga, Order(order_id="async-1")))
            return state, await orch.get(state.id), await orch.history(state.id)

    async_state, async_read, async_history = arun(drive)

    assert sync_state.status == expected
    assert async_state.status == expected
    assert async_read == async_state
    assert async_state.lease_owner is None and async_state.lease_expires_at is None
    assert error_shape(async_state.error, "async-1") == error_shape(sync_state.error, "sync-1")
    assert operation_rows(async_state) == operation_rows(sync_state)
    assert event_rows(async_history, "async-1") == event_rows(sync_history, "sync-1")
    assert calls.sequence("async-1") == calls.sequence("sync-1")


def test_both_doors_settle_a_parked_saga_alike(database_url: str) -> None:
    """An operator's resolve(outcome="failed") then run, through either door, compensates
    the parked saga the same way: same operations, same events, same calls."""
    factory, _ = SHAPES["review"]
    calls = Calls()
    saga = factory(calls)

    with Orchestrator(database_url, sagas=[saga]) as sync_orch:
        parked = sync_orch.execute(saga, Order(order_id="sync-1"))
        assert parked.status == "needs_review"
        sync_orch.resolve(parked.id, "charge", outcome="failed", actor="ops@acme", reason="no")
        sync_state = sync_orch.run(parked.id)
        sync_history = sync_orch.history(parked.id)

    async def drive() -> tuple[SagaState, list[HistoryEvent]]:
        async with _async_orch(database_url, saga) as orch:
            parked = await within(orch.execute(saga, Order(order_id="async-1")))
            assert parked.status == "needs_review"
            await within(
                orch.resolve(parked.id, "charge", outcome="failed", actor="ops@acme", reason="no")
            )
            state = await within(orch.run(parked.id))
            return state, await orch.history(parked.id)

    async_state, async_history = arun(drive)

    assert sync_state.status == "compensated"
    assert async_state.status == "compensated"
    assert operation_rows(async_state) == operation_rows(sync_state)
    assert event_rows(async_history, "async-1") == event_rows(sync_history, "sync-1")
    assert calls.sequence("async-1") == calls.sequence("sync-1") == ["reserve", "charge", "release"]


# ----- 2 and 3. many calls in one loop -------------------------------------------------------


def test_fifty_sagas_gathered_in_one_loop_all_complete(database_url: str) -> None:
    """asyncio.gather of 50 execute() calls of different sagas: all complete, each step of
    each saga is called exactly once, and the sagas really overlap (an async step of one
    runs while another's is in flight)."""
    calls = Calls()
    saga = order_saga("gathered")
    in_flight = 0
    peak = 0

    @saga.step
    def reserve(ctx: StepContext, o: Order) -> dict[str, Any]:
        calls.hit(o, "reserve")
        return {"sku": o.order_id}

    @saga.step
    async def charge(ctx: StepContext, o: Order) -> dict[str, Any]:
        nonlocal in_flight, peak
        calls.hit(o, "charge")
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            await asyncio.sleep(0.05)
        finally:
            in_flight -= 1
        return {"charged": o.amount_cents}

    @saga.step
    async def ship(ctx: StepContext, o: Order) -> dict[str, Any]:
        calls.hit(o, "ship")
        return {"sku": ctx.results["reserve"]["sku"]}

    ids = [f"o-{n}" for n in range(50)]

    async def main() -> list[SagaState]:
        async with _async_orch(database_url, saga) as orch:
            return await within(
                asyncio.gather(*(orch.execute(saga, Order(order_id=i)) for i in ids)), 60
            )

    states = arun(main)
    assert [s.status for s in states] == ["completed"] * 50
    assert [s.key for s in states] == ids
    assert len({s.id for s in states}) == 50
    for state in states:
        assert state.operation("ship").result == {"sku": state.key}
        assert calls.of(state.key) == {"reserve": 1, "charge": 1, "ship": 1}
    assert peak > 1, "the 50 sagas ran one at a time: the async door serialises them"


def _counted_saga(name: str, calls: Calls) -> Saga[Order]:
    """charge (async) then ship (sync), each counted."""
    saga = order_saga(name)

    @saga.step(idempotent=True)
    async def charge(ctx: StepContext, o: Order) -> dict[str, Any]:
        calls.hit(o, "charge")
        await asyncio.sleep(0.02)
        return {"charged": o.amount_cents}

    @saga.step
    def ship(ctx: StepContext, o: Order) -> dict[str, Any]:
        calls.hit(o, "ship")
        time.sleep(0.02)
        return {"shipped": True}

    return saga


def test_twenty_gathered_starts_of_one_request_make_one_saga(database_url: str) -> None:
    """20 concurrent start() calls with the same input return one saga id, exactly one of
    them created it, and nothing runs; 20 concurrent run() calls of it then call each step
    once and leave it completed."""
    calls = Calls()
    saga = _counted_saga("same_start", calls)

    async def main() -> tuple[list[SagaHandle], list[SagaState], SagaState, list[str]]:
        async with _async_orch(database_url, saga) as orch:
            handles = await within(
                asyncio.gather(*(orch.start(saga, Order(order_id="o-1")) for _ in range(20)))
            )
            assert calls.of("o-1") == {}
            saga_id = handles[0].id
            runs = await within(asyncio.gather(*(orch.run(saga_id) for _ in range(20))))
            final = await orch.get(saga_id)
            listed = [s.id for s in await orch.list(saga="same_start")]
            return list(handles), list(runs), final, listed

    handles, runs, final, listed = arun(main)
    assert len({h.id for h in handles}) == 1
    assert sum(1 for h in handles if h.created) == 1
    assert {r.id for r in runs} == {final.id}
    assert final.status == "completed"
    assert listed == [final.id]
    assert [(op.step, op.attempts) for op in final.operations] == [("charge", 1), ("ship", 1)]
    assert calls.of("o-1") == {"charge": 1, "ship": 1}


def test_twenty_gathered_executes_of_one_request_run_each_effect_once(
    database_url: str,
) -> None:
    """20 concurrent execute() calls with the same input: one saga, driven by one of them
    (the others see it leased or finished), each step called once, one attempt each."""
    calls = Calls()
    saga = _counted_saga("same_execute", calls)

    async def main() -> tuple[list[SagaState], SagaState, list[HistoryEvent]]:
        async with _async_orch(database_url, saga) as orch:
            states = await within(
                asyncio.gather(*(orch.execute(saga, Order(order_id="o-1")) for _ in range(20)))
            )
            final = await orch.get(states[0].id)
            return list(states), final, await orch.history(final.id)

    states, final, history = arun(main)
    assert {s.id for s in states} == {final.id}
    assert "completed" in {s.status for s in states}
    assert final.status == "completed"
    assert calls.of("o-1") == {"charge": 1, "ship": 1}
    started = [(e.step, e.attempt) for e in history if e.event == "attempt_started"]
    assert started == [("charge", 1), ("ship", 1)]
    assert events(history).count("saga_started") == 1


# ----- 4 and 5. which loop, which thread -----------------------------------------------------


def test_async_steps_hooks_and_compensations_run_on_the_callers_loop(database_url: str) -> None:
    """An async step awaits an asyncio.Event and a Queue created by the test on its loop and
    set by another task; an async prepare hook, reconcile hook and compensations run on that
    same loop, in its thread."""
    saga = order_saga("on_my_loop")
    loops: dict[str, tuple[asyncio.AbstractEventLoop, int]] = {}
    entered: asyncio.Queue[str] | None = None
    go: asyncio.Event | None = None

    def where(what: str) -> None:
        loops[what] = (asyncio.get_running_loop(), threading.get_ident())

    @saga.step
    async def wait_for_go(ctx: StepContext, o: Order) -> dict[str, Any]:
        assert entered is not None and go is not None
        where("step")
        await entered.put(ctx.saga_id)
        await asyncio.wait_for(go.wait(), 10)
        return {"went": True}

    @wait_for_go.compensation
    async def undo_go(ctx: StepContext, o: Order, result: dict[str, Any]) -> None:
        where("compensation")
        assert result == {"went": True}

    @saga.step
    async def charge(ctx: StepContext, o: Order) -> dict[str, Any]:
        where("charge")
        raise LookupError("reply lost")  # unknown: asked of the reconcile hook

    @charge.prepare
    async def charge_request(ctx: StepContext, o: Order) -> dict[str, Any]:
        where("prepare")
        return {"amount_cents": o.amount_cents}

    @charge.reconcile
    async def find_charge(ctx: StepContext, o: Order) -> Found:
        where("reconcile")
        await asyncio.sleep(0)
        return Found({"charge_id": "ch-1"})

    @charge.compensation
    async def refund(ctx: StepContext, o: Order, result: dict[str, Any]) -> None:
        where("refund")
        assert result == {"charge_id": "ch-1"}

    @saga.step
    async def ship(ctx: StepContext, o: Order) -> dict[str, Any]:
        raise PermanentError("no carrier")

    async def main() -> tuple[SagaState, asyncio.AbstractEventLoop, str, list[str]]:
        nonlocal entered, go
        entered, go = asyncio.Queue(), asyncio.Event()
        async with _async_orch(database_url, saga) as orch:
            task = asyncio.create_task(orch.execute(saga, Order(order_id="o-1")))
            saga_id = await within(entered.get(), 10)
            go.set()
            state = await within(task)
            return state, asyncio.get_running_loop(), saga_id, events(await orch.history(saga_id))

    state, loop, saga_id, names = arun(main)
    assert state.id == saga_id
    assert state.status == "compensated", state.error
    assert "reconcile_found" in names
    main_thread = threading.get_ident()
    # function -> (ran on the test's loop, ran in the loop's thread)
    assert {
        what: (ran_on is loop, thread == main_thread) for what, (ran_on, thread) in loops.items()
    } == {
        what: (True, True)
        for what in ("step", "prepare", "charge", "reconcile", "refund", "compensation")
    }


def test_a_sleeping_sync_step_does_not_block_the_loop(database_url: str) -> None:
    """A sync step that sleeps 0.3 s runs in another thread: a ticker task on the loop keeps
    ticking every 20 ms while it sleeps."""
    saga = order_saga("sleepy")
    window: dict[str, float] = {}
    step_thread: list[int] = []

    @saga.step
    def slow(ctx: StepContext, o: Order) -> dict[str, Any]:
        step_thread.append(threading.get_ident())
        window["start"] = time.monotonic()
        time.sleep(0.3)
        window["end"] = time.monotonic()
        return {"slept": True}

    async def main() -> tuple[SagaState, list[float]]:
        ticks: list[float] = []
        stop = asyncio.Event()

        async def ticker() -> None:
            while not stop.is_set():
                ticks.append(time.monotonic())
                await asyncio.sleep(0.02)

        async with _async_orch(database_url, saga) as orch:
            tick_task = asyncio.create_task(ticker())
            try:
                state = await within(orch.execute(saga, Order(order_id="o-1")))
            finally:
                stop.set()
                await tick_task
            return state, ticks

    state, ticks = arun(main)
    assert state.status == "completed"
    assert step_thread and step_thread[0] != threading.get_ident()
    during = [t for t in ticks if window["start"] <= t <= window["end"]]
    # 0.3 s at one tick per 20 ms is ~15 ticks; a blocked loop gives none.
    assert len(during) >= 5, f"{len(during)} ticks while the sync step slept"
    gaps = [b - a for a, b in itertools.pairwise(during)]
    assert max(gaps, default=0.0) < 0.2


# ----- 6. timeouts -----------------------------------------------------------------------------


def test_a_timeout_cancels_an_async_step_and_its_outcome_is_unknown(database_url: str) -> None:
    """An async step past its timeout_seconds is cancelled (the coroutine sees
    CancelledError) soon after, not when its sleep would end; the attempt's outcome is
    unknown: an idempotent step is retried with the same key and completes, a plain one
    parks in needs_review with the operation unknown."""
    idem = order_saga("timeout_idem")
    plain = order_saga("timeout_plain")
    cancelled: list[tuple[str, int]] = []
    keys: list[str] = []

    async def slow_first(ctx: StepContext, o: Order, label: str) -> dict[str, Any]:
        keys.append(ctx.idempotency_key)
        if label == "plain" or ctx.attempt == 1:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.append((label, ctx.attempt))
                raise
        return {"charged_by": ctx.attempt}

    @idem.step(idempotent=True, timeout_seconds=0.2, retry=QUICK3)
    async def charge(ctx: StepContext, o: Order) -> dict[str, Any]:
        return await slow_first(ctx, o, "idem")

    @plain.step(timeout_seconds=0.2)
    async def send(ctx: StepContext, o: Order) -> dict[str, Any]:
        return await slow_first(ctx, o, "plain")

    async def main() -> tuple[SagaState, list[HistoryEvent], SagaState, float]:
        async with _async_orch(database_url, idem, plain) as orch:
            began = time.monotonic()
            done = await within(orch.execute(idem, Order(order_id="o-1")), 15)
            history = await orch.history(done.id)
            parked = await within(orch.execute(plain, Order(order_id="o-2")), 15)
            return done, history, parked, time.monotonic() - began

    done, history, parked, elapsed = arun(main)
    assert elapsed < 10.0
    assert cancelled == [("idem", 1), ("plain", 1)]

    assert done.status == "completed"
    op = done.operation("charge")
    assert (op.status, op.attempts, op.result) == ("succeeded", 2, {"charged_by": 2})
    assert keys[:2] == [op.idempotency_key] * 2
    names = events(history)
    assert names.count("outcome_unknown") == 1 and "unknown_retried" in names
    unknown = next(e for e in history if e.event == "outcome_unknown")
    assert unknown.step == "charge" and unknown.attempt == 1
    assert "timeout" in str(unknown.detail.get("reason", ""))

    assert parked.status == "needs_review"
    assert parked.operation("send").status == "unknown"
    assert parked.operation("send").attempts == 1


# ----- 7. the async worker -------------------------------------------------------------------


def test_an_async_worker_drains_thirty_sagas_each_effect_once(database_url: str) -> None:
    """30 sagas started with start() are driven by one AsyncWorker(concurrency=8) until
    idle: all complete, each step once per saga, never more than 8 at a time, several at
    once."""
    calls = Calls()
    saga = order_saga("drained")
    in_flight = 0
    peak = 0

    @saga.step
    async def charge(ctx: StepContext, o: Order) -> dict[str, Any]:
        nonlocal in_flight, peak
        calls.hit(o, "charge")
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            await asyncio.sleep(0.03)
        finally:
            in_flight -= 1
        return {"charged": True}

    @saga.step
    def ship(ctx: StepContext, o: Order) -> dict[str, Any]:
        calls.hit(o, "ship")
        return {"shipped": True}

    ids = [f"o-{n}" for n in range(30)]

    async def main() -> list[SagaState]:
        async with _async_orch(database_url, saga) as orch:
            handles = [await orch.start(saga, Order(order_id=i)) for i in ids]
            worker = orch.worker(concurrency=8, poll_seconds=0.2)
            assert isinstance(worker, AsyncWorker)
            await within(worker.run(until_idle=True), 60)
            return [await orch.get(h.id) for h in handles]

    states = arun(main)
    assert [s.status for s in states] == ["completed"] * 30
    for oid in ids:
        assert calls.of(oid) == {"charge": 1, "ship": 1}
    assert 1 < peak <= 8


def test_stop_from_another_task_hands_in_flight_sagas_back(database_url: str) -> None:
    """worker.stop() from another task: the attempts in flight finish and are recorded, no
    further step starts, run() returns without error, each lease is released (reason
    shutdown); a second worker later completes the sagas, each step called once."""
    calls = Calls()
    saga = order_saga("stoppable_async")
    entered = 0
    all_entered: asyncio.Event | None = None
    release: asyncio.Event | None = None

    @saga.step
    async def first(ctx: StepContext, o: Order) -> dict[str, Any]:
        nonlocal entered
        assert all_entered is not None and release is not None
        calls.hit(o, "first")
        entered += 1
        if entered == 3:
            all_entered.set()
        await asyncio.wait_for(release.wait(), 10)
        return {"first": True}

    @saga.step
    def second(ctx: StepContext, o: Order) -> dict[str, Any]:
        calls.hit(o, "second")
        return {"second": True}

    ids = ["o-1", "o-2", "o-3"]

    async def main() -> tuple[list[SagaState], list[list[HistoryEvent]], list[SagaState]]:
        nonlocal all_entered, release
        all_entered, release = asyncio.Event(), asyncio.Event()
        async with _async_orch(database_url, saga) as orch:
            handles = [await orch.start(saga, Order(order_id=i)) for i in ids]
            worker = orch.worker(concurrency=3, grace_seconds=10.0, poll_seconds=0.2)
            running = asyncio.create_task(worker.run())
            await within(all_entered.wait(), 10)

            async def stopper() -> None:
                worker.stop()

            await asyncio.create_task(stopper())
            await asyncio.sleep(0.2)
            assert not running.done(), "run() returned with attempts still in flight"
            release.set()
            await within(running, 15)  # ends gracefully: no exception
            handed_back = [await orch.get(h.id) for h in handles]
            histories = [await orch.history(h.id) for h in handles]

        async with _async_orch(database_url, saga) as other:
            await within(other.worker(concurrency=2).run(until_idle=True))
            finished = [await other.get(h.id) for h in handles]
        return handed_back, histories, finished

    handed_back, histories, finished = arun(main)
    for state, history in zip(handed_back, histories, strict=True):
        assert state.status == "running"
        assert state.operation("first").status == "succeeded"
        assert state.operation("second").status == "pending"
        assert state.lease_owner is None and state.lease_expires_at is None
        released = [e for e in history if e.event == "lease_released"]
        assert released and released[-1].detail.get("reason") == "shutdown"
    assert [s.status for s in finished] == ["completed"] * 3
    for oid in ids:
        assert calls.of(oid) == {"first": 1, "second": 1}


@pytest.mark.parametrize("stopper", ["task", "thread", "sigterm"])
def test_stop_ends_an_idle_async_worker_promptly(database_url: str, stopper: str) -> None:
    """A worker waiting for work (30 s poll) returns from run() soon after stop(), called
    from another task, from another thread, or by SIGTERM (the loop runs in the main
    thread, so run() handles it); an orchestrator built without sagas registers one with
    the plain register() and is closed with `await close()`."""
    saga = happy_shape(Calls(), "idle_async")
    unhandled: list[int] = []

    async def main() -> float:
        orch = AsyncOrchestrator(database_url)
        try:
            assert not inspect.iscoroutinefunction(orch.register)  # a plain method
            orch.register(saga)
            worker = orch.worker(concurrency=2, poll_seconds=30.0)
            running = asyncio.create_task(worker.run(until_idle=False))
            await asyncio.sleep(0.3)
            assert not running.done()
            began = time.monotonic()
            if stopper == "task":
                await asyncio.create_task(_call(worker.stop))
            elif stopper == "thread":
                await asyncio.to_thread(worker.stop)
            else:
                signal.raise_signal(signal.SIGTERM)
            await within(running, 10)
            return time.monotonic() - began
        finally:
            await orch.close()

    # Should run() not handle SIGTERM, this handler records it instead of ending pytest.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: unhandled.append(signum))
    try:
        assert arun(main) < 5.0
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert unhandled == []


async def _call(fn: Callable[[], None]) -> None:
    fn()


def test_an_attempt_outlasting_the_grace_period_is_cancelled_and_unknown(
    database_url: str,
) -> None:
    """After the grace period an async step still in flight is cancelled (it sees
    CancelledError), run() returns and the lease is released; the attempt is never
    recorded as failed: the next owner finds its outcome unknown and parks the saga."""
    saga = order_saga("graceless")
    cancelled: list[int] = []
    entered: asyncio.Event | None = None

    @saga.step
    async def slow(ctx: StepContext, o: Order) -> dict[str, Any]:
        assert entered is not None
        entered.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(ctx.attempt)
            raise
        return {"late": True}

    @slow.compensation
    def undo(ctx: StepContext, o: Order, result: dict[str, Any] | None) -> None:
        raise AssertionError("an unknown outcome is never compensated on its own")

    async def main() -> tuple[SagaState, SagaState, float]:
        nonlocal entered
        entered = asyncio.Event()
        async with _async_orch(database_url, saga) as orch:
            saga_id = (await orch.start(saga, Order(order_id="o-1"))).id
            worker = orch.worker(concurrency=1, grace_seconds=0.3)
            running = asyncio.create_task(worker.run())
            await within(entered.wait(), 10)
            began = time.monotonic()
            worker.stop()
            await within(running, 10)
            took = time.monotonic() - began
            handed_back = await orch.get(saga_id)
        async with _async_orch(database_url, saga) as other:
            return handed_back, await within(other.run(saga_id)), took

    handed_back, parked, took = arun(main)
    assert took < 5.0
    assert cancelled == [1]
    assert handed_back.lease_owner is None
    assert handed_back.operation("slow").status in ("running", "unknown")
    assert handed_back.operation("slow").result is None
    assert parked.status == "needs_review"
    assert parked.operation("slow").status == "unknown"
    assert parked.operation("slow").attempts == 1


def test_a_cancelled_caller_leaves_the_attempt_unknown_not_failed(database_url: str) -> None:
    """Cancelling the task that awaits execute() (a client gone, a request timeout) cancels
    the async step in flight; the attempt is not recorded as failed and nothing is
    compensated: the next run finds its outcome unknown and parks the saga (not
    idempotent, no reconcile hook)."""
    saga = order_saga("abandoned_caller")
    calls = Calls()
    cancelled: list[int] = []
    entered: asyncio.Event | None = None

    @saga.step
    def reserve(ctx: StepContext, o: Order) -> dict[str, Any]:
        calls.hit(o, "reserve")
        return {"sku": "x"}

    @reserve.compensation
    def release(ctx: StepContext, o: Order, result: dict[str, Any] | None) -> None:
        calls.hit(o, "release")

    @saga.step
    async def charge(ctx: StepContext, o: Order) -> dict[str, Any]:
        assert entered is not None
        calls.hit(o, "charge")
        entered.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(ctx.attempt)
            raise
        return {"charged": True}

    async def main() -> tuple[SagaState, SagaState]:
        nonlocal entered
        entered = asyncio.Event()
        # A short lease: should cancelling not release it, it ends 1 s later.
        async with _async_orch(database_url, saga, lease_seconds=1.0) as orch:
            caller = asyncio.create_task(orch.execute(saga, Order(order_id="o-1")))
            await within(entered.wait(), 10)
            caller.cancel()
            with pytest.raises(asyncio.CancelledError):
                await within(caller, 10)
            [left] = await orch.list(saga="abandoned_caller")
            again = await within(orch.run(left.id, wait_seconds=5.0))
            return left, again

    left, again = arun(main)
    assert cancelled == [1]
    assert left.operation("charge").status in ("running", "unknown")
    assert left.status == "running"
    assert again.status == "needs_review", again.error
    assert again.operation("charge").status == "unknown"
    assert again.operation("reserve").status == "succeeded"
    assert calls.of("o-1") == {"reserve": 1, "charge": 1}


# ----- 8. both doors on one database ---------------------------------------------------------


def test_sync_and_async_doors_drive_each_others_sagas(database_url: str) -> None:
    """Sagas started by a sync Orchestrator are completed by an AsyncWorker; sagas started by
    an AsyncOrchestrator are completed by a sync Worker; a sync worker (in a thread) and an
    async worker draining one queue together run each step once per saga."""
    calls = Calls()
    saga = _counted_saga("shared", calls)

    with Orchestrator(database_url, sagas=[saga]) as sync_orch:
        from_sync = [sync_orch.start(saga, Order(order_id=f"s-{n}")).id for n in range(8)]

        async def async_side() -> tuple[list[SagaState], list[str]]:
            async with _async_orch(database_url, saga) as orch:
                await within(orch.worker(concurrency=4).run(until_idle=True))
                driven = [await orch.get(i) for i in from_sync]
                started = [(await orch.start(saga, Order(order_id=f"a-{n}"))).id for n in range(8)]
                return driven, started

        driven_by_async, from_async = arun(async_side)
        assert [s.status for s in driven_by_async] == ["completed"] * 8
        assert all(sync_orch.get(i).status == "pending" for i in from_async)

        sync_orch.worker(concurrency=4).run(until_idle=True, handle_signals=False)
        assert all(sync_orch.get(i).status == "completed" for i in from_async)

        together = [sync_orch.start(saga, Order(order_id=f"t-{n}")).id for n in range(20)]
        sync_worker = sync_orch.worker(concurrency=3)

        async def both() -> None:
            async with _async_orch(database_url, saga) as orch:
                await within(
                    asyncio.gather(
                        asyncio.to_thread(sync_worker.run, until_idle=True, handle_signals=False),
                        orch.worker(concurrency=3).run(until_idle=True),
                    ),
                    60,
                )

        arun(both)
        assert all(sync_orch.get(i).status == "completed" for i in together)

    for prefix, count in (("s", 8), ("a", 8), ("t", 20)):
        for n in range(count):
            assert calls.of(f"{prefix}-{n}") == {"charge": 1, "ship": 1}


def test_an_orchestrator_used_from_a_second_loop_says_so(database_url: str) -> None:
    """An AsyncOrchestrator's connections belong to the loop that connected it: a second
    loop gets a clear error instead of a pool that hangs or fails deep inside psycopg;
    once closed on its own loop, it serves a new one."""
    calls = Calls()
    saga = order_saga("one_loop")

    @saga.step
    async def only(ctx: StepContext, order: Order) -> dict[str, Any]:
        calls.hit(order, "only")
        return {}

    orch = AsyncOrchestrator(database_url, sagas=[saga])

    async def first() -> str:
        return (await orch.start(saga, Order(order_id="o-1"))).id

    async def second(saga_id: str) -> None:
        with pytest.raises(RuntimeError, match="connected on another event loop"):
            await orch.get(saga_id)

    async def third(saga_id: str) -> str:
        try:
            return (await orch.run(saga_id)).status
        finally:
            await orch.close()

    async def main() -> str:
        saga_id = await first()
        await asyncio.to_thread(asyncio.run, second(saga_id))
        await orch.close()
        return saga_id

    saga_id = asyncio.run(main())
    assert asyncio.run(third(saga_id)) == "completed"
    assert calls.of("o-1") == {"only": 1}
