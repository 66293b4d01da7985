"""Attempts abandoned at their timeout whose threads still run in this process.

A sync step cannot be stopped: past `timeout_seconds` its thread runs on, and may still
take effect. While it provably runs here, its operation is not settled (no reconcile, no
new attempt): a truthful reconcile hook would answer Absent, a new attempt would take
effect, and then so would the abandoned one. The runner waits for such a thread for a
bounded time (`wait_bound`), then parks the saga naming it.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

# Waiting for an abandoned attempt lasts at least this long (seconds), the default lease:
# no longer than another worker would wait for a dead owner, and long enough that a step
# that ran a little late is settled without a human.
MIN_WAIT_SECONDS = 10.0
# ...and at least this many times the step's timeout.
WAIT_TIMEOUTS = 3.0


@dataclass(frozen=True, slots=True, eq=False)
class Abandoned:
    """One attempt given up at its timeout, its thread still running."""

    saga_id: str
    step: str
    kind: str
    attempt: int
    timeout_seconds: float
    thread: threading.Thread = field(repr=False)

    def describe(self) -> str:
        """The attempt, as named in a parked saga's reason."""
        what = "compensation of step" if self.kind == "compensation" else "step"
        return (
            f"attempt {self.attempt} of {what} {self.step!r}, abandoned at its timeout of "
            f"{self.timeout_seconds:g}s, is still running in process {os.getpid()} "
            f"(thread {self.thread.name})"
        )


_lock = threading.Lock()
# By operation. Read without the lock only to learn that nothing is abandoned at all (the
# common case), so a call need not look its operation up.
running: dict[tuple[str, str, str], list[Abandoned]] = {}


def wait_bound(timeout_seconds: float) -> float:
    """How long (seconds) to wait for an abandoned attempt before parking its saga."""
    return max(WAIT_TIMEOUTS * timeout_seconds, MIN_WAIT_SECONDS)


def add(entry: Abandoned) -> None:
    """Track an abandoned attempt until its thread ends (the thread calls `discard`)."""
    with _lock:
        running.setdefault((entry.saga_id, entry.step, entry.kind), []).append(entry)


def discard(entry: Abandoned) -> None:
    """Forget an attempt whose thread has ended."""
    key = (entry.saga_id, entry.step, entry.kind)
    with _lock:
        entries = [e for e in running.get(key, []) if e is not entry]
        if entries:
            running[key] = entries
        else:
            running.pop(key, None)


def still_running(saga_id: str, step: str, kind: str) -> list[Abandoned]:
    """The abandoned attempts of this operation whose threads are alive."""
    with _lock:
        entries = list(running.get((saga_id, step, kind), []))
    return [e for e in entries if e.thread.is_alive()]


def wait_for(saga_id: str, step: str, kind: str) -> list[Abandoned]:
    """Wait for the operation's abandoned attempts, each up to its `wait_bound`, from now;
    returns those still running after it (empty: the operation may be settled)."""
    entries = still_running(saga_id, step, kind)
    if not entries:
        return []
    deadline = time.monotonic() + max(wait_bound(e.timeout_seconds) for e in entries)
    for entry in entries:
        entry.thread.join(max(0.0, deadline - time.monotonic()))
    return [e for e in entries if e.thread.is_alive()]
