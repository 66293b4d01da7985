"""An order handled in a session of durable steps, for the tests of forking a session.

The tests import it to run the session's code (`place_order`, `aplace_order`), `saga fork
--app session_fork_app` loads its `orch`, and a child process runs the session to be
killed inside a call:

    python session_fork_app.py RUN_ID ORDER_ID   (database: SAGA_DATABASE_URL)

Every call of a step or a compensation in this process is appended to `CALLS`, so a
test counts what really ran. `PLAN["ship"]` steers `fork_ship`: "unknown" (it raises a
RuntimeError, so its outcome is unknown and the session parks), "ok", or "permanent"
(a PermanentError). `fork_charge` declines amounts above `DECLINE_ABOVE` (a
PermanentError: the call fails, and the order's code tries the next amount). With
`SESSION_FORK_APP_HANG=charge` the charge hangs after it took effect, saying `IN_CALL`.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from saga import AsyncOrchestrator, Orchestrator, PermanentError, StepContext, durable_step

NAME = "orders"
TENANT = "acme"
DECLINE_ABOVE = 10_000
# A short lease: a killed holder's session is free again soon.
LEASE_SECONDS = 1.0

CALLS: list[str] = []
PLAN: dict[str, str] = {"ship": "unknown"}

orch = Orchestrator(lease_seconds=LEASE_SECONDS)


@durable_step(name="fork_reserve")
def reserve(order_id: str) -> dict[str, Any]:
    CALLS.append(f"reserve {order_id}")
    return {"sku": "book", "order_id": order_id}


@reserve.compensation
def release(ctx: StepContext, result: dict[str, Any], order_id: str) -> None:
    CALLS.append(f"release {order_id}")


@durable_step(name="fork_charge")
def charge(order_id: str, amount_cents: int) -> dict[str, Any]:
    # Not idempotent and no reconcile hook: run twice, it would charge twice.
    CALLS.append(f"charge {order_id} {amount_cents}")
    if os.environ.get("SESSION_FORK_APP_HANG") == "charge":
        print("IN_CALL", flush=True)
        time.sleep(3600)
    if amount_cents > DECLINE_ABOVE:
        raise PermanentError(f"card declined for {amount_cents}")
    return {"charge_id": f"ch-{order_id}-{amount_cents}"}


@charge.compensation
def refund(ctx: StepContext, result: dict[str, Any], order_id: str, amount_cents: int) -> None:
    CALLS.append(f"refund {result['charge_id']} {amount_cents}")


@durable_step(name="fork_ship")
def ship(order_id: str) -> dict[str, Any]:
    CALLS.append(f"ship {order_id}")
    plan = PLAN["ship"]
    if plan == "unknown":
        raise RuntimeError("carrier timed out")
    if plan == "permanent":
        raise PermanentError("no carrier delivers there")
    return {"tracking": f"t-{order_id}"}


def place_order(
    app: Orchestrator, run_id: str, order_id: str, amounts: Sequence[int] = (4990,)
) -> tuple[int, int]:
    """The order's code, in session `run_id`: reserve, charge the first amount the card
    accepts, ship; (executed, replayed) of the block."""
    with app.session(run_id, tenant=TENANT, name=NAME) as run:
        reserve(order_id)
        for amount in amounts:
            try:
                charge(order_id, amount)
                break
            except PermanentError:
                continue  # declined: try the next amount
        ship(order_id)
    return run.executed, run.replayed


async def aplace_order(
    app: AsyncOrchestrator, run_id: str, order_id: str, amounts: Sequence[int] = (4990,)
) -> tuple[int, int]:
    """`place_order` through the asyncio door."""
    async with app.session(run_id, tenant=TENANT, name=NAME) as run:
        await reserve(order_id)  # type: ignore[misc]
        for amount in amounts:
            try:
                await charge(order_id, amount)  # type: ignore[misc]
                break
            except PermanentError:
                continue
        await ship(order_id)  # type: ignore[misc]
    return run.executed, run.replayed


if __name__ == "__main__":
    with orch:
        orch.list(limit=1)  # connected and migrated before the parent is told
        print("READY", flush=True)
        place_order(orch, sys.argv[1], sys.argv[2])
