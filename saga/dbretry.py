"""Bounded retries of database work that failed for a transient reason."""

from __future__ import annotations

import psycopg
import structlog
import tenacity
from psycopg import errors
from psycopg_pool import PoolTimeout

_log: structlog.typing.FilteringBoundLogger = structlog.get_logger("saga")

# How long (seconds) database work keeps being retried before the error is raised.
DEFAULT_RETRY_SECONDS = 30.0


def is_transient(exc: BaseException) -> bool:
    """Connection lost, server shutting down, serialization failure, deadlock, pool timeout."""
    if isinstance(exc, errors.SerializationFailure | errors.DeadlockDetected):
        return True
    if isinstance(exc, PoolTimeout):
        return True
    # OperationalError covers lost connections, AdminShutdown and CannotConnectNow.
    return isinstance(exc, psycopg.OperationalError)


def retrying(what: str, *, seconds: float = DEFAULT_RETRY_SECONDS) -> tenacity.Retrying:
    """A tenacity loop retrying transient database errors for at most `seconds`."""

    def log(state: tenacity.RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        _log.warning(
            "database_retry",
            what=what,
            attempt=state.attempt_number,
            error=f"{type(exc).__name__}: {exc}".strip(),
            retry_in_seconds=round(state.upcoming_sleep, 3),
        )

    return tenacity.Retrying(
        retry=tenacity.retry_if_exception(is_transient),
        wait=tenacity.wait_exponential(multiplier=0.05, max=2.0) + tenacity.wait_random(0, 0.05),
        stop=tenacity.stop_after_delay(seconds),
        before_sleep=log,
        reraise=True,
    )
