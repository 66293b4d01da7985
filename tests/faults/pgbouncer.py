"""A real PgBouncer in transaction mode in front of a test PostgreSQL, as a child process.

Debian's `pgbouncer` package (`apt-get install pgbouncer`, which `.ci/run` does when it is
missing) installs the binary as /usr/sbin/pgbouncer. PgBouncer refuses to run as root:
started by root, it is given `-u` and a system user to run as (the owner of the server's
socket directory, else `postgres`, else `nobody`), and its files are in a directory that
user can read.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

from psycopg.conninfo import conninfo_to_dict, make_conninfo

# Set by `.ci/run`: a missing pgbouncer fails the tests that need it instead of skipping them.
ENV_REQUIRE = "SAGA_TEST_REQUIRE_PGBOUNCER"


def find_pgbouncer() -> str | None:
    """The pgbouncer executable: on PATH, else where Debian installs it; None if neither."""
    found = shutil.which("pgbouncer")
    if found:
        return found
    for candidate in ("/usr/sbin/pgbouncer", "/usr/local/sbin/pgbouncer"):
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _quoted(value: str) -> str:
    return '"' + value.replace('"', '""') + '"'


class PgBouncer:
    """PgBouncer listening on 127.0.0.1 (a free port), pooling in `pool_mode` every
    database of the server `server_url` names, with the URL's user and password.

    Clients are trusted (`auth_type = trust`); PgBouncer logs in to PostgreSQL with the
    user and password of `server_url`, written to its `auth_file`.
    """

    def __init__(
        self,
        server_url: str,
        *,
        executable: str | None = None,
        pool_mode: str = "transaction",
        default_pool_size: int = 20,
    ) -> None:
        exe = executable or find_pgbouncer()
        if exe is None:
            raise FileNotFoundError(
                "pgbouncer is not installed (Debian: apt-get install pgbouncer)"
            )
        self.executable = exe
        self.server_url = server_url
        self.pool_mode = pool_mode
        self.default_pool_size = default_pool_size
        self.port = 0
        self.directory: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    # ----- life cycle ----------------------------------------------------------------------

    def start(self) -> PgBouncer:
        params = conninfo_to_dict(self.server_url)
        user = str(params.get("user") or "postgres")
        password = str(params.get("password") or "")
        host = str(params.get("host") or "127.0.0.1")
        server_port = str(params.get("port") or "5432")
        directory = Path(tempfile.mkdtemp(prefix="saga-pgbouncer-"))
        directory.chmod(0o755)  # readable by the user it runs as
        self.directory = directory
        self.port = _free_port()
        (directory / "users.txt").write_text(f"{_quoted(user)} {_quoted(password)}\n")
        (directory / "pgbouncer.ini").write_text(
            "\n".join(
                [
                    "[databases]",
                    f"* = host={host} port={server_port}",
                    "",
                    "[pgbouncer]",
                    "listen_addr = 127.0.0.1",
                    f"listen_port = {self.port}",
                    "unix_socket_dir =",
                    "auth_type = trust",
                    f"auth_file = {directory / 'users.txt'}",
                    f"admin_users = {user}",
                    f"pool_mode = {self.pool_mode}",
                    "max_client_conn = 2000",
                    f"default_pool_size = {self.default_pool_size}",
                    "server_lifetime = 3600",
                    # After a failed login to the server (a restart), clients are turned
                    # away for this long (default 15 s): the harness restarts it on purpose.
                    "server_login_retry = 1",
                    "",
                ]
            )
        )
        for path in directory.iterdir():
            path.chmod(0o644)
        command = [self.executable]
        if os.geteuid() == 0:
            command += ["-u", _unprivileged_user(host)]
        command.append(str(directory / "pgbouncer.ini"))
        log = (directory / "pgbouncer.log").open("wb")
        self._proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + 15.0
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise RuntimeError(f"pgbouncer exited with {self._proc.returncode}:\n{self.log()}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5),
            ):
                return
            time.sleep(0.05)
        raise RuntimeError(f"pgbouncer did not listen on port {self.port}:\n{self.log()}")

    def stop(self) -> None:
        """Shut PgBouncer down (SIGTERM, then SIGKILL) and remove its directory."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self._proc = None
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None

    def __enter__(self) -> PgBouncer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ----- use -----------------------------------------------------------------------------

    def url_for(self, url: str) -> str:
        """`url` (a database of the same server) as reached through this PgBouncer."""
        return make_conninfo(url, host="127.0.0.1", port=str(self.port))

    @property
    def admin_url(self) -> str:
        """The admin console (`SHOW POOLS`, `SHOW STATS`...)."""
        return self.url_for(make_conninfo(self.server_url, dbname="pgbouncer"))

    def log(self) -> str:
        if self.directory is None:
            return ""
        path = self.directory / "pgbouncer.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""


def _unprivileged_user(host: str) -> str:
    """Who runs PgBouncer when root starts it: the owner of the server's socket directory
    when `host` is one (an embedded server's data directory admits only its own user),
    else `postgres`, else `nobody`."""
    if host.startswith("/"):
        with contextlib.suppress(OSError, KeyError):
            owner = pwd.getpwuid(os.stat(host).st_uid)
            if owner.pw_uid != 0:
                return owner.pw_name
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            pwd.getpwnam(name)
            return name
    raise RuntimeError("no unprivileged system user (postgres, nobody) to run pgbouncer as")
