"""Confirmations: an attempt that needs one starts only with an approval of exactly what
it would do, and uses that approval up.

The planner asks `holds_back` before each attempt; the approver is shown a preview of
the attempt, and an approval is bound to that preview's hash (`saga.approvals`). Like
the rest of the core, this module does no I/O and reads no clock: the time is the
planner's `now`.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

from saga.approvals import preview_hash
from saga.definition import OperationSpec
from saga.rows import ConfirmationRow, Event, OpRow, describe
from saga.state import OperationStatus, SagaStatus

if TYPE_CHECKING:
    from saga.protocol import Planner


def holds_back(planner: Planner, op: OpRow, spec: OperationSpec, cost: float | None) -> bool:
    """Whether a confirmation holds back the attempt of `op` about to start (of declared
    `cost`): True when the operation needs confirming and no approval releases this
    attempt; the confirmation is then asked for and the saga awaits it. An approval
    that releases the attempt is used up by it."""
    if not _needs_confirmation(planner, op, spec) or _use_approval(planner, op, spec, cost):
        return False
    _await_confirmation(planner, op, spec, cost)
    return True


def pending_confirmation(planner: Planner) -> ConfirmationRow | None:
    """The confirmation the saga waits for (the newest unapproved one), or None."""
    waiting = [c for c in planner.confirmations if c.approved_at is None]
    return max(waiting, key=lambda c: c.expires_at) if waiting else None


def _needs_confirmation(planner: Planner, op: OpRow, spec: OperationSpec) -> bool:
    policy = spec.guards.confirm
    if isinstance(policy, bool):
        return policy
    return bool(policy(planner.request_of(op)))


def _use_approval(planner: Planner, op: OpRow, spec: OperationSpec, cost: float | None) -> bool:
    """Whether an approval releases the attempt of `op` about to start, which then
    uses it up (recorded with that attempt's start: one approval, one attempt).

    Only an approval of exactly what would be previewed now (its hash covers the
    attempt's number, so every retry needs a new one), not yet used, and whose
    confirmation has not expired, releases anything."""
    digest = _preview(planner, op, spec, cost)["request_hash"]
    confirmation = _confirmation_for(planner, op.step, digest)
    if (
        confirmation is None
        or confirmation.approved_at is None
        or confirmation.consumed_attempt is not None
    ):
        return False
    if confirmation.expires_at <= planner.now:
        planner.events.append(
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
    planner.events.append(
        Event(
            "approval_used",
            step=op.step,
            kind=op.kind,
            attempt=attempt,
            detail={"request_hash": digest, "approved_by": confirmation.approved_by},
        )
    )
    return True


def _confirmation_for(planner: Planner, step: str, digest: str) -> ConfirmationRow | None:
    # At most one: (saga, step, request hash) is the confirmations' primary key.
    return next(
        (c for c in planner.confirmations if c.step == step and c.request_hash == digest),
        None,
    )


def _preview(
    planner: Planner, op: OpRow, spec: OperationSpec, cost: float | None
) -> dict[str, Any]:
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
    if planner.saga.spend_budget is not None:
        checks.append(
            {
                "check": "spend_budget",
                "limit": planner.saga.spend_budget,
                "spent": planner.saga.spent,
            }
        )
    given = planner.input_model().model_dump(mode="json")  # what the step receives
    prepared = spec.prepare_fn is not None and op.request is not None
    preview: dict[str, Any] = {
        "target": describe(op),
        "step": op.step,
        "idempotency_key": op.idempotency_key,
        "attempt": op.attempts + 1,
        # The request the attempt acts on: the prepared one (ctx.request), else the input.
        "payload": op.request if prepared else given,
        **({"input": given} if prepared else {}),
        # ctx.results, as stored.
        "results": {
            o.step: o.result for o in planner.actions if o.status == OperationStatus.SUCCEEDED
        },
        "amount": cost,
        "policy_checks": checks,
    }
    preview["request_hash"] = preview_hash(preview)
    return preview


def _await_confirmation(
    planner: Planner, op: OpRow, spec: OperationSpec, cost: float | None
) -> None:
    preview = _preview(planner, op, spec, cost)
    digest = preview["request_hash"]
    expires_at = planner.now + timedelta(seconds=spec.guards.confirm_ttl_seconds)
    existing = _confirmation_for(planner, op.step, digest)
    if existing is None:
        planner.confirmations.append(
            ConfirmationRow(op.step, digest, preview, expires_at, new=True)
        )
    else:
        # Asked again (it expired, approved or not): an earlier approval is withdrawn.
        existing.preview, existing.expires_at = preview, expires_at
        existing.approved_by = existing.approved_at = existing.consumed_attempt = None
        existing.new, existing.dirty = True, False
    planner.set_status(SagaStatus.AWAITING_CONFIRMATION)
    planner.saga.error = (
        f"{describe(op)} waits for confirmation of attempt {op.attempts + 1} (request {digest})"
    )
    planner.event(
        "confirmation_requested",
        op,
        request_hash=digest,
        preview=preview,
        expires_at=str(expires_at),
    )
