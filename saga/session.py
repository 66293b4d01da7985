"""Sessions: durable steps called as code decides, on the same ledger as declared sagas.

A session is a saga row (named `session/<name>`, a name no declared saga can have, so no
worker ever claims it) whose operations are added as its code calls durable steps. The
process inside the `with` block holds the session's lease (kept alive by the heartbeat)
and drives each call through the same flows as a declared saga's step: `running`
committed before the call, the outcome after, retries, timeouts, unknown outcomes settled
by a reconcile hook or a same-key retry, or a park. The flows are shared by the two
doors; `Session` and `AsyncSession` only carry them out.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Sequence
from contextlib import AbstractContextManager
from types import TracebackType
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from saga._codefirst import SessionSaga as SessionSaga  # re-exported: named by saga.session
from saga._core import inputs
from saga._core.planner import Planner, SagaRow
from saga._core.rows import Event, OpRow
from saga._flows.claim import Flows
from saga._flows.drive import Released, retried
from saga._flows.effects import Flow, Observed, Pause, Watch, db
from saga._flows.store_ops import StoreOps
from saga.durable import DurableStep, session_scope
from saga.errors import (
    IdempotencyConflict,
    PermanentError,
    SagaDefinitionError,
    SessionBusy,
    SessionParked,
    StepStateError,
)
from saga.keys import call_operation_long_name, call_operation_name, operation_key
from saga.keys import request_hash as hash_fields
from saga.remedies import LEDGER_PREFIX as LEDGER_PREFIX  # re-exported: named by saga.session
from saga.remedies import SESSION_PREFIX as SESSION_PREFIX
from saga.remedies import resolve_commands
from saga.state import HistoryEvent, OperationState, OperationStatus, SagaState, SagaStatus

if TYPE_CHECKING:
    from saga._drivers.driver import Runner
    from saga._drivers.driver_async import AsyncRunner
    from saga._drivers.leases import LeaseKeeper
    from saga._drivers.leases_async import AsyncLeaseKeeper


class SessionEngine(Protocol):
    """What a `Session` needs of its orchestrator: a driver of its flows, the heartbeat
    that keeps its lease alive, and the audit trail (an `Orchestrator` is one)."""

    @property
    def lease_seconds(self) -> float: ...

    @property
    def lease_keeper(self) -> LeaseKeeper: ...

    def _runner(self) -> Runner: ...

    def history(self, saga_id: str) -> list[HistoryEvent]: ...


class AsyncSessionEngine(Protocol):
    """What an `AsyncSession` needs of its orchestrator: a driver of its flows on the
    running loop, the heartbeat task, and the audit trail (an `AsyncOrchestrator` is one)."""

    @property
    def lease_seconds(self) -> float: ...

    async def runner(self) -> AsyncRunner: ...

    async def lease_keeper(self) -> AsyncLeaseKeeper: ...

    async def history(self, saga_id: str) -> list[HistoryEvent]: ...


# How often a session entry that found a live holder looks again (seconds).
_BUSY_POLL = 0.1


def call_step_name(durable: DurableStep[Any, Any], key: str) -> str:
    """The operation name of a call of `durable` under `key` (`call_operation_name`)."""
    return call_operation_name(durable.name, key)


def call_long_name(durable: DurableStep[Any, Any], key: str) -> str:
    """The operation name of a call of `durable` under `key` whose short name another
    key's call has (`call_operation_long_name`)."""
    return call_operation_long_name(durable.name, key)


class SessionFlows:
    """Opening, calling and closing one session, as flows both doors carry out."""

    def __init__(
        self,
        flows: Flows,
        definition: SessionSaga,
        *,
        run_id: str,
        tenant: str,
        lease_seconds: float,
    ) -> None:
        self.flows = flows
        self.definition = definition
        self.run_id = run_id
        self.tenant = tenant
        self.lease_seconds = lease_seconds

    def open(self, wait_seconds: float) -> Flow[tuple[Planner | None, SagaState | None]]:
        """Create the session's row if it is new, leased to us in the same statement (one
        commit), else take the lease of the existing one, waiting up to `wait_seconds`
        for a live holder to let go (`SessionBusy` after). A session that is no longer
        runnable (finished, parked) is returned as its state, unleased."""
        planner, events = self._planned_row()
        row = planner.saga

        def start() -> Flow[dict[str, Any]]:
            outcome: dict[str, Any] = yield from db(
                StoreOps.start_saga, row, [], events, lease_seconds=self.lease_seconds, notify=False
            )
            return outcome

        # A start whose reply was lost is retried; the retry that finds this very row (by
        # its new id) knows the first one landed, leased to us.
        outcome = yield from retried("start_session", start)
        if outcome["created"]:
            yield Observed((Watch(planner, events=events[1:]),))
            return planner, None
        return (yield from self._claim(str(outcome["id"]), wait_seconds))

    def _planned_row(self) -> tuple[Planner, list[Event]]:
        """A new session row leased to us (fence 1) and planned as a claim would plan it,
        with the events its creation records; nothing is written here."""
        row = SagaRow(
            id=str(uuid.uuid4()),
            name=self.definition.name,
            version=1,
            tenant_id=self.tenant,
            key=self.run_id,
            input={},
            input_hash=hash_fields({}),
            status=SagaStatus.PENDING,
            error=None,
            direction="forward",
            fence=1,
            run_after=None,
            lease_owner=self.flows.owner,
        )
        planner, _, write = self.flows.plan_new(self.definition, row, [])
        # No call is asked for yet: the plan holds (running, leased) and writes no operation.
        assert not write.release and not write.new_ops and not write.confirmations
        return planner, [Event("session_started"), *write.events]

    def _claim(
        self, saga_id: str, wait_seconds: float
    ) -> Flow[tuple[Planner | None, SagaState | None]]:
        """Take the lease of the existing session `saga_id`, waiting up to `wait_seconds`
        for a live holder to let go; see `open`."""
        deadline = time.monotonic() + wait_seconds
        while True:
            claimed = yield from self.flows.claim(self.definition, saga_id)
            if claimed is not None:
                planner, nxt = claimed
                if planner.saga.direction != "backward":
                    return planner, None
                # Compensating: an operator cancelled or compensated it, or a crash cut its
                # compensations short. The claim has planned (and recorded) the next one;
                # they are finished here, and the session is returned closed.
                yield from self.flows.carry_on(planner, nxt)
                closed: SagaState | None = yield from db(StoreOps.get_state, saga_id)
                assert closed is not None
                return None, closed
            state: SagaState | None = yield from db(StoreOps.get_state, saga_id)
            if state is None:
                raise StepStateError(f"session {self.run_id!r} was deleted while it was opened")
            if not state.status.is_runnable:
                return None, state
            left = deadline - time.monotonic()
            if left <= 0:
                raise SessionBusy(
                    f"session {self.run_id!r} ({saga_id}) is held by {state.lease_owner} "
                    f"until {state.lease_expires_at}; nothing was called (wait longer with "
                    "wait_seconds=, or let the other holder finish)"
                )
            yield Pause(min(_BUSY_POLL, left))

    def call(
        self, planner: Planner, asked: inputs.CallAsked | None, step: str
    ) -> Flow[tuple[Planner, SagaState | None]]:
        """Record the call `step` (new when `asked`), run it to a settled outcome (or a
        park), and return the planner as the last write left it, with the session's state
        when that write gave the lease back (a park)."""
        planner.session_call = step
        try:
            planner, nxt = yield from self.flows.transact(planner, asked)
            planner, nxt = yield from self.flows.carry_on(planner, nxt)
        finally:
            planner.session_call = None
        return planner, nxt.state if isinstance(nxt, Released) else None

    def close(self, planner: Planner, failure: str | None) -> Flow[SagaState | None]:
        """End the session: completed, or (with `failure`) its succeeded calls
        compensated in reverse; the lease is given back with the last write, which reads
        the state it leaves."""
        planner, nxt = yield from self.flows.transact(planner, inputs.SessionClosed(failure))
        planner, nxt = yield from self.flows.carry_on(planner, nxt)
        if isinstance(nxt, Released):
            return nxt.state
        state: SagaState | None = yield from db(StoreOps.get_state, planner.saga.id)
        return state

    def leave(
        self, planner: Planner, *, closes: bool, failure: str | None
    ) -> Flow[SagaState | None]:
        """End the block: close the session (`close`) and return its final state, or,
        when it does not close, give the lease back and return None: the session stays
        open, and the next entry resumes it (its settled calls replay)."""
        if not closes:
            yield from self.flows.release_after_error(planner.saga)
            return None
        return (yield from self.close(planner, failure))


class _Decided(NamedTuple):
    """What `_Ledger.before` decided of a call."""

    name: str  # the call's operation name
    key: str  # the call's key in the session
    asked: inputs.CallAsked | None  # the call to add, when it is new
    replay: Any  # the stored result to return, or _NOT_STORED when the call must run


class _Ledger:
    """What a session knows of its calls, and what both doors decide alike."""

    def __init__(self, definition: SessionSaga) -> None:
        self.definition = definition
        self.planner: Planner | None = None
        self.finished: SagaState | None = None
        self.failure: str | None = None
        self.executed = 0
        self.replayed = 0
        self.reconciled = 0

    def before(
        self, durable: DurableStep[Any, Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> _Decided:
        """Decide a call: replay its stored result, raise what it raised before, or run
        it (`replay` is then `_NOT_STORED`)."""
        if durable.prepare_fn is not None:
            # A prepared request would take the place of the call's stored arguments and
            # request hash, which are the call's identity in a session.
            raise SagaDefinitionError(
                f"durable step {durable.name!r} has a prepare hook: prepared requests are "
                "not supported in sessions yet; compute the request in the step itself"
            )
        call = durable.call_of(args, kwargs)
        name = self.call_name(durable, call.key)
        stored = self._stored(name)
        if stored is not None:
            status, request_hash, hash_version, result, error = stored
            if not call.matches(request_hash, hash_version):
                raise IdempotencyConflict(
                    f"durable step {durable.name!r} was called in session {self.session_id()} "
                    f"under key {call.key!r} with other arguments; use another key for another "
                    "call",
                    saga=self.definition.name,
                    key=call.key,
                )
            if status == OperationStatus.SUCCEEDED:
                self.replayed += 1
                return _Decided(name, call.key, None, durable.codec.decode(result))
            if status == OperationStatus.FAILED:
                raise self._raised(name, error)
        if self.planner is None:
            assert self.finished is not None
            if self.finished.status == SagaStatus.NEEDS_REVIEW:
                raise SessionParked(_parked_message(self.finished))
            forked = self.finished.forked_to
            raise StepStateError(
                f"session {self.session_id()} is {self.finished.status.value}: a call it did not "
                f"make ({durable.name!r} under key {call.key!r}) cannot run in it now"
                + (
                    f"; it goes on in its fork {forked}: run this code under the fork's run id "
                    f"(`saga show {forked}`)"
                    if forked is not None
                    else ""
                )
            )
        if self.failure is not None:
            raise StepStateError(
                f"session {self.session_id()} was failed ({self.failure}): no call runs after that"
            )
        planner = self.planner
        op = planner.find(name, "action")
        asked = None
        position = len(planner.actions) if op is None else op.position
        if op is None:
            asked = inputs.CallAsked(
                step=name,
                position=position,
                # The whole key's digest, whatever the call's (display) name.
                idempotency_key=self._identity(call_long_name(durable, call.key)),
                request_hash=call.request_hash,
                arguments=call.arguments,
                max_attempts=durable.retry.max_attempts,
                key=call.key,
            )
        self.definition.install(name, position, durable, (args, kwargs))
        # What an earlier run of this call left here is not this run's.
        self.definition.raised.pop(name, None)
        self.definition.refused.pop(name, None)
        self.definition.found.discard(name)
        return _Decided(name, call.key, asked, _NOT_STORED)

    def after(
        self,
        durable: DurableStep[Any, Any],
        decided: _Decided,
        planner: Planner,
        left: SagaState | None,
    ) -> Any:
        """What the call returns once its flow is done: its result, or its error (a
        `TypeError` when its result could not be stored, `SessionParked` when the session
        waits for a human). `left`: the session's state when the call's last write gave
        the lease back."""
        name = decided.name
        refused = self.definition.refused.pop(name, None)
        self.planner = planner
        saga = planner.saga
        if saga.status == SagaStatus.NEEDS_REVIEW:
            parked = self._parked(planner, left)
            if refused is not None:
                raise _not_stored(durable, decided, parked, refused) from refused
            exited = self.definition.raised.pop(name, None)
            if exited is not None and not isinstance(exited, Exception):
                # The step's own SystemExit or KeyboardInterrupt, its unknown outcome now
                # recorded, goes on through the session's code as the step raised it.
                raise exited
            raise SessionParked(_parked_message(parked))
        op = planner.find(name, "action")
        assert op is not None
        if op.status == OperationStatus.SUCCEEDED:
            if name in self.definition.found:
                self.definition.found.discard(name)
                self.reconciled += 1
            else:
                self.executed += 1
            return durable.codec.decode(op.result)
        if op.status == OperationStatus.FAILED:
            raise self._raised(name, op.error)
        raise SessionParked(  # pragma: no cover - the flow settles or parks every call
            f"call {name!r} of session {self.session_id()} ended {op.status.value}: {op.error}"
        )

    def _parked(self, planner: Planner, state: SagaState | None) -> SagaState:
        """The state of a session the call parked (`state`, read by the write that gave
        the lease back): the session is finished for this block (later calls raise
        `SessionParked`)."""
        if state is None:  # pragma: no cover - a park's write always reads the state back
            raise SessionParked(f"session {planner.saga.id} needs a human: {planner.saga.error}")
        self.planner = None
        self.finished = state
        return state

    def call_name(self, durable: DurableStep[Any, Any], key: str) -> str:
        """The operation name of the call of `durable` under `key` in this session.

        Short (`call_step_name`) unless another key's call has that name: the call's
        identity is its idempotency key, built on the whole key's digest (sessions written
        before it was are told apart by request hash, as they were)."""
        short = call_step_name(durable, key)
        long = call_long_name(durable, key)
        if self._call_identity(long) is not None:
            return long
        taken = self._call_identity(short)
        if taken is None or taken in (self._identity(long), self._identity(short)):
            return short
        return long

    def _call_identity(self, name: str) -> str | None:
        """The idempotency key of the session's call `name`, or None when it has none."""
        row = self._row(name)
        return None if row is None else row.idempotency_key

    def _row(self, name: str) -> OpRow | OperationState | None:
        """The session's call `name` as this block knows it: its planner's row while
        entered, else the state it finished with; None when there is no such call."""
        if self.planner is not None:
            return self.planner.find(name, "action")
        if self.finished is None:  # not entered yet: no call is stored
            return None
        for state in self.finished.operations:
            if state.step == name and state.kind == "action":
                return state
        return None

    def _identity(self, name: str) -> str:
        """The idempotency key of call `name` of this session."""
        if self.planner is not None:
            saga = self.planner.saga
            return operation_key(saga.name, saga.version, saga.tenant_id, saga.key, name, "action")
        state = self.finished
        assert state is not None
        return operation_key(state.saga, state.version, state.tenant_id, state.key, name, "action")

    def _stored(self, name: str) -> tuple[OperationStatus, str, int, Any, str | None] | None:
        row = self._row(name)
        if row is None:
            return None
        return row.status, row.request_hash, row.hash_version, row.result, row.error

    def _raised(self, name: str, error: str | None) -> BaseException:
        """The error a failed call raises to the session's code: what the step raised when
        it was a `PermanentError`, else (its attempts used up) a `PermanentError` caused
        by it, so that leaving the block with it compensates, in this entry as in any
        later one that replays the failure."""
        exc = self.definition.raised.pop(name, None)
        if isinstance(exc, PermanentError):
            return exc
        failed = PermanentError(f"call {name!r} failed: {error}")
        failed.__cause__ = exc
        return failed

    def session_id(self) -> str:
        """The session's saga id."""
        if self.planner is not None:
            return self.planner.saga.id
        assert self.finished is not None
        return self.finished.id

    def closing(self, exc: BaseException | None) -> tuple[bool, str | None]:
        """Whether the exit closes the session, and why it fails (None: it completes)."""
        if isinstance(exc, PermanentError):
            return True, f"the session's code raised {type(exc).__name__}: {exc}"
        if exc is not None:
            return False, None
        return True, self.failure


_NOT_STORED: Any = object()

# Longest key shown in an error message (characters).
_SHOWN_KEY = 120


def _unsettled_calls(state: SagaState) -> list[str]:
    return [
        op.step
        for op in state.operations
        if op.kind == "action" and op.status in (OperationStatus.UNKNOWN, OperationStatus.RUNNING)
    ]


def _resolve_hint(session_id: str, calls: Sequence[str]) -> str:
    if not calls:
        return ""
    named = ", ".join(repr(call) for call in calls)
    succeeded, failed = resolve_commands(session_id, calls[0])
    return (
        f"; settle call {named} with `{succeeded}` (what its effect returned) or "
        f"`{failed}`, then enter the session again"
    )


def _parked_message(state: SagaState) -> str:
    """`SessionParked`'s message for a parked session: its reason, and the call to settle."""
    return (
        f"session {state.id} needs a human: {state.error}"
        f"{_resolve_hint(state.id, _unsettled_calls(state))}"
    )


def _not_stored(
    durable: DurableStep[Any, Any], decided: _Decided, parked: SagaState, refused: TypeError
) -> TypeError:
    """The error of a call whose result could not be stored (`refused`): its effect
    happened, so it is recorded as unknown and the session is parked for a human."""
    key = decided.key
    shown = repr(key if len(key) <= _SHOWN_KEY else key[:_SHOWN_KEY] + "...")
    return TypeError(
        f"{durable.where} under key {shown} in session {parked.id}: its effect happened, but "
        f"its result cannot be stored ({refused}). The call is never run again: it is "
        f"recorded with its outcome unknown, and the session is parked for a human"
        f"{_resolve_hint(parked.id, [decided.name])}. Make the step return JSON (or a "
        "pydantic model)."
    )


class _SessionBase:
    """What both doors' sessions share: their run, ledger and counts."""

    # The session's flows, set as the block is entered.
    _flows: SessionFlows

    def __init__(
        self, run_id: str, *, tenant: str = "", name: str = "session", wait_seconds: float = 0.0
    ) -> None:
        _check_run_id(run_id)
        self._run_id = run_id
        self._tenant = tenant
        self._wait = wait_seconds
        self._ledger = _Ledger(SessionSaga(name))
        self._exits: list[Any] = []
        # The heartbeat's hold on the session's lease, while the block has it.
        self._holding: AbstractContextManager[Any] | None = None

    @property
    def id(self) -> str:
        """The session's saga id (its row in `saga list`)."""
        return self._ledger.session_id()

    def operation_name(self, durable: DurableStep[Any, Any], key: str) -> str:
        """The name of the operation a call of `durable` under `key` has in this session,
        or would have if it were called now: `<step>.<48 bits of the key's SHA-256>`, or
        the whole digest when another key's call has that name."""
        return self._ledger.call_name(durable, key)

    @property
    def executed(self) -> int:
        """Calls run in this block."""
        return self._ledger.executed

    @property
    def replayed(self) -> int:
        """Calls answered from the ledger without running."""
        return self._ledger.replayed

    @property
    def reconciled(self) -> int:
        """Calls whose earlier attempt's outcome was unknown (a crash, a timeout) and
        that this block settled by their reconcile hook finding the effect (`Found`):
        not run again, and not counted as executed or replayed."""
        return self._ledger.reconciled

    def fail(self, reason: str) -> None:
        """End the session as failed when its block exits: its succeeded calls are
        compensated in reverse. No call runs after this."""
        self._ledger.failure = reason

    def _flows_of(self, flows: Flows, lease_seconds: float) -> SessionFlows:
        return SessionFlows(
            flows,
            self._ledger.definition,
            run_id=self._run_id,
            tenant=self._tenant,
            lease_seconds=lease_seconds,
        )

    def _opened(self, planner: Planner | None, state: SagaState | None) -> None:
        if planner is None:
            assert state is not None
            if state.status == SagaStatus.NEEDS_REVIEW:
                raise SessionParked(_parked_message(state))
            self._ledger.finished = state
        else:
            self._ledger.planner = planner  # its definition has learned the calls on record

    def _hold(self, holding: AbstractContextManager[Any]) -> None:
        """Keep the session's lease alive (the heartbeat) until the block lets it go."""
        holding.__enter__()
        self._holding = holding

    def _let_go(self) -> None:
        holding, self._holding = self._holding, None
        if holding is not None:
            holding.__exit__(None, None, None)

    def _after(
        self,
        durable: DurableStep[Any, Any],
        decided: _Decided,
        planner: Planner,
        left: SagaState | None,
    ) -> Any:
        """The ledger's answer to a call that ran; the heartbeat stops when the call
        parked the session (its write gave the lease back, reading `left`)."""
        try:
            return self._ledger.after(durable, decided, planner, left)
        finally:
            if self._ledger.planner is None:
                self._let_go()

    def _leaving(self, exc: BaseException | None) -> Flow[SagaState | None] | None:
        """The flow that ends the block for `exc`, or None when nothing is held."""
        planner = self._ledger.planner
        if planner is None:
            return None
        closes, failure = self._ledger.closing(exc)
        return self._flows.leave(planner, closes=closes, failure=failure)

    def _left(self, finished: SagaState | None) -> None:
        if finished is not None:
            self._ledger.planner = None
            self._ledger.finished = finished

    def _unwind(self, exc: BaseException | None) -> None:
        while self._exits:
            self._exits.pop().__exit__(None, None, None)
        self._let_go()
        finished = self._ledger.finished
        if exc is None and finished is not None and finished.status == SagaStatus.NEEDS_REVIEW:
            raise SessionParked(_parked_message(finished))


class Session(_SessionBase):
    """A session of durable steps under one lease: `with orch.session(run_id) as run:`.

    Attributes:
        id: The session's saga id.
        executed: Calls run in this block.
        replayed: Calls answered from the ledger without running.
        reconciled: Calls settled in this block by their reconcile hook finding the
            effect of an earlier attempt whose outcome was unknown.
    """

    def __init__(
        self,
        orch: SessionEngine,
        run_id: str,
        *,
        tenant: str = "",
        name: str = "session",
        wait_seconds: float = 0.0,
    ) -> None:
        super().__init__(run_id, tenant=tenant, name=name, wait_seconds=wait_seconds)
        self._orch = orch
        # Calls of one session run one at a time (threads given its context included).
        self._lock = threading.Lock()

    def history(self) -> list[HistoryEvent]:
        """The session's audit trail: each call's attempts, outcomes and compensations."""
        return self._orch.history(self.id)

    def __enter__(self) -> Session:
        runner = self._orch._runner()
        self._runner: Runner = runner
        self._flows = self._flows_of(runner.flows, self._orch.lease_seconds)
        planner, state = runner.run(self._flows.open(self._wait))
        self._opened(planner, state)
        if planner is not None:
            self._hold(self._orch.lease_keeper.holding(planner.saga.id, planner.saga.fence))
        scope = session_scope(self)
        scope.__enter__()
        self._exits.append(scope)
        return self

    def call(
        self, durable: DurableStep[Any, Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Run `durable` once under its key in this session, or replay its stored result."""
        with self._lock:
            decided = self._ledger.before(durable, args, kwargs)
            if decided.replay is not _NOT_STORED:
                return decided.replay
            planner = self._ledger.planner
            assert planner is not None
            ran, left = self._runner.run(self._flows.call(planner, decided.asked, decided.name))
            return self._after(durable, decided, ran, left)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            leaving = self._leaving(exc)
            if leaving is not None:
                self._left(self._runner.run(leaving))
        finally:
            self._unwind(exc)


def _check_run_id(run_id: object) -> None:
    if not isinstance(run_id, str) or not run_id.strip():
        raise ValueError(f"a session's run id must be a non-empty string, got {run_id!r}")


class AsyncSession(_SessionBase):
    """The asyncio twin of `Session`: `async with aorch.session(run_id) as run:`; each
    durable step call inside is awaited (a sync step's function runs in a thread), and
    the calls of one session run one at a time, whichever task makes them."""

    def __init__(
        self,
        orch: AsyncSessionEngine,
        run_id: str,
        *,
        tenant: str = "",
        name: str = "session",
        wait_seconds: float = 0.0,
    ) -> None:
        super().__init__(run_id, tenant=tenant, name=name, wait_seconds=wait_seconds)
        self._orch = orch
        self._lock = asyncio.Lock()

    async def history(self) -> list[HistoryEvent]:
        """The session's audit trail."""
        history: list[HistoryEvent] = await self._orch.history(self.id)
        return history

    async def __aenter__(self) -> AsyncSession:
        runner = await self._orch.runner()
        self._runner: AsyncRunner = runner
        self._flows = self._flows_of(runner.flows, self._orch.lease_seconds)
        planner, state = await runner.run(self._flows.open(self._wait))
        self._opened(planner, state)
        if planner is not None:
            keeper = await self._orch.lease_keeper()
            self._hold(keeper.holding(planner.saga.id, planner.saga.fence))
        scope = session_scope(self)
        scope.__enter__()
        self._exits.append(scope)
        return self

    async def call(
        self, durable: DurableStep[Any, Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Run `durable` once under its key in this session, or replay its stored result."""
        async with self._lock:
            decided = self._ledger.before(durable, args, kwargs)
            if decided.replay is not _NOT_STORED:
                return decided.replay
            planner = self._ledger.planner
            assert planner is not None
            flow = self._flows.call(planner, decided.asked, decided.name)
            ran, left = await self._runner.run(flow)
            return self._after(durable, decided, ran, left)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            leaving = self._leaving(exc)
            if leaving is not None:
                self._left(await self._runner.run(leaving))
        finally:
            self._unwind(exc)
