"""The `saga` command's operator guardrails: a ceiling set where there was none is a
lowering, an actor is never blank, and `purge` keeps what the app's retention keeps."""

from __future__ import annotations

import getpass
import os
from pathlib import Path

import cli_app
import psycopg
import pytest
from cli_app import Job
from support import OrchestratorFactory
from test_cli import _one_line_error, _park_unknown, _rows, saga_cmd


def _os_user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no login name in some containers
        return f"uid-{os.getuid()}"


# ----- item 9: unlimited is the highest ceiling ---------------------------------------------


@pytest.mark.parametrize(
    ("option", "value", "ceiling"),
    [
        ("--max-operations", "1", "max_operations"),
        ("--max-side-effects", "0", "max_side_effects"),
        ("--spend-budget", "5", "spend_budget"),
    ],
)
def test_retry_refuses_to_set_a_ceiling_the_saga_does_not_have(
    make_orch: OrchestratorFactory,
    database_url: str,
    app_dir: Path,
    option: str,
    value: str,
    ceiling: str,
) -> None:
    """shop has no saga ceilings: `retry --max-operations 1` (or --max-side-effects 0, or a
    spend budget) would lower unlimited to a limit. Refused on stderr, exit 1, nothing
    written; the saga stays parked."""
    orch = make_orch(*cli_app.SAGAS)
    saga_id = _park_unknown(orch, "o-u")
    before = _rows(database_url)

    refused = saga_cmd(
        "retry",
        "--app",
        "cli_app",
        "--database-url",
        database_url,
        saga_id,
        option,
        value,
        "--run",
        app_dir=app_dir,
    )
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert _one_line_error(refused) == (
        f"saga: refused: {ceiling} can only be raised: it is unlimited, not {value}"
    )
    assert "raised ceilings" not in refused.stdout
    assert _rows(database_url) == before
    assert orch.get(saga_id).status == "needs_review"


# ----- item 10: an actor is never blank ------------------------------------------------------


@pytest.mark.parametrize(
    "verb",
    [
        ["retry", "--extra-attempts", "1"],
        ["resolve", "--succeeded", "--result", '{"charge_id": "ch_1"}'],
        ["compensate"],
        ["cancel", "--reason", "customer asked"],
        ["retry", "--max-operations", "100"],
        ["confirm"],
    ],
    ids=["retry", "resolve", "compensate", "cancel", "raise", "confirm"],
)
@pytest.mark.parametrize("blank", ["", "  "])
def test_a_blank_actor_is_refused_before_anything_is_written(
    make_orch: OrchestratorFactory,
    database_url: str,
    app_dir: Path,
    verb: list[str],
    blank: str,
) -> None:
    """`--actor ""` (or blanks) names nobody: every mutating command refuses it as a usage
    error (exit 2) instead of recording it or quietly using the OS user."""
    orch = make_orch(*cli_app.SAGAS)
    saga_id = _park_unknown(orch, "o-b")
    before = _rows(database_url)
    name, *options = verb
    positional = [saga_id]
    if name == "resolve":
        positional.append("charge")
    if name == "confirm":
        positional += ["charge", "0" * 64]

    refused = saga_cmd(
        name,
        "--app",
        "cli_app",
        "--database-url",
        database_url,
        *positional,
        *options,
        "--actor",
        blank,
        app_dir=app_dir,
        SAGA_CONFIRMATION_KEY="cli-test-key",
    )
    assert refused.returncode == 2, refused.stdout + refused.stderr
    line = _one_line_error(refused)
    assert line.startswith(f"saga: {name}: --actor ") and "audit trail" in line, line
    assert _rows(database_url) == before


def test_without_actor_the_command_records_the_os_user(
    make_orch: OrchestratorFactory, database_url: str, app_dir: Path
) -> None:
    """The command's default actor stays the OS user running it."""
    orch = make_orch(*cli_app.SAGAS)
    saga_id = orch.start(cli_app.parcel, Job(order_id="o-os")).id
    done = saga_cmd(
        "cancel",
        "--app",
        "cli_app",
        "--database-url",
        database_url,
        saga_id,
        "--reason",
        "customer asked",
        app_dir=app_dir,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    event = next(e for e in orch.history(saga_id) if e.event == "cancel_requested")
    assert event.detail["actor"] == _os_user()


# ----- item 11: purge honours the app's retention -------------------------------------------


def _ended(orch_url: str, saga_id: str, days: int) -> None:
    with psycopg.connect(orch_url, autocommit=True) as conn:
        conn.execute(
            "UPDATE saga.sagas SET finished_at = now() - make_interval(days => %s),"
            " updated_at = now() - make_interval(days => %s) WHERE id = %s",
            (days, days, saga_id),
        )


def test_purge_uses_the_retention_of_the_app(
    make_orch: OrchestratorFactory, database_url: str, app_dir: Path
) -> None:
    """With --app, purge keeps what the app's `retention_days=90` keeps: a saga that ended
    40 days ago stays, one that ended 100 days ago goes. It says on stderr which retention
    it applies and where it comes from; --dry-run lists what would go and deletes
    nothing; an explicit --older-than shorter than the app's retention is refused."""
    orch = make_orch(*cli_app.SAGAS)
    forty = orch.execute(cli_app.shop, Job(order_id="forty")).id
    hundred = orch.execute(cli_app.shop, Job(order_id="hundred")).id
    fresh = orch.execute(cli_app.shop, Job(order_id="fresh")).id
    parked = _park_unknown(orch, "parked")
    _ended(database_url, forty, 40)
    _ended(database_url, hundred, 100)
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            "UPDATE saga.sagas SET updated_at = now() - interval '400 days' WHERE id = %s",
            (parked,),
        )
    app = ("--database-url", database_url, "--app", "cli_app_retention")
    before = _rows(database_url)

    planned = saga_cmd("purge", *app, "--dry-run", app_dir=app_dir)
    assert planned.returncode == 0, planned.stdout + planned.stderr
    assert (
        "sagas that ended more than 90 days ago (retention_days of the app's orchestrator"
        in planned.stderr
    ), planned.stderr
    listed = [line for line in planned.stdout.splitlines() if line.startswith(hundred)]
    assert len(listed) == 1, planned.stdout
    assert "shop v1" in listed[0] and "completed" in listed[0]
    finished = orch.get(hundred).finished_at
    assert finished is not None and finished.astimezone().strftime("%Y-%m-%d") in listed[0]
    assert forty not in planned.stdout and fresh not in planned.stdout
    assert parked not in planned.stdout
    assert "would purge 1 ended saga(s)" in planned.stdout
    assert _rows(database_url) == before

    # An explicit cutoff wins when it is longer, and is refused below the app's retention.
    longer = saga_cmd("purge", *app, "--older-than", "150d", "--dry-run", app_dir=app_dir)
    assert longer.returncode == 0, longer.stdout + longer.stderr
    assert "more than 150 days ago (--older-than; the retention is 90 days" in longer.stderr
    assert "nothing to purge" in longer.stdout
    for option, value in (("--older-than", "30d"), ("--retention-days", "30")):
        short = saga_cmd("purge", *app, option, value, app_dir=app_dir)
        assert short.returncode == 2, short.stdout + short.stderr
        line = _one_line_error(short)
        assert option in line and "retention of 90 days" in line, line
    assert _rows(database_url) == before

    purged = saga_cmd("purge", *app, app_dir=app_dir)
    assert purged.returncode == 0, purged.stdout + purged.stderr
    assert (
        "purging sagas that ended more than 90 days ago (retention_days of the app's orchestrator"
        in purged.stderr
    ), purged.stderr
    assert "purged 1 ended saga(s)" in purged.stdout
    assert {s.id for s in orch.list()} == {forty, fresh, parked}


def test_purge_without_an_app_says_it_uses_the_default(
    make_orch: OrchestratorFactory, database_url: str, app_dir: Path
) -> None:
    """Without --app or an explicit retention, purge applies its default of 30 days and
    says so; an explicit --retention-days is named as the source."""
    orch = make_orch(*cli_app.SAGAS)
    forty = orch.execute(cli_app.shop, Job(order_id="forty")).id
    _ended(database_url, forty, 40)
    before = _rows(database_url)

    planned = saga_cmd("purge", "--database-url", database_url, "--dry-run")
    assert planned.returncode == 0, planned.stdout + planned.stderr
    assert "more than 30 days ago (the default retention" in planned.stderr, planned.stderr
    assert forty in planned.stdout
    assert _rows(database_url) == before

    kept = saga_cmd("purge", "--database-url", database_url, "--retention-days", "45")
    assert kept.returncode == 0, kept.stdout + kept.stderr
    assert "more than 45 days ago (--retention-days)" in kept.stderr, kept.stderr
    assert "purged 0" in kept.stdout
    assert {s.id for s in orch.list()} == {forty}
