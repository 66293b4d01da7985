"""Carries out the protocol's decisions for one saga: transactions, calls, heartbeats."""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from saga import abandoned, faults
from saga.context import StepContext
from saga.dbretry import is_transient, log_retry, retrying
from saga.definition import Saga
from saga.errors import LeaseLost
from saga.leases import LeaseKeeper
from saga.logs import get_logger, step_logger
from saga.outcomes import Absent, Found, Inconclusive
from saga.protocol import (
    AskReconcile,
    ConfirmationRow,
    Event,
    Invoke,
    Next,
    OpRow,
    Planner,
    Prepare,
    SagaRow,
    Sleep,
    Stop,
    Yield,
)
from saga.state import OperationStatus, SagaState
from saga.store import Conn, Loaded, Store, new_token

_log = get_logger("saga")

Mutation = Callable[[Planner], None]


@dataclass(frozen=True, slots=True)
class RunnerOptions:
    """How a runner holds leases and waits.

    Attributes:
        owner: Lease owner name written to the database.
        lease_seconds: Lease length; renewed by every write and by the heartbeat.
        heartbeat_seconds: Interval of lease renewal while user code runs.
        max_inline_sleep: Longest retry backoff (seconds) waited out under the lease;
            a longer one is persisted as `run_after` and the lease released.
    """

    owner: str
    lease_seconds: float
    heartbeat_seconds: float
    max_inline_sleep: float = math.inf


class Runner:
    """Drives claimed sagas under a lease; every write is fenced."""

    def __init__(
        self,
        store: Store,
        options: RunnerOptions,
        *,
        keeper: LeaseKeeper,
        stopping: threading.Event | None = None,
    ) -> None:
        self.store = store
        self.keeper = keeper
        self.options = options
        self.owner = options.owner
        self.lease_seconds = options.lease_seconds
        self.stopping = stopping or threading.Event()

    # ----- entry points ------------------------------------------------------------------

    def claim_and_drive(self, definition: Saga[Any], saga_id: str) -> SagaState | None:
        """Claim one saga and drive it until it stops; None when it could not be claimed
        (or was lost to another owner on the way).

        A claim whose reply was lost is recognised by the token of its first write: the
        retry then carries on with the saga it holds instead of finding it leased (to
        itself) and giving up."""
        token = new_token()
        retried = False
        for attempt in retrying("claim_saga"):
            with attempt:
                claimed = self._reclaim(definition, saga_id, token) if retried else None
                retried = True
                if claimed is None:
                    claimed = self._claim_by_id(definition, saga_id, token)
        if claimed is None:
            return None
        return self.drive(*claimed)

    def _claim_by_id(
        self, definition: Saga[Any], saga_id: str, token: str
    ) -> tuple[Planner, Next] | None:
        with self.store.pipelined() as conn:
            loaded = self.store.claim_txn(
                conn, saga_id, owner=self.owner, lease_seconds=self.lease_seconds
            )
            if loaded is None:
                return None
            planner, nxt, events = self._begin_txn(conn, definition, loaded, token)
        log_events(planner, events)
        return planner, nxt

    def claim_next(
        self, kinds: Sequence[str], lookup: Callable[[str, int], Saga[Any]]
    ) -> tuple[Planner, Next] | None:
        """Claim the longest-waiting runnable saga of these name:version kinds and plan its
        first move in the same transaction; None when there is nothing to claim.

        A transient database error is retried; a claim that had landed although its reply
        was lost is found again by its token and carried on."""
        token = new_token()
        retried = False
        for attempt in retrying("claim_next_saga", until=self.stopping):
            with attempt:
                if retried:
                    own = self.store.own_claim(owner=self.owner, token=token)
                    if own is not None:
                        saga_id, name, version = own
                        reclaimed = self._reclaim(lookup(name, version), saga_id, token)
                        if reclaimed is not None:
                            return reclaimed
                retried = True
                return self._claim_next_once(kinds, lookup, token)
        return None  # stopping while the database was unavailable

    def _claim_next_once(
        self, kinds: Sequence[str], lookup: Callable[[str, int], Saga[Any]], token: str
    ) -> tuple[Planner, Next] | None:
        with self.store.pipelined() as conn:
            loaded = self.store.claim_next_txn(
                conn, kinds=kinds, owner=self.owner, lease_seconds=self.lease_seconds
            )
            if loaded is None:
                return None
            row = loaded[0]
            planner, nxt, events = self._begin_txn(
                conn, lookup(row.name, row.version), loaded, token
            )
        log_events(planner, events)
        return planner, nxt

    def _reclaim(
        self, definition: Saga[Any], saga_id: str, token: str
    ) -> tuple[Planner, Next] | None:
        """The saga our claim took, when that claim landed although its reply was lost
        (its first write carries `token` and the lease is still ours); None otherwise.

        The claim's first move was committed with it: an attempt it started is ours to
        call now; any other move is planned again from what was committed."""
        written = self.store.write_token(saga_id)
        if written is None or written[0] != token or written[1] != self.owner:
            return None
        with self.store.pipelined() as conn:
            loaded = self.store.load_txn(conn, saga_id)
        if loaded is None:
            return None
        planner = Planner(definition, *loaded)
        _log.info("claim_landed", saga_id=saga_id, fence=planner.saga.fence)
        started = [o for o in planner.ops if o.status == OperationStatus.RUNNING]
        if started:
            # Every attempt running before the claim was marked unknown by its first move:
            # a running one now is the attempt that move started.
            return planner, Invoke(started[0])
        return self._transact(planner, None)

    def plan_new(
        self, definition: Saga[Any], row: SagaRow, ops: list[OpRow]
    ) -> tuple[Planner, Next, bool]:
        """Plan the first move of a saga about to be created under our lease (nothing is
        written here); returns the planner, its move, and whether the lease ends at once."""
        # Nothing is stored yet: a definition that cannot plan it raises to the caller.
        planner, nxt = self._first_move(definition, row, ops, [], park_on_error=False)
        release, _ = self._hand_over(planner, nxt)
        if isinstance(nxt, Invoke):
            faults.point("before_record", step=nxt.op.step, kind=nxt.op.kind)
        return planner, nxt, release

    def drive(self, planner: Planner, nxt: Next) -> SagaState | None:
        """Carry out `nxt` and every move after it until the saga stops or is handed back.

        Returns the saga's state as the last transaction left it, read in that same
        transaction; None when the lease was lost to another owner.
        """
        saga = planner.saga
        try:
            while not isinstance(nxt, Stop | Yield):
                if isinstance(nxt, Sleep):
                    if planner.final_state is not None:
                        # The transaction that planned this backoff persisted it as
                        # run_after and released the lease (_hand_over decided).
                        return planner.final_state
                    self._wait_until(planner, nxt.until)
                    planner, nxt = self._transact(planner, None)
                elif isinstance(nxt, Invoke):
                    planner, nxt = self._invoke(planner, nxt.op)
                elif isinstance(nxt, AskReconcile):
                    planner, nxt = self._reconcile(planner, nxt.op)
                elif isinstance(nxt, Prepare):
                    planner, nxt = self._prepare(planner, nxt.op)
        except LeaseLost as exc:
            _log.warning("lease_lost", saga_id=saga.id, fence=saga.fence, error=str(exc))
            return None
        except Exception as exc:
            if is_transient(exc):
                self._release_after_error(saga)
                raise
            # One saga never takes its driver down: the saga is parked with the reason.
            return self._park_broken(planner, exc)
        except BaseException:
            self._release_after_error(saga)
            raise
        return planner.final_state

    def _release_after_error(self, saga: SagaRow) -> None:
        # Leave the saga to the next owner right away rather than after lease expiry.
        try:
            self.store.release_lease(saga.id, owner=self.owner, fence=saga.fence)
        except Exception:
            _log.exception("lease_release_failed", saga_id=saga.id)

    def _park_broken(self, planner: Planner, exc: Exception) -> SagaState | None:
        """Park a saga whose driving raised something unexpected, with the reason, in a
        fenced write over the saga as last committed (what was planned after that is
        dropped; an attempt committed as running stays so, its outcome unknown to whoever
        settles it). None when the lease was lost meanwhile."""
        saga = planner.saga
        reason = f"driving the saga raised {_describe_error(exc)}; parked for review"
        _log.error(
            "saga_drive_failed",
            saga_id=saga.id,
            fence=saga.fence,
            error=_describe_error(exc),
            traceback=traceback.format_exc(),
        )
        # As for every write: a retry that finds the park's token knows it landed.
        token = new_token()
        retried = False
        try:
            for attempt in retrying("park_saga"):
                with attempt:
                    if retried:
                        written = self.store.write_token(saga.id)
                        if written is not None and written[0] == token:
                            _log.info("write_landed", saga_id=saga.id, fence=saga.fence)
                            return self.store.get_state(saga.id)
                    retried = True
                    fresh = self._reload(planner)
                    fresh.park(reason)
                    events: list[Event] = []
                    self._transact_at_once(fresh, Stop(fresh.saga.status), token, events)
        except LeaseLost as lost:
            _log.warning("lease_lost", saga_id=saga.id, fence=saga.fence, error=str(lost))
            return None
        log_events(fresh, events)
        return fresh.final_state

    def _wait_until(self, planner: Planner, until: datetime) -> None:
        """Wait out a short backoff under the lease (`_hand_over` kept it for this), renewed
        by the heartbeat meanwhile: it is never stretched to the backoff's end, so a process
        that dies while waiting blocks nobody beyond `lease_seconds` (run_after, set to the
        backoff's end, keeps workers from starting the saga early)."""
        delay = (until - datetime.now().astimezone()).total_seconds()
        if delay > 0:
            with self.keeper.holding(planner.saga.id, planner.saga.fence):
                # Wakes early when the worker shuts down; the next transition then yields.
                self.stopping.wait(delay)

    # ----- transactions ------------------------------------------------------------------

    def _begin_txn(
        self, conn: Conn, definition: Saga[Any], loaded: Loaded, token: str
    ) -> tuple[Planner, Next, list[Event]]:
        planner, nxt = self._first_move(definition, *loaded)
        events, read_state = self._persist_txn(conn, planner, nxt, token)
        if read_state is not None:
            planner.final_state = read_state()
        return planner, nxt, events

    def _first_move(
        self,
        definition: Saga[Any],
        row: SagaRow,
        ops: list[OpRow],
        confirmations: list[ConfirmationRow],
        *,
        park_on_error: bool = True,
    ) -> tuple[Planner, Next]:
        """A planner for a saga whose lease we have just taken, and its first move."""
        planner = Planner(definition, row, ops, confirmations)
        planner.events.append(
            Event("lease_acquired", detail={"owner": self.owner, "fence": row.fence})
        )
        if not park_on_error:
            return planner, planner.advance(may_call=not self.stopping.is_set())
        return planner, self._advance(planner)

    def _advance(self, planner: Planner) -> Next:
        """The planner's next move; a saga it cannot plan (an operation its definition no
        longer declares, user code in a cost function, confirm rule or input model that
        raises) is parked with the reason instead, so that it never takes a worker down.

        The planner calls user code before it changes the operation concerned: what it
        recorded before the error are whole transitions, kept with the park."""
        try:
            return planner.advance(may_call=not self.stopping.is_set())
        except Exception as exc:
            if is_transient(exc):
                raise
            saga = planner.saga
            reason = (
                f"cannot plan saga {saga.name!r} v{saga.version} under its registered "
                f"definition: {_describe_error(exc)}"
            )
            _log.error(
                "saga_unplannable",
                saga_id=saga.id,
                saga=saga.name,
                version=saga.version,
                error=_describe_error(exc),
                traceback=traceback.format_exc(),
            )
            planner.park(reason)
            return Stop(planner.saga.status)

    def _transact(self, planner: Planner, mutate: Mutation | None) -> tuple[Planner, Next]:
        """Record an outcome and plan the next move in one fenced transaction.

        A transient database error is retried. Every write carries a token of its own:
        when the error leaves it unclear whether the commit landed (the server committed
        and the reply was lost), the saga's token is read back. If it is this write's, the
        write landed: nothing is applied again and the move it planned is carried out.
        Otherwise the same outcome is applied to a fresh snapshot and written again. The
        first try runs without the retry machinery, which only a failure needs.
        """
        try:
            return planner, self._record(planner, mutate)
        except _Unsure as exc:
            unsure = exc
            log_retry("record_transition", exc.cause)
        for attempt in retrying("record_transition"):
            with attempt:
                if self._landed(unsure):
                    return unsure.planner, unsure.nxt
                fresh = self._reload(unsure.planner)
                try:
                    return fresh, self._record(fresh, mutate)
                except _Unsure as exc:
                    unsure = exc
                    raise exc.cause from None
        raise AssertionError("unreachable: retrying() reraises")  # pragma: no cover

    def _record(self, planner: Planner, mutate: Mutation | None) -> Next:
        """Apply `mutate` and the moves that follow to `planner`, and write them; `_Unsure`
        when a transient error leaves it open whether the write landed."""
        if mutate is not None:
            mutate(planner)
        nxt = self._advance(planner)
        token = new_token()
        written: list[Event] = []
        try:
            if any(c.new or c.dirty for c in planner.confirmations):
                self._transact_pipelined(planner, nxt, token, written)
            else:
                self._transact_at_once(planner, nxt, token, written)
        except Exception as exc:
            if not is_transient(exc):
                raise
            raise _Unsure(planner, nxt, token, written, exc) from exc
        log_events(planner, written)
        return nxt

    def _landed(self, unsure: _Unsure) -> bool:
        """Whether the write of `unsure` landed (its token is the saga's); if so, its events
        are logged and, when it gave the lease back, the saga's state is read."""
        planner = unsure.planner
        written = self.store.write_token(planner.saga.id)
        if written is None or written[0] != unsure.token:
            return False
        _log.info("write_landed", saga_id=planner.saga.id, fence=planner.saga.fence)
        log_events(planner, unsure.events)
        if written[1] is None:
            # The write gave the lease back (a stop, a shutdown, a long backoff).
            planner.final_state = self.store.get_state(planner.saga.id)
        return True

    def _transact_at_once(
        self, planner: Planner, nxt: Next, token: str, written: list[Event]
    ) -> None:
        """The common transition: one statement, one round trip (saga.write_saga_v3), which
        fails as a whole when the lease is no longer ours."""
        release, lease_until = self._hand_over(planner, nxt)
        written.extend(planner.take_events())
        if isinstance(nxt, Invoke):
            faults.point("before_record", step=nxt.op.step, kind=nxt.op.kind)
        state = self.store.apply_transition(
            planner.saga,
            planner.ops,
            written,
            owner=self.owner,
            lease_seconds=self.lease_seconds,
            release=release,
            lease_until=lease_until,
            notify=isinstance(nxt, Yield),
            return_state=release,
            token=token,
        )
        if release:
            planner.final_state = state

    def _transact_pipelined(
        self, planner: Planner, nxt: Next, token: str, written: list[Event]
    ) -> None:
        """A transition that also writes confirmations, as one pipelined transaction whose
        fenced saga write goes first and fails it, writes included, if the lease was lost."""
        with self.store.pipelined() as conn:
            events, read_state = self._persist_txn(conn, planner, nxt, token)
            written.extend(events)
        if read_state is not None:
            planner.final_state = read_state()

    def _reload(self, planner: Planner) -> Planner:
        """A fresh planner from the database, once the lease is checked to be still ours
        (`LeaseLost` otherwise)."""
        saga = planner.saga
        with self.store.pipelined() as conn:
            self.store.assert_fence_txn(
                conn, saga.id, owner=self.owner, fence=saga.fence, lease_seconds=self.lease_seconds
            )
            loaded = self.store.load_txn(conn, saga.id)
        assert loaded is not None  # the fence check found the row
        return Planner(planner.definition, *loaded)

    def _persist_txn(
        self, conn: Conn, planner: Planner, nxt: Next, token: str
    ) -> tuple[list[Event], Callable[[], SagaState | None] | None]:
        """Queue the planner's changes; when the saga is handed back, also the read of its
        state, returned as a function to call once the transaction has committed."""
        release, lease_until = self._hand_over(planner, nxt)
        events = planner.take_events()
        read_state = self.store.save_txn(
            conn,
            planner.saga,
            planner.ops,
            events,
            owner=self.owner,
            lease_seconds=self.lease_seconds,
            release=release,
            lease_until=lease_until,
            notify=isinstance(nxt, Yield),
            # The caller's answer, read in the last transaction rather than in one more.
            return_state=release,
            confirmations=planner.confirmations,
            token=token,
        )
        if isinstance(nxt, Invoke):
            faults.point("before_record", step=nxt.op.step, kind=nxt.op.kind)
        return events, read_state if release else None

    def _hand_over(self, planner: Planner, nxt: Next) -> tuple[bool, datetime | None]:
        """Whether the lease ends with this transition, and until when it must last
        otherwise; records the matching events and run_after on the planner."""
        saga = planner.saga
        lease_until: datetime | None = None
        release = isinstance(nxt, Stop | Yield)
        if isinstance(nxt, Sleep):
            saga.run_after = nxt.until
            delay = (nxt.until - datetime.now().astimezone()).total_seconds()
            if delay > self.options.max_inline_sleep:
                release = True
                planner.events.append(
                    Event("lease_released", detail={"owner": self.owner, "reason": "backoff"})
                )
            # Otherwise the lease is kept through the backoff, renewed by the heartbeat
            # while _wait_until waits (a lease is a liveness signal, never stretched).
        elif isinstance(nxt, Yield):
            saga.run_after = datetime.now().astimezone()
            planner.events.append(
                Event("lease_released", detail={"owner": self.owner, "reason": "shutdown"})
            )
        elif isinstance(nxt, Stop):
            planner.events.append(Event("lease_released", detail={"owner": self.owner}))
        return release, lease_until

    # ----- calling user code -------------------------------------------------------------

    def _context(self, planner: Planner, op: OpRow) -> StepContext:
        saga = planner.saga
        return StepContext(
            saga_id=saga.id,
            tenant_id=saga.tenant_id,
            step=op.step,
            kind=op.kind,
            idempotency_key=op.idempotency_key,
            attempt=op.attempts,
            fence=saga.fence,
            results=planner.results(),
            request=planner.request_of(op) if planner.spec_of(op).prepare_fn else None,
            _report=(
                self._spend_reporter(saga, op) if op.status == OperationStatus.RUNNING else None
            ),
            # Bound lazily, on the step's first log call.
            log=step_logger(
                saga_id=saga.id,
                step=op.step,
                kind=op.kind,
                attempt=op.attempts,
                idempotency_key=op.idempotency_key,
            ),
        )

    def _spend_reporter(self, saga: SagaRow, op: OpRow) -> Callable[[float], None]:
        """What persists the running total an attempt reports with `ctx.spend()`: retried
        on transient errors (writing the same total twice changes nothing), and never
        raised into step code, whose spend is counted from memory at its outcome if the
        write cannot be made."""
        where = {"saga_id": saga.id, "step": op.step, "kind": op.kind, "attempt": op.attempts}

        def report(total: float) -> None:
            try:
                for attempt in retrying("report_spend", until=self.stopping):
                    with attempt:
                        written = self.store.report_spend(
                            saga.id,
                            step=op.step,
                            kind=op.kind,
                            attempt=op.attempts,
                            total=total,
                            owner=self.owner,
                            fence=saga.fence,
                        )
                        if not written:
                            _log.warning("spend_not_persisted", **where, total=total)
            except Exception as exc:
                _log.warning(
                    "spend_not_persisted", **where, total=total, error=_describe_error(exc)
                )

        return report

    def _record_not_called(
        self, planner: Planner, op: OpRow, reason: str
    ) -> tuple[Planner, Next]:
        """Record that the attempt of `op` was never made (`reason`: the machinery's error)
        and plan what follows: the saga parks."""
        return self._transact(
            planner, lambda p: p.record_not_called(p.op(op.step, op.kind), reason)
        )

    def _prepare(self, planner: Planner, op: OpRow) -> tuple[Planner, Next]:
        spec = planner.spec_of(op)
        assert spec.prepare_fn is not None and spec.request_codec is not None
        ctx = self._context(planner, op)
        mutate: Mutation
        # Nothing has been called when prepare raises, so its outcome is never unknown:
        # PermanentError and fail_on fail the attempt and the operation, retry_on retries,
        # and anything else (a bug, a request that cannot be stored) parks the saga.
        verdict = "unknown"
        failure: Exception | None = None
        try:
            prepared = _call(spec.prepare_fn, ctx, *planner.arguments(op))
        except _MachineryError as exc:
            # Our machinery, not the hook: no verdict on the operation, whose attempt was
            # not started; the saga parks with the reason.
            _log.error("prepare_not_run", step=op.step, kind=op.kind, error=str(exc))
            reason = (
                f"prepare of {_describe_op(op)} could not be run: the orchestrator failed "
                f"({exc}); the attempt was not called"
            )
            return self._record_not_called(planner, op, reason)
        except Exception as exc:
            verdict, failure = spec.retry.classify(exc), exc
        else:
            try:
                request = spec.request_codec.encode(prepared)
            except TypeError as exc:
                failure = exc
        if failure is None:
            mutate = lambda p: p.record_request(p.op(op.step, op.kind), request)  # noqa: E731
        else:
            error = _describe_error(failure)
            retryable, park = verdict == "retry", verdict == "unknown"
            trace = _traceback_of(failure) if park else None
            delay = spec.retry.delay_after(op.attempts + 1) if retryable else 0.0
            mutate = lambda p: p.record_prepare_failure(  # noqa: E731
                p.op(op.step, op.kind),
                error,
                retryable=retryable,
                delay=delay,
                park=park,
                traceback=trace,
            )
        # Nothing has been called yet: a retried transaction may simply prepare again.
        return self._transact(planner, mutate)

    def _invoke(self, planner: Planner, op: OpRow) -> tuple[Planner, Next]:
        spec = planner.spec_of(op)
        fn, codec, policy = spec.fn, spec.codec, spec.retry
        where = {"step": op.step, "kind": op.kind}
        mutate: Mutation
        try:
            # What the step is handed (its context, the earlier results, its arguments) is
            # built by our machinery: a failure here is no outcome of the step, which
            # has not been called.
            ctx = self._context(planner, op)
            arguments = (ctx, *planner.arguments(op))
        except Exception as exc:
            if is_transient(exc):
                raise
            _log.error("attempt_not_called", **where, error=_describe_error(exc))
            reason = (
                f"attempt {op.attempts} of {_describe_op(op)} was not called: its arguments "
                f"could not be built ({_describe_error(exc)}); nothing of it ran"
            )
            return self._record_not_called(planner, op, reason)
        faults.point("before_call", **where)
        try:
            with self.keeper.holding(planner.saga.id, planner.saga.fence):
                value = _call_with_timeout(fn, arguments, spec.guards.timeout_seconds)
        except _AttemptTimedOut as exc:
            reason, park = str(exc), exc.still_running
            mutate = lambda p: p.record_unknown(p.op(op.step, op.kind), reason, park=park)  # noqa: E731
        except _NotCalled as exc:
            # Our machinery failed before any of the step ran: no outcome to record.
            _log.error("attempt_not_called", **where, error=str(exc), traceback=_traceback_of(exc))
            reason = (
                f"attempt {op.attempts} of {_describe_op(op)} was not called: the orchestrator "
                f"could not run it ({exc}); nothing of it ran"
            )
            mutate = lambda p: p.record_not_called(p.op(op.step, op.kind), reason)  # noqa: E731
        except _MachineryFailed as exc:
            # Not the step's verdict, whatever its policy says of the error: unknown, parked.
            trace = _traceback_of(exc)
            reason = (
                f"attempt {op.attempts}: the orchestrator failed after the step's function "
                f"had started ({exc}); its outcome is unknown"
            )
            mutate = lambda p: p.record_unknown(  # noqa: E731
                p.op(op.step, op.kind), reason, park=True, traceback=trace
            )
        except Exception as exc:
            error = _describe_error(exc)
            verdict = policy.classify(exc)
            if verdict == "unknown":
                # Not a verdict: the exception may come after the effect (discipline 7).
                trace = _traceback_of(exc)  # in the outcome_unknown event, logged with it
                reason = (
                    f"attempt {op.attempts} raised {error}, which is neither a PermanentError "
                    "nor listed in fail_on or retry_on: its outcome is unknown"
                )
                mutate = lambda p: p.record_unknown(  # noqa: E731
                    p.op(op.step, op.kind), reason, park=False, traceback=trace
                )
            else:
                retryable = verdict == "retry"
                delay = policy.delay_after(op.attempts) if retryable else 0.0
                mutate = lambda p: p.record_failure(  # noqa: E731
                    p.op(op.step, op.kind), error, retryable=retryable, delay=delay
                )
        else:
            try:
                stored = codec.encode(value)
            except TypeError as exc:
                reason = f"TypeError: {exc}; the effect may have happened, so a human decides"
                mutate = lambda p: p.record_unknown(  # noqa: E731
                    p.op(op.step, op.kind), reason, park=True, spend_known=True
                )
            else:
                mutate = lambda p: p.record_success(p.op(op.step, op.kind), stored)  # noqa: E731
        if ctx.spent or ctx._refused:
            recorded, spent, refused = mutate, ctx.spent, list(ctx._refused)

            def mutate(p: Planner) -> None:
                target = p.op(op.step, op.kind)
                p.note_spend(target, spent)
                recorded(p)
                if refused:
                    p.refuse_spend(target, refused[0])

        faults.point("after_call", **where)
        result = self._transact(planner, mutate)
        faults.point("after_record", **where)
        return result

    def _reconcile(self, planner: Planner, op: OpRow) -> tuple[Planner, Next]:
        spec = planner.spec_of(op)
        fn, codec = spec.reconcile_fn, spec.codec
        assert fn is not None  # the planner asks only operations that have a hook
        running = self._abandoned_attempt(planner, op)
        if running is not None:
            return self._transact(planner, lambda p: p.park(running))
        ctx = self._context(planner, op)
        mutate: Mutation
        try:
            answer = _call(fn, ctx, *planner.arguments(op))
            if isinstance(answer, Found):
                try:
                    stored = codec.encode(answer.result)
                except TypeError as exc:
                    # Asking again would find the same value: a human decides now.
                    reason = f"reconcile found the effect, but TypeError: {exc}; a human decides"
                    mutate = lambda p: p.record_unknown(p.op(op.step, op.kind), reason, park=True)  # noqa: E731
                else:
                    ref = answer.provider_reference
                    mutate = lambda p: p.record_found(p.op(op.step, op.kind), stored, ref)  # noqa: E731
            elif isinstance(answer, Absent):
                settled = answer.settled
                mutate = lambda p: p.record_absent(p.op(op.step, op.kind), settled=settled)  # noqa: E731
            else:
                reason = (
                    answer.reason or "the provider's answer was inconclusive"
                    if isinstance(answer, Inconclusive)
                    else f"reconcile returned {type(answer).__name__}; expected Found, Absent "
                    "or Inconclusive"
                )
                mutate = lambda p: p.record_inconclusive(p.op(op.step, op.kind), reason)  # noqa: E731
        except _MachineryError as exc:
            # No answer: the orchestrator could not run the hook.
            reason = f"reconcile could not be run: the orchestrator failed ({exc})"
            mutate = lambda p: p.record_inconclusive(p.op(op.step, op.kind), reason)  # noqa: E731
        except Exception as exc:
            reason = f"reconcile raised {_describe_error(exc)}"
            mutate = lambda p: p.record_inconclusive(p.op(op.step, op.kind), reason)  # noqa: E731
        # The operation is `unknown` while it is reconciled: nothing to protect from replay.
        result = self._transact(planner, mutate)
        faults.point("after_record", step=op.step, kind=op.kind)
        return result

    def _abandoned_attempt(self, planner: Planner, op: OpRow) -> str | None:
        """Wait, under the lease, for attempts of `op` abandoned at their timeout that still
        run in this process; the reason to park if one outlives the wait (a reconcile
        answer now could be overtaken by its effect)."""
        saga = planner.saga
        if not abandoned.still_running(saga.id, op.step, op.kind):
            return None
        with self.keeper.holding(saga.id, saga.fence):
            late = abandoned.wait_for(saga.id, op.step, op.kind)
        if not late:
            return None
        return f"outcome of {op.kind} {op.step!r} is unknown and not reconciled: " + (
            f"{late[0].describe()}; resolve it once it has ended"
        )


class _Unsure(Exception):
    """A write failed for a transient reason, and may have landed all the same."""

    def __init__(
        self, planner: Planner, nxt: Next, token: str, events: list[Event], cause: Exception
    ) -> None:
        super().__init__(str(cause))
        self.planner = planner
        self.nxt = nxt
        self.token = token
        self.events = events
        self.cause = cause


class _AttemptTimedOut(Exception):
    """The attempt ran past its timeout; its outcome is unknown."""

    def __init__(self, reason: str, *, still_running: bool = False) -> None:
        super().__init__(reason)
        # The abandoned call still runs in this process: park rather than settle.
        self.still_running = still_running


def _call_with_timeout(
    fn: Callable[..., Any], args: tuple[Any, ...], timeout_seconds: float | None
) -> Any:
    """Call `fn`, giving up after `timeout_seconds`: the call may still take effect, so
    the caller records the outcome as unknown.

    A coroutine is cancelled (`asyncio.wait_for` returns once the task has ended). A plain
    function cannot be stopped: it runs on in its thread, tracked in `saga.abandoned`, and
    is waited for up to `abandoned.wait_bound(timeout_seconds)` more before the unknown
    outcome is settled (reconcile, retry), so that no second attempt and no reconcile
    answer races it; if it is still running then, the saga parks (`still_running`).
    `args[0]` is the attempt's StepContext, which names the operation; an earlier attempt
    of it still running here is waited for the same way before this one is called.
    """
    ctx = args[0] if args and isinstance(args[0], StepContext) else None
    if ctx is not None and abandoned.still_running(ctx.saga_id, ctx.step, ctx.kind):
        late = abandoned.wait_for(ctx.saga_id, ctx.step, ctx.kind)
        if late:
            raise _AttemptTimedOut(
                f"attempt {ctx.attempt} was not called: {late[0].describe()}; resolve the "
                "outcome once it has ended",
                still_running=True,
            )
    if timeout_seconds is None:
        return _call(fn, *args)
    what = f"attempt exceeded its timeout of {timeout_seconds:g}s; its outcome is unknown"
    if _is_async(fn):
        return _run_async(
            lambda: fn(*args), began=False, timeout=timeout_seconds, timed_out=what
        )
    outcome: list[Any] = []
    failure: list[BaseException] = []
    tracked: list[abandoned.Abandoned] = []

    def target() -> None:
        try:
            outcome.append(_call(fn, *args))
        except BaseException as exc:
            failure.append(exc)
        finally:
            for entry in tracked:
                abandoned.discard(entry)

    thread = threading.Thread(target=target, name="saga-attempt", daemon=True)
    thread.start()
    thread.join(timeout_seconds)
    if thread.is_alive():
        if ctx is None:
            raise _AttemptTimedOut(what)
        entry = abandoned.Abandoned(
            ctx.saga_id, ctx.step, ctx.kind, ctx.attempt, timeout_seconds, thread
        )
        tracked.append(entry)
        abandoned.add(entry)
        if not thread.is_alive():  # ended before it was tracked: target() missed it
            abandoned.discard(entry)
        if abandoned.wait_for(ctx.saga_id, ctx.step, ctx.kind):
            waited = abandoned.wait_bound(timeout_seconds)
            raise _AttemptTimedOut(
                f"{what}: {entry.describe()} after {waited:g}s more; resolve it once it has "
                "ended",
                still_running=True,
            )
        raise _AttemptTimedOut(f"{what} (it ended late; settled as any unknown outcome)")
    if failure:
        raise failure[0]
    return outcome[0]


class _MachineryError(Exception):
    """The orchestrator's own machinery failed around a user function's call; `cause` is
    its error, which says nothing about the function."""

    def __init__(self, cause: Exception) -> None:
        super().__init__(_describe_error(cause))
        self.cause = cause


class _NotCalled(_MachineryError):
    """The machinery failed before any of the user function ran (an event loop for an
    async function could not be started): the call was never made."""


class _MachineryFailed(_MachineryError):
    """The machinery failed after the user function may have started (the sync part of a
    callable that returned an awaitable ran): its outcome is unknown."""


def _call(fn: Callable[..., Any], *args: Any) -> Any:
    """Call a user function; an async one (or one that returns an awaitable) is awaited in
    an event loop of its own. `_NotCalled` or `_MachineryFailed` when that loop fails."""
    if _is_async(fn):
        # Nothing of an async function runs before its coroutine is awaited, in the loop.
        return _run_async(lambda: fn(*args), began=False)
    result = fn(*args)
    if inspect.isawaitable(result):
        return _run_async(lambda: result, began=True)
    return result


def _is_async(fn: Callable[..., Any]) -> bool:
    """Whether calling `fn` only creates a coroutine (async def, a partial of one, or an
    object whose `__call__` is one)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - the method, not callability
    )


def _run_async(
    make: Callable[[], Any],
    *,
    began: bool,
    timeout: float | None = None,
    timed_out: str = "",
) -> Any:
    """Await `make()` in a new event loop (bounded by `timeout`, past which
    `_AttemptTimedOut(timed_out)`), telling the machinery's failures from the function's.

    `began`: user code already ran to produce the awaitable. If the loop fails before our
    coroutine starts, that is `_NotCalled` (nothing of the function ran) or, when `began`,
    `_MachineryFailed`; if it fails as it closes after the function returned, the result
    stands. An exception of the function itself is raised as it is.
    """
    entered = False
    returned: list[Any] = []

    async def main() -> Any:
        nonlocal entered
        entered = True
        try:
            value = await (make() if timeout is None else asyncio.wait_for(make(), timeout))
        except TimeoutError:
            if timeout is None:
                raise
            raise _AttemptTimedOut(timed_out) from None
        returned.append(value)
        return value

    coro = main()
    try:
        return asyncio.run(coro)
    except Exception as exc:
        if not entered:
            coro.close()
            if began:
                pending = make()
                if inspect.iscoroutine(pending):
                    pending.close()  # never to be awaited: no "never awaited" warning
                raise _MachineryFailed(exc) from exc
            raise _NotCalled(exc) from exc
        if returned:
            _log.warning("event_loop_close_failed", error=_describe_error(exc))
            return returned[0]
        raise


# Longest traceback kept in an audit event (characters; its last lines are kept).
_MAX_TRACEBACK_CHARS = 8000


def _traceback_of(exc: BaseException) -> str:
    text = "".join(traceback.format_exception(exc))
    return text if len(text) <= _MAX_TRACEBACK_CHARS else "..." + text[-_MAX_TRACEBACK_CHARS:]


def _describe_op(op: OpRow) -> str:
    return f"step {op.step!r}" if op.kind == "action" else f"compensation of step {op.step!r}"


def _describe_error(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def log_events(planner: Planner, events: Sequence[Event]) -> None:
    """Log audit events once their transaction has committed (skipped, unbuilt, when the
    configured logger drops info events)."""
    if events and _info_enabled():
        for event in events:
            log_event(planner.saga, planner, event)


def _info_enabled() -> bool:
    # The logging as configured now; a wrapper class without the check logs everything.
    return _log.is_enabled_for(logging.INFO)


def log_event(saga: SagaRow, planner: Planner, event: Event) -> None:
    """Log an audit event with structlog, bound with saga id, step, attempt and key (never
    raises: a failure to log changes nothing)."""
    try:
        extra: dict[str, Any] = {}
        if event.step is not None:
            op = planner.find(event.step, event.kind or "action")
            extra = {
                "step": event.step,
                "kind": event.kind,
                "attempt": event.attempt,
                "idempotency_key": op.idempotency_key if op is not None else None,
            }
        _log.info(
            event.event,
            saga_id=saga.id,
            saga=saga.name,
            tenant_id=saga.tenant_id,
            **extra,
            **event.detail,
        )
    except Exception:
        pass  # an event the logger cannot take is still in saga.events
