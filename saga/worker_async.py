"""An asyncio worker: claims runnable sagas and drives each as a task on one event loop."""

from __future__ import annotations

import asyncio
import contextlib
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any, Protocol

import psycopg
from psycopg import sql

from saga import telemetry
from saga._core.planner import Next, Planner
from saga._db._store_base import DatabaseGauges
from saga._db.database import behind_pooler_async
from saga._db.dbretry import is_transient
from saga._db.store_async import AsyncStore
from saga._drivers.driver_async import AsyncRunner
from saga._flows.drive import describe_error
from saga.definition import Saga
from saga.logs import get_logger
from saga.redact import scrub
from saga.worker import (
    CHANNEL,
    MAX_CLAIM_BATCH,
    START_RETRY_SECONDS,
    check_settings,
    listen_target,
    log_loop_error,
    log_unreachable,
    loop_backoff,
    orchestrator_route,
    unreachable,
    warn_polling,
)

_log = get_logger("saga.worker")


class AsyncWorkerEngine(Protocol):
    """What an `AsyncWorker` needs of its orchestrator: the registry, the settings, the
    store and a driver (an `AsyncOrchestrator` is one)."""

    @property
    def owner(self) -> str: ...

    @property
    def database_url(self) -> str: ...

    def registered(self) -> list[Saga[Any]]: ...

    def definition(self, name: str, version: int) -> Saga[Any]: ...

    async def store(self) -> AsyncStore: ...

    async def ensure_pool_size(self, connections: int) -> None: ...

    async def runner(
        self, *, stopping: asyncio.Event | None = None, max_inline_sleep: float | None = None
    ) -> AsyncRunner: ...


# Longest wait (seconds) between two attempts to LISTEN again after the listener failed.
_LISTEN_RETRY_MAX_SECONDS = 5.0


class AsyncWorker:
    """Drives up to `concurrency` sagas at once, as tasks on the loop that awaits `run`.

    The same claim rules, leases, wake-ups and graceful stop as `Worker`: it claims only
    sagas whose (name, version) its orchestrator registers, wakes on `LISTEN/NOTIFY`
    (through `AsyncConnection.notifies`), when the earliest backoff or expired lease
    comes due, and otherwise every `poll_seconds`. Async steps are awaited on the loop;
    sync steps run in threads.

    Args:
        orchestrator: Whose registry, database and lease settings to use.
        concurrency: Most sagas driven at once (one task each).
        poll_seconds: Longest wait between two looks for claimable sagas.
        grace_seconds: On stop, how long in-flight attempts may take to finish; leases
            still held after it are released and their tasks cancelled.
        short_wait_seconds: Retry backoffs up to this long are waited out under the
            lease; longer ones are persisted as `run_after` and the lease released.
        listen_url: A direct URL of the same database for `LISTEN`, as `Worker` takes
            it (else `SAGA_LISTEN_URL`, else the orchestrator's URL; polling, with one
            warning, where a pooler answers).
    """

    def __init__(
        self,
        orchestrator: AsyncWorkerEngine,
        *,
        concurrency: int = 4,
        poll_seconds: float = 1.0,
        grace_seconds: float = 10.0,
        short_wait_seconds: float = 1.0,
        listen_url: str | None = None,
    ) -> None:
        check_settings(concurrency, poll_seconds, grace_seconds, short_wait_seconds)
        self.orchestrator = orchestrator
        self.concurrency = concurrency
        self.poll_seconds = poll_seconds
        self.grace_seconds = grace_seconds
        self.short_wait_seconds = short_wait_seconds
        self.listen_url = listen_url
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._wake: asyncio.Event | None = None
        self._stop_requested = False
        # By (saga id, fence), as the sync worker keeps them.
        self._in_flight: dict[tuple[str, int], tuple[asyncio.Task[None], Planner]] = {}

    def stop(self) -> None:
        """Stop claiming; in-flight sagas finish their current attempt and are handed back.
        Safe to call from any task, any thread, or a signal handler."""
        self._stop_requested = True
        loop = self._loop
        if loop is None:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._set_stopping()
        else:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._set_stopping)

    def _set_stopping(self) -> None:
        if self._stopping is not None and self._wake is not None:
            self._stopping.set()
            self._wake.set()

    @property
    def in_flight(self) -> int:
        """How many sagas this worker is driving now."""
        return len(self._in_flight)

    async def run(self, until_idle: bool = False, *, handle_signals: bool | None = None) -> None:
        """Claim and drive sagas until `stop()`, or, with `until_idle`, until none is open.

        Open means pending, running or compensating: with `until_idle=True` the worker
        waits out retry backoffs and expired leases before returning. With
        `handle_signals` (default: when the loop runs in the main thread), SIGTERM and
        SIGINT stop the worker gracefully.
        """
        orch = self.orchestrator
        kinds = [f"{s.name}:{s.version}" for s in orch.registered()]
        if not kinds:
            raise ValueError("the orchestrator has no registered saga; register one first")
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        self._wake = asyncio.Event()
        if self._stop_requested:
            self._stopping.set()
        if handle_signals is None:
            handle_signals = _in_main_thread()
        with self._signals(handle_signals):
            if await self._reach_database():
                await self._run(kinds, until_idle)
        _log.info("worker_stopped", owner=orch.owner)

    async def _reach_database(self) -> bool:
        """Connect (and migrate), and check the role may drive sagas; False when stopped
        first. A database it cannot reach yet is waited for, with backoff, logged; a
        refusal, a malformed URL or a role that may not drive sagas is raised (as
        `Worker` does)."""
        assert self._stopping is not None
        orch = self.orchestrator
        delay, most = START_RETRY_SECONDS
        attempt = 0
        while not self._stopping.is_set():
            attempt += 1
            try:
                await (await orch.store()).check_privileges("worker")
                return True
            except Exception as exc:
                if not unreachable(exc, orch.database_url):
                    raise
                log_unreachable(exc, attempt=attempt, retry_in=delay)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), delay)
            delay = min(2 * delay, most)
        return False

    async def _run(self, kinds: list[str], until_idle: bool) -> None:
        assert self._loop is not None and self._stopping is not None
        orch = self.orchestrator
        # Each saga in flight may hold a connection for its transaction; one for the
        # heartbeat and one for the claim loop.
        await orch.ensure_pool_size(self.concurrency + 2)
        runner = await orch.runner(
            stopping=self._stopping, max_inline_sleep=self.short_wait_seconds
        )
        _log.info("worker_started", owner=orch.owner, concurrency=self.concurrency, kinds=kinds)
        url, source = listen_target(self.listen_url, orch.database_url, orchestrator_route(orch))
        if url is None:
            warn_polling(orch.database_url, source, self.poll_seconds)
        listener = asyncio.create_task(self._listen(url, source), name="saga-listener")
        # While it runs, the metrics' gauges read the database this worker drives.
        unwatch = telemetry.watch_database(
            orch.database_url,
            _gauges_reader(await orch.store(), self._loop),
            [s.name for s in orch.registered()],
        )
        try:
            await self._claim_loop(runner, kinds, until_idle)
        finally:
            unwatch()
            self._stopping.set()
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await listener
            await self._drain(runner)
            with contextlib.suppress(Exception):
                await (await orch.store()).delete_worker(orch.owner)

    # ----- the claim loop ------------------------------------------------------------------

    async def _claim_loop(self, runner: AsyncRunner, kinds: list[str], until_idle: bool) -> None:
        assert self._stopping is not None and self._wake is not None
        store = await self.orchestrator.store()
        announced = -math.inf
        failures = 0
        while not self._stopping.is_set():
            self._wake.clear()
            try:
                if time.monotonic() - announced >= self.poll_seconds:
                    await store.upsert_worker(
                        owner=self.orchestrator.owner,
                        kinds=kinds,
                        concurrency=self.concurrency,
                        ttl_seconds=3 * self.poll_seconds + 5.0,
                    )
                    announced = time.monotonic()
                while self.in_flight < self.concurrency and not self._stopping.is_set():
                    if not await self._claim_some(runner, kinds):
                        break
                if self.in_flight >= self.concurrency:
                    await self._sleep(self.poll_seconds)
                    continue
                if until_idle and self.in_flight == 0 and await store.count_open(kinds) == 0:
                    return
                timeout = self._until_next(await store.next_claimable_at(kinds))
                failures = 0
            except Exception as exc:
                # One failure never ends the worker (as in `Worker`): a lost database is
                # waited for, anything else logged and tried again, backing off.
                if is_transient(exc):
                    _log.warning("worker_database_error", error=describe_error(exc))
                    timeout = self.poll_seconds
                else:
                    failures += 1
                    timeout = loop_backoff(self.poll_seconds, failures)
                    log_loop_error(exc, retry_in=timeout)
            await self._sleep(timeout)

    async def _claim_some(self, runner: AsyncRunner, kinds: list[str]) -> bool:
        """Claim sagas for the free slots in one statement and one commit (a batch claim,
        `MAX_CLAIM_BATCH` at most), and start driving each one claimed; whether the claim
        took all it asked for (there may be more to claim).

        One claim a saga would leave the slots to fill at the pace of one round trip and
        commit each, slower than short sagas end."""
        wanted = min(self.concurrency - self.in_flight, MAX_CLAIM_BATCH)
        claimed = await runner.claim_batch(kinds, self.orchestrator.definition, wanted)
        for planner, nxt in claimed:
            self._spawn(runner, planner, nxt)
        return len(claimed) >= wanted

    async def _sleep(self, seconds: float) -> None:
        assert self._wake is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), seconds)

    def _until_next(self, at: datetime | None) -> float:
        if at is None:
            return self.poll_seconds
        seconds = (at - datetime.now().astimezone()).total_seconds()
        return min(self.poll_seconds, max(seconds, 0.01))

    def _spawn(self, runner: AsyncRunner, planner: Planner, nxt: Next) -> None:
        saga_id = planner.saga.id
        key = (saga_id, planner.saga.fence)

        async def drive() -> None:
            try:
                await runner.drive(planner, nxt)
            except asyncio.CancelledError:
                raise
            except Exception:
                _log.exception("saga_drive_failed", saga_id=saga_id)
            finally:
                self._in_flight.pop(key, None)
                if self._wake is not None:
                    self._wake.set()

        task = asyncio.get_running_loop().create_task(drive(), name=f"saga-{saga_id}")
        self._in_flight[key] = (task, planner)

    async def _drain(self, runner: AsyncRunner) -> None:
        tasks = [task for task, _ in self._in_flight.values()]
        if tasks:
            await asyncio.wait(tasks, timeout=self.grace_seconds)
        left = list(self._in_flight.values())
        for task, planner in left:
            saga = planner.saga
            _log.warning("grace_period_exceeded", saga_id=saga.id, fence=saga.fence)
            task.cancel()
            with contextlib.suppress(Exception):
                await runner.store.release_lease(
                    saga.id, owner=self.orchestrator.owner, fence=saga.fence
                )
        if left:
            await asyncio.wait([task for task, _ in left], timeout=1.0)

    # ----- wake-ups --------------------------------------------------------------------------

    async def _listen(self, url: str | None, source: str) -> None:
        """LISTEN for runnable sagas; reconnects with bounded backoff while the worker runs.
        Returns at once when there is nowhere to LISTEN (polling finds the work)."""
        assert self._stopping is not None and self._wake is not None
        if url is None:
            return
        delay = 0.05
        while not self._stopping.is_set():
            try:
                conn = await psycopg.AsyncConnection.connect(
                    url, autocommit=True, prepare_threshold=None
                )
                async with conn:
                    if await behind_pooler_async(conn):
                        warn_polling(url, source, self.poll_seconds)
                        return
                    await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(CHANNEL)))
                    self._wake.set()  # catch up on anything missed while not listening
                    delay = 0.05
                    async for _ in conn.notifies():
                        self._wake.set()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self._stopping.is_set():
                    return
                # The URL's password may be quoted by the driver (a URL that does not parse).
                error = scrub(describe_error(exc), url)
                if isinstance(exc, psycopg.ProgrammingError):
                    # A URL that does not parse never will: said once, as the sync worker
                    # says it; polling still finds work.
                    _log.error("listener_stopped", error=error)
                    return
                # Polling still finds work; only the prompt wake-ups are delayed.
                _log.warning("listener_reconnecting", error=error)
                await asyncio.sleep(delay)
                delay = min(delay * 2, _LISTEN_RETRY_MAX_SECONDS)

    @contextlib.contextmanager
    def _signals(self, install: bool) -> Iterator[None]:
        if not install:
            yield
            return
        loop = asyncio.get_running_loop()

        def on_signal(signum: signal.Signals) -> None:
            _log.info("worker_stopping", signal=signum.name)
            self.stop()

        installed: list[signal.Signals] = []
        for signum in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(signum, on_signal, signum)
            except (NotImplementedError, RuntimeError, ValueError):
                continue
            installed.append(signum)
        try:
            yield
        finally:
            for signum in installed:
                loop.remove_signal_handler(signum)


# Longest wait (seconds) of a metrics collection for the worker's loop to read the gauges.
_GAUGES_TIMEOUT_SECONDS = 5.0


def _gauges_reader(
    store: AsyncStore, loop: asyncio.AbstractEventLoop
) -> Callable[[], list[DatabaseGauges]]:
    """What reads the gauges for a metrics collection (made in another thread, the
    exporter's): the query is run on the worker's loop, whose pool it uses. A collection
    made on the loop itself reads nothing rather than wait for itself."""

    def read() -> list[DatabaseGauges]:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            return []
        future = asyncio.run_coroutine_threadsafe(store.database_gauges(), loop)
        return future.result(timeout=_GAUGES_TIMEOUT_SECONDS)

    return read


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()
