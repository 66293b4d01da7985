"""What happened to an operation, as frozen values the core applies to a snapshot.

A driver calls user code, turns what came back into one of these values and hands it to
`apply`; an operator's request is one too, applied by `request`. Replaying after a
transient database error applies the same value to the snapshot reloaded from the
database: nothing about the outcome is kept in a closure or in the driver. This module
does no I/O, reads no clock and imports no driver.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from saga._core import ceilings
from saga._core import requests as interventions
from saga._core.planner import Next, OpRow, Planner, Stop, Write
from saga.definition import OperationSpec
from saga.retry import is_ambiguous
from saga.state import OperationStatus, SagaStatus

Verdict = Literal["retry", "failed", "unknown"]


@dataclass(frozen=True, slots=True)
class _OfOperation:
    """What happened to one operation, named by its step and kind (`action` or
    `compensation`): the fields every outcome below begins with."""

    step: str
    kind: str


@dataclass(frozen=True, slots=True)
class Returned(_OfOperation):
    """The attempt returned; `result` is its value encoded as JSON."""

    result: Any


@dataclass(frozen=True, slots=True)
class Raised(_OfOperation):
    """The attempt raised `error`, classified by its retry policy: `retry` after `delay`
    seconds, `failed` for good, or `unknown` (no verdict: it may have happened; a same-key
    retry, where one is safe, waits `delay` seconds)."""

    error: str
    verdict: Verdict
    delay: float = 0.0
    traceback: str | None = None


@dataclass(frozen=True, slots=True)
class TimedOut(_OfOperation):
    """The attempt ran past its timeout; `still_running` when it still runs here."""

    reason: str
    still_running: bool = False


@dataclass(frozen=True, slots=True)
class NotJson(_OfOperation):
    """The attempt (or a reconcile's `Found`) returned a value that cannot be stored."""

    reason: str
    returned: bool = True


@dataclass(frozen=True, slots=True)
class NotCalled(_OfOperation):
    """The orchestrator's machinery failed before any of the operation's code ran."""

    reason: str


@dataclass(frozen=True, slots=True)
class MachineryFailed(_OfOperation):
    """The orchestrator's machinery failed after the operation's code had started."""

    reason: str
    traceback: str | None = None


@dataclass(frozen=True, slots=True)
class Answered(_OfOperation):
    """A reconcile hook's answer: `found` (with the stored result and reference),
    `absent` (settled or not) or `inconclusive` (with the reason)."""

    answer: Literal["found", "absent", "inconclusive"]
    result: Any = None
    provider_reference: str | None = None
    settled: bool = True
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Prepared(_OfOperation):
    """The prepare hook computed `request` (JSON) for the next attempt."""

    request: Any


@dataclass(frozen=True, slots=True)
class PrepareRaised(_OfOperation):
    """The prepare hook raised: nothing was called."""

    error: str
    retryable: bool
    delay: float
    park: bool
    traceback: str | None = None


@dataclass(frozen=True, slots=True)
class Parked:
    """The saga cannot go on safely here (`reason`)."""

    reason: str


@dataclass(frozen=True, slots=True)
class Spent:
    """`outcome`, of an attempt that reported `amount` with `ctx.spend()` (and had a
    report refused, when `refused` says why)."""

    outcome: OpOutcome
    amount: float
    refused: str | None = None


@dataclass(frozen=True, slots=True)
class RequestCompensation:
    """An operator asks to compensate what succeeded (`compensate`)."""

    actor: str | None
    include_unknown: bool = False


@dataclass(frozen=True, slots=True)
class Resolve:
    """An operator settles an operation they checked (`resolve`); `result` is encoded."""

    step: str
    kind: Literal["action", "compensation"] | None
    outcome: Literal["succeeded", "failed"]
    result: Any
    actor: str
    reason: str | None = None
    # The steps an operator resolved as succeeded before (read under the row lock): the
    # result of such a step may be amended until its compensation has used it.
    operator_resolved: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class RequestRetry:
    """An operator resumes a parked saga at the operation it stopped at (`retry`)."""

    extra_attempts: int
    actor: str | None


@dataclass(frozen=True, slots=True)
class RequestCancel:
    """An operator stops forward progress and asks for compensation (`cancel`)."""

    reason: str
    actor: str | None
    include_unknown: bool = False


@dataclass(frozen=True, slots=True)
class RaiseCeilings:
    """An operator raises the saga's persisted ceilings (`raise_ceilings`)."""

    actor: str | None
    max_operations: int | None = None
    spend_budget: float | None = None
    max_side_effects: int | None = None
    extend_deadline_seconds: float | None = None


@dataclass(frozen=True, slots=True)
class Approve:
    """An approval, verified, releases the pending confirmation (`confirm`); the token
    (`approval`) is stored with it, for workers to verify again before the attempt."""

    step: str
    request_hash: str
    actor: str
    approval: str | None = None


@dataclass(frozen=True, slots=True)
class ReopenExpired:
    """A confirmation that expired unanswered is asked for again (`run`)."""


# An operator's request, applied under the saga's row lock.
Request = (
    RequestCompensation
    | Resolve
    | RequestRetry
    | RequestCancel
    | RaiseCeilings
    | Approve
    | ReopenExpired
)

# The verb of each request, as refusals name it.
_VERBS: dict[type, str] = {
    RequestCompensation: "compensate",
    Resolve: "resolve",
    RequestRetry: "retry",
    RequestCancel: "cancel",
    RaiseCeilings: "raise the ceilings of",
    Approve: "approve",
    ReopenExpired: "run",
}

# What happened to one operation.
OpOutcome = (
    Returned
    | Raised
    | TimedOut
    | NotJson
    | NotCalled
    | MachineryFailed
    | Answered
    | Prepared
    | PrepareRaised
)


@dataclass(frozen=True, slots=True)
class CallAsked:
    """A session's code calls a durable step under a key it has not called before: the
    call's operation is added, pending (nothing when a write that landed added it)."""

    step: str
    position: int
    idempotency_key: str
    request_hash: str
    arguments: Any
    max_attempts: int
    key: str


@dataclass(frozen=True, slots=True)
class SessionClosed:
    """A session's block ended: with `failure`, its succeeded calls are compensated in
    reverse; else it completes, unless a call's outcome is still unknown (it parks)."""

    failure: str | None = None


Outcome = OpOutcome | Parked | Spent | CallAsked | SessionClosed


class StepExited(Exception):
    """User code raised a `BaseException` that is not an `Exception` (`SystemExit` from a
    library calling `sys.exit()`, `KeyboardInterrupt` raised by code rather than by a
    signal): carried into the flow as the attempt's outcome, which is unknown, so that it
    ends that attempt and not the worker driving it. `raised` is what the code raised;
    messages and tracebacks name it."""

    def __init__(self, raised: BaseException) -> None:
        super().__init__(str(raised))
        self.raised = raised


def describe_error(exc: BaseException) -> str:
    """`Type: message` of an exception (the type alone when the message is empty); what
    a step raised for a `StepExited`."""
    if isinstance(exc, StepExited):  # named as the step raised it
        exc = exc.raised
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def outcome_of(
    spec: OperationSpec,
    op: OpRow,
    *,
    returned: Any = None,
    raised: Exception | None = None,
    trace: Callable[[BaseException], str],
    rng: random.Random | None = None,
) -> Returned | NotJson | Raised:
    """What the attempt of `op` (declared by `spec`) came to, as the value the core
    applies: what it `returned`, encoded by the step's codec (`Returned`; `NotJson` when
    it cannot be stored, the effect may have happened), or what it `raised`, classified
    by its retry policy (`Raised`): `failed`, `retry` after the policy's backoff (drawn
    with `rng`), or `unknown` when the exception is no verdict, with its traceback as
    `trace` renders it (the caller's: that reads source files)."""
    if raised is None:
        try:
            stored = spec.codec.encode(returned)
        except TypeError as exc:
            reason = f"TypeError: {exc}; the effect may have happened, so a human decides"
            return NotJson(op.step, op.kind, reason)
        return Returned(op.step, op.kind, stored)
    policy = spec.retry
    error = describe_error(raised)
    verdict = policy.classify(raised)
    if verdict != "unknown":
        retryable = verdict == "retry"
        delay = policy.delay_after(op.attempts, rng=rng) if retryable else 0.0
        return Raised(op.step, op.kind, error, verdict, delay)
    # Not a verdict: the exception may come after the effect (discipline 7).
    if is_ambiguous(raised):
        # The reply was cut off, the provider may have acted: settled as unknown (a
        # reconcile hook, a same-key retry of an idempotent operation, else a park), a
        # retry only after the policy's backoff.
        why = "an ambiguous error (the provider may have acted before the reply was cut off)"
        delay = policy.delay_after(op.attempts, rng=rng)
    else:
        why = "which is neither a PermanentError nor listed in fail_on or retry_on"
        delay = 0.0
    reason = f"attempt {op.attempts} raised {error}, {why}: its outcome is unknown"
    return Raised(op.step, op.kind, reason, "unknown", delay, traceback=trace(raised))


def reported(outcome: OpOutcome, spent: Sequence[float], refused: Sequence[str]) -> Outcome:
    """`outcome`, with what the attempt reported with `ctx.spend()` (`spent`, each
    report) and the reports refused (`refused`, why; the first is recorded), when any."""
    if not spent and not refused:
        return outcome
    return Spent(outcome, sum(spent), refused[0] if refused else None)


@dataclass(frozen=True, slots=True)
class Transition:
    """What an input did to a saga: its next move, the write that records all of it, and
    the error that kept the saga from being planned (it is parked then), if one did."""

    next: Next
    write: Write
    unplannable: Exception | None = None


def transition(
    planner: Planner,
    outcome: Outcome | None,
    now: datetime,
    *,
    may_call: bool,
    owner: str | None,
    max_inline_sleep: float,
    answer: bool = True,
) -> Transition:
    """Apply `outcome` (None: none, only the moves that need no call) at time `now`,
    plan the moves that follow (`Planner.advance`, nothing new started unless
    `may_call`), and make the write of all of it for the lease holder `owner`
    (`Planner.write`, reading the state back when it gives the lease up and `answer`).
    A saga that cannot be planned (an operation its definition no longer declares, user
    code in a cost function, confirm rule or input model that raises) is parked with
    the reason instead: the planner calls user code before it
    changes the operation concerned, so what it recorded before the error are whole
    transitions, kept with the park."""
    if outcome is not None:
        apply(planner, outcome, now)
    unplannable: Exception | None = None
    try:
        nxt = planner.advance(now, may_call=may_call)
    except Exception as exc:
        saga = planner.saga
        planner.park(
            f"cannot plan saga {saga.name!r} v{saga.version} under its registered "
            f"definition: {describe_error(exc)}"
        )
        nxt, unplannable = Stop(planner.saga.status), exc
    write = planner.write(nxt, owner=owner, max_inline_sleep=max_inline_sleep, answer=answer)
    return Transition(nxt, write, unplannable)


def apply(planner: Planner, outcome: Outcome, now: datetime) -> None:
    """Record `outcome`, which happened at `now`, on `planner`'s snapshot (the next move
    is planned after it)."""
    planner.now = now
    if isinstance(outcome, Parked):
        planner.park(outcome.reason)
        return
    if isinstance(outcome, CallAsked):
        _ask(planner, outcome)
        return
    if isinstance(outcome, SessionClosed):
        _close(planner, outcome)
        return
    if isinstance(outcome, Spent):
        inner = outcome.outcome
        op = planner.op(inner.step, inner.kind)
        if ceilings.note_spend(op, outcome.amount):
            planner.changed(op)
        _apply_to(planner, op, inner)
        if outcome.refused is not None:
            planner.event("spend_refused", op, reason=outcome.refused)
            planner.park(ceilings.refused_spend(op, outcome.refused))
        return
    _apply_to(planner, planner.op(outcome.step, outcome.kind), outcome)


def _ask(planner: Planner, call: CallAsked) -> None:
    planner.session_call = call.step
    if planner.find(call.step, "action") is not None:
        return  # added by a write that landed although its reply was lost
    op = OpRow(
        step=call.step,
        kind="action",
        position=call.position,
        idempotency_key=call.idempotency_key,
        request_hash=call.request_hash,
        status=OperationStatus.PENDING,
        attempts=0,
        max_attempts=call.max_attempts,
        request=call.arguments,
    )
    planner.add_op(op)
    planner.event("call_asked", op, key=call.key)


def _close(planner: Planner, closed: SessionClosed) -> None:
    if not planner.saga.status.is_runnable:
        return
    if closed.failure is not None:
        planner.begin_compensation(closed.failure)
        return
    unsettled = [
        op.step
        for op in planner.actions
        if op.status in (OperationStatus.UNKNOWN, OperationStatus.RUNNING)
    ]
    if unsettled:
        planner.park(
            f"the session ended with the outcome of {', '.join(map(repr, unsettled))} unknown "
            "(a call its code did not make again): resolve it"
        )
        return
    planner.finish(SagaStatus.COMPLETED)


def _apply_to(planner: Planner, op: OpRow, outcome: OpOutcome) -> None:
    if op.kind == "action" and planner.definition.is_session:
        # A session calls one operation at a time: this one (a planner made afresh to
        # apply the outcome again, after a write whose reply was lost, learns it here).
        planner.session_call = op.step
    if isinstance(outcome, Returned):
        planner.record_success(op, outcome.result)
    elif isinstance(outcome, Raised):
        if outcome.verdict == "unknown":
            planner.record_unknown(
                op,
                outcome.error,
                park=False,
                traceback=outcome.traceback,
                retry_after=outcome.delay,
            )
        else:
            planner.record_failure(
                op, outcome.error, retryable=outcome.verdict == "retry", delay=outcome.delay
            )
    elif isinstance(outcome, TimedOut):
        planner.record_unknown(op, outcome.reason, park=outcome.still_running)
    elif isinstance(outcome, NotJson):
        planner.record_unknown(op, outcome.reason, park=True, spend_known=outcome.returned)
    elif isinstance(outcome, NotCalled):
        planner.record_not_called(op, outcome.reason)
    elif isinstance(outcome, MachineryFailed):
        planner.record_unknown(op, outcome.reason, park=True, traceback=outcome.traceback)
    elif isinstance(outcome, Answered):
        if outcome.answer == "found":
            planner.record_found(op, outcome.result, outcome.provider_reference)
        elif outcome.answer == "absent":
            planner.record_absent(op, settled=outcome.settled)
        else:
            planner.record_inconclusive(op, outcome.reason)
    elif isinstance(outcome, Prepared):
        planner.record_request(op, outcome.request)
    else:
        planner.record_prepare_failure(
            op,
            outcome.error,
            retryable=outcome.retryable,
            delay=outcome.delay,
            park=outcome.park,
            traceback=outcome.traceback,
        )


def request(planner: Planner, req: Request, now: datetime) -> bool:
    """Apply an operator's request, made at `now`, to `planner`'s snapshot; False when it
    found the saga already where it asks for, and changed nothing."""
    interventions.refuse_when_forked(planner, _VERBS.get(type(req), "change"))
    if isinstance(req, RequestCompensation):
        return interventions.request_compensation(
            planner, include_unknown=req.include_unknown, actor=req.actor, now=now
        )
    if isinstance(req, Resolve):
        interventions.resolve(
            planner,
            req.step,
            kind=req.kind,
            outcome=req.outcome,
            result=req.result,
            actor=req.actor,
            reason=req.reason,
            operator_resolved=req.operator_resolved,
            now=now,
        )
    elif isinstance(req, RequestRetry):
        interventions.request_retry(
            planner, extra_attempts=req.extra_attempts, actor=req.actor, now=now
        )
    elif isinstance(req, RequestCancel):
        return interventions.request_cancel(
            planner,
            reason=req.reason,
            actor=req.actor,
            include_unknown=req.include_unknown,
            now=now,
        )
    elif isinstance(req, RaiseCeilings):
        interventions.raise_ceilings(
            planner,
            actor=req.actor,
            max_operations=req.max_operations,
            spend_budget=req.spend_budget,
            max_side_effects=req.max_side_effects,
            extend_deadline_seconds=req.extend_deadline_seconds,
            now=now,
        )
    elif isinstance(req, Approve):
        interventions.approve_confirmation(
            planner, req.step, req.request_hash, actor=req.actor, now=now, approval=req.approval
        )
    else:
        return interventions.reopen_expired_confirmation(planner, now=now)
    return True
