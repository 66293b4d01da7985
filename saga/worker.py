"""A worker: claims runnable sagas of its orchestrator's registered kinds and drives them."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
import time
import traceback
from collections.abc import Iterator
from datetime import datetime
from types import FrameType
from typing import Any, Protocol

import psycopg
from psycopg import sql

from saga import telemetry
from saga._core.planner import Next, Planner
from saga._db.database import Route, behind_pooler, describe_url, is_malformed_url
from saga._db.dbretry import is_transient, retrying
from saga._db.store import Store
from saga._drivers.driver import Runner, RunnerOptions
from saga._drivers.leases import LeaseKeeper
from saga._drivers.loopguard import sync_only
from saga.definition import Saga
from saga.errors import DatabaseRefused, DatabaseUnavailable
from saga.logs import get_logger
from saga.redact import scrub

_log = get_logger("saga.worker")


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


class WorkerEngine(Protocol):
    """What a `Worker` needs of its orchestrator: the registry, the settings, the store
    and the heartbeat (an `Orchestrator` is one)."""

    @property
    def owner(self) -> str: ...

    @property
    def database_url(self) -> str: ...

    @property
    def store(self) -> Store: ...

    @property
    def lease_keeper(self) -> LeaseKeeper: ...

    def registered(self) -> list[Saga[Any]]: ...

    def definition(self, name: str, version: int) -> Saga[Any]: ...

    def runner_options(self, *, max_inline_sleep: float = ...) -> RunnerOptions: ...

    def ensure_pool_size(self, connections: int) -> None: ...


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
    # A reply the client could not make sense of (psycopg's own InternalError, with no
    # SQLSTATE: "received 2 results from command 'COMMIT'" when a server restarts behind a
    # pooler mid-reply): the connection is broken, not the request refused. What a worker
    # does at start (migrate, check its privileges) is safe to do again.
    if isinstance(exc, psycopg.InternalError) and exc.sqlstate is None:
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


CHANNEL = "saga_runnable"
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


class Worker:
    """Drives up to `concurrency` sagas at once until stopped (or idle).

    A worker only claims sagas whose (name, version) its orchestrator has
    registered; others wait for a worker that knows them. It wakes on
    `LISTEN/NOTIFY` when a saga is started or made runnable, at the moment the
    earliest retry backoff or expired lease comes due, and otherwise polls every
    `poll_seconds` as a fallback.

    Args:
        orchestrator: Whose registry, database and lease settings to use.
        concurrency: Most sagas driven at once (one thread each).
        poll_seconds: Longest wait between two looks for claimable sagas.
        grace_seconds: On stop, how long in-flight attempts may take to finish;
            leases still held after it are released (their attempts' outcomes
            become unknown to the next owner, and their late writes are fenced out).
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
        orchestrator: WorkerEngine,
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
        self._stopping = threading.Event()
        self._wake = threading.Event()
        # By (saga id, fence): an attempt fenced out by a newer lease of this worker on the
        # same saga may still be running beside the newer one, and counts as in flight.
        self._in_flight: dict[tuple[str, int], tuple[threading.Thread, Planner]] = {}
        self._lock = threading.Lock()

    def stop(self) -> None:
        """Stop claiming; in-flight sagas finish their current attempt and are handed back."""
        self._stopping.set()
        self._wake.set()

    @property
    def in_flight(self) -> int:
        """How many sagas this worker is driving now."""
        with self._lock:
            return len(self._in_flight)

    @sync_only(runs_steps=True)
    def run(self, until_idle: bool = False, *, handle_signals: bool | None = None) -> None:
        """Claim and drive sagas until `stop()`, or, with `until_idle`, until none is open.

        Open means pending, running or compensating: with `until_idle=True` the
        worker waits out retry backoffs and expired leases before returning. Called
        from the main thread, SIGTERM and SIGINT stop the worker gracefully (unless
        `handle_signals=False`).
        """
        orch = self.orchestrator
        kinds = [f"{s.name}:{s.version}" for s in orch.registered()]
        if not kinds:
            raise ValueError("the orchestrator has no registered saga; register one first")
        if handle_signals is None:
            handle_signals = threading.current_thread() is threading.main_thread()
        with self._signals(handle_signals):
            if self._reach_database():
                self._run(kinds, until_idle)
        _log.info("worker_stopped", owner=orch.owner)

    def _reach_database(self) -> bool:
        """Connect (and migrate), and check the role may drive sagas; False when stopped
        first. A database it cannot reach yet (a server restarting, a network down) is
        waited for, with backoff, logged (`worker_database_unreachable`): a worker never
        exits on its own. A refusal, a malformed URL or a role that may not drive sagas
        is raised, naming what is wrong, rather than found at the first claim."""
        orch = self.orchestrator
        delay, most = START_RETRY_SECONDS
        attempt = 0
        while not self._stopping.is_set():
            attempt += 1
            try:
                orch.store.check_privileges("worker")
                return True
            except Exception as exc:
                if not unreachable(exc, orch.database_url):
                    raise
                log_unreachable(exc, attempt=attempt, retry_in=delay)
            self._stopping.wait(delay)
            delay = min(2 * delay, most)
        return False

    def _run(self, kinds: list[str], until_idle: bool) -> None:
        orch = self.orchestrator
        # Each saga in flight may hold two connections (its transaction and its heartbeat).
        orch.ensure_pool_size(2 * self.concurrency + 2)
        options = orch.runner_options(max_inline_sleep=self.short_wait_seconds)
        runner = Runner(orch.store, options, keeper=orch.lease_keeper, stopping=self._stopping)
        url, source = listen_target(self.listen_url, orch.database_url, orchestrator_route(orch))
        if url is None:
            warn_polling(orch.database_url, source, self.poll_seconds)
        listener = threading.Thread(
            target=self._listen, args=(url, source), name="saga-listener", daemon=True
        )
        _log.info("worker_started", owner=orch.owner, concurrency=self.concurrency, kinds=kinds)
        # While it runs, the metrics' gauges read the database this worker drives.
        unwatch = telemetry.watch_database(
            orch.database_url, orch.store.database_gauges, [s.name for s in orch.registered()]
        )
        listener.start()
        try:
            self._loop(runner, kinds, until_idle)
        finally:
            unwatch()
            self._stopping.set()
            self._drain()
            with contextlib.suppress(Exception):
                orch.store.delete_worker(orch.owner)

    # ----- the claim loop ------------------------------------------------------------------

    def _loop(self, runner: Runner, kinds: list[str], until_idle: bool) -> None:
        store = self.orchestrator.store
        announced = -math.inf
        failures = 0
        while not self._stopping.is_set():
            self._wake.clear()
            try:
                if time.monotonic() - announced >= self.poll_seconds:
                    store.upsert_worker(
                        owner=self.orchestrator.owner,
                        kinds=kinds,
                        concurrency=self.concurrency,
                        ttl_seconds=3 * self.poll_seconds + 5.0,
                    )
                    announced = time.monotonic()
                while self.in_flight < self.concurrency and not self._stopping.is_set():
                    # The idle drivers' sagas in one claim: one statement, one commit.
                    wanted = min(self.concurrency - self.in_flight, MAX_CLAIM_BATCH)
                    claimed = runner.claim_batch(kinds, self.orchestrator.definition, wanted)
                    for planner, nxt in claimed:
                        self._spawn(runner, planner, nxt)
                    if len(claimed) < wanted:
                        break
                if self.in_flight >= self.concurrency:
                    self._wake.wait(self.poll_seconds)
                    continue
                if until_idle and self.in_flight == 0 and store.count_open(kinds) == 0:
                    return
                timeout = self._until_next(store.next_claimable_at(kinds))
                failures = 0
            except Exception as exc:
                # One failure never ends the worker: a lost database is waited for, and
                # anything else is logged with its traceback and tried again, backing off.
                if is_transient(exc):
                    _log.warning("worker_database_error", error=f"{type(exc).__name__}: {exc}")
                    timeout = self.poll_seconds
                else:
                    failures += 1
                    timeout = loop_backoff(self.poll_seconds, failures)
                    log_loop_error(exc, retry_in=timeout)
            self._wake.wait(timeout)

    def _until_next(self, at: datetime | None) -> float:
        if at is None:
            return self.poll_seconds
        seconds = (at - datetime.now().astimezone()).total_seconds()
        return min(self.poll_seconds, max(seconds, 0.01))

    def _spawn(self, runner: Runner, planner: Planner, nxt: Next) -> None:
        saga_id = planner.saga.id
        key = (saga_id, planner.saga.fence)

        def drive() -> None:
            try:
                runner.drive(planner, nxt)
            except Exception:
                _log.exception("saga_drive_failed", saga_id=saga_id)
            finally:
                with self._lock:
                    self._in_flight.pop(key, None)
                self._wake.set()

        # Daemon threads: a step still running after the grace period must not keep the
        # process alive; its lease has been released and its late writes are fenced out.
        thread = threading.Thread(target=drive, name=f"saga-{saga_id}", daemon=True)
        with self._lock:
            self._in_flight[key] = (thread, planner)
        thread.start()

    def _drain(self) -> None:
        deadline = time.monotonic() + self.grace_seconds
        with self._lock:
            threads = list(self._in_flight.values())
        for thread, _ in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            left = list(self._in_flight.values())
        store = self.orchestrator.store
        for _, planner in left:
            saga = planner.saga
            _log.warning("grace_period_exceeded", saga_id=saga.id, fence=saga.fence)
            with contextlib.suppress(Exception):
                store.release_lease(saga.id, owner=self.orchestrator.owner, fence=saga.fence)

    # ----- wake-ups --------------------------------------------------------------------------

    def _listen(self, url: str | None, source: str) -> None:
        """LISTEN for runnable sagas; reconnects with bounded backoff while the worker runs.
        Returns at once when there is nowhere to LISTEN (polling finds the work)."""
        if url is None:
            return
        try:
            for attempt in retrying("listen", seconds=math.inf, until=self._stopping, url=url):
                with (
                    attempt,
                    psycopg.connect(url, autocommit=True, prepare_threshold=None) as conn,
                ):
                    if behind_pooler(conn):
                        warn_polling(url, source, self.poll_seconds)
                        return
                    conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(CHANNEL)))
                    self._wake.set()  # catch up on anything missed while not listening
                    while not self._stopping.is_set():
                        for _ in conn.notifies(timeout=1.0, stop_after=1):
                            self._wake.set()
        except Exception as exc:
            if not self._stopping.is_set():
                # Polling still finds work; only the prompt wake-ups are lost. The URL's
                # password may be quoted by the driver (a URL that does not parse).
                _log.error("listener_stopped", error=scrub(f"{type(exc).__name__}: {exc}", url))

    @contextlib.contextmanager
    def _signals(self, install: bool) -> Iterator[None]:
        if not install:
            yield
            return

        def on_signal(signum: int, frame: FrameType | None) -> None:
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


def orchestrator_route(orch: object) -> Route | None:
    """The orchestrator's `route` (what its first connection found), when it has one."""
    route = getattr(orch, "route", None)
    return route if isinstance(route, Route) else None
