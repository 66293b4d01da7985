"""A box office's sale as a session of durable steps, for `saga.testing.crash_test`
(`app="faults.session_kit_app:orch"`, `session="faults.session_kit_app:sell_tickets"`).

Each step declares what its provider guarantees, and no more:

- `hold_seats`: the venue dedupes on the idempotency key (`idempotent=True`); its
  compensation `release_seats` too;
- `take_payment`: the card processor does not dedupe, but finds a payment by the key it
  was made with (the reconcile hook `find_payment`); its refund dedupes on its key;
- `email_receipt`, called twice (buyer and box office) under keys of their own: the mailer
  dedupes on the key;
- `print_tickets`: the printer takes no key and cannot be asked, so the step declares
  neither: a kill while it is in flight waits for a human. With `refuse=True` the printer
  refuses the order for good (`PermanentError`): the session compensates.

Two functions are wrong on purpose, for the kit to catch: `sell_tickets_with_sms` calls
`text_buyer`, declared `idempotent=True` while the SMS gateway does not dedupe (a same-key
retry after a kill sends a second text); `sell_tickets_with_fresh_ids` keys a receipt on
an order id it makes afresh every time it runs (run again, the call has another key).

Every request to a provider is a row of `session_kit.requests`, with whether the provider
performed it (`performed`: false when it deduplicated it); `effects(url)` counts the
performed ones per idempotency key. The database comes from `SAGA_DATABASE_URL`, which
`crash_test` sets in its children; the schema is created on first use.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import psycopg

from saga import (
    Absent,
    Found,
    Orchestrator,
    PermanentError,
    StepContext,
    current_context,
    durable_step,
)

PROVIDER_SCHEMA = """
CREATE SCHEMA IF NOT EXISTS session_kit;
CREATE TABLE IF NOT EXISTS session_kit.requests (
    id              bigserial PRIMARY KEY,
    service         text NOT NULL,
    idempotency_key text NOT NULL,
    performed       boolean NOT NULL,
    pid             integer NOT NULL,
    at              timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS requests_by_key ON session_kit.requests (idempotency_key);
"""


def _url() -> str:
    return os.environ["SAGA_DATABASE_URL"]


def create_providers(url: str) -> None:
    """Create the providers' table (idempotent)."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT pg_advisory_lock(4711)")
        try:
            conn.execute(PROVIDER_SCHEMA)
        finally:
            conn.execute("SELECT pg_advisory_unlock(4711)")


def effects(url: str) -> dict[str, int]:
    """Effects the providers performed, per idempotency key."""
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT idempotency_key, count(*) FROM session_kit.requests WHERE performed GROUP BY 1"
        ).fetchall()
    return {str(k): int(n) for k, n in rows}


def requests(url: str, service: str) -> int:
    """Requests a provider received, performed or deduplicated."""
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT count(*) FROM session_kit.requests WHERE service = %s", (service,)
        ).fetchone()
    assert row is not None
    return int(row[0])


def perform(service: str, key: str, *, dedupe: bool) -> dict[str, Any]:
    """A provider's answer to a request under `key`: a provider that dedupes answers a
    repeated request with the first one's effect and performs nothing."""
    with psycopg.connect(_url()) as conn, conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (key,))
        first = conn.execute(
            "SELECT id FROM session_kit.requests WHERE idempotency_key = %s AND performed"
            " ORDER BY id LIMIT 1",
            (key,),
        ).fetchone()
        performed = not (dedupe and first is not None)
        row = conn.execute(
            "INSERT INTO session_kit.requests (service, idempotency_key, performed, pid)"
            " VALUES (%s, %s, %s, %s) RETURNING id",
            (service, key, performed, os.getpid()),
        ).fetchone()
    assert row is not None
    effect = int(row[0]) if performed or first is None else int(first[0])
    return {"service": service, "effect": effect}


def find(service: str, key: str) -> Found | Absent:
    """A provider's look-up of the effect made under `key`."""
    with psycopg.connect(_url()) as conn:
        row = conn.execute(
            "SELECT id FROM session_kit.requests WHERE idempotency_key = %s AND performed"
            " ORDER BY id LIMIT 1",
            (key,),
        ).fetchone()
    if row is None:
        return Absent()
    return Found({"service": service, "effect": int(row[0])}, provider_reference=str(row[0]))


def _key() -> str:
    ctx = current_context()
    assert ctx is not None, "a durable step of this app runs inside a session"
    return ctx.idempotency_key


@durable_step(name="hold_seats", key=lambda show, seats: f"{show}:{seats}", idempotent=True)
def hold_seats(show: str, seats: int) -> dict[str, Any]:
    """Hold seats at the venue, which dedupes on the key."""
    return perform("venue", _key(), dedupe=True)


@hold_seats.compensation(idempotent=True)
def release_seats(ctx: StepContext, result: dict[str, Any], show: str, seats: int) -> None:
    """Release the held seats (the venue dedupes on the compensation's key)."""
    perform("venue-release", ctx.idempotency_key, dedupe=True)


@durable_step(name="take_payment")
def take_payment(order_id: str, amount_cents: int) -> dict[str, Any]:
    """Charge the buyer: the processor does not dedupe."""
    return perform("card", _key(), dedupe=False)


@take_payment.reconcile
def find_payment(ctx: StepContext, order_id: str, amount_cents: int) -> Found | Absent:
    """Ask the processor for the payment made under the call's key."""
    return find("card", ctx.idempotency_key)


@take_payment.compensation(idempotent=True)
def refund_payment(
    ctx: StepContext, result: dict[str, Any], order_id: str, amount_cents: int
) -> None:
    """Refund the payment (refunds dedupe on their key)."""
    perform("card-refund", ctx.idempotency_key, dedupe=True)


@durable_step(name="email_receipt", key=lambda to, order_id: f"{to}:{order_id}", idempotent=True)
def email_receipt(to: str, order_id: str) -> dict[str, Any]:
    """Email a receipt; the mailer dedupes on the key."""
    return perform("mail", _key(), dedupe=True)


@durable_step(name="print_tickets")
def print_tickets(order_id: str, refuse: bool = False) -> dict[str, Any]:
    """Print the tickets: the printer takes no key and cannot be asked."""
    if refuse:
        raise PermanentError(f"the printer refused order {order_id}")
    return perform("printer", _key(), dedupe=False)


@durable_step(name="text_buyer", idempotent=True)  # wrong: the SMS gateway does not dedupe
def text_buyer(phone: str, order_id: str) -> dict[str, Any]:
    """Text the buyer: declared idempotent, which the SMS gateway is not."""
    return perform("sms", _key(), dedupe=False)


orch = Orchestrator()  # SAGA_DATABASE_URL, which crash_test sets in its children


def sell_tickets(run_id: str, refuse: bool = False) -> None:
    """Sell two seats of one show, in the session `run_id`."""
    create_providers(orch.database_url)
    with orch.session(run_id, tenant="box-office"):
        hold_seats("hamlet", 2)
        take_payment("order-1", 9000)
        email_receipt("buyer@example.com", "order-1")
        email_receipt("office@example.com", "order-1")
        print_tickets("order-1", refuse)


def sell_tickets_with_sms(run_id: str) -> None:
    """Sell seats and text the buyer, in the session `run_id`."""
    create_providers(orch.database_url)
    with orch.session(run_id, tenant="box-office"):
        take_payment("order-2", 4500)
        text_buyer("+15550100", "order-2")


def sell_tickets_with_fresh_ids(run_id: str) -> None:
    """Sell seats, keying the receipt on an order id made afresh by every run of the
    function (a bug: run again, the call has another key, so it runs again)."""
    create_providers(orch.database_url)
    with orch.session(run_id, tenant="box-office"):
        take_payment("order-3", 2500)
        email_receipt("buyer@example.com", f"order-{uuid.uuid4().hex[:8]}")
