"""`saga dashboard`: the dashboard served by uvicorn on one address until SIGINT or
SIGTERM."""

from __future__ import annotations

import contextlib
import copy
import ipaddress
import logging
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn
import uvicorn.config

from saga._db.database import describe_url
from saga.orchestrator import Orchestrator
from saga.web.app import LOOPBACK_HOSTS, create_app

# How long open pages' streams may take to end once the server is told to stop (seconds).
_GRACE_SECONDS = 2


class DashboardError(Exception):
    """The dashboard cannot be served as asked (the message says why and what to do)."""


class _Server(uvicorn.Server):
    """uvicorn's server, stopped by SIGINT or SIGTERM as `saga worker` is: it shuts down
    gracefully and `serve` returns (uvicorn would raise the signal again once stopped)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine only (`127.0.0.1`, `::1`, `localhost`)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_names(host: str, bound: str) -> tuple[str, ...]:
    """The `Host` names a dashboard on loopback address `host` (bound as `bound`)
    answers to: the usual loopback names, and the address it was asked to listen on as
    a browser writes it (`127.0.0.2`, `[::1]`); any other name is refused."""
    names = [*LOOPBACK_HOSTS, _url_host(host.strip("[]").lower()), _url_host(bound)]
    return tuple(dict.fromkeys(names))


def _url_host(address: str) -> str:
    """An address as a URL's host (an IPv6 address in brackets)."""
    return f"[{address}]" if ":" in address else address


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on `host`:`port` (port 0: any free port); `DashboardError`
    when the address cannot be had."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise DashboardError(f"--host {host!r} is not an address to listen on: {exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise DashboardError(
            f"cannot listen on {host} port {port}: {exc.strerror or exc}; "
            "pass another --port (or --port 0 for any free one)"
        ) from None
    sock.set_inheritable(True)
    return sock


def serve(
    database_url: str | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 8080,
    verbose: bool = False,
    poll_seconds: float = 1.0,
    log_formatter: logging.Formatter | None = None,
    announce: Callable[..., None] | None = None,
) -> None:
    """Serve the read-only dashboard of the sagas in `database_url` (else
    `SAGA_DATABASE_URL`, else the embedded PostgreSQL) on `host`:`port` until SIGINT or
    SIGTERM. The database is checked first: unreachable, or without the saga schema, it
    raises that error before anything listens.

    uvicorn's logs go to stderr: warnings, and with `verbose` its info and one line per
    request, formatted by `log_formatter` (else uvicorn's). Its own lines (where it
    listens, that it stopped) are `announce(line, event, level=...)` (else printed on
    stderr)."""
    say = announce or _print
    with Orchestrator(database_url, auto_migrate=False, pool_size=2) as probe:
        probe.list(limit=1)
        url = probe.database_url
    sock = bind(host, port)
    local = is_loopback(host)
    bound_host, bound_port = sock.getsockname()[:2]
    shown = _url_host(bound_host)
    app = create_app(
        url,
        poll_seconds=poll_seconds,
        allowed_hosts=host_names(host, bound_host) if local else None,
    )
    say(
        f"saga dashboard: http://{shown}:{bound_port}/ (read-only) showing the sagas of "
        f"{describe_url(url)}; Ctrl-C or SIGTERM stops it",
        "dashboard_ready",
    )
    if not local:
        say(
            f"saga dashboard: warning: listening on {host}, not on this machine only; the "
            "dashboard has no login, so whoever can reach it sees every saga's input and "
            "results",
            "dashboard_exposed",
            level="warning",
        )
    config = uvicorn.Config(
        app,
        log_config=_log_config(log_formatter),
        log_level="info" if verbose else "warning",
        access_log=verbose,
        timeout_graceful_shutdown=_GRACE_SECONDS,
        lifespan="on",
    )
    try:
        _Server(config).run(sockets=[sock])
    finally:
        sock.close()
    say("saga dashboard: stopped", "dashboard_stopped")


def _print(text: str, event: str, **fields: object) -> None:
    print(text, file=sys.stderr, flush=True)


def _log_config(formatter: logging.Formatter | None) -> dict[str, Any]:
    """uvicorn's logging configuration with every log on stderr (its access log is on
    stdout by default), formatted by `formatter` when given."""
    config: dict[str, Any] = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    config["handlers"]["access"]["stream"] = "ext://sys.stderr"
    if formatter is not None:
        config["formatters"] = {"given": {"()": lambda: formatter}}
        for handler in config["handlers"].values():
            handler["formatter"] = "given"
    return config
