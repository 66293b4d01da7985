"""A process that runs an OpenAI Agents SDK agent's refund in a session, for the kill tests.

    python openai_agents_app.py RUN_ID     (database: OAI_APP_URL, tool: OAI_APP_TOOL)

The tool is `refund_reconciled` (the provider does not dedupe; a reconcile hook looks the
refund up by key) or `refund_idempotent` (the provider dedupes on the key). The agent's
model is a script: it asks for the refund of order o-1 with a fresh `call_id` (and a
fresh volatile note) on every run, then reports what the tool returned. With
OAI_APP_KILL=after_effect the process SIGKILLs itself inside the tool right after the
provider recorded the refund, with `before_effect` right before; either way after the
session recorded the call as running and before it recorded the outcome.

The refunds are rows of the test database's `oai_refunds` table, written by the tool
(not through the orchestrator), so the parent counts what really happened. Lines the
parent reads start with `OAI_APP `.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator
from typing import Any

import psycopg
from agents import Agent, Model, ModelResponse, Usage, set_tracing_disabled
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)

from saga import Absent, AsyncOrchestrator, Found, StepContext, current_context
from saga.integrations.openai_agents import DurableTools

URL = os.environ.get("OAI_APP_URL", "")
KILL = os.environ.get("OAI_APP_KILL", "")
TOOL = os.environ.get("OAI_APP_TOOL", "refund_reconciled")
LEASE_SECONDS = float(os.environ.get("OAI_APP_LEASE", "1.0"))

set_tracing_disabled(True)


def say(line: str) -> None:
    print(f"OAI_APP {line}", flush=True)


def kill_if(moment: str) -> None:
    if moment == KILL:
        say(f"KILLED {moment}")
        os.kill(os.getpid(), signal.SIGKILL)


def insert_refund(key: str, order_id: str, amount_cents: int, *, dedupe: bool) -> dict[str, Any]:
    """The provider's refund under `key` (a second one unless it dedupes)."""
    with psycopg.connect(URL, autocommit=True) as conn:
        if dedupe:
            row = conn.execute(
                "SELECT refund_id FROM oai_refunds WHERE idempotency_key = %s", (key,)
            ).fetchone()
            if row is not None:
                return {"refund_id": row[0], "order_id": order_id, "amount_cents": amount_cents}
        refund_id = f"re_{uuid.uuid4().hex[:10]}"
        conn.execute(
            "INSERT INTO oai_refunds (refund_id, idempotency_key, order_id, amount_cents)"
            " VALUES (%s, %s, %s, %s)",
            (refund_id, key, order_id, amount_cents),
        )
    return {"refund_id": refund_id, "order_id": order_id, "amount_cents": amount_cents}


def find_refund(ctx: StepContext, arguments: dict[str, Any]) -> Found | Absent:
    """The reconcile hook: did the provider refund under the call's key?"""
    with psycopg.connect(URL, autocommit=True) as conn:
        row = conn.execute(
            "SELECT refund_id, order_id, amount_cents FROM oai_refunds WHERE idempotency_key = %s",
            (ctx.idempotency_key,),
        ).fetchone()
    if row is None:
        say("RECONCILED absent")
        return Absent()
    say("RECONCILED found")
    return Found({"refund_id": row[0], "order_id": row[1], "amount_cents": row[2]})


class Script(Model):
    """Asks for the refund (a fresh call_id every run), then reports its result."""

    async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
        items = args[1] if len(args) > 1 else kwargs["input"]
        returned = [
            dict(item)
            for item in (items if isinstance(items, list) else [])
            if dict(item).get("type") == "function_call_output"
        ]
        if returned:
            seen = {"output": returned[-1]["output"], "call_id": returned[-1]["call_id"]}
            say("RESULT " + json.dumps(seen))
            text = ResponseOutputText(type="output_text", text="refunded", annotations=[])
            done = ResponseOutputMessage(
                id="msg_1", type="message", role="assistant", status="completed", content=[text]
            )
            return ModelResponse(output=[done], usage=Usage(), response_id=None)
        arguments = {"order_id": "o-1", "amount_cents": 2400, "note": uuid.uuid4().hex}
        call = ResponseFunctionToolCall(
            type="function_call",
            name=TOOL,
            arguments=json.dumps(arguments),
            call_id=f"call_{uuid.uuid4().hex[:12]}",
            id=f"fc_{uuid.uuid4().hex[:12]}",
            status="completed",
        )
        return ModelResponse(output=[call], usage=Usage(), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        raise NotImplementedError("the scripted model does not stream")


durable = DurableTools("oai_app")


@durable.tool(key="{order_id}", volatile=("note",), reconcile=find_refund)
def refund_reconciled(order_id: str, amount_cents: int, note: str) -> dict[str, Any]:
    """Refund an order (the provider does not dedupe)."""
    ctx = current_context()
    assert ctx is not None
    kill_if("before_effect")
    refund = insert_refund(ctx.idempotency_key, order_id, amount_cents, dedupe=False)
    kill_if("after_effect")
    return refund


@durable.tool(key="{order_id}", volatile=("note",), idempotent=True)
def refund_idempotent(order_id: str, amount_cents: int, note: str) -> dict[str, Any]:
    """Refund an order (the provider dedupes on the key)."""
    ctx = current_context()
    assert ctx is not None
    kill_if("before_effect")
    refund = insert_refund(ctx.idempotency_key, order_id, amount_cents, dedupe=True)
    kill_if("after_effect")
    return refund


agent = Agent(name="oai_app", model=Script(), tools=[refund_reconciled, refund_idempotent])


async def main(run_id: str) -> None:
    async with (
        AsyncOrchestrator(URL, lease_seconds=LEASE_SECONDS) as aorch,
        aorch.session(run_id, wait_seconds=30) as run,
    ):
        say(f"SESSION {run.id}")
        output = (await durable.run(agent, "Refund order o-1, please.")).final_output
        say(
            json.dumps(
                {
                    "output": output,
                    "executed": run.executed,
                    "replayed": run.replayed,
                    "reconciled": run.reconciled,
                }
            )
        )


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
