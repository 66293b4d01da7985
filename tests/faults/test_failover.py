"""A failover: the primary is killed mid-run and its streaming standby promoted.

With synchronous replication nothing committed is lost: workers connected through a
multi-host URL (`target_session_attrs=read-write`) reconnect to the new primary and
finish every saga. With asynchronous replication the last transitions before the
failover can vanish; the saga then finds its step as it was when the standby last heard
of it, and what it does is safe: the attempt whose outcome record vanished is treated as
unknown and settled by its reconcile hook, and a step whose start vanished too is called
again with the same idempotency key (docs/production.md, "Through a failover")."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from pydantic import BaseModel

from faults import invariants
from faults.harness import WorkerProcess, quiesce, start_sagas, wait_for
from faults.replication import Pair, replicated_pair
from saga import Absent, Found, Orchestrator, Saga, StepContext
from saga._db.migrate import migrate_database

pytestmark = [pytest.mark.integration, pytest.mark.crash]

SAGAS = 40
# How long the standby waits to be promoted after the primary died: the time a failover
# manager (Patroni, pg_auto_failover, a managed service) takes to decide.
PROMOTE_AFTER = 1.0


def _settled(url: str) -> int | None:
    """Sagas settled, as the writable server says; None while there is none."""
    try:
        with psycopg.connect(url) as conn:
            row = conn.execute(
                "SELECT count(*) FROM saga.sagas"
                " WHERE status IN ('completed', 'compensated', 'needs_review')"
            ).fetchone()
    except psycopg.OperationalError:
        return None
    return None if row is None else int(row[0])


def _new_database(pair: Pair, name: str) -> str:
    pair.primary.scalar(f"CREATE DATABASE {name}")
    url = pair.url(name)
    migrate_database(url)
    return url


def test_workers_finish_every_saga_through_a_failover(
    provider_url: str, workers: list[WorkerProcess], private_dir: Path, log_dir: Path
) -> None:
    """Synchronous replication; the primary is SIGKILLed (with every process of it) while
    two workers drive 40 sagas, and the standby promoted a second later: the workers
    reconnect by themselves and finish every saga; 0 duplicates, 0 lost."""
    with replicated_pair(private_dir / "pair", synchronous=True) as pair:
        url = _new_database(pair, "failover_sync")
        keys = start_sagas(url, SAGAS, seed=11, prefix="failover")
        for _ in range(2):
            workers.append(
                WorkerProcess(url, provider_url, log_dir, lease_seconds=2.0, step_delay=0.05)
            )
        wait_for(
            lambda: (_settled(url) or 0) >= SAGAS // 4, timeout=90, what="progress before failover"
        )
        before = _settled(url) or 0
        killed = time.time()
        pair.primary.kill()
        time.sleep(PROMOTE_AFTER)
        pair.standby.promote()
        promoted = time.time()
        for worker in workers:
            assert worker.wait(timeout=180) == 0, worker.output()[-3000:]
        done = time.time()
        with psycopg.connect(url) as conn:
            row = conn.execute(
                "SELECT extract(epoch FROM min(at)) FROM saga.events WHERE at > to_timestamp(%s)",
                (promoted,),
            ).fetchone()
        assert row is not None and row[0] is not None
        first_write = float(row[0])
        quiesce(url, timeout=30)  # nothing left: the workers finished it all
        summary = invariants.check(url, provider_url, keys)
        print(
            invariants.table(
                summary,
                settled_before_kill=before,
                promoted_after_s=round(promoted - killed, 2),
                first_write_after_kill_s=round(first_write - killed, 2),
                first_write_after_promotion_s=round(first_write - promoted, 2),
                all_done_after_kill_s=round(done - killed, 2),
            )
        )
        summary.assert_ok()
        assert summary.sagas == SAGAS
        assert summary.lost == 0 and summary.duplicates == 0
        # Workers back at work within a bound: the retry backoff tops out at 2 s.
        assert first_write - promoted < 10.0
        logs = "".join(w.output() for w in workers)
        assert "database_retry" in logs or "worker_database_error" in logs


class Order(BaseModel):
    order_id: str


class _Provider:
    """Effects kept on another server (the test database), which the failover spares:
    `charge` performs every call (it cannot dedupe, but can be looked up by key); `ship`
    dedupes by key and counts the calls it got."""

    def __init__(self, url: str) -> None:
        self.url = url
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(
                "CREATE TABLE failover_charges (id bigserial PRIMARY KEY, key text NOT NULL);"
                "CREATE TABLE failover_shipments (key text PRIMARY KEY, calls int NOT NULL)"
            )
        self.charging = threading.Event()
        self.gate = threading.Event()

    def charge(self, key: str) -> dict[str, Any]:
        self.charging.set()
        assert self.gate.wait(60), "the test never let the charge through"
        with psycopg.connect(self.url, autocommit=True) as conn:
            row = conn.execute(
                "INSERT INTO failover_charges (key) VALUES (%s) RETURNING id", (key,)
            ).fetchone()
        assert row is not None
        return {"charge": int(row[0])}

    def find_charge(self, key: str) -> int | None:
        with psycopg.connect(self.url) as conn:
            row = conn.execute("SELECT id FROM failover_charges WHERE key = %s", (key,)).fetchone()
        return None if row is None else int(row[0])

    def ship(self, key: str) -> dict[str, Any]:
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO failover_shipments (key, calls) VALUES (%s, 1)"
                " ON CONFLICT (key) DO UPDATE SET calls = failover_shipments.calls + 1",
                (key,),
            )
        return {"shipped": key}

    def counts(self) -> tuple[int, list[int]]:
        with psycopg.connect(self.url) as conn:
            charges = conn.execute("SELECT count(*) FROM failover_charges").fetchone()
            calls = conn.execute("SELECT calls FROM failover_shipments").fetchall()
        assert charges is not None
        return int(charges[0]), [int(c) for (c,) in calls]


def _order_saga(provider: _Provider) -> Saga[Order]:
    saga: Saga[Order] = Saga("failover_order", version=1, input=Order, key=lambda o: o.order_id)

    @saga.step
    def charge(ctx: StepContext, order: Order) -> dict[str, Any]:
        return provider.charge(ctx.idempotency_key)

    @charge.reconcile
    def find_charge(ctx: StepContext, order: Order) -> Found | Absent:
        found = provider.find_charge(ctx.idempotency_key)
        return Absent() if found is None else Found({"charge": found})

    @saga.step(idempotent=True)
    def ship(ctx: StepContext, order: Order) -> dict[str, Any]:
        return provider.ship(ctx.idempotency_key)

    return saga


def test_transitions_lost_with_asynchronous_replication_are_settled_safely(
    database_url: str, private_dir: Path
) -> None:
    """Asynchronous replication, cut after the charge's attempt reached the standby: the
    charge and the shipment happen, the saga completes on the primary, and all of that
    but the charge's start vanishes with it. On the promoted standby the saga finds the
    charge `running`: it is reconciled (found at the provider, not charged again), and
    the shipment, whose start vanished, is called again with the same key, which the
    provider dedupes. One charge, one shipment, the saga completed."""
    provider = _Provider(database_url)
    saga = _order_saga(provider)
    with replicated_pair(private_dir / "pair", synchronous=False) as pair:
        url = _new_database(pair, "failover_async")
        pair.wait_replayed()
        result: dict[str, Any] = {}
        with Orchestrator(url, sagas=[saga], lease_seconds=1.0) as first:

            def execute() -> None:
                result["state"] = first.execute(saga, Order(order_id="o-1"))

            thread = threading.Thread(target=execute)
            thread.start()
            assert provider.charging.wait(30)
            pair.wait_replayed()  # the charge's attempt is on the standby
            pair.cut_replication()  # and nothing after it will be
            provider.gate.set()
            thread.join(60)
            assert result["state"].status == "completed"
            saga_id = result["state"].id
            pair.primary.kill()
        pair.standby.promote()

        with Orchestrator(url, sagas=[saga]) as second:
            found = second.get(saga_id)
            assert found.status == "running"  # the completion vanished with the primary
            ops = {op.step: op for op in found.operations if op.kind == "action"}
            assert str(ops["charge"].status) == "running"
            assert str(ops["ship"].status) == "pending"
            final = second.run(saga_id, wait_seconds=30)
        assert final.status == "completed"
        charged = result["state"].operation("charge").result
        assert final.operation("charge").result == charged  # the provider's, as found
        charges, ship_calls = provider.counts()
        assert charges == 1  # reconciled, never charged a second time
        assert ship_calls == [2]  # called again with its key; the provider deduped it
        history = {e.event for e in second.history(saga_id)}
        assert "reconcile_found" in history
