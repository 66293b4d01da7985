"""A pydantic-ai support agent whose tool calls are operations of a session.

An exchange ticket: the customer paid 129 EUR for a blue kettle and wants the red one
(139 EUR). A pydantic-ai `Agent` handles it with three tools, in one session per ticket
(`async with aorch.session(ticket_id)`), made durable by the `DurableTools` capability:

1. `charge_card(order_id, amount_cents)` charges the red kettle first; keyed on the
   order (never on the model's `tool_call_id`); its compensation refunds the charge.
2. `refund_payment(payment_id, amount_cents, reason)` refunds the blue one; keyed on the
   payment, the reason is volatile (the model words it anew on every turn); the
   provider dedupes on the call's key (`idempotent=True`). A refund of 100 EUR or more
   waits for an approval signed for exactly this call (`confirm=`): the agent run ends
   deferred, the session stays open, an approver signs the call's request hash, and the
   approved run makes the refund.
3. `send_email(to, template, order_id)` confirms the exchange.

No model service is needed: the model is pydantic-ai's `FunctionModel` playing a script
that looks at what the tools returned so far and asks for the next call, with a fresh
`tool_call_id` every turn, as a real model does. Run it again with the same ticket and
every call replays (the model sees the stored results; nothing is charged twice). The
providers are tables of the schema `demo_pyai` in the example's database, written by the
tools; at the end the example counts the ticket's effects there.

    python examples/refund_agent_pydantic_ai.py --ticket T-1
    python examples/refund_agent_pydantic_ai.py --ticket T-1          # again: all replayed
    python examples/refund_agent_pydantic_ai.py --ticket T-2 --fail-permanently

Exit status: 0 the ticket was handled; 1 an effect happened twice (or is missing); 3 the
refund was refused for good and the session's calls were compensated; 4 the session is
parked for a human; 5 another process holds the session.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import uuid
from dataclasses import dataclass
from typing import Any

import psycopg
import structlog
from pydantic_ai import Agent, DeferredToolRequests, DeferredToolResults
from pydantic_ai.messages import (
    ModelMessage,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from saga import (
    AsyncOrchestrator,
    AsyncSession,
    PermanentError,
    RetryPolicy,
    SessionBusy,
    SessionParked,
    StepContext,
    current_context,
)
from saga.integrations.pydantic_ai import (
    AgentRunDeferred,
    DurableTools,
    approval_results,
    sign_approval,
    tool_policy,
)

EXIT_BAD_EFFECTS, EXIT_COMPENSATED, EXIT_PARKED, EXIT_BUSY = 1, 3, 4, 5
# The approvers' secret. A real deployment keeps it with the approvers' service.
APPROVERS_KEY = b"demo approvers' secret"
APPROVAL_FROM_CENTS = 10_000

PROVIDER_SCHEMA = """
CREATE SCHEMA IF NOT EXISTS demo_pyai;
CREATE TABLE IF NOT EXISTS demo_pyai.charges (
    charge_id text PRIMARY KEY, idempotency_key text UNIQUE NOT NULL, order_id text NOT NULL,
    amount_cents int NOT NULL);
CREATE TABLE IF NOT EXISTS demo_pyai.refunds (
    refund_id text PRIMARY KEY, idempotency_key text UNIQUE NOT NULL, paid_by text NOT NULL,
    amount_cents int NOT NULL);
CREATE TABLE IF NOT EXISTS demo_pyai.emails (
    message_id text PRIMARY KEY, idempotency_key text UNIQUE NOT NULL, order_id text NOT NULL);
"""


def say(line: str = "") -> None:
    print(line, flush=True)


def key_of_call() -> str:
    ctx = current_context()
    assert ctx is not None, "the tools run inside the ticket's session"
    return ctx.idempotency_key


class Providers:
    """The card and mail providers; each dedupes on the idempotency key it is given."""

    conn: psycopg.AsyncConnection[tuple[Any, ...]]
    refuse_refunds = False

    async def connect(self, url: str) -> None:
        self.conn = await psycopg.AsyncConnection.connect(url, autocommit=True)
        await self.conn.execute(PROVIDER_SCHEMA)

    async def once(self, table: str, id_column: str, key: str, row: dict[str, Any]) -> str:
        """Insert `row` under `key` unless one is there; the id of the row under `key`."""
        columns = [id_column, "idempotency_key", *row]
        new_id = f"{table[:2]}_{uuid.uuid4().hex[:8]}"
        query = (
            f"INSERT INTO demo_pyai.{table} ({', '.join(columns)}) VALUES "
            f"({', '.join(['%s'] * len(columns))}) ON CONFLICT (idempotency_key) DO NOTHING"
        )
        await self.conn.execute(query.encode(), (new_id, key, *row.values()))
        cursor = await self.conn.execute(
            f"SELECT {id_column} FROM demo_pyai.{table} WHERE idempotency_key = %s".encode(),
            (key,),
        )
        found = await cursor.fetchone()
        assert found is not None
        return str(found[0])

    async def count(self, query: str, value: str) -> int:
        cursor = await self.conn.execute(query.encode(), (value,))
        row = await cursor.fetchone()
        return int(row[0]) if row else 0


providers = Providers()


# ----- the agent and its tools -------------------------------------------------------------------


@dataclass(frozen=True)
class Ticket:
    id: str
    customer: str = "ana@example.com"
    paid_cents: int = 12_900
    new_cents: int = 13_900

    @property
    def payment_id(self) -> str:
        return f"pay-{self.id}-blue"

    @property
    def new_order(self) -> str:
        return f"o-{self.id}-red"


def script(ticket: Ticket) -> FunctionModel:
    """The model: the next tool call from what the tools returned so far."""

    def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        done = {
            part.tool_name: part.content
            for message in messages
            for part in message.parts
            if isinstance(part, ToolReturnPart)
        }
        if "charge_card" not in done:
            call = ToolCallPart(
                "charge_card", {"order_id": ticket.new_order, "amount_cents": ticket.new_cents}
            )
        elif "refund_payment" not in done:
            reason = f"exchange, worded {uuid.uuid4().hex[:4]}"  # reworded every turn
            call = ToolCallPart(
                "refund_payment",
                {
                    "payment_id": ticket.payment_id,
                    "amount_cents": ticket.paid_cents,
                    "reason": reason,
                },
            )
        elif "send_email" not in done:
            call = ToolCallPart(
                "send_email",
                {"to": ticket.customer, "template": "exchanged", "order_id": ticket.new_order},
            )
        else:
            return ModelResponse(parts=[TextPart(f"Exchanged: {done['refund_payment']}")])
        say(f"  model asks {call.tool_name}({call.args})  [{call.tool_call_id}]")
        return ModelResponse(parts=[call])

    return FunctionModel(respond)


async def refund_charge(ctx: StepContext, result: Any, arguments: dict[str, Any]) -> None:
    """Compensation of charge_card: refund the charge."""
    paid_by = result["charge_id"] if result else arguments["order_id"]
    refund_id = await providers.once(
        "refunds",
        "refund_id",
        ctx.idempotency_key,
        {"paid_by": paid_by, "amount_cents": arguments["amount_cents"]},
    )
    say(f"    compensation: charge {paid_by} refunded ({refund_id})")


agent = Agent(
    name="exchange_agent",
    output_type=[str, DeferredToolRequests],
    capabilities=[DurableTools(approval_key=APPROVERS_KEY)],
)


@agent.tool_plain(
    metadata=tool_policy(
        key="{order_id}",
        idempotent=True,
        compensate=refund_charge,
        compensation_idempotent=True,
        compensation_retry=RetryPolicy(max_attempts=5),
    )
)
async def charge_card(order_id: str, amount_cents: int) -> dict[str, Any]:
    """Charge the customer's card for an order."""
    charge_id = await providers.once(
        "charges",
        "charge_id",
        key_of_call(),
        {"order_id": order_id, "amount_cents": amount_cents},
    )
    say(f"    card provider: charged {amount_cents} cents for {order_id} ({charge_id})")
    return {"charge_id": charge_id, "amount_cents": amount_cents}


@agent.tool_plain(
    metadata=tool_policy(
        key="{payment_id}",
        volatile=("reason",),
        idempotent=True,
        confirm=lambda arguments: arguments["amount_cents"] >= APPROVAL_FROM_CENTS,
    )
)
async def refund_payment(payment_id: str, amount_cents: int, reason: str) -> dict[str, Any]:
    """Refund a payment."""
    if providers.refuse_refunds:
        raise PermanentError(f"the card provider refuses to refund {payment_id}: disputed")
    refund_id = await providers.once(
        "refunds",
        "refund_id",
        key_of_call(),
        {"paid_by": payment_id, "amount_cents": amount_cents},
    )
    say(f"    card provider: refunded {amount_cents} cents of {payment_id} ({refund_id})")
    return {"refund_id": refund_id, "amount_cents": amount_cents}


@agent.tool_plain(metadata=tool_policy(key="{template}/{order_id}", idempotent=True))
async def send_email(to: str, template: str, order_id: str) -> dict[str, Any]:
    """Send the customer an email."""
    message_id = await providers.once("emails", "message_id", key_of_call(), {"order_id": order_id})
    say(f"    mail provider: sent {template!r} to {to} ({message_id})")
    return {"message_id": message_id}


# ----- handling a ticket -------------------------------------------------------------------------


@dataclass
class Counts:
    """How the session's calls were answered, over every entry of the ticket."""

    executed: int = 0
    replayed: int = 0
    reconciled: int = 0

    def add(self, session: AsyncSession) -> None:
        self.executed += session.executed
        self.replayed += session.replayed
        self.reconciled += session.reconciled


async def handle(aorch: AsyncOrchestrator, ticket: Ticket, counts: Counts) -> str:
    """Run the agent on the ticket until it is done, getting approvals on the way; the
    session's status. `counts` adds up how the calls were answered, whatever happens."""
    history: list[ModelMessage] | None = None
    approvals: DeferredToolResults | None = None
    while True:
        session = aorch.session(ticket.id, wait_seconds=15)
        try:
            async with session as run:
                say(f"Session {ticket.id!r} (saga {run.id}):")
                result = await agent.run(
                    "Exchange the blue kettle for the red one.",
                    model=script(ticket),
                    message_history=history,
                    deferred_tool_results=approvals,
                )
                say(f"  agent: {result.output}")
            return "completed"
        except AgentRunDeferred as deferred:
            history, tokens = deferred.messages, {}
            for call_id, request in deferred.approval_requests().items():
                say(f"  waits for approval: {request.tool}({request.arguments})")
                say(f"    request hash {request.request_hash[:16]}... (session {request.saga_id})")
                tokens[call_id] = sign_approval(
                    APPROVERS_KEY, request, actor="lead@example.com", ttl_seconds=3600
                )
                say("  lead@example.com signs an approval of exactly this request")
            approvals = approval_results(tokens)
        finally:
            counts.add(session)


async def count_effects(ticket: Ticket) -> dict[str, int]:
    """The ticket's effects at the providers, counted by business fields."""
    count = providers.count
    return {
        "charges": await count(
            "SELECT count(*) FROM demo_pyai.charges WHERE order_id = %s", ticket.new_order
        ),
        "refunds of the payment": await count(
            "SELECT count(*) FROM demo_pyai.refunds WHERE paid_by = %s", ticket.payment_id
        ),
        "refunds of the charge": await count(
            "SELECT count(*) FROM demo_pyai.refunds r JOIN demo_pyai.charges c"
            " ON r.paid_by = c.charge_id WHERE c.order_id = %s",
            ticket.new_order,
        ),
        "emails": await count(
            "SELECT count(*) FROM demo_pyai.emails WHERE order_id = %s", ticket.new_order
        ),
    }


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--database-url", help="default: SAGA_DATABASE_URL, else embedded")
    parser.add_argument("--ticket", default="T-1", help="the ticket's id (default: T-1)")
    parser.add_argument(
        "--fail-permanently",
        action="store_true",
        help="the provider refuses the refund for good: the charge is compensated",
    )
    args = parser.parse_args(argv)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    providers.refuse_refunds = args.fail_permanently
    ticket = Ticket(args.ticket)
    async with AsyncOrchestrator(args.database_url, lease_seconds=5) as aorch:
        await providers.connect(aorch.database_url)
        counts = Counts()
        try:
            status = await handle(aorch, ticket, counts)
            failure = None
        except PermanentError as exc:
            status, failure = "compensated", exc
        except SessionParked as exc:
            say(f"The session needs a human: {exc}")
            return EXIT_PARKED
        except SessionBusy as exc:
            say(f"Another process holds the session: {exc}")
            return EXIT_BUSY
        effects = await count_effects(ticket)
        await providers.conn.close()
    say()
    say(
        f"Ticket {ticket.id}: {status}; calls executed {counts.executed}, replayed "
        f"{counts.replayed}, reconciled {counts.reconciled}"
    )
    say("  effects: " + ", ".join(f"{name} {n}" for name, n in effects.items()))
    twice = [name for name, n in effects.items() if n > 1]
    expected = {"charges": 1, "refunds of the payment": 1, "refunds of the charge": 0, "emails": 1}
    if failure is not None:  # the new charge refunded, the old payment kept
        expected = {
            "charges": 1,
            "refunds of the payment": 0,
            "refunds of the charge": 1,
            "emails": 0,
        }
    if twice or effects != expected:
        print(f"FAILED: effects {effects}, expected {expected}", file=sys.stderr, flush=True)
        return EXIT_BAD_EFFECTS
    say("  no effect happened twice")
    if failure is not None:
        say(f"The refund failed for good ({failure}): the session's calls were compensated.")
        return EXIT_COMPENSATED
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
