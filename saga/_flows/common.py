"""What the flow modules share: the retry of a flow after a transient database error,
how an error is described and its traceback kept, and the time of an input to the core."""

from __future__ import annotations

import sys
import traceback
import uuid
from collections.abc import Callable
from datetime import datetime
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
    the driver is not stopping); the last error is raised."""
    policy = tenacity.Retrying(
        retry=tenacity.retry_if_exception_type(DatabaseInterrupted),
        wait=tenacity.wait_exponential(multiplier=0.05, max=2.0) + tenacity.wait_random(0, 0.05),
        stop=tenacity.stop_after_delay(DATABASE_RETRY_SECONDS),
        reraise=True,
    )
    policy.begin()
    state = tenacity.RetryCallState(policy, fn=None, args=(), kwargs={})
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
    """A fresh write token: each write of a saga carries its own (see `Store.write_token`)."""
    return str(uuid.uuid4())


def input_time() -> datetime:
    """The time of an input to the core (which reads no clock itself)."""
    return datetime.now().astimezone()
