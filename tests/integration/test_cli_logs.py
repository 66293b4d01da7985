"""What `saga worker` (and the other commands) log on stderr, at which level and in which
format, and how a worker stops when a signal comes while it starts: the real `saga`
command in a subprocess, on a real PostgreSQL."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import cli_app
import httpx
import pytest
from cli_app import Job
from support import OrchestratorFactory, wait_until
from test_cli import Worker, _env, saga_cmd

pytestmark = [pytest.mark.integration]


def _drive_one(
    make_orch: OrchestratorFactory, database_url: str, app_dir: Path, *flags: str
) -> tuple[str, str]:
    """Start a saga, run `saga worker FLAGS` until it completes it, SIGTERM it: the saga's
    id and the worker's stderr (its stdout is empty)."""
    orch = make_orch(*cli_app.SAGAS)
    saga_id = orch.start(cli_app.parcel, Job(order_id="o-log")).id
    worker = Worker(database_url, app_dir, *flags)
    try:
        wait_until(lambda: orch.get(saga_id).status == "completed", timeout=30)
        code, err = worker.stop()
    finally:
        worker.kill()
    assert code == 0, err
    assert worker.out == "", worker.out
    return saga_id, err


@pytest.mark.parametrize(
    ("flags", "lifecycle", "events"),
    [
        ((), True, False),
        (("-v",), True, True),
        (("-q",), False, False),
    ],
    ids=["default", "verbose", "quiet"],
)
def test_worker_log_levels(
    make_orch: OrchestratorFactory,
    database_url: str,
    app_dir: Path,
    flags: tuple[str, ...],
    lifecycle: bool,
    events: bool,
) -> None:
    """By default a worker logs its lifecycle (`worker_started`, `worker_stopping`,
    `worker_stopped`) and warnings, not one line per event of every saga it drives; `-v`
    adds those (`attempt_succeeded`...); `-q` leaves warnings and errors only. Its own
    lines (what it drives, that it stopped) are there whatever the level. (`-v` used to
    change nothing, every event was logged, and `-q` was refused.)"""
    _, err = _drive_one(make_orch, database_url, app_dir, *flags)
    assert "Traceback" not in err, err
    assert "driving" in err and "stopped (SIGTERM)" in err, err
    assert ("worker_started" in err) is lifecycle, err
    assert ("worker_stopping" in err) is lifecycle, err
    assert ("attempt_succeeded" in err) is events, err
    assert ("saga_completed" in err) is events, err


def test_worker_logs_json_lines(
    make_orch: OrchestratorFactory, database_url: str, app_dir: Path
) -> None:
    """`--log-format json`: every line of stderr is one JSON object, with `event`,
    `level` and `timestamp`; a saga's events carry its fields and the logger
    `saga.events`; the worker's own lines are events too, the line in `message`."""
    saga_id, err = _drive_one(make_orch, database_url, app_dir, "-v", "--log-format", "json")
    records: list[dict[str, Any]] = [json.loads(line) for line in err.splitlines()]
    assert all({"event", "level", "timestamp"} <= r.keys() for r in records), err
    by_event = {r["event"]: r for r in records}
    assert "driving" in by_event["worker_ready"]["message"]
    assert by_event["worker_started"]["logger"] == "saga.worker"
    done = by_event["saga_completed"]
    assert done["saga_id"] == saga_id and done["logger"] == "saga.events"
    assert done["level"] == "info"
    assert "stopped" in by_event["worker_exited"]["message"]


def test_a_one_shot_command_logs_warnings_unless_verbose(
    make_orch: OrchestratorFactory, database_url: str, app_dir: Path
) -> None:
    """`saga cancel --run` drives the saga here: quiet on stderr by default, every event
    of it with `-v`."""
    orch = make_orch(*cli_app.SAGAS)
    ids = [orch.start(cli_app.parcel, Job(order_id=f"o-c{i}")).id for i in range(2)]
    common = ("--app", "cli_app", "--database-url", database_url, "--run", "--reason", "test")
    quiet = saga_cmd("cancel", *common, ids[0], app_dir=app_dir)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr == "", quiet.stderr
    loud = saga_cmd("cancel", *common, "-v", ids[1], app_dir=app_dir)
    assert loud.returncode == 0, loud.stderr
    assert "saga_compensated" in loud.stderr and ids[1] in loud.stderr, loud.stderr


@pytest.mark.parametrize("attr", ["orch", "aorch"], ids=["sync", "async"])
def test_a_worker_signalled_while_it_starts_stops_with_exit_0(
    make_orch: OrchestratorFactory, database_url: str, app_dir: Path, attr: str
) -> None:
    """SIGTERM while the worker still imports the app (a deployment replacing a worker it
    has just started): it exits 0 saying it stopped, and drives nothing. It used to be
    killed by the signal (exit -15)."""
    orch = make_orch(*cli_app.SAGAS)
    saga_id = orch.start(cli_app.parcel, Job(order_id="o-early")).id
    proc = subprocess.Popen(
        [sys.executable, "-m", "saga", "worker", "--app", f"cli_app_slow_start:{attr}"],
        env=_env(app_dir, SAGA_DATABASE_URL=database_url),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(lambda: (app_dir / "importing").exists() or proc.poll() is not None)
        proc.send_signal(signal.SIGTERM)
        (app_dir / "go").touch()
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert out == "", out
    assert "stopped (SIGTERM)" in err, err
    assert "driving" not in err and "Traceback" not in err, err
    assert orch.get(saga_id).status == "pending"
    assert orch.workers() == []


# Put first on PYTHONPATH, this holds the command while its own code (any `saga.` module
# but the package, its entry point and the signal handler it installs first) is imported:
# it creates `saga-importing` in CLI_APP_DIR, then waits for `saga-go` there. Python
# imports `sitecustomize` at start-up.
_HOLD_THE_IMPORT = """
import os, sys, time
from pathlib import Path

class Hold:
    def find_spec(self, name, path=None, target=None):
        if name.startswith("saga.") and name not in {"saga._entry", "saga._early", "saga.__main__"}:
            sys.meta_path.remove(self)
            state = Path(os.environ["CLI_APP_DIR"])
            (state / "saga-importing").touch()
            deadline = time.monotonic() + 30
            while not (state / "saga-go").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        return None

sys.meta_path.insert(0, Hold())
"""


def _signalled_while_saga_is_imported(
    app_dir: Path, saga: list[str], *args: str, **env: str
) -> tuple[int, str, str]:
    """Run `saga ARGS` (`saga` the command to run), SIGTERM it while it imports its own
    code, before the command runs: its exit code, stdout and stderr."""
    hook = app_dir / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_HOLD_THE_IMPORT)
    environ = _env(app_dir, **env)
    environ["PYTHONPATH"] = os.pathsep.join([str(hook), environ["PYTHONPATH"]])
    proc = subprocess.Popen(
        [*saga, *args], env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        wait_until(lambda: (app_dir / "saga-importing").exists() or proc.poll() is not None)
        proc.send_signal(signal.SIGTERM)
        (app_dir / "saga-go").touch()
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, out, err


_PYTHON_M_SAGA = [sys.executable, "-m", "saga"]


@pytest.mark.parametrize("command", ["module", "script"])
def test_a_worker_signalled_while_saga_is_imported_stops_with_exit_0(
    make_orch: OrchestratorFactory, database_url: str, app_dir: Path, command: str
) -> None:
    """SIGTERM in the first moment of `saga worker`, while the saga package itself is
    still being imported (about a second, before the command runs): it exits 0 saying it
    stopped, and drives nothing. It used to be killed by the signal (exit -15)."""
    orch = make_orch(*cli_app.SAGAS)
    saga_id = orch.start(cli_app.parcel, Job(order_id="o-boot")).id
    saga = _PYTHON_M_SAGA
    if command == "script":  # the console script `pip install` made
        saga = [str(Path(sys.executable).with_name("saga"))]
    code, out, err = _signalled_while_saga_is_imported(
        app_dir, saga, "worker", "--app", "cli_app:orch", SAGA_DATABASE_URL=database_url
    )
    assert code == 0, err
    assert out == "", out
    assert "stopped (SIGTERM)" in err, err
    assert "driving" not in err and "Traceback" not in err, err
    assert orch.get(saga_id).status == "pending"
    assert orch.workers() == []


def test_a_dashboard_signalled_while_saga_is_imported_stops_with_exit_0(
    database_url: str, app_dir: Path
) -> None:
    """The same for `saga dashboard`: exit 0, `stopped (SIGTERM)`, nothing served. It used
    to be killed by the signal (exit -15)."""
    code, out, err = _signalled_while_saga_is_imported(
        app_dir, _PYTHON_M_SAGA, "dashboard", "--port", "0", "--database-url", database_url
    )
    assert code == 0, err
    assert out == ""
    assert err == "saga dashboard: stopped (SIGTERM)\n"


def test_another_command_signalled_while_saga_is_imported_is_ended_by_it(
    database_url: str, app_dir: Path
) -> None:
    """A command that handles no signal (`saga list`) still ends by a SIGTERM that came
    while it started, as a supervisor expects of it, after doing nothing."""
    code, out, err = _signalled_while_saga_is_imported(
        app_dir, _PYTHON_M_SAGA, "list", "--database-url", database_url
    )
    assert code == -signal.SIGTERM, err
    assert out == err == ""


def test_dashboard_logs_json_on_stderr_only(database_url: str, tmp_path: Path) -> None:
    """`saga dashboard -v --log-format json`: its own lines and uvicorn's, one line per
    request included, are JSON objects on stderr; stdout stays empty. (uvicorn's request
    lines used to go to stdout, in its own format.)"""
    err_path = tmp_path / "stderr"
    with err_path.open("w") as err:
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "saga", "dashboard", "--port", "0", "-v"),
                *("--log-format", "json", "--database-url", database_url),
            ],
            env=_env(None),
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    try:
        found = wait_until(
            lambda: (
                re.search(r"http://127\.0\.0\.1:\d+/", err_path.read_text())
                or proc.poll() is not None
            ),
            timeout=60,
        )
        assert isinstance(found, re.Match), err_path.read_text()
        assert httpx.get(found.group(0), timeout=10).status_code == 200
        wait_until(lambda: '\\"GET / HTTP/1.1\\" 200' in err_path.read_text())
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err_path.read_text()
    assert out == "", out
    records = [json.loads(line) for line in err_path.read_text().splitlines()]
    by_event = {r["event"]: r for r in records}
    assert "dashboard_ready" in by_event and "dashboard_stopped" in by_event
    access = [r for r in records if r.get("logger") == "uvicorn.access"]
    assert access and access[0]["level"] == "info", records
