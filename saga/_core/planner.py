"""The step protocol's decisions, free of I/O: what to write and what to call next.

The planner works on an in-memory snapshot of one saga (its row, its operation rows and
its confirmations: `saga._core.snapshot`). Each input changes the snapshot through it,
which notes every row changed and records audit events; `write` hands those changes
over as one `Write`, which the runner persists in one transaction, and the runner
carries out the returned move (`saga._core.moves`: call a step, ask a reconcile hook,
sleep, or stop). Keeping the decisions here lets a sync and an async runner share one
protocol. It reads no clock: every input carries the time it happened (`now`).

The planner is built in layers, each with one responsibility: `Snapshot` reads the rows
against the saga's definition and records what changed; `Outcomes`
(`saga._core.outcomes`) applies what became of an attempt; `Planner` decides the next
move. The checks before an attempt live beside it (`saga._core.ceilings`,
`saga._core.confirmations`), and an operator's requests in `saga._core.requests`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from saga._core import ceilings, confirmations
from saga._core.moves import (
    AskReconcile,
    Attempt,
    Hold,
    Invoke,
    Next,
    Prepare,
    Sleep,
    Stop,
    Yield,
)
from saga._core.outcomes import Outcomes
from saga._core.rows import (
    ConfirmationChange,
    ConfirmationRow,
    Event,
    OpRow,
    SagaRow,
    Write,
    describe,
)
from saga._core.snapshot import action_request_hash, compensation_request_hash, new_action_rows
from saga.definition import Compensation, OperationSpec, Saga
from saga.state import OperationStatus, SagaStatus

if TYPE_CHECKING:
    from saga.approvals import ApprovalVerifier

# The rows (`saga._core.rows`), the moves (`saga._core.moves`) and the rows' hashes
# (`saga._core.snapshot`) are named through this module too, as they were before they
# had modules of their own.
__all__ = [
    "AskReconcile",
    "Attempt",
    "ConfirmationChange",
    "ConfirmationRow",
    "Event",
    "Hold",
    "Invoke",
    "Next",
    "OpRow",
    "Planner",
    "Prepare",
    "SagaRow",
    "Sleep",
    "StartInSql",
    "Stop",
    "Write",
    "Yield",
    "action_request_hash",
    "compensation_request_hash",
    "new_action_rows",
    "starts_in_sql",
    "unknown_remedy",
]


class Planner(Outcomes):
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
        super().__init__(definition, saga, ops, confirmations, now=now)
        # The approvers' public key(s), as data: with it, an attempt a confirmation holds
        # back starts only when the approval stored with it verifies (`saga._core.confirmations`);
        # without it (HMAC approvals), the approved confirmation row is trusted.
        self.approval_verifier = approval_verifier
        self.may_call = True
        # The call a session's code makes now (the operation's step), None between calls:
        # the only operation a session runs (`_session_forward`). Set by the session for
        # the call, and by each input about one of its calls (`saga._core.inputs`).
        self.session_call: str | None = None
        # When the write that last confirmed this planner's lease was sent, on the
        # driver's monotonic clock (set by the flows; the core reads no clock). None: not
        # confirmed by this planner's writes, so it is confirmed again before a call.
        self.lease_confirmed_at: float | None = None
        for op in ops:
            if op.status == OperationStatus.PENDING and op.retrying_unknown:
                # Written by an earlier release, which reset an unknown operation to
                # pending before its retry started: what is known of it is still unknown.
                self.mark_unknown(op, f"outcome of attempt {op.attempts} is unknown")

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
        """A session runs the one call its code makes (`session_call`), and nothing
        else: a call that failed is the code's to handle, and the session ends when its
        block does, not when its calls run out."""
        call = self.session_call
        op = None if call is None else self.find(call, "action")
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
            self.changed(op)
        return self._start_or_wait(op)

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
        asked = verdict.asked
        if asked is not None:
            if not any(row is asked for row in self.confirmations):
                self.confirmations.append(asked)
            self.confirmation_asked(asked)
        if verdict.used is not None:
            self.confirmation_changed(verdict.used)
        if verdict.held:
            self.set_status(SagaStatus.AWAITING_CONFIRMATION)
            self.saga.error = verdict.error
        self.events.extend(verdict.events)
        return verdict.held


@dataclass(frozen=True, slots=True)
class StartInSql:
    """A step whose attempt the database may start as it claims a saga (saga.claim_batch_v2,
    migration 0026), where `Planner._start_or_wait` would start it with nothing to decide
    but the rows: `side_effect` counts the attempt as a side effect, `deadline_seconds`
    sets the operation's deadline when it has none yet."""

    step: str
    side_effect: bool
    deadline_seconds: float | None


def starts_in_sql(definition: Saga[Any]) -> tuple[StartInSql, ...]:
    """The steps of `definition` whose next attempt the planner starts from the rows alone:
    no prepare hook (the request is the input), no declared cost (its function is user
    code, its value a ceiling's business) and no confirmation rule. The rest of what
    `_start_or_wait` and `advance` check before it starts one (the saga runs forward with
    no saga-level ceiling and no confirmation; none of its operations running, unknown,
    failed or a compensation; the step is the first action not succeeded, pending, below
    its ceiling, out of its backoff, before its deadline) is in the rows, and the database
    checks it there; every other saga is claimed only, and planned here. A session's calls
    are its code's to make: none."""
    if definition.is_session:
        return ()
    return tuple(
        StartInSql(step.name, step.guards.side_effect, step.guards.deadline_seconds)
        for step in definition.steps
        if step.prepare_fn is None and step.guards.cost is None and step.guards.confirm is False
    )


def unknown_remedy(compensation: Compensation | None) -> str:
    """What settles a step of unknown outcome that compensation cannot go past: including
    unknown steps helps only when the step declares a compensation."""
    if compensation is None:
        return "it has no compensation, so resolve it (succeeded or failed) first"
    return "resolve it first, or compensate with include_unknown=True"
