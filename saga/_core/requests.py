"""An operator's requests, applied to a saga's snapshot under its row lock, and the dry
runs of compensating.

Each request (compensate, cancel, resolve, retry, raise ceilings, approve or reopen a
confirmation) is refused with `StepStateError`, changing nothing, where it would leave
the saga somewhere the protocol never goes; otherwise it changes the snapshot and
records its audit events, with who asked. `saga._core.inputs.request` applies them as
values. Like the rest of the core, this module does no I/O and reads no clock: each
request is made at the `now` it is given.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

from saga._core.confirmations import pending_confirmation
from saga._core.planner import Planner, new_action_rows, unknown_remedy
from saga._core.rows import Event, Kind, OpRow, SagaRow, describe
from saga.errors import StepStateError
from saga.keys import operation_key
from saga.state import OperationState, OperationStatus, SagaStatus


def request_compensation(
    planner: Planner, *, include_unknown: bool, actor: str | None, now: datetime
) -> bool:
    """Switch to compensating what succeeded, in reverse, running no further step.

    An explicit request gives each compensation that failed at its ceiling a fresh
    budget of its policy's max_attempts (the attempts made still count), recorded as
    `ceiling_raised`; the automatic runtime never does. False when the saga is
    already compensated (nothing changes).
    """
    planner.now = now
    if planner.saga.status == SagaStatus.COMPENSATED:
        return False
    planner.saga.direction = "backward"
    _resume(planner, now)
    planner.events.append(
        Event(
            "compensation_requested",
            detail={"actor": actor, "include_unknown": include_unknown},
        )
    )
    if include_unknown:
        for act in planner.actions:
            if act.status in (OperationStatus.UNKNOWN, OperationStatus.RUNNING):
                planner.mark_unknown(act, act.error or "outcome unknown")
                if planner.compensation_of(act) and planner.find(act.step, "compensation") is None:
                    planner.add_compensation(act)
    for comp in planner.ops:
        budget = _fresh_budget(planner, comp)
        if budget is None:
            continue
        previous = comp.max_attempts
        comp.max_attempts = comp.attempts + budget
        planner.touch(comp, status=OperationStatus.PENDING)
        comp.next_attempt_at = None
        planner.event(
            "ceiling_raised",
            comp,
            actor=actor,
            reason="explicit compensation request",
            previous_max_attempts=previous,
            max_attempts=comp.max_attempts,
        )
    return True


def resolve(
    planner: Planner,
    step: str,
    *,
    kind: Kind | None,
    outcome: Literal["succeeded", "failed"],
    result: Any,
    actor: str,
    reason: str | None,
    now: datetime,
    operator_resolved: Collection[str] = (),
) -> OpRow:
    """An operator settles an operation; the saga becomes runnable again.

    Refused (`StepStateError`, nothing changed) where the settlement would leave the
    saga in a state the protocol never reaches: on a completed or compensated saga
    (nothing runs again, so nothing could act on it), and as `succeeded` for a step
    that compensation has already gone past (it would be undone out of order).

    A step an operator resolved as succeeded before (`operator_resolved` names those
    steps) has its result amended by resolving it as succeeded again, as long as its
    compensation has not started (it has not received the result yet); recorded as
    `result_amended` with the actor, the old and the new result. A step a provider
    call completed keeps the result the provider returned."""
    planner.now = now
    if outcome == "succeeded" and step in operator_resolved:
        action = planner.find(step, "action")
        if (
            action is not None
            and action.status == OperationStatus.SUCCEEDED
            and kind != ("compensation")
        ):
            return _amend_result(planner, action, result=result, actor=actor, reason=reason)
    _refuse_when_final(planner, "resolve", step)
    op = _resolution_target(planner, step, kind)
    if outcome == "succeeded" and op.kind == "action" and planner.saga.direction == "backward":
        _refuse_success_behind_compensation(planner, op)
    if op.status == OperationStatus.SUCCEEDED:
        why = (
            ": its result is what the provider call returned, and only a result an "
            "operator gave with resolve can be amended"
            if outcome == "succeeded" and op.kind == "action"
            else ""
        )
        raise StepStateError(f"{describe(op)} already succeeded; there is nothing to resolve{why}")
    if op.status == OperationStatus.PENDING and op.attempts == 0:
        raise StepStateError(f"{describe(op)} has not been attempted; there is nothing to resolve")
    if outcome == "succeeded":
        planner.touch(op, status=OperationStatus.SUCCEEDED)
        op.result = result
        op.error = None
    else:
        planner.touch(op, status=OperationStatus.FAILED)
        op.error = f"resolved as failed by {actor}" + (f": {reason}" if reason else "")
    op.next_attempt_at = None
    op.finished_at = now
    op.retrying_unknown = False
    planner.event("operation_resolved", op, outcome=outcome, actor=actor, reason=reason)
    if not planner.saga.status.is_terminal:
        _resume(planner, now)
    return op


def _amend_result(
    planner: Planner, action: OpRow, *, result: Any, actor: str, reason: str | None
) -> OpRow:
    """Replace the result an operator gave a succeeded step, before its compensation
    receives it; refused once the compensation has started or finished."""
    comp = planner.find(action.step, "compensation")
    if comp is not None and (comp.attempts > 0 or comp.status != OperationStatus.PENDING):
        raise StepStateError(
            f"the result of step {action.step!r} can no longer be amended: its compensation "
            f"has started ({comp.status.value}, {comp.attempts} attempt(s)) and received "
            "the result it had"
        )
    if planner.saga.status in (SagaStatus.COMPENSATED, SagaStatus.FORKED):
        raise StepStateError(
            f"saga {planner.saga.id} is {planner.saga.status.value}: it is final, and the "
            f"result of step {action.step!r} is no longer used"
        )
    previous = action.result
    action.result = result
    planner.changed(action)
    planner.event(
        "result_amended",
        action,
        actor=actor,
        reason=reason,
        previous_result=previous,
        result=result,
    )
    return action


def request_retry(
    planner: Planner, *, extra_attempts: int, actor: str | None, now: datetime
) -> OpRow:
    """Resume a parked saga at the operation that blocks it, its ceiling raised by
    `extra_attempts`; attempts already made still count."""
    planner.now = now
    if extra_attempts < 0:
        raise ValueError(f"extra_attempts must not be negative, got {extra_attempts}")
    if planner.saga.status != SagaStatus.NEEDS_REVIEW:
        raise StepStateError(
            f"saga {planner.saga.id} is {planner.saga.status}, not needs_review; nothing to retry"
        )
    op = planner.blocking_operation()
    if op is None:
        raise StepStateError(
            f"no operation of saga {planner.saga.id} is blocked; compensate or resolve it instead"
        )
    if op.kind == "action" and planner.saga.direction == "backward":
        raise StepStateError(
            f"compensation stopped at step {op.step!r}, whose outcome is unknown: resolve it, "
            "or compensate with include_unknown"
        )
    if (
        op.status == OperationStatus.UNKNOWN
        and planner.reconcile_fn(op) is None
        and not planner.is_idempotent(op)
    ):
        raise StepStateError(
            f"outcome of {describe(op)} is unknown and it is neither idempotent nor has a "
            "reconcile hook, so a retry could repeat its effect; check with the provider "
            "and resolve it"
        )
    ceiling = op.max_attempts + extra_attempts
    if op.attempts >= ceiling:
        raise StepStateError(
            f"{describe(op)} has used {op.attempts} of its {op.max_attempts} attempts; "
            "raise its ceiling with extra attempts to retry it"
        )
    previous_status, previous_ceiling = op.status, op.max_attempts
    op.max_attempts = ceiling
    if op.status == OperationStatus.FAILED:
        planner.touch(op, status=OperationStatus.PENDING)
    else:
        # An unknown outcome stays unknown: the planner settles it (reconcile or retry).
        planner.changed(op)
    op.next_attempt_at = None
    planner.event(
        "retry_requested",
        op,
        actor=actor,
        previous_status=str(previous_status),
        extra_attempts=extra_attempts,
        previous_max_attempts=previous_ceiling,
        max_attempts=ceiling,
    )
    _resume(planner, now)
    return op


def request_cancel(
    planner: Planner, *, reason: str, actor: str | None, include_unknown: bool, now: datetime
) -> bool:
    """Stop forward progress and compensate what succeeded, in reverse; False when the
    saga is already compensating or compensated (nothing changes).

    With `include_unknown`, a saga already compensating, or parked while compensating,
    whose steps of unknown outcome have compensations is compensated as
    `request_compensation(include_unknown=True)` does: those compensations run too."""
    planner.now = now
    status = planner.saga.status
    if status == SagaStatus.COMPLETED:
        raise StepStateError(
            f"saga {planner.saga.id} is completed: there is no forward progress to stop "
            "(compensate undoes a completed saga)"
        )
    if planner.saga.direction == "backward":
        if status == SagaStatus.COMPENSATED:
            return False
        unknown = unknown_compensable(planner)
        if include_unknown and unknown:
            planner.events.append(
                Event(
                    "cancel_requested",
                    detail={"actor": actor, "reason": reason, "include_unknown": True},
                )
            )
            request_compensation(planner, include_unknown=True, actor=actor, now=now)
            planner.saga.error = f"cancelled by {actor or 'an operator'}: {reason}"
            return True
        if status == SagaStatus.COMPENSATING:
            return False
        if unknown:
            raise StepStateError(
                f"saga {planner.saga.id} is already compensating and parked: compensation "
                f"stopped at step {unknown[0]!r}, whose outcome is unknown; resolve it, or "
                "cancel again with include_unknown=True (its compensation then gets None as the "
                "step's result)"
            )
        raise StepStateError(
            f"saga {planner.saga.id} is already compensating and parked ({planner.saga.error}); "
            "retry or resolve the blocked compensation"
        )
    pivot = planner.succeeded_pivot()
    if pivot is not None:
        raise StepStateError(
            f"pivot step {pivot!r} of saga {planner.saga.id} has succeeded: it can only go "
            "forward (compensate it explicitly if you must undo it)"
        )
    planner.events.append(Event("cancel_requested", detail={"actor": actor, "reason": reason}))
    request_compensation(planner, include_unknown=include_unknown, actor=actor, now=now)
    planner.saga.error = f"cancelled by {actor or 'an operator'}: {reason}"
    return True


def unknown_compensable(planner: Planner) -> list[str]:
    """The steps of unknown outcome (or left running) that have a compensation and none
    yet, last first: what compensating with include_unknown adds."""
    return [
        act.step
        for act in reversed(planner.actions)
        if act.status in (OperationStatus.UNKNOWN, OperationStatus.RUNNING)
        and planner.compensation_of(act) is not None
        and planner.find(act.step, "compensation") is None
    ]


def raise_ceilings(
    planner: Planner,
    *,
    actor: str | None,
    max_operations: int | None = None,
    spend_budget: float | None = None,
    max_side_effects: int | None = None,
    extend_deadline_seconds: float | None = None,
    now: datetime,
) -> None:
    """An operator raises saga ceilings (never lowers them); a saga parked in
    needs_review becomes runnable again, its counters untouched.

    A ceiling the saga does not have is unlimited, the highest there is: setting
    one there would lower it, and is refused like any lowering. One refused
    ceiling refuses the whole request, changing nothing."""
    planner.now = now
    _refuse_when_final(planner, "raise a ceiling for")
    saga = planner.saga

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
        saga.deadline_at = max(saga.deadline_at, now) + timedelta(seconds=extend_deadline_seconds)
    planner.events.append(
        Event("ceilings_raised", detail={"actor": actor, "before": before, "after": ceilings()})
    )
    if saga.status == SagaStatus.NEEDS_REVIEW:
        _resume(planner, now)


def approve_confirmation(
    planner: Planner,
    step: str,
    request_hash: str,
    *,
    actor: str,
    now: datetime,
    approval: str | None = None,
) -> None:
    """A verified approval of the pending request of `step`: the saga may go on. The
    approval token is stored with the confirmation (workers with the approvers' public
    key verify it again before the attempt it releases)."""
    planner.now = now
    if planner.saga.status != SagaStatus.AWAITING_CONFIRMATION:
        raise StepStateError(
            f"saga {planner.saga.id} is {planner.saga.status}, not awaiting_confirmation"
        )
    pending = [c for c in planner.confirmations if c.step == step and c.approved_at is None]
    match = next((c for c in pending if c.request_hash == request_hash), None)
    if match is None:
        hashes = ", ".join(c.request_hash for c in pending) or "none"
        raise StepStateError(
            f"request hash {request_hash} does not match the pending request of step "
            f"{step!r} (pending: {hashes}); approve the request previewed now"
        )
    if match.expires_at <= now:
        raise StepStateError(
            f"the confirmation of step {step!r} expired at {match.expires_at}; run the saga "
            "again to prepare a new preview"
        )
    match.approved_by, match.approved_at = actor, now
    planner.confirmation_changed(match)
    match.approval = approval
    _resume(planner, now)
    planner.events.append(
        Event(
            "confirmation_approved",
            step=step,
            kind="action",
            detail={"actor": actor, "request_hash": request_hash},
        )
    )


def reopen_expired_confirmation(planner: Planner, *, now: datetime) -> bool:
    """Make a saga whose pending confirmation expired runnable, to preview again."""
    planner.now = now
    pending = pending_confirmation(planner.confirmations)
    if planner.saga.status != SagaStatus.AWAITING_CONFIRMATION or pending is None:
        return False
    if pending.expires_at > now:
        return False
    _resume(planner, now)
    planner.events.append(
        Event(
            "confirmation_expired",
            step=pending.step,
            kind="action",
            detail={"request_hash": pending.request_hash},
        )
    )
    return True


def compensation_plan(
    planner: Planner, *, include_unknown: bool
) -> tuple[list[tuple[str, str]], str | None]:
    """What compensating would run, changing nothing: (step, idempotency key) of each
    compensation in order, and why it would stop early (None when it would finish)."""
    runs: list[tuple[str, str]] = []
    for act in reversed(planner.actions):
        comp_def = planner.compensation_of(act)
        comp = planner.find(act.step, "compensation")
        unknown = act.status in (OperationStatus.UNKNOWN, OperationStatus.RUNNING)
        gets_comp = comp is not None or (include_unknown and comp_def is not None)
        if act.status == OperationStatus.SUCCEEDED or (unknown and gets_comp):
            if comp_def is None or (comp and comp.status == OperationStatus.SUCCEEDED):
                continue
            stop = None if comp is None else _plan_stop(planner, comp)
            if stop is not None:
                return runs, stop
            key = comp.idempotency_key if comp is not None else planner.compensation_key(act.step)
            runs.append((act.step, key))
        elif unknown:
            return runs, f"step {act.step!r} has an unknown outcome; " + unknown_remedy(comp_def)
    return runs, None


def null_result_compensations(planner: Planner, steps: Sequence[str]) -> list[tuple[str, str]]:
    """(step, compensation's name) of each of `steps` whose compensation would get None
    as the step's result, because the step's outcome is unknown (for dry runs)."""
    found: list[tuple[str, str]] = []
    for step in steps:
        act = planner.find(step, "action")
        comp_def = None if act is None else planner.compensation_of(act)
        if act is None or comp_def is None:
            continue
        if act.status in (OperationStatus.UNKNOWN, OperationStatus.RUNNING):
            found.append((step, getattr(comp_def.fn, "__name__", "compensation")))
    return found


def fresh_budgets(planner: Planner) -> list[tuple[str, int, int]]:
    """(step, ceiling now, ceiling after) of each compensation an explicit compensation
    request would give a fresh budget, changing nothing (for dry runs)."""
    raised: list[tuple[str, int, int]] = []
    for op in planner.ops:
        budget = _fresh_budget(planner, op)
        if budget is not None:
            raised.append((op.step, op.max_attempts, op.attempts + budget))
    return raised


def _fresh_budget(planner: Planner, op: OpRow) -> int | None:
    """The attempts an explicit compensation request adds to a compensation that
    failed at its ceiling (its policy's max_attempts); None for any other operation.

    A compensation that failed below its ceiling failed permanently: a raised
    ceiling would not change that, so it is left to `retry` or `resolve`.
    """
    if op.kind != "compensation" or op.status != OperationStatus.FAILED:
        return None
    if op.attempts < op.max_attempts:
        return None
    spec = planner.declared(op)
    return None if spec is None else spec.retry.max_attempts


def _plan_stop(planner: Planner, comp: OpRow) -> str | None:
    """Why compensating would stop at this open compensation (as the planner decides
    once `request_compensation` has switched to compensating), or None if it would run."""
    what = f"compensation of step {comp.step!r}"
    if comp.status == OperationStatus.FAILED:
        if _fresh_budget(planner, comp) is not None:
            return None  # the request gives it a fresh budget
        return (
            f"{what} failed permanently ({comp.error}); retry it "
            "(with --extra-attempts if needed) or resolve it"
        )
    if comp.status in (OperationStatus.UNKNOWN, OperationStatus.RUNNING):
        if planner.reconcile_fn(comp) is not None:
            return None  # its reconcile hook is asked; Absent runs it again
        if not planner.is_idempotent(comp):
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


def _refuse_when_final(planner: Planner, verb: str, step: str | None = None) -> None:
    """A completed or compensated saga never changes again: say what is left."""
    status = planner.saga.status
    if status == SagaStatus.COMPLETED:
        raise StepStateError(
            f"saga {planner.saga.id} is completed: nothing runs again, so there is nothing to "
            f"{verb}; compensate it to undo what it did"
        )
    if status == SagaStatus.COMPENSATED:
        what = f"; if step {step!r} took effect after all, undo it at the provider" if step else ""
        raise StepStateError(
            f"saga {planner.saga.id} is compensated: it is final and nothing runs again, so "
            f"there is nothing to {verb}{what}"
        )


def _refuse_success_behind_compensation(planner: Planner, op: OpRow) -> None:
    """Compensation runs in reverse: a step it has gone past can no longer become one
    that needs undoing."""
    if planner.compensation_of(op) is None:
        return  # nothing to undo either way
    ran = [
        c
        for c in planner.ops
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


def _resolution_target(planner: Planner, step: str, kind: Kind | None) -> OpRow:
    if planner.definition.step_named(step) is None:
        raise StepStateError(f"saga {planner.saga.name!r} has no step {step!r}")
    if kind is not None:
        op = planner.find(step, kind)
        if op is None:
            raise StepStateError(f"step {step!r} has no {kind} operation yet")
        return op
    comp = planner.find(step, "compensation")
    if comp is not None and comp.status != OperationStatus.SUCCEEDED:
        return comp
    action = planner.find(step, "action")
    assert action is not None  # every declared step has its action row
    return action


def _resume(planner: Planner, now: datetime) -> None:
    back = planner.saga.direction == "backward"
    planner.set_status(SagaStatus.COMPENSATING if back else SagaStatus.RUNNING)
    planner.saga.error = None
    planner.saga.run_after = now


# What a fork's source may be: going forward and not waiting for an answer (the lease is
# checked by the caller, under the row lock).
_FORKABLE = (
    SagaStatus.NEEDS_REVIEW,
    SagaStatus.PENDING,
    SagaStatus.RUNNING,
)
# A finished saga is forked too, when the fork repeats no effect (`_inherited`): the
# seed's "refine step N+1 without paying for steps 1..N again".
_FORKABLE_FINISHED = (SagaStatus.COMPLETED, SagaStatus.COMPENSATED)


@dataclass(frozen=True, slots=True)
class ForkPlan:
    """The saga a fork creates: its row, its operations (the inherited ones settled,
    with their results) and its first events; `from_step` is the step (or the call of a
    session, by its operation name) the fork runs from."""

    saga: SagaRow
    ops: list[OpRow]
    events: list[Event]
    inherited: tuple[str, ...]
    from_step: str


class AmbiguousCall(StepStateError):
    """A durable step's name names several unsettled calls of a session: the operator
    names one of them (the exception lists them)."""


def unsettled_call(
    session_id: str, ops: Sequence[OperationState], step: str, kind: Kind | None = None
) -> str:
    """The call of a session that an operator's `step` names: a call's operation name as
    given, or a durable step's plain name when exactly one call of that step is unsettled
    (its outcome unknown, running, waiting for a retry, or its compensation parked).
    `AmbiguousCall` listing the candidates when several are; `StepStateError` naming the
    calls when none is."""
    calls = [op.step for op in ops if op.kind == "action"]
    if step in calls:
        return step

    def unsettled(op: OperationState) -> bool:
        return (
            op.status in (OperationStatus.UNKNOWN, OperationStatus.RUNNING)
            or (op.status == OperationStatus.PENDING and op.attempts > 0)
            or (op.kind == "compensation" and op.status == OperationStatus.FAILED)
        )

    of_step = _calls_of(calls, step)
    open_steps = {op.step for op in ops if (kind is None or op.kind == kind) and unsettled(op)}
    candidates = [c for c in of_step if c in open_steps]
    if len(candidates) == 1:
        return candidates[0]
    if candidates:
        raise AmbiguousCall(
            f"session {session_id} has {len(candidates)} unsettled calls of durable step "
            f"{step!r}: {', '.join(candidates)}; name the one to resolve"
        )
    if of_step:
        raise StepStateError(
            f"session {session_id} has no unsettled call of durable step {step!r} (its "
            f"calls of it: {', '.join(of_step)}); name a call to resolve it"
        )
    raise _no_call(session_id, step, calls)


def session_call(session_id: str, ops: Sequence[OpRow], from_step: str) -> str:
    """The operation name of the call of a session that `from_step` names: that name
    itself (`charge.1a2b3c4d5e6f`, as `saga show` lists the calls), or a durable step's
    plain name when the session called that step exactly once. `StepStateError` naming
    the calls otherwise."""
    calls = [op.step for op in sorted(ops, key=lambda o: o.position) if op.kind == "action"]
    if from_step in calls:
        return from_step
    matching = _calls_of(calls, from_step)
    if len(matching) == 1:
        return matching[0]
    if matching:
        raise StepStateError(
            f"session {session_id} called durable step {from_step!r} {len(matching)} times "
            f"({', '.join(matching)}): fork from one of these calls, by its name"
        )
    raise _no_call(session_id, from_step, calls)


def _calls_of(calls: Sequence[str], step: str) -> list[str]:
    """The calls among `calls` (operation names, `charge.1a2b3c4d5e6f`) of durable step
    `step`, in their order."""
    return [call for call in calls if call.rsplit(".", 1)[0] == step]


def _no_call(session_id: str, name: str, calls: Sequence[str]) -> StepStateError:
    """The refusal of a `name` that names no call of the session, listing its `calls`."""
    listed = ", ".join(calls) if calls else "none yet"
    return StepStateError(f"session {session_id} has no call {name!r}; its calls: {listed}")


def fork(
    planner: Planner,
    from_step: str,
    *,
    fork_id: str,
    key: str,
    actor: str | None,
    deadline_at: datetime | None,
    now: datetime,
) -> ForkPlan:
    """Continue a saga as a new one that runs from `from_step` on, inheriting the stored
    results of the steps before it without calling them again.

    The saga must be held by no worker (the caller checks the lease under the row lock)
    and either going forward (parked, or runnable after an operator's resolve) or
    finished (completed or compensated). Every step before `from_step` must have
    succeeded, its effect not undone (an unknown outcome is reconciled or resolved
    first), and no step from `from_step` on may have an effect the fork would repeat:
    each one either took no effect (not succeeded, nor running or unknown), is declared
    `side_effect=False`, or was compensated; so that no effect is ever left to nobody or
    made twice. The source becomes `forked`: final, its inherited effects now the fork's
    to compensate. Refusals raise `StepStateError` naming the step, and change nothing.

    A session is forked from one of its calls (`session_call` names it): the fork is a
    session of the same name and tenant whose key is `key`, holding the calls made before
    that one, settled as they were (a call that failed, which the session's code went on
    from, is inherited as failed and replays its failure); the calls from there on are
    made afresh when the fork's code makes them again.
    """
    planner.now = now
    saga = planner.saga
    session = planner.definition.is_session
    what = "call" if session else "step"
    if session:
        from_step = session_call(saga.id, planner.ops, from_step)
    target = planner.definition.step_named(from_step)
    if target is None:
        names = ", ".join(step.name for step in planner.definition.steps)
        raise StepStateError(f"saga {saga.name!r} has no step {from_step!r}; its steps: {names}")
    _refuse_unforkable(planner, session)
    inherited = _inherited(planner, target.index, from_step, what=what, keep_failed=session)
    if session:
        ops = [_inherited_call(saga, key, act) for act in inherited]
    else:
        ops = new_action_rows(planner.definition, saga.tenant_id, key, planner.business_input())
        by_step = {act.step: act for act in inherited}
        for op in ops:
            source = by_step.get(op.step)
            if source is not None:
                _inherit(op, source)
    steps = tuple(act.step for act in inherited)
    row = dataclasses.replace(
        saga,
        id=fork_id,
        key=key,
        status=SagaStatus.PENDING,
        error=None,
        direction="forward",
        fence=0,
        run_after=None,
        lease_owner=None,
        lease_expires_at=None,
        created_at=None,
        updated_at=None,
        deadline_at=deadline_at,
        forked_from=saga.id,
        forked_to=None,
    )
    started = (
        Event("session_started")
        if session
        else Event("saga_started", detail={"input_hash": saga.input_hash})
    )
    events = [
        started,
        Event(
            "saga_forked_from",
            detail={"saga_id": saga.id, "from_step": from_step, "actor": actor, "inherited": steps},
        ),
    ]
    saga.status = SagaStatus.FORKED
    saga.forked_to = fork_id
    runs = "the fork's session runs" if session else "the fork runs"
    saga.error = (
        f"forked to {fork_id} from {what} {from_step!r}: {runs} from there, and what "
        f"this {'session' if session else 'saga'} did is the fork's to compensate"
    )
    saga.run_after = None
    planner.events.append(
        Event(
            "saga_forked",
            detail={"to": fork_id, "from_step": from_step, "actor": actor, "inherited": steps},
        )
    )
    return ForkPlan(saga=row, ops=ops, events=events, inherited=steps, from_step=from_step)


def _refuse_unforkable(planner: Planner, session: bool) -> None:
    """A fork's source goes forward, is not final, and has undone nothing."""
    saga = planner.saga
    if saga.status in _FORKABLE_FINISHED:
        return  # each step is checked by `_inherited`
    if saga.status not in _FORKABLE:
        if session:
            raise StepStateError(
                f"session {saga.id} is {saga.status.value}: only a session going forward that "
                "no process holds (parked, or left open by its code), or a finished one, is "
                "forked"
            )
        raise StepStateError(
            f"saga {saga.id} is {saga.status.value}: only a saga going forward that no "
            "worker holds (parked, or pending or running between two owners), or a finished "
            "one, is forked; one that awaits a confirmation is answered first, and one that "
            "is compensating finishes first"
        )
    if saga.direction != "forward" or any(
        c.kind == "compensation" and (c.attempts > 0 or c.status == OperationStatus.SUCCEEDED)
        for c in planner.ops
    ):
        raise StepStateError(
            f"saga {saga.id} was compensating when it parked: what it undid cannot be "
            "inherited; finish its compensation instead (compensate or resolve)"
        )


def _inherited(
    planner: Planner, position: int, from_step: str, *, what: str, keep_failed: bool
) -> list[OpRow]:
    """The actions before `position`, each settled (succeeded, or with `keep_failed`
    failed); `StepStateError` when one is not, or when an action from `position` on may
    have taken effect."""
    inherited: list[OpRow] = []
    for act in planner.actions:
        settled = act.status == OperationStatus.SUCCEEDED
        unsure = act.status in (OperationStatus.UNKNOWN, OperationStatus.RUNNING)
        undo = planner.find(act.step, "compensation")
        undone = undo is not None and undo.status == OperationStatus.SUCCEEDED
        undoing = undo is not None and not undone and undo.attempts > 0
        if act.position < position and (undone or undoing):
            raise StepStateError(
                f"{what} {act.step!r} before {from_step!r} was "
                f"{'compensated' if undone else 'being compensated'}: its effect is undone, "
                f"so a fork cannot inherit its result; fork from {act.step!r} or before it"
            )
        if act.position >= position and settled and (undone or not _has_effect(planner, act)):
            continue  # nothing the fork would repeat: no effect, or one undone
        if act.position >= position and undoing:
            raise StepStateError(
                f"{what} {act.step!r}'s compensation is {undo.status.value if undo else ''}: "
                f"its effect may still be in place, and a fork from {from_step!r} would run "
                "it again under a new key; settle the compensation first"
            )
        if act.position < position:
            if unsure:
                raise StepStateError(
                    f"{what} {act.step!r} before {from_step!r} has an unknown outcome: "
                    "reconcile or resolve it first, so that the fork inherits what really "
                    "happened"
                )
            if not settled and not (keep_failed and act.status == OperationStatus.FAILED):
                raise StepStateError(
                    f"{what} {act.step!r} before {from_step!r} has not succeeded "
                    f"({act.status.value}): fork from {act.step!r} instead"
                )
            inherited.append(act)
        elif settled:
            raise StepStateError(
                f"{what} {act.step!r} succeeded: a fork from {from_step!r} would run it again "
                f"under a new key and repeat its effect (it is not declared side_effect=False, "
                f"and was not compensated); fork from a later {what}"
            )
        elif unsure:
            raise StepStateError(
                f"{what} {act.step!r} has an unknown outcome: its effect may be in place, and a "
                f"fork from {from_step!r} would run it again under a new key; resolve it first"
            )
    return inherited


def _inherited_call(saga: SagaRow, key: str, source: OpRow) -> OpRow:
    """The operation of a session's fork (key `key`) holding call `source` of the
    session, settled as it is there (a failure with its error), under an idempotency key
    of the fork's own."""
    op = OpRow(
        step=source.step,
        kind="action",
        position=source.position,
        idempotency_key=operation_key(
            saga.name, saga.version, saga.tenant_id, key, source.step, "action"
        ),
        request_hash=source.request_hash,
        status=source.status,
        attempts=source.attempts,
        max_attempts=source.max_attempts,
        error=source.error,
    )
    _inherit(op, source)
    return op


def _inherit(op: OpRow, source: OpRow) -> None:
    """Settle `op` (a fork's) as `source` (its source's) is."""
    op.status = source.status
    op.attempts = source.attempts
    op.max_attempts = source.max_attempts
    op.result = source.result
    op.provider_reference = source.provider_reference
    op.started_at, op.finished_at = source.started_at, source.finished_at
    op.request, op.request_hash = source.request, source.request_hash
    op.spent, op.peak_spend = source.spent, source.peak_spend


def _has_effect(planner: Planner, act: OpRow) -> bool:
    """Whether the step of `act` takes an effect outside (not declared
    `side_effect=False`); a step not known here is taken to."""
    step = planner.definition.step_named(act.step)
    return step is None or step.guards.side_effect


def refuse_when_forked(planner: Planner, verb: str) -> None:
    """A forked saga never changes again: its effects belong to the fork."""
    saga = planner.saga
    if saga.status == SagaStatus.FORKED:
        raise StepStateError(
            f"saga {saga.id} was forked to {saga.forked_to}: it is final and what it did "
            f"belongs to the fork; {verb} saga {saga.forked_to} instead"
        )


def check_actor(verb: str, actor: str) -> str:
    """`actor` when it names someone; `ValueError` naming `verb` when it is empty or blank.

    An actor is who makes an operator's change (a person, or the system acting for
    one), recorded with it in the saga's audit trail.
    """
    if not isinstance(actor, str) or not actor.strip():
        raise ValueError(
            f"{verb}() needs an actor: who makes this change (a person or a system), "
            f"recorded in the saga's audit trail; got {actor!r}"
        )
    return actor
