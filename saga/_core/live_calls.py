"""Calls in flight under a live lease, and the operator requests that must not touch them.

A declared saga is held whole by one lease, on its row: an operator's change to it is
refused while that lease is live, unless forced. A ledger channel's calls are held one by
one, each by a claim of its own on its operation row, and a session's running call by the
session's lease. An operator's request that would take over or undo a call in flight (a
compensation, with or without `include_unknown`, a cancel, a resolve of that call) is
refused the same way, naming the call, its holder and when its lease ends; forced, the
claims are broken first, so that their holders' later writes are refused.

Pure rules, no I/O: the engine reads the calls (`Store.running_calls_txn`) and carries
out what these decide.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from saga._core import inputs


@dataclass(frozen=True, slots=True)
class RunningCall:
    """An operation left `running`, with the claim that holds it (ledger calls)."""

    step: str
    kind: str
    claim_owner: str | None
    claim_expires_at: datetime | None
    claimed: bool  # held by a live claim of its own, by the database's clock


def touched(change: inputs.Request, calls: Sequence[RunningCall]) -> list[RunningCall]:
    """The calls held by a live claim that `change` would take over or undo: every one
    for a compensation or a cancel, the resolved one for a resolve, none otherwise."""
    claimed = [c for c in calls if c.claimed]
    if isinstance(change, inputs.RequestCompensation | inputs.RequestCancel):
        return claimed
    if isinstance(change, inputs.Resolve):
        return [c for c in claimed if c.step == change.step and change.kind in (None, c.kind)]
    return []


def claimed_refusal(saga_id: str, calls: Sequence[RunningCall]) -> str:
    """Why an operator's change to saga `saga_id` is refused: `calls` are held by live
    claims (the wording of a declared saga's live lease, with the call named)."""
    held = ", ".join(
        f"call {c.step} is leased by {c.claim_owner} until {c.claim_expires_at}" for c in calls
    )
    return (
        f"saga {saga_id}: {held}; wait for it to be settled or for the lease to expire, or force it"
    )


def leased_refusal(
    saga_id: str, owner: str | None, expires_at: datetime | None, calls: Sequence[RunningCall]
) -> str:
    """Why an operator's change to saga `saga_id` is refused: its own lease is live (the
    calls running under it, if any, named)."""
    running = ", ".join(c.step for c in calls if not c.claimed)
    under = f" (call {running} running under it)" if running else ""
    return (
        f"saga {saga_id} is leased by {owner} until {expires_at}{under}; wait for it to stop "
        "or for the lease to expire, or force it"
    )
