"""A subscription renewal told end to end: a clean run, a crash after the charge, a refusal.

Run it with `make demo` (embedded PostgreSQL) or with SAGA_DATABASE_URL set. The warehouse
and the payment provider are simulated in the schema `demo_provider` of the same database;
like real providers, they honour idempotency keys, and the steps that call them say so
(`idempotent=True`), so an attempt whose outcome a crash left unknown is retried with the same
key. The carrier takes no key: `create_shipment` is neither idempotent nor reconcilable, and a
crash while it is in flight parks the saga for a human to check with the carrier.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime
from typing import Any, LiteralString

import psycopg
import structlog
from pydantic import BaseModel

from saga import Absent, Found, Orchestrator, PermanentError, RetryPolicy, Saga, StepContext

CHILD_LEASE_SECONDS = 1.0
PROVIDER_SCHEMA = """
CREATE SCHEMA IF NOT EXISTS demo_provider;
CREATE TABLE IF NOT EXISTS demo_provider.reservations (
    idempotency_key text PRIMARY KEY, reservation_id text NOT NULL, order_id text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp(), released_at timestamptz);
CREATE TABLE IF NOT EXISTS demo_provider.charges (
    idempotency_key text PRIMARY KEY, amount_cents int NOT NULL, charge_id text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE IF NOT EXISTS demo_provider.refunds (
    idempotency_key text PRIMARY KEY, charge_id text NOT NULL, amount_cents int NOT NULL,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp());
"""


class Renewal(BaseModel):
    tenant_id: str
    renewal_event_id: str
    order_id: str
    amount_cents: int
    ship_to: str = "Berlin"
    requested_at: str | None = None  # volatile: left out of the request hash


class Charge(BaseModel):
    charge_id: str
    amount_cents: int


class Provider:
    """Warehouse, payment provider and carrier: a call repeated with a key gets the first answer."""

    conn: psycopg.Connection[tuple[Any, ...]]
    crash_after_charge = False  # set in the child of scene 2

    def connect(self, url: str) -> None:
        if getattr(self, "conn", None) is not None:  # connected again: to another database
            self.conn.close()
        self.conn = psycopg.connect(url, autocommit=True)  # every call commits at once
        self.conn.execute(PROVIDER_SCHEMA)

    def row(self, query: LiteralString, *params: Any) -> tuple[Any, ...]:
        row = self.conn.execute(query, params).fetchone()
        return row if row is not None else (None,)

    def reserve(self, key: str, order_id: str) -> str:
        self.conn.execute(
            "INSERT INTO demo_provider.reservations (idempotency_key, reservation_id, order_id)"
            " VALUES (%s, %s, %s) ON CONFLICT (idempotency_key) DO NOTHING",
            (key, f"res_{uuid.uuid4().hex[:8]}", order_id),
        )
        sql = "SELECT reservation_id FROM demo_provider.reservations WHERE idempotency_key = %s"
        return str(self.row(sql, key)[0])

    def release(self, reservation_id: str) -> None:
        self.conn.execute(
            "UPDATE demo_provider.reservations SET released_at = clock_timestamp()"
            " WHERE reservation_id = %s AND released_at IS NULL",
            (reservation_id,),
        )

    def charge(self, key: str, amount_cents: int) -> Charge:
        self.conn.execute(
            "INSERT INTO demo_provider.charges (idempotency_key, amount_cents, charge_id)"
            " VALUES (%s, %s, %s) ON CONFLICT (idempotency_key) DO NOTHING",
            (key, amount_cents, f"ch_{uuid.uuid4().hex[:10]}"),
        )
        found = self.find_charge(key)
        assert found is not None
        return found

    def find_charge(self, key: str) -> Charge | None:
        sql = "SELECT charge_id, amount_cents FROM demo_provider.charges WHERE idempotency_key = %s"
        row = self.conn.execute(sql, (key,)).fetchone()
        return None if row is None else Charge(charge_id=row[0], amount_cents=row[1])

    def refund(self, key: str, charge: Charge) -> None:
        self.conn.execute(
            "INSERT INTO demo_provider.refunds (idempotency_key, charge_id, amount_cents)"
            " VALUES (%s, %s, %s) ON CONFLICT (idempotency_key) DO NOTHING",
            (key, charge.charge_id, charge.amount_cents),
        )


provider = Provider()
renewal = Saga(
    "renewal",
    version=1,
    input=Renewal,
    key=lambda r: r.renewal_event_id,
    tenant=lambda r: r.tenant_id,
    volatile=("requested_at",),
)


def say(message: str) -> None:
    tag = f"[child pid {os.getpid()}] " if provider.crash_after_charge else ""
    print(f"  {tag}{message}", flush=True)


# The warehouse dedupes on ctx.idempotency_key: a retry after a crash reserves nothing twice.
@renewal.step(idempotent=True, retry=RetryPolicy(max_attempts=3, initial_delay=0.25, max_delay=1.0))
def reserve_inventory(ctx: StepContext, r: Renewal) -> dict[str, str]:
    reservation_id = provider.reserve(ctx.idempotency_key, r.order_id)
    say(f"reserve_inventory: reserved {reservation_id} for order {r.order_id}")
    return {"reservation_id": reservation_id}


@reserve_inventory.compensation(retry=RetryPolicy(max_attempts=10), idempotent=True)
def release_inventory(ctx: StepContext, r: Renewal, result: dict[str, str]) -> None:
    provider.release(result["reservation_id"])
    say(f"release_inventory: released {result['reservation_id']}")


@renewal.step(idempotent=True)  # the provider dedupes on ctx.idempotency_key
def charge(ctx: StepContext, r: Renewal) -> Charge:
    result = provider.charge(ctx.idempotency_key, r.amount_cents)
    say(f"charge: charged {result.charge_id}, {result.amount_cents:,} cents")
    if provider.crash_after_charge:
        say("charge: the provider has committed the charge; dying before it is recorded")
        os.kill(os.getpid(), signal.SIGKILL)
    return result


@charge.compensation(idempotent=True)
def refund(ctx: StepContext, r: Renewal, result: Charge) -> None:
    provider.refund(ctx.idempotency_key, result)
    say(f"refund: refunded {result.charge_id}, {result.amount_cents:,} cents")


@charge.reconcile  # asked when an attempt's outcome is unknown
def find_charge(ctx: StepContext, r: Renewal) -> Found | Absent:
    found = provider.find_charge(ctx.idempotency_key)
    answer = found.charge_id if found else "nothing"
    say(f"find_charge: outcome unknown; asked by key, the provider has {answer}")
    return Absent() if found is None else Found(found, provider_reference=found.charge_id)


# The parcel leaves the warehouse: no way back after this. The carrier has no idempotency
# key, so the step is not declared idempotent: an attempt a crash left unknown parks.
@renewal.step(pivot=True)
def create_shipment(ctx: StepContext, r: Renewal) -> dict[str, str]:
    if r.ship_to == "Atlantis":
        say("create_shipment: the carrier refuses: no delivery to Atlantis")
        # Only PermanentError (or an exception in RetryPolicy(fail_on=...)) says "this did
        # not happen". Any other exception, a KeyError parsing the carrier's answer say,
        # may come after the parcel was booked: it leaves the outcome unknown instead.
        raise PermanentError("carrier does not deliver to Atlantis")
    say(f"create_shipment: shipment shp_{r.order_id} to {r.ship_to}")
    return {"shipment_id": f"shp_{r.order_id}"}


def expect(condition: bool, message: str) -> None:
    if not condition:
        sys.exit(f"FAILED: {message}")


def start(orch: Orchestrator, order_id: str, **fields: Any) -> str:
    event_id = f"evt_{uuid.uuid4().hex[:8]}"  # fresh keys: the demo can run again and again
    r = Renewal(
        tenant_id="acme",
        renewal_event_id=event_id,
        order_id=order_id,
        amount_cents=4990,
        requested_at=datetime.now(UTC).isoformat(),
        **fields,
    )
    say(f"renewal {event_id} of order {order_id}: {r.amount_cents:,} cents, ship to {r.ship_to}")
    return orch.start(renewal, r).id


def scene_clean_run(orch: Orchestrator) -> None:
    print("\n== Scene 1: a clean renewal ==")
    state = orch.run(start(orch, "ord-1001"))
    expect(state.status == "completed", f"scene 1 ended {state.status}, not completed")
    say(f"-> saga completed: {', '.join(f'{op.step} {op.status}' for op in state.operations)}")


def scene_crash_after_charge(orch: Orchestrator) -> None:
    print("\n== Scene 2: the worker is killed after the provider charged ==")
    saga_id = start(orch, "ord-1002")
    env = {**os.environ, "SAGA_DATABASE_URL": orch.database_url}
    child = subprocess.run([sys.executable, __file__, "--child", saga_id], env=env, timeout=60)
    expect(child.returncode == -signal.SIGKILL, f"the child exited with {child.returncode}")
    state = orch.get(saga_id)
    key = state.operation("charge").idempotency_key
    expect(state.operation("charge").status == "running", "charge should be left running")
    expires = state.lease_expires_at or datetime.now(UTC)
    wait = max(0.0, (expires - datetime.now(UTC)).total_seconds()) + 0.2
    say(f"the child died by SIGKILL, charge left 'running'; waiting {wait:.1f} s for its lease")
    time.sleep(wait)
    say("resuming the saga in this process")
    state = orch.run(saga_id)
    expect(state.status == "completed", f"scene 2 ended {state.status}, not completed")
    events = [e.event for e in orch.history(saga_id) if e.step == "charge"]
    expect({"outcome_unknown", "reconcile_found"} <= set(events), f"charge events: {events}")
    (count,) = provider.row(
        "SELECT count(*) FROM demo_provider.charges WHERE idempotency_key = %s", key
    )
    expect(count == 1, f"the provider holds {count} charges for {key}, not exactly one")
    charge_id, amount, at = provider.row(
        "SELECT charge_id, amount_cents, created_at FROM demo_provider.charges"
        " WHERE idempotency_key = %s",
        key,
    )
    reference = state.operation("charge").provider_reference
    expect(charge_id == reference, f"recorded reference {reference} is not the charge {charge_id}")
    say(f"-> saga completed with exactly one charge at the provider for key {key}:")
    say(f"   {charge_id}, {amount:,} cents, made at {at:%H:%M:%S.%f} by the killed child")


def scene_refused_shipment(orch: Orchestrator) -> None:
    print("\n== Scene 3: the carrier refuses the shipment ==")
    saga_id = start(orch, "ord-1003", ship_to="Atlantis")
    state = orch.run(saga_id)
    expect(state.status == "compensated", f"scene 3 ended {state.status}")
    order = [
        e.step
        for e in orch.history(saga_id)
        if e.kind == "compensation" and e.event == "attempt_succeeded"
    ]
    expect(order == ["charge", "reserve_inventory"], f"compensations ran in order {order}")
    (refund_first,) = provider.row(
        "SELECT (SELECT max(created_at) FROM demo_provider.refunds WHERE charge_id = %s)"
        " < (SELECT released_at FROM demo_provider.reservations WHERE reservation_id = %s)",
        state.operation("charge").result["charge_id"],
        state.operation("reserve_inventory").result["reservation_id"],
    )
    expect(refund_first is True, "the provider should see the refund before the release")
    say(
        "-> saga compensated in reverse order: refund (of charge),"
        " then release_inventory (of reserve_inventory)"
    )


def child(saga_id: str) -> None:
    """Scene 2's doomed worker: runs the saga with a short lease and dies inside `charge`."""
    provider.crash_after_charge = True
    with Orchestrator(lease_seconds=CHILD_LEASE_SECONDS, sagas=[renewal]) as orch:
        provider.connect(orch.database_url)
        orch.run(saga_id)
    sys.exit("the child should have died inside charge")


def main() -> None:
    # Keep the library's logs out of the story (the refused shipment is logged as a warning).
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2])
    with Orchestrator(sagas=[renewal]) as orch:
        provider.connect(orch.database_url)
        scene_clean_run(orch)
        scene_crash_after_charge(orch)
        scene_refused_shipment(orch)
    print("\nAll three scenes ended as told.")


if __name__ == "__main__":
    main()
