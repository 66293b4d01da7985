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
from datetime import datetime, timedelta
from typing import Any

import structlog

from saga import faults
from saga.context import StepContext
from saga.dbretry import is_transient, log_retry, retrying
from saga.definition import Saga
from saga.errors import LeaseLost
from saga.leases import LeaseKeeper
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
from saga.store import Conn, Loaded, Store

_log: structlog.typing.FilteringBoundLogger = structlog.get_logger("saga")

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
        (or was lost to another owner on the way)."""
        for attempt in retrying("claim_saga"):
            with attempt:
                claimed = self._claim_by_id(definition, saga_id)
        if claimed is None:
            return None
        return self.drive(*claimed)

    def _claim_by_id(self, definition: Saga[Any], saga_id: str) -> tuple[Planner, Next] | None:
        with self.store.pipelined() as conn:
            loaded = self.store.claim_txn(
                conn, saga_id, owner=self.owner, lease_seconds=self.lease_seconds
            )
            if loaded is None:
                return None
            planner, nxt, events = self._begin_txn(conn, definition, loaded)
        log_events(planner, events)
        return planner, nxt

    def claim_next(
        self, kinds: Sequence[str], lookup: Callable[[str, int], Saga[Any]]
    ) -> tuple[Planner, Next] | None:
        """Claim the longest-waiting runnable saga of these name:version kinds and plan its
        first move in the same transaction; None when there is nothing to claim."""
        with self.store.pipelined() as conn:
            loaded = self.store.claim_next_txn(
                conn, kinds=kinds, owner=self.owner, lease_seconds=self.lease_seconds
            )
            if loaded is None:
                return None
            row = loaded[0]
            planner, nxt, events = self._begin_txn(conn, lookup(row.name, row.version), loaded)
        log_events(planner, events)
        return planner, nxt

    def plan_new(
        self, definition: Saga[Any], row: SagaRow, ops: list[OpRow]
    ) -> tuple[Planner, Next, bool]:
        """Plan the first move of a saga about to be created under our lease (nothing is
        written here); returns the planner, its move, and whether the lease ends at once."""
        planner, nxt = self._first_move(definition, row, ops, [])
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
                    self._wait_until(nxt.until)
                    planner, nxt = self._transact(planner, None, None)
                elif isinstance(nxt, Invoke):
                    planner, nxt = self._invoke(planner, nxt.op)
                elif isinstance(nxt, AskReconcile):
                    planner, nxt = self._reconcile(planner, nxt.op)
                elif isinstance(nxt, Prepare):
                    planner, nxt = self._prepare(planner, nxt.op)
        except LeaseLost as exc:
            _log.warning("lease_lost", saga_id=saga.id, fence=saga.fence, error=str(exc))
            return None
        except BaseException:
            # Leave the saga to the next owner right away rather than after lease expiry.
            try:
                self.store.release_lease(saga.id, owner=self.owner, fence=saga.fence)
            except Exception:
                _log.exception("lease_release_failed", saga_id=saga.id)
            raise
        return planner.final_state

    def _wait_until(self, until: datetime) -> None:
        """Wait out a short backoff under the lease (`_hand_over` kept it for this)."""
        delay = (until - datetime.now().astimezone()).total_seconds()
        if delay > 0:
            # Wakes early when the worker shuts down; the next transition then yields.
            self.stopping.wait(delay)

    # ----- transactions ------------------------------------------------------------------

    def _begin_txn(
        self, conn: Conn, definition: Saga[Any], loaded: Loaded
    ) -> tuple[Planner, Next, list[Event]]:
        planner, nxt = self._first_move(definition, *loaded)
        events, read_state = self._persist_txn(conn, planner, nxt)
        if read_state is not None:
            planner.final_state = read_state()
        return planner, nxt, events

    def _first_move(
        self,
        definition: Saga[Any],
        row: SagaRow,
        ops: list[OpRow],
        confirmations: list[ConfirmationRow],
    ) -> tuple[Planner, Next]:
        """A planner for a saga whose lease we have just taken, and its first move."""
        planner = Planner(definition, row, ops, confirmations)
        planner.events.append(
            Event("lease_acquired", detail={"owner": self.owner, "fence": row.fence})
        )
        return planner, planner.advance(may_call=not self.stopping.is_set())

    def _transact(
        self, planner: Planner, mutate: Mutation | None, target: tuple[str, str, int] | None
    ) -> tuple[Planner, Next]:
        """Record an outcome and plan the next move in one fenced transaction.

        A transient database error is retried with a fresh snapshot; if the failed
        commit had in fact landed, the recorded outcome is not applied twice. The first
        try runs without the retry machinery, which only a failure needs.
        """
        try:
            return planner, self._record(planner, mutate)
        except Exception as exc:
            if not is_transient(exc):
                raise
            log_retry("record_transition", exc)
        for attempt in retrying("record_transition"):
            with attempt:
                planner, landed = self._reload(planner, target)
                if landed is not None:
                    return planner, landed
                if target is not None and not self._still_in_flight(planner, target):
                    mutate = None
                nxt = self._record(planner, mutate)
        return planner, nxt

    def _record(self, planner: Planner, mutate: Mutation | None) -> Next:
        if mutate is not None:
            mutate(planner)
        nxt = planner.advance(may_call=not self.stopping.is_set())
        if any(c.new or c.dirty for c in planner.confirmations):
            events = self._transact_pipelined(planner, nxt)
        else:
            events = self._transact_at_once(planner, nxt)
        log_events(planner, events)
        return nxt

    def _transact_at_once(self, planner: Planner, nxt: Next) -> list[Event]:
        """The common transition: one statement, one round trip (saga.write_saga), which
        fails as a whole when the lease is no longer ours."""
        release, lease_until = self._hand_over(planner, nxt)
        events = planner.take_events()
        if isinstance(nxt, Invoke):
            faults.point("before_record", step=nxt.op.step, kind=nxt.op.kind)
        state = self.store.apply_transition(
            planner.saga,
            planner.ops,
            events,
            owner=self.owner,
            lease_seconds=self.lease_seconds,
            release=release,
            lease_until=lease_until,
            notify=isinstance(nxt, Yield),
            return_state=release,
        )
        if release:
            planner.final_state = state
        return events

    def _transact_pipelined(self, planner: Planner, nxt: Next) -> list[Event]:
        """A transition that also writes confirmations, as one pipelined transaction whose
        fenced saga write goes first and fails it, writes included, if the lease was lost."""
        with self.store.pipelined() as conn:
            events, read_state = self._persist_txn(conn, planner, nxt)
        if read_state is not None:
            planner.final_state = read_state()
        return events

    def _reload(
        self, planner: Planner, target: tuple[str, str, int] | None
    ) -> tuple[Planner, Next | None]:
        """A fresh planner from the database, and the move already committed, if any."""
        saga = planner.saga
        with self.store.pipelined() as conn:
            self.store.assert_fence_txn(
                conn, saga.id, owner=self.owner, fence=saga.fence, lease_seconds=self.lease_seconds
            )
            loaded = self.store.load_txn(conn, saga.id)
        assert loaded is not None  # the fence check found the row
        fresh = Planner(planner.definition, *loaded)
        if target is not None and not self._still_in_flight(fresh, target):
            # The outcome was committed; an attempt it started is ours to call now.
            started = [o for o in fresh.ops if o.status == OperationStatus.RUNNING]
            if started:
                return fresh, Invoke(started[0])
        return fresh, None

    @staticmethod
    def _still_in_flight(planner: Planner, target: tuple[str, str, int]) -> bool:
        step, kind, attempts = target
        op = planner.find(step, "action" if kind == "action" else "compensation")
        return op is not None and op.status == OperationStatus.RUNNING and op.attempts == attempts

    def _persist_txn(
        self, conn: Conn, planner: Planner, nxt: Next
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
            else:
                # Keep the lease through a short backoff so no other worker starts it early.
                lease_until = nxt.until + timedelta(seconds=self.lease_seconds)
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
            # Bound lazily, on the step's first log call.
            log=structlog.get_logger(
                "saga",
                saga_id=saga.id,
                step=op.step,
                kind=op.kind,
                attempt=op.attempts,
                idempotency_key=op.idempotency_key,
            ),
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
        return self._transact(planner, mutate, None)

    def _invoke(self, planner: Planner, op: OpRow) -> tuple[Planner, Next]:
        spec = planner.spec_of(op)
        fn, codec, policy = spec.fn, spec.codec, spec.retry
        ctx = self._context(planner, op)
        where = {"step": op.step, "kind": op.kind}
        mutate: Mutation
        faults.point("before_call", **where)
        try:
            with self.keeper.holding(planner.saga.id, planner.saga.fence):
                value = _call_with_timeout(
                    fn, (ctx, *planner.arguments(op)), spec.guards.timeout_seconds
                )
        except _AttemptTimedOut as exc:
            reason = str(exc)
            mutate = lambda p: p.record_unknown(p.op(op.step, op.kind), reason, park=False)  # noqa: E731
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
                mutate = lambda p: p.record_unknown(p.op(op.step, op.kind), reason, park=True)  # noqa: E731
            else:
                mutate = lambda p: p.record_success(p.op(op.step, op.kind), stored)  # noqa: E731
        if ctx.spent:
            recorded, spent = mutate, ctx.spent

            def mutate(p: Planner) -> None:
                p.add_spend(spent)
                recorded(p)

        faults.point("after_call", **where)
        result = self._transact(planner, mutate, (op.step, op.kind, op.attempts))
        faults.point("after_record", **where)
        return result

    def _reconcile(self, planner: Planner, op: OpRow) -> tuple[Planner, Next]:
        spec = planner.spec_of(op)
        fn, codec = spec.reconcile_fn, spec.codec
        assert fn is not None  # the planner asks only operations that have a hook
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
        except Exception as exc:
            reason = f"reconcile raised {_describe_error(exc)}"
            mutate = lambda p: p.record_inconclusive(p.op(op.step, op.kind), reason)  # noqa: E731
        # The operation is `unknown` while it is reconciled: nothing to protect from replay.
        result = self._transact(planner, mutate, None)
        faults.point("after_record", step=op.step, kind=op.kind)
        return result


class _AttemptTimedOut(Exception):
    """The attempt ran past its timeout; its outcome is unknown."""


def _call_with_timeout(
    fn: Callable[..., Any], args: tuple[Any, ...], timeout_seconds: float | None
) -> Any:
    """Call `fn`, giving up after `timeout_seconds`: the call may still take effect, so
    the caller records the outcome as unknown. A coroutine is cancelled; a plain
    function cannot be stopped and finishes in its own thread, its result ignored."""
    if timeout_seconds is None:
        return _call(fn, *args)
    what = f"attempt exceeded its timeout of {timeout_seconds:g}s; its outcome is unknown"
    if inspect.iscoroutinefunction(fn):

        async def bounded() -> Any:
            try:
                return await asyncio.wait_for(fn(*args), timeout_seconds)
            except TimeoutError:
                raise _AttemptTimedOut(what) from None

        return asyncio.run(bounded())
    outcome: list[Any] = []
    failure: list[BaseException] = []

    def target() -> None:
        try:
            outcome.append(_call(fn, *args))
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=target, name="saga-attempt", daemon=True)
    thread.start()
    thread.join(timeout_seconds)
    if thread.is_alive():
        raise _AttemptTimedOut(what)
    if failure:
        raise failure[0]
    return outcome[0]


def _call(fn: Callable[..., Any], *args: Any) -> Any:
    result = fn(*args)
    if inspect.isawaitable(result):
        return asyncio.run(_await(result))
    return result


async def _await(awaitable: Any) -> Any:
    return await awaitable


# Longest traceback kept in an audit event (characters; its last lines are kept).
_MAX_TRACEBACK_CHARS = 8000


def _traceback_of(exc: BaseException) -> str:
    text = "".join(traceback.format_exception(exc))
    return text if len(text) <= _MAX_TRACEBACK_CHARS else "..." + text[-_MAX_TRACEBACK_CHARS:]


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
    # The logger as configured now; a wrapper class without the check logs everything.
    check = getattr(_log.bind(), "is_enabled_for", None)
    return True if check is None else bool(check(logging.INFO))


def log_event(saga: SagaRow, planner: Planner, event: Event) -> None:
    """Log an audit event with structlog, bound with saga id, step, attempt and key."""
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
