"""A process that runs a pydantic-ai agent's refund in a session, for the kill tests.

    python pydantic_ai_app.py RUN_ID     (database: PYAI_APP_URL, tool: PYAI_APP_TOOL)

The tool is `refund_reconciled` (the provider does not dedupe; a reconcile hook looks the
refund up by key) or `refund_idempotent` (the provider dedupes on the key). The agent's
model is a script: it asks for the refund of order o-1 with a fresh `tool_call_id` (and a
fresh volatile note) on every run, then reports what the tool returned. With
PYAI_APP_KILL=after_effect the process SIGKILLs itself inside the tool right after the
provider recorded the refund, with `before_effect` right before; either way after the
session recorded the call as running and before it recorded the outcome.

The refunds are rows of the test database's `pyai_refunds` table, written by the tool
(not through the orchestrator), so the parent counts what really happened. Lines the
parent reads start with `PYAI_APP `.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import uuid
from typing import Any

import psycopg
from pydantic_ai import Agent
from pydantic_ai.messages import (
    ModelMessage,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from saga import Absent, AsyncOrchestrator, Found, StepContext, current_context
from saga.integrations.pydantic_ai import DurableTools, tool_policy

URL = os.environ.get("PYAI_APP_URL", "")
KILL = os.environ.get("PYAI_APP_KILL", "")
TOOL = os.environ.get("PYAI_APP_TOOL", "refund_reconciled")
LEASE_SECONDS = float(os.environ.get("PYAI_APP_LEASE", "1.0"))
TABLE = """
CREATE TABLE IF NOT EXISTS pyai_refunds (
    refund_id text PRIMARY KEY, idempotency_key text NOT NULL, order_id text NOT NULL,
    amount_cents int NOT NULL)
"""


def say(line: str) -> None:
    print(f"PYAI_APP {line}", flush=True)


def kill_if(moment: str) -> None:
    if moment == KILL:
        say(f"KILLED {moment}")
        os.kill(os.getpid(), signal.SIGKILL)


def insert_refund(key: str, order_id: str, amount_cents: int, *, dedupe: bool) -> dict[str, Any]:
    """The provider's refund under `key` (a second one unless it dedupes)."""
    with psycopg.connect(URL, autocommit=True) as conn:
        if dedupe:
            row = conn.execute(
                "SELECT refund_id FROM pyai_refunds WHERE idempotency_key = %s", (key,)
            ).fetchone()
            if row is not None:
                return {"refund_id": row[0], "order_id": order_id, "amount_cents": amount_cents}
        refund_id = f"re_{uuid.uuid4().hex[:10]}"
        conn.execute(
            "INSERT INTO pyai_refunds (refund_id, idempotency_key, order_id, amount_cents)"
            " VALUES (%s, %s, %s, %s)",
            (refund_id, key, order_id, amount_cents),
        )
    return {"refund_id": refund_id, "order_id": order_id, "amount_cents": amount_cents}


def find_refund(ctx: StepContext, arguments: dict[str, Any]) -> Found | Absent:
    """The reconcile hook: did the provider refund under the call's key?"""
    with psycopg.connect(URL, autocommit=True) as conn:
        row = conn.execute(
            "SELECT refund_id, order_id, amount_cents FROM pyai_refunds WHERE idempotency_key = %s",
            (ctx.idempotency_key,),
        ).fetchone()
    if row is None:
        say("RECONCILED absent")
        return Absent()
    say("RECONCILED found")
    return Found({"refund_id": row[0], "order_id": row[1], "amount_cents": row[2]})


def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """Ask for the refund (a fresh tool_call_id every run), then report its result."""
    returned = [
        part
        for message in messages
        for part in message.parts
        if isinstance(part, ToolReturnPart) and part.tool_name == TOOL
    ]
    if returned:
        seen = {"content": returned[-1].content, "id": returned[-1].tool_call_id}
        say("RESULT " + json.dumps(seen))
        return ModelResponse(parts=[TextPart("refunded")])
    arguments = {"order_id": "o-1", "amount_cents": 2400, "note": uuid.uuid4().hex}
    return ModelResponse(parts=[ToolCallPart(TOOL, arguments)])


agent = Agent(FunctionModel(script), name="pyai_app", capabilities=[DurableTools()])


@agent.tool_plain(metadata=tool_policy(key="{order_id}", volatile=("note",), reconcile=find_refund))
def refund_reconciled(order_id: str, amount_cents: int, note: str) -> dict[str, Any]:
    ctx = current_context()
    assert ctx is not None
    kill_if("before_effect")
    refund = insert_refund(ctx.idempotency_key, order_id, amount_cents, dedupe=False)
    kill_if("after_effect")
    return refund


@agent.tool_plain(metadata=tool_policy(key="{order_id}", volatile=("note",), idempotent=True))
def refund_idempotent(order_id: str, amount_cents: int, note: str) -> dict[str, Any]:
    ctx = current_context()
    assert ctx is not None
    kill_if("before_effect")
    refund = insert_refund(ctx.idempotency_key, order_id, amount_cents, dedupe=True)
    kill_if("after_effect")
    return refund


async def main(run_id: str) -> None:
    async with (
        AsyncOrchestrator(URL, lease_seconds=LEASE_SECONDS) as aorch,
        aorch.session(run_id, wait_seconds=30) as run,
    ):
        say(f"SESSION {run.id}")
        output = (await agent.run("Refund order o-1, please.")).output
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
