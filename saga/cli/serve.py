"""The `saga` commands that run until stopped: `saga worker` (a Worker or an AsyncWorker
on the app's sagas) and `saga dashboard` (the web extra's read-only dashboard)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from collections.abc import Iterator
from types import FrameType
from typing import Any

from saga import _early
from saga._acompat import loop_signals
from saga._app import UsageError, load_app
from saga._db.database import describe_url
from saga.cli.console import announce, stdlib_formatter
from saga.cli.parser import EXIT_OK, WEB_EXTRA
from saga.logs import get_logger
from saga.orchestrator import Orchestrator
from saga.orchestrator_async import AsyncOrchestrator
from saga.worker import Worker, unreachable
from saga.worker_async import AsyncWorker

# The modules `saga dashboard` needs (the web extra).
_WEB_MODULES = {"starlette", "jinja2", "uvicorn"}


class _StopSignals:
    """SIGTERM and SIGINT for `saga worker`, from its first moment: before the app is
    imported and the database reached, a signal is remembered (the worker then stops
    before it drives anything); once the worker exists, it stops it gracefully."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._worker: Worker | AsyncWorker | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopSignals:
        early = _early.installed()
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._previous[signum] = signal.signal(signum, self._on_signal)
        # One that came while the command itself was being imported (see saga/_early.py).
        if early and _early.received is not None:
            self._on_signal(_early.received, None)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _on_signal(self, signum: int, frame: FrameType | None = None) -> None:
        self.received = signal.Signals(signum).name
        get_logger("saga.worker").info("worker_stopping", signal=self.received)
        if self._worker is not None:
            self._worker.stop()

    def on_loop(self) -> contextlib.AbstractContextManager[None]:
        """The same handling through the running event loop, which wakes at once; then
        back to the handler of the process."""
        return loop_signals(self._on_signal, then=self._on_signal)

    def hand_to(self, worker: Worker | AsyncWorker) -> None:
        """From now on a signal stops `worker` (at once if one came already)."""
        self._worker = worker
        if self.received is not None:
            worker.stop()


def run_worker(args: argparse.Namespace) -> int:
    """`saga worker`: drive the app's sagas until SIGTERM or SIGINT."""
    # Signals first: a SIGTERM while the app is imported or the database reached (a
    # deployment replacing a worker it has just started) stops it with exit 0.
    with _StopSignals() as signals:
        orch = load_app(args.app, args.database_url)
        if args.metrics_port is not None and signals.received is None:
            _serve_metrics(*args.metrics_port)
        if isinstance(orch, AsyncOrchestrator):
            return asyncio.run(
                _async_worker(orch, args.concurrency, args.listen_url, signals=signals)
            )
        with orch:
            # Connect (and migrate) now, and check the role may drive sagas: a refused
            # login, a malformed URL or a role without the privileges fails before the
            # worker is announced. A database it cannot reach yet is waited for by the
            # worker (logged).
            with _unless_unreachable(orch.database_url):
                if signals.received is None:
                    orch.store.check_privileges("worker")
            if signals.received is None:
                _announce_ready(orch, args.concurrency)
                worker = orch.worker(concurrency=args.concurrency, listen_url=args.listen_url)
                signals.hand_to(worker)
                worker.run(handle_signals=False)
        announce(_stopped(orch.owner, signals), "worker_exited", owner=orch.owner)
        return EXIT_OK


@contextlib.contextmanager
def _unless_unreachable(url: str) -> Iterator[None]:
    """Raise what the block raises unless it says the database at `url` cannot be reached
    for now (see `saga.worker.unreachable`): the worker waits for that one."""
    try:
        yield
    except Exception as exc:
        if not unreachable(exc, url):
            raise


def _announce_ready(orch: Orchestrator | AsyncOrchestrator, concurrency: int) -> None:
    kinds = ", ".join(f"{s.name} v{s.version}" for s in orch.registered())
    door = " (asyncio)" if isinstance(orch, AsyncOrchestrator) else ""
    announce(
        f"worker {orch.owner}: driving {kinds} with concurrency {concurrency}{door} on "
        f"{describe_url(orch.database_url)}; SIGTERM or Ctrl-C stops it gracefully",
        "worker_ready",
        owner=orch.owner,
    )


def _stopped(owner: str, signals: _StopSignals) -> str:
    if signals.received is None:
        return f"worker {owner}: stopped"
    return f"worker {owner}: stopped ({signals.received})"


def _serve_metrics(host: str, port: int) -> None:
    """`saga worker --metrics-port`: serve the process's metrics for Prometheus (see
    `saga.telemetry.serve_prometheus`) before the worker starts."""
    from saga.telemetry import MetricsUnavailable, serve_prometheus

    try:
        bound = serve_prometheus(port, host)
    except MetricsUnavailable as exc:
        raise UsageError(f"--metrics-port: {exc}") from None
    except OSError as exc:
        raise UsageError(f"--metrics-port: cannot listen on {host or '*'}:{port}: {exc}") from None
    shown = f"[{host}]" if ":" in host else host or "0.0.0.0"
    announce(f"metrics for Prometheus at http://{shown}:{bound}/metrics", "metrics_serving")


async def _async_worker(
    orch: AsyncOrchestrator,
    concurrency: int,
    listen_url: str | None = None,
    *,
    signals: _StopSignals | None = None,
) -> int:
    """`saga worker` for an AsyncOrchestrator app: an AsyncWorker on this loop, stopped
    gracefully by SIGTERM or SIGINT; the orchestrator is closed before the loop ends."""
    with contextlib.ExitStack() as stack:
        if signals is None:
            signals = stack.enter_context(_StopSignals())
        stack.enter_context(signals.on_loop())
        try:
            # As for a sync app: refusals fail here, an unreachable database is waited for.
            with _unless_unreachable(orch.database_url):
                if signals.received is None:
                    await (await orch.store()).check_privileges("worker")
            if signals.received is None:
                _announce_ready(orch, concurrency)
                worker = orch.worker(concurrency=concurrency, listen_url=listen_url)
                signals.hand_to(worker)
                await worker.run(handle_signals=False)
        finally:
            await orch.close()
        announce(_stopped(orch.owner, signals), "worker_exited", owner=orch.owner)
    return EXIT_OK


def run_dashboard(args: argparse.Namespace) -> int:
    """`saga dashboard`: serve the dashboard until stopped."""
    try:
        # Imported here only: the dashboard's dependencies are an optional extra.
        from saga import web
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").partition(".")[0]
        if missing not in _WEB_MODULES:
            raise
        raise UsageError(
            f"the dashboard needs the web extra, and {missing} is not installed: {WEB_EXTRA}"
        ) from None
    # A signal while the command and the web framework were imported stops it cleanly.
    early = _early.take()
    if early is not None:
        announce(f"saga dashboard: stopped ({early.name})", "dashboard_stopped")
        return EXIT_OK
    try:
        web.serve(
            args.database_url,
            host=args.host,
            port=args.port,
            verbose=args.verbose,
            log_formatter=stdlib_formatter(),
            announce=announce,
        )
    except web.DashboardError as exc:
        raise UsageError(str(exc)) from None
    return EXIT_OK
