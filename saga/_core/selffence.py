"""Self-fencing: when an owner may still start a call under its lease.

A lease is set by the server, from its own clock at or after the moment the write that
set it was sent: it ends no earlier than `lease_seconds` after that send. An owner that
measures from the send (never from the reply, which may come much later: a pooler that
held the statement, a reply lost and its landing found again) knows a moment before which
the lease cannot have ended. It starts no call at or past that moment less a margin;
a taker, which takes a lease only once the server says it has ended, thus waits out the
margin too. Past it, the owner confirms its lease again (a fenced renewal) before it
calls, or stops when the lease is no longer its own.
"""

from __future__ import annotations

SELF_FENCE_MARGIN = 0.25  # of lease_seconds: the gap between an owner's last call and a taker


def self_fence_margin(lease_seconds: float) -> float:
    """How long before its lease could end an owner stops starting calls (seconds)."""
    return lease_seconds * SELF_FENCE_MARGIN


def may_start_call(confirmed_at: float | None, now: float, lease_seconds: float) -> bool:
    """Whether an owner whose lease was last confirmed by a write sent at `confirmed_at`
    (monotonic seconds; None: unknown) may start a call at `now`: only while the lease
    cannot have ended, less the margin."""
    if confirmed_at is None:
        return False
    return now - confirmed_at < lease_seconds - self_fence_margin(lease_seconds)
