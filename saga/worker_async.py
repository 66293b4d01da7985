"""The workers: claim runnable sagas of their orchestrator's registered kinds and drive them.

`AsyncWorker` drives each saga as a task on one event loop; `Worker` drives each in a
thread of its own. `saga/worker_async.py` is the source of both: `saga/worker.py` is
generated from it by `tools/async_to_sync.py`, which keeps the `else:` branch of each
`if True:  # ASYNC` block, where the few lines that differ sit.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any, Protocol

from saga import telemetry
from saga._core.planner import Planner
from saga._db.database import Route, describe_url, garbled_reply, is_malformed_url
from saga._db.dbretry import is_transient
from saga._db.listen_async import listening, unparsable_url
from saga._db.store_async import AsyncStore
from saga._drivers.driver_async import AsyncRunner
from saga._flows.drive import Move, describe_error
from saga.definition import Saga
from saga.errors import DatabaseRefused, DatabaseUnavailable
from saga.logs import get_logger
from saga.redact import scrub
from saga.state import DatabaseGauges

if True:  # ASYNC
    import asyncio
    from asyncio import Event, Task

    from saga._acompat import loop_signals, sync_only
else:
    from threading import Event, Thread

    from saga._drivers.drivethreads import DriverThreads
    from saga._drivers.loopguard import sync_only

_log = get_logger("saga.worker")

if True:  # ASYNC

    async def _wait(event: Event, seconds: float) -> None:
        """Wait until `event` is set, `seconds` at most."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), seconds)

    async def _wait_for(tasks: list[Task[None]], seconds: float) -> None:
        """Wait until `tasks` are done, `seconds` at most."""
        if tasks:
            await asyncio.wait(tasks, timeout=seconds)

    # Connections a saga in flight may hold: its transaction (one task renews every lease).
    _CONNECTIONS_PER_SAGA = 1
else:

    def _wait(event: Event, seconds: float) -> None:
        """Wait until `event` is set, `seconds` at most."""
        event.wait(seconds)

    # Connections a saga in flight may hold: its transaction and its heartbeat.
    _CONNECTIONS_PER_SAGA = 2


def check_settings(
    concurrency: int, poll_seconds: float, grace_seconds: float, short_wait_seconds: float
) -> None:
    """`ValueError` naming the first worker setting out of range (both workers')."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    for name, value in (
        ("poll_seconds", poll_seconds),
        ("grace_seconds", grace_seconds),
        ("short_wait_seconds", short_wait_seconds),
    ):
        if not value >= 0 or (name == "poll_seconds" and value == 0):
            raise ValueError(f"{name} must be positive, got {value}")


class AsyncWorkerEngine(Protocol):
    """What a worker needs of its orchestrator: the registry, the settings, the connection
    pool and a driver (an `AsyncOrchestrator` is one for an `AsyncWorker`, an
    `Orchestrator` for a `Worker`)."""

    @property
    def owner(self) -> str: ...

    @property
    def database_url(self) -> str: ...

    def registered(self) -> list[Saga[Any]]: ...

    def definition(self, name: str, version: int) -> Saga[Any]: ...

    async def ensure_pool_size(self, connections: int) -> None: ...

    async def runner(
        self,
        *,
        stopping: Event | None = None,
        max_inline_sleep: float | None = None,
        answers: bool = True,
    ) -> AsyncRunner: ...


# A worker waiting for its database at start tries again after this long (seconds),
# doubled at each failure up to the second figure.
START_RETRY_SECONDS = (0.1, 5.0)
# Longest wait (seconds) of the claim loop between two tries after an unexpected error.
LOOP_ERROR_MAX_SECONDS = 30.0


def unreachable(exc: BaseException, url: str) -> bool:
    """Whether `exc`, from a worker's first use of its database, says the database cannot
    be reached for now (refused connections, a server restarting, a network down): the
    worker waits for it. A refusal (bad credentials, an unknown role or database, an
    access rule), a malformed URL or a role without the privileges is raised."""
    if isinstance(exc, DatabaseRefused):
        return False
    if isinstance(exc, DatabaseUnavailable):
        return not is_malformed_url(url)
    # A reply the client could not make sense of: the connection is broken, not the
    # request refused. What a worker does at start (migrate, check its privileges) is safe
    # to do again.
    if garbled_reply(exc):
        return True
    return is_transient(exc)


def log_unreachable(exc: BaseException, *, attempt: int, retry_in: float) -> None:
    """The log line of a worker that waits for its database at start."""
    _log.warning(
        "worker_database_unreachable",
        attempt=attempt,
        error=f"{type(exc).__name__}: {exc}",
        retry_in_seconds=round(retry_in, 3),
    )


def loop_backoff(poll_seconds: float, failures: int) -> float:
    """The claim loop's wait (seconds) after `failures` unexpected errors in a row."""
    grown: float = poll_seconds * 2.0 ** min(failures - 1, 16)
    return min(grown, max(LOOP_ERROR_MAX_SECONDS, poll_seconds))


def log_loop_error(exc: BaseException, *, retry_in: float) -> None:
    """The log line of a worker whose claim loop failed unexpectedly; it goes on."""
    _log.error(
        "worker_loop_failed",
        error=f"{type(exc).__name__}: {exc}",
        retry_in_seconds=round(retry_in, 3),
        traceback="".join(traceback.format_exception(exc)),
    )


# Most sagas one claim takes (one statement and one commit), for as many idle drivers.
MAX_CLAIM_BATCH = 32
ENV_LISTEN_URL = "SAGA_LISTEN_URL"


def listen_target(
    explicit: str | None, database_url: str, route: Route | None
) -> tuple[str | None, str]:
    """Where a worker LISTENs: the explicit `listen_url`, else `SAGA_LISTEN_URL`, else the
    database URL itself unless the orchestrator's first connection found a pooler there
    (None: no LISTEN, polling only); with where the URL came from, for the log."""
    if explicit:
        return explicit, "listen_url"
    from_env = os.environ.get(ENV_LISTEN_URL)
    if from_env:
        return from_env, ENV_LISTEN_URL
    if route is not None and route.pooled:
        return None, "database_url"
    return database_url, "database_url"


def warn_polling(url: str, source: str, poll_seconds: float) -> None:
    """The one log line of a worker that cannot LISTEN on `url` (a pooler answers there)
    and finds work by polling instead."""
    _log.warning(
        "listen_unavailable",
        url=describe_url(url),
        source=source,
        reason="a connection pooler answers on this URL, and LISTEN needs a session of its "
        "own on the server",
        polling_seconds=poll_seconds,
        fix=f"give the worker a direct URL for its wake-ups: listen_url=, {ENV_LISTEN_URL} "
        "or `saga worker --listen-url`",
    )


def orchestrator_route(orch: object) -> Route | None:
    """The orchestrator's `route` (what its first connection found), when it has one."""
    route = getattr(orch, "route", None)
    return route if isinstance(route, Route) else None


# Longest wait (seconds) between two attempts to LISTEN again after the listener failed.
_LISTEN_RETRY_MAX_SECONDS = 5.0


class AsyncWorker:
    """Drives up to `concurrency` sagas at once until stopped (or idle).

    A worker only claims sagas whose (name, version) its orchestrator has
    registered; others wait for a worker that knows them. It wakes on
    `LISTEN/NOTIFY` when a saga is started or made runnable, at the moment the
    earliest retry backoff or expired lease comes due, and otherwise polls every
    `poll_seconds` as a fallback.

    A `Worker` drives each saga in a thread of its own. An `AsyncWorker` drives each as
    a task on the loop that awaits `run`: async steps are awaited on that loop, sync
    steps run in threads.

    Args:
        orchestrator: Whose registry, database and lease settings to use.
        concurrency: Most sagas driven at once (one thread each in a `Worker`, one task
            each in an `AsyncWorker`).
        poll_seconds: Longest wait between two looks for claimable sagas.
        grace_seconds: On stop, how long in-flight attempts may take to finish;
            leases still held after it are released (their attempts' outcomes
            become unknown to the next owner, and their late writes are fenced out;
            an `AsyncWorker` also cancels their tasks).
        short_wait_seconds: Retry backoffs up to this long are waited out under the
            lease; longer ones are persisted as `run_after` and the lease released.
        listen_url: A direct URL of the same database for `LISTEN` (which needs a
            session of its own), when the orchestrator's URL is a transaction pooler's;
            else `SAGA_LISTEN_URL`; else the orchestrator's URL. Where a pooler answers
            (detected as `Orchestrator` detects it), the worker logs one warning
            (`listen_unavailable`) and polls every `poll_seconds` instead.
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
        self._stopping = Event()
        self._wake = Event()
        self._stop_requested = False
        # By (saga id, fence): an attempt fenced out by a newer lease of this worker on the
        # same saga may still be running beside the newer one, and counts as in flight.
        if True:  # ASYNC
            self._in_flight: dict[tuple[str, int], tuple[Task[None], Planner]] = {}
            self._loop: asyncio.AbstractEventLoop | None = None
        else:
            # A saga is driven in a thread kept for the next one when it ends.
            self._in_flight: dict[tuple[str, int], tuple[None, Planner]] = {}
            self._drivers = DriverThreads()
        self._lock = threading.Lock()

    def stop(self) -> None:
        """Stop claiming; in-flight sagas finish their current attempt and are handed back.
        Safe to call from any thread, any task, or a signal handler."""
        self._stop_requested = True
        if True:  # ASYNC
            # The events belong to the worker's loop: set them there.
            loop = self._loop
            if loop is None:
                return
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is not loop:
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                    loop.call_soon_threadsafe(self._set_stopping)
                return
        self._set_stopping()

    def _set_stopping(self) -> None:
        self._stopping.set()
        self._wake.set()

    @property
    def in_flight(self) -> int:
        """How many sagas this worker is driving now."""
        with self._lock:
            return len(self._in_flight)

    @sync_only(runs_steps=True)
    async def run(self, until_idle: bool = False, *, handle_signals: bool | None = None) -> None:
        """Claim and drive sagas until `stop()`, or, with `until_idle`, until none is open.

        Open means pending, running or compensating: with `until_idle=True` the
        worker waits out retry backoffs and expired leases before returning. Run in
        the main thread (for an `AsyncWorker`, on a loop running in the main thread),
        SIGTERM and SIGINT stop the worker gracefully, unless `handle_signals=False`.
        """
        orch = self.orchestrator
        kinds = [f"{s.name}:{s.version}" for s in orch.registered()]
        if not kinds:
            raise ValueError("the orchestrator has no registered saga; register one first")
        if True:  # ASYNC
            # Events of this loop (a worker may be run again, on another loop).
            self._loop = asyncio.get_running_loop()
            self._stopping, self._wake = Event(), Event()
        if self._stop_requested:
            self._stopping.set()
        if handle_signals is None:
            handle_signals = threading.current_thread() is threading.main_thread()
        with self._signals(handle_signals):
            runner = await self._reach_database()
            if runner is not None:
                await self._run(runner, kinds, until_idle)
        _log.info("worker_stopped", owner=orch.owner)

    async def _reach_database(self) -> AsyncRunner | None:
        """Connect (and migrate), and check the role may drive sagas: a driver of the
        orchestrator's flows, or None when stopped first. A database it cannot reach yet
        (a server restarting, a network down) is waited for, with backoff, logged
        (`worker_database_unreachable`): a worker never exits on its own. A refusal, a
        malformed URL or a role that may not drive sagas is raised, naming what is
        wrong, rather than found at the first claim."""
        orch = self.orchestrator
        delay, most = START_RETRY_SECONDS
        attempt = 0
        while not self._stopping.is_set():
            attempt += 1
            try:
                # A worker drops the state a drive ends with: it is not read back.
                runner = await orch.runner(
                    stopping=self._stopping,
                    max_inline_sleep=self.short_wait_seconds,
                    answers=False,
                )
                await runner.store.check_privileges("worker")
                return runner
            except Exception as exc:
                if not unreachable(exc, orch.database_url):
                    raise
                log_unreachable(exc, attempt=attempt, retry_in=delay)
            await _wait(self._stopping, delay)
            delay = min(2 * delay, most)
        return None

    async def _run(self, runner: AsyncRunner, kinds: list[str], until_idle: bool) -> None:
        orch = self.orchestrator
        store = runner.store
        # Each saga in flight may hold connections (`_CONNECTIONS_PER_SAGA`); one more for
        # the heartbeat and one for the claim loop.
        await orch.ensure_pool_size(_CONNECTIONS_PER_SAGA * self.concurrency + 2)
        _log.info("worker_started", owner=orch.owner, concurrency=self.concurrency, kinds=kinds)
        url, source = listen_target(self.listen_url, orch.database_url, orchestrator_route(orch))
        if url is None:
            warn_polling(orch.database_url, source, self.poll_seconds)
        if True:  # ASYNC
            listener = asyncio.create_task(self._listen(url, source), name="saga-listener")
            gauges = _gauges_reader(store, asyncio.get_running_loop())
        else:
            # A daemon thread: it never keeps the process alive.
            listener = Thread(
                target=self._listen, args=(url, source), name="saga-listener", daemon=True
            )
            listener.start()
            gauges = store.database_gauges
        # While it runs, the metrics' gauges read the database this worker drives.
        unwatch = telemetry.watch_database(
            orch.database_url, gauges, [s.name for s in orch.registered()]
        )
        try:
            await self._claim_loop(runner, kinds, until_idle)
        finally:
            unwatch()
            self._stopping.set()
            if True:  # ASYNC
                listener.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await listener
            await self._drain(runner)
            with contextlib.suppress(Exception):
                await store.delete_worker(orch.owner)

    # ----- the claim loop ------------------------------------------------------------------

    async def _claim_loop(self, runner: AsyncRunner, kinds: list[str], until_idle: bool) -> None:
        store = runner.store
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
                    await _wait(self._wake, self.poll_seconds)
                    continue
                if until_idle and self.in_flight == 0 and await store.count_open(kinds) == 0:
                    return
                timeout = self._until_next(await store.next_claimable_at(kinds))
                failures = 0
            except Exception as exc:
                # One failure never ends the worker: a lost database is waited for, and
                # anything else is logged with its traceback and tried again, backing off.
                if is_transient(exc):
                    _log.warning("worker_database_error", error=describe_error(exc))
                    timeout = self.poll_seconds
                else:
                    failures += 1
                    timeout = loop_backoff(self.poll_seconds, failures)
                    log_loop_error(exc, retry_in=timeout)
            await _wait(self._wake, timeout)

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

    def _until_next(self, at: datetime | None) -> float:
        if at is None:
            return self.poll_seconds
        seconds = (at - datetime.now().astimezone()).total_seconds()
        return min(self.poll_seconds, max(seconds, 0.01))

    def _spawn(self, runner: AsyncRunner, planner: Planner, nxt: Move) -> None:
        saga_id = planner.saga.id
        key = (saga_id, planner.saga.fence)

        async def drive() -> None:
            try:
                await runner.drive(planner, nxt)
            except Exception:
                _log.exception("saga_drive_failed", saga_id=saga_id)
            finally:
                with self._lock:
                    self._in_flight.pop(key, None)
                self._wake.set()

        if True:  # ASYNC
            task = asyncio.get_running_loop().create_task(drive(), name=f"saga-{saga_id}")
            with self._lock:
                self._in_flight[key] = (task, planner)
        else:
            # In a daemon thread (`DriverThreads`): a step still running after the grace
            # period must not keep the process alive; its lease has been released and its
            # late writes are fenced out.
            with self._lock:
                self._in_flight[key] = (None, planner)
            try:
                self._drivers.run(drive, name=f"saga-{saga_id}")
            except BaseException:
                with self._lock:
                    self._in_flight.pop(key, None)
                raise

    async def _drain(self, runner: AsyncRunner) -> None:
        """Wait `grace_seconds` for the sagas in flight, then hand back the leases still
        held (an `AsyncWorker` cancels their tasks)."""
        if True:  # ASYNC
            with self._lock:
                driving = [each for each, _ in self._in_flight.values()]
            await _wait_for(driving, self.grace_seconds)
        else:
            # Each saga's thread sets `_wake` once the saga has left `_in_flight`.
            deadline = time.monotonic() + self.grace_seconds
            while True:
                self._wake.clear()
                with self._lock:
                    if not self._in_flight:
                        break
                left_seconds = deadline - time.monotonic()
                if left_seconds <= 0:
                    break
                self._wake.wait(left_seconds)
        with self._lock:
            left = list(self._in_flight.values())
        if True:  # ASYNC
            for task, _ in left:
                task.cancel()
        for _, planner in left:
            saga = planner.saga
            _log.warning("grace_period_exceeded", saga_id=saga.id, fence=saga.fence)
            with contextlib.suppress(Exception):
                await runner.store.release_lease(
                    saga.id, owner=self.orchestrator.owner, fence=saga.fence
                )
        if True:  # ASYNC
            await _wait_for([task for task, _ in left], 1.0)
        else:
            self._drivers.close()
            self._drivers = DriverThreads()

    # ----- wake-ups --------------------------------------------------------------------------

    async def _listen(self, url: str | None, source: str) -> None:
        """LISTEN for runnable sagas; reconnects with bounded backoff while the worker runs.
        Returns at once when there is nowhere to LISTEN (polling finds the work)."""
        if url is None:
            return
        delay = 0.05
        while not self._stopping.is_set():
            try:
                async with listening(url) as listener:
                    if await listener.behind_pooler():
                        warn_polling(url, source, self.poll_seconds)
                        return
                    await listener.listen()
                    self._wake.set()  # catch up on anything missed while not listening
                    delay = 0.05
                    while not self._stopping.is_set():
                        if await listener.notified(1.0):
                            self._wake.set()
            except Exception as exc:
                if self._stopping.is_set():
                    return
                # The URL's password may be quoted by the driver (a URL that does not parse).
                error = scrub(describe_error(exc), url)
                if unparsable_url(exc):
                    # A URL that does not parse never will: said once; polling still finds
                    # work.
                    _log.error("listener_stopped", error=error)
                    return
                # Polling still finds work; only the prompt wake-ups are delayed.
                _log.warning("listener_reconnecting", error=error)
                await _wait(self._stopping, delay)
                delay = min(delay * 2, _LISTEN_RETRY_MAX_SECONDS)

    @contextlib.contextmanager
    def _signals(self, install: bool) -> Iterator[None]:
        """SIGTERM and SIGINT stop the worker while the block runs (with `install`)."""
        if not install:
            yield
            return
        if True:  # ASYNC

            def on_signal(signum: signal.Signals) -> None:
                _log.info("worker_stopping", signal=signum.name)
                self.stop()

            with loop_signals(on_signal):
                yield
        else:

            def on_signal(signum: int, frame: object) -> None:
                _log.info("worker_stopping", signal=signal.Signals(signum).name)
                self.stop()

            previous: dict[int, Any] = {}
            for signum in (signal.SIGTERM, signal.SIGINT):
                previous[signum] = signal.signal(signum, on_signal)
            try:
                yield
            finally:
                for number, handler in previous.items():
                    signal.signal(number, handler)


if True:  # ASYNC
    # Longest wait (seconds) of a metrics collection for the worker's loop to read the
    # gauges.
    _GAUGES_TIMEOUT_SECONDS = 5.0

    def _gauges_reader(
        store: AsyncStore, loop: asyncio.AbstractEventLoop
    ) -> Callable[[], list[DatabaseGauges]]:
        """What reads the gauges for a metrics collection (made in another thread, the
        exporter's): the query is run on the worker's loop, whose pool it uses. A
        collection made on the loop itself reads nothing rather than wait for itself."""

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
