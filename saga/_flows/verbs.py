"""The flows of the verbs both orchestrators share: start, run and get a saga, an
operator's change, a fork.

Each is a generator of effects (`saga._flows.effects`), written once and carried out by
either driver. They take the engine that runs them as a `VerbEngine`: its lease settings,
its registry and the sagas it has just started, never the orchestrator itself.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict

from saga._core import inputs
from saga._core import requests as interventions
from saga._core.live_calls import RunningCall, claimed_refusal, leased_refusal, touched
from saga._core.planner import Event, Next, Planner, SagaRow, new_action_rows
from saga._core.rows import OpRow
from saga._flows.claim import Flows
from saga._flows.common import new_token, retried
from saga._flows.drive import before_record
from saga._flows.effects import (
    Begin,
    Commit,
    Fetch,
    Flow,
    Observed,
    Pause,
    Stopping,
    Watch,
    db,
    db_txn,
    watched,
)
from saga._flows.started import Started, StartedSagas
from saga._flows.store_ops import StoreOps
from saga.definition import Saga
from saga.errors import IdempotencyConflict, NotRegistered, SagaNotFound, StepStateError
from saga.keys import canonical_form, check_saga_input, hash_of_form, same_request
from saga.logs import events_logger, get_logger
from saga.remedies import LEDGER_PREFIX, SESSION_PREFIX
from saga.state import HistoryEvent, SagaHandle, SagaState, SagaStatus

_log = get_logger("saga")
_events = events_logger()

T = TypeVar("T")

# run(wait_seconds=...) claims again this long after the holder's lease should end, and at
# least this often meanwhile (seconds).
LEASE_POLL_SECONDS = 0.05
MAX_LEASE_POLL_SECONDS = 0.5


class VerbEngine(Protocol):
    """What the verbs' flows need of the engine that runs them: its lease settings, its
    registry, and the sagas it has just started (`saga._engine.Engine` is one)."""

    @property
    def owner(self) -> str: ...

    @property
    def lease_seconds(self) -> float: ...

    @property
    def _started(self) -> StartedSagas: ...

    def definition(self, name: str, version: int) -> Saga[Any]: ...

    def _definition_or_none(self, name: str, version: int) -> Saga[Any] | None: ...

    def _adopt(self, saga: Saga[Any]) -> None: ...


def check_id(saga_id: str) -> str:
    """`saga_id` as the store spells it; `SagaNotFound` when it is no saga id at all (no
    statement is sent for it)."""
    try:
        return str(uuid.UUID(str(saga_id)))
    except ValueError:
        raise SagaNotFound(saga_id) from None


def locked(saga_id: str) -> Flow[tuple[SagaRow, bool]]:
    """Begin a transaction and lock the saga's row: the row, and whether a live lease holds
    it; `SagaNotFound` when there is no such saga."""
    yield Begin(pipelined=False)
    found = yield from db_txn(StoreOps.lock_saga_txn, saga_id)
    if found is None:
        raise SagaNotFound(saga_id)
    return found


def changed_once(
    name: str,
    saga_id: str,
    attempt: Callable[[str], Flow[T]],
    landed: Callable[[], Flow[T]],
) -> Flow[T]:
    """`attempt(token)`, a change of saga `saga_id` in one transaction that records
    `token` on the saga, retried as `name` while the database is interrupted. One token
    for the change, however often it is tried: a retry after a lost reply that finds it
    on the saga knows the change landed, and returns `landed()` instead of applying it
    again."""
    token = new_token()
    tried = [False]

    def once() -> Flow[T]:
        if tried[0]:
            written = yield from db(StoreOps.write_token, saga_id)
            if written is not None and written[0] == token:
                return (yield from landed())
        tried[0] = True
        return (yield from attempt(token))

    return (yield from retried(name, once))


def start(
    engine: VerbEngine,
    flows: Flows,
    saga: Saga[Any],
    data: BaseModel | dict[str, Any],
    *,
    claim: bool,
    trace_context: dict[str, str] | None,
) -> Flow[tuple[SagaHandle, tuple[Planner, Next] | None]]:
    """Create a saga instance, idempotently on (tenant, saga name, key); with `claim`,
    created leased to us with its first move planned and recorded (`execute`)."""
    if not isinstance(saga, Saga):
        raise TypeError(
            "start() and execute() take the Saga object itself (the one its steps are "
            f"declared on), not {type(saga).__name__} {saga!r}"
        )
    engine._adopt(saga)
    model = saga.validate_input(data)
    tenant, key = saga.identity(model)
    stored = model.model_dump(mode="json")
    check_saga_input(saga.name, model.model_dump(), stored, identity=(tenant, key))
    business = saga.business_fields(model)
    # The canonical form of the business input, made once: the saga's input hash and
    # every step's request hash are computed over it.
    canonical = canonical_form(business)
    deadline = saga.ceilings.deadline_seconds
    row = SagaRow(
        id=str(uuid.uuid4()),
        name=saga.name,
        version=saga.version,
        tenant_id=tenant,
        key=key,
        input=stored,
        input_hash=hash_of_form(canonical),  # = saga.input_hash(model)
        status=SagaStatus.PENDING,
        error=None,
        direction="forward",
        fence=1 if claim else 0,
        run_after=None,
        lease_owner=engine.owner if claim else None,
        max_operations=saga.ceilings.max_operations,
        deadline_at=None
        if deadline is None
        else datetime.now().astimezone() + timedelta(seconds=deadline),
        spend_budget=saga.ceilings.spend_budget,
        max_side_effects=saga.ceilings.max_side_effects,
        # Whoever drives the saga continues the trace of the code starting it.
        trace_context=trace_context,
    )
    ops = new_action_rows(saga, tenant, key, business, canonical=canonical)
    events = [Event("saga_started", detail={"input_hash": row.input_hash})]
    claimed: tuple[Planner, Next] | None = None
    if claim:
        stopping = yield Stopping()
        planner, nxt, write = flows.plan_new(saga, row, ops, may_call=not stopping)
        if write.confirmations:
            # Confirmation rows are not written at start: start plainly, then run.
            return (
                yield from start(
                    engine, flows, saga, model, claim=False, trace_context=trace_context
                )
            )
        if write.release:
            row.lease_owner = None
        events += write.events
        claimed = (planner, nxt)

    # A start whose reply was lost is retried; the retry that finds this very saga
    # (by its new id) knows the first one landed, and goes on as its creator.
    start_token = None if claim else new_token()
    # A start that starts an attempt is its `before_record` fault point.
    watch = None
    if claimed is not None and (point := before_record(claimed[1])) is not None:
        watch = Watch(claimed[0], before=point)
    # When the first try was sent: a start that claims confirms its lease no earlier.
    sent: list[float] = []

    def once() -> Flow[dict[str, Any]]:
        if not sent:
            sent.append(time.monotonic())
        outcome: dict[str, Any] = yield from watched(
            watch,
            StoreOps.start_saga,
            row,
            ops,
            events,
            lease_seconds=engine.lease_seconds,
            notify=not claim,
            token=start_token,
        )
        return outcome

    outcome = yield from retried("start_saga", once)
    created = bool(outcome["created"])
    if created:
        saga_id = row.id
        _events.info("saga_started", saga_id=saga_id, saga=saga.name, tenant_id=tenant, key=key)
        if claimed is not None:
            claimed[0].lease_confirmed_at = sent[0]
            yield Observed((Watch(claimed[0], events=events[1:]),))
        elif start_token is not None and row.run_after is not None:
            # As the start wrote it (a start retried after a lost reply has not heard
            # the server's run_after, and is left to the usual claim).
            engine._started.add(Started(row, ops, start_token))
    else:
        claimed = None
        saga_id = _check_duplicate(saga, row, outcome, business)
        _events.info(
            "saga_start_deduplicated",
            saga_id=saga_id,
            saga=saga.name,
            tenant_id=tenant,
            key=key,
        )
    handle = SagaHandle(
        id=saga_id,
        saga=saga.name,
        version=saga.version,
        tenant_id=tenant,
        key=key,
        created=created,
    )
    return handle, claimed


def get(saga_id: str) -> Flow[SagaState]:
    check_id(saga_id)
    state: SagaState | None = yield from db(StoreOps.get_state, str(saga_id))
    if state is None:
        raise SagaNotFound(saga_id)
    return state


def run(engine: VerbEngine, flows: Flows, saga_id: str, wait_seconds: float) -> Flow[SagaState]:
    """Drive a saga here until it is completed, compensated or parked (see `run`)."""
    if not wait_seconds >= 0:
        raise ValueError(f"wait_seconds must not be negative, got {wait_seconds!r}")
    deadline = time.monotonic() + wait_seconds
    parsed = check_id(saga_id)
    # Claim first: a runnable saga nobody holds (`start()` then `run()`, the common
    # case) is claimed with its first move recorded in one transaction, unread
    # before; one this orchestrator has just started, in one statement. A saga the
    # claim cannot take (terminal, parked, awaiting a confirmation, leased, or
    # unknown) is read and handled below.
    started = engine._started.take(parsed)
    if started is not None:
        driven = yield from flows.claim_started_and_drive(engine.definition, started)
        if driven is not None:
            return driven
    driven = yield from flows.claim_and_drive(engine.definition, parsed)
    if driven is not None:
        return driven
    state = yield from get(saga_id)
    definition = engine.definition(state.saga, state.version)
    if state.status == SagaStatus.AWAITING_CONFIRMATION:
        # A confirmation that expired unanswered is asked again, with a fresh preview.
        state = yield from operator_change(engine, state.id, inputs.ReopenExpired())
    while state.status.is_runnable:
        driven = yield from flows.claim_and_drive(definition, state.id)
        if driven is not None:
            return driven
        state = yield from get(state.id)
        pause = _lease_pause(state, deadline)
        if pause is None:
            break
        yield Pause(pause)
        state = yield from get(state.id)
    return state


def operator_change(
    engine: VerbEngine,
    saga_id: str,
    change: inputs.Request,
    *,
    force: bool = False,
    actor: str | None = None,
    registered: bool = True,
) -> Flow[SagaState]:
    """Apply an operator's change to a saga no live worker holds (or, with `force`,
    take the lease over), in one transaction; returns the saga's new state. A change
    that returns False and records nothing writes nothing.

    `registered=False` allows sagas this orchestrator does not register, for changes
    that run no step code."""
    check_id(saga_id)

    def landed() -> Flow[SagaState]:
        state: SagaState | None = yield from db(StoreOps.get_state, saga_id)
        assert state is not None
        return state

    def attempt(token: str) -> Flow[SagaState]:
        return _change_txn(
            engine, saga_id, change, force=force, actor=actor, registered=registered, token=token
        )

    return (yield from changed_once("operator_change", saga_id, attempt, landed))


def _change_txn(
    engine: VerbEngine,
    saga_id: str,
    change: inputs.Request,
    *,
    force: bool,
    actor: str | None,
    registered: bool,
    token: str,
) -> Flow[SagaState]:
    row, live = yield from locked(saga_id)
    definition = engine._definition_or_none(row.name, row.version)
    if definition is None:
        if registered:
            raise NotRegistered(row.name, row.version)
        definition = _opaque(row.name, row.version)
    broken: list[Event] = []
    running: list[RunningCall] = yield from db_txn(StoreOps.running_calls_txn, saga_id)
    if live and not force:
        raise StepStateError(
            leased_refusal(saga_id, row.lease_owner, row.lease_expires_at, running)
        )
    claimed = touched(change, running)
    if claimed and not force:
        raise StepStateError(claimed_refusal(saga_id, claimed))
    if claimed:
        # Each holder's next write fails its fence check; its call, still running,
        # is treated as unknown by whoever settles it next.
        fences = yield from db_txn(StoreOps.break_claims_txn, saga_id, [c.step for c in claimed])
        broken.extend(
            Event(
                "lease_broken",
                step=c.step,
                kind="action",
                detail={
                    "actor": actor,
                    "previous_owner": c.claim_owner,
                    "fence": fences.get(c.step),
                    "ledger": True,
                },
            )
            for c in claimed
        )
    if live:
        # The holder's next write fails its fence check; its running attempt, if
        # any, is treated as unknown by whoever drives the saga next.
        fence = yield from db_txn(StoreOps.break_lease_txn, saga_id)
        broken.append(
            Event(
                "lease_broken",
                detail={"actor": actor, "previous_owner": row.lease_owner, "fence": fence},
            )
        )
        row.fence, row.lease_owner, row.lease_expires_at = fence, None, None
    if isinstance(change, inputs.Resolve) and change.outcome == "succeeded":
        # Whether the step's result is an operator's, which they may amend.
        resolved: set[str] = yield from db_txn(StoreOps.operator_resolved_steps_txn, saga_id)
        change = dataclasses.replace(change, operator_resolved=frozenset(resolved))
    planner = Planner(
        definition,
        row,
        (yield from db_txn(StoreOps.operations_txn, saga_id)),
        (yield from db_txn(StoreOps.confirmations_txn, saga_id)),
        now=datetime.now().astimezone(),
    )
    planner.events.extend(broken)
    changed = inputs.request(planner, change, planner.now)
    write = planner.write(None, owner=None)  # an operator's change, under the row lock
    events = write.events
    if changed is False and not events:
        # The change found the saga already where it asks for: nothing is
        # written, and the saga is returned as it is.
        state = yield from db_txn(StoreOps.get_state_txn, saga_id)
        yield Commit()
    else:
        read = yield from db_txn(StoreOps.save_txn, write, owner=None, token=token)
        state = yield Fetch(read)
        yield Commit()
    yield Observed((Watch(planner, events=events),))
    assert state is not None  # the row is locked in this transaction
    return state


def fork(
    engine: VerbEngine, saga_id: str, from_step: str, *, key: str | None, actor: str | None
) -> Flow[SagaHandle]:
    """Fork a parked saga from one of its steps, in one transaction: the new saga
    (pending, workers told) inherits the results of the steps before `from_step`,
    and the source becomes `forked` (see `interventions.fork`). Asking again for the
    fork a saga already has returns it (`created=False`)."""
    check_id(saga_id)
    fork_id = str(uuid.uuid4())

    def attempt(token: str) -> Flow[SagaHandle]:
        return _fork_txn(engine, saga_id, from_step, fork_id, key, actor, token)

    return (
        yield from changed_once(
            "fork_saga", saga_id, attempt, lambda: _existing_fork(fork_id, created=True)
        )
    )


def _existing_fork(fork_id: str, *, created: bool) -> Flow[SagaHandle]:
    state: SagaState | None = yield from db(StoreOps.get_state, fork_id)
    if state is None:
        raise StepStateError(
            f"the fork {fork_id} was purged after the retention period; there is nothing "
            "left to fork again"
        )
    return SagaHandle(
        id=state.id,
        saga=state.saga,
        version=state.version,
        tenant_id=state.tenant_id,
        key=state.key,
        created=created,
    )


def _fork_txn(
    engine: VerbEngine,
    saga_id: str,
    from_step: str,
    fork_id: str,
    key: str | None,
    actor: str | None,
    token: str,
) -> Flow[SagaHandle]:
    row, live = yield from locked(saga_id)
    if row.name.startswith(LEDGER_PREFIX):
        raise StepStateError(
            f"saga {saga_id} is a ledger channel: its calls are claimed by their callers, "
            "so there is nothing to fork"
        )
    session = row.name.startswith(SESSION_PREFIX)
    ops: list[OpRow] = yield from db_txn(StoreOps.operations_txn, saga_id)
    if session:
        from_step = _session_fork_point(row, ops, from_step)
    fork_key = key if key is not None else f"{row.key}:fork:{from_step}"
    if row.status == SagaStatus.FORKED and row.forked_to is not None:
        yield Commit()
        existing = yield from _existing_fork(row.forked_to, created=False)
        history: list[HistoryEvent] = yield from db(StoreOps.history, saga_id)
        step = next(
            (e.detail.get("from_step") for e in reversed(history) if e.event == "saga_forked"),
            None,
        )
        if existing.key != fork_key or step != from_step:
            raise StepStateError(
                f"saga {saga_id} was already forked to {existing.id} from step {step!r} "
                f"(key {existing.key!r}); fork that saga instead"
            )
        return existing
    definition = engine._definition_or_none(row.name, row.version)
    if definition is None:
        raise NotRegistered(row.name, row.version)
    if live and session:
        raise StepStateError(
            f"session {saga_id} is held by {row.lease_owner} until {row.lease_expires_at}: "
            "a process is inside its block; wait for the block to end (or, if that process "
            "died, for its lease to expire)"
        )
    if live:
        raise StepStateError(
            f"saga {saga_id} is leased by {row.lease_owner} until {row.lease_expires_at}; "
            "wait for it to stop or for the lease to expire"
        )
    now = datetime.now().astimezone()
    planner = Planner(
        definition, row, ops, (yield from db_txn(StoreOps.confirmations_txn, saga_id)), now=now
    )
    deadline = definition.ceilings.deadline_seconds
    plan = interventions.fork(
        planner,
        from_step,
        fork_id=fork_id,
        key=fork_key,
        actor=actor,
        deadline_at=None if deadline is None else now + timedelta(seconds=deadline),
        now=now,
    )
    outcome = yield from db_txn(
        StoreOps.start_saga_txn,
        plan.saga,
        plan.ops,
        plan.events,
        lease_seconds=engine.lease_seconds,
        notify=not session,  # no worker runs a session: its code does, when it enters
    )
    if not outcome["created"]:
        raise StepStateError(
            f"key {fork_key!r} is taken by saga {outcome['id']} of {row.name!r}: pass "
            "another key for the fork"
        )
    write = planner.write(None, owner=None)  # an operator's change, under the row lock
    yield from db_txn(StoreOps.save_txn, write, owner=None, token=token)
    yield from db_txn(StoreOps.record_fork_txn, saga_id, fork_id)
    yield Commit(Watch(planner, events=write.events))
    _log.info(
        "saga_forked",
        saga_id=saga_id,
        fork_id=fork_id,
        from_step=plan.from_step,
        inherited=list(plan.inherited),
    )
    return SagaHandle(
        id=fork_id,
        saga=row.name,
        version=row.version,
        tenant_id=row.tenant_id,
        key=fork_key,
        created=True,
    )


def _check_duplicate(
    saga: Saga[Any], row: SagaRow, found: dict[str, Any], business: dict[str, Any]
) -> str:
    # An input hashed before an upgrade of the hash matches under its own version.
    if found["version"] != saga.version or not (
        found["input_hash"] == row.input_hash or same_request(found["input_hash"], business)
    ):
        raise IdempotencyConflict(
            f"saga {saga.name!r} with key {row.key!r} (tenant {row.tenant_id!r}) already "
            f"exists as {found['id']} with a different request "
            f"(version {found['version']}, hash {found['input_hash'][:12]}…); "
            "use a new key for a new request",
            saga=saga.name,
            key=row.key,
        )
    return str(found["id"])


def _session_fork_point(row: SagaRow, ops: list[OpRow], from_step: str) -> str:
    """The call of session `row` that `from_step` names (`interventions.session_call`);
    for a session forked already, `from_step` as given when it names no single call (the
    fork it has is then not that one)."""
    try:
        return interventions.session_call(row.id, ops, from_step)
    except StepStateError:
        if row.status == SagaStatus.FORKED:
            return from_step
        raise


def _lease_pause(state: SagaState, deadline: float) -> float | None:
    """How long to sleep before claiming again a saga another owner holds, or None
    when there is no point waiting (not runnable, not held, or out of time)."""
    left = deadline - time.monotonic()
    if not state.status.is_runnable or state.lease_expires_at is None or left <= 0:
        return None
    # The lease's end by this host's clock, re-checked often: clocks differ, and the
    # holder may stop (and release the lease) before it ends.
    until_end = (state.lease_expires_at - datetime.now().astimezone()).total_seconds()
    return min(left, max(until_end, 0.0) + LEASE_POLL_SECONDS, MAX_LEASE_POLL_SECONDS)


class _AnyInput(BaseModel):
    """Any saga input, unvalidated: for operator changes that run no step code."""

    model_config = ConfigDict(extra="allow")


def _opaque(name: str, version: int) -> Saga[Any]:
    """A stand-in definition of a saga this orchestrator does not register."""
    return Saga(name, version=version, input=_AnyInput, key=lambda _: "")
