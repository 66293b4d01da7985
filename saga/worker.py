"""A worker: claims runnable sagas of its orchestrator's registered kinds and drives them."""

from __future__ import annotations

import threading
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING

import structlog

from saga.runner import Runner

if TYPE_CHECKING:
    from saga.orchestrator import Orchestrator

_log: structlog.typing.FilteringBoundLogger = structlog.get_logger("saga.worker")


class Worker:
    """Drives up to `concurrency` sagas at once until stopped (or idle).

    A worker only claims sagas whose (name, version) its orchestrator has
    registered; others wait for a worker that knows them. It polls for runnable
    sagas every `poll_seconds` when it has nothing to do.
    """

    def __init__(
        self, orchestrator: Orchestrator, *, concurrency: int, poll_seconds: float
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        if not poll_seconds > 0:
            raise ValueError(f"poll_seconds must be positive, got {poll_seconds}")
        self.orchestrator = orchestrator
        self.concurrency = concurrency
        self.poll_seconds = poll_seconds
        self._stop = threading.Event()

    def stop(self) -> None:
        """Stop claiming; `run` returns once in-flight sagas have stopped."""
        self._stop.set()

    def run(self, until_idle: bool = False) -> None:
        """Claim and drive sagas until `stop()`, or, with `until_idle`, until none is open.

        Open means pending, running or compensating: with `until_idle=True` the
        worker waits out retry backoffs and expired leases before returning.
        """
        orch = self.orchestrator
        kinds = [f"{s.name}:{s.version}" for s in orch.registered()]
        if not kinds:
            raise ValueError("the orchestrator has no registered saga; register one first")
        # Each saga in flight may hold two connections (its transaction and its heartbeat).
        orch.ensure_pool_size(2 * self.concurrency + 2)
        runner = Runner(orch.store, owner=orch.owner, lease_seconds=orch.lease_seconds)
        in_flight: set[Future[None]] = set()
        _log.info("worker_started", owner=orch.owner, concurrency=self.concurrency, kinds=kinds)
        with ThreadPoolExecutor(self.concurrency, thread_name_prefix="saga-worker") as pool:
            while not self._stop.is_set():
                claimed = False
                if len(in_flight) < self.concurrency:
                    claimed = self._claim_one(runner, kinds, pool, in_flight)
                if claimed:
                    continue
                if in_flight:
                    done, in_flight = _wait_some(in_flight, self.poll_seconds)
                    for future in done:
                        future.result()
                    continue
                if until_idle and orch.store.count_open(kinds) == 0:
                    break
                self._stop.wait(self.poll_seconds)
            for future in in_flight:
                future.result()
        _log.info("worker_stopped", owner=orch.owner)

    def _claim_one(
        self,
        runner: Runner,
        kinds: list[str],
        pool: ThreadPoolExecutor,
        in_flight: set[Future[None]],
    ) -> bool:
        claimed = runner.claim_next(kinds, self.orchestrator.definition)
        if claimed is None:
            return False
        planner, nxt = claimed

        def drive() -> None:
            try:
                runner.drive(planner, nxt)
            except Exception:
                _log.exception("saga_drive_failed", saga_id=planner.saga.id)

        in_flight.add(pool.submit(drive))
        return True


def _wait_some(
    futures: set[Future[None]], timeout: float
) -> tuple[set[Future[None]], set[Future[None]]]:
    done, pending = wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)
    return set(done), set(pending)
