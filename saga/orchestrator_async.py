"""The asyncio door: `AsyncOrchestrator`, every verb of `Orchestrator` as a coroutine."""

from __future__ import annotations

import asyncio
import builtins
from datetime import timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

from psycopg_pool import AsyncConnectionPool
from pydantic import BaseModel

from saga._core import inputs
from saga._db.database import check_connection, unavailable
from saga._db.migrate import migrate_database
from saga._db.store_async import AsyncStore
from saga._drivers.driver_async import AsyncRunner
from saga._drivers.leases_async import AsyncLeaseKeeper
from saga._engine import Engine, list_filters, list_key, resolve_arguments, upgraded
from saga.definition import Saga
from saga.ledger import AsyncLedger
from saga.logs import get_logger
from saga.operator import actor_or_os_user, check_actor
from saga.orchestrator import connection_kwargs, transaction_settings
from saga.session import AsyncSession
from saga.state import Confirmation, HistoryEvent, SagaHandle, SagaState, SagaStatus, WorkerInfo
from saga.upgrade import UpgradePlan, check_upgrade_arguments

if TYPE_CHECKING:
    from saga.worker_async import AsyncWorker

_log = get_logger("saga")


class AsyncOrchestrator(Engine):
    """Runs registered sagas against one PostgreSQL database, from asyncio.

    Takes the same arguments as `Orchestrator`, and has every one of its methods as a
    coroutine with the same name, arguments and results; both write the same rows and
    events for the same saga (one protocol, two drivers). Async steps, compensations and
    hooks are awaited on the caller's event loop, so they can share the application's
    clients; sync ones run in a thread and never block the loop. A step's timeout
    cancels an async step. Use it as `async with AsyncOrchestrator(...) as orch:`, or
    `await orch.close()` when done.
    """

    def _unconnected(self) -> None:
        self._connecting: asyncio.Lock | None = None
        self._pool: AsyncConnectionPool[Any] | None = None
        self._store: AsyncStore | None = None
        self._ledger: AsyncLedger | None = None
        self._keeper: AsyncLeaseKeeper | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ----- set-up ------------------------------------------------------------------------

    async def store(self) -> AsyncStore:
        """The storage layer, connected (and migrated) on first use.

        Its connections belong to the event loop that first used it: using the same
        orchestrator from another loop raises `RuntimeError` (make one per loop, or
        `close()` it first)."""
        loop = asyncio.get_running_loop()
        if self._loop is not None and self._loop is not loop and self._store is not None:
            raise RuntimeError(
                "this AsyncOrchestrator is connected on another event loop; its "
                "connections cannot serve this one: create an AsyncOrchestrator per event "
                "loop, or close() it on its own loop first"
            )
        self._loop = loop
        if self._store is None:
            if self._connecting is None:
                self._connecting = asyncio.Lock()
            async with self._connecting:
                if self._store is None:
                    self._store = await self._connect()
        return self._store

    async def _connect(self) -> AsyncStore:
        # Resolving the URL may start the embedded server: blocking work, off the loop.
        url = await asyncio.to_thread(lambda: self.database_url)
        self.route = route = await asyncio.to_thread(check_connection, url)
        if self.auto_migrate:
            await asyncio.to_thread(migrate_database, url)
        pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
            url,
            min_size=1,
            max_size=self._pool_size,
            kwargs=connection_kwargs(url, self.lease_seconds, route, self.prepared_statements),
            open=False,
            name=f"saga-async-{self.owner}",
        )
        try:
            await pool.open(wait=True, timeout=10.0)
        except Exception as exc:
            await pool.close()
            raise unavailable(url, exc) from None
        self._pool = pool
        return AsyncStore(
            pool, transaction_settings=transaction_settings(route, self.lease_seconds)
        )

    async def ensure_pool_size(self, connections: int) -> None:
        """Size the connection pool for a worker that needs `connections` (see
        `Orchestrator.ensure_pool_size`)."""
        store = await self.store()
        await store.pool.resize(
            min_size=store.pool.min_size,
            max_size=self.pool_size_for(connections, store.pool.max_size),
        )

    async def lease_keeper(self) -> AsyncLeaseKeeper:
        """The heartbeat task that keeps this orchestrator's leases alive while steps run."""
        store = await self.store()
        if self._keeper is None:
            self._keeper = AsyncLeaseKeeper(
                store,
                owner=self.owner,
                lease_seconds=self.lease_seconds,
                heartbeat_seconds=self.heartbeat_seconds,
            )
        return self._keeper

    async def runner(
        self, *, stopping: asyncio.Event | None = None, max_inline_sleep: float | None = None
    ) -> AsyncRunner:
        """A driver of this orchestrator's flows on the running loop."""
        options = (
            self.runner_options()
            if max_inline_sleep is None
            else self.runner_options(max_inline_sleep=max_inline_sleep)
        )
        return AsyncRunner(
            await self.store(), options, keeper=await self.lease_keeper(), stopping=stopping
        )

    async def close(self) -> None:
        """Stop the heartbeat and close the connection pool."""
        if self._keeper is not None:
            await self._keeper.aclose()
            self._keeper = None
        if self._pool is not None:
            await self._pool.close()
            self._pool = None
            self._store = None
        self._loop = None
        self._connecting = None

    async def __aenter__(self) -> AsyncOrchestrator:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # ----- starting and driving ----------------------------------------------------------

    async def start(self, saga: Saga[Any], data: BaseModel | dict[str, Any]) -> SagaHandle:
        """Create a saga instance, idempotently on (tenant, saga name, key); see
        `Orchestrator.start`."""
        runner = await self.runner()
        return (await runner.run(self._start_flow(runner.flows, saga, data, claim=False)))[0]

    async def execute(self, saga: Saga[Any], data: BaseModel | dict[str, Any]) -> SagaState:
        """Start a saga and drive it here on this loop: `start` then `run`, one commit
        cheaper; see `Orchestrator.execute`."""
        runner = await self.runner()
        handle, claimed = await runner.run(self._start_flow(runner.flows, saga, data, claim=True))
        if claimed is None:
            return await self.run(handle.id)
        return await runner.drive(*claimed) or await self.get(handle.id)

    async def run(self, saga_id: str, *, wait_seconds: float = 0.0) -> SagaState:
        """Drive a saga here until it is completed, compensated or parked; see
        `Orchestrator.run`."""
        runner = await self.runner()
        return await runner.run(self._run_flow(runner.flows, saga_id, wait_seconds))

    async def _operator_change(
        self,
        saga_id: str,
        change: inputs.Request,
        *,
        force: bool = False,
        actor: str | None = None,
        registered: bool = True,
    ) -> SagaState:
        runner = await self.runner()
        flow = self._operator_flow(saga_id, change, force=force, actor=actor, registered=registered)
        return await runner.run(flow)

    # ----- operator verbs ----------------------------------------------------------------

    async def raise_ceilings(
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
        """Raise a saga's persisted ceilings; see `Orchestrator.raise_ceilings`."""
        check_actor("raise_ceilings", actor)
        return await self._operator_change(
            saga_id,
            inputs.RaiseCeilings(
                actor=actor,
                max_operations=max_operations,
                spend_budget=spend_budget,
                max_side_effects=max_side_effects,
                extend_deadline_seconds=extend_deadline_seconds,
            ),
            force=force,
            actor=actor,
        )

    async def compensate(
        self,
        saga_id: str,
        *,
        include_unknown: bool = False,
        actor: str | None = None,
        force: bool = False,
    ) -> SagaState:
        """Compensation-only recovery, driven here; see `Orchestrator.compensate`."""
        actor = actor_or_os_user("compensate", actor)
        state = await self._operator_change(
            saga_id,
            inputs.RequestCompensation(actor=actor, include_unknown=include_unknown),
            force=force,
            actor=actor,
        )
        return await self.run(state.id)

    async def resolve(
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
        """Settle an operation a human has checked; see `Orchestrator.resolve`."""
        resolve_arguments(outcome, actor)
        state = await self.get(saga_id)
        request = self._resolution(
            state, step, outcome=outcome, result=result, actor=actor, reason=reason, kind=kind
        )
        return await self._operator_change(
            state.id,
            request,
            force=force,
            actor=actor,
        )

    async def retry(
        self,
        saga_id: str,
        *,
        extra_attempts: int = 0,
        actor: str | None = None,
        force: bool = False,
    ) -> SagaState:
        """Resume a parked saga after a fix; see `Orchestrator.retry`."""
        if extra_attempts < 0:
            raise ValueError(f"extra_attempts must not be negative, got {extra_attempts}")
        actor = actor_or_os_user("retry", actor)
        return await self._operator_change(
            saga_id,
            inputs.RequestRetry(extra_attempts=extra_attempts, actor=actor),
            force=force,
            actor=actor,
        )

    def session(
        self, run_id: str, *, tenant: str = "", name: str = "session", wait_seconds: float = 0.0
    ) -> AsyncSession:
        """A session of durable steps: `async with aorch.session(run_id) as run:`; see
        `Orchestrator.session`. Each durable step call inside is awaited."""
        return AsyncSession(self, run_id, tenant=tenant, name=name, wait_seconds=wait_seconds)

    @property
    def ledger(self) -> AsyncLedger:
        """The ledger of calls claimed one by one: `claim`, `heartbeat`, `complete`,
        `fail`, `unknown` (see `saga.AsyncLedger`)."""
        if self._ledger is None:
            self._ledger = AsyncLedger(self)
        return self._ledger

    async def fork(
        self, saga_id: str, from_step: str, *, key: str | None = None, actor: str | None = None
    ) -> SagaHandle:
        """Continue a parked saga (or session) as a new one from `from_step`; see
        `Orchestrator.fork`."""
        actor = actor_or_os_user("fork", actor)
        runner = await self.runner()
        return await runner.run(self._fork_flow(saga_id, from_step, key=key, actor=actor))

    async def upgrade(
        self,
        saga_id: str,
        to_version: int,
        *,
        step_map: dict[str, str] | None = None,
        actor: str,
    ) -> SagaState:
        """Move a saga in flight that no worker holds to `to_version` of its definition,
        in one transaction; `UpgradeRefused` (nothing written) when the operations that
        took effect do not map onto it; see `Orchestrator.upgrade`."""
        step_map = check_upgrade_arguments(to_version, step_map)
        actor = check_actor("upgrade", actor)
        runner = await self.runner()
        flow = self._upgrade_flow(saga_id, to_version, step_map=step_map, actor=actor, write=True)
        plan, state = await runner.run(flow)
        return upgraded(plan, state)

    async def upgrade_plan(
        self, saga_id: str, to_version: int, *, step_map: dict[str, str] | None = None
    ) -> UpgradePlan:
        """What `upgrade` would do with the saga now; nothing is written. See
        `Orchestrator.upgrade_plan`."""
        step_map = check_upgrade_arguments(to_version, step_map)
        runner = await self.runner()
        flow = self._upgrade_flow(saga_id, to_version, step_map=step_map, actor="", write=False)
        plan, _ = await runner.run(flow)
        return plan

    async def cancel(
        self,
        saga_id: str,
        *,
        reason: str,
        actor: str | None = None,
        include_unknown: bool = False,
        force: bool = False,
    ) -> SagaState:
        """Stop a saga's forward progress and compensate; see `Orchestrator.cancel`."""
        if not reason:
            raise ValueError("cancel() needs a reason")
        actor = actor_or_os_user("cancel", actor)
        return await self._operator_change(
            saga_id,
            inputs.RequestCancel(reason=reason, actor=actor, include_unknown=include_unknown),
            force=force,
            actor=actor,
        )

    # ----- confirmations -----------------------------------------------------------------

    async def confirmations(self, saga_id: str) -> builtins.list[Confirmation]:
        """Every confirmation a saga asked for, pending and approved, oldest first."""
        await self.get(saga_id)
        return await (await self.store()).confirmations(saga_id)

    async def preview(self, saga_id: str) -> Confirmation | None:
        """The confirmation a saga waits for, or None; see `Orchestrator.preview`."""
        state = await self.get(saga_id)
        if state.status != SagaStatus.AWAITING_CONFIRMATION:
            return None
        store = await self.store()
        pending = [c for c in await store.confirmations(saga_id) if c.approved_at is None]
        return max(pending, key=lambda c: c.requested_at) if pending else None

    async def approval(
        self,
        saga_id: str,
        step: str,
        request_hash: str,
        *,
        actor: str,
        ttl_seconds: float = 600.0,
    ) -> str:
        """Sign an HMAC approval token for exactly this saga, step and request hash; see
        `Orchestrator.approval`."""
        check_actor("approval", actor)
        return self._sign_approval(
            saga_id, step, request_hash, actor=actor, ttl_seconds=ttl_seconds
        )

    async def confirm(self, saga_id: str, step: str, request_hash: str, approval: str) -> SagaState:
        """Resume a saga waiting for confirmation with a signed approval; see
        `Orchestrator.confirm`."""
        granted = self._verify_approval(saga_id, step, request_hash, approval)
        return await self._operator_change(
            saga_id,
            inputs.Approve(step, request_hash, actor=granted.actor, approval=approval),
            actor=granted.actor,
            registered=False,
        )

    # ----- retention ---------------------------------------------------------------------

    async def purge(self, *, older_than_days: float | None = None, batch_size: int = 1000) -> int:
        """Delete ended sagas older than the retention; see `Orchestrator.purge`."""
        days = self.purge_cutoff_days(older_than_days)
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        store = await self.store()
        total = 0
        while True:
            deleted = await store.purge_finished(
                retention_seconds=days * 86400.0, batch_size=batch_size
            )
            total += deleted
            if deleted < batch_size:
                break
        _log.info("sagas_purged", count=total, older_than_days=days)
        return total

    # ----- reading -----------------------------------------------------------------------

    async def get(self, saga_id: str) -> SagaState:
        """The saga and its operations; `SagaNotFound` when there is none."""
        runner = await self.runner()
        return await runner.run(self._get_flow(saga_id))

    async def list(
        self,
        status: str | None = None,
        saga: str | None = None,
        tenant: str | None = None,
        limit: int = 100,
        *,
        older_than: timedelta | None = None,
        key: str | None = None,
    ) -> builtins.list[SagaState]:
        """Sagas filtered by status, saga name, tenant and business key, newest first;
        see `Orchestrator.list`."""
        status, seconds = list_filters(status, limit, older_than)
        store = await self.store()
        return await store.list_states(
            status=status,
            name=saga,
            tenant_id=tenant,
            limit=limit,
            older_than_seconds=seconds,
            key=list_key(key),
        )

    async def workers(self) -> builtins.list[WorkerInfo]:
        """Live workers of this database and the saga kinds (name:version) each runs."""
        return await (await self.store()).live_workers()

    async def history(self, saga_id: str) -> builtins.list[HistoryEvent]:
        """The audit trail of a saga, oldest first."""
        await self.get(saga_id)
        return await (await self.store()).history(saga_id)

    # ----- workers -----------------------------------------------------------------------

    def worker(
        self,
        concurrency: int = 4,
        *,
        poll_seconds: float = 1.0,
        grace_seconds: float = 10.0,
        short_wait_seconds: float = 1.0,
        listen_url: str | None = None,
    ) -> AsyncWorker:
        """An `AsyncWorker` that claims and drives this orchestrator's registered sagas as
        tasks on the loop that runs it. See `AsyncWorker` for each setting."""
        from saga.worker_async import AsyncWorker

        return AsyncWorker(
            self,
            concurrency=concurrency,
            poll_seconds=poll_seconds,
            grace_seconds=grace_seconds,
            short_wait_seconds=short_wait_seconds,
            listen_url=listen_url,
        )
