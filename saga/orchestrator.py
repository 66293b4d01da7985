"""The Orchestrator: start, run, inspect, compensate and resolve sagas on PostgreSQL."""

from __future__ import annotations

import builtins
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import ConnectionPool
from pydantic import BaseModel, ConfigDict

from saga import approvals, faults
from saga.database import check_connection, describe_url, resolve_database_url, unavailable
from saga.dbretry import retrying
from saga.definition import Saga
from saga.errors import (
    IdempotencyConflict,
    NotRegistered,
    SagaDefinitionError,
    SagaNotFound,
    StepStateError,
)
from saga.keys import check_saga_input
from saga.keys import request_hash as hash_business_fields
from saga.leases import LeaseKeeper
from saga.logs import get_logger
from saga.loopguard import sync_only
from saga.migrate import apply_migrations
from saga.operator import actor_or_os_user, check_actor
from saga.protocol import Event, Next, Planner, SagaRow, new_action_rows
from saga.runner import Runner, RunnerOptions, log_events
from saga.state import (
    Confirmation,
    HistoryEvent,
    SagaHandle,
    SagaState,
    SagaStatus,
    WorkerInfo,
)
from saga.store import Store, new_token, parse_id

if TYPE_CHECKING:
    from saga.worker import Worker

_log = get_logger("saga")

ENV_CONFIRMATION_KEY = "SAGA_CONFIRMATION_KEY"
# run(wait_seconds=...) claims again this long after the holder's lease should end, and at
# least this often meanwhile (seconds).
LEASE_POLL_SECONDS = 0.05
MAX_LEASE_POLL_SECONDS = 0.5


class Orchestrator:
    """Runs registered sagas against one PostgreSQL database.

    Its methods block while they wait for the database and run steps (an async step in
    an event loop of its own). From async code, call them in a thread (`await
    asyncio.to_thread(orch.execute, ...)`): called from a running event loop, every
    method that reads, writes or runs steps raises `SyncCallInEventLoop` before doing
    anything.

    Args:
        database_url: PostgreSQL URL; else `SAGA_DATABASE_URL`; else an embedded
            PostgreSQL started in a local data directory.
        sagas: Sagas to register (the registry is per orchestrator).
        lease_seconds: How long a claim on a saga lasts without renewal; a crashed
            owner's sagas are taken over after it expires (default 10 s).
        heartbeat_seconds: How often a running step's lease is renewed (default a
            third of the lease).
        auto_migrate: Apply pending migrations on first use.
        owner: Name of this lease owner in the database (defaults to host:pid:random).
        pool_size: Most database connections this orchestrator holds at once.
        confirmation_key: Key that signs and verifies approval tokens (`confirm`);
            else `SAGA_CONFIRMATION_KEY`.
        retention_days: Ended sagas are kept at least this long; `purge` deletes
            only those older (default 30).
    """

    def __init__(
        self,
        database_url: str | None = None,
        *,
        sagas: Iterable[Saga[Any]] = (),
        lease_seconds: float = 10.0,
        heartbeat_seconds: float | None = None,
        auto_migrate: bool = True,
        owner: str | None = None,
        pool_size: int = 10,
        confirmation_key: str | bytes | None = None,
        retention_days: float = 30.0,
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
        if pool_size < 2:
            raise ValueError(f"pool_size must be at least 2, got {pool_size!r}")
        self._explicit_url = database_url
        self._url: str | None = None
        self.lease_seconds = float(lease_seconds)
        self.heartbeat_seconds = float(heartbeat_seconds)
        self.auto_migrate = auto_migrate
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._pool_size = pool_size
        if not retention_days >= 0:
            raise ValueError(f"retention_days must not be negative, got {retention_days!r}")
        self.retention_days = float(retention_days)
        key = confirmation_key or os.environ.get(ENV_CONFIRMATION_KEY)
        self._confirmation_key = key.encode("utf-8") if isinstance(key, str) else key
        self._registry: dict[tuple[str, int], Saga[Any]] = {}
        self._lock = threading.Lock()
        self._pool: ConnectionPool[Any] | None = None
        self._keeper: LeaseKeeper | None = None
        self._store: Store | None = None
        for saga in sagas:
            self.register(saga)
        # Crash tests arm a fault point in a child process through SAGA_FAULT.
        faults.arm_from_environment()

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
        return f"<Orchestrator {where} owner={self.owner!r}>"

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
        """The registered saga (name, version); `NotRegistered` otherwise."""
        saga = self._registry.get((name, version))
        if saga is None:
            raise NotRegistered(name, version)
        return saga

    @property
    def store(self) -> Store:
        """The storage layer, connected (and migrated) on first use."""
        if self._store is None:
            with self._lock:
                if self._store is None:
                    self._store = self._connect()
        return self._store

    def _connect(self) -> Store:
        url = self.database_url
        check_connection(url)
        if self.auto_migrate:
            try:
                with psycopg.connect(url, autocommit=True) as conn:
                    apply_migrations(conn)
            except psycopg.OperationalError as exc:
                raise unavailable(url, exc) from None
        pool: ConnectionPool[Any] = ConnectionPool(
            url,
            min_size=1,
            max_size=self._pool_size,
            kwargs={"autocommit": True, "options": session_options(url, self.lease_seconds)},
            open=False,
            name=f"saga-{self.owner}",
        )
        try:
            pool.open(wait=True, timeout=10.0)
        except Exception as exc:
            pool.close()
            raise unavailable(url, exc) from None
        self._pool = pool
        return Store(pool)

    @sync_only()
    def ensure_pool_size(self, connections: int) -> None:
        """Grow the connection pool to at least `connections` (workers call this)."""
        self.store.pool.resize(
            min_size=self.store.pool.min_size,
            max_size=max(self.store.pool.max_size, connections),
        )

    def close(self) -> None:
        """Stop the heartbeat and close the connection pool."""
        if self._keeper is not None:
            self._keeper.close()
            self._keeper = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None
            self._store = None

    def __enter__(self) -> Orchestrator:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ----- starting ----------------------------------------------------------------------

    @sync_only()
    def start(self, saga: Saga[Any], data: BaseModel | dict[str, Any]) -> SagaHandle:
        """Create a saga instance, idempotently on (tenant, saga name, key).

        The same call twice returns the same saga. The same key with a different
        request (business fields) raises `IdempotencyConflict` and stores nothing.
        Invalid input raises pydantic's `ValidationError` before anything is written.
        """
        return self._start(saga, data, runner=None)[0]

    @sync_only(runs_steps=True)
    def execute(self, saga: Saga[Any], data: BaseModel | dict[str, Any]) -> SagaState:
        """Start a saga and drive it here: `start` then `run`, one commit cheaper.

        The new saga is created already leased to this orchestrator with its first
        attempt recorded, in one transaction. When the saga already exists (the
        same request again), this is `run` on it.
        """
        runner = self._runner()
        handle, claimed = self._start(saga, data, runner=runner)
        if claimed is None:
            return self.run(handle.id)
        return runner.drive(*claimed) or self.get(handle.id)

    def _start(
        self, saga: Saga[Any], data: BaseModel | dict[str, Any], *, runner: Runner | None
    ) -> tuple[SagaHandle, tuple[Planner, Next] | None]:
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
            fence=0 if runner is None else 1,
            run_after=None,
            lease_owner=None if runner is None else runner.owner,
            max_operations=saga.ceilings.max_operations,
            deadline_at=None
            if deadline is None
            else datetime.now().astimezone() + timedelta(seconds=deadline),
            spend_budget=saga.ceilings.spend_budget,
            max_side_effects=saga.ceilings.max_side_effects,
        )
        ops = new_action_rows(saga, tenant, key, business)
        events = [Event("saga_started", detail={"input_hash": row.input_hash})]
        claimed: tuple[Planner, Next] | None = None
        if runner is not None:
            planner, nxt, released = runner.plan_new(saga, row, ops)
            if any(c.new or c.dirty for c in planner.confirmations):
                # Confirmation rows are not written at start: start plainly, then run.
                return self._start(saga, model, runner=None)
            if released:
                row.lease_owner = None
            events += planner.take_events()
            claimed = (planner, nxt)
        # A start whose reply was lost is retried; the retry that finds this very saga
        # (by its new id) knows the first one landed, and goes on as its creator.
        for attempt in retrying("start_saga"):
            with attempt:
                outcome = self.store.start_saga(
                    row, ops, events, lease_seconds=self.lease_seconds, notify=runner is None
                )
        created = bool(outcome["created"])
        if created:
            saga_id = row.id
            _log.info("saga_started", saga_id=saga_id, saga=saga.name, tenant_id=tenant, key=key)
            if claimed is not None:
                log_events(claimed[0], events[1:])
        else:
            claimed = None
            saga_id = self._check_duplicate(saga, row, outcome)
            _log.info(
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

    def _check_duplicate(self, saga: Saga[Any], row: SagaRow, found: dict[str, Any]) -> str:
        if found["version"] != saga.version or found["input_hash"] != row.input_hash:
            raise IdempotencyConflict(
                f"saga {saga.name!r} with key {row.key!r} (tenant {row.tenant_id!r}) already "
                f"exists as {found['id']} with a different request "
                f"(version {found['version']}, hash {found['input_hash'][:12]}…); "
                "use a new key for a new request",
                saga=saga.name,
                key=row.key,
            )
        return str(found["id"])

    # ----- driving -----------------------------------------------------------------------

    @sync_only(runs_steps=True)
    def run(self, saga_id: str, *, wait_seconds: float = 0.0) -> SagaState:
        """Drive a saga here until it is completed, compensated or parked.

        A terminal saga is returned as is, calling nothing. A saga whose lease another
        live owner holds is waited for up to `wait_seconds` (a dead owner's lease ends
        `lease_seconds` after its last heartbeat): as soon as it can be claimed it is
        driven here; if the lease outlasts the wait, or the holder parks or finishes the
        saga meanwhile, its current state is returned (`lease_owner` and
        `lease_expires_at` say who holds it and until when).
        """
        if not wait_seconds >= 0:
            raise ValueError(f"wait_seconds must not be negative, got {wait_seconds!r}")
        deadline = time.monotonic() + wait_seconds
        state = self.get(saga_id)
        definition = self.definition(state.saga, state.version)
        if state.status == SagaStatus.AWAITING_CONFIRMATION:
            # A confirmation that expired unanswered is asked again, with a fresh preview.
            state = self._operator_change(state.id, Planner.reopen_expired_confirmation)
        while state.status.is_runnable:
            driven = self._runner().claim_and_drive(definition, state.id)
            if driven is not None:
                return driven
            state = self.get(state.id)
            pause = self._lease_pause(state, deadline)
            if pause is None:
                break
            time.sleep(pause)
            state = self.get(state.id)
        return state

    @staticmethod
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

    @sync_only()
    def raise_ceilings(
        self,
        saga_id: str,
        *,
        actor: str,
        max_operations: int | None = None,
        spend_budget: float | None = None,
        max_side_effects: int | None = None,
        extend_deadline_seconds: float | None = None,
        force: bool = False,
    ) -> SagaState:
        """Raise a saga's persisted ceilings (lowering is refused) and, if it was parked,
        make it runnable again; recorded as `ceilings_raised` with the before and after.
        The saga is not driven here: call `run` or leave it to a worker.

        A ceiling the saga does not have is unlimited, the highest there is: setting
        one (even `max_operations=1`) would lower it, and is refused (`StepStateError`)
        like any lowering, writing nothing. `actor` is who makes the change, recorded in
        the audit trail; an empty or blank one is refused (`ValueError`).
        """
        check_actor("raise_ceilings", actor)
        return self._operator_change(
            saga_id,
            lambda p: p.raise_ceilings(
                actor=actor,
                max_operations=max_operations,
                spend_budget=spend_budget,
                max_side_effects=max_side_effects,
                extend_deadline_seconds=extend_deadline_seconds,
            ),
            force=force,
            actor=actor,
        )

    # ----- confirmations -----------------------------------------------------------------

    @sync_only()
    def confirmations(self, saga_id: str) -> builtins.list[Confirmation]:
        """Every confirmation a saga asked for, pending and approved, oldest first."""
        self.get(saga_id)
        return self.store.confirmations(saga_id)

    @sync_only()
    def preview(self, saga_id: str) -> Confirmation | None:
        """The confirmation a saga waits for, or None when it waits for none.

        Its `preview` shows exactly what the attempt will read: `payload` (the prepared
        request, else the whole saga input, volatile fields included), `input` (the whole
        saga input, beside a prepared request), `results` (of the steps before), and the
        `target`, `attempt`, `amount` and `policy_checks`. `request_hash`, the hash of
        all of it, is what an approval is bound to (`approval`, `confirm`)."""
        state = self.get(saga_id)
        if state.status != SagaStatus.AWAITING_CONFIRMATION:
            return None
        pending = [c for c in self.store.confirmations(saga_id) if c.approved_at is None]
        return max(pending, key=lambda c: c.requested_at) if pending else None

    def approval(
        self,
        saga_id: str,
        step: str,
        request_hash: str,
        *,
        actor: str,
        ttl_seconds: float = 600.0,
    ) -> str:
        """Sign an approval token for exactly this saga, step and request hash (the
        `request_hash` of the preview approved, see `preview`).

        Whoever holds the confirmation key can approve: give it to the approvers'
        tooling, not to the processes that run step code. `actor` is who approves,
        recorded when the approval is used; an empty or blank one is refused
        (`ValueError`).
        """
        check_actor("approval", actor)
        return approvals.sign(
            self._require_key(),
            saga_id=saga_id,
            step=step,
            request_hash=request_hash,
            actor=actor,
            ttl_seconds=ttl_seconds,
        )

    @sync_only()
    def confirm(self, saga_id: str, step: str, request_hash: str, approval: str) -> SagaState:
        """Resume a saga waiting in `awaiting_confirmation` with a signed approval.

        The approval must be signed with this orchestrator's key and bound to this
        saga, step and the exact pending request hash, and neither the token nor the
        confirmation may have expired. One approval releases one attempt: the attempt
        it releases uses it up when it starts, and any retry of the step (after a
        failure, an unknown outcome, a reconcile's Absent, an operator's retry) asks
        for a new confirmation. On resume the step's request is prepared again; if
        anything previewed changed, or the confirmation expired before the attempt
        could start, a new confirmation is asked for instead. The saga is not driven
        here: call `run` or leave it to a worker.
        """
        granted = approvals.verify(
            self._require_key(), approval, saga_id=saga_id, step=step, request_hash=request_hash
        )
        # Approving runs no step code, so the approvers' tooling need not register the saga.
        return self._operator_change(
            saga_id,
            lambda p: p.approve_confirmation(step, request_hash, actor=granted.actor),
            actor=granted.actor,
            registered=False,
        )

    def _require_key(self) -> bytes:
        if not self._confirmation_key:
            raise StepStateError(
                "no confirmation key: pass Orchestrator(confirmation_key=...) or set "
                f"{ENV_CONFIRMATION_KEY}"
            )
        return self._confirmation_key

    # ----- retention ---------------------------------------------------------------------

    @sync_only()
    def purge(self, *, older_than_days: float | None = None, batch_size: int = 1000) -> int:
        """Delete completed and compensated sagas that ended longer ago than the retention
        (or `older_than_days`, which may only be longer), in batches; returns how many.

        Sagas that are pending, running, compensating, parked or awaiting confirmation
        are never deleted, and neither are their operations.
        """
        days = self.purge_cutoff_days(older_than_days)
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        total = 0
        while True:
            deleted = self.store.purge_finished(
                retention_seconds=days * 86400.0, batch_size=batch_size
            )
            total += deleted
            if deleted < batch_size:
                break
        _log.info("sagas_purged", count=total, older_than_days=days)
        return total

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

    @sync_only(runs_steps=True)
    def compensate(
        self,
        saga_id: str,
        *,
        include_unknown: bool = False,
        actor: str | None = None,
        force: bool = False,
    ) -> SagaState:
        """Compensation-only recovery: undo what succeeded, in reverse, running no further step.

        A step whose outcome is still unknown stops the compensation there (the saga
        stays in needs_review saying so) unless `include_unknown=True`, in which case
        its compensation runs with `result=None`. A saga a live worker holds is refused
        (`StepStateError`) unless `force=True`, which takes its lease over.

        `actor` is who asks, recorded in the audit trail; None records the OS user
        running the call, and an empty or blank one is refused (`ValueError`).
        """
        actor = actor_or_os_user("compensate", actor)
        state = self._operator_change(
            saga_id,
            lambda p: p.request_compensation(include_unknown=include_unknown, actor=actor),
            force=force,
            actor=actor,
        )
        return self.run(state.id)

    @sync_only()
    def resolve(
        self,
        saga_id: str,
        step: str,
        *,
        outcome: Literal["succeeded", "failed"],
        result: Any = None,
        actor: str,
        reason: str | None = None,
        kind: Literal["action", "compensation"] | None = None,
        force: bool = False,
    ) -> SagaState:
        """Settle an operation a human has checked, and make the saga runnable again.

        `outcome="succeeded"` records `result` (validated like a step's return value);
        `outcome="failed"` records the failure, so the next run compensates. The saga
        is not driven here: call `run` or leave it to a worker. `force=True` takes over
        the lease of a live worker instead of refusing. `actor` is who checked and
        settled the step, recorded in the audit trail; an empty or blank one is refused
        (`ValueError`).
        """
        if outcome not in ("succeeded", "failed"):
            raise ValueError(f"outcome must be 'succeeded' or 'failed', got {outcome!r}")
        check_actor("resolve", actor)
        state = self.get(saga_id)
        definition = self.definition(state.saga, state.version)
        target = definition.step_named(step)
        if target is None:
            raise StepStateError(f"saga {state.saga!r} has no step {step!r}")
        stored = None
        if outcome == "succeeded":
            codec = target.codec
            if kind == "compensation" and target.compensation_op is not None:
                codec = target.compensation_op.codec
            stored = codec.encode(codec.decode(result))
        return self._operator_change(
            state.id,
            lambda p: p.resolve(
                step, kind=kind, outcome=outcome, result=stored, actor=actor, reason=reason
            ),
            force=force,
            actor=actor,
        )

    @sync_only()
    def retry(
        self,
        saga_id: str,
        *,
        extra_attempts: int = 0,
        actor: str | None = None,
        force: bool = False,
    ) -> SagaState:
        """Resume a parked saga after a fix, at the operation it stopped at.

        That operation's ceiling is raised by `extra_attempts`; the attempts it has
        made still count, so a retry past the ceiling needs extra attempts. An
        unknown outcome is settled again (reconcile hook or idempotent retry); one
        that is neither idempotent nor reconcilable is refused: resolve it instead.
        The request is recorded as `retry_requested` with `actor`, who asks (None: the
        OS user running the call; an empty or blank one is refused, `ValueError`). The
        saga is not driven here: call `run` or leave it to a worker.
        """
        if extra_attempts < 0:
            raise ValueError(f"extra_attempts must not be negative, got {extra_attempts}")
        actor = actor_or_os_user("retry", actor)
        return self._operator_change(
            saga_id,
            lambda p: p.request_retry(extra_attempts=extra_attempts, actor=actor),
            force=force,
            actor=actor,
        )

    @sync_only()
    def cancel(
        self,
        saga_id: str,
        *,
        reason: str,
        actor: str | None = None,
        include_unknown: bool = False,
        force: bool = False,
    ) -> SagaState:
        """Stop a saga's forward progress and compensate what succeeded, in reverse.

        Recorded as `cancel_requested` with the reason and actor, which also becomes
        the saga's `error`. A completed saga, or one past a succeeded pivot step, is
        refused (`StepStateError`); one already compensating is returned unchanged.
        The saga is not driven here: call `run` or leave it to a worker. `actor` is
        who asks (None: the OS user running the call; an empty or blank one is
        refused, `ValueError`).
        """
        if not reason:
            raise ValueError("cancel() needs a reason")
        actor = actor_or_os_user("cancel", actor)
        return self._operator_change(
            saga_id,
            lambda p: p.request_cancel(reason=reason, actor=actor, include_unknown=include_unknown),
            force=force,
            actor=actor,
        )

    def _operator_change(
        self,
        saga_id: str,
        change: Callable[[Planner], object],
        *,
        force: bool = False,
        actor: str | None = None,
        registered: bool = True,
    ) -> SagaState:
        """Apply an operator's change to a saga no live worker holds (or, with `force`,
        take the lease over), in one transaction; returns the saga's new state. A change
        that returns False and records nothing writes nothing.

        `registered=False` allows sagas this orchestrator does not register, for changes
        that run no step code."""
        if parse_id(saga_id) is None:
            raise SagaNotFound(saga_id)
        store = self.store
        # One token for the change, however often it is tried: a retry after a lost reply
        # that finds it on the saga knows the change landed, and applies nothing again.
        token = new_token()
        retried = False
        for attempt in retrying("operator_change"):
            with attempt:
                if retried:
                    written = store.write_token(saga_id)
                    if written is not None and written[0] == token:
                        landed = store.get_state(saga_id)
                        assert landed is not None
                        return landed
                retried = True
                return self._operator_txn(
                    saga_id, change, force=force, actor=actor, registered=registered, token=token
                )
        raise AssertionError("unreachable: retrying() reraises")  # pragma: no cover

    def _operator_txn(
        self,
        saga_id: str,
        change: Callable[[Planner], object],
        *,
        force: bool,
        actor: str | None,
        registered: bool,
        token: str,
    ) -> SagaState:
        store = self.store
        with store.transaction() as conn:
            locked = store.lock_saga_txn(conn, saga_id)
            if locked is None:
                raise SagaNotFound(saga_id)
            row, live = locked
            definition = self._registry.get((row.name, row.version))
            if definition is None:
                if registered:
                    raise NotRegistered(row.name, row.version)
                definition = _opaque(row.name, row.version)
            broken: list[Event] = []
            if live and not force:
                raise StepStateError(
                    f"saga {saga_id} is leased by {row.lease_owner} until {row.lease_expires_at}; "
                    "wait for it to stop or for the lease to expire, or force it"
                )
            if live:
                # The holder's next write fails its fence check; its running attempt, if
                # any, is treated as unknown by whoever drives the saga next.
                fence = store.break_lease_txn(conn, saga_id)
                broken.append(
                    Event(
                        "lease_broken",
                        detail={"actor": actor, "previous_owner": row.lease_owner, "fence": fence},
                    )
                )
                row.fence, row.lease_owner, row.lease_expires_at = fence, None, None
            planner = Planner(
                definition,
                row,
                store.operations_txn(conn, saga_id),
                store.confirmations_txn(conn, saga_id),
            )
            planner.events.extend(broken)
            changed = change(planner)
            events = planner.take_events()
            if changed is False and not events:
                # The change found the saga already where it asks for: nothing is
                # written, and the saga is returned as it is.
                state = store.get_state_txn(conn, saga_id)
            else:
                state = store.save_txn(
                    conn,
                    planner.saga,
                    planner.ops,
                    events,
                    owner=None,  # an operator's change, made under the row lock
                    release=True,
                    notify=planner.saga.status.is_runnable,
                    return_state=True,
                    confirmations=planner.confirmations,
                    token=token,
                )()
        log_events(planner, events)
        assert state is not None  # the row is locked in this transaction
        return state

    def runner_options(self, *, max_inline_sleep: float = math.inf) -> RunnerOptions:
        """Lease settings of this orchestrator, for runners."""
        return RunnerOptions(
            owner=self.owner,
            lease_seconds=self.lease_seconds,
            heartbeat_seconds=self.heartbeat_seconds,
            max_inline_sleep=max_inline_sleep,
        )

    def _runner(self) -> Runner:
        return Runner(self.store, self.runner_options(), keeper=self.lease_keeper)

    @property
    def lease_keeper(self) -> LeaseKeeper:
        """The heartbeat that keeps this orchestrator's leases alive while steps run."""
        store = self.store
        with self._lock:
            if self._keeper is None:
                self._keeper = LeaseKeeper(
                    store,
                    owner=self.owner,
                    lease_seconds=self.lease_seconds,
                    heartbeat_seconds=self.heartbeat_seconds,
                )
            return self._keeper

    # ----- reading -----------------------------------------------------------------------

    @sync_only()
    def get(self, saga_id: str) -> SagaState:
        """The saga and its operations; `SagaNotFound` when there is none."""
        if parse_id(saga_id) is None:
            raise SagaNotFound(saga_id)
        state = self.store.get_state(str(saga_id))
        if state is None:
            raise SagaNotFound(saga_id)
        return state

    @sync_only()
    def list(
        self,
        status: str | None = None,
        saga: str | None = None,
        tenant: str | None = None,
        limit: int = 100,
        *,
        older_than: timedelta | None = None,
    ) -> builtins.list[SagaState]:
        """Sagas filtered by status, saga name and tenant, newest first.

        `older_than` keeps sagas whose last change (`updated_at`, by the database
        clock) is at least that long ago: for a parked saga, how long it has waited.
        """
        if status is not None:
            status = SagaStatus(status).value
        if limit < 1:
            raise ValueError(f"limit must be positive, got {limit}")
        seconds = None
        if older_than is not None:
            seconds = older_than.total_seconds()
            if seconds < 0:
                raise ValueError(f"older_than must not be negative, got {older_than}")
        return self.store.list_states(
            status=status, name=saga, tenant_id=tenant, limit=limit, older_than_seconds=seconds
        )

    @sync_only()
    def workers(self) -> builtins.list[WorkerInfo]:
        """Live workers of this database and the saga kinds (name:version) each runs."""
        return self.store.live_workers()

    @sync_only()
    def history(self, saga_id: str) -> builtins.list[HistoryEvent]:
        """The audit trail of a saga, oldest first."""
        self.get(saga_id)
        return self.store.history(saga_id)

    # ----- workers -----------------------------------------------------------------------

    def worker(
        self,
        concurrency: int = 4,
        *,
        poll_seconds: float = 1.0,
        grace_seconds: float = 10.0,
        short_wait_seconds: float = 1.0,
    ) -> Worker:
        """A worker that claims and drives this orchestrator's registered sagas.

        See `Worker` for the meaning of each setting.
        """
        from saga.worker import Worker

        return Worker(
            self,
            concurrency=concurrency,
            poll_seconds=poll_seconds,
            grace_seconds=grace_seconds,
            short_wait_seconds=short_wait_seconds,
        )


def session_options(url: str, lease_seconds: float) -> str:
    """Server settings of the orchestrator's connections (libpq `options`, added to any the
    URL or PGOPTIONS give): no transaction of ours holds its locks, or waits for another's,
    longer than a lease.

    A claim plans the saga's first move (cost functions, confirm rules, input models: user
    code) while the saga row is locked; a holder frozen there (SIGSTOP, a GC pause, a slow
    cost function) would block `run()` and every operator verb on that saga for as long as
    it is frozen. With `idle_in_transaction_session_timeout` the server ends such a
    transaction once it has waited a lease for its client, and rolls it back (its lease
    would have expired by then anyway); with `lock_timeout` a wait for a row lock ends
    after a lease too, retried by a claim or a write and reported as busy by an operator
    verb. Set per session, as a startup parameter, they cost no statement and no commit.
    """
    existing = conninfo_to_dict(url).get("options") or os.environ.get("PGOPTIONS", "")
    milliseconds = max(1, math.ceil(lease_seconds * 1000.0))
    ours = (
        f"-c idle_in_transaction_session_timeout={milliseconds} -c lock_timeout={milliseconds}"
    )
    return f"{existing} {ours}".strip()


class _AnyInput(BaseModel):
    """Any saga input, unvalidated: for operator changes that run no step code."""

    model_config = ConfigDict(extra="allow")


def _opaque(name: str, version: int) -> Saga[Any]:
    """A stand-in definition of a saga this orchestrator does not register."""
    return Saga(name, version=version, input=_AnyInput, key=lambda _: "")
