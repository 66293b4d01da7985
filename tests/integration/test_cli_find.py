"""Finding a saga by its business key (`saga list --key`, every ID argument, the
`orch.list(key=...)` of both doors) and `saga history`, run for real against PostgreSQL."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from types import SimpleNamespace

import cli_app
import psycopg
import pytest
from cli_app import Job
from support import OrchestratorFactory
from test_cli import _one_line_error, _park_unknown, saga_cmd

from saga import AsyncOrchestrator
from saga._db._store_base import QUERIES

# A key as a booking system writes it: with colons, as the operator is paged about it.
TRIP = "trip:crashB-013"


def test_show_history_and_verbs_take_a_business_key(
    make_orch: OrchestratorFactory, database_url: str, app_dir: Path
) -> None:
    """`saga show KEY`, `saga history KEY` and a verb (cancel) find the saga by its key
    (one with colons); history prints who acted, and --json is one document whose events
    are the saga's audit trail."""
    orch = make_orch(*cli_app.SAGAS)
    other = orch.start(cli_app.shop, Job(order_id="trip:crashB-014")).id
    saga_id = _park_unknown(orch, TRIP)

    before = saga_cmd("show", "--database-url", database_url, TRIP)
    assert before.returncode == 0, before.stderr
    assert before.stdout.split()[:2] == ["saga", saga_id] and other not in before.stdout

    cancelled = saga_cmd(
        "cancel",
        *("--app", "cli_app", "--database-url", database_url, TRIP),
        *("--reason", "paged about it", "--include-unknown", "--actor", "oncall-ana"),
        app_dir=app_dir,
    )
    assert cancelled.returncode in (0, 1), cancelled.stdout + cancelled.stderr
    assert f"cancelled saga {saga_id}, by oncall-ana" in cancelled.stdout

    text = saga_cmd("history", "--database-url", database_url, TRIP)
    assert text.returncode == 0, text.stderr
    head, columns, *rows = text.stdout.splitlines()
    assert head == f"saga {saga_id}  shop v1  tenant acme  key {TRIP}  {orch.get(saga_id).status}"
    assert columns.split() == ["AT", "EVENT", "OPERATION", "TOOK", "ACTOR", "DETAIL"]
    cancel_row = next(row for row in rows if " cancel_requested " in row)
    assert "oncall-ana" in cancel_row and 'reason="paged about it"' in cancel_row
    assert len(rows) == len(orch.history(saga_id))

    as_json = saga_cmd("history", "--database-url", database_url, "--json", TRIP)
    assert as_json.returncode == 0, as_json.stderr
    document = json.loads(as_json.stdout)
    assert {k: document[k] for k in ("id", "saga", "version", "tenant_id", "key")} == {
        "id": saga_id,
        "saga": "shop",
        "version": 1,
        "tenant_id": "acme",
        "key": TRIP,
    }
    history = orch.history(saga_id)
    assert [(e["event"], e["step"], e["kind"], e["attempt"]) for e in document["events"]] == [
        (e.event, e.step, e.kind, e.attempt) for e in history
    ]
    assert [e["detail"] for e in document["events"]] == [e.detail for e in history]
    assert document["events"][0]["at"] == history[0].at.isoformat()
    cancel = next(e for e in document["events"] if e["event"] == "cancel_requested")
    assert cancel["actor"] == "oncall-ana" and cancel["detail"]["reason"] == "paged about it"
    started = next(e for e in document["events"] if e["event"] == "attempt_started")
    assert started["actor"] is None and started["step"] == "reserve" and started["attempt"] == 1

    # The full id, as before.
    by_id = saga_cmd("history", "--database-url", database_url, "--json", saga_id)
    assert by_id.returncode == 0 and json.loads(by_id.stdout) == document


def test_a_key_of_several_sagas_lists_them_and_exits_2(
    make_orch: OrchestratorFactory, database_url: str, app_dir: Path
) -> None:
    """The same key in two tenants: show and history list both (id, saga, version,
    tenant, status) and exit 2, changing nothing; `saga list --key` finds both, and
    --tenant narrows to one; a key nothing has exits 1 saying so."""
    orch = make_orch(*cli_app.SAGAS)
    acme = _park_unknown(orch, "crashB-013")
    beta = orch.start(cli_app.shop, Job(order_id="crashB-013", tenant_id="beta")).id
    orch.start(cli_app.shop, Job(order_id="crashB-0130"))

    for verb in ("show", "history"):
        result = saga_cmd(verb, "--database-url", database_url, "crashB-013")
        assert result.returncode == 2, result.stdout + result.stderr
        assert result.stdout == ""
        lead, columns, *rows = result.stderr.strip().splitlines()
        assert lead == (
            f"saga: {verb}: 'crashB-013' is the key of 2 sagas: give the full id of the one "
            "you mean"
        )
        assert columns.split() == ["ID", "SAGA", "VERSION", "TENANT", "STATUS", "MATCHED", "BY"]
        assert [row.split() for row in rows] == [
            [beta, "shop", "1", "beta", "pending", "key"],
            [acme, "shop", "1", "acme", "needs_review", "key"],
        ]

    listed = saga_cmd("list", "--database-url", database_url, "--key", "crashB-013", "--json")
    assert listed.returncode == 0, listed.stderr
    assert [json.loads(line)["id"] for line in listed.stdout.splitlines()] == [beta, acme]
    narrowed = saga_cmd(
        "list", "--database-url", database_url, "--key", "crashB-013", "--tenant", "beta"
    )
    assert [line.split()[0] for line in narrowed.stdout.splitlines()[1:]] == [beta]
    one = saga_cmd("show", "--database-url", database_url, "--json", "crashB-0130")
    assert one.returncode == 0 and json.loads(one.stdout)["key"] == "crashB-0130"

    missing = saga_cmd("show", "--database-url", database_url, "crashB-999")
    assert missing.returncode == 1
    assert _one_line_error(missing) == "saga: no saga has the id or the key 'crashB-999'"


def test_a_key_that_is_also_an_id_prefix_is_ambiguous_and_a_full_id_wins(
    make_orch: OrchestratorFactory, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`abcd1111` is the start of one saga's id and the whole key of another: both are
    listed, exit 2. A full id still names its own saga even when it is another saga's
    key; a uuid that is no saga's id but is a key finds the saga of that key."""
    orch = make_orch(*cli_app.SAGAS)
    forced = iter(["abcd1111"])
    ids = SimpleNamespace(uuid4=lambda: uuid.UUID(next(forced) + uuid.uuid4().hex[8:]))
    with monkeypatch.context() as patch:
        patch.setattr("saga._flows.verbs.uuid", ids)
        by_id = orch.start(cli_app.shop, Job(order_id="o-first")).id
    by_key = orch.start(cli_app.shop, Job(order_id="abcd1111")).id
    keyed_by_id = orch.start(cli_app.shop, Job(order_id=by_id)).id
    event_id = str(uuid.uuid4())
    keyed_by_uuid = orch.start(cli_app.shop, Job(order_id=event_id)).id

    both = saga_cmd("show", "--database-url", database_url, "abcd1111")
    assert both.returncode == 2, both.stdout + both.stderr
    lead, _, *rows = both.stderr.strip().splitlines()
    assert "'abcd1111' is the key of 1 saga and the start of 1 saga id" in lead
    assert [(row.split()[0], row.split()[-2:]) for row in rows] == [
        (by_key, ["pending", "key"]),
        (by_id, ["id", "prefix"]),
    ]

    full = saga_cmd("show", "--database-url", database_url, "--json", by_id)
    assert full.returncode == 0 and json.loads(full.stdout)["id"] == by_id
    assert keyed_by_id != by_id
    keyed = saga_cmd("show", "--database-url", database_url, "--json", event_id)
    assert keyed.returncode == 0 and json.loads(keyed.stdout)["id"] == keyed_by_uuid
    # A longer prefix of the id than the key names the saga by its id alone.
    longer = saga_cmd("show", "--database-url", database_url, "--json", by_id[:10])
    assert longer.returncode == 0 and json.loads(longer.stdout)["id"] == by_id


def test_list_by_key_in_both_doors(make_orch: OrchestratorFactory, database_url: str) -> None:
    """`orch.list(key=..., tenant=...)` of Orchestrator and AsyncOrchestrator: the sagas
    of that exact key, newest first, with the other filters still applying."""
    orch = make_orch(*cli_app.SAGAS)
    acme = orch.start(cli_app.shop, Job(order_id=TRIP)).id
    beta = orch.start(cli_app.shop, Job(order_id=TRIP, tenant_id="beta")).id
    orch.start(cli_app.shop, Job(order_id=TRIP + ":x"))

    assert [s.id for s in orch.list(key=TRIP)] == [beta, acme]
    assert [s.id for s in orch.list(key=TRIP, tenant="acme")] == [acme]
    assert [s.id for s in orch.list("pending", "shop", "beta", 10, key=TRIP)] == [beta]
    assert orch.list(key=TRIP, status="completed") == []
    assert orch.list(key="trip:crashB") == []
    with pytest.raises(ValueError, match="key must be a string"):
        orch.list(key=13)  # type: ignore[arg-type]

    async def main() -> tuple[list[str], list[str]]:
        door = AsyncOrchestrator(database_url, sagas=list(cli_app.SAGAS))
        try:
            every = await door.list(key=TRIP)
            one = await door.list(key=TRIP, tenant="beta", limit=5)
            return [s.id for s in every], [s.id for s in one]
        finally:
            await door.close()

    assert asyncio.run(main()) == ([beta, acme], [beta])


def test_the_key_lookups_read_through_the_key_index(database_url: str) -> None:
    """On a table of 20,000 finished sagas, the lookups by key (the list's and the one
    behind every ID argument) use the index sagas_key (migration 0024), never a scan."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO saga.sagas (id, name, version, tenant_id, key, input, input_hash,"
            " status, finished_at)"
            " SELECT gen_random_uuid(), 'shop', 1, 't' || (i % 50), 'order:' || i, '{}',"
            " 'h', 'completed', now() FROM generate_series(1, 20000) AS i"
        )
        conn.execute("ANALYZE saga.sagas")
        params = {
            "key": "order:77",
            "status": None,
            "name": None,
            "tenant_id": None,
            "older_than_seconds": None,
            "limit": 11,
        }
        for name in ("list_sagas_by_key", "saga_refs_by_key"):
            query = QUERIES[name]
            with conn.cursor() as cur:
                plan = "\n".join(
                    row[0] for row in cur.execute(b"EXPLAIN " + query.encode(), params)
                )
            assert "sagas_key" in plan and "Seq Scan" not in plan, plan
