"""`saga show` tells an operation an attempt timed from one a person settled or a fork
inherited: its LAST TOOK column says `resolved by X` or `inherited from SOURCE`, never
the minutes a human took, or another saga's timing, as if it were the provider's."""

from __future__ import annotations

import re
from pathlib import Path

import cli_app
from support import OrchestratorFactory
from test_cli import _park_unknown, saga_cmd
from test_cli_fork import _fork, _park_at_notify


def _operations(out: str) -> dict[tuple[str, str], dict[str, str]]:
    """The OPERATIONS table of `saga show`: (step, kind) -> column -> cell."""
    table = out.split("\nOPERATIONS\n", 1)[1].split("\n\nTIMELINE", 1)[0]
    header, *lines = table.splitlines()
    names = re.split(r"\s{2,}", header.strip())
    rows = {}
    for line in lines:
        cells = dict(zip(names, re.split(r"\s{2,}", line.strip()), strict=False))
        rows[(cells["STEP"], cells["KIND"])] = cells
    return rows


def test_show_says_who_resolved_a_step_instead_of_how_long_it_took(
    make_orch: OrchestratorFactory, database_url: str, app_dir: Path
) -> None:
    """A charge parked with its outcome unknown, settled by alice with `saga resolve`:
    `saga show` says `resolved by alice` where a timed attempt says its seconds."""
    orch = make_orch(*cli_app.SAGAS)
    saga_id = _park_unknown(orch, "o-who")

    # Parked, `saga show` ends with the command lines that take it on, as run here.
    parked = saga_cmd("show", "--database-url", database_url, saga_id)
    assert parked.returncode == 0, parked.stderr
    commands = parked.stdout.split("\nWHAT TO RUN (one of these)\n", 1)[1].splitlines()
    assert [c.strip() for c in commands] == [
        f"saga resolve {saga_id} charge --app MODULE --succeeded --result JSON",
        f"saga resolve {saga_id} charge --app MODULE --failed --reason TEXT",
        f"saga compensate {saga_id} --app MODULE --include-unknown",
    ]
    resolve = commands[0].split()[1:-1]  # without `saga` and the JSON placeholder
    resolve[resolve.index("MODULE")] = "cli_app"
    resolved = saga_cmd(
        *resolve,
        *('{"charge_id": "ch_manual"}', "--actor", "alice", "--database-url", database_url),
        app_dir=app_dir,
    )
    assert resolved.returncode == 0, resolved.stderr

    shown = saga_cmd("show", "--database-url", database_url, saga_id[:8])
    assert "WHAT TO RUN" not in shown.stdout  # no longer parked
    assert shown.returncode == 0, shown.stderr
    ops = _operations(shown.stdout)
    assert ops[("charge", "action")]["STATUS"] == "succeeded"
    assert ops[("charge", "action")]["LAST TOOK"] == "resolved by alice"
    assert re.fullmatch(r"\d+\.\d{3}s", ops[("reserve", "action")]["LAST TOOK"])

    # The saga goes on: the steps after it are timed; the resolved one still says who.
    assert orch.run(saga_id).status == "completed"
    ops = _operations(saga_cmd("show", "--database-url", database_url, saga_id).stdout)
    assert ops[("charge", "action")]["LAST TOOK"] == "resolved by alice"
    assert re.fullmatch(r"\d+\.\d{3}s", ops[("ship", "action")]["LAST TOOK"])


def test_show_labels_a_forks_inherited_steps_with_their_source(
    make_orch: OrchestratorFactory, database_url: str, app_dir: Path
) -> None:
    """A fork's steps inherited from its source say `inherited from SOURCE` (its id's
    first 8 characters) in `saga show`, and in its Mermaid comments instead of
    `never attempted`; the step the fork runs afresh does not."""
    orch = make_orch(*cli_app.SAGAS)
    source = _park_at_notify(orch, "o-inh")
    forked = saga_cmd(*_fork(database_url, source, "--from", "notify"), app_dir=app_dir)
    assert forked.returncode == 0, forked.stdout + forked.stderr
    fork_id = forked.stdout.split()[0]

    shown = saga_cmd("show", "--database-url", database_url, fork_id)
    assert shown.returncode == 0, shown.stderr
    ops = _operations(shown.stdout)
    for step in ("reserve", "charge", "ship"):
        assert ops[(step, "action")]["LAST TOOK"] == f"inherited from {source[:8]}", step
    assert ops[("notify", "action")]["LAST TOOK"] == "-"

    gantt = saga_cmd("show", "--database-url", database_url, fork_id, "--format", "mermaid")
    assert gantt.returncode == 0, gantt.stderr
    assert f"    %% charge: succeeded, inherited from {source[:8]}" in gantt.stdout.splitlines()
    assert "    %% notify: pending, never attempted" in gantt.stdout.splitlines()
