# WARNING: generated from saga/_drivers/leases_async.py by tools/async_to_sync.py:
# edit the source, then run `python tools/async_to_sync.py`. CI fails on any difference.
"""Keeping leases alive while user code runs: one heartbeat worker per orchestrator, a task
of its event loop for `AsyncLeaseKeeper` (`leases_async.py`, the source), a thread for
`LeaseKeeper` (`leases.py`, generated from it by `tools/async_to_sync.py`)."""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager
from types import TracebackType

from saga._acompat import Event, Worker, spawn, stop, wait_set, worker_alive
from saga._db.store import Store
from saga._flows.drive import describe_error
from saga.logs import get_logger

_log = get_logger("saga")


class LeaseKeeper:
    """Renews, every `heartbeat_seconds`, the lease of each saga whose attempt is in flight,
    in one statement for all of them, so a long step is not taken for a dead one. A lease
    found lost is logged; the attempt's outcome write will then be refused by its fence.

    Leases are held by (saga id, fence): an attempt fenced out by a newer lease of the
    same owner on the same saga may still be running, and its end must not stop the
    heartbeat of the newer one."""

    def __init__(
        self, store: Store, *, owner: str, lease_seconds: float, heartbeat_seconds: float
    ) -> None:
        self.store = store
        self.owner = owner
        self.lease_seconds = lease_seconds
        self.heartbeat_seconds = heartbeat_seconds
        # (saga id, fence) -> how many blocks hold it (one, unless nested).
        self._held: dict[tuple[str, int], int] = {}
        # Holders are threads of the blocking twin; on a loop the lock is never contended.
        self._lock = threading.Lock()
        self._worker: Worker | None = None
        self._stopped = Event()

    def holding(self, saga_id: str, fence: int) -> AbstractContextManager[None]:
        """Keep the lease of `saga_id` at `fence` alive for the duration of the block (with
        asyncio, entered on the loop's thread). The heartbeat starts with the first hold,
        and again after `close` or once its loop has ended."""
        return _Holding(self, (saga_id, fence))

    def _hold(self, key: tuple[str, int]) -> None:
        with self._lock:
            self._held[key] = self._held.get(key, 0) + 1
            if self._worker is None or not worker_alive(self._worker):
                stopped = self._stopped = Event()
                self._worker = spawn(
                    lambda: self._beat(stopped), name=f"saga-heartbeat-{self.owner}"
                )

    def _release(self, key: tuple[str, int]) -> None:
        with self._lock:
            left = self._held.get(key, 0) - 1
            if left > 0:
                self._held[key] = left
            else:
                self._held.pop(key, None)

    def close(self) -> None:
        """Stop the heartbeat (leases then expire unless renewed by writes)."""
        with self._lock:
            worker, self._worker = self._worker, None
            self._stopped.set()
        if worker is not None:
            stop(worker)

    def _beat(self, stopped: Event) -> None:
        while not wait_set(stopped, self.heartbeat_seconds):
            with self._lock:
                held = set(self._held)
            if not held:
                continue
            try:
                alive = self.store.renew_leases(
                    held, owner=self.owner, lease_seconds=self.lease_seconds
                )
            except Exception as exc:  # outcome writes will find out; keep trying meanwhile
                _log.warning("heartbeat_failed", error=describe_error(exc))
                continue
            for saga_id, fence in held - alive:
                with self._lock:
                    if self._held.pop((saga_id, fence), None) is None:
                        continue  # released meanwhile
                _log.warning("heartbeat_lease_lost", saga_id=saga_id, fence=fence)


class _Holding:
    """The block of `holding` (every call of user code enters one): a plain object rather
    than a generator-based context manager, which costs several times as much."""

    __slots__ = ("_keeper", "_key")

    def __init__(self, keeper: LeaseKeeper, key: tuple[str, int]) -> None:
        self._keeper = keeper
        self._key = key

    def __enter__(self) -> None:
        self._keeper._hold(self._key)

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._keeper._release(self._key)
