"""The embedded PostgreSQL shared by processes: the last live client stops it, even after
other clients were SIGKILLed. Every client is a real child process."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import psycopg
import pytest

from saga._db.embedded import CLIENTS_FILE, Client, read_clients

pytestmark = [pytest.mark.integration, pytest.mark.crash]

CLIENT = Path(__file__).resolve().parent / "embedded_client.py"


class ClientProcess:
    """A child process attached to the embedded server in `data_dir`."""

    def __init__(self, data_dir: Path) -> None:
        env = {k: v for k, v in os.environ.items() if k != "SAGA_DATABASE_URL"}
        env["SAGA_EMBEDDED_DIR"] = str(data_dir)
        self.proc = subprocess.Popen(
            [sys.executable, str(CLIENT)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("READY "):
            self.proc.kill()
            _, err = self.proc.communicate(timeout=30)
            raise AssertionError(f"the client did not attach: {line!r}\n{err}")
        self.url = line.split(" ", 1)[1].strip()

    def kill(self) -> None:
        """SIGKILL, and reap it: no exit handler of the client runs."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.communicate(timeout=30)

    def exit(self) -> None:
        """Let the client exit normally (its exit handlers run) and check it did."""
        _, err = self.proc.communicate("\n", timeout=60)
        assert self.proc.returncode == 0, err


def postmaster_pid(data_dir: Path) -> int | None:
    """The PID in `postmaster.pid`, if that process runs; None once the server stopped."""
    pid_file = data_dir / "postmaster.pid"
    try:
        pid = int(pid_file.read_text().splitlines()[0])
    except (FileNotFoundError, IndexError, ValueError):
        return None
    try:
        running = psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return None
    return pid if running else None


def wait_stopped(data_dir: Path, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while postmaster_pid(data_dir) is not None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def answers(url: str) -> bool:
    with psycopg.connect(url, connect_timeout=5) as conn:
        row = conn.execute("SELECT 1").fetchone()
    return row == (1,)


@pytest.fixture(scope="module")
def data_dir() -> Iterator[Path]:
    """A data directory of these tests only (initialised once), stopped and removed after."""
    root = Path(tempfile.mkdtemp(prefix="saga-test-shared-"))
    pgdata = root / "pgdata"
    try:
        yield pgdata
    finally:
        pid = postmaster_pid(pgdata)
        if pid is not None:  # a test failed with the server left running: stop it
            os.kill(pid, signal.SIGINT)
            wait_stopped(pgdata)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def clients() -> Iterator[list[ClientProcess]]:
    started: list[ClientProcess] = []
    yield started
    for client in started:
        if client.proc.poll() is None:
            client.kill()


def test_the_last_live_client_stops_the_server_after_two_were_killed(
    data_dir: Path, clients: list[ClientProcess]
) -> None:
    """Three clients share one server; two are SIGKILLed, the third exits normally: the
    server stops (its postmaster is gone, `postmaster.pid` removed by a clean shutdown)."""
    for _ in range(3):
        clients.append(ClientProcess(data_dir))
    first, second, last = clients
    assert first.url == second.url == last.url
    server = postmaster_pid(data_dir)
    assert server is not None
    first.kill()
    second.kill()
    assert postmaster_pid(data_dir) == server, "killing clients must not stop the server"
    assert answers(last.url)
    last.exit()
    assert wait_stopped(data_dir), (
        f"the server (postmaster {server}) still runs after its last live client exited"
    )
    assert not (data_dir / "postmaster.pid").exists()


def test_a_live_client_keeps_the_server_while_others_are_killed_or_exit(
    data_dir: Path, clients: list[ClientProcess]
) -> None:
    """A killed client and one that exits normally leave the server to the live client,
    which still queries it; when that one exits, the server stops."""
    keeper = ClientProcess(data_dir)
    clients.append(keeper)
    killed = ClientProcess(data_dir)
    clients.append(killed)
    server = postmaster_pid(data_dir)
    assert server is not None
    killed.kill()
    leaving = ClientProcess(data_dir)
    clients.append(leaving)
    leaving.exit()
    time.sleep(0.5)
    assert postmaster_pid(data_dir) == server, "the server stopped under a live client"
    assert answers(keeper.url)
    keeper.exit()
    assert wait_stopped(data_dir), f"the server (postmaster {server}) still runs"


def test_a_killed_last_client_leaves_the_server_to_the_next_one(
    data_dir: Path, clients: list[ClientProcess]
) -> None:
    """What a crash leaves: the only client is SIGKILLed, nobody stops the server; the next
    client reuses that server (same postmaster) and stops it when it exits."""
    crashed = ClientProcess(data_dir)
    clients.append(crashed)
    server = postmaster_pid(data_dir)
    crashed.kill()
    time.sleep(0.5)
    assert postmaster_pid(data_dir) == server
    nxt = ClientProcess(data_dir)
    clients.append(nxt)
    assert postmaster_pid(data_dir) == server, "the next client started another server"
    nxt.exit()
    assert wait_stopped(data_dir), f"the server (postmaster {server}) still runs"


def test_a_reused_pid_is_not_taken_for_a_live_client(
    data_dir: Path, clients: list[ClientProcess]
) -> None:
    """A killed client's PID given to an unrelated process (its start time differs) does not
    keep the server running."""
    killed = ClientProcess(data_dir)
    clients.append(killed)
    server = postmaster_pid(data_dir)
    (record,) = read_clients(data_dir)
    assert record.pid == killed.proc.pid and record.is_live()
    killed.kill()
    time.sleep(0.1)  # the new owner of the PID starts later (ticks are 10 ms)
    unrelated = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        # As if the system had given the killed client's PID to `unrelated`.
        reused = Client(unrelated.pid, record.started)
        assert not reused.is_live()
        (data_dir / CLIENTS_FILE).write_text(
            json.dumps([{"pid": unrelated.pid, "started": record.started}])
        )
        last = ClientProcess(data_dir)
        clients.append(last)
        last.exit()
        assert wait_stopped(data_dir), f"the server (postmaster {server}) still runs"
    finally:
        unrelated.kill()
        unrelated.wait()


def test_client_records_tell_live_dead_zombie_and_reused() -> None:
    """A record is live only for a running, non-zombie process started when recorded."""
    me = Client.this_process()
    assert me.is_live()
    assert Client(me.pid, None).is_live()
    assert me.started is not None
    assert not Client(me.pid, me.started - 100).is_live()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert not Client(child.pid, None).is_live(), "an unreaped child is not a live client"
    child.wait()
    assert not Client(child.pid, None).is_live()


REPO = Path(__file__).resolve().parents[2]


def _make(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`make ARGS` in this checkout with this interpreter's environment as the venv (never
    reinstalled: its stamp is taken as up to date)."""
    venv = Path(sys.prefix)
    stamp = venv / "bin" / ".installed-demo"
    command = ["make", "--no-print-directory", f"VENV={venv}", "-o", str(stamp), *args]
    return subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False
    )


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_demo_uses_a_data_directory_of_its_own() -> None:
    """`make demo` with a user's `SAGA_EMBEDDED_DIR` (and `SAGA_DATABASE_URL`) set runs on
    the demo's own data directory: the user's stays untouched, and the demo's server is
    stopped when the demo exits. By default that directory is `.demo-pgdata` here."""
    dry = _make("-n", "demo", env={k: v for k, v in os.environ.items() if k != "DEMO_PGDATA"})
    assert dry.returncode == 0, dry.stderr
    assert f"SAGA_EMBEDDED_DIR='{REPO / '.demo-pgdata'}'" in dry.stdout

    root = Path(tempfile.mkdtemp(prefix="saga-test-demo-"))
    try:
        users_dir = root / "app-pgdata"
        demo_dir = root / "demo-pgdata"
        env = {
            **os.environ,
            "SAGA_EMBEDDED_DIR": str(users_dir),
            "SAGA_DATABASE_URL": "postgresql://nobody@127.0.0.1:1/not-the-demo",
            "XDG_DATA_HOME": str(root / "xdg"),
        }
        proc = _make(f"DEMO_PGDATA={demo_dir}", "demo", env=env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert proc.stdout.rstrip().endswith("All three scenes ended as told.")
        assert (demo_dir / "PG_VERSION").exists(), "the demo did not use its own directory"
        assert not users_dir.exists(), "the demo touched the user's SAGA_EMBEDDED_DIR"
        assert not (root / "xdg").exists(), "the demo touched the user data directory"
        assert wait_stopped(demo_dir), "the demo's server still runs after the demo"
    finally:
        pid = postmaster_pid(root / "demo-pgdata")
        if pid is not None:
            os.kill(pid, signal.SIGINT)
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0,
    reason="as root only: the server then runs as another system user",
)
def test_the_last_client_stops_the_server_even_where_pg_ctl_cannot_reach_it() -> None:
    """Run as root, the server's system user may lose access to the directory's parents
    (another process tightened their mode): pg_ctl stop fails, the postmaster is sent
    the fast-shutdown signal instead and the server stops all the same."""
    from saga._db import embedded

    root = Path(tempfile.mkdtemp(prefix="saga-test-locked-"))
    pgdata = root / "pgdata"
    try:
        url = embedded.attach(pgdata)
        assert answers(url)
        server = postmaster_pid(pgdata)
        root.chmod(0o700)  # the server's system user can no longer traverse to pgdata
        assert embedded.detach(pgdata)
        assert server is not None and not psutil.pid_exists(server)
    finally:
        pid = postmaster_pid(pgdata)
        if pid is not None:
            os.kill(pid, signal.SIGINT)
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.skipif(Path("/var/run/docker.sock").exists(), reason="would use a container")
def test_a_server_whose_directory_was_removed_is_still_stopped_at_exit() -> None:
    """`postgres_server()` without a directory removes its temporary directory when the
    block ends, under the running server; the process's exit still stops that server."""
    script = (
        "from pathlib import Path\n"
        "from saga.testing import postgres_server\n"
        "with postgres_server() as url:\n"
        "    pgdata = Path(url.split('host=')[1])  # the socket is in the data directory\n"
        "    print('PID', (pgdata / 'postmaster.pid').read_text().split()[0], flush=True)\n"
        "assert not pgdata.exists()\n"
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("SAGA_TEST_DATABASE_URL", "SAGA_DATABASE_URL", "DOCKER_HOST")
    }
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pid = int(proc.stdout.split("PID ")[1].split()[0])
    # Well before PostgreSQL's own check of its lock file (each minute) would stop it.
    deadline = time.monotonic() + 10
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"the postmaster {pid} still runs"
        time.sleep(0.1)
