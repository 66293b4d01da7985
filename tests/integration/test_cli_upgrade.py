"""`saga upgrade` and `saga versions` as a deploy uses them, through the real command.

The app (upgrade_app) registers `signup` v1 and v2; a v1 signup parked with its `mail`
step's outcome unknown is moved onto v2, then finished by v2's code.
"""

from __future__ import annotations

import json
from pathlib import Path

from cli_app import calls
from support import OrchestratorFactory, scalar
from test_cli import _rows, saga_cmd
from test_upgrade_in_flight import stuck_signup
from upgrade_app import signup_v1, signup_v2

APP = ["--app", "upgrade_app:orch"]


def test_upgrade_refuses_then_dry_runs_then_upgrades(
    make_orch: OrchestratorFactory, database_url: str, app_dir: Path
) -> None:
    """Without --map the step that took effect has nowhere to go: refused, exit 1, nothing
    written. --dry-run shows the moves and writes nothing; the upgrade then makes them,
    and `saga retry --run` finishes the saga under v2 without creating the account
    again."""
    saga_id = stuck_signup(make_orch(signup_v1, signup_v2), "c-1")
    db = ["--database-url", database_url, "--actor", "alice"]
    before = _rows(database_url)

    refused = saga_cmd("upgrade", *APP, *db, saga_id, "--to", "2", app_dir=app_dir)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert refused.stdout.splitlines() == [
        f"refused: saga {saga_id} (signup) stays at v1, not upgraded to v2:",
        "  - step 'account' succeeded and version 2 has no step 'account': map it onto the "
        "step that carries its effect (--map account=NEW)",
    ]
    assert _rows(database_url) == before

    mapped = ["--to", "2", "--map", "account=create_account"]
    dry = saga_cmd("upgrade", *APP, *db, saga_id[:8], *mapped, "--dry-run", app_dir=app_dir)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    lines = dry.stdout.splitlines()
    assert lines[0] == (
        f"dry run: saga {saga_id} (signup) can be upgraded from v1 to v2; nothing was changed"
    )
    assert [line.split() for line in lines[1:]] == [
        ["STEP", "MOVE", "WAS", "STATUS", "ATTEMPTS", "KEY"],
        ["create_account", "kept", "account", "succeeded", "1", "signup:v1:acme:c-1:account"],
        ["mail", "kept", "-", "unknown", "1", "signup:v1:acme:c-1:mail"],
        ["trial", "added", "-", "pending", "0", "signup:v2:acme:c-1:trial"],
    ]
    assert _rows(database_url) == before

    done = saga_cmd("upgrade", *APP, *db, saga_id, *mapped, app_dir=app_dir)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout.splitlines()
    assert out[0] == f"upgraded saga {saga_id} (signup) from v1 to v2, by alice"
    assert out[1:][:4] == lines[1:5]
    assert out[-1] == (
        f"saga {saga_id} stays needs_review: resume it under v2 with `saga retry {saga_id}`"
    )
    history = saga_cmd("show", "--database-url", database_url, "--json", saga_id)
    upgraded = [e for e in json.loads(history.stdout)["history"] if e["event"] == "saga_upgraded"]
    assert [e["detail"]["actor"] for e in upgraded] == ["alice"]
    shown = saga_cmd("show", "--database-url", database_url, saga_id)
    assert shown.returncode == 0, shown.stderr
    line = next(x for x in shown.stdout.splitlines() if "saga_upgraded" in x)
    assert "actor=alice fence=2 to_version=2 from_version=1 renamed_steps=" in line, line

    resumed = saga_cmd("retry", *APP, *db, saga_id, "--run", app_dir=app_dir)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"saga {saga_id} is completed" in resumed.stdout
    assert [name for name, order, _ in calls() if order == "c-1"] == [
        "v1:account",
        "v1:mail",
        "v2:mail:signup:v1:acme:c-1:mail",
        "v2:trial",
    ]


def test_a_batch_reports_each_saga_and_fails_when_one_is_refused(
    make_orch: OrchestratorFactory, database_url: str, app_dir: Path
) -> None:
    """--saga and --version select the batch; a saga a live worker holds is refused
    (naming the holder) and the others are upgraded all the same; exit code 1. Before,
    `saga versions` with an app that registers only v2 exits 1 (a pre-deploy gate);
    once the last v1 saga is upgraded, 0."""
    orch = make_orch(signup_v1, signup_v2)
    first, held = stuck_signup(orch, "b-1"), stuck_signup(orch, "b-2")
    scalar(
        database_url,
        "UPDATE saga.sagas SET lease_owner = 'worker-9', lease_expires_at = now() + "
        "interval '1 minute' WHERE id = %s RETURNING 1",
        (held,),
    )
    db = ["--database-url", database_url]
    gate = ["versions", "--app", "upgrade_app:only_v2", *db]
    blocked = saga_cmd(*gate, app_dir=app_dir)
    assert blocked.returncode == 1, blocked.stdout + blocked.stderr
    assert "not registered by upgrade_app:only_v2 (signup v1)" in blocked.stdout
    assert saga_cmd("versions", *APP, *db, app_dir=app_dir).returncode == 0

    batch = [*APP, *db, "--saga", "signup", "--version", "1", "--to", "2"]
    result = saga_cmd(
        "upgrade", *batch, "--map", "account=create_account", "--json", app_dir=app_dir
    )
    assert result.returncode == 1, result.stdout + result.stderr
    *sagas, summary = [json.loads(line) for line in result.stdout.splitlines()]
    by_id = {s["id"]: s for s in sagas}
    assert by_id[first]["upgraded"] is True and by_id[first]["reasons"] == []
    assert by_id[held]["upgraded"] is False
    assert "worker-9 holds its lease" in by_id[held]["reasons"][0]
    assert summary == {
        "summary": True,
        "command": "upgrade",
        "dry_run": False,
        "allowed": 1,
        "upgraded": 1,
        "refused": 1,
    }
    assert scalar(database_url, "SELECT version FROM saga.sagas WHERE id = %s", (held,)) == 1

    scalar(database_url, "UPDATE saga.sagas SET lease_owner = NULL RETURNING 1")
    again = saga_cmd("upgrade", *batch, "--map", "account=create_account", app_dir=app_dir)
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.splitlines()[-1] == (
        "upgrade: 1 saga(s) of signup v1 selected, 1 upgraded to v2, 0 refused"
    )
    assert saga_cmd(*gate, app_dir=app_dir).returncode == 0


def test_an_async_app_upgrades_the_same_way(
    make_orch: OrchestratorFactory, database_url: str, app_dir: Path
) -> None:
    """With an AsyncOrchestrator app the command plans and upgrades alike."""
    saga_id = stuck_signup(make_orch(signup_v1, signup_v2), "a-1")
    args = ["--app", "upgrade_app:aorch", "--database-url", database_url, saga_id, "--to", "2"]
    mapped = [*args, "--map", "account=create_account", "--json"]

    dry = saga_cmd("upgrade", *mapped, "--dry-run", app_dir=app_dir)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    plan, summary = [json.loads(line) for line in dry.stdout.splitlines()]
    assert (plan["allowed"], plan["upgraded"]) == (True, False)
    assert (summary["allowed"], summary["upgraded"], summary["refused"]) == (1, 0, 0)

    done = saga_cmd("upgrade", *mapped, app_dir=app_dir)
    assert done.returncode == 0, done.stdout + done.stderr
    made = json.loads(done.stdout.splitlines()[0])
    assert made["upgraded"] is True
    assert [(m["move"], m["to"], m["key"]) for m in made["moves"]] == [
        ("kept", "create_account", "signup:v1:acme:a-1:account"),
        ("kept", "mail", "signup:v1:acme:a-1:mail"),
        ("added", "trial", "signup:v2:acme:a-1:trial"),
    ]
    assert scalar(database_url, "SELECT version FROM saga.sagas WHERE id = %s", (saga_id,)) == 2


def test_usage_errors_exit_2_before_anything_is_read(database_url: str) -> None:
    """A --map that is not OLD=NEW, the same step mapped twice, a batch flag beside an
    ID, or neither an ID nor --saga and --version: exit 2, one line saying what is wrong."""
    base = ["upgrade", "--database-url", database_url, "--to", "2"]
    cases = [
        ([*base, "x", "--map", "account"], "expected OLD=NEW (two step names), got 'account'"),
        ([*base, "x", "--map", "a=b", "--map", "a=c"], "--map a=... is given twice: a=b, a=c"),
        ([*base, "x", "--saga", "signup"], "--saga select a batch; they do not go with a saga ID"),
        ([*base, "--saga", "signup"], "give a saga ID, or select a batch with --saga NAME and"),
    ]
    for args, message in cases:
        result = saga_cmd(*args)
        assert result.returncode == 2, (args, result.stdout, result.stderr)
        assert message in result.stderr, result.stderr
