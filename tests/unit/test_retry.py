"""RetryPolicy: documented defaults, validation, backoff maths and what is retryable."""

import random
from typing import Any

import pytest
from pydantic import ValidationError

from saga import PermanentError, RetryPolicy, TransientError
from saga.retry import is_ambiguous

# Enough draws to see both ends of the jitter range with a seeded generator.
JITTER_SAMPLES = 2000


def test_defaults_are_the_documented_ones() -> None:
    """RetryPolicy() is 3 attempts, 0.25 s initial, 30 s max, x2.0, 10% jitter, and retries
    only TransientError (an ambiguous error is settled as unknown)."""
    policy = RetryPolicy()
    assert policy.max_attempts == 3
    assert policy.initial_delay == 0.25
    assert policy.max_delay == 30.0
    assert policy.multiplier == 2.0
    assert policy.jitter == 0.1
    assert policy.retry_on == (TransientError,)
    assert policy.fail_on == ()


def test_policy_is_frozen() -> None:
    """A policy is a value: assigning a field raises and leaves it unchanged."""
    policy = RetryPolicy()
    with pytest.raises(ValidationError):
        policy.max_attempts = 10  # type: ignore[misc]
    assert policy.max_attempts == 3


def test_policies_with_equal_fields_are_equal_and_hashable() -> None:
    """Two policies built from the same options compare equal and can key a dict."""
    a = RetryPolicy(max_attempts=5, initial_delay=1.0)
    b = RetryPolicy(max_attempts=5, initial_delay=1.0)
    assert a == b
    assert {a: "x"}[b] == "x"


def test_options_are_keyword_only() -> None:
    """Positional arguments are refused with TypeError."""
    untyped: Any = RetryPolicy  # call it as a careless caller would
    with pytest.raises(TypeError):
        untyped(5)


def test_unknown_option_is_refused() -> None:
    """A misspelt option raises instead of being silently ignored."""
    with pytest.raises(ValidationError):
        RetryPolicy(max_attempt=5)  # type: ignore[call-arg]


@pytest.mark.parametrize(
    "options",
    [
        {"max_attempts": 0},
        {"max_attempts": -1},
        {"initial_delay": -0.1},
        {"max_delay": -1.0},
        {"initial_delay": 5.0, "max_delay": 1.0},
        {"jitter": 1.5},
        {"jitter": -0.1},
        {"multiplier": 0.5},
        {"initial_delay": float("nan")},
        {"max_delay": float("inf")},
        {"retry_on": (ValueError, "oops")},
        {"retry_on": (int,)},
        {"retry_on": 42},
        {"fail_on": (KeyError, "oops")},
        {"fail_on": (int,)},
        {"fail_on": 42},
    ],
    ids=[
        "zero-attempts",
        "negative-attempts",
        "negative-initial",
        "negative-max",
        "initial-above-max",
        "jitter-above-1",
        "negative-jitter",
        "shrinking-multiplier",
        "nan-delay",
        "infinite-max",
        "retry-on-str",
        "retry-on-non-exception-class",
        "retry-on-int",
        "fail-on-str",
        "fail-on-non-exception-class",
        "fail-on-int",
    ],
)
def test_invalid_options_raise_validation_error(options: dict[str, Any]) -> None:
    """Nonsensical options fail at construction with pydantic's ValidationError."""
    with pytest.raises(ValidationError):
        RetryPolicy(**options)


def test_retry_on_accepts_a_single_class() -> None:
    """retry_on=SomeError is accepted as the one-element tuple (SomeError,)."""
    assert RetryPolicy(retry_on=ValueError).retry_on == (ValueError,)
    assert RetryPolicy(fail_on=KeyError).fail_on == (KeyError,)


def test_boundary_values_are_accepted() -> None:
    """One attempt, zero delays, no jitter and full jitter are all valid."""
    RetryPolicy(max_attempts=1, initial_delay=0.0, max_delay=0.0, jitter=0.0)
    RetryPolicy(jitter=1.0, multiplier=1.0)
    RetryPolicy(initial_delay=2.0, max_delay=2.0)


# ----- delays ---------------------------------------------------------------------------


def test_delays_grow_exponentially_without_jitter() -> None:
    """With jitter=0 the delay after attempt n is initial_delay * multiplier**(n-1)."""
    policy = RetryPolicy(initial_delay=0.5, multiplier=3.0, max_delay=1000.0, jitter=0.0)
    assert [policy.delay_after(n) for n in range(1, 6)] == pytest.approx(
        [0.5, 1.5, 4.5, 13.5, 40.5]
    )


def test_default_delays_double() -> None:
    """Default policy without jitter: 0.25, 0.5, 1, 2 seconds."""
    policy = RetryPolicy(jitter=0.0)
    assert [policy.delay_after(n) for n in range(1, 5)] == pytest.approx([0.25, 0.5, 1.0, 2.0])


def test_delays_are_capped_at_max_delay() -> None:
    """No delay exceeds max_delay, however many attempts have failed."""
    policy = RetryPolicy(initial_delay=1.0, max_delay=5.0, jitter=0.0)
    assert [policy.delay_after(n) for n in range(1, 6)] == pytest.approx([1.0, 2.0, 4.0, 5.0, 5.0])
    assert policy.delay_after(10_000) == pytest.approx(5.0)


def test_constant_delay_with_multiplier_one() -> None:
    """multiplier=1 gives the same delay after every attempt."""
    policy = RetryPolicy(initial_delay=0.75, multiplier=1.0, jitter=0.0)
    assert {policy.delay_after(n) for n in range(1, 8)} == {0.75}


def test_zero_delays_stay_zero() -> None:
    """initial_delay=0 retries immediately, jitter or not."""
    policy = RetryPolicy(initial_delay=0.0, max_delay=0.0)
    assert policy.delay_after(1) == 0.0
    assert policy.delay_after(5, rng=random.Random(1)) == 0.0


def test_jitter_stays_within_its_fraction_of_the_base_delay() -> None:
    """Each jittered delay lies within +/- jitter of the exponential base and varies."""
    policy = RetryPolicy(initial_delay=1.0, multiplier=2.0, max_delay=1000.0, jitter=0.2)
    rng = random.Random(20240501)
    for attempt in (1, 2, 3, 4):
        base = 2.0 ** (attempt - 1)
        samples = [policy.delay_after(attempt, rng=rng) for _ in range(JITTER_SAMPLES)]
        assert min(samples) >= base * 0.8
        assert max(samples) <= base * 1.2
        # The spread is actually used: both sides of the base are reached, near the edges.
        assert min(samples) < base * 0.85
        assert max(samples) > base * 1.15


def test_jittered_delay_never_exceeds_max_delay() -> None:
    """At the cap, jitter only shortens the delay: max_delay is a hard bound."""
    policy = RetryPolicy(initial_delay=1.0, max_delay=4.0, jitter=0.5)
    rng = random.Random(7)
    samples = [policy.delay_after(10, rng=rng) for _ in range(JITTER_SAMPLES)]
    assert max(samples) <= 4.0
    assert min(samples) >= 2.0


def test_full_jitter_never_goes_negative() -> None:
    """jitter=1.0 spreads the delay over [0, 2*base] capped, never below zero."""
    policy = RetryPolicy(initial_delay=1.0, max_delay=100.0, jitter=1.0)
    rng = random.Random(3)
    samples = [policy.delay_after(1, rng=rng) for _ in range(JITTER_SAMPLES)]
    assert min(samples) >= 0.0
    assert max(samples) <= 2.0


def test_seeded_rng_makes_delays_reproducible() -> None:
    """The same seed gives the same jittered delays."""
    policy = RetryPolicy()
    first = [policy.delay_after(n, rng=random.Random(42)) for n in range(1, 6)]
    again = [policy.delay_after(n, rng=random.Random(42)) for n in range(1, 6)]
    assert first == again


@pytest.mark.parametrize("attempt", [0, -1])
def test_attempt_numbers_start_at_one(attempt: int) -> None:
    """delay_after(0) is a caller bug and raises ValueError."""
    with pytest.raises(ValueError):
        RetryPolicy().delay_after(attempt)


# ----- what is retryable ----------------------------------------------------------------


class _Flaky(TransientError):
    pass


class _Both(PermanentError, TransientError):
    pass


@pytest.mark.parametrize(
    "error", [TransientError("x"), _Flaky("x")], ids=["transient", "transient-subclass"]
)
def test_default_policy_retries_transient_errors(error: BaseException) -> None:
    """TransientError (and subclasses), the step's word that nothing happened, is retried."""
    assert RetryPolicy().is_retryable(error)
    assert RetryPolicy().classify(error) == "retry"


class _TimedOutRead(TimeoutError):
    pass


class _BusyButUntouched(TransientError, ConnectionError):
    pass


@pytest.mark.parametrize(
    "error",
    [
        ConnectionError("x"),
        TimeoutError("x"),
        BrokenPipeError(),
        ConnectionResetError(),
        ConnectionRefusedError(),
        _TimedOutRead("x"),
    ],
    ids=["connection", "timeout", "broken-pipe", "reset", "refused", "sub"],
)
def test_default_policy_leaves_ambiguous_errors_unknown(error: BaseException) -> None:
    """A ConnectionError or TimeoutError (any subclass) may come after the provider acted:
    not retried by the policy, its outcome is unknown (settled by reconcile, a same-key
    retry of an idempotent operation, else a park)."""
    assert is_ambiguous(error)
    assert not RetryPolicy().is_retryable(error)
    assert RetryPolicy().classify(error) == "unknown"


def test_a_transient_error_is_never_ambiguous() -> None:
    """A TransientError that is also a ConnectionError is the step's word: retried."""
    assert not is_ambiguous(_BusyButUntouched("x"))
    assert RetryPolicy().classify(_BusyButUntouched("x")) == "retry"
    assert not is_ambiguous(ValueError("x"))


def test_an_explicit_retry_on_retries_an_ambiguous_error() -> None:
    """Listing TimeoutError (or a base class of it) in retry_on is the user's explicit word
    that a retry is safe: it is retried as listed."""
    assert RetryPolicy(retry_on=(TimeoutError,)).classify(TimeoutError("x")) == "retry"
    assert RetryPolicy(retry_on=(OSError,)).classify(ConnectionResetError()) == "retry"
    assert RetryPolicy(retry_on=(TimeoutError,)).classify(ConnectionResetError()) == "unknown"


@pytest.mark.parametrize(
    "error",
    [PermanentError("x"), ValueError("x"), KeyError("x"), RuntimeError("x")],
    ids=["permanent", "value", "key", "runtime"],
)
def test_default_policy_does_not_retry_other_errors(error: BaseException) -> None:
    """PermanentError and anything unlisted are not retried."""
    assert not RetryPolicy().is_retryable(error)


def test_only_permanent_error_and_fail_on_are_failures() -> None:
    """PermanentError and fail_on fail the operation; retry_on retries; anything else
    leaves the outcome unknown (it may have been raised after the effect)."""
    policy = RetryPolicy(fail_on=(KeyError,))
    assert policy.classify(PermanentError("x")) == "failed"
    assert policy.classify(KeyError("x")) == "failed"
    assert policy.classify(TransientError("x")) == "retry"
    assert policy.classify(ValueError("x")) == "unknown"
    assert RetryPolicy().classify(KeyError("x")) == "unknown"


def test_fail_on_wins_over_retry_on() -> None:
    """An exception in both fail_on and retry_on fails the operation; it is not retried."""
    policy = RetryPolicy(retry_on=(ConnectionError,), fail_on=(ConnectionRefusedError,))
    assert policy.classify(ConnectionRefusedError()) == "failed"
    assert not policy.is_retryable(ConnectionRefusedError())
    assert policy.classify(ConnectionResetError()) == "retry"


def test_listed_errors_are_retried() -> None:
    """An exception class listed in retry_on is retried; the defaults are then not implied."""
    policy = RetryPolicy(retry_on=(ValueError,))
    assert policy.is_retryable(ValueError("x"))
    assert not policy.is_retryable(TransientError("x"))


def test_permanent_error_is_never_retried() -> None:
    """PermanentError is final even when listed in retry_on or mixed with TransientError."""
    policy = RetryPolicy(retry_on=(PermanentError, TransientError, Exception))
    assert not policy.is_retryable(PermanentError("x"))
    assert not policy.is_retryable(_Both("x"))
    assert not RetryPolicy().is_retryable(_Both("x"))
