"""The `saga` command's operator guardrails: a ceiling set where there was none is a
lowering, and an actor is never blank."""

from __future__ import annotations

import getpass
import os
from pathlib import Path

import cli_app
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
