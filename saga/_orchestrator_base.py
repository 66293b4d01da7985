# WARNING: generated from saga/_orchestrator_base_async.py by tools/async_to_sync.py:
# edit the source, then run `python tools/async_to_sync.py`. CI fails on any difference.
"""What an orchestrator stands on: its connection to the database, the reading verbs, and
the doors it makes (sessions, the ledger, workers).

`AsyncOrchestratorBase` is the base of `AsyncOrchestrator`, `OrchestratorBase` that of
`Orchestrator`: `saga/_orchestrator_base_async.py` is the source of both, and
`saga/_orchestrator_base.py` is generated from it by `tools/async_to_sync.py`. The verbs
that start, drive and change sagas are the orchestrators' own (`saga.orchestrator_async`).
"""

from __future__ import annotations

import builtins
import threading
from collections.abc import Callable
from datetime import timedelta
from threading import Event
from typing import TYPE_CHECKING, ParamSpec, Self, TypeVar

from saga._db.pool import open_store
from saga._db.store import Store
from saga._drivers.driver import Runner
from saga._drivers.leases import LeaseKeeper
from saga._drivers.loopguard import sync_only
from saga._engine import Engine, list_filters, list_key
from saga._flows import verbs
from saga._flows.effects import Flow
from saga.ledger import Ledger
from saga.session import Session
from saga.state import Confirmation, HistoryEvent, SagaState, SagaStatus, WorkerInfo

_DOOR = "Orchestrator"

if TYPE_CHECKING:
    from saga.worker import Worker

P = ParamSpec("P")
R = TypeVar("R")


def _guarded(method: Callable[P, R]) -> Callable[P, R]:
    """`sync_only`, with `method` named as the orchestrator's (`Orchestrator.get`), not
    this base's: the name a blocking call refused in an event loop gives."""
    method.__qualname__ = f"{_DOOR}.{method.__name__}"
    return sync_only()(method)


class OrchestratorBase(Engine):
    """The connection of an `AsyncOrchestrator`, its reading verbs and the doors it makes
    (see `AsyncOrchestrator`)."""

    def _unconnected(self) -> None:
        self._store: Store | None = None
        self._ledger: Ledger | None = None
        self._keeper: LeaseKeeper | None = None
        self._lock = threading.Lock()

    # ----- set-up ------------------------------------------------------------------------

    @property
    def store(self) -> Store:
        """The storage layer, connected (and migrated) on first use."""
        if self._store is None:
            with self._lock:
                if self._store is None:
                    self._store = self._connect()
        return self._store

    @property
    def lease_keeper(self) -> LeaseKeeper:
        """The heartbeat that keeps this orchestrator's leases alive while steps run."""
        store = self.store
        with self._lock:
            return self._keeper_on(store)

    def _keeper_on(self, store: Store) -> LeaseKeeper:
        """The lease keeper on `store`, made on first use."""
        if self._keeper is None:
            self._keeper = LeaseKeeper(
                store,
                owner=self.owner,
                lease_seconds=self.lease_seconds,
                heartbeat_seconds=self.heartbeat_seconds,
            )
        return self._keeper

    def _connected(self) -> Store:
        """The storage layer (`store`), connected on first use."""
        return self.store

    def _connect(self) -> Store:
        url = self.database_url
        name = f"saga-{self.owner}"
        self.route, store = open_store(
            url,
            name=name,
            max_size=self._pool_size,
            lease_seconds=self.lease_seconds,
            prepared_statements=self.prepared_statements,
            auto_migrate=self.auto_migrate,
        )
        return store

    @_guarded
    def ensure_pool_size(self, connections: int) -> None:
        """Size the connection pool for a worker that needs `connections` (workers call
        this): to exactly that when `pool_size` was not given, else at least that."""
        store = self._connected()
        pool = store.pool
        pool.resize(min_size=pool.min_size, max_size=self.pool_size_for(connections, pool.max_size))

    def runner(
        self,
        *,
        stopping: Event | None = None,
        max_inline_sleep: float | None = None,
        answers: bool = True,
    ) -> Runner:
        """A driver of this orchestrator's flows (for an `AsyncOrchestrator`, on the
        running loop); `answers` False for a driver that drops the state a drive ends
        with (`RunnerOptions.answers`)."""
        options = (
            self.runner_options(answers=answers)
            if max_inline_sleep is None
            else self.runner_options(max_inline_sleep=max_inline_sleep, answers=answers)
        )
        store = self._connected()
        keeper = self.lease_keeper
        return Runner(store, options, keeper=keeper, stopping=stopping)

    def _runner(self) -> Runner:
        """A driver of this orchestrator's flows with the default options."""
        return self.runner()

    def _drive(self, flow: Flow[R]) -> R:
        """Carry `flow` out with a driver of this orchestrator's (`runner`)."""
        runner = self.runner()
        return runner.run(flow)

    def close(self) -> None:
        """Stop the heartbeat and close the connection pool."""
        if self._keeper is not None:
            self._keeper.close()
            self._keeper = None
        if self._store is not None:
            self._store.pool.close()
            self._store = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ----- reading -----------------------------------------------------------------------

    @_guarded
    def get(self, saga_id: str) -> SagaState:
        """The saga and its operations; `SagaNotFound` when there is none."""
        return self._drive(verbs.get(saga_id))

    @_guarded
    def list(
        self,
        status: str | None = None,
        saga: str | None = None,
        tenant: str | None = None,
        limit: int = 100,
        *,
        older_than: timedelta | None = None,
        key: str | None = None,
    ) -> builtins.list[SagaState]:
        """Sagas filtered by status, saga name and tenant, newest first.

        `older_than` keeps sagas whose last change (`updated_at`, by the database
        clock) is at least that long ago: for a parked saga, how long it has waited.
        `key` keeps the sagas of that business key (the `key` a saga was started with,
        matched exactly): one per saga name and tenant, found through an index, so the
        lookup does not read the finished history.
        """
        status, seconds = list_filters(status, limit, older_than)
        store = self._connected()
        return store.list_states(
            status=status,
            name=saga,
            tenant_id=tenant,
            limit=limit,
            older_than_seconds=seconds,
            key=list_key(key),
        )

    @_guarded
    def workers(self) -> builtins.list[WorkerInfo]:
        """Live workers of this database and the saga kinds (name:version) each runs."""
        store = self._connected()
        return store.live_workers()

    @_guarded
    def history(self, saga_id: str) -> builtins.list[HistoryEvent]:
        """The audit trail of a saga, oldest first."""
        self.get(saga_id)
        store = self._connected()
        return store.history(saga_id)

    @_guarded
    def confirmations(self, saga_id: str) -> builtins.list[Confirmation]:
        """Every confirmation a saga asked for, pending and approved, oldest first."""
        self.get(saga_id)
        store = self._connected()
        return store.confirmations(saga_id)

    @_guarded
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
        store = self._connected()
        pending = [c for c in store.confirmations(saga_id) if c.approved_at is None]
        return max(pending, key=lambda c: c.requested_at) if pending else None

    # ----- the doors it makes ------------------------------------------------------------

    def session(
        self, run_id: str, *, tenant: str = "", name: str = "session", wait_seconds: float = 0.0
    ) -> Session:
        """A session of durable steps: `with orch.session("ticket-4821") as run:` (`async
        with`, from an `AsyncOrchestrator`: each durable step call inside is awaited).

        Inside the block, each call of a `@durable_step` function is an operation of the
        session: the first call under a key runs (`running` committed before, the outcome
        after), every later one, here or in any later process, returns the stored result.
        The session is leased while the block runs: another process entering it waits up
        to `wait_seconds`, then raises `SessionBusy`. A `PermanentError` leaving the
        block (or `run.fail(reason)`) compensates the succeeded calls in reverse; any
        other exception leaves the session open for the next entry to resume.
        """
        return Session(self, run_id, tenant=tenant, name=name, wait_seconds=wait_seconds)

    @property
    def ledger(self) -> Ledger:
        """The ledger of calls claimed one by one: `claim`, `heartbeat`, `complete`,
        `fail`, `unknown` (see `saga.Ledger`, and `saga.AsyncLedger` for an
        `AsyncOrchestrator`)."""
        if self._ledger is None:
            self._ledger = Ledger(self)
        return self._ledger

    def worker(
        self,
        concurrency: int = 4,
        *,
        poll_seconds: float = 1.0,
        grace_seconds: float = 10.0,
        short_wait_seconds: float = 1.0,
        listen_url: str | None = None,
    ) -> Worker:
        """A worker that claims and drives this orchestrator's registered sagas: a
        `Worker`, or, from an `AsyncOrchestrator`, an `AsyncWorker` that drives them as
        tasks on the loop that runs it.

        See `Worker` (`AsyncWorker`) for the meaning of each setting.
        """
        from saga.worker import Worker

        return Worker(
            self,
            concurrency=concurrency,
            poll_seconds=poll_seconds,
            grace_seconds=grace_seconds,
            short_wait_seconds=short_wait_seconds,
            listen_url=listen_url,
        )
