"""Keeping leases alive while user code runs: one heartbeat thread per orchestrator."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from saga._db.store import Store
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
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    @contextmanager
    def holding(self, saga_id: str, fence: int) -> Iterator[None]:
        """Keep the lease of `saga_id` at `fence` alive for the duration of the block."""
        key = (saga_id, fence)
        with self._lock:
            self._held[key] = self._held.get(key, 0) + 1
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._beat, name=f"saga-heartbeat-{self.owner}", daemon=True
                )
                self._thread.start()
        try:
            yield
        finally:
            with self._lock:
                left = self._held.get(key, 0) - 1
                if left > 0:
                    self._held[key] = left
                else:
                    self._held.pop(key, None)

    def close(self) -> None:
        """Stop the heartbeat thread (leases then expire unless renewed by writes)."""
        self._stopped.set()
        thread = self._thread
        if thread is not None:
            thread.join()

    def _beat(self) -> None:
        while not self._stopped.wait(self.heartbeat_seconds):
            with self._lock:
                held = set(self._held)
            if not held:
                continue
            try:
                alive = self.store.renew_leases(
                    held, owner=self.owner, lease_seconds=self.lease_seconds
                )
            except Exception as exc:  # outcome writes will find out; keep trying meanwhile
                _log.warning("heartbeat_failed", error=f"{type(exc).__name__}: {exc}")
                continue
            for saga_id, fence in held - alive:
                with self._lock:
                    if self._held.pop((saga_id, fence), None) is None:
                        continue  # released meanwhile
                _log.warning("heartbeat_lease_lost", saga_id=saga_id, fence=fence)
