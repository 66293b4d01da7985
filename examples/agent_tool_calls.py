"""An agent's tool calls as durable steps: one session per ticket, each effect once.

A support agent handles an exchange ticket: the customer paid for a blue mug and wants the
red one, which costs a little more. There is no model here: a scripted planner looks at
what the agent has seen so far (its observations) and decides the next tool call, with a
fresh random `tool_call_id` every time it plans, as a model does on every turn. The tools
are durable steps called inside one session, `orch.session(ticket_id)`:

1. `charge_card(order_id, amount_cents)` charges the replacement order first (a declined
   card then leaves nothing to undo). Its key is the order: a call is known by what it
   does, never by the `tool_call_id`, which changes whenever the planner runs again. The
   card provider does not dedupe, but it finds a charge by the key it was made with:
   the step's reconcile hook asks it when a crash left a call's outcome unknown. Its
   compensation, `refund_card`, refunds the charge.
2. `refund(payment_id, order_id, amount_cents)` refunds the original payment, keyed on
   the payment; the provider dedupes on `ctx.idempotency_key` (`idempotent=True`).
3. `send_email(to, template, order_id)` confirms the exchange, keyed on
   `(to, template, order_id)`; the mail provider dedupes on `ctx.idempotency_key`.

Run it again with the same ticket (after a crash, or after it finished) and the planner
plans again with new `tool_call_id`s; the session replays the calls already made, and
settles a call a crash cut off (reconcile hook, or a same-key retry), so each effect
happens once. The providers are tables of the schema `demo_agent` in the example's
database, written by the tools themselves; at the end the example counts the ticket's
effects there and fails if any happened twice.

    python examples/agent_tool_calls.py --ticket T-1
    python examples/agent_tool_calls.py --ticket T-2 --crash-in charge_card   # dies
    python examples/agent_tool_calls.py --ticket T-2    # resumes (once the killed run's
                                                        # lease, 10 s, has run out)
    python examples/agent_tool_calls.py --ticket T-3 --fail-permanently

Options: `--database-url` (default `SAGA_DATABASE_URL`, else the embedded PostgreSQL);
`--crash-in TOOL` kills the process with SIGKILL inside that tool, right after its
provider recorded the effect and before the session records the outcome;
`--fail-permanently` makes the card provider refuse the refund for good
(`PermanentError`): the session compensates its calls in reverse, so the new charge is
refunded; `--lease-seconds` is the session's lease (a killed holder's session can be
entered again once it has run out).

Exit status: 0 the ticket was handled; 1 an effect happened twice (or is missing);
3 the ticket failed permanently and its calls were compensated; 4 the session is parked
for a human (`saga show`, `saga resolve`); 5 another process holds the session.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, LiteralString

import psycopg
import structlog

from saga import (
    Absent,
    Found,
    Orchestrator,
    PermanentError,
    RetryPolicy,
    Session,
    SessionBusy,
    SessionParked,
    StepContext,
    current_context,
    durable_step,
)

EXIT_BAD_EFFECTS = 1
EXIT_COMPENSATED = 3
EXIT_PARKED = 4
EXIT_BUSY = 5
TOOL_NAMES = ("charge_card", "refund", "send_email")

PROVIDER_SCHEMA = """
CREATE SCHEMA IF NOT EXISTS demo_agent;
-- The card provider does not dedupe: a second call is a second charge. It keeps the key a
-- charge was made with, so a charge can be looked up by it.
CREATE TABLE IF NOT EXISTS demo_agent.charges (
    charge_id text PRIMARY KEY, idempotency_key text NOT NULL, order_id text NOT NULL,
    amount_cents int NOT NULL, created_at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE INDEX IF NOT EXISTS charges_by_key ON demo_agent.charges (idempotency_key);
-- Refunds and emails: one per idempotency key, a repeated call gets the first answer.
CREATE TABLE IF NOT EXISTS demo_agent.refunds (
    idempotency_key text PRIMARY KEY, refund_id text NOT NULL, payment_id text NOT NULL,
    order_id text NOT NULL, amount_cents int NOT NULL,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE IF NOT EXISTS demo_agent.emails (
    idempotency_key text PRIMARY KEY, message_id text NOT NULL, to_address text NOT NULL,
    template text NOT NULL, order_id text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp());
"""


def say(line: str = "") -> None:
    print(line, flush=True)  # flushed: a SIGKILL loses nothing already said


# ----- the providers ---------------------------------------------------------------------------


class Providers:
    """The card and mail providers, simulated in the schema `demo_agent`."""

    conn: psycopg.Connection[tuple[Any, ...]]
    crash_in: str | None = None
    refuse_refunds = False

    def connect(self, url: str) -> None:
        self.conn = psycopg.connect(url, autocommit=True)  # every call commits at once
        self.conn.execute(PROVIDER_SCHEMA)

    def close(self) -> None:
        self.conn.close()

    def charge(self, key: str, order_id: str, amount_cents: int) -> dict[str, Any]:
        charge_id = f"ch_{uuid.uuid4().hex[:10]}"
        self.conn.execute(
            "INSERT INTO demo_agent.charges (charge_id, idempotency_key, order_id, amount_cents)"
            " VALUES (%s, %s, %s, %s)",
            (charge_id, key, order_id, amount_cents),
        )
        return {"charge_id": charge_id, "order_id": order_id, "amount_cents": amount_cents}

    def find_charge(self, key: str) -> dict[str, Any] | None:
        row = self.conn.execute(
            "SELECT charge_id, order_id, amount_cents FROM demo_agent.charges"
            " WHERE idempotency_key = %s ORDER BY created_at LIMIT 1",
            (key,),
        ).fetchone()
        if row is None:
            return None
        return {"charge_id": row[0], "order_id": row[1], "amount_cents": row[2]}

    def refund(
        self, key: str, payment_id: str, order_id: str, amount_cents: int
    ) -> tuple[dict[str, Any], bool]:
        """The refund made under `key`, and whether this call made it (False: a repeat)."""
        inserted = self.conn.execute(
            "INSERT INTO demo_agent.refunds"
            " (idempotency_key, refund_id, payment_id, order_id, amount_cents)"
            " VALUES (%s, %s, %s, %s, %s) ON CONFLICT (idempotency_key) DO NOTHING",
            (key, f"re_{uuid.uuid4().hex[:10]}", payment_id, order_id, amount_cents),
        ).rowcount
        row = self.conn.execute(
            "SELECT refund_id, payment_id, amount_cents FROM demo_agent.refunds"
            " WHERE idempotency_key = %s",
            (key,),
        ).fetchone()
        assert row is not None
        answer = {"refund_id": row[0], "payment_id": row[1], "amount_cents": row[2]}
        return answer, inserted == 1

    def send(self, key: str, to: str, template: str, order_id: str) -> tuple[str, bool]:
        """The message id sent under `key`, and whether this call sent it."""
        inserted = self.conn.execute(
            "INSERT INTO demo_agent.emails"
            " (idempotency_key, message_id, to_address, template, order_id)"
            " VALUES (%s, %s, %s, %s, %s) ON CONFLICT (idempotency_key) DO NOTHING",
            (key, f"msg_{uuid.uuid4().hex[:10]}", to, template, order_id),
        ).rowcount
        row = self.conn.execute(
            "SELECT message_id FROM demo_agent.emails WHERE idempotency_key = %s", (key,)
        ).fetchone()
        assert row is not None
        return str(row[0]), inserted == 1

    def crash_if_asked(self, tool: str, what: str) -> None:
        if self.crash_in == tool:
            say(f"    !! {tool}: the provider recorded {what}; this process is killed now")
            say("       (SIGKILL), before the session records the call's outcome")
            os.kill(os.getpid(), signal.SIGKILL)


providers = Providers()
# How the call in progress was settled when it was not simply called, and what was seen
# (set by the tools and the reconcile hook, for the transcript).
notes: list[tuple[str, str]] = []


def key_of_call() -> str:
    ctx = current_context()
    assert ctx is not None, "the tools run inside the ticket's session"
    return ctx.idempotency_key


# ----- the tools: durable steps ----------------------------------------------------------------


@durable_step(name="charge_card", key=lambda order_id, amount_cents: order_id)
def charge_card(order_id: str, amount_cents: int) -> dict[str, Any]:
    charge = providers.charge(key_of_call(), order_id, amount_cents)
    providers.crash_if_asked("charge_card", f"charge {charge['charge_id']}")
    return charge


@charge_card.reconcile
def find_charge(ctx: StepContext, order_id: str, amount_cents: int) -> Found | Absent:
    """Asked when a call's outcome is unknown: did the provider charge under its key?"""
    charge = providers.find_charge(ctx.idempotency_key)
    if charge is None:
        notes.append(("called again", "outcome unknown; the card provider has no charge"))
        return Absent()  # nothing happened: the call is made again, under the same key
    notes.append(
        (
            "settled by its reconcile hook",
            f"outcome unknown; the card provider has {charge['charge_id']} under its key",
        )
    )
    return Found(charge, provider_reference=charge["charge_id"])


@charge_card.compensation(idempotent=True, retry=RetryPolicy(max_attempts=5))
def refund_card(ctx: StepContext, result: dict[str, Any], order_id: str, amount_cents: int) -> None:
    made, _ = providers.refund(
        ctx.idempotency_key, result["charge_id"], order_id, result["amount_cents"]
    )
    say(f"    compensation refund_card: refunded {result['charge_id']} ({made['refund_id']})")


@durable_step(
    name="refund",
    key=lambda payment_id, order_id, amount_cents: payment_id,
    idempotent=True,
)
def refund(payment_id: str, order_id: str, amount_cents: int) -> dict[str, Any]:
    if providers.refuse_refunds:
        # PermanentError says "this did not happen, and never will": no retry, and the
        # session compensates what it did. Any other exception leaves the outcome unknown.
        raise PermanentError(f"the card provider refuses to refund {payment_id}: disputed")
    answer, made = providers.refund(key_of_call(), payment_id, order_id, amount_cents)
    if not made:
        notes.append(("retried under its key", "the provider already had this refund"))
    providers.crash_if_asked("refund", f"refund {answer['refund_id']}")
    return answer


@durable_step(
    name="send_email",
    key=lambda to, template, order_id: json.dumps([to, template, order_id]),
    idempotent=True,
)
def send_email(to: str, template: str, order_id: str) -> dict[str, Any]:
    message_id, sent = providers.send(key_of_call(), to, template, order_id)
    if not sent:
        notes.append(("retried under its key", "the mail provider had already sent it"))
    providers.crash_if_asked("send_email", f"email {message_id}")
    return {"message_id": message_id, "to": to, "template": template}


TOOLS: dict[str, Callable[..., Any]] = {
    "charge_card": charge_card,
    "refund": refund,
    "send_email": send_email,
}


# ----- the agent: a scripted planner and its loop ----------------------------------------------


@dataclass(frozen=True)
class Ticket:
    id: str
    customer: str
    order_id: str  # the blue mug, paid by `payment_id`
    payment_id: str
    paid_cents: int
    replacement_order_id: str  # the red mug
    replacement_cents: int

    @classmethod
    def from_id(cls, ticket_id: str) -> Ticket:
        order_id = f"o-{ticket_id}"
        return cls(
            id=ticket_id,
            customer="ana@example.com",
            order_id=order_id,
            payment_id=f"pay-{order_id}",
            paid_cents=2400,
            replacement_order_id=f"{order_id}-red",
            replacement_cents=2600,
        )


@dataclass(frozen=True)
class ToolCall:
    tool_call_id: str  # fresh on every plan: for the transcript, never a key
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class Observation:
    call: ToolCall
    result: Any


def plan(ticket: Ticket, seen: list[Observation]) -> ToolCall | None:
    """The next tool call, from what the agent has seen so far; None when it is done."""
    done = {o.call.name for o in seen}

    def call(name: str, **arguments: Any) -> ToolCall:
        return ToolCall(f"call_{uuid.uuid4().hex[:12]}", name, arguments)

    if "charge_card" not in done:
        return call(
            "charge_card",
            order_id=ticket.replacement_order_id,
            amount_cents=ticket.replacement_cents,
        )
    if "refund" not in done:
        return call(
            "refund",
            payment_id=ticket.payment_id,
            order_id=ticket.order_id,
            amount_cents=ticket.paid_cents,
        )
    if "send_email" not in done:
        return call(
            "send_email",
            to=ticket.customer,
            template="exchange_confirmed",
            order_id=ticket.replacement_order_id,
        )
    return None


def run_agent(ticket: Ticket, run: Session, fates: list[str]) -> list[Observation]:
    """Plan, call, observe, until the planner is done; each call's fate is added to
    `fates` ("charge_card replayed", ...)."""
    seen: list[Observation] = []
    turn = 0
    while (call := plan(ticket, seen)) is not None:
        turn += 1
        shown = ", ".join(f"{k}={v!r}" for k, v in call.arguments.items())
        say(f"  turn {turn}  {call.tool_call_id}  {call.name}({shown})")
        replayed = run.replayed
        notes.clear()
        try:
            # The tool gets the arguments only: the tool_call_id is neither the call's
            # key nor one of its arguments (arguments are part of the request: a new id
            # under the same key would be another request, an IdempotencyConflict).
            result = TOOLS[call.name](**call.arguments)
        except PermanentError as exc:
            say(f"          -> failed for good: {exc}")
            fates.append(f"{call.name} failed")
            raise
        if run.replayed > replayed:
            fate, detail = "replayed", "replayed from the session, not called"
        elif notes:
            fate = notes[-1][0]
            detail = "; ".join(f"{what} ({seen_there})" for what, seen_there in notes)
        else:
            fate = detail = "called"
        say(f"          -> {detail}: {json.dumps(result)}")
        fates.append(f"{call.name} {fate}")
        seen.append(Observation(call, result))
    return seen


# ----- counting the effects --------------------------------------------------------------------


@dataclass(frozen=True)
class Effects:
    charges: int  # of the replacement order
    charges_refunded: int  # refunds of those charges (by the compensation)
    refunds: int  # of the original payment (by the `refund` tool)
    emails: int
    twice: list[str]  # effects that happened more than once

    def summary(self) -> str:
        return (
            f"charges {self.charges}, refunds of the original payment {self.refunds}, "
            f"refunds of the new charge {self.charges_refunded}, emails {self.emails}"
        )


def count_effects(ticket: Ticket) -> Effects:
    conn = providers.conn
    orders = [ticket.order_id, ticket.replacement_order_id]

    def counts(query: LiteralString, *params: Any) -> list[tuple[Any, ...]]:
        return conn.execute(query, params).fetchall()

    twice: list[str] = []
    for order_id, n in counts(
        "SELECT order_id, count(*) FROM demo_agent.charges WHERE order_id = ANY(%s)"
        " GROUP BY order_id HAVING count(*) > 1",
        orders,
    ):
        twice.append(f"order {order_id} was charged {n} times")
    for payment_id, n in counts(
        "SELECT payment_id, count(*) FROM demo_agent.refunds WHERE order_id = ANY(%s)"
        " GROUP BY payment_id HAVING count(*) > 1",
        orders,
    ):
        twice.append(f"payment {payment_id} was refunded {n} times")
    for to, template, order_id, n in counts(
        "SELECT to_address, template, order_id, count(*) FROM demo_agent.emails"
        " WHERE order_id = ANY(%s) GROUP BY 1, 2, 3 HAVING count(*) > 1",
        orders,
    ):
        twice.append(f"email {template!r} about {order_id} was sent to {to} {n} times")
    ((charges, charges_refunded, refunds, emails),) = counts(
        "SELECT (SELECT count(*) FROM demo_agent.charges WHERE order_id = %s),"
        " (SELECT count(*) FROM demo_agent.refunds r JOIN demo_agent.charges c"
        "   ON r.payment_id = c.charge_id WHERE c.order_id = %s),"
        " (SELECT count(*) FROM demo_agent.refunds WHERE payment_id = %s),"
        " (SELECT count(*) FROM demo_agent.emails WHERE order_id = ANY(%s))",
        ticket.replacement_order_id,
        ticket.replacement_order_id,
        ticket.payment_id,
        orders,
    )
    return Effects(int(charges), int(charges_refunded), int(refunds), int(emails), twice)


def check(effects: Effects, status: str) -> list[str]:
    """What is wrong with the ticket's effects, for a session that ended `status`."""
    if effects.twice:
        return effects.twice
    if status == "completed":
        expected = {
            "charges": (effects.charges, 1),
            "refunds of the original payment": (effects.refunds, 1),
            "refunds of the new charge": (effects.charges_refunded, 0),
            "emails": (effects.emails, 1),
        }
    elif status == "compensated":  # the new charge refunded, the original payment kept
        expected = {
            "refunds of the new charge": (effects.charges_refunded, effects.charges),
            "refunds of the original payment": (effects.refunds, 0),
        }
    else:
        expected = {}
    return [
        f"{name} {got}, expected {want}" for name, (got, want) in expected.items() if got != want
    ]


# ----- the program -----------------------------------------------------------------------------


def arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="An agent handles an exchange ticket with durable tool calls, one "
        "session per ticket: run it again after a crash and each effect still happens once.",
        epilog=f"exit status: 0 the ticket was handled; {EXIT_BAD_EFFECTS} an effect happened "
        f"twice (or is missing); {EXIT_COMPENSATED} the ticket failed permanently and its calls "
        f"were compensated; {EXIT_PARKED} the session is parked for a human; {EXIT_BUSY} another "
        "process holds the session",
    )
    parser.add_argument(
        "--database-url",
        default=None,
        help="PostgreSQL URL (default: SAGA_DATABASE_URL, else the embedded PostgreSQL)",
    )
    parser.add_argument("--ticket", default="T-1", help="the ticket's id (default: T-1)")
    parser.add_argument(
        "--crash-in",
        choices=TOOL_NAMES,
        help="kill this process (SIGKILL) inside this tool, after its provider recorded the effect",
    )
    parser.add_argument(
        "--fail-permanently",
        action="store_true",
        help="the card provider refuses the refund for good: the session compensates "
        f"(the new charge is refunded) and the exit status is {EXIT_COMPENSATED}",
    )
    parser.add_argument(
        "--lease-seconds",
        type=float,
        default=10.0,
        help="the session's lease; after a crash, the next run waits for it to run out "
        "(default: 10)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    # Keep the library's logs out of the transcript.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    providers.crash_in = args.crash_in
    providers.refuse_refunds = args.fail_permanently
    ticket = Ticket.from_id(args.ticket)
    say(
        f"Ticket {ticket.id} from {ticket.customer}: paid {ticket.paid_cents} cents for "
        f"{ticket.order_id} (blue mug), wants the red one ({ticket.replacement_cents} cents)."
    )
    with Orchestrator(args.database_url, lease_seconds=args.lease_seconds) as orch:
        providers.connect(orch.database_url)
        try:
            return handle(orch, ticket, wait_seconds=args.lease_seconds + 5)
        finally:
            providers.close()


def handle(orch: Orchestrator, ticket: Ticket, *, wait_seconds: float) -> int:
    failure: PermanentError | None = None
    say(f"Session {ticket.id!r} (waits up to {wait_seconds:g} s for a previous holder's lease):")
    session = orch.session(ticket.id, wait_seconds=wait_seconds)
    fates: list[str] = []
    try:
        with session as run:
            say(f"  saga {run.id}")
            run_agent(ticket, run, fates)
    except PermanentError as exc:
        failure = exc
    except SessionParked as exc:
        say(f"\nThe session needs a human: {exc}")
        say("Check with the provider, then `saga resolve` the call; the next run replays it.")
        return EXIT_PARKED
    except SessionBusy as exc:
        say(f"\nAnother process holds the session: {exc}")
        return EXIT_BUSY
    status = orch.get(session.id).status
    effects = count_effects(ticket)
    say()
    say("Summary")
    say(f"  session:  {ticket.id} (saga {session.id}), {status}")
    say(f"  executed: {session.executed}")
    say(f"  replayed: {session.replayed}")
    say(f"  reconciled: {session.reconciled}")
    say(f"  calls:    {', '.join(fates)}")
    say(f"  effects:  {effects.summary()}")
    problems = check(effects, status)
    if problems:
        print(f"FAILED: ticket {ticket.id}: {'; '.join(problems)}", file=sys.stderr, flush=True)
        return EXIT_BAD_EFFECTS
    say("  no effect happened twice")
    if failure is not None:
        say(f"The ticket could not be handled: {failure}")
        say("The session's calls were compensated in reverse: the new charge is refunded.")
        return EXIT_COMPENSATED
    return 0


if __name__ == "__main__":
    sys.exit(main())
