"""Confirmations: an attempt that needs one starts only with an approval of exactly what
it would do, and uses that approval up.

The planner asks `holds_back` before each attempt; the approver is shown a preview of
the attempt, and an approval is bound to that preview's hash (`saga.approvals`). Like
the rest of the core, this module does no I/O and reads no clock: the time is the
planner's `now`.

With signed approvals (the planner has an `approval_verifier`, built from the approvers'
public key), the approval stored with the confirmation is verified here, before every
attempt it would release: the confirmation row's `approved_at` and `approved_by` are
columns anything holding the database credentials can write, so they prove nothing by
themselves. An approval that is missing, altered, signed with another key, expired or
bound to another saga, step or request releases nothing: the confirmation is asked for
again and the refusal is in the audit trail (`approval_refused`). Verifying is pure
computation on data the planner was given, so it belongs to the core and both drivers
share it. Without a verifier (the HMAC `confirmation_key` mode), the token was checked
by `confirm()` and the row is trusted, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from saga._core.rows import ConfirmationRow, Event, OpRow, SagaRow, describe
from saga.approvals import Approval, ApprovalRejected, preview_hash
from saga.definition import OperationSpec
from saga.keys import HASH_VERSIONS
from saga.state import OperationStatus

if TYPE_CHECKING:
    from saga.approvals import ApprovalVerifier


@dataclass(frozen=True, slots=True)
class Gate:
    """What the check before an attempt reads: the saga's rows, the time, and the
    values the attempt would receive (asked only when a policy or a preview needs them)."""

    saga: SagaRow
    ops: Sequence[OpRow]
    confirmations: Sequence[ConfirmationRow]
    now: datetime
    verifier: ApprovalVerifier | None
    # The request the attempt acts on (what a confirm policy is given).
    request: Callable[[], Any]
    # The saga input, validated into its model (what the step receives).
    given: Callable[[], Any]


@dataclass(slots=True)
class Verdict:
    """What the check answers: whether the attempt is held back, the events to record,
    the confirmation asked for (a new row, or a row already read, asked for again with
    a new preview: updated in place), the confirmation whose approval the attempt uses
    up (updated in place), and, when held, the saga's error while it awaits the
    confirmation. The planner adds a new row and notes both as changed."""

    held: bool = False
    events: list[Event] = field(default_factory=list)
    asked: ConfirmationRow | None = None
    used: ConfirmationRow | None = None
    error: str | None = None


def holds_back(gate: Gate, op: OpRow, spec: OperationSpec, cost: float | None) -> Verdict:
    """Whether a confirmation holds back the attempt of `op` about to start (of declared
    `cost`): held when the operation needs confirming and no approval releases this
    attempt; the confirmation is then asked for and the saga awaits it. An approval
    that releases the attempt is used up by it. The planner applies the verdict."""
    verdict = Verdict()
    if not _needs_confirmation(gate, spec):
        return verdict
    released, refused = _use_approval(gate, op, spec, cost, verdict)
    if released:
        return verdict
    _await_confirmation(gate, op, spec, cost, verdict, refused=refused)
    return verdict


def pending_confirmation(confirmations: Sequence[ConfirmationRow]) -> ConfirmationRow | None:
    """The confirmation the saga waits for (the newest unapproved one), or None."""
    waiting = [c for c in confirmations if c.approved_at is None]
    return max(waiting, key=lambda c: c.expires_at) if waiting else None


def _needs_confirmation(gate: Gate, spec: OperationSpec) -> bool:
    policy = spec.guards.confirm
    if isinstance(policy, bool):
        return policy
    return bool(policy(gate.request()))


def _use_approval(
    gate: Gate, op: OpRow, spec: OperationSpec, cost: float | None, verdict: Verdict
) -> tuple[bool, str | None]:
    """Whether an approval releases the attempt of `op` about to start, which then
    uses it up (recorded with that attempt's start: one approval, one attempt; the
    row is `verdict.used`, its events in `verdict.events`), and why
    a stored approval was refused (None when none was).

    Only an approval of exactly what would be previewed now (its hash covers the
    attempt's number, so every retry needs a new one), not yet used, and whose
    confirmation has not expired, releases anything; with signed approvals, only when
    the approval stored with it verifies too."""
    preview = _preview(gate, op, spec, cost)
    digest = preview["request_hash"]
    confirmation = _confirmation_for(gate, op.step, digest)
    if confirmation is None:
        # Asked and approved before an upgrade of the hash: bound to the preview's hash
        # under the version of its day.
        for earlier in (preview_hash(preview, version=v) for v in HASH_VERSIONS):
            found = None if earlier == digest else _confirmation_for(gate, op.step, earlier)
            if found is not None:
                digest, confirmation = earlier, found
                break
    if (
        confirmation is None
        or confirmation.approved_at is None
        or confirmation.consumed_attempt is not None
    ):
        return False, None
    events = verdict.events
    if confirmation.expires_at <= gate.now:
        events.append(
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
        return False, None
    granted, refused = _signed_approval(gate, op, confirmation, digest, events)
    if refused is not None:
        return False, refused
    attempt = op.attempts + 1
    confirmation.consumed_attempt = attempt
    verdict.used = confirmation
    detail: dict[str, Any] = {"request_hash": digest}
    if granted is None:
        detail["approved_by"] = confirmation.approved_by
    else:
        # Who approved, as the signature says: the row's approved_by is only a column.
        detail.update(approved_by=granted.actor, signed=True)
    events.append(
        Event("approval_used", step=op.step, kind=op.kind, attempt=attempt, detail=detail)
    )
    return True, None


def _signed_approval(
    gate: Gate, op: OpRow, confirmation: ConfirmationRow, digest: str, events: list[Event]
) -> tuple[Approval | None, str | None]:
    """With signed approvals, the approval stored with `confirmation` once it verifies
    for the attempt of `op` about to start (previewed as `digest`), or why it does not
    (also recorded as an `approval_refused` event); without them, (None, None): the
    HMAC token was verified by `confirm()`, and the row is trusted."""
    verifier = gate.verifier
    if verifier is None:
        return None, None
    try:
        granted = verifier.verify(
            confirmation.approval,
            saga_id=gate.saga.id,
            step=op.step,
            request_hash=digest,
            now=gate.now.timestamp(),
        )
    except ApprovalRejected as exc:
        events.append(
            Event(
                "approval_refused",
                step=op.step,
                kind=op.kind,
                attempt=op.attempts + 1,
                detail={
                    "request_hash": digest,
                    "reason": str(exc),
                    # What the row claims, recorded as claimed: it proved nothing.
                    "claimed_by": confirmation.approved_by,
                },
            )
        )
        return None, str(exc)
    return granted, None


def _confirmation_for(gate: Gate, step: str, digest: str) -> ConfirmationRow | None:
    # At most one: (saga, step, request hash) is the confirmations' primary key.
    return next(
        (c for c in gate.confirmations if c.step == step and c.request_hash == digest),
        None,
    )


def _preview(gate: Gate, op: OpRow, spec: OperationSpec, cost: float | None) -> dict[str, Any]:
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
    if gate.saga.spend_budget is not None:
        checks.append(
            {
                "check": "spend_budget",
                "limit": gate.saga.spend_budget,
                "spent": gate.saga.spent,
            }
        )
    given = gate.given().model_dump(mode="json")  # what the step receives
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
            o.step: o.result
            for o in sorted(gate.ops, key=lambda o: o.position)
            if o.kind == "action" and o.status == OperationStatus.SUCCEEDED
        },
        "amount": cost,
        "policy_checks": checks,
    }
    preview["request_hash"] = preview_hash(preview)
    return preview


def _await_confirmation(
    gate: Gate,
    op: OpRow,
    spec: OperationSpec,
    cost: float | None,
    verdict: Verdict,
    *,
    refused: str | None = None,
) -> None:
    preview = _preview(gate, op, spec, cost)
    digest = preview["request_hash"]
    expires_at = gate.now + timedelta(seconds=spec.guards.confirm_ttl_seconds)
    existing = _confirmation_for(gate, op.step, digest)
    if existing is None:
        verdict.asked = ConfirmationRow(op.step, digest, preview, expires_at)
    else:
        # Asked again (it expired, approved or not): an earlier approval is withdrawn.
        existing.preview, existing.expires_at = preview, expires_at
        existing.approved_by = existing.approved_at = existing.consumed_attempt = None
        existing.approval = None
        verdict.asked = existing
    verdict.held = True
    verdict.error = (
        f"{describe(op)} waits for confirmation of attempt {op.attempts + 1} (request {digest})"
    )
    if refused is not None:
        verdict.error += f"; the stored approval was refused: {refused}"
    verdict.events.append(
        Event(
            "confirmation_requested",
            op.step,
            op.kind,
            op.attempts or None,
            {"request_hash": digest, "preview": preview, "expires_at": str(expires_at)},
        )
    )
