"""A saga app run as a child process by the crash and fencing tests, and imported by them.

Run as `python crash_app.py SAGA_NAME ORDER_ID` with `CRASH_APP_DATABASE_URL` set: it starts
the saga and runs it with a 1-second lease. `CRASH_APP_BLOCK` makes the `charge` step of
this process block, so the parent can kill or freeze it there:

- `after_effect`: record the charge at the provider, print `CRASH_APP CHARGED`, block;
- `before_effect`: print `CRASH_APP IN_CHARGE`, block before touching the provider;
- `gate`: print `CRASH_APP IN_CHARGE`, wait for the file named by `CRASH_APP_GATE`, then
  charge and return normally;
- `transient`: raise `TransientError` before touching the provider (set in the parent, to
  make the retry of a killed attempt fail).

Every line meant for the parent starts with `CRASH_APP `. The parent imports this module
to register the very same saga definitions in its own orchestrator; there the variables
are unset and `charge` never blocks.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
from pydantic import BaseModel

from saga import (
    Absent,
    Ceilings,
    Found,
    LeaseLost,
    Orchestrator,
    RetryPolicy,
    Saga,
    StepContext,
    TransientError,
)

ENV_URL = "CRASH_APP_DATABASE_URL"
ENV_BLOCK = "CRASH_APP_BLOCK"
ENV_GATE = "CRASH_APP_GATE"
LEASE_SECONDS = 1.0


class CrashOrder(BaseModel):
    """Input of the crash-test sagas."""

    order_id: str
    amount_cents: int = 500


def create_provider_tables(url: str) -> None:
    """The fake provider's ledger and a log of every step call, in the test database."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE provider_charges ("
            " idempotency_key text PRIMARY KEY,"
            " charge_id text NOT NULL,"
            " amount_cents integer NOT NULL,"
            " pid integer NOT NULL)"
        )
        conn.execute(
            "CREATE TABLE step_calls ("
            " id bigserial PRIMARY KEY,"
            " saga text NOT NULL,"
            " step text NOT NULL,"
            " idempotency_key text NOT NULL,"
            " attempt integer NOT NULL,"
            " fence bigint NOT NULL,"
            " pid integer NOT NULL)"
        )


def _url() -> str:
    return os.environ[ENV_URL]


def _record_call(saga: str, step: str, ctx: StepContext) -> None:
    with psycopg.connect(_url(), autocommit=True) as conn:
        conn.execute(
            "INSERT INTO step_calls (saga, step, idempotency_key, attempt, fence, pid)"
            " VALUES (%s, %s, %s, %s, %s, %s)",
            (saga, step, ctx.idempotency_key, ctx.attempt, ctx.fence, os.getpid()),
        )


def _signal(line: str) -> None:
    print(f"CRASH_APP {line}", flush=True)


def _block_forever() -> None:
    while True:
        time.sleep(60)


def _provider_charge(ctx: StepContext, order: CrashOrder) -> dict[str, Any]:
    """Charge at the provider, which dedupes on the idempotency key."""
    charge_id = f"ch_{order.order_id}"
    with psycopg.connect(_url(), autocommit=True) as conn:
        conn.execute(
            "INSERT INTO provider_charges (idempotency_key, charge_id, amount_cents, pid)"
            " VALUES (%s, %s, %s, %s) ON CONFLICT (idempotency_key) DO NOTHING",
            (ctx.idempotency_key, charge_id, order.amount_cents, os.getpid()),
        )
    return {"charge_id": charge_id, "pid": os.getpid()}


def _charge(saga: str, ctx: StepContext, order: CrashOrder) -> dict[str, Any]:
    _record_call(saga, "charge", ctx)
    block = os.environ.get(ENV_BLOCK)
    if block == "before_effect":
        _signal("IN_CHARGE")
        _block_forever()
    if block == "transient":
        raise TransientError("the provider is unavailable")
    if block == "gate":
        _signal(f"IN_CHARGE fence={ctx.fence}")
        gate = Path(os.environ[ENV_GATE])
        while not gate.exists():
            time.sleep(0.02)
    result = _provider_charge(ctx, order)
    if block == "after_effect":
        _signal("CHARGED")
        _block_forever()
    return result


def _build(
    name: str,
    *,
    idempotent: bool,
    reconcile: bool,
    max_attempts: int = 3,
    confirm: bool = False,
) -> Saga[CrashOrder]:
    saga: Saga[CrashOrder] = Saga(name, version=1, input=CrashOrder, key=lambda o: o.order_id)

    @saga.step
    def reserve(ctx: StepContext, order: CrashOrder) -> dict[str, Any]:
        _record_call(name, "reserve", ctx)
        return {"reserved": order.order_id}

    @saga.step(
        idempotent=idempotent,
        retry=RetryPolicy(max_attempts=max_attempts, initial_delay=0.01, max_delay=0.02),
        confirm=confirm,
    )
    def charge(ctx: StepContext, order: CrashOrder) -> dict[str, Any]:
        return _charge(name, ctx, order)

    if reconcile:

        @charge.reconcile
        def find_charge(ctx: StepContext, order: CrashOrder) -> Found | Absent:
            _record_call(name, "reconcile", ctx)
            with psycopg.connect(_url()) as conn:
                row = conn.execute(
                    "SELECT charge_id, pid FROM provider_charges WHERE idempotency_key = %s",
                    (ctx.idempotency_key,),
                ).fetchone()
            if row is None:
                return Absent()
            return Found({"charge_id": row[0], "pid": row[1]}, provider_reference=row[0])

    @saga.step
    def confirm(ctx: StepContext, order: CrashOrder) -> dict[str, Any]:
        _record_call(name, "confirm", ctx)
        return {"confirmed": ctx.results["charge"]["charge_id"]}

    return saga


def _build_compensated(
    name: str, *, max_attempts: int = 3, ceilings: Ceilings | None = None
) -> Saga[CrashOrder]:
    """reserve, an idempotent charge, confirm; reserve and charge have compensations that
    count no side effect (the saga's ceiling never blocks them)."""
    saga: Saga[CrashOrder] = Saga(
        name, version=1, input=CrashOrder, key=lambda o: o.order_id, ceilings=ceilings
    )

    @saga.step
    def reserve(ctx: StepContext, order: CrashOrder) -> dict[str, Any]:
        _record_call(name, "reserve", ctx)
        return {"reserved": order.order_id}

    @reserve.compensation(side_effect=False)
    def release(ctx: StepContext, order: CrashOrder, result: dict[str, Any]) -> None:
        _record_call(name, "release", ctx)

    @saga.step(
        idempotent=True,
        retry=RetryPolicy(max_attempts=max_attempts, initial_delay=0.01, max_delay=0.02),
    )
    def charge(ctx: StepContext, order: CrashOrder) -> dict[str, Any]:
        return _charge(name, ctx, order)

    @charge.compensation(idempotent=True, side_effect=False)
    def refund(ctx: StepContext, order: CrashOrder, result: dict[str, Any] | None) -> None:
        _record_call(name, "refund", ctx)

    @saga.step
    def confirm(ctx: StepContext, order: CrashOrder) -> dict[str, Any]:
        _record_call(name, "confirm", ctx)
        return {"confirmed": ctx.results["charge"]["charge_id"]}

    return saga


# (a) unknown charge settled by asking the provider; (b) by retrying with the same key;
# (c) by a human; (d) idempotent, but the unknown attempt was its last one.
RECONCILED = _build("crash_reconciled", idempotent=False, reconcile=True)
IDEMPOTENT = _build("crash_idempotent", idempotent=True, reconcile=False)
PLAIN = _build("crash_plain", idempotent=False, reconcile=False)
AT_CEILING = _build("crash_at_ceiling", idempotent=True, reconcile=False, max_attempts=1)
# (i) a charge that waits for an approval before each attempt, settled by an idempotent
# retry, or (j) by asking the provider.
CONFIRMED = _build("crash_confirmed", idempotent=True, reconcile=False, confirm=True)
CONFIRMED_RECONCILED = _build(
    "crash_confirmed_reconciled", idempotent=False, reconcile=True, confirm=True
)


def _build_backoff(name: str, *, backoff_seconds: float) -> Saga[CrashOrder]:
    """charge fails transiently at its first attempt (printing `CRASH_APP FAILING` first),
    so the process that runs it waits out a backoff of `backoff_seconds` in-process;
    the second attempt charges."""
    saga: Saga[CrashOrder] = Saga(name, version=1, input=CrashOrder, key=lambda o: o.order_id)

    @saga.step
    def reserve(ctx: StepContext, order: CrashOrder) -> dict[str, Any]:
        _record_call(name, "reserve", ctx)
        return {"reserved": order.order_id}

    @saga.step(
        idempotent=True,
        retry=RetryPolicy(
            max_attempts=2, initial_delay=backoff_seconds, max_delay=backoff_seconds, jitter=0.0
        ),
    )
    def charge(ctx: StepContext, order: CrashOrder) -> dict[str, Any]:
        _record_call(name, "charge", ctx)
        if ctx.attempt == 1:
            _signal("FAILING")
            raise TransientError("gateway busy")
        return _provider_charge(ctx, order)

    return saga


# (e) a charge waiting out a backoff in-process: long (a cancel must not wait for it) and
# moderate (a new process drives the saga once the dead owner's lease ends).
LONG_BACKOFF = _build_backoff("crash_long_backoff", backoff_seconds=600.0)
BACKOFF = _build_backoff("crash_backoff", backoff_seconds=10.0)

# (g) the retry of an unknown charge is blocked by the saga's side-effect ceiling;
# (h) the retry of an unknown charge fails (transiently) at its ceiling.
CAPPED = _build_compensated("crash_capped", ceilings=Ceilings(max_side_effects=2))
RETRIED = _build_compensated("crash_retried", max_attempts=2)


def _build_spending(name: str, *, max_cost: float | None, budget: float | None) -> Saga[CrashOrder]:
    """reserve, then an idempotent charge that reports a spend of 10 with ctx.spend()
    before it charges (and blocks, as `_charge` says)."""
    ceilings = Ceilings(spend_budget=budget) if budget is not None else None
    saga: Saga[CrashOrder] = Saga(
        name, version=1, input=CrashOrder, key=lambda o: o.order_id, ceilings=ceilings
    )

    @saga.step
    def reserve(ctx: StepContext, order: CrashOrder) -> dict[str, Any]:
        _record_call(name, "reserve", ctx)
        return {"reserved": order.order_id}

    @saga.step(
        idempotent=True,
        max_cost=max_cost,
        retry=RetryPolicy(max_attempts=3, initial_delay=0.01, max_delay=0.02),
    )
    def charge(ctx: StepContext, order: CrashOrder) -> dict[str, Any]:
        ctx.spend(10)
        return _charge(name, ctx, order)

    return saga


# (i) spend reported before a crash: counted at the declared worst case; without one, under
# a budget, the saga parks; without a budget, what was reported is counted.
SPEND_WORST_CASE = _build_spending("crash_spend_worst", max_cost=15, budget=100)
SPEND_UNDECLARED = _build_spending("crash_spend_undeclared", max_cost=None, budget=100)
SPEND_UNBUDGETED = _build_spending("crash_spend_unbudgeted", max_cost=None, budget=None)
ALL_SAGAS = (
    RECONCILED,
    IDEMPOTENT,
    PLAIN,
    AT_CEILING,
    CONFIRMED,
    CONFIRMED_RECONCILED,
    LONG_BACKOFF,
    BACKOFF,
    CAPPED,
    RETRIED,
    SPEND_WORST_CASE,
    SPEND_UNDECLARED,
    SPEND_UNBUDGETED,
)
BY_NAME = {s.name: s for s in ALL_SAGAS}


def main(argv: list[str]) -> int:
    saga_name, order_id = argv
    import structlog.testing

    orch = Orchestrator(_url(), sagas=ALL_SAGAS, lease_seconds=LEASE_SECONDS)
    with orch:
        handle = orch.start(BY_NAME[saga_name], CrashOrder(order_id=order_id))
        _signal(f"STARTED {handle.id}")
        lease_lost = False
        with structlog.testing.capture_logs() as logs:
            try:
                state = orch.run(handle.id)
            except LeaseLost:
                lease_lost = True
                state = orch.get(handle.id)
        lease_lost = lease_lost or any("lease_lost" in str(e.get("event")) for e in logs)
        if lease_lost:
            _signal("LEASE_LOST")
        _signal(f"FINISHED {state.status}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
