"""What a new user hit with the `saga` command: flag names in messages, a cancel that
will park said up front, a resolve without --result warned about, JSON from the batch
jobs, reconcile's --limit counting sagas, id prefixes, --version and `saga versions`."""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path
from types import SimpleNamespace

import cli_app
import cli_app_letter
import psycopg
import pytest
from cli_app import Job
from support import OrchestratorFactory
from test_cli import _one_line_error, _park_unknown, _rows, saga_cmd

import saga
from saga import Orchestrator

_PYTHON_WORDING = re.compile(r"include_unknown|extra attempts|extra_attempts|force=True")


def _park_letter(orch: Orchestrator, order_id: str) -> str:
    """A letter saga parked forward: `post` (no compensation) has an unknown outcome."""
    saga_id = orch.start(cli_app_letter.letter, Job(order_id=order_id, plan="unknown")).id
    state = orch.run(saga_id)
    assert state.status == "needs_review"
    assert state.operation("post").status == "unknown"
    return saga_id


def _json_lines(text: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in text.splitlines()]


# ----- item 8: CLI wording ------------------------------------------------------------


def test_refusals_and_park_reasons_name_cli_flags(
    make_orch: OrchestratorFactory, database_url: str, app_dir: Path
) -> None:
    """A compensation stopped at an unknown step, and the retry refused after it, name
    --include-unknown, never the Python keyword include_unknown."""
    orch = make_orch(*cli_app.SAGAS)
    saga_id = _park_unknown(orch, "o-w")
    base = ["--app", "cli_app", "--database-url", database_url]

    stopped = saga_cmd("compensate", *base, saga_id, app_dir=app_dir)
    assert stopped.returncode == 1, stopped.stdout + stopped.stderr
    assert "--include-unknown" in stopped.stdout
    assert not _PYTHON_WORDING.search(stopped.stdout + stopped.stderr), stopped.stdout

    shown = saga_cmd("show", "--database-url", database_url, saga_id)
    reason = next(line for line in shown.stdout.splitlines() if line.startswith("reason"))
    assert "--include-unknown" in reason and not _PYTHON_WORDING.search(reason), reason

    before = _rows(database_url)
    refused = saga_cmd("retry", *base, saga_id, app_dir=app_dir)
    assert refused.returncode == 1
    line = _one_line_error(refused)
    assert "--include-unknown" in line and not _PYTHON_WORDING.search(line), line
    assert _rows(database_url) == before


def test_cancel_says_up_front_that_the_saga_will_park(
    make_orch: OrchestratorFactory, database_url: str, app_dir: Path
) -> None:
    """`post` is unknown and has no compensation: cancel says, before it acts, what it
    will undo and that the saga will then park, and why (--yes: it acts without asking);
    it never suggests --include-unknown, which cannot help (and here was passed already)."""
    orch = make_orch(cli_app_letter.letter)
    plain, flagged = _park_letter(orch, "o-c1"), _park_letter(orch, "o-c2")
    base = ["cancel", "--app", "cli_app_letter", "--database-url", database_url]

    for saga_id, extra in ((plain, []), (flagged, ["--include-unknown"])):
        result = saga_cmd(
            *base, saga_id, "--reason", "customer asked", "--run", "--yes", *extra, app_dir=app_dir
        )
        out = result.stdout + result.stderr
        assert result.returncode == 1, out
        first = result.stdout.splitlines()[0]
        assert first.startswith("cancel: ") and "will park" in first, result.stdout
        assert "'post'" in first and "no compensation" in first, first
        assert "cancelled saga" in result.stdout.splitlines()[1]
        assert "include-unknown" not in out and not _PYTHON_WORDING.search(out), out
        assert orch.get(saga_id).status == "needs_review"

    # Parked while compensating, the saga is refused a second cancel: nothing is announced.
    again = saga_cmd(*base, plain, "--reason", "again", app_dir=app_dir)
    assert again.returncode == 1 and again.stdout == "", again.stdout
    assert "already compensating" in _one_line_error(again)


def test_resolve_succeeded_without_result_warns_when_a_compensation_gets_null(
    make_orch: OrchestratorFactory, database_url: str, app_dir: Path
) -> None:
    """charge has a compensation (refund): resolving it as succeeded without --result
    warns on stderr that refund will receive null; with --result, or for a step without
    a compensation, there is no warning."""
    orch = make_orch(*cli_app.SAGAS, cli_app_letter.letter)
    bare, given = _park_unknown(orch, "o-r1"), _park_unknown(orch, "o-r2")
    letter = _park_letter(orch, "o-r3")
    base = ["resolve", "--database-url", database_url]

    warned = saga_cmd(*base, "--app", "cli_app", bare, "charge", "--succeeded", app_dir=app_dir)
    assert warned.returncode == 0, warned.stderr
    assert "warning" in warned.stderr and "'refund'" in warned.stderr, warned.stderr
    assert "null" in warned.stderr and "--result" in warned.stderr

    quiet = saga_cmd(
        *base,
        "--app",
        "cli_app",
        given,
        "charge",
        "--succeeded",
        "--result",
        '{"c": 1}',
        app_dir=app_dir,
    )
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    no_comp = saga_cmd(
        *base, "--app", "cli_app_letter", letter, "post", "--succeeded", app_dir=app_dir
    )
    assert no_comp.returncode == 0 and no_comp.stderr == "", no_comp.stderr


# ----- item 9: JSON from the batch jobs, reconcile --limit ------------------------------


def test_batch_commands_write_json_lines_with_a_summary(
    make_orch: OrchestratorFactory, database_url: str, app_dir: Path
) -> None:
    """compensate, reconcile and purge with --json: one JSON object per saga, one per
    line, then a summary object; nothing else on stdout."""
    orch = make_orch(*cli_app.SAGAS)
    first, second = _park_unknown(orch, "o-j1"), _park_unknown(orch, "o-j2")
    app = ["--app", "cli_app", "--database-url", database_url]

    dry = saga_cmd(
        "compensate",
        *app,
        "--status",
        "needs_review",
        "--include-unknown",
        "--dry-run",
        "--json",
        app_dir=app_dir,
    )
    assert dry.returncode == 0, dry.stderr
    *planned, dry_summary = _json_lines(dry.stdout)
    assert {p["saga_id"] for p in planned} == {first, second}
    assert [c["step"] for c in planned[0]["compensations"]] == ["charge", "reserve"]
    assert dry_summary["summary"] is True and dry_summary["dry_run"] is True
    assert dry_summary["selected"] == 2

    comp = saga_cmd(
        "compensate",
        *app,
        "--status",
        "needs_review",
        "--include-unknown",
        "--json",
        app_dir=app_dir,
    )
    assert comp.returncode == 0, comp.stdout + comp.stderr
    *outcomes, summary = _json_lines(comp.stdout)
    assert sorted((o["saga_id"], o["result"]) for o in outcomes) == sorted(
        [(first, "done"), (second, "done")]
    )
    assert {o["saga"] for o in outcomes} == {"shop v1"}
    assert summary == {
        "summary": True,
        "command": "compensate",
        "selected": 2,
        "done": 2,
        "parked": 0,
        "skipped": 0,
        "not_handled": 0,
        "interrupted": False,
    }

    rec = saga_cmd("reconcile", *app, "--json", app_dir=app_dir)
    assert rec.returncode == 0, rec.stderr
    assert _json_lines(rec.stdout) == [
        {
            "summary": True,
            "command": "reconcile",
            "selected": 0,
            "done": 0,
            "parked": 0,
            "skipped": 0,
            "not_handled": 0,
            "interrupted": False,
        }
    ]

    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            "UPDATE saga.sagas SET finished_at = now() - interval '40 days' WHERE id = %s",
            (first,),
        )
    purge = ["purge", "--database-url", database_url, "--json"]
    listed = saga_cmd(*purge, "--dry-run")
    assert listed.returncode == 0, listed.stderr
    *candidates, listed_summary = _json_lines(listed.stdout)
    assert [(c["saga_id"], c["status"]) for c in candidates] == [(first, "compensated")]
    assert listed_summary["summary"] is True and listed_summary["would_purge"] == 1
    purged = saga_cmd(*purge)
    assert purged.returncode == 0, purged.stderr
    *deleted, purge_summary = _json_lines(purged.stdout)
    assert deleted == [] and purge_summary["purged"] == 1 and purge_summary["summary"] is True


def test_reconcile_limit_counts_sagas_not_operations(
    make_orch: OrchestratorFactory, database_url: str, app_dir: Path
) -> None:
    """Three compensating sagas, each with two unsettled operations (charge unknown, its
    refund left running by a worker that died): --limit 2 selects two sagas."""
    orch = make_orch(*cli_app.SAGAS)
    ids = []
    for n in range(3):
        saga_id = _park_unknown(orch, f"o-l{n}")
        orch.cancel(saga_id, reason="test", actor="t", include_unknown=True)
        ids.append(saga_id)
    with psycopg.connect(database_url, autocommit=True) as conn:
        # What a worker killed inside the refund leaves: the attempt running, no lease.
        conn.execute(
            "UPDATE saga.operations SET status = 'running', attempts = 1, started_at = now() "
            "WHERE step = 'charge' AND kind = 'compensation'"
        )
    result = saga_cmd(
        "reconcile",
        "--app",
        "cli_app",
        "--database-url",
        database_url,
        "--limit",
        "2",
        app_dir=app_dir,
    )
    *outcomes, summary = result.stdout.splitlines()
    assert summary.startswith("reconcile: 2 selected: 2 done"), result.stdout + result.stderr
    assert sorted(line.split()[1] for line in outcomes) == sorted(ids[:2])
    assert orch.get(ids[2]).status == "compensating"


# ----- item 10: id prefixes, --version ------------------------------------------------


def test_commands_take_unique_id_prefixes(
    make_orch: OrchestratorFactory,
    database_url: str,
    app_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """show, retry and the other commands take a unique prefix of an id; an ambiguous
    prefix lists candidates, an unknown one or one too short says so, exit codes 2/1/2."""
    orch = make_orch(*cli_app.SAGAS)
    forced = iter(["abcd1111", "abcd2222"])
    ids = SimpleNamespace(uuid4=lambda: uuid.UUID(next(forced) + uuid.uuid4().hex[8:]))
    with monkeypatch.context() as patch:
        # Only the ids of the sagas started here: two that share the prefix abcd.
        patch.setattr("saga._flows.verbs.uuid", ids)
        first = orch.start(cli_app.shop, Job(order_id="o-p1", plan="unknown")).id
        second = orch.start(cli_app.shop, Job(order_id="o-p2", plan="unknown")).id
    for saga_id in (first, second):
        assert orch.run(saga_id).status == "needs_review"
    assert first.startswith("abcd1111") and second.startswith("abcd2222")

    shown = saga_cmd("show", "--database-url", database_url, "abcd1")
    assert shown.returncode == 0, shown.stderr
    assert first in shown.stdout and second not in shown.stdout
    upper = saga_cmd("show", "--database-url", database_url, "--json", first[:13].upper())
    assert upper.returncode == 0 and json.loads(upper.stdout)["id"] == first

    ambiguous = saga_cmd("show", "--database-url", database_url, "abcd")
    assert ambiguous.returncode == 2
    line = _one_line_error(ambiguous)
    assert "ambiguous" in line and first in line and second in line, line

    none = saga_cmd("show", "--database-url", database_url, "0123abc")
    assert none.returncode == 1
    assert "no saga id starts with '0123abc'" in _one_line_error(none)
    short = saga_cmd("show", "--database-url", database_url, "ab")
    assert short.returncode == 2 and "at least 4" in _one_line_error(short)

    cancelled = saga_cmd(
        "cancel",
        "--app",
        "cli_app",
        "--database-url",
        database_url,
        "abcd2",
        "--reason",
        "r",
        "--include-unknown",
        app_dir=app_dir,
    )
    assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
    assert f"cancelled saga {second}" in cancelled.stdout


def test_version() -> None:
    """`saga --version` and `saga.__version__` give the installed package's version."""
    from importlib.metadata import version

    assert saga.__version__ == version("saga-orchestrator")
    result = saga_cmd("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"saga {saga.__version__}"


# ----- saga versions ------------------------------------------------------------------


def test_versions_lists_sagas_in_flight_per_version(
    make_orch: OrchestratorFactory, database_url: str, app_dir: Path
) -> None:
    """Sagas in flight per name and version, by status, and whether --app registers the
    version: shop v1 (registered), letter v1 (not registered by cli_app, so the command
    exits 1)."""
    orch = make_orch(*cli_app.SAGAS, cli_app_letter.letter)
    _park_unknown(orch, "o-v1")
    orch.start(cli_app.shop, Job(order_id="o-v2"))
    done = orch.start(cli_app.shop, Job(order_id="o-v3")).id
    assert orch.run(done).status == "completed"
    _park_letter(orch, "o-v4")

    as_json = saga_cmd(
        "versions",
        "--app",
        "cli_app",
        "--database-url",
        database_url,
        "--json",
        app_dir=app_dir,
    )
    # letter v1 is in flight and cli_app does not register it: exit 1, a deploy gate.
    assert as_json.returncode == 1, as_json.stderr
    rows = {(r["saga"], r["version"]): r for r in _json_lines(as_json.stdout)}
    assert rows[("shop", 1)]["pending"] == 1 and rows[("shop", 1)]["needs_review"] == 1
    assert rows[("shop", 1)]["in_flight"] == 2 and rows[("shop", 1)]["registered"] is True
    assert rows[("letter", 1)]["in_flight"] == 1 and rows[("letter", 1)]["registered"] is False
    assert rows[("parcel", 1)]["in_flight"] == 0 and rows[("parcel", 1)]["registered"] is True

    text = saga_cmd("versions", "--database-url", database_url)
    assert text.returncode == 0, text.stderr
    header, *lines = text.stdout.splitlines()
    assert header.split()[:3] == ["SAGA", "VERSION", "PENDING"] and "REGISTERED" not in header
    assert [line.split()[:2] for line in lines if line[:1] != " "][:2] == [
        ["letter", "1"],
        ["shop", "1"],
    ]

    with_app = saga_cmd(
        "versions", "--app", "cli_app", "--database-url", database_url, app_dir=app_dir
    )
    assert with_app.returncode == 1, with_app.stderr
    letter_line = next(line for line in with_app.stdout.splitlines() if line.startswith("letter"))
    assert letter_line.split()[-1] == "no"
    assert "not registered by" in with_app.stdout
