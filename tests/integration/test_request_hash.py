"""One request, one hash: request hashes are SHA-256 over RFC 8785 canonical JSON (hash
version 2), so JSON numbers that are equal (4200 and 4200.0) are one request in every
door; every stored row records its hash version, and rows hashed before (version 1:
Python's json with sorted keys) keep verifying under theirs after an upgrade."""

from __future__ import annotations

import hashlib
import json
import uuid
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb
from pydantic import BaseModel
from support import OrchestratorFactory, scalar

from saga import IdempotencyConflict, Orchestrator, Saga, StepContext, durable_step
from saga._db._store_base import sql
from saga._db.database import connection_kwargs
from saga.durable import isolated_steps
from saga.ledger import CHANNEL_SAGA


def _v1_hash(fields: dict[str, Any]) -> str:
    """The request hash as releases before hash versions computed it (version 1)."""
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _as_written_before(
    url: str, table: str, where: str, params: dict[str, Any], digest: str
) -> None:
    """Turn rows back into what a release before hash versions wrote: a version 1 hash,
    and (the column's default for such a release) hash_version 1."""
    column = "input_hash" if table == "sagas" else "request_hash"
    with psycopg.connect(url, autocommit=True) as conn:
        updated = conn.execute(
            f"UPDATE saga.{table} SET {column} = %(digest)s, hash_version = 1 WHERE {where}",
            {**params, "digest": digest},
        ).rowcount
    assert updated == 1


# ----- the ledger -------------------------------------------------------------------------


def test_a_ledger_call_claimed_with_4200_then_4200_0_is_one_call(database_url: str) -> None:
    with Orchestrator(database_url) as orch:
        claim = orch.ledger.claim("run-1", "charge:o-1", "charge", {"amount_cents": 4200})
        orch.ledger.complete(claim, {"charge_id": 7})
        again = orch.ledger.claim("run-1", "charge:o-1", "charge", {"amount_cents": 4200.0})
        assert (again.status, again.result) == ("replayed", {"charge_id": 7})
        assert again.request_hash == claim.request_hash
        with pytest.raises(IdempotencyConflict, match="other deduplicated fields"):
            orch.ledger.claim("run-1", "charge:o-1", "charge", {"amount_cents": 4201})
    assert scalar(database_url, "SELECT hash_version FROM saga.operations") == 2


def test_a_ledger_call_hashed_before_the_upgrade_still_replays(database_url: str) -> None:
    fields = {"amount_cents": 4200.0}
    with Orchestrator(database_url) as orch:
        claim = orch.ledger.claim("run-1", "charge:o-1", "charge", fields)
        orch.ledger.complete(claim, {"charge_id": 7})
    old = _v1_hash({"tool": "charge", "key": "charge:o-1", "fields": fields})
    _as_written_before(database_url, "operations", "step = %(step)s", {"step": claim.step}, old)

    with Orchestrator(database_url) as orch:
        again = orch.ledger.claim("run-1", "charge:o-1", "charge", fields)
        assert (again.status, again.result, again.request_hash) == (
            "replayed",
            {"charge_id": 7},
            old,
        )
        with pytest.raises(IdempotencyConflict):
            orch.ledger.claim("run-1", "charge:o-1", "charge", {"amount_cents": 4300})
    assert scalar(database_url, "SELECT hash_version FROM saga.operations") == 1


def test_rows_a_release_before_hash_versions_writes_are_marked_version_1(
    database_url: str,
) -> None:
    """The write functions are unchanged: a connection that does not say which version it
    hashes under (an older release during a rolling deploy) writes rows marked 1."""
    with Orchestrator(database_url):
        pass  # migrated
    digest = _v1_hash({"tool": "t", "key": "k", "fields": {}})
    with psycopg.connect(database_url, autocommit=True) as conn:
        verdict = conn.execute(
            "SELECT verdict FROM saga.ledger_claim(%s, %s, %s, %s, %s, %s, %s, %s, %s::jsonb, "
            "%s, %s, %s)",
            (
                "",
                CHANNEL_SAGA,
                "old",
                uuid.uuid4(),
                _v1_hash({}),
                "t.old",
                "k",
                digest,
                "{}",
                "old-release",
                30.0,
                3,
            ),
        ).fetchone()
    assert verdict == ("claimed",)
    assert scalar(database_url, "SELECT hash_version FROM saga.operations") == 1
    assert scalar(database_url, "SELECT hash_version FROM saga.sagas") == 1


# ----- sessions ---------------------------------------------------------------------------


def test_a_session_call_with_4200_then_4200_0_under_one_key_is_one_call(
    database_url: str,
) -> None:
    calls: list[float] = []
    with isolated_steps():

        @durable_step(name="charge", key=lambda order_id, amount_cents: order_id)
        def charge(order_id: str, amount_cents: float) -> dict[str, Any]:
            calls.append(amount_cents)
            return {"charged": amount_cents}

        run_id = f"run-{uuid.uuid4()}"
        with Orchestrator(database_url) as orch:
            with orch.session(run_id) as run:
                assert charge("o-1", 4200) == {"charged": 4200}
                assert charge("o-1", 4200.0) == {"charged": 4200}
                assert (run.executed, run.replayed) == (1, 1)
            with orch.session(run_id) as run:  # a later entry: the stored row
                charge("o-1", 4200.0)
                with pytest.raises(IdempotencyConflict, match="with other arguments"):
                    charge("o-1", 4200.5)
    assert calls == [4200]
    assert scalar(database_url, "SELECT hash_version FROM saga.operations") == 2


def test_a_session_call_hashed_before_the_upgrade_still_replays(database_url: str) -> None:
    calls: list[float] = []
    with isolated_steps():

        @durable_step(name="charge", key=lambda order_id, amount_cents: order_id)
        def charge(order_id: str, amount_cents: float) -> dict[str, Any]:
            calls.append(amount_cents)
            return {"charged": amount_cents}

        run_id = f"run-{uuid.uuid4()}"
        with Orchestrator(database_url) as orch, orch.session(run_id):
            charge("o-1", 4200.0)
        arguments = {"order_id": "o-1", "amount_cents": 4200.0}
        old = _v1_hash({"step": "charge", "key": "o-1", "arguments": arguments})
        _as_written_before(database_url, "operations", "kind = 'action'", {}, old)

        with Orchestrator(database_url) as orch, orch.session(run_id) as run:
            assert charge("o-1", 4200.0) == {"charged": 4200}
            assert (run.executed, run.replayed) == (0, 1)
    assert calls == [4200.0]


# ----- declared sagas ---------------------------------------------------------------------


class Invoice(BaseModel):
    invoice_id: str
    lines: dict[str, Any]


def _invoice_saga() -> Saga[Invoice]:
    saga = Saga("invoice", input=Invoice, key=lambda i: i.invoice_id)

    @saga.step
    def bill(ctx: StepContext, i: Invoice) -> dict[str, Any]:
        return {"billed": i.invoice_id}

    return saga


def test_a_saga_started_with_4200_then_4200_0_is_one_saga(
    make_orch: OrchestratorFactory, database_url: str
) -> None:
    saga = _invoice_saga()
    orch = make_orch(saga)
    first = orch.start(saga, Invoice(invoice_id="i-1", lines={"amount_cents": 4200}))
    second = orch.start(saga, Invoice(invoice_id="i-1", lines={"amount_cents": 4200.0}))
    assert (second.id, second.created) == (first.id, False)
    with pytest.raises(IdempotencyConflict, match="different request"):
        orch.start(saga, Invoice(invoice_id="i-1", lines={"amount_cents": 4201}))
    assert scalar(database_url, "SELECT hash_version FROM saga.sagas") == 2
    assert scalar(database_url, "SELECT min(hash_version) FROM saga.operations") == 2


def test_a_saga_started_before_the_upgrade_is_found_again_by_its_old_hash(
    make_orch: OrchestratorFactory, database_url: str
) -> None:
    saga = _invoice_saga()
    orch = make_orch(saga)
    first = orch.start(saga, Invoice(invoice_id="i-1", lines={"amount_cents": 4200.0}))
    old = _v1_hash({"invoice_id": "i-1", "lines": {"amount_cents": 4200.0}})
    _as_written_before(database_url, "sagas", "id = %(id)s", {"id": first.id}, old)

    again = make_orch(saga).start(saga, Invoice(invoice_id="i-1", lines={"amount_cents": 4200.0}))
    assert (again.id, again.created) == (first.id, False)


# ----- approvals --------------------------------------------------------------------------


def test_an_approval_given_before_the_upgrade_still_releases_its_attempt(
    database_url: str,
) -> None:
    """A confirmation asked and approved under hash version 1 (before an upgrade) is found
    under that version by the planner after it: the approved attempt runs, once."""
    calls: list[int] = []
    saga = Saga("payout", input=Invoice, key=lambda i: i.invoice_id)

    @saga.step(confirm=True)
    def pay(ctx: StepContext, i: Invoice) -> dict[str, Any]:
        calls.append(ctx.attempt)
        return {"paid": i.lines["amount_cents"]}

    with Orchestrator(database_url, sagas=[saga], confirmation_key="k") as orch:
        state = orch.execute(saga, Invoice(invoice_id="i-1", lines={"amount_cents": 4200.0}))
        assert state.status == "awaiting_confirmation"
        pending = orch.preview(state.id)
        assert pending is not None
        shown = {k: v for k, v in pending.preview.items() if k != "request_hash"}
        old = _v1_hash({"kind": "confirmation", "preview": shown})
        assert old != pending.request_hash  # 4200.0 is written 4200 under RFC 8785
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(
                "UPDATE saga.confirmations SET request_hash = %s, "
                "preview = jsonb_set(preview, '{request_hash}', to_jsonb(%s::text))",
                (old, old),
            )
        token = orch.approval(state.id, "pay", old, actor="lead@acme")
        orch.confirm(state.id, "pay", old, token)
        done = orch.run(state.id)
        assert (done.status, calls) == ("completed", [1])
        assert [c.consumed_attempt for c in orch.confirmations(state.id)] == [1]


# ----- a request hash changed later (migrations 0023 and 0028) ----------------------------


_SAGA_ROW = {
    "status": "running",
    "direction": "forward",
    "operations_executed": 0,
    "spent": 0,
    "side_effects": 0,
}


def _operation(url: str, version: int) -> uuid.UUID:
    """A saga with one operation whose request hash `h1` was written under `version`."""
    saga_id = uuid.uuid4()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO saga.sagas (id, name, version, tenant_id, key, input, input_hash,"
            " status) VALUES (%s, 'invoice', 1, '', %s, '{}', 'i', 'running')",
            (saga_id, str(saga_id)),
        )
        conn.execute(
            "INSERT INTO saga.operations (saga_id, step, kind, position, idempotency_key,"
            " request_hash, max_attempts, hash_version)"
            " VALUES (%s, 'bill', 'action', 0, %s, 'h1', 3, %s)",
            (saga_id, f"k-{saga_id}", version),
        )
    return saga_id


def _changed_op(request_hash: str) -> dict[str, Any]:
    """The operation `bill` as a write sends it, its request hash changed (prepared again)."""
    return {
        "kind": "action",
        "step": "bill",
        "status": "pending",
        "attempts": 0,
        "max_attempts": 3,
        "request_hash": request_hash,
        "reconcile_asks": 0,
        "retrying_unknown": False,
    }


def _version(url: str, saga_id: uuid.UUID) -> tuple[str, int]:
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT request_hash, hash_version FROM saga.operations WHERE saga_id = %s",
            (saga_id,),
        ).fetchone()
    assert row is not None
    return row[0], row[1]


def test_a_changed_request_hash_takes_the_version_of_whoever_changed_it(
    database_url: str,
) -> None:
    """A request hash changed by a release that does not know hash versions (through its
    write function, or a plain UPDATE, on a connection that says no version) is marked 1;
    one changed by this release (its session or its statement says 2, direct or through a
    pooler) is marked 2, in the state the write reads back too; an update that leaves the
    hash as it is leaves its version."""
    with Orchestrator(database_url):
        pass  # migrated

    # An older release's worker: saga.write_saga_v3 (migration 0011), no version said.
    older = _operation(database_url, 2)
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            "SELECT saga.write_saga_v3(%s)",
            (Jsonb({"saga_id": str(older), "ops": [_changed_op("h-old")]}),),
        )
    assert _version(database_url, older) == ("h-old", 1)

    # A plain UPDATE, without and with the version said.
    plain = _operation(database_url, 2)
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            "UPDATE saga.operations SET request_hash = 'h-plain' WHERE saga_id = %s", (plain,)
        )
    assert _version(database_url, plain) == ("h-plain", 1)
    with psycopg.connect(database_url, autocommit=True, options="-c saga.hash_version=2") as conn:
        conn.execute(
            "UPDATE saga.operations SET request_hash = 'h-plain-2' WHERE saga_id = %s", (plain,)
        )
    assert _version(database_url, plain) == ("h-plain-2", 2)

    # This release, on a direct connection: the session says 2, the statement does not.
    direct = _operation(database_url, 1)
    write = {
        "saga_id": str(direct),
        "saga": _SAGA_ROW,
        "ops": [_changed_op("h-direct")],
        "return_state": True,
    }
    with psycopg.connect(database_url, autocommit=True, options="-c saga.hash_version=2") as conn:
        row = conn.execute(sql("write_sagas_direct"), {"writes": Jsonb([write])}).fetchone()
    assert row is not None
    [answer] = row[0]
    assert [op["hash_version"] for op in answer["state"]["operations"]] == [2]
    assert _version(database_url, direct) == ("h-direct", 2)

    # Through a pooler: the statement says 2 (saga.hashed_under), the session nothing.
    pooled = _operation(database_url, 1)
    write = {"saga_id": str(pooled), "saga": _SAGA_ROW, "ops": [_changed_op("h-pooled")]}
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(sql("write_sagas"), {"writes": Jsonb([write])})
        conn.execute(
            sql("write_saga"),
            {"write": Jsonb({"saga_id": str(pooled), "ops": [_changed_op("h-pooled-2")]})},
        )
    assert _version(database_url, pooled) == ("h-pooled-2", 2)

    # The hash sent again as it is: the row keeps the version it was hashed under.
    kept = _operation(database_url, 1)
    write = {"saga_id": str(kept), "saga": _SAGA_ROW, "ops": [_changed_op("h1")]}
    with psycopg.connect(database_url, autocommit=True, options="-c saga.hash_version=2") as conn:
        conn.execute(sql("write_sagas_direct"), {"writes": Jsonb([write])})
    assert _version(database_url, kept) == ("h1", 1)


def test_updating_operations_takes_no_row_lock_for_a_trigger(database_url: str) -> None:
    """No row-level BEFORE UPDATE trigger on saga.operations (migration 0028): the executor
    locks each row it updates for one (one more WAL record a row), whatever the trigger's
    columns and WHEN clause, and a saga's writes update its operation rows six times."""
    with Orchestrator(database_url):
        pass  # migrated
    with psycopg.connect(database_url) as conn:
        before_update_row = conn.execute(
            "SELECT tgname FROM pg_trigger WHERE tgrelid = 'saga.operations'::regclass"
            " AND tgtype & 1 = 1 AND tgtype & 2 = 2 AND tgtype & 16 = 16"
        ).fetchall()
    assert before_update_row == []


def test_the_statements_say_the_version_when_the_session_does_not(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a direct connection the session says the version and the statements leave it
    out; a pooler that passes for a direct connection may drop the startup options, and
    then the store, finding its session saying nothing, keeps saying it in each statement:
    the rows are marked 2 either way."""
    import saga._db.pool as pool_module

    saga = _invoice_saga()
    with Orchestrator(database_url, sagas=[saga]) as orch:
        assert orch.store.session_hash_version is True
        orch.execute(saga, Invoice(invoice_id="i-1", lines={}))

    def options_dropped(*args: Any, **kwargs: Any) -> dict[str, Any]:
        given = connection_kwargs(*args, **kwargs)
        given.pop("options", None)
        return given

    monkeypatch.setattr(pool_module, "connection_kwargs", options_dropped)
    with Orchestrator(database_url, sagas=[saga]) as orch:
        assert orch.store.session_hash_version is False
        orch.execute(saga, Invoice(invoice_id="i-2", lines={}))
    assert scalar(database_url, "SELECT min(hash_version) FROM saga.sagas") == 2
    assert scalar(database_url, "SELECT min(hash_version) FROM saga.operations") == 2
