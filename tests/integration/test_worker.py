"""Workers: wake-ups, long backoffs without a held lease, graceful stop, recovery, DB faults."""

from __future__ import annotations

import contextvars
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import crash_app
import psycopg
from support import (
    ChildApp,
    OrchestratorFactory,
    Order,
    events,
    order_saga,
    scalar,
    wait_until,
)

from saga import Orchestrator, RetryPolicy, StepContext, TransientError, Worker


@contextmanager
def running(worker: Worker, *, until_idle: bool = False) -> Iterator[threading.Thread]:
    """Run `worker` in a thread for the block; stop it and wait for it afterwards."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            worker.run(until_idle=until_idle, handle_signals=False)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        worker.stop()
        thread.join(30)
        assert not thread.is_alive(), "the worker did not stop"
    assert errors == []


def test_a_started_saga_wakes_an_idle_worker_at_once(make_orch: OrchestratorFactory) -> None:
    """A worker polling only every 30 s still picks up a new saga at once (LISTEN/NOTIFY)."""
    saga = order_saga("notified")

    @saga.step
    def only(ctx: StepContext, order: Order) -> dict[str, Any]:
        return {"ok": True}

    worker_orch = make_orch(saga)
    worker = worker_orch.worker(concurrency=2, poll_seconds=30.0)
    with running(worker):
        time.sleep(0.5)  # the worker is idle and listening
        producer = make_orch(saga)
        started = time.monotonic()
        saga_id = producer.start(saga, Order(order_id="o-1")).id
        wait_until(lambda: producer.get(saga_id).status == "completed", timeout=10)
        assert time.monotonic() - started < 5.0


def test_a_long_backoff_releases_the_lease(make_orch: OrchestratorFactory) -> None:
    """A backoff longer than the short wait is persisted as run_after; no lease is held."""
    saga = order_saga("patient")
    calls: list[int] = []

    @saga.step(retry=RetryPolicy(max_attempts=2, initial_delay=2.0, max_delay=2.0, jitter=0.0))
    def flaky(ctx: StepContext, order: Order) -> dict[str, Any]:
        calls.append(ctx.attempt)
        if ctx.attempt == 1:
            raise TransientError("try again later")
        return {"ok": True}

    orch = make_orch(saga)
    saga_id = orch.start(saga, Order(order_id="o-1")).id
    worker = orch.worker(concurrency=1, short_wait_seconds=0.5, poll_seconds=0.2)
    with running(worker):
        # `orch.get` reads the saga row and its operations in two statements, which may
        # straddle the worker's commit: wait for a state showing both sides of it.
        sleeping = wait_until(
            lambda: (
                (s := orch.get(saga_id)).operation("flaky").attempts == 1
                and s.operation("flaky").status == "pending"
                and s.lease_owner is None
                and s
            ),
            timeout=10,
        )
        assert sleeping.lease_expires_at is None
        assert sleeping.run_after is not None
        assert worker.in_flight == 0
        done = wait_until(lambda: (s := orch.get(saga_id)).status == "completed" and s, timeout=10)
    assert calls == [1, 2]
    released = [e for e in orch.history(saga_id) if e.event == "lease_released"]
    assert released[0].detail["reason"] == "backoff"
    assert done.operation("flaky").attempts == 2


def test_stop_lets_the_attempt_finish_and_hands_the_saga_back(
    make_orch: OrchestratorFactory,
) -> None:
    """On stop, the step in flight finishes and is recorded; no new step starts; the lease
    is released so another worker finishes the saga."""
    saga = order_saga("stoppable")
    entered, release = threading.Event(), threading.Event()
    calls: list[str] = []

    @saga.step
    def first(ctx: StepContext, order: Order) -> dict[str, Any]:
        calls.append("first")
        entered.set()
        release.wait(10)
        return {"first": True}

    @saga.step
    def second(ctx: StepContext, order: Order) -> dict[str, Any]:
        calls.append("second")
        return {"second": True}

    orch = make_orch(saga)
    saga_id = orch.start(saga, Order(order_id="o-1")).id
    worker = orch.worker(concurrency=1, grace_seconds=10.0)
    with running(worker) as thread:
        assert entered.wait(10)
        worker.stop()
        time.sleep(0.2)
        assert thread.is_alive()  # waiting for the attempt in flight
        release.set()
        thread.join(10)
    state = orch.get(saga_id)
    assert calls == ["first"]
    assert state.status == "running"
    assert state.operation("first").status == "succeeded"
    assert state.operation("second").status == "pending"
    assert state.lease_owner is None
    released = [e for e in orch.history(saga_id) if e.event == "lease_released"]
    assert released[-1].detail["reason"] == "shutdown"

    other = make_orch(saga)
    other.worker(concurrency=1).run(until_idle=True, handle_signals=False)
    assert other.get(saga_id).status == "completed"
    assert calls == ["first", "second"]


def test_an_attempt_outlasting_the_grace_period_is_fenced_out(
    make_orch: OrchestratorFactory,
) -> None:
    """After the grace period the lease is released; the late attempt's outcome is refused,
    and the next owner treats it as unknown."""
    saga = order_saga("slow")
    entered, release = threading.Event(), threading.Event()

    @saga.step
    def slow(ctx: StepContext, order: Order) -> dict[str, Any]:
        entered.set()
        release.wait(10)
        return {"late": True}

    orch = make_orch(saga)
    saga_id = orch.start(saga, Order(order_id="o-1")).id
    worker = orch.worker(concurrency=1, grace_seconds=0.3)
    with running(worker) as thread:
        assert entered.wait(10)
        worker.stop()
        thread.join(10)
        assert not thread.is_alive()
    assert orch.get(saga_id).lease_owner is None
    release.set()
    time.sleep(0.5)  # the late outcome reaches the database and is refused
    state = orch.get(saga_id)
    assert state.operation("slow").status == "running"
    assert state.operation("slow").result is None

    parked = make_orch(saga).run(saga_id)
    assert parked.status == "needs_review"
    assert parked.operation("slow").status == "unknown"


_marked: contextvars.ContextVar[str | None] = contextvars.ContextVar("marked", default=None)


def test_a_worker_keeps_its_threads_for_the_next_sagas(make_orch: OrchestratorFactory) -> None:
    """A `Worker` of concurrency 2 drives 12 sagas in a few threads it keeps, not one
    started per saga; each saga runs in a thread named after it and starts with fresh
    context variables, as in a new thread."""
    saga = order_saga("kept")
    threads: set[threading.Thread] = set()
    leaked: list[str | None] = []
    names: list[bool] = []

    @saga.step
    def only(ctx: StepContext, order: Order) -> dict[str, Any]:
        threads.add(threading.current_thread())
        names.append(threading.current_thread().name == f"saga-{ctx.saga_id}")
        if _marked.get() is not None:
            leaked.append(_marked.get())
        _marked.set(order.order_id)
        return {}

    orch = make_orch(saga)
    ids = [orch.start(saga, Order(order_id=f"o-{i}")).id for i in range(12)]
    orch.worker(concurrency=2).run(until_idle=True, handle_signals=False)
    assert [orch.get(saga_id).status for saga_id in ids] == ["completed"] * 12
    assert len(threads) <= 4
    assert names == [True] * 12
    assert leaked == []


def test_a_dead_workers_saga_is_recovered_when_its_lease_expires(
    make_orch: OrchestratorFactory, app_url: str, children: list[ChildApp]
) -> None:
    """A worker that polls only every 30 s takes over a SIGKILLed owner's saga as soon as
    its lease expires (it wakes at the earliest expiry)."""
    child = ChildApp(app_url, crash_app.IDEMPOTENT.name, "o-1", CRASH_APP_BLOCK="after_effect")
    children.append(child)
    saga_id = child.expect("STARTED").split()[1]
    child.expect("CHARGED")
    expires = scalar(app_url, "SELECT lease_expires_at FROM saga.sagas WHERE id = %s", (saga_id,))
    orch = make_orch(*crash_app.ALL_SAGAS)
    worker = orch.worker(concurrency=2, poll_seconds=30.0)
    with running(worker):
        time.sleep(0.3)  # the worker is waiting, with the child's lease still live
        child.signal(signal.SIGKILL)
        assert child.wait() == -signal.SIGKILL
        wait_until(lambda: orch.get(saga_id).status == "completed", timeout=10)
        finished = scalar(app_url, "SELECT now()")
    # Recovery within lease expiry plus a moment, not a 30 s poll.
    assert (finished - expires).total_seconds() < 3.0
    assert "outcome_unknown" in events(orch.history(saga_id))
    assert scalar(app_url, "SELECT count(*) FROM provider_charges") == 1


def test_connections_killed_by_the_server_are_retried(make_orch: OrchestratorFactory) -> None:
    """When the server terminates the orchestrator's connections mid-step, the outcome is
    still recorded (with bounded retries) and no step runs twice."""
    saga = order_saga("resilient")
    calls: list[str] = []
    orch: Orchestrator

    @saga.step
    def first(ctx: StepContext, order: Order) -> dict[str, Any]:
        calls.append("first")
        with psycopg.connect(orch.database_url, autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        return {"first": True}

    @saga.step
    def second(ctx: StepContext, order: Order) -> dict[str, Any]:
        calls.append("second")
        return {"second": True}

    orch = make_orch(saga)
    state = orch.execute(saga, Order(order_id="o-1"))
    assert state.status == "completed"
    assert calls == ["first", "second"]
    assert [op.attempts for op in state.operations] == [1, 1]


def test_live_workers_say_which_kinds_they_run(make_orch: OrchestratorFactory) -> None:
    """A running worker is listed with the saga kinds it runs; a stopped one is not."""
    saga = order_saga("listed", version=2)

    @saga.step
    def only(ctx: StepContext, order: Order) -> dict[str, Any]:
        return {"ok": True}

    orch = make_orch(saga)
    worker = orch.worker(concurrency=3, poll_seconds=0.2)
    with running(worker):
        live = wait_until(lambda: orch.workers(), timeout=10)
        assert [(w.owner, w.kinds, w.concurrency) for w in live] == [(orch.owner, ["listed:2"], 3)]
    assert orch.workers() == []


def _buffers_of(conn: psycopg.Connection[Any], query: str, params: tuple[Any, ...]) -> int:
    plan = conn.execute(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {query}", params).fetchone()
    assert plan is not None
    top = plan[0][0]["Plan"]
    return int(top["Shared Hit Blocks"]) + int(top["Shared Read Blocks"])


def test_a_claim_reads_the_head_of_a_long_queue_not_all_of_it(
    make_orch: OrchestratorFactory,
) -> None:
    """With 6,000 sagas queued and the table's statistics not caught up with them (as after
    a burst), a claim walks the runnable index in order and stops at the first saga it can
    take, rather than reading the whole backlog: its cost must not grow with the queue."""
    saga = order_saga("queued")

    @saga.step
    def only(ctx: StepContext, order: Order) -> dict[str, Any]:
        return {}

    orch = make_orch(saga)
    first = orch.start(saga, Order(order_id="first")).id
    with psycopg.connect(orch.database_url, autocommit=True) as conn:
        conn.execute("UPDATE saga.sagas SET run_after = now() - interval '1 day'")
        conn.execute(
            "INSERT INTO saga.sagas (id, name, version, tenant_id, key, input, input_hash,"
            " run_after)"
            " SELECT gen_random_uuid(), 'queued', 1, 't', 'k' || i, '{}', 'h',"
            "        now() - make_interval(secs => 6001 - i)"
            " FROM generate_series(1, 6000) AS i"
        )
        backlog = _buffers_of(
            conn,
            "SELECT count(*) FROM saga.sagas WHERE status = 'pending' AND name = %s",
            ("queued",),
        )
        # A first call in the session reads the catalogs; it claims nothing (no such kind).
        conn.execute("SELECT * FROM saga.claim_next(%s, 'probe', 10)", (["other:1"],))
        claim = _buffers_of(conn, "SELECT * FROM saga.claim_next(%s, 'probe', 10)", (["queued:1"],))
        claimed = scalar(orch.database_url, "SELECT id FROM saga.sagas WHERE lease_owner = 'probe'")
    assert str(claimed) == first  # the one that has waited longest
    # Reading the queue costs `backlog` pages (about 190); the claim, a few dozen at most.
    assert claim * 4 < backlog, f"a claim read {claim} buffers with {backlog} pages queued"
