"""The control loop of driving a saga, written once for both drivers.

Claim, plan, call, record, retry, reload: each exchange is a generator that yields
effects (`saga._flows.effects`) and receives their results. The sync `Runner` and the asyncio
`AsyncRunner` carry the effects out and are the only code that differs between them; the
decisions stay in the core (`saga._core.planner`, `saga._core.inputs`).
"""

from __future__ import annotations

import logging
import math
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

import tenacity

from saga import telemetry
from saga._core import inputs
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
from saga._core.rows import describe
from saga._core.selffence import may_start_call
from saga._db.dbretry import DEFAULT_RETRY_SECONDS, is_transient, log_retry
from saga._db.store import Loaded, new_token
from saga._drivers import faults
from saga._flows.effects import (
    AttemptTimedOut,
    AwaitAbandoned,
    Begin,
    Call,
    Commit,
    Fetch,
    Flow,
    MachineryError,
    MachineryFailedError,
    NotCalledError,
    Pause,
    StepExited,
    Stopping,
    Wait,
    db,
    db_txn,
)
from saga._flows.started import Started
from saga._flows.store_ops import StoreOps
from saga.context import StepContext
from saga.definition import Saga
from saga.errors import LeaseLost
from saga.logs import events_logger, get_logger, step_logger
from saga.outcomes import Absent, Found, Inconclusive
from saga.retry import is_ambiguous
from saga.state import OperationStatus, SagaState

if TYPE_CHECKING:
    from saga.approvals import ApprovalVerifier

_log = get_logger("saga")
_events = events_logger()

T = TypeVar("T")
# What persists an attempt's running spend total (built by the driver for each attempt).
SpendReporter = Callable[[SagaRow, OpRow], Callable[[float], None]]
Lookup = Callable[[str, int], Saga[Any]]


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


def retried(what: str, body: Callable[[], Flow[T]], *, interruptible: bool = False) -> Flow[T]:
    """Run the flow `body()` again after a transient database error, with tenacity's
    backoff, for at most `DEFAULT_RETRY_SECONDS` (and, when `interruptible`, only while
    the driver is not stopping); the last error is raised."""
    policy = tenacity.Retrying(
        retry=tenacity.retry_if_exception(is_transient),
        wait=tenacity.wait_exponential(multiplier=0.05, max=2.0) + tenacity.wait_random(0, 0.05),
        stop=tenacity.stop_after_delay(DEFAULT_RETRY_SECONDS),
        reraise=True,
    )
    policy.begin()
    state = tenacity.RetryCallState(policy, fn=None, args=(), kwargs={})
    while True:
        action = policy.iter(state)
        if isinstance(action, tenacity.DoAttempt):
            try:
                result = yield from body()
            except BaseException:  # tenacity decides, and reraises what it does not retry
                state.set_exception(sys.exc_info())  # type: ignore[arg-type]
            else:
                state.set_result(result)
        elif isinstance(action, tenacity.DoSleep):
            exc = state.outcome.exception() if state.outcome is not None else None
            state.prepare_for_next_attempt()
            if interruptible and (yield Stopping()):
                assert exc is not None
                raise exc
            log_retry(what, exc, attempt=state.attempt_number - 1, retry_in=float(action))
            yield Pause(float(action), interruptible=interruptible)
        else:
            return action  # type: ignore[no-any-return]


class Flows:
    """Drives claimed sagas under a lease; every write is fenced. Each method is a flow:
    a generator of effects that a driver carries out."""

    def __init__(self, options: RunnerOptions, *, reporter: SpendReporter) -> None:
        self.options = options
        self.owner = options.owner
        self.lease_seconds = options.lease_seconds
        self.reporter = reporter

    # ----- entry points ------------------------------------------------------------------

    def claim_and_drive(
        self, definition: Saga[Any] | Lookup, saga_id: str
    ) -> Flow[SagaState | None]:
        """Claim one saga and drive it until it stops; None when it could not be claimed
        (or was lost to another owner on the way)."""
        claimed = yield from self.claim(definition, saga_id)
        if claimed is None:
            return None
        return (yield from self.drive(*claimed))

    def claim_started_and_drive(self, lookup: Lookup, started: Started) -> Flow[SagaState | None]:
        """`claim_started`, then drive the saga until it stops; None when it was not as
        started (nothing was written) or was lost to another owner on the way."""
        claimed = yield from self.claim_started(lookup, started)
        if claimed is None:
            return None
        return (yield from self.drive(*claimed))

    def claim_started(self, lookup: Lookup, started: Started) -> Flow[tuple[Planner, Next] | None]:
        """Claim a saga this orchestrator has just started, with its first move planned
        from the rows its start wrote, and record both in one statement: nothing is read
        before the claim. None when the saga is no longer as started (claimed by another
        owner, changed by an operator): nothing is written then, and the caller claims it
        the usual way.

        A claim whose reply was lost is recognised by the token of its write, as in
        `claim`: the retry carries on with the saga it holds."""
        row = started.row
        row.fence, row.lease_owner = 1, self.owner
        planner = self._new_planner(lookup(row.name, row.version), row, started.ops, [])
        nxt = yield from self._advance(planner)
        write = self._write(planner, nxt)
        token = new_token()
        tried = [False]

        def once() -> Flow[tuple[Planner, Next] | None]:
            if tried[0]:
                reclaimed = yield from self._reclaim(lookup, row.id, token)
                if reclaimed is not None:
                    return reclaimed
            tried[0] = True
            if isinstance(nxt, Invoke):
                faults.point("before_record", step=nxt.op.step, kind=nxt.op.kind)
            sent = time.monotonic()
            claimed, state = yield from db(
                StoreOps.claim_started,
                write,
                start_token=started.start_token,
                owner=self.owner,
                lease_seconds=self.lease_seconds,
                token=token,
            )
            if not claimed:
                return None
            planner.lease_confirmed_at = sent
            if write.release:
                planner.final_state = state
            log_events(planner, write.events)
            return planner, nxt

        return (yield from retried("claim_saga", once))

    def claim(
        self, definition: Saga[Any] | Lookup, saga_id: str
    ) -> Flow[tuple[Planner, Next] | None]:
        """Claim one saga and plan (and record) its first move; None when it is not
        runnable or another owner's lease is live.

        `definition` is the saga's definition, or a lookup by the claimed row's name and
        version (for a caller that has not read the saga before claiming it); an error
        the lookup raises (`NotRegistered`) rolls the claim back.

        A claim whose reply was lost is recognised by the token of its first write: the
        retry then carries on with the saga it holds instead of finding it leased (to
        itself) and giving up."""
        lookup = _lookup_of(definition)
        token = new_token()
        tried = [False]

        def once() -> Flow[tuple[Planner, Next] | None]:
            claimed = (yield from self._reclaim(lookup, saga_id, token)) if tried[0] else None
            tried[0] = True
            if claimed is None:
                claimed = yield from self._claim_by_id(lookup, saga_id, token)
            return claimed

        return (yield from retried("claim_saga", once))

    def transact(
        self, planner: Planner, outcome: inputs.Outcome | None
    ) -> Flow[tuple[Planner, Next]]:
        """Record `outcome` (None: only the moves that need no call) and plan the next
        move, in one fenced write; see `_transact`."""
        return (yield from self._transact(planner, outcome))

    def _claim_by_id(
        self, lookup: Lookup, saga_id: str, token: str
    ) -> Flow[tuple[Planner, Next] | None]:
        sent = time.monotonic()
        yield Begin()
        loaded = yield from db_txn(
            StoreOps.claim_txn, saga_id, owner=self.owner, lease_seconds=self.lease_seconds
        )
        if loaded is None:
            yield Commit()
            return None
        row = loaded[0]
        planner, nxt, events, read = yield from self._begin_txn(
            lookup(row.name, row.version), loaded, token
        )
        yield Commit()
        planner.lease_confirmed_at = sent
        if read is not None:
            planner.final_state = yield Fetch(read)
        log_events(planner, events)
        return planner, nxt

    def claim_next(self, kinds: Sequence[str], lookup: Lookup) -> Flow[tuple[Planner, Next] | None]:
        """Claim the longest-waiting runnable saga of these name:version kinds and plan its
        first move in the same transaction; None when there is nothing to claim.

        A transient database error is retried; a claim that had landed although its reply
        was lost is found again by its token and carried on."""
        token = new_token()
        tried = [False]

        def once() -> Flow[tuple[Planner, Next] | None]:
            if tried[0]:
                own = yield from db(StoreOps.own_claim, owner=self.owner, token=token)
                if own is not None:
                    saga_id, _name, _version = own
                    reclaimed = yield from self._reclaim(lookup, saga_id, token)
                    if reclaimed is not None:
                        return reclaimed
            tried[0] = True
            return (yield from self._claim_next_once(kinds, lookup, token))

        try:
            return (yield from retried("claim_next_saga", once, interruptible=True))
        except Exception as exc:
            if is_transient(exc) and (yield Stopping()):
                return None  # stopping while the database was unavailable
            raise

    def _claim_next_once(
        self, kinds: Sequence[str], lookup: Lookup, token: str
    ) -> Flow[tuple[Planner, Next] | None]:
        sent = time.monotonic()
        yield Begin()
        loaded = yield from db_txn(
            StoreOps.claim_next_txn, kinds=kinds, owner=self.owner, lease_seconds=self.lease_seconds
        )
        if loaded is None:
            yield Commit()
            return None
        row = loaded[0]
        planner, nxt, events, read = yield from self._begin_txn(
            lookup(row.name, row.version), loaded, token
        )
        yield Commit()
        planner.lease_confirmed_at = sent
        if read is not None:
            planner.final_state = yield Fetch(read)
        log_events(planner, events)
        return planner, nxt

    def claim_batch(
        self, kinds: Sequence[str], lookup: Lookup, limit: int
    ) -> Flow[list[tuple[Planner, Next]]]:
        """Claim up to `limit` of the longest-waiting runnable sagas of these name:version
        kinds in one statement, and plan and record the first move of each, all in one
        transaction and one commit; each saga has its own lease, fence and first write.
        The sagas claimed, in run_after order, to be driven each by a driver of its own
        (none when there was nothing to claim). A limit of 1 is `claim_next`.

        A transient database error is retried. A claim that had landed although its reply
        was lost is found again by the tokens of its first writes (one per saga it could
        take): every saga it holds is carried on, none is left to its lease's expiry. A
        saga whose first write alone is refused is parked with the reason; the others of
        the batch are driven."""
        if limit <= 1:
            one = yield from self.claim_next(kinds, lookup)
            return [] if one is None else [one]
        tokens = [new_token() for _ in range(limit)]
        tried = [False]
        # Sagas of a landed claim carried on so far, by id: a retry after an error in the
        # middle of carrying them on does not look for them again.
        carried: dict[str, tuple[Planner, Next] | None] = {}

        def once() -> Flow[list[tuple[Planner, Next]]]:
            if tried[0]:
                owned: dict[str, str] = yield from db(
                    StoreOps.own_claims, owner=self.owner, tokens=tokens
                )
                for saga_id, token in sorted(owned.items(), key=lambda item: tokens.index(item[1])):
                    if saga_id not in carried:
                        carried[saga_id] = yield from self._reclaim_one(lookup, saga_id, token)
                reclaimed = [c for c in carried.values() if c is not None]
                if carried:
                    return reclaimed
            tried[0] = True
            return (yield from self._claim_batch_once(kinds, lookup, tokens))

        try:
            return (yield from retried("claim_saga_batch", once, interruptible=True))
        except Exception as exc:
            if is_transient(exc) and (yield Stopping()):
                return [c for c in carried.values() if c is not None]
            raise

    def _reclaim_one(
        self, lookup: Lookup, saga_id: str, token: str
    ) -> Flow[tuple[Planner, Next] | None]:
        """`_reclaim` of one saga of a batch claim: what it raises (other than a transient
        error, retried) is that saga's alone, which is then left to the next owner once
        its lease expires; the other sagas of the claim are carried on."""
        try:
            return (yield from self._reclaim(lookup, saga_id, token))
        except Exception as exc:
            if is_transient(exc):
                raise
            _log.error("reclaim_failed", saga_id=saga_id, error=_describe_error(exc))
            return None

    def _claim_batch_once(
        self, kinds: Sequence[str], lookup: Lookup, tokens: Sequence[str]
    ) -> Flow[list[tuple[Planner, Next]]]:
        sent = time.monotonic()
        yield Begin()
        batch: list[Loaded] = yield from db_txn(
            StoreOps.claim_batch_txn,
            kinds=kinds,
            owner=self.owner,
            lease_seconds=self.lease_seconds,
            limit=len(tokens),
        )
        planned: list[tuple[Planner, Next, Write, str]] = []
        unplanned: list[SagaRow] = []
        for loaded, token in zip(batch, tokens, strict=False):
            row = loaded[0]
            try:
                definition = lookup(row.name, row.version)
            except Exception as exc:
                if is_transient(exc):
                    raise
                # The claim reads only registered kinds: a registry changed meanwhile.
                _log.error("saga_not_plannable", saga_id=row.id, error=_describe_error(exc))
                unplanned.append(row)
                continue
            planner = self._new_planner(definition, *loaded)
            nxt = yield from self._advance(planner)
            planned.append((planner, nxt, self._write(planner, nxt), token))
        read = None
        if planned:
            read = yield from db_txn(
                StoreOps.save_batch_txn,
                [(write, token) for _, _, write, token in planned],
                owner=self.owner,
                lease_seconds=self.lease_seconds,
            )
            for _, nxt, _, _ in planned:
                if isinstance(nxt, Invoke):
                    faults.point("before_record", step=nxt.op.step, kind=nxt.op.kind)
        yield Commit()
        for row in unplanned:
            yield from self.release_after_error(row)
        if read is None:
            return []
        answers: list[SagaState | Exception | None] = yield Fetch(read)
        claimed: list[tuple[Planner, Next]] = []
        for (planner, nxt, write, _), answer in zip(planned, answers, strict=True):
            if isinstance(answer, Exception):
                # One bad saga never stops the others: it alone is parked, with the reason.
                try:
                    yield from self._park_broken(planner, answer)
                except Exception:
                    _log.exception("saga_park_failed", saga_id=planner.saga.id)
                    yield from self.release_after_error(planner.saga)
                continue
            planner.lease_confirmed_at = sent
            if write.release:
                planner.final_state = answer
            log_events(planner, write.events)
            claimed.append((planner, nxt))
        return claimed

    def _reclaim(
        self, lookup: Lookup, saga_id: str, token: str
    ) -> Flow[tuple[Planner, Next] | None]:
        """The saga our claim took, when that claim landed although its reply was lost
        (its first write carries `token` and the lease is still ours); None otherwise.

        The claim's first move was committed with it: an attempt it started is ours to
        call now; any other move is planned again from what was committed."""
        written = yield from db(StoreOps.write_token, saga_id)
        if written is None or written[0] != token or written[1] != self.owner:
            return None
        loaded = yield from self._load(saga_id)
        if loaded is None:
            return None
        # Still our claim's, as read? Every write (another owner's claim, its reconcile,
        # the attempt it starts) changes the token: a read that came after one would hand
        # us the new owner's attempt, under its fence, to call a second time.
        again = yield from db(StoreOps.write_token, saga_id)
        if again != written:
            _log.info("claim_taken_over", saga_id=saga_id, fence=loaded[0].fence)
            return None
        planner = self._planner(lookup(loaded[0].name, loaded[0].version), loaded)
        _log.info("claim_landed", saga_id=saga_id, fence=planner.saga.fence)
        started = [o for o in planner.ops if o.status == OperationStatus.RUNNING]
        if started:
            # Every attempt running before the claim was marked unknown by its first move:
            # a running one now is the attempt that move started.
            return planner, Invoke(started[0])
        try:
            return (yield from self._transact(planner, None))
        except LeaseLost:
            # The lease ran out while the lost reply was being recovered (a slow reconnect,
            # a pooler waiting for its server) and another owner holds the saga now: it is
            # theirs to drive, and this claim has nothing.
            _log.info("claim_taken_over", saga_id=saga_id, fence=planner.saga.fence)
            return None

    def _load(self, saga_id: str) -> Flow[Loaded | None]:
        yield Begin()
        loaded: Loaded | None = yield from db_txn(StoreOps.load_txn, saga_id)
        yield Commit()
        return loaded

    def plan_new(
        self, definition: Saga[Any], row: SagaRow, ops: list[OpRow], *, may_call: bool = True
    ) -> tuple[Planner, Next, Write]:
        """Plan the first move of a saga about to be created under our lease (nothing is
        written here); returns the planner, its move, and the write that records it."""
        # Nothing is stored yet: a definition that cannot plan it raises to the caller.
        planner = self._new_planner(definition, row, ops, [])
        nxt = planner.advance(_now(), may_call=may_call)
        write = self._write(planner, nxt)
        if isinstance(nxt, Invoke):
            faults.point("before_record", step=nxt.op.step, kind=nxt.op.kind)
        return planner, nxt, write

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
                    self._invoke(planner, nxt.op), planner, nxt.op, keys=self.options.telemetry_keys
                )
            elif isinstance(nxt, AskReconcile):
                planner, nxt = yield from telemetry.traced_call(
                    self._reconcile(planner, nxt.op),
                    planner,
                    nxt.op,
                    keys=self.options.telemetry_keys,
                    reconcile=True,
                )
            elif isinstance(nxt, Prepare):
                planner, nxt = yield from self._prepare(planner, nxt.op)
        return planner, nxt

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
        reason = f"driving the saga raised {_describe_error(exc)}; parked for review"
        _log.error(
            "saga_drive_failed",
            saga_id=saga.id,
            fence=saga.fence,
            error=_describe_error(exc),
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
            inputs.apply(fresh, inputs.Parked(reason), _now())
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
        nxt = yield from self._advance(planner)
        write = self._write(planner, nxt)
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

    def _advance(self, planner: Planner) -> Flow[Next]:
        """The planner's next move; a saga it cannot plan (an operation its definition no
        longer declares, user code in a cost function, confirm rule or input model that
        raises) is parked with the reason instead, so that it never takes a worker down.

        The planner calls user code before it changes the operation concerned: what it
        recorded before the error are whole transitions, kept with the park."""
        stopping = yield Stopping()
        try:
            return planner.advance(_now(), may_call=not stopping)
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
                traceback="".join(traceback.format_exception(exc)),
            )
            planner.park(reason)
            return Stop(planner.saga.status)

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
        if outcome is not None:
            inputs.apply(planner, outcome, _now())
        nxt = yield from self._advance(planner)
        token = new_token()
        write = self._write(planner, nxt)
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
            definition, *loaded, now=_now(), approval_verifier=self.options.approval_verifier
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
            _report=(self.reporter(saga, op) if op.status == OperationStatus.RUNNING else None),
            # Bound lazily, on the step's first log call.
            log=step_logger(
                saga_id=saga.id,
                step=op.step,
                kind=op.kind,
                attempt=op.attempts,
                idempotency_key=op.idempotency_key,
            ),
        )

    def _prepare(self, planner: Planner, op: OpRow) -> Flow[tuple[Planner, Next]]:
        spec = planner.spec_of(op)
        assert spec.prepare_fn is not None and spec.request_codec is not None
        ctx = self._context(planner, op)
        outcome: inputs.Outcome
        # Nothing has been called when prepare raises, so its outcome is never unknown:
        # PermanentError and fail_on fail the attempt and the operation, retry_on retries,
        # and anything else (a bug, a request that cannot be stored) parks the saga.
        verdict = "unknown"
        failure: Exception | None = None
        try:
            prepared = yield Call(spec.prepare_fn, (ctx, *planner.arguments(op)))
        except MachineryError as exc:
            # Our machinery, not the hook: no verdict on the operation, whose attempt was
            # not started; the saga parks with the reason.
            _log.error("prepare_not_run", step=op.step, kind=op.kind, error=str(exc))
            reason = (
                f"prepare of {describe(op)} could not be run: the orchestrator failed "
                f"({exc}); the attempt was not called"
            )
            return (yield from self._transact(planner, inputs.NotCalled(op.step, op.kind, reason)))
        except Exception as exc:
            verdict, failure = spec.retry.classify(exc), exc
            if verdict == "unknown" and is_ambiguous(exc):
                verdict = "retry"  # nothing was called: a cut-off reply is only transient here
        else:
            try:
                request = spec.request_codec.encode(prepared)
            except TypeError as exc:
                failure = exc
        if failure is None:
            outcome = inputs.Prepared(op.step, op.kind, request)
        else:
            retryable, park = verdict == "retry", verdict == "unknown"
            outcome = inputs.PrepareRaised(
                op.step,
                op.kind,
                _describe_error(failure),
                retryable=retryable,
                delay=spec.retry.delay_after(op.attempts + 1) if retryable else 0.0,
                park=park,
                traceback=traceback_of(failure) if park else None,
            )
        # Nothing has been called yet: a retried transaction may simply prepare again.
        return (yield from self._transact(planner, outcome))

    def _invoke(self, planner: Planner, op: OpRow) -> Flow[tuple[Planner, Next]]:
        spec = planner.spec_of(op)
        codec, policy = spec.codec, spec.retry
        where = {"step": op.step, "kind": op.kind}
        outcome: inputs.OpOutcome
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
                f"attempt {op.attempts} of {describe(op)} was not called: its arguments "
                f"could not be built ({_describe_error(exc)}); nothing of it ran"
            )
            return (yield from self._transact(planner, inputs.NotCalled(op.step, op.kind, reason)))
        faults.point("before_call", **where)
        yield from self._self_fence(planner, op)
        try:
            value = yield Call(
                spec.fn,
                arguments,
                timeout_seconds=spec.guards.timeout_seconds,
                hold=(planner.saga.id, planner.saga.fence),
            )
        except AttemptTimedOut as exc:
            outcome = inputs.TimedOut(op.step, op.kind, str(exc), exc.still_running)
        except NotCalledError as exc:
            # Our machinery failed before any of the step ran: no outcome to record.
            _log.error("attempt_not_called", **where, error=str(exc), traceback=traceback_of(exc))
            reason = (
                f"attempt {op.attempts} of {describe(op)} was not called: the orchestrator "
                f"could not run it ({exc}); nothing of it ran"
            )
            outcome = inputs.NotCalled(op.step, op.kind, reason)
        except MachineryFailedError as exc:
            # Not the step's verdict, whatever its policy says of the error: unknown, parked.
            reason = (
                f"attempt {op.attempts}: the orchestrator failed after the step's function "
                f"had started ({exc}); its outcome is unknown"
            )
            outcome = inputs.MachineryFailed(op.step, op.kind, reason, traceback_of(exc))
        except Exception as exc:
            error = _describe_error(exc)
            verdict = policy.classify(exc)
            if verdict == "unknown":
                # Not a verdict: the exception may come after the effect (discipline 7).
                if is_ambiguous(exc):
                    # The reply was cut off, the provider may have acted: settled as unknown
                    # (a reconcile hook, a same-key retry of an idempotent operation, else a
                    # park), a retry only after the policy's backoff.
                    why = (
                        "an ambiguous error (the provider may have acted before the reply "
                        "was cut off)"
                    )
                    delay = policy.delay_after(op.attempts)
                else:
                    why = "which is neither a PermanentError nor listed in fail_on or retry_on"
                    delay = 0.0
                reason = f"attempt {op.attempts} raised {error}, {why}: its outcome is unknown"
                outcome = inputs.Raised(
                    op.step, op.kind, reason, "unknown", delay, traceback=traceback_of(exc)
                )
            else:
                retryable = verdict == "retry"
                delay = policy.delay_after(op.attempts) if retryable else 0.0
                outcome = inputs.Raised(op.step, op.kind, error, verdict, delay)
        else:
            try:
                stored = codec.encode(value)
            except TypeError as exc:
                reason = f"TypeError: {exc}; the effect may have happened, so a human decides"
                outcome = inputs.NotJson(op.step, op.kind, reason)
            else:
                outcome = inputs.Returned(op.step, op.kind, stored)
        recorded: inputs.Outcome = outcome
        if ctx.spent or ctx._refused:
            refused = ctx._refused[0] if ctx._refused else None
            recorded = inputs.Spent(outcome, ctx.spent, refused)
        faults.point("after_call", **where)
        result = yield from self._transact(planner, recorded)
        faults.point("after_record", **where)
        return result

    def _reconcile(self, planner: Planner, op: OpRow) -> Flow[tuple[Planner, Next]]:
        spec = planner.spec_of(op)
        fn, codec = spec.reconcile_fn, spec.codec
        assert fn is not None  # the planner asks only operations that have a hook
        running = yield from self._abandoned_attempt(planner, op)
        if running is not None:
            return (yield from self._transact(planner, inputs.Parked(running)))
        ctx = self._context(planner, op)
        outcome: inputs.OpOutcome
        yield from self._self_fence(planner, op)
        try:
            answer = yield Call(fn, (ctx, *planner.arguments(op)))
            if isinstance(answer, Found):
                try:
                    stored = codec.encode(answer.result)
                except TypeError as exc:
                    # Asking again would find the same value: a human decides now.
                    reason = f"reconcile found the effect, but TypeError: {exc}; a human decides"
                    outcome = inputs.NotJson(op.step, op.kind, reason, returned=False)
                else:
                    outcome = inputs.Answered(
                        op.step, op.kind, "found", stored, answer.provider_reference
                    )
            elif isinstance(answer, Absent):
                outcome = inputs.Answered(op.step, op.kind, "absent", settled=answer.settled)
            else:
                reason = (
                    answer.reason or "the provider's answer was inconclusive"
                    if isinstance(answer, Inconclusive)
                    else f"reconcile returned {type(answer).__name__}; expected Found, Absent "
                    "or Inconclusive"
                )
                outcome = inputs.Answered(op.step, op.kind, "inconclusive", reason=reason)
        except MachineryError as exc:
            # No answer: the orchestrator could not run the hook.
            reason = f"reconcile could not be run: the orchestrator failed ({exc})"
            outcome = inputs.Answered(op.step, op.kind, "inconclusive", reason=reason)
        except Exception as exc:
            reason = f"reconcile raised {_describe_error(exc)}"
            outcome = inputs.Answered(op.step, op.kind, "inconclusive", reason=reason)
        # The operation is `unknown` while it is reconciled: nothing to protect from replay.
        result = yield from self._transact(planner, outcome)
        faults.point("after_record", step=op.step, kind=op.kind)
        return result

    def _self_fence(self, planner: Planner, op: OpRow) -> Flow[None]:
        """Start a call only while the lease cannot have ended, less a margin
        (`saga._core.selffence`), by this process's clock from when the write that last
        confirmed it was sent. Past that (a reply held by a pooler, a lost reply found
        again, a stalled process), the lease is confirmed again by a fenced renewal first;
        `LeaseLost` when it is no longer ours: another owner may have settled the attempt
        meanwhile (a reconcile that found nothing), and this call must not start."""
        saga, lease = planner.saga, self.lease_seconds
        held = (saga.id, saga.fence)

        def renew() -> Flow[tuple[float, bool]]:
            sent = time.monotonic()
            alive = yield from db(
                StoreOps.renew_leases, {held}, owner=self.owner, lease_seconds=lease
            )
            return sent, held in alive

        while not may_start_call(planner.lease_confirmed_at, time.monotonic(), lease):
            sent, alive = yield from retried("confirm_lease", renew)
            if not alive:
                raise LeaseLost(
                    f"the lease of saga {saga.id} at fence {saga.fence} may have ended before "
                    f"{describe(op)} was called, and it is no longer ours: not called"
                )
            _log.info("lease_confirmed_again", saga_id=saga.id, fence=saga.fence, step=op.step)
            planner.lease_confirmed_at = sent

    def _abandoned_attempt(self, planner: Planner, op: OpRow) -> Flow[str | None]:
        """Wait, under the lease, for attempts of `op` abandoned at their timeout that still
        run in this process; the reason to park if one outlives the wait (a reconcile
        answer now could be overtaken by its effect)."""
        saga = planner.saga
        late = yield AwaitAbandoned(saga.id, op.step, op.kind, (saga.id, saga.fence))
        if not late:
            return None
        return f"outcome of {op.kind} {op.step!r} is unknown and not reconciled: " + (
            f"{late[0].describe()}; resolve it once it has ended"
        )


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


# Longest traceback kept in an audit event (characters; its last lines are kept).
_MAX_TRACEBACK_CHARS = 8000


def _lookup_of(definition: Saga[Any] | Lookup) -> Lookup:
    """A lookup of definitions by (name, version): `definition` itself, or one that gives
    the definition whatever the claimed saga's name."""
    if isinstance(definition, Saga):
        fixed = definition
        return lambda name, version: fixed
    return definition


def traceback_of(exc: BaseException) -> str:
    """The traceback of `exc` as text, its end kept when it is long (of what the step
    raised, for a `StepExited`)."""
    if isinstance(exc, StepExited):
        exc = exc.raised
    text = "".join(traceback.format_exception(exc))
    return text if len(text) <= _MAX_TRACEBACK_CHARS else "..." + text[-_MAX_TRACEBACK_CHARS:]


def _now() -> datetime:
    # The time of an input to the core (which reads no clock itself).
    return datetime.now().astimezone()


def _describe_error(exc: BaseException) -> str:
    if isinstance(exc, StepExited):  # named as the step raised it
        exc = exc.raised
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def describe_error(exc: BaseException) -> str:
    """`Type: message` of an exception (the type alone when the message is empty)."""
    return _describe_error(exc)


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
