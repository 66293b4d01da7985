"""The control loop of driving a saga, written once for both drivers.

Plan, call, record, retry, reload: each exchange is a generator that yields effects
(`saga._flows.effects`) and receives their results. The sync and the asyncio driver
(`saga._drivers`) carry the effects out and are the only code that differs between them;
the decisions stay in the core (`saga._core.planner`, `saga._core.inputs`). The calls of
user code are `saga._flows.call`'s; claiming a saga, `saga._flows.claim`'s (its `Flows`
are the flows the drivers run).
"""

from __future__ import annotations

import logging
import math
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from saga import telemetry
from saga._core import inputs
from saga._core.inputs import describe_error
from saga._core.planner import (
    AskReconcile,
    ConfirmationRow,
    Event,
    Hold,
    Invoke,
    Next,
    OpRow,
    Planner,
    Prepare,
    SagaRow,
    Sleep,
    Stop,
    Write,
    Yield,
)
from saga._core.rows import Loaded
from saga._db.dbretry import is_transient, log_retry
from saga._drivers import faults
from saga._flows.call import Answer, Calls, SpendReporter
from saga._flows.common import input_time, new_token, retried, traceback_of
from saga._flows.effects import (
    Begin,
    Commit,
    Flow,
    Stopping,
    Wait,
    db,
    db_txn,
)
from saga._flows.store_ops import StoreOps
from saga.definition import Saga
from saga.errors import LeaseLost
from saga.logs import events_logger, get_logger
from saga.state import SagaState

if TYPE_CHECKING:
    from saga.approvals import ApprovalVerifier

__all__ = [
    "Loop",
    "RunnerOptions",
    "describe_error",
    "log_event",
    "log_events",
    "retried",
    "traceback_of",
]

_log = get_logger("saga")
_events = events_logger()


@dataclass(frozen=True, slots=True)
class RunnerOptions:
    """How a runner holds leases and waits.

    Attributes:
        owner: Lease owner name written to the database.
        lease_seconds: Lease length; renewed by every write and by the heartbeat.
        heartbeat_seconds: Interval of lease renewal while user code runs.
        max_inline_sleep: Longest retry backoff (seconds) waited out under the lease;
            a longer one is persisted as `run_after` and the lease released.
        approval_verifier: The approvers' public key(s): every planner gets it, so an
            attempt a confirmation holds back starts only with a signed approval that
            verifies (None: HMAC approvals, the confirmation row is trusted).
        telemetry_keys: Spans carry keys and request hashes (`saga.telemetry`).
    """

    owner: str
    lease_seconds: float
    heartbeat_seconds: float
    max_inline_sleep: float = math.inf
    approval_verifier: ApprovalVerifier | None = None
    telemetry_keys: bool = False


class Loop:
    """Drives claimed sagas under a lease; every write is fenced. Each method is a flow:
    a generator of effects that a driver carries out."""

    def __init__(self, options: RunnerOptions, *, reporter: SpendReporter) -> None:
        self.options = options
        self.owner = options.owner
        self.lease_seconds = options.lease_seconds
        self.reporter = reporter
        self.calls = Calls(self.owner, self.lease_seconds, reporter)

    def transact(
        self, planner: Planner, outcome: inputs.Outcome | None
    ) -> Flow[tuple[Planner, Next]]:
        """Record `outcome` (None: only the moves that need no call) and plan the next
        move, in one fenced write; see `_transact`."""
        return (yield from self._transact(planner, outcome))

    def drive(self, planner: Planner, nxt: Next) -> Flow[SagaState | None]:
        """Carry out `nxt` and every move after it until the saga stops or is handed back.

        Returns the saga's state as the last transaction left it, read in that same
        transaction; None when the lease was lost to another owner. Traced as `saga.run`
        when telemetry is configured (`saga.telemetry`).
        """
        keys = self.options.telemetry_keys
        return (yield from telemetry.traced_run(self._drive(planner, nxt), planner.saga, keys=keys))

    def _drive(self, planner: Planner, nxt: Next) -> Flow[SagaState | None]:
        saga = planner.saga
        try:
            planner, nxt = yield from self.carry_on(planner, nxt)
            if isinstance(nxt, Hold):
                # A session driven outside its block (an operator's run): what it does
                # next is its code's to say; give the lease back to the next entry.
                yield from self.release_after_error(planner.saga)
                state: SagaState | None = yield from db(StoreOps.get_state, saga.id)
                return state
        except LeaseLost as exc:
            _log.warning("lease_lost", saga_id=saga.id, fence=saga.fence, error=str(exc))
            return None
        except Exception as exc:
            if is_transient(exc):
                yield from self.release_after_error(saga)
                raise
            # One saga never takes its driver down: the saga is parked with the reason.
            return (yield from self._park_broken(planner, exc))
        except BaseException:
            yield from self.release_after_error(saga)
            raise
        return planner.final_state

    def carry_on(self, planner: Planner, nxt: Next) -> Flow[tuple[Planner, Next]]:
        """Carry out `nxt` and the moves after it until the saga stops, is handed back
        (a backoff whose write released the lease, a shutdown) or holds (a session's
        call is settled); returns the planner as the last write left it, and that move.
        Errors are the caller's (`drive` parks a broken saga; a session raises)."""
        while not isinstance(nxt, Stop | Yield | Hold):
            if isinstance(nxt, Sleep):
                if planner.final_state is not None:
                    # The transaction that planned this backoff persisted it as run_after
                    # and released the lease (Planner.write decided).
                    break
                yield from self._wait_until(planner, nxt.until)
                planner, nxt = yield from self._transact(planner, None)
            elif isinstance(nxt, Invoke):
                planner, nxt = yield from telemetry.traced_call(
                    self._call(planner, self.calls.invoke(planner, nxt), nxt.op),
                    planner,
                    nxt.op,
                    keys=self.options.telemetry_keys,
                )
            elif isinstance(nxt, AskReconcile):
                planner, nxt = yield from telemetry.traced_call(
                    self._call(planner, self.calls.reconcile(planner, nxt.op), nxt.op),
                    planner,
                    nxt.op,
                    keys=self.options.telemetry_keys,
                    reconcile=True,
                )
            elif isinstance(nxt, Prepare):
                prepared = yield from self.calls.prepare(planner, nxt.op)
                planner, nxt = yield from self._transact(planner, prepared)
        return planner, nxt

    def _call(self, planner: Planner, call: Flow[Answer], op: OpRow) -> Flow[tuple[Planner, Next]]:
        """Make `call` and record what came of it."""
        answer = yield from call
        result = yield from self._transact(planner, answer.outcome)
        if answer.after_record:
            faults.point("after_record", step=op.step, kind=op.kind)
        return result

    def release_after_error(self, saga: SagaRow) -> Flow[None]:
        """Leave the saga to the next owner right away rather than after lease expiry."""
        try:
            yield from db(StoreOps.release_lease, saga.id, owner=self.owner, fence=saga.fence)
        except Exception:
            _log.exception("lease_release_failed", saga_id=saga.id)

    def _park_broken(self, planner: Planner, exc: Exception) -> Flow[SagaState | None]:
        """Park a saga whose driving raised something unexpected, with the reason, in a
        fenced write over the saga as last committed (what was planned after that is
        dropped; an attempt committed as running stays so, its outcome unknown to whoever
        settles it). None when the lease was lost meanwhile."""
        saga = planner.saga
        reason = f"driving the saga raised {describe_error(exc)}; parked for review"
        _log.error(
            "saga_drive_failed",
            saga_id=saga.id,
            fence=saga.fence,
            error=describe_error(exc),
            traceback="".join(traceback.format_exception(exc)),
        )
        # As for every write: a retry that finds the park's token knows it landed.
        token = new_token()
        tried = [False]
        parked: list[Planner] = []

        def once() -> Flow[SagaState | None]:
            if tried[0]:
                written = yield from db(StoreOps.write_token, saga.id)
                if written is not None and written[0] == token:
                    _log.info("write_landed", saga_id=saga.id, fence=saga.fence)
                    state: SagaState | None = yield from db(StoreOps.get_state, saga.id)
                    return state
            tried[0] = True
            fresh = yield from self._reload(planner)
            inputs.apply(fresh, inputs.Parked(reason), input_time())
            write = self._write(fresh, Stop(fresh.saga.status))
            yield from self._transact_at_once(fresh, write, token)
            log_events(fresh, write.events)
            parked.append(fresh)
            return fresh.final_state

        try:
            return (yield from retried("park_saga", once))
        except LeaseLost as lost:
            _log.warning("lease_lost", saga_id=saga.id, fence=saga.fence, error=str(lost))
            return None

    def _wait_until(self, planner: Planner, until: datetime) -> Flow[None]:
        """Wait out a short backoff under the lease (`Planner.write` kept it for this), renewed
        by the heartbeat meanwhile: it is never stretched to the backoff's end, so a process
        that dies while waiting blocks nobody beyond `lease_seconds` (run_after, set to the
        backoff's end, keeps workers from starting the saga early)."""
        delay = (until - datetime.now().astimezone()).total_seconds()
        if delay > 0:
            # Wakes early when the worker shuts down; the next transition then yields.
            yield Wait(delay, hold=(planner.saga.id, planner.saga.fence))

    # ----- transactions ------------------------------------------------------------------

    def _begin_txn(
        self, definition: Saga[Any], loaded: Loaded, token: str
    ) -> Flow[tuple[Planner, Next, list[Event], Callable[[], Any] | None]]:
        planner = self._new_planner(definition, *loaded)
        nxt, write = yield from self._plan(planner)
        read = yield from self._persist_txn(write, token)
        if isinstance(nxt, Invoke):
            faults.point("before_record", step=nxt.op.step, kind=nxt.op.kind)
        return planner, nxt, list(write.events), read

    def _new_planner(
        self,
        definition: Saga[Any],
        row: SagaRow,
        ops: list[OpRow],
        confirmations: list[ConfirmationRow],
    ) -> Planner:
        """A planner for a saga whose lease we have just taken."""
        planner = self._planner(definition, (row, ops, confirmations))
        planner.events.append(
            Event("lease_acquired", detail={"owner": self.owner, "fence": row.fence})
        )
        return planner

    def _plan(
        self, planner: Planner, outcome: inputs.Outcome | None = None
    ) -> Flow[tuple[Next, Write]]:
        """Apply `outcome` to `planner` and plan the moves that follow, in one call of the
        core (`inputs.transition`): the next move and the write of all of it. A saga the
        core cannot plan is parked with the reason, so that it never takes a worker down."""
        stopping = yield Stopping()
        done = inputs.transition(
            planner,
            outcome,
            input_time(),
            may_call=not stopping,
            owner=self.owner,
            max_inline_sleep=self.options.max_inline_sleep,
        )
        if done.unplannable is not None:
            exc, saga = done.unplannable, planner.saga
            if is_transient(exc):
                raise exc
            _log.error(
                "saga_unplannable",
                saga_id=saga.id,
                saga=saga.name,
                version=saga.version,
                error=describe_error(exc),
                traceback="".join(traceback.format_exception(exc)),
            )
        return done.next, done.write

    def _transact(
        self, planner: Planner, outcome: inputs.Outcome | None
    ) -> Flow[tuple[Planner, Next]]:
        """Record an outcome and plan the next move in one fenced transaction.

        A transient database error is retried. Every write carries a token of its own:
        when the error leaves it unclear whether the commit landed (the server committed
        and the reply was lost), the saga's token is read back. If it is this write's, the
        write landed: nothing is applied again and the move it planned is carried out.
        Otherwise the same outcome is applied to a fresh snapshot and written again. The
        first try runs without the retry machinery, which only a failure needs.
        """
        try:
            return planner, (yield from self._record(planner, outcome))
        except _Unsure as exc:
            unsure = [exc]
            log_retry("record_transition", exc.cause)

        def again() -> Flow[tuple[Planner, Next]]:
            if (yield from self._landed(unsure[0])):
                # Confirmed when that write was sent, however long finding it out took.
                unsure[0].planner.lease_confirmed_at = unsure[0].sent
                return unsure[0].planner, unsure[0].nxt
            fresh = yield from self._reload(unsure[0].planner)
            try:
                return fresh, (yield from self._record(fresh, outcome))
            except _Unsure as exc:
                unsure[0] = exc
                raise exc.cause from None

        return (yield from retried("record_transition", again))

    def _record(self, planner: Planner, outcome: inputs.Outcome | None) -> Flow[Next]:
        """Apply `outcome` and the moves that follow to `planner`, and write them; `_Unsure`
        when a transient error leaves it open whether the write landed."""
        nxt, write = yield from self._plan(planner, outcome)
        token = new_token()
        if isinstance(nxt, Invoke):
            faults.point("before_record", step=nxt.op.step, kind=nxt.op.kind)
        sent = time.monotonic()
        try:
            yield from self._transact_at_once(planner, write, token)
        except Exception as exc:
            if not is_transient(exc):
                raise
            raise _Unsure(planner, nxt, token, list(write.events), exc, sent) from exc
        planner.lease_confirmed_at = sent
        log_events(planner, write.events)
        return nxt

    def _landed(self, unsure: _Unsure) -> Flow[bool]:
        """Whether the write of `unsure` landed (its token is the saga's); if so, its events
        are logged and, when it gave the lease back, the saga's state is read."""
        planner = unsure.planner
        written = yield from db(StoreOps.write_token, planner.saga.id)
        if written is None or written[0] != unsure.token:
            return False
        _log.info("write_landed", saga_id=planner.saga.id, fence=planner.saga.fence)
        log_events(planner, unsure.events)
        if written[1] is None:
            # The write gave the lease back (a stop, a shutdown, a long backoff).
            planner.final_state = yield from db(StoreOps.get_state, planner.saga.id)
        return True

    def _transact_at_once(self, planner: Planner, write: Write, token: str) -> Flow[None]:
        """A transition: one statement, one round trip (saga.write_saga_v4), which fails
        as a whole when the lease is no longer ours."""
        state = yield from db(
            StoreOps.apply_transition,
            write,
            owner=self.owner,
            lease_seconds=self.lease_seconds,
            token=token,
        )
        if write.release:
            planner.final_state = state

    def _reload(self, planner: Planner) -> Flow[Planner]:
        """A fresh planner from the database, once the lease is checked to be still ours
        (`LeaseLost` otherwise)."""
        saga = planner.saga
        sent = time.monotonic()
        yield Begin()
        yield from db_txn(
            StoreOps.assert_fence_txn,
            saga.id,
            owner=self.owner,
            fence=saga.fence,
            lease_seconds=self.lease_seconds,
        )
        loaded = yield from db_txn(StoreOps.load_txn, saga.id)
        yield Commit()
        assert loaded is not None  # the fence check found the row
        fresh = self._planner(planner.definition, loaded)
        fresh.lease_confirmed_at = sent  # the fence check renewed the lease
        return fresh

    def _planner(self, definition: Saga[Any], loaded: Loaded) -> Planner:
        """A planner of a saga as read, at the time now, with this runner's approval
        verifier: every planner that may start an attempt is made here."""
        return Planner(
            definition, *loaded, now=input_time(), approval_verifier=self.options.approval_verifier
        )

    def _persist_txn(self, write: Write, token: str) -> Flow[Callable[[], Any] | None]:
        """Queue a write in the open transaction; when the saga is handed back, also the
        read of its state, returned as a read to make once the transaction has committed."""
        read = yield from db_txn(
            StoreOps.save_txn,
            write,
            owner=self.owner,
            lease_seconds=self.lease_seconds,
            token=token,
        )
        # The caller's answer, read in the last transaction rather than in one more.
        return read if write.release else None

    def _write(self, planner: Planner, nxt: Next) -> Write:
        """What the transaction that plans `nxt` writes, as the core decides it."""
        return planner.write(nxt, owner=self.owner, max_inline_sleep=self.options.max_inline_sleep)


class _Unsure(Exception):
    """A write failed for a transient reason, and may have landed all the same."""

    def __init__(
        self,
        planner: Planner,
        nxt: Next,
        token: str,
        events: list[Event],
        cause: Exception,
        sent: float,
    ) -> None:
        super().__init__(str(cause))
        self.planner = planner
        self.nxt = nxt
        self.token = token
        self.events = events
        self.cause = cause
        # When the write was sent (monotonic): if it landed, it confirmed the lease then.
        self.sent = sent


def log_events(planner: Planner, events: Sequence[Event]) -> None:
    """Log audit events once their transaction has committed (skipped, unbuilt, when the
    configured logger drops info events), and count their outcomes (`saga.telemetry`)."""
    telemetry.record_events(planner.saga.name, events, session=planner.definition.is_session)
    if events and _info_enabled():
        for event in events:
            log_event(planner.saga, planner, event)


def _info_enabled() -> bool:
    # The logging as configured now; a wrapper class without the check logs everything.
    return _events.is_enabled_for(logging.INFO)


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
        _events.info(
            event.event,
            saga_id=saga.id,
            saga=saga.name,
            tenant_id=saga.tenant_id,
            **extra,
            **event.detail,
        )
    except Exception:
        pass  # an event the logger cannot take is still in saga.events
