"""The control loop of driving a saga, written once for both drivers.

Plan, call, record, retry, reload: each exchange is a generator that yields effects
(`saga._flows.effects`) and receives their results. The sync and the asyncio driver
(`saga._drivers`) carry the effects out and are the only code that differs between them;
the decisions stay in the core (`saga._core.planner`, `saga._core.inputs`). The calls of
user code are `saga._flows.call`'s; claiming a saga, `saga._flows.claim`'s (its `Flows`
are the flows the drivers run).
"""

from __future__ import annotations

import math
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime
from typing import TYPE_CHECKING, Any

from saga._core import inputs
from saga._core.inputs import describe_error
from saga._core.planner import (
    AskReconcile,
    ConfirmationRow,
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
from saga._core.rows import Loaded, lease_acquired
from saga._flows.call import Answer, Calls, SpendReporter
from saga._flows.common import input_time, new_token, retried, traceback_of
from saga._flows.effects import (
    Begin,
    Commit,
    Drive,
    Flow,
    Observed,
    Point,
    Stopping,
    Wait,
    Watch,
    db,
    db_txn,
    watched,
)
from saga._flows.store_ops import StoreOps
from saga.definition import Saga
from saga.errors import DatabaseInterrupted, LeaseLost
from saga.logs import get_logger, log_retry
from saga.state import SagaState, SagaStatus

if TYPE_CHECKING:
    from saga.approvals import ApprovalVerifier

__all__ = [
    "Claimed",
    "Loop",
    "Move",
    "Released",
    "RunnerOptions",
    "describe_error",
    "retried",
    "traceback_of",
]

_log = get_logger("saga")


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
        answers: A drive returns the state it left the saga in, read back by the write
            that gave the lease up (`run()`, `execute()`); False for a driver that drops
            it (a worker), so neither the server builds it nor the client reads it.
    """

    owner: str
    lease_seconds: float
    heartbeat_seconds: float
    max_inline_sleep: float = math.inf
    approval_verifier: ApprovalVerifier | None = None
    telemetry_keys: bool = False
    answers: bool = True


@dataclass(frozen=True, slots=True)
class Released:
    """The write that planned `next` gave the lease back (a stop, a shutdown, a backoff
    too long to wait out under the lease), and read the saga's `state` as it left it, in
    the same statement: the drive ends here, with that state."""

    next: Next
    state: SagaState | None


# A move of a saga held under our lease: the next one to make, or the end of the drive.
Move = Next | Released
# A saga held under our lease, and its move.
Claimed = tuple[Planner, Move]


class Loop:
    """Drives claimed sagas under a lease; every write is fenced. Each method is a flow:
    a generator of effects that a driver carries out."""

    def __init__(self, options: RunnerOptions, *, reporter: SpendReporter) -> None:
        self.options = options
        self.owner = options.owner
        self.lease_seconds = options.lease_seconds
        self.reporter = reporter
        self.calls = Calls(self.owner, self.lease_seconds, reporter)

    def transact(self, planner: Planner, outcome: inputs.Outcome | None) -> Flow[Claimed]:
        """Record `outcome` (None: only the moves that need no call) and plan the next
        move, in one fenced write; see `_transact`."""
        return (yield from self._transact(planner, outcome))

    def drive(self, planner: Planner, nxt: Move) -> Flow[SagaState | None]:
        """Carry out `nxt` and every move after it until the saga stops or is handed back.

        Returns the saga's state as the last transaction left it, read in that same
        transaction; None when the lease was lost to another owner, or when the runner
        does not answer (`RunnerOptions.answers`). The driver traces the drive as
        `saga.run` (`Drive`) when telemetry is configured (`saga.telemetry`).
        """
        yield Drive(planner.saga)
        status, state = yield from self._drive(planner, nxt)
        yield Drive(planner.saga, ended=True, status=status)
        return state

    def _drive(
        self, planner: Planner, nxt: Move
    ) -> Flow[tuple[SagaStatus | None, SagaState | None]]:
        """`drive`'s state, and the status the drive left the saga in (None: the lease
        was lost)."""
        saga = planner.saga
        try:
            planner, nxt = yield from self.carry_on(planner, nxt)
            if isinstance(nxt, Hold):
                # A session driven outside its block (an operator's run): what it does
                # next is its code's to say; give the lease back to the next entry.
                yield from self.release_after_error(planner.saga)
                return _left((yield from db(StoreOps.get_state, saga.id)))
        except LeaseLost as exc:
            _log.warning("lease_lost", saga_id=saga.id, fence=saga.fence, error=str(exc))
            return None, None
        except Exception as exc:
            if isinstance(exc, DatabaseInterrupted):
                yield from self.release_after_error(saga)
                raise
            # One saga never takes its driver down: the saga is parked with the reason.
            return _left((yield from self._park_broken(planner, exc)))
        except BaseException:
            yield from self.release_after_error(saga)
            raise
        if isinstance(nxt, Released):
            # The write that gave the lease back left the saga as the planner has it.
            return planner.saga.status, nxt.state
        # The move was planned by a write that read no state back: a start whose first
        # plan already stops the saga (`verbs.start`, which frees the row as it writes it).
        return _left((yield from db(StoreOps.get_state, saga.id)))

    def carry_on(self, planner: Planner, nxt: Move) -> Flow[Claimed]:
        """Carry out `nxt` and the moves after it until the saga stops, is handed back
        (a backoff whose write released the lease, a shutdown) or holds (a session's
        call is settled); returns the planner as the last write left it, and that move.
        Errors are the caller's (`drive` parks a broken saga; a session raises). A backoff
        whose write gave the lease back (`Planner.write` decided) is `Released`: the next
        owner makes it once run_after has passed."""
        while not isinstance(nxt, Stop | Yield | Hold | Released):
            if isinstance(nxt, Sleep):
                yield from self._wait_until(planner, nxt.until)
                planner, nxt = yield from self._transact(planner, None)
            elif isinstance(nxt, Invoke):
                planner, nxt = yield from self._call(
                    planner, self.calls.invoke(planner, nxt), nxt.op
                )
            elif isinstance(nxt, AskReconcile):
                planner, nxt = yield from self._call(
                    planner, self.calls.reconcile(planner, nxt.op), nxt.op
                )
            elif isinstance(nxt, Prepare):
                prepared = yield from self.calls.prepare(planner, nxt.op)
                planner, nxt = yield from self._transact(planner, prepared)
        return planner, nxt

    def _call(self, planner: Planner, call: Flow[Answer], op: OpRow) -> Flow[Claimed]:
        """Make `call` and record what came of it (the write that records the call of user
        code ends its span, and is the `after_record` fault point)."""
        answer = yield from call
        after = ("after_record", op.step, op.kind) if answer.after_record else None
        return (yield from self._transact(planner, answer.outcome, after=after, records=True))

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
            # The state is read back whatever the runner answers: the park's None means
            # a lost lease.
            write = self._write(fresh, Stop(fresh.saga.status), answer=True)
            watch = Watch(fresh, events=write.events)
            return (yield from self._transact_at_once(fresh, write, token, watch))

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
    ) -> Flow[tuple[Planner, Next, Watch, Callable[[], Any] | None]]:
        """Plan the first move of a saga just claimed in the open transaction, and queue its
        write there; what the commit is to be watched with (`Commit(watch)`)."""
        planner = self._new_planner(definition, *loaded)
        nxt, write = yield from self._plan(planner)
        read = yield from self._persist_txn(write, token)
        watch = Watch(planner, before=before_record(nxt), events=write.events)
        return planner, nxt, watch, read

    def _new_planner(
        self,
        definition: Saga[Any],
        row: SagaRow,
        ops: list[OpRow],
        confirmations: list[ConfirmationRow],
    ) -> Planner:
        """A planner for a saga whose lease we have just taken."""
        planner = self._planner(definition, (row, ops, confirmations))
        planner.events.append(lease_acquired(self.owner, row.fence))
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
            answer=self.options.answers,
        )
        if done.unplannable is not None:
            exc, saga = done.unplannable, planner.saga
            if isinstance(exc, DatabaseInterrupted):
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
        self,
        planner: Planner,
        outcome: inputs.Outcome | None,
        *,
        after: Point | None = None,
        records: bool = False,
    ) -> Flow[Claimed]:
        """Record an outcome and plan the next move in one fenced transaction (`after`: the
        fault point once it has committed; `records`: the outcome is that of the call of
        user code just made, whose span the write ends).

        A transient database error is retried. Every write carries a token of its own:
        when the error leaves it unclear whether the commit landed (the server committed
        and the reply was lost), the saga's token is read back. If it is this write's, the
        write landed: nothing is applied again and the move it planned is carried out.
        Otherwise the same outcome is applied to a fresh snapshot and written again. The
        first try runs without the retry machinery, which only a failure needs.
        """
        try:
            return planner, (yield from self._record(planner, outcome, after, records))
        except _Unsure as exc:
            unsure = [exc]
            log_retry("record_transition", exc.cause)

        def again() -> Flow[Claimed]:
            landed = yield from self._landed(unsure[0])
            if landed is not None:
                # Confirmed when that write was sent, however long finding it out took.
                unsure[0].planner.lease_confirmed_at = unsure[0].sent
                return unsure[0].planner, landed
            fresh = yield from self._reload(unsure[0].planner)
            try:
                return fresh, (yield from self._record(fresh, outcome, after, records))
            except _Unsure as exc:
                unsure[0] = exc
                raise exc.cause from None

        return (yield from retried("record_transition", again))

    def _record(
        self, planner: Planner, outcome: inputs.Outcome | None, after: Point | None, records: bool
    ) -> Flow[Move]:
        """Apply `outcome` and the moves that follow to `planner`, and write them; `_Unsure`
        when a transient error leaves it open whether the write landed."""
        nxt, write = yield from self._plan(planner, outcome)
        token = new_token()
        watch = Watch(
            planner, before=before_record(nxt), after=after, events=write.events, records=records
        )
        sent = time.monotonic()
        try:
            state = yield from self._transact_at_once(planner, write, token, watch)
        except DatabaseInterrupted as exc:
            raise _Unsure(planner, nxt, token, watch, exc, sent) from exc
        planner.lease_confirmed_at = sent
        return Released(nxt, state) if write.release else nxt

    def _landed(self, unsure: _Unsure) -> Flow[Move | None]:
        """The move the write of `unsure` planned, if it landed (its token is the saga's),
        else None; its events are logged then and, when it gave the lease back, the saga's
        state is read."""
        planner = unsure.planner
        written = yield from db(StoreOps.write_token, planner.saga.id)
        if written is None or written[0] != unsure.token:
            return None
        _log.info("write_landed", saga_id=planner.saga.id, fence=planner.saga.fence)
        # Observed as the write would have been, had its reply come back (its fault point
        # before it was reached when it was sent).
        yield Observed((replace(unsure.watch, before=None),))
        if written[1] is None:
            # The write gave the lease back (a stop, a shutdown, a long backoff).
            if not self.options.answers:
                return Released(unsure.nxt, None)
            state = yield from db(StoreOps.get_state, planner.saga.id)
            return Released(unsure.nxt, state)
        return unsure.nxt

    def _transact_at_once(
        self, planner: Planner, write: Write, token: str, watch: Watch
    ) -> Flow[SagaState | None]:
        """A transition: one statement, one round trip (saga.write_saga_v4), which fails
        as a whole when the lease is no longer ours. When the write gives the lease back,
        the saga's state as it left it (read by the same statement)."""
        state = yield from watched(
            watch,
            StoreOps.apply_transition,
            write,
            owner=self.owner,
            lease_seconds=self.lease_seconds,
            token=token,
        )
        return state if write.release else None

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
        fresh.session_call = planner.session_call  # the session's call, carried on
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

    def _write(self, planner: Planner, nxt: Next, *, answer: bool | None = None) -> Write:
        """What the transaction that plans `nxt` writes, as the core decides it; it reads
        the state back on giving the lease up when `answer` (the runner's
        `RunnerOptions.answers` unless said)."""
        return planner.write(
            nxt,
            owner=self.owner,
            max_inline_sleep=self.options.max_inline_sleep,
            answer=self.options.answers if answer is None else answer,
        )


def _left(state: SagaState | None) -> tuple[SagaStatus | None, SagaState | None]:
    """A drive's end as read from the database: the saga's status, and its state."""
    return (None if state is None else state.status), state


class _Unsure(Exception):
    """A write failed for a transient reason, and may have landed all the same."""

    def __init__(
        self,
        planner: Planner,
        nxt: Next,
        token: str,
        watch: Watch,
        cause: Exception,
        sent: float,
    ) -> None:
        super().__init__(str(cause))
        self.planner = planner
        self.nxt = nxt
        self.token = token
        # What the write was to be watched with: observed if it is found to have landed.
        self.watch = watch
        self.cause = cause
        # When the write was sent (monotonic): if it landed, it confirmed the lease then.
        self.sent = sent


def before_record(nxt: Next) -> Point | None:
    """The fault point of a write that plans `nxt`: `before_record` when it starts an
    attempt, which is called once the write has committed."""
    return ("before_record", nxt.op.step, nxt.op.kind) if isinstance(nxt, Invoke) else None
