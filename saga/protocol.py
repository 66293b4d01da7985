"""The step protocol's decisions, free of I/O: what to write and what to call next.

The planner works on an in-memory snapshot of one saga (its row and its operation
rows). Each method mutates the snapshot, marks what changed and records audit
events; the runner persists those changes in one transaction and carries out the
returned `Next` (call a step, ask a reconcile hook, sleep, or stop). Keeping the
decisions here lets a sync and an async runner share one protocol. It reads no clock:
every input carries the time it happened (`now`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal

from saga.amounts import finite_amount
from saga.approvals import preview_hash
from saga.definition import Compensation, OperationSpec, Saga, Step
from saga.errors import StepStateError
from saga.keys import canonical_json, operation_key, request_hash
from saga.state import OperationKind, OperationStatus, SagaState, SagaStatus

Direction = Literal["forward", "backward"]
Kind = OperationKind


@dataclass(slots=True)
class OpRow:
    """In-memory mirror of one row of saga.operations."""

    step: str
    kind: Kind
    position: int
    idempotency_key: str
    request_hash: str
    status: OperationStatus
    attempts: int
    max_attempts: int
    next_attempt_at: datetime | None = None
    result: Any = None
    provider_reference: str | None = None
    error: str | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    request: Any = None
    deadline_at: datetime | None = None
    cost: float | None = None
    reconcile_started_at: datetime | None = None
    reconcile_asks: int = 0
    retrying_unknown: bool = False
    # Spend reported with ctx.spend(): counted over all attempts, reported by the attempt
    # in flight and not yet counted, and the most one attempt has reported (migration 0011).
    spent: float = 0.0
    attempt_spend: float = 0.0
    peak_spend: float = 0.0
    new: bool = False
    dirty: bool = False


@dataclass(slots=True)
class SagaRow:
    """In-memory mirror of one row of saga.sagas."""

    id: str
    name: str
    version: int
    tenant_id: str
    key: str
    input: dict[str, Any]
    input_hash: str
    status: SagaStatus
    error: str | None
    direction: Direction
    fence: int
    run_after: datetime | None
    lease_owner: str | None = None
    lease_expires_at: datetime | None = None
    created_at: datetime | None = None
    updated_at: datetime | None = None
    max_operations: int | None = None
    operations_executed: int = 0
    deadline_at: datetime | None = None
    spend_budget: float | None = None
    spent: float = 0.0
    max_side_effects: int | None = None
    side_effects: int = 0


@dataclass(slots=True)
class ConfirmationRow:
    """In-memory mirror of one row of saga.confirmations."""

    step: str
    request_hash: str
    preview: dict[str, Any]
    expires_at: datetime
    approved_by: str | None = None
    approved_at: datetime | None = None
    # The attempt this confirmation's approval released (used it up), or None.
    consumed_attempt: int | None = None
    new: bool = False
    dirty: bool = False


@dataclass(frozen=True, slots=True)
class Event:
    """An audit event produced by a decision, persisted in the same transaction."""

    event: str
    step: str | None = None
    kind: Kind | None = None
    attempt: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ConfirmationChange:
    """A confirmation to write: asked for (`ask`), approved (`approve`), or used up by
    the attempt it releases (`consume`, refused by the database when that approval has
    released an attempt already)."""

    action: Literal["ask", "approve", "consume"]
    row: ConfirmationRow


@dataclass(frozen=True, slots=True)
class Write:
    """Everything one transaction writes for a saga, as the core decided it: the saga's
    columns, the operations created and changed, the confirmations, the audit events,
    and what becomes of the lease (`release`: it ends with this write; otherwise the
    write renews it). `notify` wakes workers (the saga is runnable by anyone now), and
    `return_state` reads the saga's state back in the same statement."""

    saga: SagaRow
    new_ops: tuple[OpRow, ...]
    changed_ops: tuple[OpRow, ...]
    confirmations: tuple[ConfirmationChange, ...]
    events: tuple[Event, ...]
    release: bool
    notify: bool
    return_state: bool


@dataclass(frozen=True, slots=True)
class Invoke:
    """Call the operation's function; its attempt is already recorded as running."""

    op: OpRow


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


Next = Invoke | AskReconcile | Prepare | Sleep | Stop | Yield


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
    ) -> None:
        self.definition = definition
        self.saga = saga
        self.ops = ops
        self.confirmations = confirmations or []
        # Operations whose request was prepared in this transaction, ready to start.
        self.prepared: set[tuple[str, str]] = set()
        self._input_model: Any = None
        self.events: list[Event] = []
        # The time of the input being applied: the core never reads a clock. Each input
        # (`advance`, `saga.inputs.apply`, an operator's change) carries its own.
        self.now = now
        self.may_call = True
        # Set by the runner when it hands the saga back: the state its last commit left.
        self.final_state: SagaState | None = None
        for op in ops:
            if op.status == OperationStatus.PENDING and op.retrying_unknown:
                # Written by an earlier release, which reset an unknown operation to
                # pending before its retry started: what is known of it is still unknown.
                self._mark_unknown(op, f"outcome of attempt {op.attempts} is unknown")

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
        spec = self._declared(op)
        return spec is not None and spec.idempotent

    def reconcile_fn(self, op: OpRow) -> Any:
        """The reconcile hook of an operation, or None."""
        spec = self._declared(op)
        return spec.reconcile_fn if spec is not None else None

    def spec_of(self, op: OpRow) -> OperationSpec:
        """The declared step or compensation an operation row runs."""
        spec = self._declared(op)
        if spec is None:
            raise StepStateError(f"step {op.step!r} has no compensation declared")
        return spec

    def _declared(self, op: OpRow) -> OperationSpec | None:
        # The step itself for an action; its compensation, if declared, for the other kind.
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
                self._mark_unknown(op, f"attempt {op.attempts} was running when its lease expired")
                uncounted = self._count_unknown_spend(op)
                if uncounted is not None:
                    self.park(uncounted)
        while True:
            status = self.saga.status
            if not status.is_runnable:
                return Stop(status)
            if status == SagaStatus.PENDING:
                self._set_status(SagaStatus.RUNNING)
            nxt = self._forward() if self.saga.direction == "forward" else self._backward()
            if nxt is not None:
                return nxt

    def _forward(self) -> Next | None:
        for op in self.actions:
            if op.status == OperationStatus.SUCCEEDED:
                continue
            if op.status == OperationStatus.UNKNOWN:
                return self._settle_unknown(op)
            if op.status == OperationStatus.FAILED:
                pivot = self._succeeded_pivot(op)
                if pivot is not None:
                    self.park(
                        f"step {op.step!r} failed after pivot step {pivot!r} succeeded; "
                        f"not compensating: {op.error}"
                    )
                else:
                    self._begin_compensation(f"step {op.step!r} failed: {op.error}")
                return None
            return self._start_or_wait(op)
        self._finish(SagaStatus.COMPLETED)
        return None

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
                    comp = self._add_compensation(act)
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
                    + _unknown_remedy(comp_def)
                )
                return None
            # pending or failed: the step had no effect, there is nothing to undo.
        self._finish(SagaStatus.COMPENSATED)
        return None

    def _start_or_wait(self, op: OpRow) -> Next | None:
        if op.attempts >= op.max_attempts and op.retrying_unknown:
            self._park_unknown(op, f"its ceiling of {op.max_attempts} attempts is reached")
            return None
        if op.attempts >= op.max_attempts:
            self._touch(op, status=OperationStatus.FAILED)
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
        cost, unusable = self._cost(op, spec)
        if unusable is not None:
            self.park(unusable)
            return None
        breach = self._ceiling_breach(op, spec, cost)
        if breach is not None:
            self.park(breach["reason"], ceiling=breach)
            return None
        if self._needs_confirmation(op, spec) and not self._use_approval(op, spec, cost):
            self._await_confirmation(op, spec, cost)
            return None
        self.prepared.discard((op.step, op.kind))
        if op.status == OperationStatus.UNKNOWN:
            # Only now, as the retry starts, does the operation stop being unknown.
            self._event("unknown_retried", op, reason="idempotent: retrying with the same key")
        op.attempts += 1
        self._touch(op, status=OperationStatus.RUNNING)
        op.next_attempt_at = None
        op.started_at = self.now
        op.finished_at = None
        op.cost = cost
        if op.deadline_at is None and spec.guards.deadline_seconds is not None:
            op.deadline_at = self.now + timedelta(seconds=spec.guards.deadline_seconds)
        self.saga.operations_executed += 1
        self.saga.side_effects += 1 if spec.guards.side_effect else 0
        self.saga.spent += cost or 0.0
        self._event("attempt_started", op)
        return Invoke(op)

    def _deadline_passed(self, op: OpRow) -> None:
        reason = f"deadline of {_describe(op)} passed at {op.deadline_at:%Y-%m-%d %H:%M:%S%z}"
        if op.retrying_unknown:
            # The last attempt may have had its effect: never turn that into a failure.
            self.park(f"{reason}; the outcome of attempt {op.attempts} is unknown; resolve it")
            return
        self._touch(op, status=OperationStatus.FAILED)
        op.error = f"{reason}; last error: {op.error}" if op.error else reason
        self._event("deadline_passed", op, deadline_at=str(op.deadline_at))

    def _cost(self, op: OpRow, spec: OperationSpec) -> tuple[float | None, str | None]:
        """The declared cost of the operation's next attempt, and why it cannot be used
        (a cost function that raises, or a cost that is not a finite, non-negative
        number); the reason parks the saga before anything is called."""
        declared = spec.guards.cost
        if declared is None:
            return None, None
        what = _describe(op)
        if isinstance(declared, int | float):
            value: object = declared
        else:
            try:
                value = declared(*self.arguments(op))
            except Exception as exc:
                return None, (
                    f"the cost function of {what} raised {type(exc).__name__}: {exc}; "
                    f"{what} not started"
                )
        cost = finite_amount(value)
        if cost is None:
            return None, (
                f"the cost of {what} is {value!r}: a cost must be a finite, non-negative "
                f"number; {what} not started"
            )
        return cost, None

    def _expected_spend(self, op: OpRow, spec: OperationSpec, cost: float | None) -> float:
        """What the next attempt of `op` is expected to spend: its declared cost, else
        its declared max_cost, plus, at least, what one earlier attempt of it reported."""
        if cost is not None:
            return cost + op.peak_spend
        if spec.guards.max_cost is not None:
            return max(spec.guards.max_cost, op.peak_spend)
        return op.peak_spend

    def _ceiling_breach(
        self, op: OpRow, spec: OperationSpec, cost: float | None
    ) -> dict[str, Any] | None:
        saga = self.saga
        what = _describe(op)
        if saga.deadline_at is not None and self.now >= saga.deadline_at:
            return {
                "ceiling": "deadline",
                "deadline_at": str(saga.deadline_at),
                "reason": f"ceiling deadline reached: the saga's deadline passed at "
                f"{saga.deadline_at:%Y-%m-%d %H:%M:%S%z}; {what} not started",
            }
        if saga.max_operations is not None and saga.operations_executed >= saga.max_operations:
            return {
                "ceiling": "max_operations",
                "limit": saga.max_operations,
                "executed": saga.operations_executed,
                "reason": f"ceiling max_operations reached: {saga.operations_executed} of "
                f"{saga.max_operations} operations executed; {what} not started",
            }
        if (
            spec.guards.side_effect
            and saga.max_side_effects is not None
            and saga.side_effects >= saga.max_side_effects
        ):
            return {
                "ceiling": "max_side_effects",
                "limit": saga.max_side_effects,
                "executed": saga.side_effects,
                "reason": f"ceiling max_side_effects reached: {saga.side_effects} of "
                f"{saga.max_side_effects} side effects performed; {what} not started",
            }
        if cost is not None and spec.guards.max_cost is not None and cost > spec.guards.max_cost:
            return {
                "ceiling": "max_cost",
                "limit": spec.guards.max_cost,
                "cost": cost,
                "reason": f"per-step limit max_cost: {what} would cost {cost:g}, above its "
                f"limit of {spec.guards.max_cost:g}",
            }
        if saga.spend_budget is None:
            return None
        expected = self._expected_spend(op, spec, cost)
        # An action that declares and has reported nothing is stopped only by a budget
        # already exceeded; a compensation (an undo) only by what it is expected to spend.
        if (expected > 0 or op.kind == "action") and saga.spent + expected > saga.spend_budget:
            return {
                "ceiling": "spend_budget",
                "limit": saga.spend_budget,
                "spent": saga.spent,
                "cost": expected,
                "reason": f"ceiling spend_budget reached: {saga.spent:g} spent + {expected:g} "
                f"expected for {what} exceeds the budget of {saga.spend_budget:g}",
            }
        return None

    def _needs_confirmation(self, op: OpRow, spec: OperationSpec) -> bool:
        policy = spec.guards.confirm
        if isinstance(policy, bool):
            return policy
        return bool(policy(self.request_of(op)))

    def _use_approval(self, op: OpRow, spec: OperationSpec, cost: float | None) -> bool:
        """Whether an approval releases the attempt of `op` about to start, which then
        uses it up (recorded with that attempt's start: one approval, one attempt).

        Only an approval of exactly what would be previewed now (its hash covers the
        attempt's number, so every retry needs a new one), not yet used, and whose
        confirmation has not expired, releases anything."""
        digest = self._preview(op, spec, cost)["request_hash"]
        confirmation = self._confirmation_for(op.step, digest)
        if (
            confirmation is None
            or confirmation.approved_at is None
            or confirmation.consumed_attempt is not None
        ):
            return False
        if confirmation.expires_at <= self.now:
            self.events.append(
                Event(
                    "approval_expired",
                    step=op.step,
                    kind=op.kind,
                    detail={
                        "request_hash": digest,
                        "approved_by": confirmation.approved_by,
                        "expires_at": str(confirmation.expires_at),
                    },
                )
            )
            return False
        attempt = op.attempts + 1
        confirmation.consumed_attempt, confirmation.dirty = attempt, True
        self.events.append(
            Event(
                "approval_used",
                step=op.step,
                kind=op.kind,
                attempt=attempt,
                detail={"request_hash": digest, "approved_by": confirmation.approved_by},
            )
        )
        return True

    def _confirmation_for(self, step: str, digest: str) -> ConfirmationRow | None:
        # At most one: (saga, step, request hash) is the confirmations' primary key.
        return next(
            (c for c in self.confirmations if c.step == step and c.request_hash == digest),
            None,
        )

    def pending_confirmation(self) -> ConfirmationRow | None:
        """The confirmation the saga waits for (the newest unapproved one), or None."""
        waiting = [c for c in self.confirmations if c.approved_at is None]
        return max(waiting, key=lambda c: c.expires_at) if waiting else None

    def _preview(self, op: OpRow, spec: OperationSpec, cost: float | None) -> dict[str, Any]:
        """What the approver of the next attempt of `op` is shown: exactly what that
        attempt reads (the prepared request and the whole saga input, volatile fields
        included, and the results of the steps before), its number and figures, and
        `request_hash`, the hash of all of it that an approval is bound to."""
        checks: list[dict[str, Any]] = [
            {"check": "confirm", "policy": "always"}
            if spec.guards.confirm is True
            else {"check": "confirm", "policy": getattr(spec.guards.confirm, "__name__", "policy")}
        ]
        if spec.guards.max_cost is not None:
            checks.append({"check": "max_cost", "limit": spec.guards.max_cost, "cost": cost})
        if self.saga.spend_budget is not None:
            checks.append(
                {"check": "spend_budget", "limit": self.saga.spend_budget, "spent": self.saga.spent}
            )
        given = self.input_model().model_dump(mode="json")  # what the step receives
        prepared = spec.prepare_fn is not None and op.request is not None
        preview: dict[str, Any] = {
            "target": _describe(op),
            "step": op.step,
            "idempotency_key": op.idempotency_key,
            "attempt": op.attempts + 1,
            # The request the attempt acts on: the prepared one (ctx.request), else the input.
            "payload": op.request if prepared else given,
            **({"input": given} if prepared else {}),
            # ctx.results, as stored.
            "results": {
                o.step: o.result for o in self.actions if o.status == OperationStatus.SUCCEEDED
            },
            "amount": cost,
            "policy_checks": checks,
        }
        preview["request_hash"] = preview_hash(preview)
        return preview

    def _await_confirmation(self, op: OpRow, spec: OperationSpec, cost: float | None) -> None:
        preview = self._preview(op, spec, cost)
        digest = preview["request_hash"]
        expires_at = self.now + timedelta(seconds=spec.guards.confirm_ttl_seconds)
        existing = self._confirmation_for(op.step, digest)
        if existing is None:
            self.confirmations.append(
                ConfirmationRow(op.step, digest, preview, expires_at, new=True)
            )
        else:
            # Asked again (it expired, approved or not): an earlier approval is withdrawn.
            existing.preview, existing.expires_at = preview, expires_at
            existing.approved_by = existing.approved_at = existing.consumed_attempt = None
            existing.new, existing.dirty = True, False
        self._set_status(SagaStatus.AWAITING_CONFIRMATION)
        self.saga.error = (
            f"{_describe(op)} waits for confirmation of attempt {op.attempts + 1} "
            f"(request {digest})"
        )
        self._event(
            "confirmation_requested",
            op,
            request_hash=digest,
            preview=preview,
            expires_at=str(expires_at),
        )

    def _business_input(self) -> dict[str, Any]:
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
                f"outcome of {_describe(op)} attempt {op.attempts} is unknown and it is neither "
                f"idempotent nor has a reconcile hook; resolve it{because}"
            )
            return None
        if op.attempts >= op.max_attempts:
            self.park(
                f"outcome of {_describe(op)} attempt {op.attempts} is unknown and its ceiling of "
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
        self._touch(op, status=OperationStatus.UNKNOWN)
        self.park(
            f"{_describe(op)} cannot be retried ({why}) and an earlier attempt's outcome "
            "is unknown: its effect may be in place; resolve it"
        )

    def _succeeded_pivot(self, before: OpRow | None = None) -> str | None:
        """The first pivot step that succeeded (before the step of `before`, if given)."""
        for op in self.actions:
            if before is not None and op.position >= before.position:
                return None
            if op.status == OperationStatus.SUCCEEDED and self.step_of(op).pivot:
                return op.step
        return None

    # ----- outcomes reported by the runner --------------------------------------------

    def record_success(
        self, op: OpRow, result: Any, *, provider_reference: str | None = None
    ) -> None:
        """The attempt returned `result` (already encoded as JSON)."""
        self._count_spend(op, op.attempt_spend)
        self._succeed(op, result, provider_reference)
        self._event("attempt_succeeded", op)

    def record_failure(self, op: OpRow, error: str, *, retryable: bool, delay: float) -> None:
        """The attempt raised; retry after `delay` seconds if allowed, else fail the operation."""
        self._count_spend(op, op.attempt_spend)
        op.error = error
        op.finished_at = self.now
        if (
            retryable
            and op.deadline_at is not None
            and self.now + timedelta(seconds=delay) >= op.deadline_at
        ):
            retryable = False
            error = f"{error} (not retried: the deadline of {_describe(op)} would pass first)"
            op.error = error
        if retryable and op.attempts < op.max_attempts:
            # After an unknown attempt, a failed retry settles nothing: still unknown.
            status = OperationStatus.UNKNOWN if op.retrying_unknown else OperationStatus.PENDING
            self._touch(op, status=status)
            op.next_attempt_at = self.now + timedelta(seconds=delay)
            self._event(
                "attempt_failed", op, error=error, retryable=True, retry_in_seconds=round(delay, 3)
            )
            return
        if op.retrying_unknown:
            # "An unknown outcome never turns into failed", whatever later attempts say.
            self._event(
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
        self._touch(op, status=OperationStatus.FAILED)
        if retryable:
            op.error = f"ceiling of {op.max_attempts} attempts reached; last error: {error}"
        self._event(
            "attempt_failed", op, error=op.error, retryable=retryable, retry_in_seconds=None
        )

    def record_unknown(
        self,
        op: OpRow,
        reason: str,
        *,
        park: bool,
        traceback: str | None = None,
        spend_known: bool = False,
    ) -> None:
        """The attempt's outcome cannot be known (or stored); park the saga if asked.

        `traceback` (of an unclassified exception) is kept in the audit event. Whether the
        effect happened is unknown, and so is what it spent: the attempt is counted at the
        worst case it declared, unless `spend_known` (it returned, and only its result
        cannot be stored: what it reported is what it spent).
        """
        if spend_known:
            self._count_spend(op, op.attempt_spend)
            uncounted = None
        else:
            uncounted = self._count_unknown_spend(op)
        if uncounted is not None and not park:
            park, reason = True, f"{reason}; {uncounted}"
        op.finished_at = self.now
        if op.status == OperationStatus.UNKNOWN:
            # Already unknown (a reconcile answer that cannot be stored): say why it stays so.
            op.error, op.dirty = reason, True
            self._event("outcome_unknown", op, reason=reason)
        self._mark_unknown(op, reason, traceback=traceback)
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
            self._touch(op, status=back)
            op.finished_at = self.now
        op.error = reason
        op.next_attempt_at = None
        op.dirty = True
        self._event("attempt_not_called", op, reason=reason)
        self.park(f"{reason}; fix the cause, then retry")

    def record_found(self, op: OpRow, result: Any, provider_reference: str | None) -> None:
        """Reconcile: the provider performed the effect."""
        self._event("reconcile_found", op, provider_reference=provider_reference)
        self._succeed(op, result, provider_reference)
        self._settled_reconcile(op)

    def _succeed(self, op: OpRow, result: Any, provider_reference: str | None) -> None:
        self._touch(op, status=OperationStatus.SUCCEEDED)
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
        self._event("reconcile_absent", op, settled=True)
        self._settled_reconcile(op)
        op.retrying_unknown = False
        if op.attempts < op.max_attempts:
            self._touch(op, status=OperationStatus.PENDING)
            op.next_attempt_at = None
            return
        self._touch(op, status=OperationStatus.FAILED)
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
            self._event(
                event,
                op,
                reason=reason,
                settled=False,
                ask=op.reconcile_asks,
                ask_again_in_seconds=round(delay, 3),
            )
            return
        self._event(event, op, reason=reason, settled=False, ask=op.reconcile_asks)
        waited = (self.now - op.reconcile_started_at).total_seconds()
        self.park(
            f"outcome of {_describe(op)} attempt {op.attempts} is unknown: {reason} "
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
        new_hash = request_hash({"kind": op.kind, "step": op.step, "request": request})
        if op.request is not None and new_hash != op.request_hash and op.retrying_unknown:
            self._event(
                "request_changed",
                op,
                previous=op.request,
                current=request,
                previous_hash=op.request_hash,
                current_hash=new_hash,
            )
            self.park(
                f"request of {_describe(op)} changed while attempt {op.attempts}'s outcome is "
                f"unknown: it was {canonical_json(op.request)} ({op.request_hash[:12]}), it is "
                f"now {canonical_json(request)} ({new_hash[:12]}); not acting on either"
            )
            return
        if op.request is None or new_hash != op.request_hash:
            self._event("request_prepared", op, request_hash=new_hash)
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
        self._event("attempt_failed", op, **detail, parked=True)
        self.park(
            f"prepare of {_describe(op)} raised {error.removeprefix('prepare failed: ')}; "
            "nothing was called; fix it, then retry, resolve or compensate"
        )

    def note_spend(self, op: OpRow, amount: float) -> None:
        """Spend that step code reported with `ctx.spend()` during the attempt in flight
        (its running total, persisted or not yet), counted when its outcome is recorded."""
        if amount > op.attempt_spend:
            op.attempt_spend = amount
            op.dirty = True

    def refuse_spend(self, op: OpRow, reason: str) -> None:
        """Step code reported a spend that is not a finite, non-negative number: it was
        refused and not counted. The attempt's outcome is recorded as it is; the saga
        parks for a human to count what was spent."""
        self._event("spend_refused", op, reason=reason)
        self.park(
            f"{_describe(op)} attempt {op.attempts} reported a spend that was refused ("
            f"{reason}); its outcome is recorded, the spend is not counted: check what it "
            "spent, then retry, resolve or compensate"
        )

    def _count_spend(self, op: OpRow, amount: float) -> None:
        """Count what an attempt of `op` reported into the operation and the saga, once."""
        if amount <= 0:
            return
        self.saga.spent += amount
        op.spent += amount
        op.peak_spend = max(op.peak_spend, amount)
        op.attempt_spend = 0.0
        op.dirty = True

    def _count_unknown_spend(self, op: OpRow) -> str | None:
        """Count the spend of an attempt whose outcome is unknown (lost to a crash, past its
        timeout, or ended by an exception that is not a verdict), once: what it reported,
        raised to its declared max_cost when it declared no cost (a declared cost was
        counted as it started). Returns why the saga must park instead, when a spend budget
        is set and the step declares neither cost nor max_cost."""
        if op.status == OperationStatus.UNKNOWN and op.attempt_spend == 0:
            return None  # counted when it became unknown (a reconcile answer now)
        spec = self._declared(op)
        reported = op.attempt_spend
        max_cost = spec.guards.max_cost if spec is not None else None
        declares_cost = op.cost is not None  # counted as the attempt started
        if not declares_cost and max_cost is not None:
            self._count_spend(op, max(reported, max_cost))
            return None
        self._count_spend(op, reported)
        if declares_cost or self.saga.spend_budget is None:
            return None
        return (
            f"what attempt {op.attempts} of {_describe(op)} spent is unknown ({reported:g} "
            "reported before it was lost) and it declares neither cost nor max_cost, so the "
            "spend budget cannot count it: check with the provider, then retry, resolve or "
            "compensate"
        )

    # ----- operator requests ----------------------------------------------------------

    def request_compensation(self, *, include_unknown: bool, actor: str | None) -> bool:
        """Switch to compensating what succeeded, in reverse, running no further step.

        An explicit request gives each compensation that failed at its ceiling a fresh
        budget of its policy's max_attempts (the attempts made still count), recorded as
        `ceiling_raised`; the automatic runtime never does. False when the saga is
        already compensated (nothing changes).
        """
        if self.saga.status == SagaStatus.COMPENSATED:
            return False
        self.saga.direction = "backward"
        self._resume()
        self.events.append(
            Event(
                "compensation_requested",
                detail={"actor": actor, "include_unknown": include_unknown},
            )
        )
        if include_unknown:
            for act in self.actions:
                if act.status in (OperationStatus.UNKNOWN, OperationStatus.RUNNING):
                    self._mark_unknown(act, act.error or "outcome unknown")
                    if self.compensation_of(act) and self.find(act.step, "compensation") is None:
                        self._add_compensation(act)
        for comp in self.ops:
            budget = self._fresh_budget(comp)
            if budget is None:
                continue
            previous = comp.max_attempts
            comp.max_attempts = comp.attempts + budget
            self._touch(comp, status=OperationStatus.PENDING)
            comp.next_attempt_at = None
            self._event(
                "ceiling_raised",
                comp,
                actor=actor,
                reason="explicit compensation request",
                previous_max_attempts=previous,
                max_attempts=comp.max_attempts,
            )
        return True

    def fresh_budgets(self) -> list[tuple[str, int, int]]:
        """(step, ceiling now, ceiling after) of each compensation an explicit compensation
        request would give a fresh budget, changing nothing (for dry runs)."""
        raised: list[tuple[str, int, int]] = []
        for op in self.ops:
            budget = self._fresh_budget(op)
            if budget is not None:
                raised.append((op.step, op.max_attempts, op.attempts + budget))
        return raised

    def _fresh_budget(self, op: OpRow) -> int | None:
        """The attempts an explicit compensation request adds to a compensation that
        failed at its ceiling (its policy's max_attempts); None for any other operation.

        A compensation that failed below its ceiling failed permanently: a raised
        ceiling would not change that, so it is left to `retry` or `resolve`.
        """
        if op.kind != "compensation" or op.status != OperationStatus.FAILED:
            return None
        if op.attempts < op.max_attempts:
            return None
        spec = self._declared(op)
        return None if spec is None else spec.retry.max_attempts

    def resolve(
        self,
        step: str,
        *,
        kind: Kind | None,
        outcome: Literal["succeeded", "failed"],
        result: Any,
        actor: str,
        reason: str | None,
    ) -> OpRow:
        """An operator settles an operation; the saga becomes runnable again.

        Refused (`StepStateError`, nothing changed) where the settlement would leave the
        saga in a state the protocol never reaches: on a completed or compensated saga
        (nothing runs again, so nothing could act on it), and as `succeeded` for a step
        that compensation has already gone past (it would be undone out of order)."""
        self._refuse_when_final("resolve", step)
        op = self._resolution_target(step, kind)
        if outcome == "succeeded" and op.kind == "action" and self.saga.direction == "backward":
            self._refuse_success_behind_compensation(op)
        if op.status == OperationStatus.SUCCEEDED:
            raise StepStateError(f"{_describe(op)} already succeeded; there is nothing to resolve")
        if op.status == OperationStatus.PENDING and op.attempts == 0:
            raise StepStateError(
                f"{_describe(op)} has not been attempted; there is nothing to resolve"
            )
        if outcome == "succeeded":
            self._touch(op, status=OperationStatus.SUCCEEDED)
            op.result = result
            op.error = None
        else:
            self._touch(op, status=OperationStatus.FAILED)
            op.error = f"resolved as failed by {actor}" + (f": {reason}" if reason else "")
        op.next_attempt_at = None
        op.finished_at = self.now
        op.retrying_unknown = False
        self._event("operation_resolved", op, outcome=outcome, actor=actor, reason=reason)
        if not self.saga.status.is_terminal:
            self._resume()
        return op

    def approve_confirmation(self, step: str, request_hash: str, *, actor: str) -> None:
        """A verified approval of the pending request of `step`: the saga may go on."""
        if self.saga.status != SagaStatus.AWAITING_CONFIRMATION:
            raise StepStateError(
                f"saga {self.saga.id} is {self.saga.status}, not awaiting_confirmation"
            )
        pending = [c for c in self.confirmations if c.step == step and c.approved_at is None]
        match = next((c for c in pending if c.request_hash == request_hash), None)
        if match is None:
            hashes = ", ".join(c.request_hash for c in pending) or "none"
            raise StepStateError(
                f"request hash {request_hash} does not match the pending request of step "
                f"{step!r} (pending: {hashes}); approve the request previewed now"
            )
        if match.expires_at <= self.now:
            raise StepStateError(
                f"the confirmation of step {step!r} expired at {match.expires_at}; run the saga "
                "again to prepare a new preview"
            )
        match.approved_by, match.approved_at, match.dirty = actor, self.now, True
        self._resume()
        self.events.append(
            Event(
                "confirmation_approved",
                step=step,
                kind="action",
                detail={"actor": actor, "request_hash": request_hash},
            )
        )

    def reopen_expired_confirmation(self) -> bool:
        """Make a saga whose pending confirmation expired runnable, to preview again."""
        pending = self.pending_confirmation()
        if self.saga.status != SagaStatus.AWAITING_CONFIRMATION or pending is None:
            return False
        if pending.expires_at > self.now:
            return False
        self._resume()
        self.events.append(
            Event(
                "confirmation_expired",
                step=pending.step,
                kind="action",
                detail={"request_hash": pending.request_hash},
            )
        )
        return True

    def _refuse_when_final(self, verb: str, step: str | None = None) -> None:
        """A completed or compensated saga never changes again: say what is left."""
        status = self.saga.status
        if status == SagaStatus.COMPLETED:
            raise StepStateError(
                f"saga {self.saga.id} is completed: nothing runs again, so there is nothing to "
                f"{verb}; compensate it to undo what it did"
            )
        if status == SagaStatus.COMPENSATED:
            what = (
                f"; if step {step!r} took effect after all, undo it at the provider" if step else ""
            )
            raise StepStateError(
                f"saga {self.saga.id} is compensated: it is final and nothing runs again, so "
                f"there is nothing to {verb}{what}"
            )

    def _refuse_success_behind_compensation(self, op: OpRow) -> None:
        """Compensation runs in reverse: a step it has gone past can no longer become one
        that needs undoing."""
        if self.compensation_of(op) is None:
            return  # nothing to undo either way
        ran = [
            c
            for c in self.ops
            if c.kind == "compensation"
            and c.position < op.position
            and (c.attempts > 0 or c.status == OperationStatus.SUCCEEDED)
        ]
        if ran:
            last = max(ran, key=lambda c: c.position)
            raise StepStateError(
                f"compensation has already gone past step {op.step!r} (the compensation of "
                f"step {last.step!r} has run): recorded as succeeded it would be undone out of "
                "order, after the steps before it; undo its effect at the provider and resolve "
                "it as failed"
            )

    def _resume(self) -> None:
        back = self.saga.direction == "backward"
        self._set_status(SagaStatus.COMPENSATING if back else SagaStatus.RUNNING)
        self.saga.error = None
        self.saga.run_after = self.now

    def _resolution_target(self, step: str, kind: Kind | None) -> OpRow:
        if self.definition.step_named(step) is None:
            raise StepStateError(f"saga {self.saga.name!r} has no step {step!r}")
        if kind is not None:
            op = self.find(step, kind)
            if op is None:
                raise StepStateError(f"step {step!r} has no {kind} operation yet")
            return op
        comp = self.find(step, "compensation")
        if comp is not None and comp.status != OperationStatus.SUCCEEDED:
            return comp
        action = self.find(step, "action")
        assert action is not None  # every declared step has its action row
        return action

    def raise_ceilings(
        self,
        *,
        actor: str | None,
        max_operations: int | None = None,
        spend_budget: float | None = None,
        max_side_effects: int | None = None,
        extend_deadline_seconds: float | None = None,
    ) -> None:
        """An operator raises saga ceilings (never lowers them); a saga parked in
        needs_review becomes runnable again, its counters untouched.

        A ceiling the saga does not have is unlimited, the highest there is: setting
        one there would lower it, and is refused like any lowering. One refused
        ceiling refuses the whole request, changing nothing."""
        self._refuse_when_final("raise a ceiling for")
        saga = self.saga

        def ceilings() -> dict[str, Any]:
            return {
                "max_operations": saga.max_operations,
                "spend_budget": saga.spend_budget,
                "max_side_effects": saga.max_side_effects,
                "deadline_at": str(saga.deadline_at) if saga.deadline_at else None,
            }

        before = ceilings()
        for name, new, old in (
            ("max_operations", max_operations, saga.max_operations),
            ("spend_budget", spend_budget, saga.spend_budget),
            ("max_side_effects", max_side_effects, saga.max_side_effects),
        ):
            if new is None:
                continue
            if new != new:  # NaN: no ceiling would ever be reached, nor compared
                raise ValueError(f"{name} must be a number, got {new!r}")
            if old is None:
                raise StepStateError(f"{name} can only be raised: it is unlimited, not {new:g}")
            if new < old:
                raise StepStateError(f"{name} can only be raised: it is {old:g}, not {new:g}")
        if extend_deadline_seconds is not None and extend_deadline_seconds <= 0:
            raise ValueError("extend_deadline_seconds must be positive")
        if max_operations is not None:
            saga.max_operations = max_operations
        if spend_budget is not None:
            saga.spend_budget = spend_budget
        if max_side_effects is not None:
            saga.max_side_effects = max_side_effects
        if extend_deadline_seconds is not None and saga.deadline_at is not None:
            saga.deadline_at = max(saga.deadline_at, self.now) + timedelta(
                seconds=extend_deadline_seconds
            )
        self.events.append(
            Event("ceilings_raised", detail={"actor": actor, "before": before, "after": ceilings()})
        )
        if saga.status == SagaStatus.NEEDS_REVIEW:
            self._resume()

    def request_retry(self, *, extra_attempts: int, actor: str | None) -> OpRow:
        """Resume a parked saga at the operation that blocks it, its ceiling raised by
        `extra_attempts`; attempts already made still count."""
        if extra_attempts < 0:
            raise ValueError(f"extra_attempts must not be negative, got {extra_attempts}")
        if self.saga.status != SagaStatus.NEEDS_REVIEW:
            raise StepStateError(
                f"saga {self.saga.id} is {self.saga.status}, not needs_review; nothing to retry"
            )
        op = self.blocking_operation()
        if op is None:
            raise StepStateError(
                f"no operation of saga {self.saga.id} is blocked; compensate or resolve it instead"
            )
        if op.kind == "action" and self.saga.direction == "backward":
            raise StepStateError(
                f"compensation stopped at step {op.step!r}, whose outcome is unknown: resolve it, "
                "or compensate with include_unknown"
            )
        if (
            op.status == OperationStatus.UNKNOWN
            and self.reconcile_fn(op) is None
            and not self.is_idempotent(op)
        ):
            raise StepStateError(
                f"outcome of {_describe(op)} is unknown and it is neither idempotent nor has a "
                "reconcile hook, so a retry could repeat its effect; check with the provider "
                "and resolve it"
            )
        ceiling = op.max_attempts + extra_attempts
        if op.attempts >= ceiling:
            raise StepStateError(
                f"{_describe(op)} has used {op.attempts} of its {op.max_attempts} attempts; "
                "raise its ceiling with extra attempts to retry it"
            )
        previous_status, previous_ceiling = op.status, op.max_attempts
        op.max_attempts = ceiling
        if op.status == OperationStatus.FAILED:
            self._touch(op, status=OperationStatus.PENDING)
        else:
            # An unknown outcome stays unknown: the planner settles it (reconcile or retry).
            op.dirty = True
        op.next_attempt_at = None
        self._event(
            "retry_requested",
            op,
            actor=actor,
            previous_status=str(previous_status),
            extra_attempts=extra_attempts,
            previous_max_attempts=previous_ceiling,
            max_attempts=ceiling,
        )
        self._resume()
        return op

    def request_cancel(self, *, reason: str, actor: str | None, include_unknown: bool) -> bool:
        """Stop forward progress and compensate what succeeded, in reverse; False when the
        saga is already compensating or compensated (nothing changes)."""
        status = self.saga.status
        if status == SagaStatus.COMPLETED:
            raise StepStateError(
                f"saga {self.saga.id} is completed: there is no forward progress to stop "
                "(compensate undoes a completed saga)"
            )
        if self.saga.direction == "backward":
            if status in (SagaStatus.COMPENSATING, SagaStatus.COMPENSATED):
                return False
            raise StepStateError(
                f"saga {self.saga.id} is already compensating and parked ({self.saga.error}); "
                "retry or resolve the blocked compensation"
            )
        pivot = self._succeeded_pivot()
        if pivot is not None:
            raise StepStateError(
                f"pivot step {pivot!r} of saga {self.saga.id} has succeeded: it can only go "
                "forward (compensate it explicitly if you must undo it)"
            )
        self.events.append(Event("cancel_requested", detail={"actor": actor, "reason": reason}))
        self.request_compensation(include_unknown=include_unknown, actor=actor)
        self.saga.error = f"cancelled by {actor or 'an operator'}: {reason}"
        return True

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

    def compensation_plan(
        self, *, include_unknown: bool
    ) -> tuple[list[tuple[str, str]], str | None]:
        """What compensating would run, changing nothing: (step, idempotency key) of each
        compensation in order, and why it would stop early (None when it would finish)."""
        runs: list[tuple[str, str]] = []
        for act in reversed(self.actions):
            comp_def = self.compensation_of(act)
            comp = self.find(act.step, "compensation")
            unknown = act.status in (OperationStatus.UNKNOWN, OperationStatus.RUNNING)
            gets_comp = comp is not None or (include_unknown and comp_def is not None)
            if act.status == OperationStatus.SUCCEEDED or (unknown and gets_comp):
                if comp_def is None or (comp and comp.status == OperationStatus.SUCCEEDED):
                    continue
                stop = None if comp is None else self._plan_stop(comp)
                if stop is not None:
                    return runs, stop
                key = comp.idempotency_key if comp is not None else self._compensation_key(act.step)
                runs.append((act.step, key))
            elif unknown:
                return runs, f"step {act.step!r} has an unknown outcome; " + _unknown_remedy(
                    comp_def
                )
        return runs, None

    def _plan_stop(self, comp: OpRow) -> str | None:
        """Why compensating would stop at this open compensation (as `_backward` and
        `_settle_unknown` decide after `request_compensation`), or None if it would run."""
        what = f"compensation of step {comp.step!r}"
        if comp.status == OperationStatus.FAILED:
            if self._fresh_budget(comp) is not None:
                return None  # the request gives it a fresh budget
            return (
                f"{what} failed permanently ({comp.error}); retry it "
                "(with --extra-attempts if needed) or resolve it"
            )
        if comp.status in (OperationStatus.UNKNOWN, OperationStatus.RUNNING):
            if self.reconcile_fn(comp) is not None:
                return None  # its reconcile hook is asked; Absent runs it again
            if not self.is_idempotent(comp):
                return (
                    f"outcome of {what} attempt {comp.attempts} is unknown and it is neither "
                    "idempotent nor has a reconcile hook; resolve it"
                )
            if comp.attempts >= comp.max_attempts:
                return (
                    f"outcome of {what} attempt {comp.attempts} is unknown and its ceiling of "
                    f"{comp.max_attempts} attempts is reached; resolve it"
                )
        return None

    # ----- transitions ----------------------------------------------------------------

    def park(self, reason: str, *, ceiling: dict[str, Any] | None = None) -> None:
        """Stop in needs_review with the reason recorded; a human decides what comes next."""
        self._set_status(SagaStatus.NEEDS_REVIEW)
        self.saga.error = reason
        detail: dict[str, Any] = {"reason": reason}
        if ceiling is not None:
            detail["ceiling"] = {k: v for k, v in ceiling.items() if k != "reason"}
        self.events.append(Event("saga_parked", detail=detail))

    def _begin_compensation(self, reason: str) -> None:
        self.saga.direction = "backward"
        self._set_status(SagaStatus.COMPENSATING)
        self.saga.error = reason
        self.events.append(Event("compensation_started", detail={"reason": reason}))

    def _finish(self, status: SagaStatus) -> None:
        self._set_status(status)
        if status == SagaStatus.COMPLETED:
            self.saga.error = None
        self.events.append(Event(f"saga_{status.value}"))

    def _mark_unknown(self, op: OpRow, reason: str, *, traceback: str | None = None) -> None:
        if op.status == OperationStatus.UNKNOWN:
            return
        self._touch(op, status=OperationStatus.UNKNOWN)
        op.error = reason
        if traceback is None:
            self._event("outcome_unknown", op, reason=reason)
        else:
            self._event("outcome_unknown", op, reason=reason, traceback=traceback)

    def _compensation_key(self, step: str) -> str:
        saga = self.saga
        return operation_key(
            saga.name, saga.version, saga.tenant_id, saga.key, step, "compensation"
        )

    def _add_compensation(self, act: OpRow) -> OpRow:
        comp_def = self.compensation_of(act)
        assert comp_def is not None
        comp = OpRow(
            step=act.step,
            kind="compensation",
            position=act.position,
            idempotency_key=self._compensation_key(act.step),
            request_hash=compensation_request_hash(act.step, self._business_input(), act.result),
            status=OperationStatus.PENDING,
            attempts=0,
            max_attempts=comp_def.retry.max_attempts,
            new=True,
        )
        self.ops.append(comp)
        return comp

    def _set_status(self, status: SagaStatus) -> None:
        self.saga.status = status

    def _touch(self, op: OpRow, *, status: OperationStatus) -> None:
        op.status = status
        op.dirty = True

    def _event(self, name: str, op: OpRow, **detail: Any) -> None:
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
        confirmations: list[ConfirmationChange] = []
        for row in self.confirmations:
            if row.new:
                confirmations.append(ConfirmationChange("ask", row))
            elif row.dirty:
                action: Literal["approve", "consume"] = (
                    "consume" if row.consumed_attempt is not None else "approve"
                )
                confirmations.append(ConfirmationChange(action, row))
            row.new = row.dirty = False
        return Write(
            saga=saga,
            new_ops=new,
            changed_ops=changed,
            confirmations=tuple(confirmations),
            events=tuple(self.take_events()),
            release=release,
            notify=notify,
            return_state=release,
        )

    def take_events(self) -> list[Event]:
        """Events produced since the last call (the runner persists and logs them)."""
        events, self.events = self.events, []
        return events


def _describe(op: OpRow) -> str:
    return f"step {op.step!r}" if op.kind == "action" else f"compensation of step {op.step!r}"


def _unknown_remedy(compensation: Compensation | None) -> str:
    """What settles a step of unknown outcome that compensation cannot go past: including
    unknown steps helps only when the step declares a compensation."""
    if compensation is None:
        return "it has no compensation, so resolve it (succeeded or failed) first"
    return "resolve it first, or compensate with include_unknown=True"
