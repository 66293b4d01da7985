"""The step protocol's decisions, free of I/O: what to write and what to call next.

The planner works on an in-memory snapshot of one saga (its row and its operation
rows, `saga._core.rows`). Each method mutates the snapshot, marks what changed and records
audit events; the runner persists those changes in one transaction and carries out the
returned `Next` (call a step, ask a reconcile hook, sleep, or stop). Keeping the
decisions here lets a sync and an async runner share one protocol. It reads no clock:
every input carries the time it happened (`now`). The checks before an attempt live
beside it (`saga._core.ceilings`, `saga._core.confirmations`), and an operator's requests in
`saga._core.requests`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Literal

from saga._core import ceilings, confirmations
from saga._core.rows import (
    ConfirmationChange,
    ConfirmationRow,
    Event,
    Kind,
    OpRow,
    SagaRow,
    Write,
    describe,
)
from saga.definition import Compensation, OperationSpec, Saga, Step
from saga.errors import StepStateError
from saga.keys import HASH_VERSION, canonical_json, operation_key, request_hash, same_request
from saga.state import OperationStatus, SagaStatus

if TYPE_CHECKING:
    from saga.approvals import ApprovalVerifier

# The rows (from `saga._core.rows`) are named through this module too, as they were before
# they had a module of their own.
__all__ = [
    "AskReconcile",
    "Attempt",
    "ConfirmationChange",
    "ConfirmationRow",
    "Event",
    "Invoke",
    "Next",
    "OpRow",
    "Planner",
    "Prepare",
    "SagaRow",
    "Sleep",
    "Stop",
    "Write",
    "Yield",
    "action_request_hash",
    "compensation_request_hash",
    "new_action_rows",
    "unknown_remedy",
]


@dataclass(frozen=True, slots=True)
class Attempt:
    """The call of an attempt, built by the planner as it starts the attempt: all the
    flow hands the driver beside the context's own fields (saga, step, key, attempt)."""

    # The step or compensation called: its function, codec, retry policy and timeout.
    spec: OperationSpec
    # What the function receives after the context: the input, and for a compensation
    # its step's result as the step returned it.
    arguments: tuple[Any, ...]
    # ctx.results: the results of the succeeded steps, as they returned them.
    results: dict[str, Any]
    # ctx.request: the prepared request, when the operation has a prepare hook.
    request: Any


@dataclass(frozen=True, slots=True)
class Invoke:
    """Call the operation's function; its attempt is already recorded as running. `call`
    is the call, or the error that kept it from being built (the attempt is then
    recorded as not called: nothing of it ran)."""

    op: OpRow
    call: Attempt | Exception = field(compare=False)


@dataclass(frozen=True, slots=True)
class AskReconcile:
    """Ask the operation's reconcile hook whether its unknown attempt happened."""

    op: OpRow


@dataclass(frozen=True, slots=True)
class Sleep:
    """Nothing can run before `until` (retry backoff)."""

    until: datetime


@dataclass(frozen=True, slots=True)
class Stop:
    """The saga is terminal or parked: give the lease back."""

    status: SagaStatus


@dataclass(frozen=True, slots=True)
class Prepare:
    """Call the operation's prepare function; its request is recorded before the attempt."""

    op: OpRow


@dataclass(frozen=True, slots=True)
class Yield:
    """Calls are not allowed now (the worker is shutting down): give the lease back."""


@dataclass(frozen=True, slots=True)
class Hold:
    """A session's call is settled, or none is asked for: its code goes on, and the
    session keeps its lease (see `saga.session`)."""


Next = Invoke | AskReconcile | Prepare | Sleep | Stop | Yield | Hold


def action_request_hash(step: str, business: dict[str, Any]) -> str:
    """Request hash of a step: its name and the saga input's business fields."""
    return request_hash({"kind": "action", "step": step, "input": business})


def compensation_request_hash(step: str, business: dict[str, Any], result: Any) -> str:
    """Request hash of a compensation: its step, the business input and the step's result."""
    return request_hash({"kind": "compensation", "step": step, "input": business, "result": result})


def new_action_rows(
    saga: Saga[Any], tenant: str, key: str, business: dict[str, Any]
) -> list[OpRow]:
    """The pending action rows created with a saga instance, one per step."""
    return [
        OpRow(
            step=step.name,
            kind="action",
            position=step.index,
            idempotency_key=operation_key(
                saga.name, saga.version, tenant, key, step.name, "action"
            ),
            request_hash=action_request_hash(step.name, business),
            status=OperationStatus.PENDING,
            attempts=0,
            max_attempts=step.retry.max_attempts,
            new=True,
        )
        for step in saga.steps
    ]


class Planner:
    """Decides the next move of one saga and records every transition as an event."""

    def __init__(
        self,
        definition: Saga[Any],
        saga: SagaRow,
        ops: list[OpRow],
        confirmations: list[ConfirmationRow] | None = None,
        *,
        now: datetime,
        approval_verifier: ApprovalVerifier | None = None,
    ) -> None:
        definition.adopt(ops)
        self.definition = definition
        self.saga = saga
        self.ops = ops
        self.confirmations = confirmations or []
        # The approvers' public key(s), as data: with it, an attempt a confirmation holds
        # back starts only when the approval stored with it verifies (`saga._core.confirmations`);
        # without it (HMAC approvals), the approved confirmation row is trusted.
        self.approval_verifier = approval_verifier
        # Operations whose request was prepared in this transaction, ready to start.
        self.prepared: set[tuple[str, str]] = set()
        self._input_model: Any = None
        self.events: list[Event] = []
        # The time of the input being applied: the core never reads a clock. Each input
        # (`advance`, `saga._core.inputs.apply`, an operator's change) carries its own.
        self.now = now
        self.may_call = True
        # When the write that last confirmed this planner's lease was sent, on the
        # driver's monotonic clock (set by the flows; the core reads no clock). None: not
        # confirmed by this planner's writes, so it is confirmed again before a call.
        self.lease_confirmed_at: float | None = None
        for op in ops:
            if op.status == OperationStatus.PENDING and op.retrying_unknown:
                # Written by an earlier release, which reset an unknown operation to
                # pending before its retry started: what is known of it is still unknown.
                self.mark_unknown(op, f"outcome of attempt {op.attempts} is unknown")

    # ----- reading the snapshot -------------------------------------------------------

    @property
    def actions(self) -> list[OpRow]:
        """Action rows in step order."""
        return sorted((o for o in self.ops if o.kind == "action"), key=lambda o: o.position)

    def find(self, step: str, kind: Kind) -> OpRow | None:
        """The row of (step, kind), or None."""
        return next((o for o in self.ops if o.step == step and o.kind == kind), None)

    def op(self, step: str, kind: str) -> OpRow:
        """The row of (step, kind); `KeyError` when there is none."""
        row = next((o for o in self.ops if o.step == step and o.kind == kind), None)
        if row is not None:
            return row
        raise KeyError(f"saga {self.saga.id} has no {kind} operation for step {step!r}")

    def step_of(self, op: OpRow) -> Step:
        """The declared step an operation row belongs to."""
        step = self.definition.step_named(op.step)
        if step is None:
            raise StepStateError(
                f"saga {self.saga.name!r} v{self.saga.version} has no step {op.step!r}; "
                "was the definition changed without bumping its version?"
            )
        return step

    def compensation_of(self, op: OpRow) -> Compensation | None:
        """The declared compensation of an operation's step, or None."""
        return self.step_of(op).compensation_op

    def is_idempotent(self, op: OpRow) -> bool:
        """Whether the operation was declared safe to retry with the same key."""
        spec = self.declared(op)
        return spec is not None and spec.idempotent

    def reconcile_fn(self, op: OpRow) -> Any:
        """The reconcile hook of an operation, or None."""
        spec = self.declared(op)
        return spec.reconcile_fn if spec is not None else None

    def spec_of(self, op: OpRow) -> OperationSpec:
        """The declared step or compensation an operation row runs."""
        spec = self.declared(op)
        if spec is None:
            raise StepStateError(f"step {op.step!r} has no compensation declared")
        return spec

    def declared(self, op: OpRow) -> OperationSpec | None:
        """The declared step or compensation an operation row runs; None for the
        compensation of a step that declares none."""
        return self.step_of(op) if op.kind == "action" else self.compensation_of(op)

    def input_model(self) -> Any:
        """The saga input, validated into its model (once per snapshot)."""
        if self._input_model is None:
            self._input_model = self.definition.validate_input(self.saga.input)
        return self._input_model

    def arguments(self, op: OpRow) -> tuple[Any, ...]:
        """What the operation's functions receive after the context: the input, and for a
        compensation its step's result as the step returned it."""
        if op.kind == "action":
            return (self.input_model(),)
        action = self.find(op.step, "action")
        stored = (
            action.result
            if action is not None and action.status == OperationStatus.SUCCEEDED
            else None
        )
        return (self.input_model(), self.step_of(op).codec.decode(stored))

    def request_of(self, op: OpRow) -> Any:
        """The request an attempt acts on: the prepared request, else the saga input."""
        spec = self.spec_of(op)
        if spec.request_codec is not None and op.request is not None:
            return spec.request_codec.decode(op.request)
        return self.input_model()

    def results(self) -> dict[str, Any]:
        """Results of succeeded steps by name, rebuilt as the steps returned them."""
        return {
            o.step: self.step_of(o).codec.decode(o.result)
            for o in self.actions
            if o.status == OperationStatus.SUCCEEDED
        }

    def blocking_operation(self) -> OpRow | None:
        """The operation a parked saga stopped at, in its current direction, or None."""
        if self.saga.direction == "forward":
            return next((o for o in self.actions if o.status != OperationStatus.SUCCEEDED), None)
        for act in reversed(self.actions):
            comp = self.find(act.step, "compensation")
            if comp is not None and comp.status != OperationStatus.SUCCEEDED:
                return comp
            if comp is None and act.status in (OperationStatus.UNKNOWN, OperationStatus.RUNNING):
                return act
        return None

    def succeeded_pivot(self, before: OpRow | None = None) -> str | None:
        """The first pivot step that succeeded (before the step of `before`, if given)."""
        for op in self.actions:
            if before is not None and op.position >= before.position:
                return None
            if op.status == OperationStatus.SUCCEEDED and self.step_of(op).pivot:
                return op.step
        return None

    # ----- the decision loop ----------------------------------------------------------

    def advance(self, now: datetime | None = None, *, may_call: bool = True) -> Next:
        """Apply every transition that needs no call, then say what to do next.

        With `may_call=False` nothing new is started: where a call or a wait would
        come next, `Yield` is returned instead and the saga stays as it is. `now` is the
        time of the decision (None: the time of the last input).
        """
        if now is not None:
            self.now = now
        self.may_call = may_call
        for op in self.ops:
            if op.status == OperationStatus.RUNNING:
                # Only a previous owner's attempt can still be running when we decide.
                self.mark_unknown(op, f"attempt {op.attempts} was running when its lease expired")
                uncounted = self._count_unknown_spend(op)
                if uncounted is not None:
                    self.park(uncounted)
        while True:
            status = self.saga.status
            if not status.is_runnable:
                return Stop(status)
            if status == SagaStatus.PENDING:
                self.set_status(SagaStatus.RUNNING)
            nxt = self._forward() if self.saga.direction == "forward" else self._backward()
            if nxt is not None:
                return nxt

    def _forward(self) -> Next | None:
        if self.definition.is_session:
            return self._session_forward()
        for op in self.actions:
            if op.status == OperationStatus.SUCCEEDED:
                continue
            if op.status == OperationStatus.UNKNOWN:
                return self._settle_unknown(op)
            if op.status == OperationStatus.FAILED:
                pivot = self.succeeded_pivot(op)
                if pivot is not None:
                    self.park(
                        f"step {op.step!r} failed after pivot step {pivot!r} succeeded; "
                        f"not compensating: {op.error}"
                    )
                else:
                    self.begin_compensation(f"step {op.step!r} failed: {op.error}")
                return None
            return self._start_or_wait(op)
        self.finish(SagaStatus.COMPLETED)
        return None

    def _session_forward(self) -> Next | None:
        """A session runs the one call its code asks for (`definition.focus`), and
        nothing else: a call that failed is the code's to handle, and the session ends
        when its block does, not when its calls run out."""
        focus = self.definition.focus
        op = None if focus is None else self.find(focus, "action")
        if op is None or op.status in (OperationStatus.SUCCEEDED, OperationStatus.FAILED):
            return Hold()
        if op.status == OperationStatus.UNKNOWN:
            return self._settle_unknown(op)
        return self._start_or_wait(op)

    def _backward(self) -> Next | None:
        for act in reversed(self.actions):
            comp_def = self.compensation_of(act)
            comp = self.find(act.step, "compensation")
            undo = act.status == OperationStatus.SUCCEEDED or (
                act.status == OperationStatus.UNKNOWN and comp is not None
            )
            if undo:
                if comp_def is None:
                    continue
                if comp is None:
                    comp = self.add_compensation(act)
                if comp.status == OperationStatus.SUCCEEDED:
                    continue
                if comp.status == OperationStatus.UNKNOWN:
                    return self._settle_unknown(comp)
                if comp.status == OperationStatus.FAILED:
                    self.park(f"compensation of step {act.step!r} failed: {comp.error}")
                    return None
                return self._start_or_wait(comp)
            if act.status == OperationStatus.UNKNOWN:
                self.park(
                    f"cannot compensate past step {act.step!r}: its outcome is unknown; "
                    + unknown_remedy(comp_def)
                )
                return None
            # pending or failed: the step had no effect, there is nothing to undo.
        self.finish(SagaStatus.COMPENSATED)
        return None

    def _start_or_wait(self, op: OpRow) -> Next | None:
        if op.attempts >= op.max_attempts and op.retrying_unknown:
            self._park_unknown(op, f"its ceiling of {op.max_attempts} attempts is reached")
            return None
        if op.attempts >= op.max_attempts:
            self.touch(op, status=OperationStatus.FAILED)
            op.error = f"ceiling of {op.max_attempts} attempts reached; {op.error or ''}".rstrip(
                "; "
            )
            return None
        if op.deadline_at is not None and self.now >= op.deadline_at:
            self._deadline_passed(op)
            return None
        if not self.may_call:
            return Yield()
        if op.next_attempt_at is not None and op.next_attempt_at > self.now:
            return Sleep(op.next_attempt_at)
        spec = self.spec_of(op)
        if spec.prepare_fn is not None and (op.step, op.kind) not in self.prepared:
            return Prepare(op)
        cost, unusable = ceilings.declared_cost(op, spec, lambda: self.arguments(op))
        if unusable is not None:
            self.park(unusable)
            return None
        breach = ceilings.ceiling_breach(self.saga, self.now, op, spec, cost)
        if breach is not None:
            self.park(breach["reason"], ceiling=breach)
            return None
        if self._held_back(op, spec, cost):
            return None
        self.prepared.discard((op.step, op.kind))
        if op.status == OperationStatus.UNKNOWN:
            # Only now, as the retry starts, does the operation stop being unknown.
            self.event("unknown_retried", op, reason="idempotent: retrying with the same key")
        op.attempts += 1
        self.touch(op, status=OperationStatus.RUNNING)
        op.next_attempt_at = None
        op.started_at = self.now
        op.finished_at = None
        op.cost = cost
        if op.deadline_at is None and spec.guards.deadline_seconds is not None:
            op.deadline_at = self.now + timedelta(seconds=spec.guards.deadline_seconds)
        self.saga.operations_executed += 1
        self.saga.side_effects += 1 if spec.guards.side_effect else 0
        self.saga.spent += cost or 0.0
        self.event("attempt_started", op)
        return self.invoke(op)

    def invoke(self, op: OpRow) -> Invoke:
        """The move that calls `op`'s attempt, recorded as running: with its call built
        here, so that the caller asks nothing more of the planner (or with the error that
        kept the call from being built)."""
        try:
            spec = self.spec_of(op)
            results = self.results()
            request = self.request_of(op) if spec.prepare_fn else None
            call = Attempt(spec, self.arguments(op), results, request)
        except Exception as exc:
            return Invoke(op, exc)
        return Invoke(op, call)

    def _deadline_passed(self, op: OpRow) -> None:
        reason = f"deadline of {describe(op)} passed at {op.deadline_at:%Y-%m-%d %H:%M:%S%z}"
        if op.retrying_unknown:
            # The last attempt may have had its effect: never turn that into a failure.
            self.park(f"{reason}; the outcome of attempt {op.attempts} is unknown; resolve it")
            return
        self.touch(op, status=OperationStatus.FAILED)
        op.error = f"{reason}; last error: {op.error}" if op.error else reason
        self.event("deadline_passed", op, deadline_at=str(op.deadline_at))

    def business_input(self) -> dict[str, Any]:
        """The saga input's business fields: what request hashes are computed from."""
        return {k: v for k, v in self.saga.input.items() if k not in self.definition.volatile}

    def _settle_unknown(self, op: OpRow) -> Next | None:
        if self.reconcile_fn(op) is not None:
            if not self.may_call:
                return Yield()
            if op.next_attempt_at is not None and op.next_attempt_at > self.now:
                return Sleep(op.next_attempt_at)  # asking again after the provider's lag
            return AskReconcile(op)
        because = f" ({op.error})" if op.error else ""
        if not self.is_idempotent(op):
            self.park(
                f"outcome of {describe(op)} attempt {op.attempts} is unknown and it is neither "
                f"idempotent nor has a reconcile hook; resolve it{because}"
            )
            return None
        if op.attempts >= op.max_attempts:
            self.park(
                f"outcome of {describe(op)} attempt {op.attempts} is unknown and its ceiling of "
                f"{op.max_attempts} attempts is reached; resolve it{because}"
            )
            return None
        # The operation stays unknown until its retry starts: a retry that is blocked (a
        # ceiling, a confirmation, a shutdown) leaves it unknown, to be undone as such.
        if not op.retrying_unknown:
            op.retrying_unknown = True
            op.dirty = True
        return self._start_or_wait(op)

    def _park_unknown(self, op: OpRow, why: str) -> None:
        """Park an operation one of whose attempts has an unknown outcome: `why` says why
        it cannot be retried; only a success, a reconcile answer or an operator settles it."""
        self.touch(op, status=OperationStatus.UNKNOWN)
        self.park(
            f"{describe(op)} cannot be retried ({why}) and an earlier attempt's outcome "
            "is unknown: its effect may be in place; resolve it"
        )

    # ----- outcomes reported by the runner --------------------------------------------

    def record_success(
        self, op: OpRow, result: Any, *, provider_reference: str | None = None
    ) -> None:
        """The attempt returned `result` (already encoded as JSON)."""
        ceilings.count_spend(self.saga, op, op.attempt_spend)
        self._succeed(op, result, provider_reference)
        self.event("attempt_succeeded", op)

    def record_failure(self, op: OpRow, error: str, *, retryable: bool, delay: float) -> None:
        """The attempt raised; retry after `delay` seconds if allowed, else fail the operation."""
        ceilings.count_spend(self.saga, op, op.attempt_spend)
        op.error = error
        op.finished_at = self.now
        if (
            retryable
            and op.deadline_at is not None
            and self.now + timedelta(seconds=delay) >= op.deadline_at
        ):
            retryable = False
            error = f"{error} (not retried: the deadline of {describe(op)} would pass first)"
            op.error = error
        if retryable and op.attempts < op.max_attempts:
            # After an unknown attempt, a failed retry settles nothing: still unknown.
            status = OperationStatus.UNKNOWN if op.retrying_unknown else OperationStatus.PENDING
            self.touch(op, status=status)
            op.next_attempt_at = self.now + timedelta(seconds=delay)
            self.event(
                "attempt_failed", op, error=error, retryable=True, retry_in_seconds=round(delay, 3)
            )
            return
        if op.retrying_unknown:
            # "An unknown outcome never turns into failed", whatever later attempts say.
            self.event(
                "attempt_failed", op, error=error, retryable=retryable, retry_in_seconds=None
            )
            why = (
                f"attempt {op.attempts} failed at its ceiling of {op.max_attempts} attempts: "
                f"{error}"
                if retryable
                else f"attempt {op.attempts} failed: {error}"
            )
            self._park_unknown(op, why)
            return
        self.touch(op, status=OperationStatus.FAILED)
        if retryable:
            op.error = f"ceiling of {op.max_attempts} attempts reached; last error: {error}"
        self.event("attempt_failed", op, error=op.error, retryable=retryable, retry_in_seconds=None)

    def record_unknown(
        self,
        op: OpRow,
        reason: str,
        *,
        park: bool,
        traceback: str | None = None,
        spend_known: bool = False,
        retry_after: float = 0.0,
    ) -> None:
        """The attempt's outcome cannot be known (or stored); park the saga if asked.

        `retry_after`: seconds before the outcome is settled by a reconcile hook or a
        same-key retry (the backoff after an ambiguous error), for an operation that has
        either.

        `traceback` (of an unclassified exception) is kept in the audit event. Whether the
        effect happened is unknown, and so is what it spent: the attempt is counted at the
        worst case it declared, unless `spend_known` (it returned, and only its result
        cannot be stored: what it reported is what it spent).
        """
        if spend_known:
            ceilings.count_spend(self.saga, op, op.attempt_spend)
            uncounted = None
        else:
            uncounted = self._count_unknown_spend(op)
        if uncounted is not None and not park:
            park, reason = True, f"{reason}; {uncounted}"
        op.finished_at = self.now
        if op.status == OperationStatus.UNKNOWN:
            # Already unknown (a reconcile answer that cannot be stored): say why it stays so.
            op.error, op.dirty = reason, True
            self.event("outcome_unknown", op, reason=reason)
        self.mark_unknown(op, reason, traceback=traceback)
        if retry_after > 0 and (self.reconcile_fn(op) is not None or self.is_idempotent(op)):
            op.next_attempt_at = self.now + timedelta(seconds=retry_after)
        if park:
            self.park(reason)

    def record_not_called(self, op: OpRow, reason: str) -> None:
        """The orchestrator's own machinery failed before any of the operation's code ran
        (`reason` names its error): the attempt was never made, so it has no outcome, and
        the error is no verdict on the step; nothing is compensated. An attempt recorded
        as running goes back to what it was before (pending, or unknown while an earlier
        attempt's outcome is); it stays counted (its number, its declared cost, the
        ceilings), as an attempt whose prepare raised does. The saga parks with the reason
        for a human to fix the cause and retry."""
        if op.status == OperationStatus.RUNNING:
            back = OperationStatus.UNKNOWN if op.retrying_unknown else OperationStatus.PENDING
            self.touch(op, status=back)
            op.finished_at = self.now
        op.error = reason
        op.next_attempt_at = None
        op.dirty = True
        self.event("attempt_not_called", op, reason=reason)
        self.park(f"{reason}; fix the cause, then retry")

    def record_found(self, op: OpRow, result: Any, provider_reference: str | None) -> None:
        """Reconcile: the provider performed the effect."""
        self.event("reconcile_found", op, provider_reference=provider_reference)
        self._succeed(op, result, provider_reference)
        self._settled_reconcile(op)

    def _succeed(self, op: OpRow, result: Any, provider_reference: str | None) -> None:
        self.touch(op, status=OperationStatus.SUCCEEDED)
        op.result = result
        op.error = None
        op.provider_reference = provider_reference
        op.finished_at = self.now
        op.retrying_unknown = False

    def record_absent(self, op: OpRow, *, settled: bool = True) -> None:
        """Reconcile: nothing happened under this key, so a retry with it is safe.

        An unsettled answer (the provider's reads may lag) counts as inconclusive.
        """
        if not settled:
            self._ask_again_or_park(
                op, "reconcile_absent", "the provider reports nothing yet, but may lag"
            )
            return
        self.event("reconcile_absent", op, settled=True)
        self._settled_reconcile(op)
        op.retrying_unknown = False
        if op.attempts < op.max_attempts:
            self.touch(op, status=OperationStatus.PENDING)
            op.next_attempt_at = None
            return
        self.touch(op, status=OperationStatus.FAILED)
        op.error = (
            f"ceiling of {op.max_attempts} attempts reached; the provider confirmed the last "
            "attempt had no effect"
        )

    def record_inconclusive(self, op: OpRow, reason: str) -> None:
        """Reconcile could not tell: ask again within the step's window, then park."""
        self._ask_again_or_park(op, "reconcile_inconclusive", reason)

    def _ask_again_or_park(self, op: OpRow, event: str, reason: str) -> None:
        spec = self.spec_of(op)
        if op.reconcile_started_at is None:
            op.reconcile_started_at = self.now
        op.reconcile_asks += 1
        op.dirty = True
        window_ends = op.reconcile_started_at + timedelta(seconds=spec.reconcile_window_seconds)
        delay = spec.reconcile_retry.delay_after(op.reconcile_asks)
        if self.now + timedelta(seconds=delay) < window_ends:
            op.next_attempt_at = self.now + timedelta(seconds=delay)
            self.event(
                event,
                op,
                reason=reason,
                settled=False,
                ask=op.reconcile_asks,
                ask_again_in_seconds=round(delay, 3),
            )
            return
        self.event(event, op, reason=reason, settled=False, ask=op.reconcile_asks)
        waited = (self.now - op.reconcile_started_at).total_seconds()
        self.park(
            f"outcome of {describe(op)} attempt {op.attempts} is unknown: {reason} "
            f"(asked {op.reconcile_asks} times over {waited:.1f}s)"
        )

    def _settled_reconcile(self, op: OpRow) -> None:
        op.reconcile_started_at = None
        op.reconcile_asks = 0
        op.next_attempt_at = None

    def record_request(self, op: OpRow, request: Any) -> None:
        """The prepare function computed `request` (JSON) for the next attempt of `op`.

        A request that differs from the one persisted while an earlier attempt's
        outcome is unknown is not acted on: the saga parks naming both requests.
        """
        fields = {"kind": op.kind, "step": op.step, "request": request}
        if op.request is not None and same_request(
            op.request_hash, fields, version=op.hash_version
        ):
            # The same request (compared under the version the stored hash was computed
            # under): its hash stays as stored.
            new_hash = op.request_hash
        else:
            new_hash = request_hash(fields)
        if op.request is not None and new_hash != op.request_hash and op.retrying_unknown:
            self.event(
                "request_changed",
                op,
                previous=op.request,
                current=request,
                previous_hash=op.request_hash,
                current_hash=new_hash,
            )
            self.park(
                f"request of {describe(op)} changed while attempt {op.attempts}'s outcome is "
                f"unknown: it was {canonical_json(op.request)} ({op.request_hash[:12]}), it is "
                f"now {canonical_json(request)} ({new_hash[:12]}); not acting on either"
            )
            return
        if op.request is None or new_hash != op.request_hash:
            self.event("request_prepared", op, request_hash=new_hash)
            op.hash_version = HASH_VERSION
        op.request, op.request_hash = request, new_hash
        op.dirty = True
        self.prepared.add((op.step, op.kind))

    def record_prepare_failure(
        self,
        op: OpRow,
        error: str,
        *,
        retryable: bool,
        delay: float,
        park: bool = False,
        traceback: str | None = None,
    ) -> None:
        """The prepare function raised: that counts as an attempt that had no effect.

        Nothing was called, so its outcome is never unknown. With `park` (an exception
        neither `PermanentError`, nor in `fail_on` or `retry_on`: a bug, most likely) the
        operation is not failed either, which would start compensation: the saga parks
        with the attempt counted, for a human to retry, resolve or compensate.
        """
        op.attempts += 1
        error = f"prepare failed: {error}"
        if not park:
            self.record_failure(op, error, retryable=retryable, delay=delay)
            return
        op.error = error
        op.finished_at = self.now
        op.next_attempt_at = None
        op.dirty = True
        detail: dict[str, Any] = {"error": error, "retryable": False, "retry_in_seconds": None}
        if traceback is not None:
            detail["traceback"] = traceback
        self.event("attempt_failed", op, **detail, parked=True)
        self.park(
            f"prepare of {describe(op)} raised {error.removeprefix('prepare failed: ')}; "
            "nothing was called; fix it, then retry, resolve or compensate"
        )

    # ----- transitions ----------------------------------------------------------------

    def park(self, reason: str, *, ceiling: dict[str, Any] | None = None) -> None:
        """Stop in needs_review with the reason recorded; a human decides what comes next."""
        self.set_status(SagaStatus.NEEDS_REVIEW)
        self.saga.error = reason
        detail: dict[str, Any] = {"reason": reason}
        if ceiling is not None:
            detail["ceiling"] = {k: v for k, v in ceiling.items() if k != "reason"}
        self.events.append(Event("saga_parked", detail=detail))

    def begin_compensation(self, reason: str) -> None:
        """Turn backward: compensate what succeeded, in reverse, for `reason`."""
        self.saga.direction = "backward"
        self.set_status(SagaStatus.COMPENSATING)
        self.saga.error = reason
        self.events.append(Event("compensation_started", detail={"reason": reason}))

    def finish(self, status: SagaStatus) -> None:
        """End the saga in a terminal `status` (completed or compensated)."""
        self.set_status(status)
        if status == SagaStatus.COMPLETED:
            self.saga.error = None
        self.events.append(Event(f"saga_{status.value}"))

    def mark_unknown(self, op: OpRow, reason: str, *, traceback: str | None = None) -> None:
        """Record that whether the last attempt of `op` took effect is unknown (once:
        an operation already unknown is left as it is)."""
        if op.status == OperationStatus.UNKNOWN:
            return
        self.touch(op, status=OperationStatus.UNKNOWN)
        op.error = reason
        if traceback is None:
            self.event("outcome_unknown", op, reason=reason)
        else:
            self.event("outcome_unknown", op, reason=reason, traceback=traceback)

    def compensation_key(self, step: str) -> str:
        """The idempotency key of the compensation of `step`."""
        saga = self.saga
        return operation_key(
            saga.name, saga.version, saga.tenant_id, saga.key, step, "compensation"
        )

    def add_compensation(self, act: OpRow) -> OpRow:
        """Create the pending compensation row of action `act`, whose step declares one."""
        comp_def = self.compensation_of(act)
        assert comp_def is not None
        comp = OpRow(
            step=act.step,
            kind="compensation",
            position=act.position,
            idempotency_key=self.compensation_key(act.step),
            request_hash=compensation_request_hash(act.step, self.business_input(), act.result),
            status=OperationStatus.PENDING,
            attempts=0,
            max_attempts=comp_def.retry.max_attempts,
            new=True,
        )
        self.ops.append(comp)
        return comp

    def set_status(self, status: SagaStatus) -> None:
        """Set the saga's status."""
        self.saga.status = status

    def touch(self, op: OpRow, *, status: OperationStatus) -> None:
        """Set the status of `op` and mark the row changed."""
        op.status = status
        op.dirty = True

    def _held_back(self, op: OpRow, spec: OperationSpec, cost: float | None) -> bool:
        """Apply the confirmation check before an attempt (`confirmations.holds_back`):
        its events, the confirmation it asks for, and the wait; whether it holds back."""
        gate = confirmations.Gate(
            self.saga,
            self.ops,
            self.confirmations,
            self.now,
            self.approval_verifier,
            request=lambda: self.request_of(op),
            given=self.input_model,
        )
        verdict = confirmations.holds_back(gate, op, spec, cost)
        if verdict.asked is not None:
            self.confirmations.append(verdict.asked)
        if verdict.held:
            self.set_status(SagaStatus.AWAITING_CONFIRMATION)
            self.saga.error = verdict.error
        self.events.extend(verdict.events)
        return verdict.held

    def _count_unknown_spend(self, op: OpRow) -> str | None:
        """Count the spend of `op`'s attempt of unknown outcome (`ceilings.count_unknown_spend`);
        why the saga must park instead, or None."""
        if ceilings.unknown_spend_counted(op):
            return None
        return ceilings.count_unknown_spend(self.saga, op, self.declared(op))

    def event(self, name: str, op: OpRow, **detail: Any) -> None:
        """Record audit event `name` about `op` (and its current attempt)."""
        self.events.append(Event(name, op.step, op.kind, op.attempts or None, detail))

    def write(self, nxt: Next | None, *, owner: str | None, max_inline_sleep: float = 0.0) -> Write:
        """The write of everything decided since the last one, and what becomes of the
        lease given the next move `nxt`; the rows handed over are marked written.

        For the lease holder (`owner`): a stop or a shutdown gives the lease back (a
        shutdown with the saga runnable at once, and workers told); a backoff persists
        its end as run_after and keeps the lease when it is no longer than
        `max_inline_sleep` seconds (waited out under the heartbeat), else gives it back.
        `owner=None` is an operator's change under the row lock: the lease ends, and
        workers are told when the saga is runnable."""
        saga = self.saga
        if owner is None:
            release, notify = True, saga.status.is_runnable
        else:
            release, notify = isinstance(nxt, Stop | Yield), isinstance(nxt, Yield)
            if isinstance(nxt, Sleep):
                saga.run_after = nxt.until
                if (nxt.until - self.now).total_seconds() > max_inline_sleep:
                    release = True
                    self.events.append(
                        Event("lease_released", detail={"owner": owner, "reason": "backoff"})
                    )
                # Otherwise the lease is kept through the backoff, renewed by the heartbeat
                # while the driver waits (a lease is a liveness signal, never stretched).
            elif isinstance(nxt, Yield):
                saga.run_after = self.now
                self.events.append(
                    Event("lease_released", detail={"owner": owner, "reason": "shutdown"})
                )
            elif isinstance(nxt, Stop):
                self.events.append(Event("lease_released", detail={"owner": owner}))
        new = tuple(op for op in self.ops if op.new)
        changed = tuple(op for op in self.ops if op.dirty and not op.new)
        for op in (*new, *changed):
            op.new = op.dirty = False
        changes: list[ConfirmationChange] = []
        for row in self.confirmations:
            if row.new:
                changes.append(ConfirmationChange("ask", row))
            elif row.dirty:
                action: Literal["approve", "consume"] = (
                    "consume" if row.consumed_attempt is not None else "approve"
                )
                changes.append(ConfirmationChange(action, row))
            row.new = row.dirty = False
        return Write(
            saga=saga,
            new_ops=new,
            changed_ops=changed,
            confirmations=tuple(changes),
            events=tuple(self.take_events()),
            release=release,
            notify=notify,
            return_state=release,
        )

    def take_events(self) -> list[Event]:
        """Events produced since the last call (the runner persists and logs them)."""
        events, self.events = self.events, []
        return events


def unknown_remedy(compensation: Compensation | None) -> str:
    """What settles a step of unknown outcome that compensation cannot go past: including
    unknown steps helps only when the step declares a compensation."""
    if compensation is None:
        return "it has no compensation, so resolve it (succeeded or failed) first"
    return "resolve it first, or compensate with include_unknown=True"
