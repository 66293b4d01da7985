"""What an attempt came to, as a value: `inputs.outcome_of`, pure and without a database."""

from __future__ import annotations

import random
from typing import Any

from pydantic import BaseModel

from saga import PermanentError, RetryPolicy, Saga
from saga._core.inputs import NotJson, Raised, Returned, StepExited, outcome_of
from saga._core.planner import OpRow, new_action_rows
from saga.definition import OperationSpec


class Order(BaseModel):
    order_id: str


class Flaky(Exception):
    """An error the step's policy retries."""


def _spec_and_op(attempts: int = 1) -> tuple[OperationSpec, OpRow]:
    saga: Saga[Order] = Saga("outcomes", input=Order, key=lambda o: o.order_id)

    @saga.step(name="charge", retry=RetryPolicy(max_attempts=5, retry_on=(Flaky,)))
    def charge(ctx: Any, order: Order) -> dict[str, str]:
        return {"charged": order.order_id}

    op = new_action_rows(saga, "t", "k", {"order_id": "o-1"})[0]
    op.attempts = attempts
    spec = saga.step_named("charge")
    assert spec is not None
    return spec, op


def _trace(exc: BaseException) -> str:
    return f"trace of {type(exc).__name__}"


def test_a_return_is_stored_as_the_codec_encodes_it() -> None:
    spec, op = _spec_and_op()
    assert outcome_of(spec, op, returned={"charged": "o-1"}, trace=_trace) == Returned(
        "charge", "action", {"charged": "o-1"}
    )


def test_a_return_that_cannot_be_stored_leaves_the_decision_to_a_human() -> None:
    spec, op = _spec_and_op()
    outcome = outcome_of(spec, op, returned={"at": object()}, trace=_trace)
    assert isinstance(outcome, NotJson)
    assert outcome.reason.startswith("TypeError: ")
    assert outcome.reason.endswith("the effect may have happened, so a human decides")


def test_a_permanent_error_fails_the_operation_at_once() -> None:
    spec, op = _spec_and_op()
    outcome = outcome_of(spec, op, raised=PermanentError("card declined"), trace=_trace)
    assert outcome == Raised("charge", "action", "PermanentError: card declined", "failed", 0.0)


def test_an_error_the_policy_retries_waits_its_backoff() -> None:
    spec, op = _spec_and_op(attempts=2)
    outcome = outcome_of(spec, op, raised=Flaky(), trace=_trace, rng=random.Random(7))
    expected = spec.retry.delay_after(2, rng=random.Random(7))
    assert outcome == Raised("charge", "action", "Flaky", "retry", expected)
    assert outcome.delay > 0


def test_an_error_that_is_no_verdict_makes_the_outcome_unknown_with_its_traceback() -> None:
    spec, op = _spec_and_op(attempts=3)
    outcome = outcome_of(spec, op, raised=KeyError("total"), trace=_trace)
    assert outcome == Raised(
        "charge",
        "action",
        "attempt 3 raised KeyError: 'total', which is neither a PermanentError nor listed "
        "in fail_on or retry_on: its outcome is unknown",
        "unknown",
        0.0,
        traceback="trace of KeyError",
    )


def test_an_ambiguous_error_is_unknown_and_retried_only_after_the_backoff() -> None:
    spec, op = _spec_and_op()
    outcome = outcome_of(
        spec, op, raised=ConnectionResetError("reset"), trace=_trace, rng=random.Random(1)
    )
    assert isinstance(outcome, Raised)
    assert outcome.verdict == "unknown"
    assert "an ambiguous error" in outcome.error
    assert outcome.delay == spec.retry.delay_after(1, rng=random.Random(1))


def test_what_a_step_exited_with_is_named_as_it_raised_it() -> None:
    spec, op = _spec_and_op()
    outcome = outcome_of(spec, op, raised=StepExited(SystemExit(3)), trace=_trace)
    assert isinstance(outcome, Raised)
    assert outcome.verdict == "unknown"
    assert "raised SystemExit: 3," in outcome.error
