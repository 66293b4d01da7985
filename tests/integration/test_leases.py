"""Leases held again by the same owner: heartbeats and in-flight counts are per (saga, fence)."""

from __future__ import annotations

import threading
from datetime import datetime
from typing import Any, cast

from support import OrchestratorFactory, Order, order_saga, scalar, wait_until

from saga import StepContext
from saga._core.planner import Planner, Stop
from saga._drivers.driver import Runner
from saga.state import SagaStatus


def _lease_to(url: str, saga_id: str, owner: str, fence: int) -> None:
    """Give the lease of a saga to `owner` at `fence`, for one second (as a claim would)."""
    scalar(
        url,
        "UPDATE saga.sagas SET lease_owner = %s, fence = %s,"
        " lease_expires_at = now() + interval '1 second' WHERE id = %s RETURNING id",
        (owner, fence, saga_id),
    )


def test_an_old_attempts_exit_keeps_the_newer_lease_alive(
    make_orch: OrchestratorFactory,
) -> None:
    """The same owner holds a saga again at a higher fence while its fenced-out earlier
    attempt still runs; when the earlier attempt's block exits, the newer lease is still
    renewed by the heartbeat (it used to be dropped, and expired mid-call)."""
    saga = order_saga("held_twice")

    @saga.step
    def only(ctx: StepContext, order: Order) -> dict[str, Any]:
        return {}

    orch = make_orch(saga, lease_seconds=1.0)
    url = orch.database_url
    saga_id = orch.start(saga, Order(order_id="o-1")).id
    keeper = orch.lease_keeper

    _lease_to(url, saga_id, orch.owner, 1)
    old = keeper.holding(saga_id, 1)
    old.__enter__()
    _lease_to(url, saga_id, orch.owner, 2)  # taken again, the first attempt still running
    with keeper.holding(saga_id, 2):
        old.__exit__(None, None, None)
        exited_at = scalar(url, "SELECT now()")
        # Only renewals made after the old block's exit can carry the lease this far.
        wait_until(
            lambda: scalar(
                url,
                "SELECT lease_expires_at > %s + interval '2.5 seconds' FROM saga.sagas"
                " WHERE id = %s",
                (exited_at, saga_id),
            ),
            timeout=20,
        )
        assert scalar(url, "SELECT fence FROM saga.sagas WHERE id = %s", (saga_id,)) == 2
        assert scalar(
            url, "SELECT lease_expires_at > now() FROM saga.sagas WHERE id = %s", (saga_id,)
        )


class _BlockingRunner:
    """Stands in for a runner: each drive waits for its fence's event (no database)."""

    def __init__(self) -> None:
        self.release = {1: threading.Event(), 2: threading.Event()}

    def drive(self, planner: Planner, nxt: Any) -> None:
        self.release[planner.saga.fence].wait(30)


def test_a_saga_driven_twice_counts_twice_in_flight(make_orch: OrchestratorFactory) -> None:
    """Two drives of one saga at two fences are two sagas in flight, and the end of the
    earlier one leaves the later one counted (the map was keyed by saga id alone)."""
    saga = order_saga("driven_twice")

    @saga.step
    def only(ctx: StepContext, order: Order) -> dict[str, Any]:
        return {}

    orch = make_orch(saga)
    saga_id = orch.start(saga, Order(order_id="o-1")).id
    worker = orch.worker(concurrency=2)
    runner = _BlockingRunner()

    def planner_at(fence: int) -> Planner:
        with orch.store.pipelined() as conn:
            loaded = orch.store.load_txn(conn, saga_id)
        assert loaded is not None
        loaded[0].fence = fence
        return Planner(saga, *loaded, now=datetime.now().astimezone())

    worker._spawn(cast(Runner, runner), planner_at(1), Stop(SagaStatus.RUNNING))
    worker._spawn(cast(Runner, runner), planner_at(2), Stop(SagaStatus.RUNNING))
    assert worker.in_flight == 2
    runner.release[1].set()
    wait_until(lambda: worker.in_flight == 1, timeout=10)
    assert list(worker._in_flight) == [(saga_id, 2)]
    runner.release[2].set()
    wait_until(lambda: worker.in_flight == 0, timeout=10)
