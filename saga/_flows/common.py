"""What the flow modules share: the retry of a flow after a transient database error,
how an error is described and its traceback kept, and the time of an input to the core."""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable
from datetime import datetime, tzinfo
from typing import TypeVar

import tenacity

from saga._core.inputs import StepExited
from saga._flows.effects import Flow, Pause, Stopping
from saga.errors import DatabaseInterrupted
from saga.logs import log_retry
from saga.retry import DATABASE_RETRY_SECONDS

T = TypeVar("T")


def retried(what: str, body: Callable[[], Flow[T]], *, interruptible: bool = False) -> Flow[T]:
    """Run the flow `body()` again after a transient database error (`DatabaseInterrupted`,
    as the drivers raise every one into a flow), with tenacity's backoff, for at most
    `DATABASE_RETRY_SECONDS` (and, when `interruptible`, only while
    the driver is not stopping); the last error is raised.

    The first try runs without tenacity's machinery, which costs more than many a flow
    it wraps: the policy is made only when that try is interrupted, and counts its time
    from the start of that try, as it would have."""
    started = time.monotonic()
    try:
        return (yield from body())
    except DatabaseInterrupted:
        first = sys.exc_info()
    policy = tenacity.Retrying(
        retry=tenacity.retry_if_exception_type(DatabaseInterrupted),
        wait=tenacity.wait_exponential(multiplier=0.05, max=2.0) + tenacity.wait_random(0, 0.05),
        stop=tenacity.stop_after_delay(DATABASE_RETRY_SECONDS),
        reraise=True,
    )
    policy.begin()
    state = tenacity.RetryCallState(policy, fn=None, args=(), kwargs={})
    state.start_time = started
    action = policy.iter(state)
    assert isinstance(action, tenacity.DoAttempt)
    state.set_exception(first)  # type: ignore[arg-type]
    del first
    while True:
        action = policy.iter(state)
        if isinstance(action, tenacity.DoAttempt):
            try:
                result = yield from body()
            except BaseException:  # tenacity decides, and reraises what it does not retry
                state.set_exception(sys.exc_info())  # type: ignore[arg-type]
            else:
                state.set_result(result)
        elif isinstance(action, tenacity.DoSleep):
            exc = state.outcome.exception() if state.outcome is not None else None
            state.prepare_for_next_attempt()
            if interruptible and (yield Stopping()):
                assert exc is not None
                raise exc
            log_retry(what, exc, attempt=state.attempt_number - 1, retry_in=float(action))
            yield Pause(float(action), interruptible=interruptible)
        else:
            return action  # type: ignore[no-any-return]


# Longest traceback kept in an audit event (characters; its last lines are kept).
_MAX_TRACEBACK_CHARS = 8000


def traceback_of(exc: BaseException) -> str:
    """The traceback of `exc` as text, its end kept when it is long (of what the step
    raised, for a `StepExited`)."""
    if isinstance(exc, StepExited):
        exc = exc.raised
    text = "".join(traceback.format_exception(exc))
    return text if len(text) <= _MAX_TRACEBACK_CHARS else "..." + text[-_MAX_TRACEBACK_CHARS:]


def new_token() -> str:
    """A fresh write token: each write of a saga carries its own (see `Store.write_token`).

    A random (version 4) UUID in its text form, as `str(uuid.uuid4())` makes it, without
    building a `UUID` object, which costs more than the random bytes."""
    raw = bytearray(os.urandom(16))
    raw[6] = (raw[6] & 0x0F) | 0x40  # version 4
    raw[8] = (raw[8] & 0x3F) | 0x80  # the RFC 4122 variant
    h = raw.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


# The local time zone as last looked up, and the second of the clock it was looked up in.
_zone: tuple[int, tzinfo | None] | None = None


def input_time() -> datetime:
    """The time of an input to the core (which reads no clock itself), in the local time
    zone, as `datetime.now().astimezone()` gives it. The zone is looked up at most once a
    second of the clock (a zone's offset changes on a whole second), since the look-up
    costs several times the rest and every transition makes a few of these."""
    global _zone
    now = time.time()
    second = int(now)
    zone = _zone
    if zone is not None and zone[0] == second:
        return datetime.fromtimestamp(now, zone[1])
    local = datetime.fromtimestamp(now).astimezone()
    _zone = (second, local.tzinfo)
    return local
