"""The `saga` command with an AsyncOrchestrator app (`--app cli_app_async`): `saga worker`
runs an AsyncWorker on an event loop, and the operator verbs run the app's coroutines."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import cli_app
import cli_app_async
import psycopg
import pytest
from cli_app import Job
from psycopg.conninfo import make_conninfo
from support import OrchestratorFactory, wait_until
from test_cli import _env, _one_line_error, _park_unknown, _rows, saga_cmd

APP = "cli_app_async:orch"


class AsyncWorkerCommand:
    """A `saga worker --app cli_app_async:orch` child process."""

    def __init__(self, database_url: str, app_dir: Path, **env: str) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "saga",
                "worker",
                "--app",
                APP,
                "--database-url",
                database_url,
                "--concurrency",
                "2",
            ],
            env=_env(app_dir, **env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def stop(self, signum: int = signal.SIGTERM, timeout: float = 30.0) -> tuple[int, str, str]:
        """Send `signum`; the exit code, stdout and stderr once it has exited."""
        self.proc.send_signal(signum)
        return self.wait(timeout)

    def wait(self, timeout: float = 30.0) -> tuple[int, str, str]:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
            raise AssertionError(f"worker did not stop within {timeout}s:\n{err}") from None
        return self.proc.returncode, out, err

    def kill(self) -> str:
        """SIGKILL it if it still runs; its stderr."""
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.communicate()[1] or ""

    def wait_for(self, predicate: Callable[[], object], what: str, timeout: float = 30.0) -> None:
        """Poll `predicate` while this worker runs; on timeout, kill it and fail with
        what it wrote on stderr."""
        try:
            wait_until(predicate, timeout=timeout)
        except AssertionError:
            err = self.kill()
            raise AssertionError(f"not within {timeout}s: {what}; worker stderr:\n{err}") from None


@pytest.fixture
def async_workers() -> Iterator[list[AsyncWorkerCommand]]:
    started: list[AsyncWorkerCommand] = []
    yield started
    for worker in started:
        worker.kill()


def _leases(url: str) -> list[tuple[str, str | None]]:
    with psycopg.connect(url) as conn:
        rows = conn.execute("SELECT id::text, lease_owner FROM saga.sagas ORDER BY id").fetchall()
    return [(str(i), o) for i, o in rows]


def _lease_live(url: str, saga_id: str) -> bool:
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT coalesce(lease_expires_at > now(), false) FROM saga.sagas WHERE id = %s",
            (saga_id,),
        ).fetchone()
    assert row is not None
    return bool(row[0])


def _calls_of(order_id: str) -> list[str]:
    return [name for name, order, _ in cli_app.calls() if order == order_id]


# ----- errors -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "verb",
    [["reconcile"], ["compensate", "--status", "needs_review"]],
    ids=["reconcile", "compensate"],
)
def test_async_app_on_an_unreachable_database_is_one_line(verb: list[str], app_dir: Path) -> None:
    """With an AsyncOrchestrator app too, an unreachable database is exit 1 and one line
    on stderr naming host and port, never the password, nothing on stdout. (A worker
    waits for it instead: `test_a_worker_waits_for_an_unreachable_database`.)"""
    url = "postgresql://ops:s3cret@127.0.0.1:1/nodb"
    result = saga_cmd(*verb, "--app", APP, "--database-url", url, app_dir=app_dir)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "127.0.0.1:1" in _one_line_error(result)
    assert "s3cret" not in result.stderr + result.stdout
    assert result.stdout == ""


@pytest.mark.parametrize("app", ["cli_app:orch", APP], ids=["sync", "async"])
def test_a_worker_waits_for_an_unreachable_database(
    app: str, app_dir: Path, tmp_path: Path
) -> None:
    """`saga worker` on a database it cannot reach does not exit on its own: it logs each
    try (`worker_database_unreachable`, host and port, never the password), backing off,
    until SIGTERM stops it with exit 0. (It used to exit 1 at once.)"""
    url = "postgresql://ops:s3cret@127.0.0.1:1/nodb"
    err_path = tmp_path / "stderr"
    with err_path.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "saga", "worker", "--app", app, "--database-url", url],
            env=_env(app_dir),
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
        try:
            wait_until(
                lambda: (
                    proc.poll() is not None
                    or err_path.read_text().count("worker_database_unreachable") >= 2
                ),
                timeout=30,
            )
            assert proc.poll() is None, err_path.read_text()
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    logged = err_path.read_text()
    assert proc.returncode == 0, logged
    assert "127.0.0.1:1" in logged and "Traceback" not in logged, logged
    assert "s3cret" not in logged + out


def test_a_worker_on_a_database_that_refuses_it_fails_at_once(
    app_dir: Path, database_url: str
) -> None:
    """A refusal is no outage: a worker given a database that does not exist exits 1 with
    one line naming it, as before."""
    url = make_conninfo(database_url, dbname="no_such_saga_db")
    result = saga_cmd("worker", "--app", APP, "--database-url", url, app_dir=app_dir)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "no_such_saga_db" in _one_line_error(result)


def test_an_app_attribute_that_is_no_orchestrator_is_a_usage_error(app_dir: Path) -> None:
    """--app naming something else of the module (a Saga) is exit 2, saying what it is."""
    result = saga_cmd("worker", "--app", "cli_app_async:relay", app_dir=app_dir)
    assert result.returncode == 2
    assert "is a Saga, not an Orchestrator or an AsyncOrchestrator" in _one_line_error(result)


# ----- saga worker --------------------------------------------------------------------


def test_async_worker_drives_sagas_and_stops_on_sigterm(
    make_orch: OrchestratorFactory,
    database_url: str,
    app_dir: Path,
    async_workers: list[AsyncWorkerCommand],
) -> None:
    """`saga worker` with an AsyncOrchestrator app runs an AsyncWorker: it completes sync
    and async sagas (async steps awaited on its loop, in its main thread), each step once;
    SIGTERM stops it with exit 0, no lease held and its worker row gone; the library prints
    nothing on stdout (its announcement and logs go to stderr)."""
    orch = make_orch(*cli_app_async.ASYNC_SAGAS)
    started = {
        "o-a1": orch.start(cli_app.shop, Job(order_id="o-a1")).id,
        "o-a2": orch.start(cli_app.parcel, Job(order_id="o-a2")).id,
        "o-a3": orch.start(cli_app_async.relay, Job(order_id="o-a3")).id,
        "o-a4": orch.start(cli_app_async.relay, Job(order_id="o-a4")).id,
    }
    worker = AsyncWorkerCommand(database_url, app_dir)
    async_workers.append(worker)
    worker.wait_for(
        lambda: all(orch.get(i).status == "completed" for i in started.values()),
        "every saga completed",
        timeout=60,
    )
    worker.wait_for(lambda: len(orch.workers()) == 1, "the worker announced", timeout=10)

    code, out, err = worker.stop(signal.SIGTERM)
    assert code == 0, err
    assert out == "", out
    assert "Traceback" not in err, err
    assert "(asyncio)" in err and "stopped" in err, err
    assert all(owner is None for _, owner in _leases(database_url))
    assert orch.workers() == []

    expected = {
        "o-a1": ["reserve", "charge", "ship", "notify"],
        "o-a2": ["label", "pack", "dispatch"],
        "o-a3": ["fetch", "fetch-on-loop", "forward"],
        "o-a4": ["fetch", "fetch-on-loop", "forward"],
    }
    for order_id, names in expected.items():
        assert _calls_of(order_id) == names, order_id
    assert {pid for _, _, pid in cli_app.calls()} == {worker.proc.pid}


def test_async_worker_sigterm_lets_the_attempt_finish_and_hands_the_saga_back(
    make_orch: OrchestratorFactory,
    database_url: str,
    app_dir: Path,
    async_workers: list[AsyncWorkerCommand],
) -> None:
    """SIGTERM while a step is in flight: the AsyncWorker lets the attempt finish, records
    it, gives the lease back and exits 0, without starting the next step; a second async
    worker finishes the saga and stops on SIGINT with exit 0. No step ran twice."""
    orch = make_orch(*cli_app_async.ASYNC_SAGAS)
    saga_id = orch.start(cli_app.parcel, Job(order_id="o-g")).id
    first = AsyncWorkerCommand(database_url, app_dir, CLI_APP_BLOCK="gate")
    async_workers.append(first)
    first.wait_for(lambda: "pack-waiting" in _calls_of("o-g"), "pack waiting at the gate")

    first.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    (app_dir / "gate").touch()
    code, out, err = first.wait()
    assert code == 0, err
    assert out == "", out
    state = orch.get(saga_id)
    assert state.lease_owner is None, f"lease still held by {state.lease_owner}"
    assert state.status != "completed"
    assert state.operation("pack").status == "succeeded"
    assert "dispatch" not in _calls_of("o-g")

    second = AsyncWorkerCommand(database_url, app_dir)
    async_workers.append(second)
    second.wait_for(lambda: orch.get(saga_id).status == "completed", "the saga completed")
    code, out, err = second.stop(signal.SIGINT)
    assert code == 0, err
    assert out == "", out
    pids = {name: pid for name, _, pid in cli_app.calls()}
    assert pids["label"] == first.proc.pid
    assert pids["dispatch"] == second.proc.pid
    assert Counter(_calls_of("o-g")) == Counter(
        {"label": 1, "pack": 1, "pack-waiting": 1, "dispatch": 1}
    )


# ----- operator verbs -----------------------------------------------------------------


def test_reconcile_with_an_async_app_settles_through_sync_and_async_hooks(
    make_orch: OrchestratorFactory,
    database_url: str,
    app_dir: Path,
    async_workers: list[AsyncWorkerCommand],
) -> None:
    """An AsyncWorker SIGKILLed mid-step leaves a sync step (`pack`) and an async one
    (`forward`) running; `saga reconcile --app cli_app_async` settles both through their
    reconcile hooks (the sync one, and the coroutine awaited on the command's loop), the
    sagas complete, and neither step is called again."""
    orch = make_orch(*cli_app_async.ASYNC_SAGAS)
    parcel = orch.start(cli_app.parcel, Job(order_id="o-s")).id
    relay = orch.start(cli_app_async.relay, Job(order_id="o-v")).id
    crashed = AsyncWorkerCommand(database_url, app_dir, CLI_APP_BLOCK="hang_after")
    async_workers.append(crashed)
    crashed.wait_for(
        lambda: {"pack-packed", "forward-sent"} <= {c[0] for c in cli_app.calls()},
        "both steps in flight",
    )
    crashed.proc.kill()
    crashed.proc.wait(timeout=10)
    wait_until(
        lambda: not _lease_live(database_url, parcel) and not _lease_live(database_url, relay)
    )

    result = saga_cmd("reconcile", "--app", APP, "--database-url", database_url, app_dir=app_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 selected: 2 done, 0 parked, 0 skipped" in result.stdout.splitlines()[-1]
    for saga_id in (parcel, relay):
        assert orch.get(saga_id).status == "completed"
    assert orch.get(parcel).operation("pack").provider_reference == "p_o-s"
    assert orch.get(relay).operation("forward").provider_reference == "fw_o-v"
    assert _calls_of("o-s").count("pack") == 1 and "find_parcel" in _calls_of("o-s")
    assert _calls_of("o-v").count("forward") == 1 and "find_forward" in _calls_of("o-v")
    assert all(owner is None for _, owner in _leases(database_url))


def test_compensate_resolve_retry_and_cancel_run_an_async_app(
    make_orch: OrchestratorFactory, database_url: str, app_dir: Path
) -> None:
    """The verbs that run user code work with an AsyncOrchestrator app: a dry run changes
    nothing, the batch compensation undoes in reverse, resolve and retry drive their saga
    to completion with --run, cancel compensates an async saga's coroutine compensation;
    every call is made once, by the command's process."""
    orch = make_orch(*cli_app_async.ASYNC_SAGAS)
    base = ["--app", APP, "--database-url", database_url]

    first, second = _park_unknown(orch, "o-1"), _park_unknown(orch, "o-2")
    batch = ["compensate", *base, "--status", "needs_review", "--include-unknown"]
    before = _rows(database_url)
    dry = saga_cmd(*batch, "--dry-run", app_dir=app_dir)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert _rows(database_url) == before
    done = saga_cmd(*batch, "--actor", "oncall", app_dir=app_dir)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 selected: 2 done, 0 parked, 0 skipped" in done.stdout
    for saga_id, order_id in ((first, "o-1"), (second, "o-2")):
        assert orch.get(saga_id).status == "compensated"
        assert [n for n in _calls_of(order_id) if n in ("refund", "release")] == [
            "refund",
            "release",
        ]

    resolved = _park_unknown(orch, "o-r")
    result = saga_cmd(
        "resolve",
        *base,
        resolved,
        "charge",
        "--succeeded",
        "--result",
        '{"charge_id": "ch_manual"}',
        "--actor",
        "alice",
        "--run",
        app_dir=app_dir,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert orch.get(resolved).status == "completed"
    assert _calls_of("o-r") == ["reserve", "charge", "ship", "notify"]

    broken = orch.start(cli_app.shop, Job(order_id="o-t", plan="broken_notify")).id
    assert orch.run(broken).status == "needs_review"
    (app_dir / "fixed").touch()
    retried = saga_cmd("retry", *base, broken, "--extra-attempts", "1", "--run", app_dir=app_dir)
    assert retried.returncode == 0, retried.stdout + retried.stderr
    assert orch.get(broken).status == "completed"
    assert _calls_of("o-t").count("notify") == 2

    # fetch succeeds here; forward waits for a confirmation: cancel undoes fetch, with the
    # coroutine compensation awaited on the command's loop.
    relay = orch.start(cli_app_async.relay, Job(order_id="o-c", plan="confirm")).id
    assert orch.run(relay).status == "awaiting_confirmation"
    cancelled = saga_cmd(
        "cancel",
        *base,
        relay,
        "--reason",
        "customer asked",
        "--actor",
        "carol",
        "--run",
        app_dir=app_dir,
    )
    assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
    state = orch.get(relay)
    assert state.status == "compensated"
    assert state.error == "cancelled by carol: customer asked"
    assert [n for n in _calls_of("o-c") if n != "fetch-on-loop"] == ["fetch", "unfetch"]

    # What the verbs ran was run by the commands' processes, not here.
    by_command = [
        ("o-1", "refund"),
        ("o-1", "release"),
        ("o-2", "refund"),
        ("o-2", "release"),
        ("o-r", "ship"),
        ("o-r", "notify"),
        ("o-c", "unfetch"),
    ]
    pids = {(order, name): pid for name, order, pid in cli_app.calls()}
    assert all(pids[call] != os.getpid() for call in by_command)
    assert [pid != os.getpid() for n, o, pid in cli_app.calls() if (n, o) == ("notify", "o-t")] == [
        False,
        True,
    ]
