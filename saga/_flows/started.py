"""The sagas an orchestrator has just started, as their start wrote them.

`start()` then `run()` in one process is the production door without a worker in
between. `run()` of a saga this orchestrator started knows what the start wrote without
reading it: it plans the first move from those rows and sends the claim and the move as
one statement (`saga.claim_started_v1`, migration 0020), which applies them only while the
saga is still exactly as started (its fence 0, its write token the start's, none of its
operations attempted). Anything
else (the saga claimed by a worker, changed by an operator, or started by another
process) is claimed the usual way.

The memo is bounded: a process that starts sagas for workers to drive keeps only the
newest `limit` of them, and a saga taken out of it is never handed out twice.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from saga._core.rows import OpRow, SagaRow

__all__ = ["DEFAULT_LIMIT", "Started", "StartedSagas"]

# Sagas kept per orchestrator: a start's rows are its input and its operations' keys and
# hashes, a few kilobytes for most sagas.
DEFAULT_LIMIT = 256


@dataclass(frozen=True, slots=True)
class Started:
    """A saga as its start wrote it, and the token that start stored."""

    row: SagaRow
    ops: list[OpRow]
    start_token: str


class StartedSagas:
    """The newest `limit` sagas started here and not yet run here, by id; thread-safe."""

    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        if limit < 0:
            raise ValueError(f"limit must not be negative, got {limit!r}")
        self._limit = limit
        self._sagas: OrderedDict[str, Started] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, started: Started) -> None:
        """Remember a saga just created by this orchestrator's start, forgetting the
        oldest beyond the limit."""
        with self._lock:
            self._sagas[started.row.id] = started
            while len(self._sagas) > self._limit:
                self._sagas.popitem(last=False)

    def take(self, saga_id: str) -> Started | None:
        """The saga's start, forgotten here: only one `run()` plans from it."""
        with self._lock:
            return self._sagas.pop(saga_id, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._sagas)
