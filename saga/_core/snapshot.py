"""One saga's rows as the core reads and changes them, and the record of what changed.

A `Snapshot` holds a saga's row, its operation rows and its confirmations
(`saga._core.rows`), read against the saga's definition: which step or compensation an
operation runs, what it receives, what it has returned. Every change to a row goes
through it: the row is noted in the record of the transition (`saga._core.writes`), the
audit events are kept, and `write` hands all of it over as one `Write`. The rows a
snapshot is given are as stored; the rows it adds (`add_op`) are new. The decisions are
made above it: what an operation's outcome changes (`saga._core.outcomes`) and what
comes next (`saga._core.planner`).
"""

from __future__ import annotations

from datetime import datetime
from operator import attrgetter
from typing import Any

from saga._core.moves import Next
from saga._core.rows import ConfirmationRow, Event, Kind, OpRow, SagaRow, Write, operation_event
from saga._core.writes import Changes, lease_after
from saga.definition import Compensation, OperationSpec, Saga, Step
from saga.errors import StepStateError
from saga.keys import action_request_hashes, operation_key, request_hash
from saga.state import OperationStatus, SagaStatus

# The sort key of operation rows in step order.
_position = attrgetter("position")


def action_request_hash(step: str, business: dict[str, Any]) -> str:
    """Request hash of a step: its name and the saga input's business fields."""
    return request_hash({"kind": "action", "step": step, "input": business})


def compensation_request_hash(step: str, business: dict[str, Any], result: Any) -> str:
    """Request hash of a compensation: its step, the business input and the step's result."""
    return request_hash({"kind": "compensation", "step": step, "input": business, "result": result})


def new_action_rows(
    saga: Saga[Any],
    tenant: str,
    key: str,
    business: dict[str, Any],
    *,
    canonical: bytes | None = None,
) -> list[OpRow]:
    """The pending action rows created with a saga instance, one per step. `canonical`,
    when the caller has it, is `canonical_form(business)`."""
    hashes = action_request_hashes(
        [step.name for step in saga.steps], business, canonical=canonical
    )
    return [
        OpRow(
            step=step.name,
            kind="action",
            position=step.index,
            idempotency_key=operation_key(
                saga.name, saga.version, tenant, key, step.name, "action"
            ),
            request_hash=hashed,
            status=OperationStatus.PENDING,
            attempts=0,
            max_attempts=step.retry.max_attempts,
        )
        for step, hashed in zip(saga.steps, hashes, strict=True)
    ]


class Snapshot:
    """The rows of one saga, read against its definition, and every change made to them
    since the last write."""

    def __init__(
        self,
        definition: Saga[Any],
        saga: SagaRow,
        ops: list[OpRow],
        confirmations: list[ConfirmationRow] | None = None,
        *,
        now: datetime,
    ) -> None:
        definition.adopt(ops)
        self.definition = definition
        self.saga = saga
        self.ops = ops
        self.confirmations = confirmations or []
        # The rows changed since the last write (`write` hands them over).
        self.changes = Changes()
        # Operations whose request was prepared in this transaction, ready to start.
        self.prepared: set[tuple[str, str]] = set()
        self._input_model: Any = None
        self.events: list[Event] = []
        # The time of the input being applied: the core never reads a clock. Each input
        # (`advance`, `saga._core.inputs.apply`, an operator's change) carries its own.
        self.now = now

    # ----- reading the snapshot -------------------------------------------------------

    @property
    def actions(self) -> list[OpRow]:
        """Action rows in step order."""
        return sorted([o for o in self.ops if o.kind == "action"], key=_position)

    def find(self, step: str, kind: Kind) -> OpRow | None:
        """The row of (step, kind), or None."""
        for o in self.ops:
            if o.step == step and o.kind == kind:
                return o
        return None

    def op(self, step: str, kind: str) -> OpRow:
        """The row of (step, kind); `KeyError` when there is none."""
        for o in self.ops:
            if o.step == step and o.kind == kind:
                return o
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

    def business_input(self) -> dict[str, Any]:
        """The saga input's business fields: what request hashes are computed from."""
        return {k: v for k, v in self.saga.input.items() if k not in self.definition.volatile}

    def compensation_key(self, step: str) -> str:
        """The idempotency key of the compensation of `step`."""
        saga = self.saga
        return operation_key(
            saga.name, saga.version, saga.tenant_id, saga.key, step, "compensation"
        )

    # ----- changing it ----------------------------------------------------------------

    def changed(self, op: OpRow) -> None:
        """Note that `op` changed: the next write updates it. Every change to an
        operation row goes through here (or `touch`, `add_op`)."""
        self.changes.ops.add(id(op))

    def touch(self, op: OpRow, *, status: OperationStatus) -> None:
        """Set the status of `op`, noting the row changed."""
        op.status = status
        self.changes.ops.add(id(op))

    def add_op(self, op: OpRow) -> None:
        """Add operation `op`, new: the next write creates it."""
        self.ops.append(op)
        self.changes.added.add(id(op))

    def confirmation_asked(self, row: ConfirmationRow) -> None:
        """Note that confirmation `row` is asked for (new, or asked again with a new
        preview): the next write records the request."""
        self.changes.asked.add(id(row))

    def confirmation_changed(self, row: ConfirmationRow) -> None:
        """Note that confirmation `row` was approved, or its approval used up: the next
        write records it."""
        self.changes.confirmed.add(id(row))

    def set_status(self, status: SagaStatus) -> None:
        """Set the saga's status."""
        self.saga.status = status

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
        )
        self.add_op(comp)
        return comp

    def event(self, name: str, op: OpRow, **detail: Any) -> None:
        """Record audit event `name` about `op` (and its current attempt)."""
        self.events.append(operation_event(name, op, **detail))

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

    def write(
        self,
        nxt: Next | None,
        *,
        owner: str | None,
        max_inline_sleep: float = 0.0,
        answer: bool = True,
    ) -> Write:
        """The write of everything changed since the last one (the rows noted, the
        events), and what becomes of the lease given the next move `nxt`
        (`saga._core.writes.lease_after`, with the lease holder `owner` and
        `max_inline_sleep`); the record of changes starts afresh. A write that gives the
        lease back reads the saga's state back with it when `answer` (a caller that
        ends its drive there returns that state); a worker, which drops it, says False."""
        release, notify = lease_after(
            self.saga,
            nxt,
            owner=owner,
            now=self.now,
            max_inline_sleep=max_inline_sleep,
            events=self.events,
        )
        new, changed = self.changes.take_ops(self.ops)
        return Write(
            saga=self.saga,
            new_ops=new,
            changed_ops=changed,
            confirmations=self.changes.take_confirmations(self.confirmations),
            events=tuple(self.take_events()),
            release=release,
            notify=notify,
            return_state=release and answer,
        )

    def take_events(self) -> list[Event]:
        """Events produced since the last call (the runner persists and logs them)."""
        events, self.events = self.events, []
        return events
