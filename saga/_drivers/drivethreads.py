"""The threads a `Worker` (the sync door) drives its sagas in, kept for the next saga.

A thread started per claimed saga (its creation, its start handshake, its end) cost a
worker process driving short sagas a sixth to a third of its CPU per saga
(docs/benchmarks.md, "The sync worker"). Here a thread whose saga has ended waits for the
next one instead: a saga claimed while a thread is idle is handed to it, otherwise a new
thread is started. Each saga runs in a fresh context (`contextvars`), as it would in a new
thread, under a thread named after it.

No saga waits for another: a thread is started whenever none is idle, so a worker of
concurrency C holds at most 2 C threads (a thread that has ended its saga but not yet
marked itself idle is not counted as idle). The threads are daemon threads, as before: a
step still running after the grace period must not keep the process alive.
"""

from __future__ import annotations

import contextvars
import queue
import threading
from collections.abc import Callable

# Handed to an idle thread: end.
_END = None


class DriverThreads:
    """Runs each job given to `run` in a thread that runs nothing else meanwhile: an idle
    one, or a new one when none is idle."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], None], str] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._threads = 0

    def run(self, job: Callable[[], None], *, name: str) -> None:
        """Run `job()` (which must not raise) in an idle thread, or a new one, named
        `name` while it runs. `RuntimeError` when no thread could be started."""
        with self._lock:
            spare = self._idle > 0
            if spare:
                self._idle -= 1
            else:
                self._threads += 1
        if not spare:
            try:
                threading.Thread(target=self._serve, name=name, daemon=True).start()
            except BaseException:
                with self._lock:
                    self._threads -= 1
                raise
        self._jobs.put((job, name))

    def close(self) -> None:
        """Let every thread end once it is idle (a thread still driving a saga ends after
        it)."""
        with self._lock:
            threads, self._threads, self._idle = self._threads, 0, 0
        for _ in range(threads):
            self._jobs.put(_END)

    def _serve(self) -> None:
        me = threading.current_thread()
        while True:
            got = self._jobs.get()
            if got is _END:
                return
            job, name = got
            me.name = name
            contextvars.Context().run(job)
            me.name = "saga-idle"
            with self._lock:
                self._idle += 1
