"""Calls of user code: a step, a compensation, their prepare and reconcile hooks.

Each call is a flow that yields the `Call` effect and turns what came of it (a return, an
exception, the driver's own failure) into an input value for the core; the loop
(`saga._flows.drive`) records it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from saga._core import inputs
from saga._core.inputs import describe_error
from saga._core.planner import Invoke, OpRow, Planner, SagaRow
from saga._core.rows import describe
from saga._core.selffence import may_start_call
from saga._flows.common import retried, traceback_of
from saga._flows.effects import (
    AttemptTimedOut,
    AwaitAbandoned,
    Call,
    Flow,
    MachineryError,
    MachineryFailedError,
    NotCalledError,
    Reached,
    Watch,
    db,
)
from saga._flows.store_ops import StoreOps
from saga.context import StepContext
from saga.errors import DatabaseInterrupted, LeaseLost
from saga.logs import get_logger
from saga.outcomes import Absent, Found, Inconclusive
from saga.retry import is_ambiguous
from saga.state import OperationStatus

_log = get_logger("saga")

# What persists an attempt's running spend total (built by the driver for each attempt).
SpendReporter = Callable[[SagaRow, OpRow], Callable[[float], None]]


@dataclass(frozen=True, slots=True)
class Answer:
    """What came of a call, for the loop to record: the input value, and whether its
    record is the `after_record` fault point (not when nothing was called)."""

    outcome: inputs.Outcome
    after_record: bool = True


class Calls:
    """Calls the user code of a saga's operations under its lease (`owner`)."""

    def __init__(self, owner: str, lease_seconds: float, reporter: SpendReporter) -> None:
        self.owner = owner
        self.lease_seconds = lease_seconds
        self.reporter = reporter

    def context(self, planner: Planner, op: OpRow) -> StepContext:
        """What a hook of `op` is handed first: its `StepContext`."""
        request = planner.request_of(op) if planner.spec_of(op).prepare_fn else None
        return self._context(planner.saga, op, planner.results(), request)

    def _context(
        self, saga: SagaRow, op: OpRow, results: dict[str, Any], request: Any
    ) -> StepContext:
        return StepContext(
            saga_id=saga.id,
            tenant_id=saga.tenant_id,
            step=op.step,
            kind=op.kind,
            idempotency_key=op.idempotency_key,
            attempt=op.attempts,
            fence=saga.fence,
            results=results,
            request=request,
            _report=(self.reporter(saga, op) if op.status == OperationStatus.RUNNING else None),
        )

    def prepare(self, planner: Planner, op: OpRow) -> Flow[inputs.Outcome]:
        """Call the prepare hook of `op`'s attempt; what came of it, to record."""
        spec = planner.spec_of(op)
        assert spec.prepare_fn is not None and spec.request_codec is not None
        ctx = self.context(planner, op)
        outcome: inputs.Outcome
        # Nothing has been called when prepare raises, so its outcome is never unknown:
        # PermanentError and fail_on fail the attempt and the operation, retry_on retries,
        # and anything else (a bug, a request that cannot be stored) parks the saga.
        verdict = "unknown"
        failure: Exception | None = None
        try:
            prepared = yield Call(spec.prepare_fn, (ctx, *planner.arguments(op)))
        except MachineryError as exc:
            # Our machinery, not the hook: no verdict on the operation, whose attempt was
            # not started; the saga parks with the reason.
            _log.error("prepare_not_run", step=op.step, kind=op.kind, error=str(exc))
            reason = (
                f"prepare of {describe(op)} could not be run: the orchestrator failed "
                f"({exc}); the attempt was not called"
            )
            return inputs.NotCalled(op.step, op.kind, reason)
        except Exception as exc:
            verdict, failure = spec.retry.classify(exc), exc
            if verdict == "unknown" and is_ambiguous(exc):
                verdict = "retry"  # nothing was called: a cut-off reply is only transient here
        else:
            try:
                request = spec.request_codec.encode(prepared)
            except TypeError as exc:
                failure = exc
        if failure is None:
            outcome = inputs.Prepared(op.step, op.kind, request)
        else:
            retryable, park = verdict == "retry", verdict == "unknown"
            outcome = inputs.PrepareRaised(
                op.step,
                op.kind,
                describe_error(failure),
                retryable=retryable,
                delay=spec.retry.delay_after(op.attempts + 1) if retryable else 0.0,
                park=park,
                traceback=traceback_of(failure) if park else None,
            )
        # Nothing has been called yet: a retried transaction may simply prepare again.
        return outcome

    def invoke(self, planner: Planner, invoke: Invoke) -> Flow[Answer]:
        """Make the call of `invoke` (an attempt of its step or compensation, built by
        the planner); what came of it, to record."""
        op, call = invoke.op, invoke.call
        where = {"step": op.step, "kind": op.kind}
        outcome: inputs.OpOutcome
        try:
            # What the step is handed (its context, the earlier results, its arguments) is
            # built by our machinery: a failure here is no outcome of the step, which
            # has not been called.
            if isinstance(call, Exception):
                raise call
            spec = call.spec
            ctx = self._context(planner.saga, op, call.results, call.request)
            arguments = (ctx, *call.arguments)
        except Exception as exc:
            if isinstance(exc, DatabaseInterrupted):
                raise
            _log.error("attempt_not_called", **where, error=describe_error(exc))
            reason = (
                f"attempt {op.attempts} of {describe(op)} was not called: its arguments "
                f"could not be built ({describe_error(exc)}); nothing of it ran"
            )
            return Answer(inputs.NotCalled(op.step, op.kind, reason), after_record=False)
        # The boundary fires the fault points around the call and traces it; the lease is
        # confirmed last, just before the call (a process stalled at `before_call` finds
        # out there that its lease lapsed).
        yield Reached(("before_call", op.step, op.kind))
        yield from self.self_fence(planner, op)
        watch = Watch(planner, after=("after_call", op.step, op.kind), span="attempt", op=op)
        try:
            value = yield Call(
                spec.fn,
                arguments,
                timeout_seconds=spec.guards.timeout_seconds,
                hold=(planner.saga.id, planner.saga.fence),
                is_async=spec.is_async,
                watch=watch,
            )
        except AttemptTimedOut as exc:
            outcome = inputs.TimedOut(op.step, op.kind, str(exc), exc.still_running)
        except NotCalledError as exc:
            # Our machinery failed before any of the step ran: no outcome to record.
            _log.error("attempt_not_called", **where, error=str(exc), traceback=traceback_of(exc))
            reason = (
                f"attempt {op.attempts} of {describe(op)} was not called: the orchestrator "
                f"could not run it ({exc}); nothing of it ran"
            )
            outcome = inputs.NotCalled(op.step, op.kind, reason)
        except MachineryFailedError as exc:
            # Not the step's verdict, whatever its policy says of the error: unknown, parked.
            reason = (
                f"attempt {op.attempts}: the orchestrator failed after the step's function "
                f"had started ({exc}); its outcome is unknown"
            )
            outcome = inputs.MachineryFailed(op.step, op.kind, reason, traceback_of(exc))
        except Exception as exc:
            outcome = inputs.outcome_of(spec, op, raised=exc, trace=traceback_of)
        else:
            outcome = inputs.outcome_of(spec, op, returned=value, trace=traceback_of)
        return Answer(inputs.reported(outcome, ctx._spent, ctx._refused))

    def reconcile(self, planner: Planner, op: OpRow) -> Flow[Answer]:
        """Ask the reconcile hook of `op`, whose outcome is unknown; its answer, to record."""
        spec = planner.spec_of(op)
        fn, codec = spec.reconcile_fn, spec.codec
        assert fn is not None  # the planner asks only operations that have a hook
        running = yield from self.abandoned_attempt(planner, op)
        if running is not None:
            return Answer(inputs.Parked(running), after_record=False)
        ctx = self.context(planner, op)
        outcome: inputs.OpOutcome
        yield from self.self_fence(planner, op)
        try:
            answer = yield Call(
                fn, (ctx, *planner.arguments(op)), watch=Watch(planner, span="reconcile", op=op)
            )
            if isinstance(answer, Found):
                try:
                    stored = codec.encode(answer.result)
                except TypeError as exc:
                    # Asking again would find the same value: a human decides now.
                    reason = f"reconcile found the effect, but TypeError: {exc}; a human decides"
                    outcome = inputs.NotJson(op.step, op.kind, reason, returned=False)
                else:
                    outcome = inputs.Answered(
                        op.step, op.kind, "found", stored, answer.provider_reference
                    )
            elif isinstance(answer, Absent):
                outcome = inputs.Answered(op.step, op.kind, "absent", settled=answer.settled)
            else:
                reason = (
                    answer.reason or "the provider's answer was inconclusive"
                    if isinstance(answer, Inconclusive)
                    else f"reconcile returned {type(answer).__name__}; expected Found, Absent "
                    "or Inconclusive"
                )
                outcome = inputs.Answered(op.step, op.kind, "inconclusive", reason=reason)
        except MachineryError as exc:
            # No answer: the orchestrator could not run the hook.
            reason = f"reconcile could not be run: the orchestrator failed ({exc})"
            outcome = inputs.Answered(op.step, op.kind, "inconclusive", reason=reason)
        except Exception as exc:
            reason = f"reconcile raised {describe_error(exc)}"
            outcome = inputs.Answered(op.step, op.kind, "inconclusive", reason=reason)
        # The operation is `unknown` while it is reconciled: nothing to protect from replay.
        return Answer(outcome)

    def self_fence(self, planner: Planner, op: OpRow) -> Flow[None]:
        """Start a call only while the lease cannot have ended, less a margin
        (`saga._core.selffence`), by this process's clock from when the write that last
        confirmed it was sent. Past that (a reply held by a pooler, a lost reply found
        again, a stalled process), the lease is confirmed again by a fenced renewal first;
        `LeaseLost` when it is no longer ours: another owner may have settled the attempt
        meanwhile (a reconcile that found nothing), and this call must not start."""
        saga, lease = planner.saga, self.lease_seconds
        held = (saga.id, saga.fence)

        def renew() -> Flow[tuple[float, bool]]:
            sent = time.monotonic()
            alive = yield from db(
                StoreOps.renew_leases, {held}, owner=self.owner, lease_seconds=lease
            )
            return sent, held in alive

        while not may_start_call(planner.lease_confirmed_at, time.monotonic(), lease):
            sent, alive = yield from retried("confirm_lease", renew)
            if not alive:
                raise LeaseLost(
                    f"the lease of saga {saga.id} at fence {saga.fence} may have ended before "
                    f"{describe(op)} was called, and it is no longer ours: not called"
                )
            _log.info("lease_confirmed_again", saga_id=saga.id, fence=saga.fence, step=op.step)
            planner.lease_confirmed_at = sent

    def abandoned_attempt(self, planner: Planner, op: OpRow) -> Flow[str | None]:
        """Wait, under the lease, for attempts of `op` abandoned at their timeout that still
        run in this process; the reason to park if one outlives the wait (a reconcile
        answer now could be overtaken by its effect)."""
        saga = planner.saga
        late = yield AwaitAbandoned(saga.id, op.step, op.kind, (saga.id, saga.fence))
        if not late:
            return None
        return f"outcome of {op.kind} {op.step!r} is unknown and not reconciled: " + (
            f"{late[0].describe()}; resolve it once it has ended"
        )
