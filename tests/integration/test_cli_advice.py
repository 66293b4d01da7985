"""The advice of the `saga` command leads with the fix of the user who ran it: the real
command in a subprocess."""

from __future__ import annotations

from pathlib import Path

import cli_app
import pytest
from support import OrchestratorFactory
from test_cli import _one_line_error, _park_unknown, saga_cmd

pytestmark = [pytest.mark.integration]


def test_list_without_a_url_says_it_used_the_embedded_database(tmp_path: Path) -> None:
    """`saga list` with neither --database-url nor SAGA_DATABASE_URL runs on the embedded
    PostgreSQL; finding no schema there, it says so first, and how to give a URL, before
    offering `saga migrate` (which used to be all it said: advice to set up a database
    the user never meant to use)."""
    data_dir = tmp_path / "pg"
    result = saga_cmd("list", SAGA_EMBEDDED_DIR=str(data_dir), timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    line = _one_line_error(result)
    assert line.startswith(
        "saga: no database URL is set (--database-url URL, or SAGA_DATABASE_URL), so this "
        f"used the embedded PostgreSQL in {data_dir}, which has no saga schema"
    ), line
    assert line.endswith("or run `saga migrate` to set up the embedded one"), line


def test_resolve_without_app_leads_with_the_app_flag(
    make_orch: OrchestratorFactory, database_url: str, app_dir: Path
) -> None:
    """`saga resolve ... --succeeded` without --app: the first thing said is to pass
    `--app MODULE[:ATTR]`, not `Orchestrator.register()`, which a user of the command has
    no way to call."""
    orch = make_orch(*cli_app.SAGAS)
    saga_id = _park_unknown(orch, "o-r")
    result = saga_cmd("resolve", "--database-url", database_url, saga_id, "charge", "--succeeded")
    assert result.returncode == 2, result.stdout + result.stderr
    line = _one_line_error(result)
    assert line.startswith(
        "saga: resolve: pass --app MODULE[:ATTR] (or set SAGA_APP) naming the module that "
        "registers saga 'shop' version 1"
    ), line
    assert "register()" not in line, line
