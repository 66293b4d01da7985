"""A support agent's refunds: small ones go through, large ones wait for a signed approval.

Run it with `python examples/refund_with_confirmation.py` (embedded PostgreSQL) or with
SAGA_DATABASE_URL set. The payment provider is simulated in the schema `demo_refunds`;
it honours idempotency keys like a real one.

What it shows:
1. a small refund runs at once;
2. a large one pauses in `awaiting_confirmation` with a preview, even though the
   agent's request says `"confirmed": true`: nothing in a payload can confirm;
3. an approval signed with the orchestrator's key, bound to the exact request hash,
   resumes it, and the refund is paid once;
4. when a volatile fact (the fee) changes between preview and resume, the approval does
   not carry over: a new preview with a new hash is asked for.
"""

from __future__ import annotations

import logging
import sys
import uuid
from typing import Any

import psycopg
import structlog
from pydantic import BaseModel

from saga import Ceilings, Orchestrator, Saga, StepContext

APPROVAL_LIMIT_CENTS = 10_000
PROVIDER_SCHEMA = """
CREATE SCHEMA IF NOT EXISTS demo_refunds;
CREATE TABLE IF NOT EXISTS demo_refunds.fees (id int PRIMARY KEY, cents int NOT NULL);
INSERT INTO demo_refunds.fees VALUES (1, 30) ON CONFLICT (id) DO NOTHING;
CREATE TABLE IF NOT EXISTS demo_refunds.refunds (
    idempotency_key text PRIMARY KEY, order_id text NOT NULL, amount_cents int NOT NULL,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp());
"""


class RefundAsk(BaseModel):
    """What the agent asks for (its `confirmed` flag is just data)."""

    ticket_id: str
    order_id: str
    amount_cents: int
    confirmed: bool = False


class RefundRequest(BaseModel):
    """The typed intent, prepared before each attempt from the ask and current facts."""

    order_id: str
    amount_cents: int
    fee_cents: int


class Provider:
    conn: psycopg.Connection[tuple[Any, ...]]

    def connect(self, url: str) -> None:
        self.conn = psycopg.connect(url, autocommit=True)
        self.conn.execute(PROVIDER_SCHEMA)

    def fee(self) -> int:
        row = self.conn.execute("SELECT cents FROM demo_refunds.fees WHERE id = 1").fetchone()
        assert row is not None
        return int(row[0])

    def set_fee(self, cents: int) -> None:
        self.conn.execute("UPDATE demo_refunds.fees SET cents = %s WHERE id = 1", (cents,))

    def refund(self, key: str, request: RefundRequest) -> None:
        self.conn.execute(
            "INSERT INTO demo_refunds.refunds (idempotency_key, order_id, amount_cents)"
            " VALUES (%s, %s, %s) ON CONFLICT (idempotency_key) DO NOTHING",
            (key, request.order_id, request.amount_cents - request.fee_cents),
        )

    def refunds_for(self, order_id: str) -> int:
        row = self.conn.execute(
            "SELECT count(*) FROM demo_refunds.refunds WHERE order_id = %s", (order_id,)
        ).fetchone()
        assert row is not None
        return int(row[0])


provider = Provider()
refunds: Saga[RefundAsk] = Saga(
    "support_refund",
    version=1,
    input=RefundAsk,
    key=lambda a: a.ticket_id,
    ceilings=Ceilings(max_operations=5, spend_budget=50_000),
)


def needs_approval(request: RefundRequest) -> bool:
    return request.amount_cents > APPROVAL_LIMIT_CENTS


@refunds.step(
    idempotent=True,
    cost=lambda ask: ask.amount_cents,
    max_cost=25_000,
    confirm=needs_approval,
    confirm_ttl_seconds=600,
)
def pay_refund(ctx: StepContext, ask: RefundAsk) -> dict[str, int]:
    request: RefundRequest = ctx.request
    provider.refund(ctx.idempotency_key, request)
    print(f"  pay_refund: refunded {request.amount_cents - request.fee_cents:,} cents")
    return {"refunded_cents": request.amount_cents - request.fee_cents}


@pay_refund.prepare
def plan_refund(ctx: StepContext, ask: RefundAsk) -> RefundRequest:
    # Re-read before every attempt and on resume: a changed fee is a changed request.
    return RefundRequest(
        order_id=ask.order_id, amount_cents=ask.amount_cents, fee_cents=provider.fee()
    )


def expect(condition: bool, message: str) -> None:
    if not condition:
        sys.exit(f"FAILED: {message}")


def ask(cents: int) -> RefundAsk:
    suffix = uuid.uuid4().hex[:8]  # fresh keys: the example can run again and again
    return RefundAsk(
        ticket_id=f"t-{suffix}", order_id=f"o-{suffix}", amount_cents=cents, confirmed=True
    )


def main() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    key = "example-approval-key"  # in production: the approvers' secret, not the workers'
    with Orchestrator(sagas=[refunds], confirmation_key=key) as orch:
        provider.connect(orch.database_url)
        provider.set_fee(30)

        print("\n== A small refund goes through ==")
        small = orch.execute(refunds, ask(4_990))
        expect(small.status == "completed", f"small refund ended {small.status}")
        print(f"  -> {small.status}")

        print("\n== A large refund waits for a human, whatever the agent's payload says ==")
        large_ask = ask(18_000)
        state = orch.execute(refunds, large_ask)
        expect(state.status == "awaiting_confirmation", f"large refund is {state.status}")
        pending = orch.preview(state.id)
        expect(pending is not None, "no preview")
        assert pending is not None
        print(f"  -> {state.status}; the agent's input said confirmed=true, ignored")
        print(f"  preview: {pending.preview['payload']} hash {pending.request_hash[:16]}...")

        print("\n== The fee changes before the approval is used ==")
        token = orch.approval(state.id, "pay_refund", pending.request_hash, actor="lead@acme")
        orch.confirm(state.id, "pay_refund", pending.request_hash, token)
        provider.set_fee(45)
        state = orch.run(state.id)
        fresh = orch.preview(state.id)
        expect(state.status == "awaiting_confirmation", f"after the fee change: {state.status}")
        assert fresh is not None
        expect(fresh.request_hash != pending.request_hash, "the hash did not change")
        expect(provider.refunds_for(large_ask.order_id) == 0, "refunded without approval")
        print(f"  -> asks again: fee_cents={fresh.preview['payload']['fee_cents']}")

        print("\n== The lead approves the exact new request ==")
        token = orch.approval(state.id, "pay_refund", fresh.request_hash, actor="lead@acme")
        orch.confirm(state.id, "pay_refund", fresh.request_hash, token)
        state = orch.run(state.id)
        expect(state.status == "completed", f"approved refund ended {state.status}")
        count = provider.refunds_for(large_ask.order_id)
        expect(count == 1, f"{count} refunds paid, not exactly one")
        print(f"  -> {state.status}, exactly one refund at the provider, approved by lead@acme")
    print("\nAll scenes ended as told.")


if __name__ == "__main__":
    main()
