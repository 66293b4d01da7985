"""Bounded retries of database work that failed for a transient reason."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import psycopg
import tenacity
from psycopg import errors
from psycopg_pool import PoolTimeout

from saga.errors import DatabaseInterrupted
from saga.logs import log_retry as log_retry
from saga.retry import DATABASE_RETRY_SECONDS

# How long (seconds) database work keeps being retried before the error is raised.
DEFAULT_RETRY_SECONDS = DATABASE_RETRY_SECONDS


def is_transient(exc: BaseException) -> bool:
    """Connection lost, server shutting down, serialization failure, deadlock, pool timeout,
    a statement cut by the server (`statement_timeout`, `lock_timeout`, an idle transaction
    ended): as psycopg raises them, or as the store translates them
    (`DatabaseInterrupted`)."""
    if isinstance(exc, DatabaseInterrupted):
        return True
    if isinstance(exc, errors.SerializationFailure | errors.DeadlockDetected):
        return True
    # The server ended a session idle in a transaction (SQLSTATE 25P03, an InternalError to
    # psycopg): the connection is gone and the transaction rolled back, as when it is lost.
    if isinstance(exc, errors.IdleInTransactionSessionTimeout):
        return True
    if isinstance(exc, PoolTimeout):
        return True
    # OperationalError covers lost connections, AdminShutdown and CannotConnectNow.
    return isinstance(exc, psycopg.OperationalError)


def retrying(
    what: str,
    *,
    seconds: float = DEFAULT_RETRY_SECONDS,
    until: threading.Event | None = None,
    url: str | None = None,
) -> tenacity.Retrying:
    """A tenacity loop retrying transient database errors for at most `seconds`.

    With `until`, the loop also ends (and its waits are cut short) once that event is set.
    With `url` (what the work connects with), its password is scrubbed from the log.
    """

    def log(state: tenacity.RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        log_retry(what, exc, attempt=state.attempt_number, retry_in=state.upcoming_sleep, url=url)

    stop: tenacity.stop.stop_base = tenacity.stop_after_delay(seconds)
    sleep: Callable[[float], None] = time.sleep
    if until is not None:
        stop = stop | tenacity.stop_when_event_set(until)
        event = until

        def sleep(seconds: float) -> None:
            event.wait(seconds)

    return tenacity.Retrying(
        retry=tenacity.retry_if_exception(is_transient),
        wait=tenacity.wait_exponential(multiplier=0.05, max=2.0) + tenacity.wait_random(0, 0.05),
        stop=stop,
        sleep=sleep,
        before_sleep=log,
        reraise=True,
    )


def aretrying(what: str, *, seconds: float = DEFAULT_RETRY_SECONDS) -> tenacity.AsyncRetrying:
    """The asyncio twin of `retrying`: transient database errors retried for at most
    `seconds`, the waits awaited."""

    def log(state: tenacity.RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        log_retry(what, exc, attempt=state.attempt_number, retry_in=state.upcoming_sleep)

    return tenacity.AsyncRetrying(
        retry=tenacity.retry_if_exception(is_transient),
        wait=tenacity.wait_exponential(multiplier=0.05, max=2.0) + tenacity.wait_random(0, 0.05),
        stop=tenacity.stop_after_delay(seconds),
        before_sleep=log,
        reraise=True,
    )
