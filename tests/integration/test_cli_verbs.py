"""Verbs that do what they say: a cancel that would only park asks first, honours
--include-unknown on a saga already compensating, and answers alike for every ended
saga; an operator's result is amended until its compensation uses it; and the dry runs
warn about compensations that get None as the step's result."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import cli_app_async
import cli_app_trip
import psycopg
import pytest
from cli_app import Job
from support import OrchestratorFactory
from test_cli import _env, _one_line_error, _park_unknown, _rows, saga_cmd

from saga import Orchestrator

APP = ["--app", "cli_app_trip"]


def _park_hotel(orch: Orchestrator, order_id: str) -> str:
    """A trip parked forward: book_flight succeeded, book_hotel's outcome is unknown."""
    saga_id = orch.start(cli_app_trip.trip, Job(order_id=order_id, plan="unknown")).id
    state = orch.run(saga_id)
    assert state.status == "needs_review"
    assert state.operation("book_hotel").status == "unknown"
    return saga_id


def _undone(app_dir: Path, step: str, order_id: str) -> object:
    """The result the compensation of `step` received (KeyError when it never ran)."""
    path = app_dir / f"undone-{step}-{order_id}.json"
    if not path.exists():
        raise KeyError(step)
    return json.loads(path.read_text())


def _on_a_terminal(*args: str, answer: str, app_dir: Path) -> tuple[int, str, str]:
    """Run `saga ARGS` with stdin and stderr on a terminal, answer its question; (exit
    code, stdout, what the terminal showed)."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "saga", *args],
        env=_env(app_dir),
        stdin=follower,
        stdout=subprocess.PIPE,
        stderr=follower,
        text=True,
    )
    os.close(follower)
    shown = b""
    deadline = time.monotonic() + 30
    try:
        while b"[y/N]" not in shown and time.monotonic() < deadline:
            if select.select([leader], [], [], 0.5)[0]:
                shown += os.read(leader, 4096)
        assert b"[y/N]" in shown, shown
        os.write(leader, answer.encode() + b"\n")
        out, _ = proc.communicate(timeout=30)
        while select.select([leader], [], [], 0.2)[0]:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # the terminal closed with the command
                break
            if not chunk:
                break
            shown += chunk
    finally:
        os.close(leader)
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, out, shown.decode(errors="replace")


# ----- item 5: cancel ---------------------------------------------------------------


def test_a_cancel_that_would_park_asks_first_and_writes_nothing_unless_confirmed(
    make_orch: OrchestratorFactory, database_url: str, app_dir: Path
) -> None:
    """book_hotel is unknown: a plain cancel would undo nothing and park. Without a
    terminal and without --yes it is refused (exit 2, nothing written); on a terminal
    it asks, and "n" writes nothing; --yes cancels."""
    orch = make_orch(cli_app_trip.trip)
    saga_id = _park_hotel(orch, "o-1")
    base = ["cancel", *APP, "--database-url", database_url, saga_id, "--reason", "asked"]

    before = _rows(database_url)
    refused = saga_cmd(*base, app_dir=app_dir)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "will park in needs_review" in refused.stdout
    line = _one_line_error(refused)
    assert "--yes" in line and "nothing was changed" in line, line
    assert _rows(database_url) == before

    code, out, shown = _on_a_terminal(*base, answer="n", app_dir=app_dir)
    assert code == 1, (out, shown)
    assert f"cancel saga {saga_id} anyway? [y/N]" in shown
    assert "nothing was changed" in out
    assert _rows(database_url) == before

    code, out, shown = _on_a_terminal(*base, answer="y", app_dir=app_dir)
    assert code == 0, (out, shown)
    assert f"cancelled saga {saga_id}" in out
    assert orch.get(saga_id).status == "compensating"

    other = _park_hotel(orch, "o-2")
    confirmed = saga_cmd(*base[:-3], other, "--reason", "asked", "--yes", app_dir=app_dir)
    assert confirmed.returncode == 0, confirmed.stdout + confirmed.stderr
    assert orch.get(other).status == "compensating"

    # A cancel refused anyway (a live worker holds the saga) asks nothing, warns of nothing.
    held = _park_hotel(orch, "o-2b")
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            "UPDATE saga.sagas SET lease_owner = 'other-host:42', fence = fence + 1,"
            " lease_expires_at = now() + interval '1 hour' WHERE id = %s",
            (held,),
        )
    leased = saga_cmd(*base[:-3], held, "--reason", "asked", app_dir=app_dir)
    assert leased.returncode == 1 and leased.stdout == "", leased.stdout
    assert "other-host:42" in _one_line_error(leased)


@pytest.mark.parametrize("driven", [False, True], ids=["compensating", "parked"])
def test_cancel_include_unknown_on_a_saga_already_cancelled_compensates_the_unknown_step(
    make_orch: OrchestratorFactory, database_url: str, app_dir: Path, driven: bool
) -> None:
    """The operator cancelled without --include-unknown (the saga is compensating, or,
    driven, parked at book_hotel); cancel again with --include-unknown --run compensates
    book_hotel and book_flight, as `compensate --include-unknown` would."""
    orch = make_orch(cli_app_trip.trip)
    saga_id = _park_hotel(orch, "o-3")
    base = ["cancel", *APP, "--database-url", database_url, saga_id, "--reason", "asked"]
    orch.cancel(saga_id, reason="asked", actor="bob")
    if driven:
        orch.run(saga_id)
    assert orch.get(saga_id).status == ("needs_review" if driven else "compensating")
    if driven:  # without the flag, the refusal names the command that works
        again = saga_cmd(*base, app_dir=app_dir)
        assert again.returncode == 1
        line = _one_line_error(again)
        assert "'book_hotel'" in line and "cancel again with --include-unknown" in line, line

    result = saga_cmd(*base, "--include-unknown", "--run", "--actor", "carol", app_dir=app_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "nothing to cancel" not in result.stdout
    assert "will get None" in result.stdout  # the preview's warning
    assert orch.get(saga_id).status == "compensated"
    assert _undone(app_dir, "book_hotel", "o-3") is None
    assert _undone(app_dir, "book_flight", "o-3") == {"flight": "fl_o-3"}
    asked = [e for e in orch.history(saga_id) if e.event == "cancel_requested"]
    assert asked[-1].detail == {"actor": "carol", "reason": "asked", "include_unknown": True}


def test_cancel_answers_alike_for_a_completed_and_a_compensated_saga(
    make_orch: OrchestratorFactory, database_url: str, app_dir: Path
) -> None:
    """Both have ended: cancel refuses each with one line on stderr, exit 1, writing
    nothing; `saga cancel --help` documents the exit codes of cancel."""
    orch = make_orch(cli_app_trip.trip)
    completed = orch.start(cli_app_trip.trip, Job(order_id="o-4")).id
    assert orch.run(completed).status == "completed"
    compensated = orch.start(cli_app_trip.trip, Job(order_id="o-5")).id
    orch.run(compensated)
    assert orch.compensate(compensated, actor="ops").status == "compensated"
    before = _rows(database_url)
    for saga_id, status in ((completed, "completed"), (compensated, "compensated")):
        result = saga_cmd(
            "cancel", *APP, "--database-url", database_url, saga_id, "--reason", "x",
            app_dir=app_dir,
        )  # fmt: skip
        assert result.returncode == 1, result.stdout + result.stderr
        assert result.stdout == ""
        line = _one_line_error(result)
        assert line.startswith(f"saga: refused: saga {saga_id} is {status}"), line
    assert _rows(database_url) == before

    helped = saga_cmd("cancel", "--help")
    assert "exit codes of cancel:" in helped.stdout
    assert "completed or compensated alike" in helped.stdout and "--yes" in helped.stdout


# ----- item 6: resolve amends an operator's result --------------------------------------


def test_resolve_amends_the_result_an_operator_gave_until_its_compensation_uses_it(
    make_orch: OrchestratorFactory, database_url: str, app_dir: Path
) -> None:
    """Resolved without --result, book_hotel's result is null and the warning names a
    command; that command amends it (result_amended: actor, old and new result), and the
    compensation gets the amended result. A provider's result, and one a compensation
    has used, are refused with the reason, writing nothing."""
    orch = make_orch(cli_app_trip.trip)
    saga_id = _park_hotel(orch, "o-6")
    base = ["resolve", *APP, "--database-url", database_url, saga_id]

    bare = saga_cmd(*base, "book_hotel", "--succeeded", app_dir=app_dir)
    assert bare.returncode == 0, bare.stderr
    advice = f"saga resolve {saga_id} book_hotel --succeeded --result JSON"
    assert advice in bare.stderr, bare.stderr

    result = '{"hotel": "ht_9"}'
    amended = saga_cmd(
        *base, "book_hotel", "--succeeded", "--result", result, "--actor", "dana",
        app_dir=app_dir,
    )  # fmt: skip
    assert amended.returncode == 0, amended.stdout + amended.stderr
    assert f"amended the result of 'book_hotel' of saga {saga_id}, by dana" in amended.stdout
    assert orch.get(saga_id).operation("book_hotel").result == {"hotel": "ht_9"}
    event = next(e for e in orch.history(saga_id) if e.event == "result_amended")
    assert event.step == "book_hotel" and event.detail["actor"] == "dana"
    assert event.detail["previous_result"] is None
    assert event.detail["result"] == {"hotel": "ht_9"}

    before = _rows(database_url)
    provider = saga_cmd(*base, "book_flight", "--succeeded", "--result", "{}", app_dir=app_dir)
    assert provider.returncode == 1
    assert "what the provider call returned" in _one_line_error(provider)
    assert _rows(database_url) == before

    assert orch.compensate(saga_id, actor="ops").status == "compensated"
    assert _undone(app_dir, "book_hotel", "o-6") == {"hotel": "ht_9"}
    before = _rows(database_url)
    late = saga_cmd(*base, "book_hotel", "--succeeded", "--result", "{}", app_dir=app_dir)
    assert late.returncode == 1
    assert "its compensation has started" in _one_line_error(late)
    assert _rows(database_url) == before


# ----- item 7: compensations that get None ----------------------------------------------


def test_dry_runs_warn_that_unknown_steps_compensations_get_none(
    make_orch: OrchestratorFactory, database_url: str, app_dir: Path
) -> None:
    """compensate --dry-run --include-unknown lists cancel_hotel with a warning that it
    gets None (text and JSON), in the same format as without the flag; cancel's preview
    says it too."""
    orch = make_orch(cli_app_trip.trip)
    saga_id = _park_hotel(orch, "o-7")
    base = ["compensate", *APP, "--database-url", database_url, saga_id, "--dry-run"]
    before = _rows(database_url)

    plain = saga_cmd(*base, app_dir=app_dir)
    flagged = saga_cmd(*base, "--include-unknown", app_dir=app_dir)
    for result in (plain, flagged):
        assert result.returncode == 0, result.stdout + result.stderr
        lines = result.stdout.splitlines()
        assert lines[0].split() == [
            "SAGA",
            "ID",
            "SAGA",
            "COMPENSATES",
            "STEP",
            "IDEMPOTENCY",
            "KEY",
        ]
        assert lines[-1].startswith("dry run: 1 selected")
    assert not [line for line in plain.stdout.splitlines() if line.startswith("warning")]
    warnings = [line for line in flagged.stdout.splitlines() if line.startswith("warning")]
    assert len(warnings) == 1, flagged.stdout
    assert "'cancel_hotel' of step 'book_hotel' will get None" in warnings[0]

    as_json = saga_cmd(*base, "--include-unknown", "--json", app_dir=app_dir)
    first = json.loads(as_json.stdout.splitlines()[0])
    assert [(n["step"], n["compensation"]) for n in first["null_results"]] == [
        ("book_hotel", "cancel_hotel")
    ]

    preview = saga_cmd(
        "cancel", *APP, "--database-url", database_url, saga_id, "--reason", "x",
        "--include-unknown", app_dir=app_dir,
    )  # fmt: skip
    assert preview.returncode == 0, preview.stdout + preview.stderr
    assert preview.stdout.startswith("cancel: warning: compensation 'cancel_hotel'")
    assert _rows(database_url) != before  # the cancel itself was written


def test_the_async_door_amends_a_result_and_cancels_an_unknown_step_too(
    make_orch: OrchestratorFactory, database_url: str, app_dir: Path
) -> None:
    """Through an AsyncOrchestrator app: resolve amends the result an operator gave, and
    cancel --include-unknown of a saga already compensating compensates the unknown step."""
    orch = make_orch(*cli_app_async.ASYNC_SAGAS)
    base = ["--app", "cli_app_async:orch", "--database-url", database_url]
    resolved = _park_unknown(orch, "o-a1")
    orch.resolve(resolved, "charge", outcome="succeeded", actor="bob")
    amended = saga_cmd(
        "resolve", *base, resolved, "charge", "--succeeded", "--result", '{"c": 1}',
        app_dir=app_dir,
    )  # fmt: skip
    assert amended.returncode == 0, amended.stdout + amended.stderr
    assert "amended the result of 'charge'" in amended.stdout
    assert orch.get(resolved).operation("charge").result == {"c": 1}

    cancelled = _park_unknown(orch, "o-a2")
    orch.cancel(cancelled, reason="asked", actor="bob")
    again = saga_cmd(
        "cancel", *base, cancelled, "--reason", "asked", "--include-unknown", "--run",
        app_dir=app_dir,
    )  # fmt: skip
    assert again.returncode == 0, again.stdout + again.stderr
    state = orch.get(cancelled)
    assert state.status == "compensated"
    assert state.operation("charge", "compensation").status == "succeeded"
