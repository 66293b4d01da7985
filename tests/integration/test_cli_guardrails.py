"""The `saga` command's guardrail verbs: preview, confirm, raising ceilings, purge."""

from __future__ import annotations

import json
from pathlib import Path

import cli_app
import psycopg
from cli_app import Job
from support import OrchestratorFactory
from test_cli import saga_cmd

KEY = "cli-test-key"


def test_preview_then_confirm_runs_the_approved_request(
    make_orch: OrchestratorFactory, database_url: str, app_dir: Path
) -> None:
    """preview shows the pending request and its hash; confirm signs an approval with the
    configured key and, with --run, the saga goes on; the ceiling then parks it and
    retry --max-operations raises it."""
    orch = make_orch(*cli_app.SAGAS)
    saga_id = orch.execute(cli_app.refund_saga, Job(order_id="r-1", plan="large")).id
    assert orch.get(saga_id).status == "awaiting_confirmation"

    shown = saga_cmd("preview", "--database-url", database_url, saga_id, "--json")
    assert shown.returncode == 0, shown.stderr
    pending = json.loads(shown.stdout)
    assert pending["step"] == "pay_back"
    assert pending["preview"]["payload"]["order_id"] == "r-1"
    request_hash = pending["request_hash"]
    assert pending["preview"]["attempt"] == 1
    text = saga_cmd("preview", "--database-url", database_url, saga_id)
    assert text.returncode == 0, text.stderr
    assert f"request hash: {request_hash}" in text.stdout
    assert "attempt:      1 (an approval releases this attempt only)" in text.stdout
    assert f"saga confirm {saga_id} pay_back {request_hash}" in text.stdout

    common = ("--database-url", database_url, "--app", "cli_app", "--actor", "ops@example")
    no_key = saga_cmd("confirm", *common, saga_id, "pay_back", request_hash, app_dir=app_dir)
    assert no_key.returncode == 1
    assert "confirmation key" in no_key.stderr and "Traceback" not in no_key.stderr
    assert cli_app.calls() == []

    wrong = saga_cmd(
        "confirm",
        *common,
        saga_id,
        "pay_back",
        "f" * 64,
        app_dir=app_dir,
        SAGA_CONFIRMATION_KEY=KEY,
    )
    assert wrong.returncode == 1 and "does not match" in wrong.stderr

    confirmed = saga_cmd(
        "confirm",
        *common,
        "--run",
        saga_id,
        "pay_back",
        request_hash,
        app_dir=app_dir,
        SAGA_CONFIRMATION_KEY=KEY,
    )
    # pay_back runs; receipt would be the second operation: the ceiling of 1 parks it.
    assert confirmed.returncode == 1, confirmed.stderr
    assert "max_operations" in confirmed.stdout
    assert [c[0] for c in cli_app.calls()] == ["pay_back"]

    raised = saga_cmd("retry", *common, "--run", "--max-operations", "2", saga_id, app_dir=app_dir)
    assert raised.returncode == 0, raised.stderr
    assert "max_operations=2" in raised.stdout
    assert orch.get(saga_id).status == "completed"
    assert [c[0] for c in cli_app.calls()] == ["pay_back", "receipt"]


def test_purge_keeps_what_the_retention_protects(
    make_orch: OrchestratorFactory, database_url: str, app_dir: Path
) -> None:
    """purge deletes ended sagas older than the retention and nothing else."""
    orch = make_orch(*cli_app.SAGAS)
    old = orch.execute(cli_app.shop, Job(order_id="old")).id
    assert orch.get(old).status == "completed"
    parked = orch.execute(cli_app.refund_saga, Job(order_id="parked")).id
    assert orch.get(parked).status == "needs_review"
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            "UPDATE saga.sagas SET finished_at = now() - interval '40 days',"
            " updated_at = now() - interval '40 days' WHERE id = %s",
            (old,),
        )
        conn.execute(
            "UPDATE saga.sagas SET updated_at = now() - interval '400 days' WHERE id = %s",
            (parked,),
        )
    short = saga_cmd("purge", "--database-url", database_url, "--older-than", "1d")
    assert short.returncode == 2 and "retention" in short.stderr
    purged = saga_cmd("purge", "--database-url", database_url)
    assert purged.returncode == 0, purged.stderr
    assert "purged 1" in purged.stdout
    assert {s.id for s in orch.list()} == {parked}


def test_list_says_which_sagas_wait_for_a_worker_that_knows_them(
    make_orch: OrchestratorFactory, database_url: str
) -> None:
    """A saga whose kind no live worker runs is shown as waiting for a worker."""
    orch = make_orch(*cli_app.SAGAS)
    saga_id = orch.start(cli_app.parcel, Job(order_id="p-1")).id

    table = saga_cmd("list", "--database-url", database_url)
    assert table.returncode == 0, table.stderr
    line = next(row for row in table.stdout.splitlines() if row.startswith(saga_id))
    assert "waiting for a worker: no live worker runs parcel v1" in line

    rows = [
        json.loads(row)
        for row in saga_cmd("list", "--database-url", database_url, "--json").stdout.splitlines()
    ]
    assert [(r["id"], r["waiting_for_worker"]) for r in rows] == [(saga_id, True)]
