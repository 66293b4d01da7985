"""The registry is per orchestrator: run() and workers drive only registered sagas."""

from __future__ import annotations

import threading

import pytest
from support import FAST, OrchestratorFactory, Order, order_saga

from saga import NotRegistered, Orchestrator, Saga, StepContext, TransientError

# A worker that has not gone idle by then is stuck: seconds.
WORKER_DEADLINE_SECONDS = 60.0


def _counting(
    name: str, calls: list[str], lock: threading.Lock, *, version: int = 1
) -> Saga[Order]:
    saga = order_saga(name, version=version)

    @saga.step
    def reserve(ctx: StepContext, o: Order) -> dict:
        with lock:
            calls.append(f"{name}:{o.order_id}:reserve")
        return {"sku": o.order_id}

    @saga.step(retry=FAST)
    def charge(ctx: StepContext, o: Order) -> dict:
        with lock:
            calls.append(f"{name}:{o.order_id}:charge:{ctx.attempt}")
        if o.amount_cents == 13 and ctx.attempt == 1:
            raise TransientError("try again")
        return {"charged": o.amount_cents}

    return saga


def _run_worker(orch: Orchestrator, concurrency: int) -> None:
    """Run a worker until idle in a thread, failing (and stopping it) past the deadline."""
    worker = orch.worker(concurrency=concurrency)
    errors: list[BaseException] = []

    def target() -> None:
        try:
            worker.run(until_idle=True)
        except BaseException as exc:  # re-raised in the test thread
            errors.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout=WORKER_DEADLINE_SECONDS)
    if thread.is_alive():
        worker.stop()
        thread.join(timeout=10)
        pytest.fail(f"worker.run(until_idle=True) did not return within {WORKER_DEADLINE_SECONDS}s")
    if errors:
        raise errors[0]


def test_run_without_the_saga_registered_raises(make_orch: OrchestratorFactory) -> None:
    """run() by an orchestrator that lacks the saga's (name, version) raises NotRegistered."""
    calls: list[str] = []
    lock = threading.Lock()
    v1 = _counting("billing", calls, lock)
    v2 = _counting("billing", calls, lock, version=2)
    saga_id = make_orch(v1).start(v1, Order(order_id="o-1")).id

    for other in (make_orch(), make_orch(v2)):
        with pytest.raises(NotRegistered) as excinfo:
            other.run(saga_id)
        message = str(excinfo.value)
        assert "billing" in message
        assert "1" in message
        assert (excinfo.value.name, excinfo.value.version) == ("billing", 1)

    assert calls == []
    assert make_orch().get(saga_id).status == "pending"


def test_worker_drives_started_sagas_to_completion(make_orch: OrchestratorFactory) -> None:
    """A worker with two threads completes every started saga, each step once (retries aside)."""
    calls: list[str] = []
    lock = threading.Lock()
    saga = _counting("fleet", calls, lock)
    orch = make_orch(saga, lease_seconds=5.0)
    ids = [
        orch.start(saga, Order(order_id=f"o-{n}", amount_cents=13 if n == 2 else 100)).id
        for n in range(6)
    ]

    _run_worker(orch, concurrency=2)

    states = [orch.get(saga_id) for saga_id in ids]
    assert [s.status for s in states] == ["completed"] * 6
    for n in range(6):
        assert calls.count(f"fleet:o-{n}:reserve") == 1
        assert calls.count(f"fleet:o-{n}:charge:1") == 1
    assert calls.count("fleet:o-2:charge:2") == 1
    assert states[2].operation("charge").attempts == 2
    assert len(calls) == 13


def test_worker_leaves_unregistered_sagas_alone(make_orch: OrchestratorFactory) -> None:
    """A worker drives only the sagas registered with its orchestrator; others stay pending."""
    calls: list[str] = []
    lock = threading.Lock()
    mine = _counting("mine", calls, lock)
    theirs = _counting("theirs", calls, lock)
    starter = make_orch(mine, theirs)
    mine_ids = [starter.start(mine, Order(order_id=f"m-{n}")).id for n in range(3)]
    their_ids = [starter.start(theirs, Order(order_id=f"t-{n}")).id for n in range(2)]

    _run_worker(make_orch(mine, lease_seconds=5.0), concurrency=2)

    assert [starter.get(i).status for i in mine_ids] == ["completed"] * 3
    assert [starter.get(i).status for i in their_ids] == ["pending"] * 2
    assert not any(c.startswith("theirs:") for c in calls)
