"""Named fault points at every boundary of the step protocol, for crash testing.

Disabled (the default) a fault point costs one global lookup. Armed, it calls a
handler with the point's name and context; `saga.testing` arms them to kill a
process at a chosen boundary. A child process can be armed from the environment:
`SAGA_FAULT=POINT[:KIND[:STEP]]` sends SIGKILL to itself the first time the
matching point is reached (KIND is `action` or `compensation`).

Points, in protocol order:
    before_record   a transaction that would start an attempt is about to commit
    before_call     the attempt is recorded as running; the function is not called yet
    after_call      the function returned or raised; its outcome is not recorded yet
    after_record    the outcome (and the next attempt, if any) is committed
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Mapping
from typing import Any

POINTS = ("before_record", "before_call", "after_call", "after_record")
ENV_FAULT = "SAGA_FAULT"

FaultHandler = Callable[[str, Mapping[str, Any]], None]

# The armed handler (None: disarmed). Read as `faults.armed`, a caller skips building a
# point's context when nothing listens.
armed: FaultHandler | None = None


def point(name: str, **context: Any) -> None:
    """Reach fault point `name`; does nothing unless a handler is armed."""
    if armed is not None:
        armed(name, context)


def arm(handler: FaultHandler | None) -> FaultHandler | None:
    """Install `handler` for every fault point (None disarms); returns the previous one."""
    global armed
    previous, armed = armed, handler
    return previous


def kill_at(spec: str) -> FaultHandler:
    """A handler that SIGKILLs this process at the first point matching `POINT[:KIND[:STEP]]`."""
    name, _, rest = spec.partition(":")
    kind, _, step = rest.partition(":")
    if name not in POINTS:
        raise ValueError(f"unknown fault point {name!r}; known points: {', '.join(POINTS)}")
    if kind not in ("", "action", "compensation"):
        raise ValueError(f"fault point kind must be 'action' or 'compensation', got {kind!r}")

    def handler(reached: str, context: Mapping[str, Any]) -> None:
        if reached != name:
            return
        if kind and context.get("kind") != kind:
            return
        if step and context.get("step") != step:
            return
        os.kill(os.getpid(), signal.SIGKILL)

    return handler


def arm_from_environment() -> None:
    """Arm `kill_at($SAGA_FAULT)` when that variable is set."""
    spec = os.environ.get(ENV_FAULT)
    if spec:
        arm(kill_at(spec))
