"""The `saga` command, run for real in a subprocess against a real PostgreSQL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cli_app
import psycopg
import pytest
from cli_app import Job
from support import OrchestratorFactory, events, wait_until

from saga import Orchestrator

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def _env(app_dir: Path | None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SAGA_", "CLI_APP_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(ROOT)])
    if app_dir is not None:
        env[cli_app.ENV_DIR] = str(app_dir)
    env.update(extra)
    return env


def saga_cmd(
    *args: str, app_dir: Path | None = None, timeout: float = 60.0, **env: str
) -> subprocess.CompletedProcess[str]:
    """Run `python -m saga ARGS` to completion."""
    return subprocess.run(
        [sys.executable, "-m", "saga", *args],
        env=_env(app_dir, **env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _rows(url: str) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of the saga tables, to compare before and after a command."""
    out: dict[str, list[tuple[Any, ...]]] = {}
    with psycopg.connect(url) as conn:
        for table, order in (
            ("sagas", "id"),
            ("operations", "saga_id, kind, step"),
            ("events", "id"),
        ):
            query = f"SELECT * FROM saga.{table} ORDER BY {order}"
            out[table] = conn.execute(query.encode()).fetchall()
    return out


def _one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


def _park_unknown(orch: Orchestrator, order_id: str) -> str:
    saga_id = orch.start(cli_app.shop, Job(order_id=order_id, plan="unknown")).id
    state = orch.run(saga_id)
    assert state.status == "needs_review"
    assert state.operation("charge").status == "unknown"
    return saga_id


# ----- usage and errors --------------------------------------------------------------


def test_help_documents_exit_codes() -> None:
    """`saga --help` lists every command and the exit codes."""
    result = saga_cmd("--help")
    assert result.returncode == 0
    for word in ("migrate", "worker", "list", "show", "compensate", "resolve", "retry"):
        assert word in result.stdout
    assert "cancel" in result.stdout and "reconcile" in result.stdout
    assert "exit codes:" in result.stdout
    assert "0  done" in result.stdout and "2  usage error" in result.stdout


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["frobnicate"],
        ["list", "--older-than", "5 parsecs"],
        ["list", "--status", "sleeping"],
        ["worker"],
        ["worker", "--app", "no_such_module_here"],
        ["worker", "--app", "cli_app:nothing"],
        ["compensate", "--app", "cli_app"],
        [
            "compensate",
            "--app",
            "cli_app",
            "00000000-0000-0000-0000-000000000000",
            "--status",
            "needs_review",
        ],
        [
            "resolve",
            "--app",
            "cli_app",
            "00000000-0000-0000-0000-000000000000",
            "charge",
            "--failed",
        ],
        [
            "resolve",
            "--app",
            "cli_app",
            "00000000-0000-0000-0000-000000000000",
            "charge",
            "--succeeded",
            "--result",
            "{not json",
        ],
        ["retry", "--app", "cli_app", "x", "--extra-attempts", "-1"],
        ["cancel", "--app", "cli_app", "x"],
    ],
)
def test_usage_errors_exit_2(args: list[str], app_dir: Path) -> None:
    """Bad arguments, a missing or wrong --app: exit 2 with one line on stderr."""
    result = saga_cmd(*args, app_dir=app_dir)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") <= 2, result.stderr
    assert "Traceback" not in result.stderr


def test_unreachable_database_is_one_line_naming_host_and_port() -> None:
    """An unreachable database: exit 1, one line with host:port, never the password."""
    url = "postgresql://ops:s3cret@127.0.0.1:1/nodb"
    result = saga_cmd("list", "--database-url", url)
    assert result.returncode == 1
    line = _one_line_error(result)
    assert "127.0.0.1:1" in line
    assert "s3cret" not in result.stderr + result.stdout


def test_read_commands_do_not_migrate(empty_database_url: str) -> None:
    """list on a database without the schema says to run `saga migrate`; migrate then works."""
    before = saga_cmd("list", "--database-url", empty_database_url)
    assert before.returncode == 1
    assert "saga migrate" in _one_line_error(before)
    migrate = saga_cmd("migrate", "--database-url", empty_database_url)
    assert migrate.returncode == 0 and "applied migrations: 0001" in migrate.stdout
    again = saga_cmd("migrate", "--database-url", empty_database_url)
    assert again.returncode == 0 and "up to date" in again.stdout
    after = saga_cmd("list", "--database-url", empty_database_url)
    assert after.returncode == 0 and after.stdout == ""


# ----- reading -----------------------------------------------------------------------


def test_list_and_show(make_orch: OrchestratorFactory, database_url: str, app_dir: Path) -> None:
    """list prints a table or JSON lines with filters; show prints operations and timeline."""
    orch = make_orch(*cli_app.SAGAS)
    done = orch.start(cli_app.shop, Job(order_id="o-done")).id
    assert orch.run(done).status == "completed"
    parked = _park_unknown(orch, "o-parked")

    table = saga_cmd("list", "--database-url", database_url)
    assert table.returncode == 0, table.stderr
    header, *lines = table.stdout.strip().splitlines()
    assert header.split()[:5] == ["ID", "SAGA", "TENANT", "KEY", "STATUS"]
    assert lines[0].startswith(parked) and "needs_review" in lines[0]
    assert lines[1].startswith(done) and "completed" in lines[1]

    as_json = saga_cmd("list", "--database-url", database_url, "--status", "needs_review", "--json")
    assert as_json.returncode == 0, as_json.stderr
    rows = [json.loads(line) for line in as_json.stdout.splitlines()]
    assert [(r["id"], r["status"], r["key"]) for r in rows] == [
        (parked, "needs_review", "o-parked")
    ]
    assert "TypeError" in rows[0]["error"]

    old = saga_cmd("list", "--database-url", database_url, "--older-than", "1h", "--json")
    assert old.returncode == 0 and old.stdout == ""

    shown = saga_cmd("show", "--database-url", database_url, parked)
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout
    assert parked in out and "needs_review" in out and "OPERATIONS" in out and "TIMELINE" in out
    key = orch.get(parked).operation("charge").idempotency_key
    charge_line = next(line for line in out.splitlines() if key in line)
    assert "unknown" in charge_line and "1/2" in charge_line and "action" in charge_line
    assert "attempt_started" in out and "saga_parked" in out

    full = json.loads(saga_cmd("show", "--database-url", database_url, parked, "--json").stdout)
    assert full["id"] == parked
    assert [op["step"] for op in full["operations"]] == ["reserve", "charge", "ship", "notify"]
    assert events(orch.history(parked)) == [e["event"] for e in full["history"]]

    missing = saga_cmd(
        "show", "--database-url", database_url, "0" * 8 + "-0000-0000-0000-" + "0" * 12
    )
    assert missing.returncode == 1
    assert "no saga" in _one_line_error(missing)


# ----- compensation ------------------------------------------------------------------


def test_batch_compensation_dry_run_then_for_real(
    make_orch: OrchestratorFactory, database_url: str, app_dir: Path
) -> None:
    """A dry run lists (saga, step, key) and changes no row; the batch then compensates."""
    orch = make_orch(*cli_app.SAGAS)
    first, second = _park_unknown(orch, "o-1"), _park_unknown(orch, "o-2")
    done = orch.start(cli_app.shop, Job(order_id="o-3")).id
    assert orch.run(done).status == "completed"
    base = ["compensate", "--app", "cli_app", "--database-url", database_url]
    batch = [*base, "--status", "needs_review", "--actor", "oncall"]

    before = _rows(database_url)
    dry = saga_cmd(*batch, "--include-unknown", "--dry-run", app_dir=app_dir)
    assert dry.returncode == 0, dry.stderr
    assert _rows(database_url) == before
    assert not [c for c in cli_app.calls() if c[0] in ("refund", "release")]
    planned = [line.split() for line in dry.stdout.splitlines() if line.startswith((first, second))]
    expected = []
    for saga_id in (first, second):
        state = orch.get(saga_id)
        for step in ("charge", "reserve"):
            key = f"{state.saga}:v1:acme:{state.key}:{step}:compensate"
            expected.append([saga_id, "shop", "v1", step, key])
    assert sorted(planned) == sorted(expected)
    assert "nothing was changed" in dry.stdout

    not_old = saga_cmd(*batch, "--older-than", "1h", app_dir=app_dir)
    assert not_old.returncode == 0 and "no sagas match" in not_old.stdout
    assert _rows(database_url) == before

    # Without --include-unknown, compensation stops at the unknown charge: parked, exit 1.
    stopped = saga_cmd(*batch, app_dir=app_dir)
    assert stopped.returncode == 1, stopped.stderr
    assert "2 selected: 0 done, 2 parked, 0 skipped" in stopped.stdout
    assert orch.get(first).status == "needs_review"

    result = saga_cmd(*batch, "--include-unknown", app_dir=app_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 selected: 2 done, 0 parked, 0 skipped" in result.stdout
    for saga_id, order in ((first, "o-1"), (second, "o-2")):
        state = orch.get(saga_id)
        assert state.status == "compensated"
        undone = [n for n, o, _ in cli_app.calls() if o == order and n in ("refund", "release")]
        assert undone == ["refund", "release"]
        requested = [e for e in orch.history(saga_id) if e.event == "compensation_requested"]
        assert requested[-1].detail == {"actor": "oncall", "include_unknown": True}
    assert orch.get(done).status == "completed"


def test_batch_compensation_recovers_sagas_parked_at_a_compensation_ceiling(
    make_orch: OrchestratorFactory, database_url: str, app_dir: Path
) -> None:
    """The recovery job's main case: refunds parked at their ceiling while the provider
    was down; once it is fixed, the dry run lists refund then unhold per saga and changes
    nothing, and the batch gives each refund a fresh budget and compensates them all."""
    orch = make_orch(*cli_app.SAGAS)
    parked = []
    for order in ("o-b1", "o-b2"):
        saga_id = orch.start(cli_app.billing, Job(order_id=order)).id
        state = orch.run(saga_id)
        assert state.status == "needs_review", state.error
        assert state.operation("bill", "compensation").status == "failed"
        parked.append(saga_id)
    (app_dir / "refunds_up").write_text("")
    base = ["compensate", "--app", "cli_app", "--database-url", database_url]
    batch = [*base, "--status", "needs_review", "--actor", "oncall"]

    before = _rows(database_url)
    dry = saga_cmd(*batch, "--dry-run", app_dir=app_dir)
    assert dry.returncode == 0, dry.stderr
    assert _rows(database_url) == before
    planned = [line.split() for line in dry.stdout.splitlines() if line.startswith(tuple(parked))]
    expected = []
    for saga_id in parked:
        state = orch.get(saga_id)
        for step in ("bill", "hold"):
            key = f"billing:v1:acme:{state.key}:{step}:compensate"
            expected.append([saga_id, "billing", "v1", step, key])
    assert sorted(planned) == sorted(expected), dry.stdout
    for saga_id in parked:  # per saga, in reverse step order
        assert [row[3] for row in planned if row[0] == saga_id] == ["bill", "hold"]
    assert "2 would be done (4 compensations), 0 would park" in dry.stdout
    raises = [line for line in dry.stdout.splitlines() if line.startswith("raises")]
    assert len(raises) == 2 and all("'bill': 2 -> 4 attempts" in line for line in raises)

    result = saga_cmd(*batch, app_dir=app_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 selected: 2 done, 0 parked, 0 skipped" in result.stdout
    for saga_id, order in zip(parked, ("o-b1", "o-b2"), strict=True):
        state = orch.get(saga_id)
        assert state.status == "compensated"
        refund = state.operation("bill", "compensation")
        assert (refund.attempts, refund.max_attempts) == (3, 4)
        ran = [n for n, o, _ in cli_app.calls() if o == order and n in ("refund_bill", "unhold")]
        assert ran == ["refund_bill", "refund_bill", "refund_bill", "unhold"]
        raised = [e for e in orch.history(saga_id) if e.event == "ceiling_raised"]
        assert [(e.step, e.kind, e.detail["actor"]) for e in raised] == [
            ("bill", "compensation", "oncall")
        ]


def test_batch_skips_a_saga_past_its_pivot(
    make_orch: OrchestratorFactory, database_url: str, app_dir: Path
) -> None:
    """The batch job never compensates past a succeeded pivot step: skipped, exit 1."""
    orch = make_orch(*cli_app.SAGAS)
    saga_id = orch.start(cli_app.shop, Job(order_id="o-p", plan="broken_notify")).id
    assert orch.run(saga_id).status == "needs_review"
    before = _rows(database_url)
    result = saga_cmd(
        "compensate",
        "--app",
        "cli_app",
        "--database-url",
        database_url,
        "--status",
        "needs_review",
        app_dir=app_dir,
    )
    assert result.returncode == 1
    assert "skipped" in result.stdout and "pivot step 'ship'" in result.stdout
    assert _rows(database_url) == before


# ----- resolve, retry, cancel --------------------------------------------------------


def test_resolve_moves_a_parked_saga_on(
    make_orch: OrchestratorFactory, database_url: str, app_dir: Path
) -> None:
    """resolve settles the unknown charge with the actor recorded; the saga completes."""
    orch = make_orch(*cli_app.SAGAS)
    saga_id = _park_unknown(orch, "o-r")
    base = ["resolve", "--app", "cli_app", "--database-url", database_url, saga_id, "charge"]

    left = saga_cmd(
        *base,
        "--succeeded",
        "--result",
        '{"charge_id": "ch_manual"}',
        "--actor",
        "alice",
        app_dir=app_dir,
    )
    assert left.returncode == 0, left.stderr
    assert "a worker will drive it" in left.stdout
    state = orch.get(saga_id)
    assert state.status == "running"
    assert state.operation("charge").result == {"charge_id": "ch_manual"}
    resolved = [e for e in orch.history(saga_id) if e.event == "operation_resolved"]
    assert resolved[0].detail["actor"] == "alice"

    again = saga_cmd(*base, "--failed", "--reason", "oops", app_dir=app_dir)
    assert again.returncode == 1
    assert "refused" in _one_line_error(again)

    run = saga_cmd(
        "retry", "--app", "cli_app", "--database-url", database_url, saga_id, app_dir=app_dir
    )
    assert run.returncode == 1  # not parked any more: nothing to retry
    assert orch.run(saga_id).status == "completed"


def test_retry_raises_the_ceiling_explicitly(
    make_orch: OrchestratorFactory, database_url: str, app_dir: Path
) -> None:
    """retry refuses to exceed the ceiling silently; with --extra-attempts it resumes."""
    orch = make_orch(*cli_app.SAGAS)
    saga_id = orch.start(cli_app.shop, Job(order_id="o-t", plan="broken_notify")).id
    parked = orch.run(saga_id)
    assert parked.status == "needs_review"
    assert parked.operation("notify").attempts == 1
    base = ["retry", "--app", "cli_app", "--database-url", database_url, saga_id, "--run"]

    before = _rows(database_url)
    refused = saga_cmd(*base, app_dir=app_dir)
    assert refused.returncode == 1
    assert "1 of its 1 attempts" in _one_line_error(refused)
    assert _rows(database_url) == before

    (app_dir / "fixed").touch()
    result = saga_cmd(*base, "--extra-attempts", "2", "--actor", "bob", app_dir=app_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ceiling 1 -> 3" in result.stdout and "completed" in result.stdout
    state = orch.get(saga_id)
    assert state.status == "completed"
    notify = state.operation("notify")
    assert (notify.status, notify.attempts, notify.max_attempts) == ("succeeded", 2, 3)
    retried = [e for e in orch.history(saga_id) if e.event == "retry_requested"]
    assert retried[0].detail["actor"] == "bob"
    assert retried[0].detail["previous_max_attempts"] == 1
    assert retried[0].detail["max_attempts"] == 3


def test_cancel_refuses_a_live_lease_unless_forced(
    make_orch: OrchestratorFactory, database_url: str, app_dir: Path
) -> None:
    """cancel compensates; a saga a live worker holds is refused, and --force takes it over."""
    orch = make_orch(*cli_app.SAGAS)
    saga_id = orch.start(cli_app.parcel, Job(order_id="o-c")).id
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            "UPDATE saga.sagas SET lease_owner = 'other-host:42', fence = fence + 1,"
            " lease_expires_at = now() + interval '1 hour' WHERE id = %s",
            (saga_id,),
        )
    base = [
        "cancel",
        "--app",
        "cli_app",
        "--database-url",
        database_url,
        saga_id,
        "--reason",
        "customer asked",
        "--actor",
        "carol",
        "--run",
    ]

    before = _rows(database_url)
    refused = saga_cmd(*base, app_dir=app_dir)
    assert refused.returncode == 1
    assert "other-host:42" in _one_line_error(refused)
    assert _rows(database_url) == before

    forced = saga_cmd(*base, "--force", app_dir=app_dir)
    assert forced.returncode == 0, forced.stdout + forced.stderr
    state = orch.get(saga_id)
    assert state.status == "compensated"
    assert state.error == "cancelled by carol: customer asked"
    history = orch.history(saga_id)
    broken = next(e for e in history if e.event == "lease_broken")
    assert broken.detail["previous_owner"] == "other-host:42"
    assert broken.detail["actor"] == "carol"
    assert next(e for e in history if e.event == "cancel_requested").detail["reason"] == (
        "customer asked"
    )
    assert not [c for c in cli_app.calls() if c[1] == "o-c"]  # nothing ran, nothing to undo


def test_cancelling_a_compensating_saga_again_changes_nothing(
    make_orch: OrchestratorFactory, database_url: str, app_dir: Path
) -> None:
    """A second cancel of a saga already compensating writes nothing and says so."""
    orch = make_orch(*cli_app.SAGAS)
    saga_id = orch.start(cli_app.parcel, Job(order_id="o-twice")).id
    first = orch.cancel(saga_id, reason="customer asked", actor="carol")
    assert first.status == "compensating"

    before = _rows(database_url)
    again = saga_cmd(
        "cancel",
        "--app",
        "cli_app",
        "--database-url",
        database_url,
        saga_id,
        "--reason",
        "asked twice",
        "--actor",
        "dave",
        app_dir=app_dir,
    )
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"saga {saga_id} is already compensating; nothing to cancel" in again.stdout
    assert _rows(database_url) == before
    assert orch.get(saga_id).updated_at == first.updated_at
    assert [e.event for e in orch.history(saga_id)].count("cancel_requested") == 1


# ----- workers and the reconcile job -------------------------------------------------


class Worker:
    """A `saga worker` subprocess."""

    out = ""  # its stdout, once it has exited

    def __init__(self, database_url: str, app_dir: Path, *flags: str, **env: str) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "saga",
                "worker",
                "--app",
                "cli_app",
                "--database-url",
                database_url,
                "--concurrency",
                "2",
                *flags,
            ],
            env=_env(app_dir, **env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def stop(self, signum: int = signal.SIGTERM, timeout: float = 30.0) -> tuple[int, str]:
        self.proc.send_signal(signum)
        return self.wait(timeout)

    def wait(self, timeout: float = 30.0) -> tuple[int, str]:
        try:
            self.out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
            raise AssertionError(f"worker did not stop within {timeout}s:\n{err}") from None
        return self.proc.returncode, err

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    started: list[Worker] = []
    yield started
    for worker in started:
        worker.kill()


def _lease(url: str, saga_id: str) -> tuple[str | None, bool]:
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT lease_owner, coalesce(lease_expires_at > now(), false)"
            " FROM saga.sagas WHERE id = %s",
            (saga_id,),
        ).fetchone()
    assert row is not None
    return row[0], bool(row[1])


def test_sigterm_releases_the_lease_and_another_worker_finishes(
    make_orch: OrchestratorFactory, database_url: str, app_dir: Path, workers: list[Worker]
) -> None:
    """SIGTERM: the worker lets the running attempt finish, gives the lease back, exits 0;
    a second worker finishes the saga."""
    orch = make_orch(*cli_app.SAGAS)
    saga_id = orch.start(cli_app.parcel, Job(order_id="o-w")).id
    first = Worker(database_url, app_dir, CLI_APP_BLOCK="gate")
    workers.append(first)
    wait_until(lambda: any(c[0] == "pack-waiting" for c in cli_app.calls()), timeout=30)

    first.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    (app_dir / "gate").touch()
    code, err = first.wait()
    assert code == 0, err
    owner, _live = _lease(database_url, saga_id)
    assert owner is None, f"lease still held by {owner}"
    state = orch.get(saga_id)
    assert state.status != "completed"
    assert not [c for c in cli_app.calls() if c[0] == "dispatch"]

    second = Worker(database_url, app_dir)
    workers.append(second)
    wait_until(lambda: orch.get(saga_id).status == "completed", timeout=30)
    code, err = second.stop(signal.SIGINT)
    assert code == 0, err
    pids = {name: pid for name, _, pid in cli_app.calls()}
    assert pids["label"] == first.proc.pid
    assert pids["dispatch"] == second.proc.pid
    assert [c[0] for c in cli_app.calls()].count("pack") == 1


def test_a_worker_behind_pgbouncer_listens_on_listen_url_else_polls_and_says_so(
    make_orch: OrchestratorFactory,
    database_url: str,
    pooled_url: str,
    app_dir: Path,
    workers: list[Worker],
) -> None:
    """`saga worker --database-url POOLER --listen-url DIRECT` drives sagas started after
    it and never says it polls; without `--listen-url` it says so once, on stderr (stdout
    stays empty), and drives them all the same."""
    orch = make_orch(*cli_app.SAGAS)
    for flags, order_id in ((("--listen-url", database_url), "o-l"), ((), "o-p")):
        worker = Worker(pooled_url, app_dir, *flags)
        workers.append(worker)
        time.sleep(1.5)  # started, idle
        saga_id = orch.start(cli_app.parcel, Job(order_id=order_id)).id
        wait_until(lambda saga_id=saga_id: orch.get(saga_id).status == "completed", timeout=30)
        code, err = worker.stop()
        assert code == 0, err
        assert worker.out == ""
        assert err.count("listen_unavailable") == (0 if flags else 1), err


def test_reconcile_settles_what_it_can_and_parks_the_rest(
    make_orch: OrchestratorFactory, database_url: str, app_dir: Path, workers: list[Worker]
) -> None:
    """A worker SIGKILLed mid-step leaves two attempts running: reconcile settles the one
    with a reconcile hook (the provider has it) and parks the one that has none."""
    orch = make_orch(*cli_app.SAGAS)
    settled = orch.start(cli_app.parcel, Job(order_id="o-s")).id
    stuck = orch.start(cli_app.fragile, Job(order_id="o-f")).id
    crashed = Worker(database_url, app_dir, CLI_APP_BLOCK="hang_after")
    workers.append(crashed)
    wait_until(
        lambda: {"pack-packed", "post_letter-posted"} <= {c[0] for c in cli_app.calls()},
        timeout=30,
    )
    crashed.proc.kill()
    crashed.proc.wait(timeout=10)
    wait_until(lambda: not _lease(database_url, settled)[1] and not _lease(database_url, stuck)[1])

    result = saga_cmd(
        "reconcile", "--app", "cli_app", "--database-url", database_url, app_dir=app_dir
    )
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert any(line.startswith("done") and settled in line and "pack" in line for line in lines)
    assert any(line.startswith("parked") and stuck in line for line in lines)
    assert "2 selected: 1 done, 1 parked, 0 skipped" in lines[-1]

    state = orch.get(settled)
    assert state.status == "completed"
    assert state.operation("pack").provider_reference == "p_o-s"
    names = [c[0] for c in cli_app.calls() if c[1] == "o-s"]
    assert names.count("pack") == 1 and "find_parcel" in names
    assert orch.get(stuck).status == "needs_review"
    assert orch.get(stuck).operation("post_letter").status == "unknown"

    again = saga_cmd(
        "reconcile", "--app", "cli_app", "--database-url", database_url, app_dir=app_dir
    )
    assert again.returncode == 0
    assert "no operation is left running" in again.stdout
