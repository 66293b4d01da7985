"""What a transition writes: the record of the rows it changed, and the lease decision.

The core changes a saga's rows in memory; each change goes through the planner, which
notes the row here (`Changes`), so that no row carries a flag and nothing outside the
planner marks one. `Planner.write` hands the record over as one `Write` and starts a
new one: the rows noted since the last write, in the snapshot's order, and what becomes
of the lease (`lease_after`).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Literal

from saga._core.moves import Next, Sleep, Stop, Yield
from saga._core.rows import ConfirmationChange, ConfirmationRow, Event, OpRow, SagaRow


class Changes:
    """The rows changed since the last write, each noted once: the operations added
    (`added`) and changed (`ops`), the confirmations asked for (`asked`) and the ones
    approved or used up (`confirmed`). Rows are noted by identity (`id`: the snapshot
    holds each row once, for as long as the planner lives), so noting costs a set
    insertion, and nothing is compared or copied. Only the planner notes rows
    (`saga._core.snapshot.Snapshot.changed` and its siblings)."""

    __slots__ = ("added", "asked", "confirmed", "ops")

    def __init__(self) -> None:
        self.added: set[int] = set()
        self.ops: set[int] = set()
        self.asked: set[int] = set()
        self.confirmed: set[int] = set()

    def take_ops(self, ops: Sequence[OpRow]) -> tuple[tuple[OpRow, ...], tuple[OpRow, ...]]:
        """The operations of `ops` added and changed since the last call, in the order of
        `ops`; the record of them starts afresh."""
        added, changed = self.added, self.ops
        if not added and not changed:
            return (), ()
        self.added, self.ops = set(), set()
        new: list[OpRow] = []
        rest: list[OpRow] = []
        for op in ops:
            key = id(op)
            if key in added:
                new.append(op)
            elif key in changed:
                rest.append(op)
        return tuple(new), tuple(rest)

    def take_confirmations(self, rows: Sequence[ConfirmationRow]) -> tuple[ConfirmationChange, ...]:
        """The confirmation changes since the last call, in the order of `rows`: `ask`
        for a row asked for, else `consume` for a row whose approval an attempt used up,
        `approve` for one approved; the record of them starts afresh."""
        asked, confirmed = self.asked, self.confirmed
        if not asked and not confirmed:
            return ()
        self.asked, self.confirmed = set(), set()
        changes: list[ConfirmationChange] = []
        for row in rows:
            if id(row) in asked:
                changes.append(ConfirmationChange("ask", row))
            elif id(row) in confirmed:
                action: Literal["approve", "consume"] = (
                    "consume" if row.consumed_attempt is not None else "approve"
                )
                changes.append(ConfirmationChange(action, row))
        return tuple(changes)


def lease_after(
    saga: SagaRow,
    nxt: Next | None,
    *,
    owner: str | None,
    now: datetime,
    max_inline_sleep: float,
    events: list[Event],
) -> tuple[bool, bool]:
    """What becomes of the lease with the write given the next move `nxt`: whether the
    write gives it back (`release`) and tells the workers (`notify`); the
    `lease_released` event is added to `events`, and the saga's run_after set, as they
    decide.

    For the lease holder (`owner`): a stop or a shutdown gives the lease back (a
    shutdown with the saga runnable at once, and workers told); a backoff persists
    its end as run_after and keeps the lease when it is no longer than
    `max_inline_sleep` seconds (waited out under the heartbeat), else gives it back.
    `owner=None` is an operator's change under the row lock: the lease ends, and
    workers are told when the saga is runnable."""
    if owner is None:
        return True, saga.status.is_runnable
    if isinstance(nxt, Sleep):
        saga.run_after = nxt.until
        if (nxt.until - now).total_seconds() > max_inline_sleep:
            events.append(Event("lease_released", detail={"owner": owner, "reason": "backoff"}))
            return True, False
        # Otherwise the lease is kept through the backoff, renewed by the heartbeat while
        # the driver waits (a lease is a liveness signal, never stretched).
        return False, False
    if isinstance(nxt, Yield):
        saga.run_after = now
        events.append(Event("lease_released", detail={"owner": owner, "reason": "shutdown"}))
        return True, True
    if isinstance(nxt, Stop):
        events.append(Event("lease_released", detail={"owner": owner}))
        return True, False
    return False, False
