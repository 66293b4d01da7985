"""A process that runs a session of durable steps, for the session tests' kills and races.

    python session_app.py MODE RUN_ID      (database: SESSION_APP_URL)

Effects are rows of the test database's `effects` table, written by the step code (not
through the orchestrator), so the parent counts what really happened. Lines the parent
waits for start with `SESSION_APP `.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from typing import Any

import psycopg

from saga import Orchestrator, SessionBusy, StepContext, current_context, durable_step

URL = os.environ.get("SESSION_APP_URL", "")
# Short, so that a killed holder's session is entered again quickly; a test that needs the
# holder to stay put on a loaded machine asks for a longer one.
LEASE_SECONDS = float(os.environ.get("SESSION_APP_LEASE", "1.0"))


def say(line: str) -> None:
    print(f"SESSION_APP {line}", flush=True)


def effect(kind: str, key: str) -> int:
    """Record an effect; a provider dedupes on `key` (0 when it was a duplicate)."""
    with psycopg.connect(URL, autocommit=True) as conn:
        cur = conn.execute(
            "INSERT INTO effects (kind, key) VALUES (%s, %s) ON CONFLICT DO NOTHING", (kind, key)
        )
        return cur.rowcount


def effects(kind: str) -> list[str]:
    with psycopg.connect(URL, autocommit=True) as conn:
        rows = conn.execute("SELECT key FROM effects WHERE kind = %s", (kind,)).fetchall()
    return [str(r[0]) for r in rows]


@durable_step(name="send_email", key=lambda to, body: to, idempotent=True)
def send_email(to: str, body: str) -> dict[str, Any]:
    ctx = current_context()
    assert ctx is not None
    effect("email", ctx.idempotency_key)  # the provider dedupes on the key
    if os.environ.get("SESSION_APP_HANG_IN") == "send_email":
        say("IN_CALL")
        time.sleep(3600)
    return {"to": to, "attempt": ctx.attempt}


@durable_step(name="charge")
def charge(order_id: str, amount_cents: int) -> dict[str, Any]:
    # Not idempotent and no reconcile: a second run would charge twice.
    effect("charge", f"{order_id}:{uuid.uuid4()}")
    if os.environ.get("SESSION_APP_HANG_IN") == "charge":
        say("IN_CALL")
        time.sleep(3600)
    if os.environ.get("SESSION_APP_SLOW_CHARGE"):
        time.sleep(float(os.environ["SESSION_APP_SLOW_CHARGE"]))
    return {"charge_id": f"ch-{order_id}"}


@durable_step(name="ship")
def ship(order_id: str) -> dict[str, Any]:
    ctx = current_context()
    assert ctx is not None
    effect("ship", ctx.idempotency_key)
    if os.environ.get("SESSION_APP_HANG_IN") == "ship":
        say("IN_CALL")
        time.sleep(3600)
    return {"tracking": f"t-{order_id}"}


@ship.reconcile
def shipped(ctx: StepContext, order_id: str) -> Any:
    from saga import Absent, Found

    if ctx.idempotency_key in effects("ship"):
        return Found({"tracking": f"t-{order_id}"})
    return Absent()


def main() -> None:
    mode, run_id = sys.argv[1], sys.argv[2]
    wait = float(os.environ.get("SESSION_APP_WAIT", "0"))
    with Orchestrator(URL, lease_seconds=LEASE_SECONDS) as orch:
        orch.list(limit=1)  # connected and migrated before the parent is told
        say("READY")
        if os.environ.get("SESSION_APP_GO"):
            # Start when told, so that racing processes enter at the same moment.
            sys.stdin.readline()
        try:
            with orch.session(run_id, wait_seconds=wait) as run:
                if mode == "email":
                    send_email("ops@acme.com", "Refund approved")
                    say("SENT")
                    if os.environ.get("SESSION_APP_HANG_AFTER"):
                        time.sleep(3600)
                    send_email("ops@acme.com", "Refund approved")
                elif mode == "charge":
                    charge("o-1", 100)
                elif mode == "ship":
                    ship("o-1")
                say(json.dumps({"executed": run.executed, "replayed": run.replayed}))
        except SessionBusy as exc:
            say(f"BUSY {exc}")


if __name__ == "__main__":
    main()
