"""A caller of the ledger in a process of its own: it claims a charge, makes it at the
fake provider (a table of the test database, with no uniqueness: a second charge is a
row more), says so, and waits to be killed before it can `complete`.

Usage: python ledger_app.py URL CHANNEL ORDER_ID AMOUNT_CENTS
Prints `LEDGER_APP <status> <attempt>` after the claim and `LEDGER_APP CHARGED <id>`
after the charge, then sleeps.
"""

from __future__ import annotations

import sys
import time

import psycopg

from saga import Orchestrator

# The claim's lease: short, so that the test reclaims soon after the kill.
LEASE_SECONDS = 1.0


def charge(url: str, idempotency_key: str, order_id: str, amount_cents: int) -> int:
    """Charge at the fake provider (committed at once, as a provider's API call is)."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "INSERT INTO provider_charges (idempotency_key, order_id, amount_cents) "
            "VALUES (%s, %s, %s) RETURNING id",
            (idempotency_key, order_id, amount_cents),
        ).fetchone()
    assert row is not None
    return int(row[0])


def main(url: str, channel: str, order_id: str, amount_cents: int) -> None:
    orch = Orchestrator(url)
    claim = orch.ledger.claim(
        channel,
        f"charge:{order_id}",
        "charge_customer",
        {"order_id": order_id, "amount_cents": amount_cents, "requested_at": time.time()},
        dedup_fields=("order_id", "amount_cents"),
        lease_seconds=LEASE_SECONDS,
    )
    print(f"LEDGER_APP {claim.status} {claim.attempt}", flush=True)
    if not claim.held:
        return
    charge_id = charge(url, claim.idempotency_key, order_id, amount_cents)
    print(f"LEDGER_APP CHARGED {charge_id}", flush=True)
    time.sleep(3600)  # killed here: the reply of the charge is lost with the process


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
