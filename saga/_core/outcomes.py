"""What an operation's outcome does to a saga: the runner's reports, applied.

Each report (an attempt returned, raised, timed out or was never made; a reconcile
hook answered; a prepare hook computed a request or raised) changes the operation and,
where it must, the saga (a park, a retry's backoff, the spend counted), and records its
audit events. `saga._core.inputs` applies outcomes as values through these methods; the
planner (`saga._core.planner`) decides what comes next.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from saga._core import ceilings
from saga._core.rows import OpRow, describe
from saga._core.snapshot import Snapshot
from saga.keys import HASH_VERSION, canonical_json, request_hash, same_request
from saga.state import OperationStatus


class Outcomes(Snapshot):
    """A snapshot that records what became of its operations' attempts."""

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
            op.error = reason
            self.changed(op)
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
        self.changed(op)
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
        self.changed(op)
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
        self.changed(op)
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
        self.changed(op)
        detail: dict[str, Any] = {"error": error, "retryable": False, "retry_in_seconds": None}
        if traceback is not None:
            detail["traceback"] = traceback
        self.event("attempt_failed", op, **detail, parked=True)
        self.park(
            f"prepare of {describe(op)} raised {error.removeprefix('prepare failed: ')}; "
            "nothing was called; fix it, then retry, resolve or compensate"
        )

    def _park_unknown(self, op: OpRow, why: str) -> None:
        """Park an operation one of whose attempts has an unknown outcome: `why` says why
        it cannot be retried; only a success, a reconcile answer or an operator settles it."""
        self.touch(op, status=OperationStatus.UNKNOWN)
        self.park(
            f"{describe(op)} cannot be retried ({why}) and an earlier attempt's outcome "
            "is unknown: its effect may be in place; resolve it"
        )

    def _count_unknown_spend(self, op: OpRow) -> str | None:
        """Count the spend of `op`'s attempt of unknown outcome (`ceilings.count_unknown_spend`);
        why the saga must park instead, or None."""
        if ceilings.unknown_spend_counted(op):
            return None
        # Counted with the operation's change to unknown, which notes the row anyway.
        self.changed(op)
        return ceilings.count_unknown_spend(self.saga, op, self.declared(op))
