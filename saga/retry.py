"""Retry policy of an operation: ceiling, exponential backoff with jitter, retryable errors."""

from __future__ import annotations

import random
from typing import Any, Literal

import tenacity
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from saga.errors import PermanentError, TransientError

# Only the step's own word that nothing happened is retried by default. A connection or
# timeout error may come after the provider acted (the reply was cut off): retried only
# where a retry is safe, as an unknown outcome (see `is_ambiguous`).
_DEFAULT_RETRY_ON: tuple[type[BaseException], ...] = (TransientError,)

# Errors that may be raised after the provider acted: the request left, the reply did not
# come back. asyncio.TimeoutError is the builtin TimeoutError (Python 3.11 on), and
# ConnectionResetError, BrokenPipeError, ConnectionRefusedError... are ConnectionErrors.
AMBIGUOUS_ERRORS: tuple[type[BaseException], ...] = (ConnectionError, TimeoutError)

# How long (seconds) the orchestrator's own database work, cut off by a transient failure
# (`DatabaseInterrupted`), is retried before the error is raised.
DATABASE_RETRY_SECONDS = 30.0


def is_ambiguous(error: BaseException) -> bool:
    """True when `error` may have been raised after the provider acted: a `ConnectionError`
    or `TimeoutError` (builtin, asyncio's, or a subclass) that is not a `TransientError`
    (the step's own word that nothing happened)."""
    return isinstance(error, AMBIGUOUS_ERRORS) and not isinstance(error, TransientError)


class RetryPolicy(BaseModel):
    """How often and how soon an operation is retried after a transient failure.

    Attributes:
        max_attempts: Ceiling on attempts, the first included (persisted with the operation).
        initial_delay: Seconds before the second attempt.
        max_delay: Upper bound, in seconds, of any delay.
        multiplier: Growth factor of the delay between consecutive attempts.
        jitter: Fraction of the delay randomly added or removed (0.1 means +/-10%).
        retry_on: Exception types that are retried up to the ceiling (by default only
            `TransientError`, the step's word that nothing happened). A type listed here is
            retried as listed, even a `ConnectionError` or `TimeoutError`: the user's
            explicit word that a retry is safe.
        fail_on: Exception types that fail the operation at once, like `PermanentError`
            (compensation follows). Any exception in neither tuple may have been raised
            after the effect, so it leaves the attempt's outcome unknown, settled by the
            operation's reconcile hook, else a retry with the same key when it is
            idempotent, else a park for a human. That is the default for a
            `ConnectionError` or `TimeoutError` (`is_ambiguous`): the reply was cut off,
            the provider may have acted, so only a safe retry is made, after this
            policy's backoff.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    max_attempts: int = Field(default=3, ge=1)
    initial_delay: float = Field(default=0.25, ge=0.0, allow_inf_nan=False)
    max_delay: float = Field(default=30.0, ge=0.0, allow_inf_nan=False)
    multiplier: float = Field(default=2.0, ge=1.0, allow_inf_nan=False)
    jitter: float = Field(default=0.1, ge=0.0, le=1.0, allow_inf_nan=False)
    retry_on: tuple[type[BaseException], ...] = _DEFAULT_RETRY_ON
    fail_on: tuple[type[BaseException], ...] = ()

    @field_validator("retry_on", "fail_on", mode="before")
    @classmethod
    def _check_exceptions(cls, value: Any, info: ValidationInfo) -> tuple[type[BaseException], ...]:
        name = info.field_name
        if isinstance(value, type):
            value = (value,)
        if not isinstance(value, tuple | list | set | frozenset):
            raise ValueError(f"{name} must be an exception class or a tuple of them, got {value!r}")
        items = tuple(value)
        for item in items:
            if not (isinstance(item, type) and issubclass(item, BaseException)):
                raise ValueError(f"{name} must hold exception classes, got {item!r}")
        return items

    @model_validator(mode="after")
    def _check_bounds(self) -> RetryPolicy:
        if self.initial_delay > self.max_delay:
            raise ValueError(
                f"initial_delay ({self.initial_delay}) must not exceed max_delay ({self.max_delay})"
            )
        return self

    def is_retryable(self, error: BaseException) -> bool:
        """True when `error` is transient under this policy (never for `PermanentError` or
        an exception in `fail_on`)."""
        if self.is_failure(error):
            return False
        return isinstance(error, self.retry_on)

    def is_failure(self, error: BaseException) -> bool:
        """True when `error` says the attempt had no effect and will not: a `PermanentError`
        or an exception in `fail_on` (they win over `retry_on`)."""
        return isinstance(error, (PermanentError, *self.fail_on))

    def classify(self, error: BaseException) -> Literal["failed", "retry", "unknown"]:
        """What an exception raised by an attempt says about its outcome: `failed` (fail
        the operation), `retry` (transient: listed in `retry_on`), or `unknown` (it may
        have been raised after the effect: an ambiguous `ConnectionError` or
        `TimeoutError` not listed in `retry_on`, a bug, a parse error)."""
        if self.is_failure(error):
            return "failed"
        return "retry" if isinstance(error, self.retry_on) else "unknown"

    def delay_after(self, attempt: int, *, rng: random.Random | None = None) -> float:
        """Seconds to wait after failed attempt number `attempt` (from 1), jitter included."""
        if attempt < 1:
            raise ValueError(f"attempt numbers start at 1, got {attempt}")
        wait = tenacity.wait_exponential(
            multiplier=self.initial_delay, exp_base=self.multiplier, max=self.max_delay
        )
        base = float(wait(_retry_state(attempt)))
        spread = base * self.jitter
        jittered = base + (rng or random).uniform(-spread, spread)
        return max(0.0, min(jittered, self.max_delay))


def _retry_state(attempt: int) -> tenacity.RetryCallState:
    state = tenacity.RetryCallState(retry_object=tenacity.Retrying(), fn=None, args=(), kwargs={})
    state.attempt_number = attempt
    return state
