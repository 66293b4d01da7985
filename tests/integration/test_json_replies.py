"""What the server sends as JSON (the SQL functions' replies, inputs and results in their
rows) reads back as the json module reads PostgreSQL's text of it, through both doors:
integers beyond 64 bits exact, floats to the bit, unicode, nesting."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import psycopg
from psycopg.types.json import set_json_loads
from pydantic import BaseModel

from saga import AsyncOrchestrator, Orchestrator, Saga, StepContext
from saga._db import jsonloads

PAYLOAD: dict[str, Any] = {
    "big": 123456789012345678901234567890,
    "below_int64": -9223372036854775809,
    "u64": 18446744073709551615,
    "beyond_u64": 18446744073709551616,
    "tenth": 0.1,
    "third": 1 / 3,
    "tiny": 5e-324,
    "largest_exact": 9007199254740991.0,
    "round": 1e15,
    "mantissa": 0.30000000000000004,
    "negative_zero": -0.0,
    "text": 'caf\u00e9 \u4e2d\u6587 \U0001f600 "q" \\ \n',
    "nested": [{"a": [1, [2.5, None, True, False]], "\u00e9": {}}, []],
    "digits_as_text": "12345678901234567890123",
}


class In(BaseModel):
    key: str
    payload: dict[str, Any]


def _saga(name: str, *, is_async: bool) -> Saga[In]:
    saga: Saga[In] = Saga(name, version=1, input=In, key=lambda i: i.key)
    if is_async:

        @saga.step(name="echo")
        async def echo_async(ctx: StepContext, item: In) -> dict[str, Any]:
            return item.payload

    else:

        @saga.step(name="echo")
        def echo(ctx: StepContext, item: In) -> dict[str, Any]:
            return item.payload

    return saga


def _exactly(value: Any) -> str:
    # json.dumps tells int from float (5 against 5.0) and keeps a float's every digit.
    return json.dumps(value)


def _stored(database_url: str, key: str) -> tuple[Any, Any]:
    """The saga's input and its step's result as the json module reads PostgreSQL's text."""
    with psycopg.connect(database_url) as conn:
        row = conn.execute(
            "SELECT s.input::text, o.result::text FROM saga.sagas s"
            " JOIN saga.operations o ON o.saga_id = s.id WHERE s.key = %s AND o.kind = 'action'",
            (key,),
        ).fetchone()
    assert row is not None
    return json.loads(row[0]), json.loads(row[1])


def test_results_and_inputs_read_exactly(database_url: str) -> None:
    saga = _saga("json_sync", is_async=False)
    with Orchestrator(database_url, sagas=[saga]) as orch:
        # execute(): the start's and the writes' replies.
        executed = orch.execute(saga, In(key="x", payload=PAYLOAD))
        # start(), then a worker: the batch claim's rows and the group writes' replies.
        started = orch.start(saga, In(key="w", payload=PAYLOAD))
        orch.worker(concurrency=2).run(until_idle=True)
        worked = orch.get(started.id)
    assert worked is not None
    for key, state in (("x", executed), ("w", worked)):
        assert state.status == "completed"
        stored_input, stored_result = _stored(database_url, key)
        result = state.operation("echo").result
        assert _exactly(result) == _exactly(stored_result)
        assert _exactly(state.input) == _exactly(stored_input)
        assert result["big"] == PAYLOAD["big"] and type(result["big"]) is int
        assert result["beyond_u64"] == 2**64 and type(result["beyond_u64"]) is int
        assert result["text"] == PAYLOAD["text"]


def test_async_door_reads_exactly(database_url: str) -> None:
    saga = _saga("json_async", is_async=True)

    async def main() -> tuple[Any, Any]:
        async with AsyncOrchestrator(database_url, sagas=[saga]) as orch:
            executed = await orch.execute(saga, In(key="ax", payload=PAYLOAD))
            started = await orch.start(saga, In(key="aw", payload=PAYLOAD))
            await orch.worker(concurrency=2).run(until_idle=True)
            return executed, await orch.get(started.id)

    executed, worked = asyncio.run(asyncio.wait_for(main(), 60.0))
    for key, state in (("ax", executed), ("aw", worked)):
        assert state is not None and state.status == "completed"
        stored_input, stored_result = _stored(database_url, key)
        assert _exactly(state.operation("echo").result) == _exactly(stored_result)
        assert _exactly(state.input) == _exactly(stored_input)


def test_pool_connections_read_with_orjson(database_url: str) -> None:
    with Orchestrator(database_url) as orch, orch.store.pool.connection() as conn:
        loader = conn.adapters.get_loader(3802, psycopg.pq.Format.TEXT)
        assert getattr(loader, "_loads", None) is jsonloads.loads


def test_a_loads_the_application_set_stays(database_url: str) -> None:
    def mine(data: bytes | str) -> Any:
        return json.loads(data)

    with psycopg.connect(database_url) as conn:
        set_json_loads(mine, conn)
        jsonloads.use_on(conn)
        loader = conn.adapters.get_loader(3802, psycopg.pq.Format.TEXT)
        assert getattr(loader, "_loads", None) is mine
    with psycopg.connect(database_url) as conn:
        jsonloads.use_on(conn)
        loader = conn.adapters.get_loader(114, psycopg.pq.Format.TEXT)
        assert getattr(loader, "_loads", None) is jsonloads.loads
