"""What both doors share: settings, the registry, and the flows of their verbs.

`Orchestrator` (blocking) and `AsyncOrchestrator` (asyncio) are two drivers of one
`Engine`: the same settings and registry, and the same flows (`saga._flows.drive`) for
starting, driving and changing sagas, carried out with blocking or async I/O.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import time
import uuid
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from saga import approvals, telemetry
from saga._codefirst import code_first_definition
from saga._core import inputs
from saga._core import requests as interventions
from saga._core.live_calls import RunningCall, claimed_refusal, leased_refusal, touched
from saga._core.planner import Event, Next, Planner, SagaRow, new_action_rows
from saga._core.requests import check_actor
from saga._core.rows import OpRow, Write
from saga._db._store_base import parse_id
from saga._db.database import Route, describe_url, prepared_statements_setting, resolve_database_url
from saga._drivers import faults
from saga._drivers.observe import log_events
from saga._flows.claim import Flows
from saga._flows.common import new_token
from saga._flows.drive import RunnerOptions, before_record, retried
from saga._flows.effects import (
    Begin,
    Commit,
    Fetch,
    Flow,
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
from saga.errors import (
    IdempotencyConflict,
    NotRegistered,
    SagaDefinitionError,
    SagaNotFound,
    StepStateError,
)
from saga.keys import check_saga_input, same_request
from saga.keys import request_hash as hash_business_fields
from saga.logs import events_logger, get_logger
from saga.remedies import LEDGER_PREFIX, SESSION_PREFIX
from saga.state import HistoryEvent, SagaHandle, SagaState, SagaStatus
from saga.upgrade import UpgradePlan, UpgradeRefused, plan_upgrade

_log = get_logger("saga")
_events = events_logger()

ENV_CONFIRMATION_KEY = "SAGA_CONFIRMATION_KEY"
ENV_APPROVAL_PUBLIC_KEY = approvals.ENV_APPROVAL_PUBLIC_KEY
# run(wait_seconds=...) claims again this long after the holder's lease should end, and at
# least this often meanwhile (seconds).
LEASE_POLL_SECONDS = 0.05
# Most connections of an orchestrator's pool when `pool_size` is not given and no worker
# has sized it for its concurrency.
DEFAULT_POOL_SIZE = 10
MAX_LEASE_POLL_SECONDS = 0.5


def resolve_arguments(outcome: str, actor: str) -> None:
    """`ValueError` for an outcome of `resolve` other than succeeded or failed, or a blank
    actor, before anything is read or written."""
    if outcome not in ("succeeded", "failed"):
        raise ValueError(f"outcome must be 'succeeded' or 'failed', got {outcome!r}")
    check_actor("resolve", actor)


def list_filters(
    status: str | None, limit: int, older_than: timedelta | None
) -> tuple[str | None, float | None]:
    """The status and age (seconds) `list` filters by, checked: `ValueError` for an
    unknown status, a limit below 1 or a negative age."""
    if status is not None:
        status = SagaStatus(status).value
    if limit < 1:
        raise ValueError(f"limit must be positive, got {limit}")
    if older_than is None:
        return status, None
    seconds = older_than.total_seconds()
    if seconds < 0:
        raise ValueError(f"older_than must not be negative, got {older_than}")
    return status, seconds


def list_key(key: object) -> str | None:
    """The business key `list` filters by, checked: `ValueError` for one not a string."""
    if key is None or isinstance(key, str):
        return key
    raise ValueError(f"key must be a string (a saga's business key), got {key!r}")


class Engine:
    """Settings and registry of an orchestrator, and the flows of its verbs (see
    `Orchestrator` for the arguments)."""

    def __init__(
        self,
        database_url: str | None = None,
        *,
        sagas: Iterable[Saga[Any]] = (),
        lease_seconds: float = 10.0,
        heartbeat_seconds: float | None = None,
        auto_migrate: bool = True,
        owner: str | None = None,
        pool_size: int | None = None,
        confirmation_key: str | bytes | None = None,
        retention_days: float = 30.0,
        approval_public_key: approvals.PublicKeyLike
        | Iterable[approvals.PublicKeyLike]
        | None = None,
        telemetry_keys: bool | None = None,
        prepared_statements: bool | None = None,
    ) -> None:
        if not lease_seconds > 0:
            raise ValueError(f"lease_seconds must be positive, got {lease_seconds!r}")
        if heartbeat_seconds is None:
            heartbeat_seconds = lease_seconds / 3.0
        if not 0 < heartbeat_seconds < lease_seconds:
            raise ValueError(
                f"heartbeat_seconds must be positive and below lease_seconds "
                f"({lease_seconds!r}), got {heartbeat_seconds!r}"
            )
        if pool_size is not None and pool_size < 2:
            raise ValueError(f"pool_size must be at least 2, got {pool_size!r}")
        self._explicit_url = database_url
        self._url: str | None = None
        self.lease_seconds = float(lease_seconds)
        self.heartbeat_seconds = float(heartbeat_seconds)
        self.auto_migrate = auto_migrate
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        # Not given: DEFAULT_POOL_SIZE until a worker sizes the pool for its concurrency.
        self._pool_size = DEFAULT_POOL_SIZE if pool_size is None else pool_size
        self._pool_size_given = pool_size is not None
        self.prepared_statements = prepared_statements_setting(prepared_statements)
        # What the first connection told of the way to the server (None until connected).
        self.route: Route | None = None
        if not retention_days >= 0:
            raise ValueError(f"retention_days must not be negative, got {retention_days!r}")
        self.retention_days = float(retention_days)
        key = confirmation_key or os.environ.get(ENV_CONFIRMATION_KEY)
        self._confirmation_key = key.encode("utf-8") if isinstance(key, str) else key
        self.approval_verifier = _approval_verifier(approval_public_key)
        self.telemetry_keys = telemetry.include_keys(telemetry_keys)
        self._registry: dict[tuple[str, int], Saga[Any]] = {}
        # Sagas started here and not yet run here, as their start wrote them: run() claims
        # one and records its first move in one statement (`saga._flows.started`).
        self._started = StartedSagas()
        for saga in sagas:
            self.register(saga)
        self._unconnected()
        # Crash tests arm a fault point in a child process through SAGA_FAULT.
        faults.arm_from_environment()

    def pool_size_for(self, connections: int, current: int) -> int:
        """The pool's new `max_size` when a worker needs `connections`: exactly that when
        `pool_size` was not given (the pool follows the worker's concurrency), else the
        larger of the given size and the need (and never below `current` there)."""
        if not self._pool_size_given:
            return max(2, connections)
        return max(current, self._pool_size, connections)

    def _unconnected(self) -> None:
        """Set the driver's connection state to "not connected yet" (each door has its own)."""

    # ----- set-up ------------------------------------------------------------------------

    @property
    def database_url(self) -> str:
        """The resolved database URL (starts the embedded server when that is the source)."""
        if self._url is None:
            self._url = resolve_database_url(self._explicit_url)
        return self._url

    def __repr__(self) -> str:
        url = self._url or self._explicit_url
        where = describe_url(url) if url else "database not resolved yet"
        return f"<{type(self).__name__} {where} owner={self.owner!r}>"

    def register(self, saga: Saga[Any]) -> None:
        """Make `saga` runnable by this orchestrator and its workers."""
        if not isinstance(saga, Saga):
            raise SagaDefinitionError(f"register() takes a Saga, got {saga!r}")
        if not saga.steps:
            raise SagaDefinitionError(f"saga {saga.name!r} has no steps")
        ident = (saga.name, saga.version)
        existing = self._registry.get(ident)
        if existing is not None and existing is not saga:
            raise SagaDefinitionError(
                f"another saga named {saga.name!r} version {saga.version} is already registered"
            )
        self._registry[ident] = saga

    def registered(self) -> list[Saga[Any]]:
        """The sagas registered with this orchestrator."""
        return list(self._registry.values())

    def definition(self, name: str, version: int) -> Saga[Any]:
        """The registered saga (name, version), or a session's definition (its calls'
        steps are those of the durable steps registered in this process); `NotRegistered`
        otherwise."""
        saga = self._definition_or_none(name, version)
        if saga is None:
            raise NotRegistered(name, version)
        return saga

    def _definition_or_none(self, name: str, version: int) -> Saga[Any] | None:
        code_first = code_first_definition(name)
        if code_first is not None:
            return code_first
        return self._registry.get((name, version))

    def runner_options(self, *, max_inline_sleep: float = math.inf) -> RunnerOptions:
        """Lease settings of this orchestrator, for runners."""
        return RunnerOptions(
            owner=self.owner,
            lease_seconds=self.lease_seconds,
            heartbeat_seconds=self.heartbeat_seconds,
            max_inline_sleep=max_inline_sleep,
            approval_verifier=self.approval_verifier,
            telemetry_keys=self.telemetry_keys,
        )

    def purge_cutoff_days(self, older_than_days: float | None = None) -> float:
        """How long ago (days) a saga must have ended for `purge` to delete it: the
        retention, or `older_than_days`; `ValueError` when that is shorter."""
        days = self.retention_days if older_than_days is None else older_than_days
        if not days >= self.retention_days:
            raise ValueError(
                f"older_than_days ({days}) is shorter than the retention of "
                f"{self.retention_days} days"
            )
        return days

    def _require_key(self) -> bytes:
        if not self._confirmation_key:
            raise StepStateError(
                "no confirmation key: pass Orchestrator(confirmation_key=...) or set "
                f"{ENV_CONFIRMATION_KEY}; or sign approvals with the approvers' private key "
                "(saga.approvals.ApprovalSigner, `saga confirm --private-key FILE`) and give "
                f"orchestrators the public key ({ENV_APPROVAL_PUBLIC_KEY})"
            )
        return self._confirmation_key

    def _verify_approval(
        self, saga_id: str, step: str, request_hash: str, approval: str
    ) -> approvals.Approval:
        """The approval `confirm` is given, verified: against the approvers' public key
        when this orchestrator has one (an HMAC token is then refused, as its workers
        would refuse it), else against the HMAC confirmation key. `ApprovalRejected` when
        it does not verify; `StepStateError` when there is nothing to verify it with."""
        if self.approval_verifier is not None:
            return self.approval_verifier.verify(
                approval, saga_id=saga_id, step=step, request_hash=request_hash
            )
        if approvals.is_signed(approval):
            raise StepStateError(
                "the approval is signed with an Ed25519 private key, and this orchestrator "
                "has no public key to verify it: pass Orchestrator(approval_public_key=...) "
                f"or set {ENV_APPROVAL_PUBLIC_KEY}"
            )
        return approvals.verify(
            self._require_key(), approval, saga_id=saga_id, step=step, request_hash=request_hash
        )

    def _resolution(
        self,
        state: SagaState,
        step: str,
        *,
        outcome: Literal["succeeded", "failed"],
        result: Any,
        actor: str,
        reason: str | None,
        kind: Literal["action", "compensation"] | None,
    ) -> inputs.Resolve:
        """The request of `resolve` for `state`: `result` validated like the step's (or
        its compensation's) return value; `StepStateError` when the saga has no `step`."""
        definition = self.definition(state.saga, state.version)
        definition.adopt(state.operations)  # a session's calls are its steps
        if definition.is_session:
            # A durable step's name stands for its one unsettled call.
            step = interventions.unsettled_call(state.id, state.operations, step, kind)
        target = definition.step_named(step)
        if target is None:
            raise StepStateError(f"saga {state.saga!r} has no step {step!r}")
        stored = None
        if outcome == "succeeded":
            codec = target.codec
            if kind == "compensation" and target.compensation_op is not None:
                codec = target.compensation_op.codec
            stored = codec.encode(codec.decode(result))
        return inputs.Resolve(step, kind, outcome, stored, actor=actor, reason=reason)

    def _sign_approval(
        self, saga_id: str, step: str, request_hash: str, *, actor: str, ttl_seconds: float
    ) -> str:
        if self.approval_verifier is not None:
            raise StepStateError(
                "this orchestrator requires approvals signed with the approvers' Ed25519 "
                "private key (it has an approval public key), so an HMAC token would be "
                "refused: sign with saga.approvals.ApprovalSigner.from_private_key(...)"
                ".approval(...) or `saga confirm ... --private-key FILE`"
            )
        return approvals.sign(
            self._require_key(),
            saga_id=saga_id,
            step=step,
            request_hash=request_hash,
            actor=actor,
            ttl_seconds=ttl_seconds,
        )

    # ----- flows of the verbs --------------------------------------------------------------

    def _start_flow(
        self, flows: Flows, saga: Saga[Any], data: BaseModel | dict[str, Any], *, claim: bool
    ) -> Flow[tuple[SagaHandle, tuple[Planner, Next] | None]]:
        """Create a saga instance, idempotently on (tenant, saga name, key); with `claim`,
        created leased to us with its first move planned and recorded (`execute`)."""
        if not isinstance(saga, Saga):
            raise TypeError(
                "start() and execute() take the Saga object itself (the one its steps are "
                f"declared on), not {type(saga).__name__} {saga!r}"
            )
        if (saga.name, saga.version) not in self._registry:
            self.register(saga)
        model = saga.validate_input(data)
        tenant, key = saga.identity(model)
        stored = model.model_dump(mode="json")
        check_saga_input(saga.name, model.model_dump(), stored, identity=(tenant, key))
        business = saga.business_fields(model)
        deadline = saga.ceilings.deadline_seconds
        row = SagaRow(
            id=str(uuid.uuid4()),
            name=saga.name,
            version=saga.version,
            tenant_id=tenant,
            key=key,
            input=stored,
            input_hash=hash_business_fields(business),  # = saga.input_hash(model)
            status=SagaStatus.PENDING,
            error=None,
            direction="forward",
            fence=1 if claim else 0,
            run_after=None,
            lease_owner=self.owner if claim else None,
            max_operations=saga.ceilings.max_operations,
            deadline_at=None
            if deadline is None
            else datetime.now().astimezone() + timedelta(seconds=deadline),
            spend_budget=saga.ceilings.spend_budget,
            max_side_effects=saga.ceilings.max_side_effects,
            # Whoever drives the saga continues the trace of the code starting it.
            trace_context=telemetry.capture_context(),
        )
        ops = new_action_rows(saga, tenant, key, business)
        events = [Event("saga_started", detail={"input_hash": row.input_hash})]
        claimed: tuple[Planner, Next] | None = None
        if claim:
            stopping = yield Stopping()
            planner, nxt, write = flows.plan_new(saga, row, ops, may_call=not stopping)
            if write.confirmations:
                # Confirmation rows are not written at start: start plainly, then run.
                return (yield from self._start_flow(flows, saga, model, claim=False))
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
                lease_seconds=self.lease_seconds,
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
                log_events(claimed[0], events[1:])
            elif start_token is not None and row.run_after is not None:
                # As the start wrote it (a start retried after a lost reply has not heard
                # the server's run_after, and is left to the usual claim).
                self._started.add(Started(row, ops, start_token))
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

    def _get_flow(self, saga_id: str) -> Flow[SagaState]:
        if parse_id(saga_id) is None:
            raise SagaNotFound(saga_id)
        state: SagaState | None = yield from db(StoreOps.get_state, str(saga_id))
        if state is None:
            raise SagaNotFound(saga_id)
        return state

    def _run_flow(self, flows: Flows, saga_id: str, wait_seconds: float) -> Flow[SagaState]:
        """Drive a saga here until it is completed, compensated or parked (see `run`)."""
        if not wait_seconds >= 0:
            raise ValueError(f"wait_seconds must not be negative, got {wait_seconds!r}")
        deadline = time.monotonic() + wait_seconds
        parsed = parse_id(saga_id)
        if parsed is None:
            raise SagaNotFound(saga_id)
        # Claim first: a runnable saga nobody holds (`start()` then `run()`, the common
        # case) is claimed with its first move recorded in one transaction, unread
        # before; one this orchestrator has just started, in one statement. A saga the
        # claim cannot take (terminal, parked, awaiting a confirmation, leased, or
        # unknown) is read and handled below.
        started = self._started.take(str(parsed))
        if started is not None:
            driven = yield from flows.claim_started_and_drive(self.definition, started)
            if driven is not None:
                return driven
        driven = yield from flows.claim_and_drive(self.definition, str(parsed))
        if driven is not None:
            return driven
        state = yield from self._get_flow(saga_id)
        definition = self.definition(state.saga, state.version)
        if state.status == SagaStatus.AWAITING_CONFIRMATION:
            # A confirmation that expired unanswered is asked again, with a fresh preview.
            state = yield from self._operator_flow(state.id, inputs.ReopenExpired())
        while state.status.is_runnable:
            driven = yield from flows.claim_and_drive(definition, state.id)
            if driven is not None:
                return driven
            state = yield from self._get_flow(state.id)
            pause = _lease_pause(state, deadline)
            if pause is None:
                break
            yield Pause(pause)
            state = yield from self._get_flow(state.id)
        return state

    def _operator_flow(
        self,
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
        if parse_id(saga_id) is None:
            raise SagaNotFound(saga_id)
        # One token for the change, however often it is tried: a retry after a lost reply
        # that finds it on the saga knows the change landed, and applies nothing again.
        token = new_token()
        tried = [False]

        def once() -> Flow[SagaState]:
            if tried[0]:
                written = yield from db(StoreOps.write_token, saga_id)
                if written is not None and written[0] == token:
                    landed: SagaState | None = yield from db(StoreOps.get_state, saga_id)
                    assert landed is not None
                    return landed
            tried[0] = True
            return (
                yield from self._operator_txn(
                    saga_id, change, force=force, actor=actor, registered=registered, token=token
                )
            )

        return (yield from retried("operator_change", once))

    def _operator_txn(
        self,
        saga_id: str,
        change: inputs.Request,
        *,
        force: bool,
        actor: str | None,
        registered: bool,
        token: str,
    ) -> Flow[SagaState]:
        yield Begin(pipelined=False)
        locked = yield from db_txn(StoreOps.lock_saga_txn, saga_id)
        if locked is None:
            raise SagaNotFound(saga_id)
        row, live = locked
        definition = self._definition_or_none(row.name, row.version)
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
            fences = yield from db_txn(
                StoreOps.break_claims_txn, saga_id, [c.step for c in claimed]
            )
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
        log_events(planner, events)
        assert state is not None  # the row is locked in this transaction
        return state

    def _upgrade_flow(
        self,
        saga_id: str,
        to_version: int,
        *,
        step_map: dict[str, str],
        actor: str,
        write: bool,
    ) -> Flow[tuple[UpgradePlan, SagaState]]:
        """Plan moving a saga to `to_version` (see `saga.upgrade`) under its row lock and,
        when `write` and the plan allows it, make the move in the same transaction: the
        version, the operations, a `saga_upgraded` event, and a new fence (a holder of an
        expired lease can no longer write). A refused plan writes nothing."""
        if parse_id(saga_id) is None:
            raise SagaNotFound(saga_id)
        token = new_token()
        made: list[UpgradePlan] = []

        def once() -> Flow[tuple[UpgradePlan, SagaState]]:
            if made:
                written = yield from db(StoreOps.write_token, saga_id)
                if written is not None and written[0] == token:
                    landed: SagaState | None = yield from db(StoreOps.get_state, saga_id)
                    assert landed is not None
                    return made[0], landed
            return (
                yield from self._upgrade_txn(
                    saga_id, to_version, step_map, actor, write, token, made
                )
            )

        return (yield from retried("upgrade_saga", once))

    def _upgrade_txn(
        self,
        saga_id: str,
        to_version: int,
        step_map: dict[str, str],
        actor: str,
        write: bool,
        token: str,
        made: list[UpgradePlan],
    ) -> Flow[tuple[UpgradePlan, SagaState]]:
        yield Begin(pipelined=False)
        locked = yield from db_txn(StoreOps.lock_saga_txn, saga_id)
        if locked is None:
            raise SagaNotFound(saga_id)
        row, live = locked
        ops: list[OpRow] = yield from db_txn(StoreOps.operations_txn, saga_id)
        upgrade = plan_upgrade(
            row,
            ops,
            to_version=to_version,
            source=self._registry.get((row.name, row.version)),
            target=self._registry.get((row.name, to_version)),
            step_map=step_map,
            live=live,
        )
        plan = upgrade.plan
        if not write or not plan.allowed:
            state = yield from db_txn(StoreOps.get_state_txn, saga_id)
            yield Commit()
            assert state is not None  # the row is locked in this transaction
            return plan, state
        from_version = row.version
        row.fence = yield from db_txn(
            StoreOps.upgrade_saga_txn, saga_id, to_version, upgrade.drop, upgrade.renames
        )
        row.version, row.lease_owner, row.lease_expires_at = to_version, None, None
        event = Event(
            "saga_upgraded",
            detail={
                "actor": actor,
                "from_version": from_version,
                "to_version": to_version,
                # jsonb orders keys by length: `saga show` gives the actor and versions first.
                "renamed_steps": plan.renamed,
                "upgrade_moves": [m.as_dict() for m in plan.moves],
                "fence": row.fence,
            },
        )
        changes = Write(
            saga=row,
            new_ops=upgrade.new_ops,
            changed_ops=(),
            confirmations=(),
            events=(event,),
            release=True,
            notify=row.status.is_runnable,
            return_state=True,
        )
        made.append(plan)
        read = yield from db_txn(StoreOps.save_txn, changes, owner=None, token=token)
        state = yield Fetch(read)
        yield Commit()
        _log.info(
            "saga_upgraded",
            saga_id=saga_id,
            saga=row.name,
            from_version=from_version,
            to_version=to_version,
            actor=actor,
        )
        assert state is not None  # the row is locked in this transaction
        return plan, state

    def _fork_flow(
        self, saga_id: str, from_step: str, *, key: str | None, actor: str | None
    ) -> Flow[SagaHandle]:
        """Fork a parked saga from one of its steps, in one transaction: the new saga
        (pending, workers told) inherits the results of the steps before `from_step`,
        and the source becomes `forked` (see `interventions.fork`). Asking again for the
        fork a saga already has returns it (`created=False`)."""
        if parse_id(saga_id) is None:
            raise SagaNotFound(saga_id)
        fork_id = str(uuid.uuid4())
        # One token for the change, however often it is tried: a retry after a lost reply
        # that finds it on the source knows the fork landed.
        token = new_token()
        tried = [False]

        def once() -> Flow[SagaHandle]:
            if tried[0]:
                written = yield from db(StoreOps.write_token, saga_id)
                if written is not None and written[0] == token:
                    return (yield from self._existing_fork(fork_id, created=True))
            tried[0] = True
            return (yield from self._fork_txn(saga_id, from_step, fork_id, key, actor, token))

        return (yield from retried("fork_saga", once))

    def _existing_fork(self, fork_id: str, *, created: bool) -> Flow[SagaHandle]:
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
        self,
        saga_id: str,
        from_step: str,
        fork_id: str,
        key: str | None,
        actor: str | None,
        token: str,
    ) -> Flow[SagaHandle]:
        yield Begin(pipelined=False)
        locked = yield from db_txn(StoreOps.lock_saga_txn, saga_id)
        if locked is None:
            raise SagaNotFound(saga_id)
        row, live = locked
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
            existing = yield from self._existing_fork(row.forked_to, created=False)
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
        definition = self._definition_or_none(row.name, row.version)
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
            lease_seconds=self.lease_seconds,
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
        yield Commit()
        log_events(planner, write.events)
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


def upgraded(plan: UpgradePlan, state: SagaState) -> SagaState:
    """The state `upgrade` returns: `state` when `plan` was made; `UpgradeRefused`
    otherwise."""
    if not plan.allowed:
        raise UpgradeRefused(plan)
    return state


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


def _approval_verifier(
    configured: approvals.PublicKeyLike | Iterable[approvals.PublicKeyLike] | None,
) -> approvals.ApprovalVerifier | None:
    """The verifier of signed approvals: of `approval_public_key`, else of
    `SAGA_APPROVAL_PUBLIC_KEY`, else None (HMAC approvals). A key that cannot be read is
    a `ValueError` naming where it came from, at construction rather than at the first
    confirmation."""
    if configured is not None:
        try:
            return approvals.ApprovalVerifier.from_public_key(configured)
        except ValueError as exc:
            raise ValueError(f"approval_public_key: {exc}") from None
    text = os.environ.get(ENV_APPROVAL_PUBLIC_KEY)
    if text is None:
        return None
    try:
        return approvals.ApprovalVerifier.from_environment(text)
    except ValueError as exc:
        raise ValueError(f"{ENV_APPROVAL_PUBLIC_KEY}: {exc}") from None


class _AnyInput(BaseModel):
    """Any saga input, unvalidated: for operator changes that run no step code."""

    model_config = ConfigDict(extra="allow")


def _opaque(name: str, version: int) -> Saga[Any]:
    """A stand-in definition of a saga this orchestrator does not register."""
    return Saga(name, version=version, input=_AnyInput, key=lambda _: "")
