"""A delivery saga behind an AsyncOrchestrator (`faults.crash_app_async:orch`), for
`saga.testing.crash_test`'s async door.

`book` and `dispatch` are coroutines, `charge` a plain function, each with a
compensation (of the same kind) and a reconcile hook on every operation. Every call of a
step or a compensation inserts a row in the ledger `crash_ledger.calls`, which
deduplicates nothing: an operation executed twice shows as two rows of one idempotency
key. A coroutine's row also counts the calls made so far on its event loop
(`loop_calls`): the sync door awaits each coroutine in a loop of its own (always 1), the
async door awaits them all on the caller's loop.

The database comes from `SAGA_DATABASE_URL`, which `crash_test` sets in its children.
"""

from __future__ import annotations

import asyncio
import os
import weakref
from typing import Any

import psycopg
from pydantic import BaseModel

from saga import Absent, AsyncOrchestrator, Found, PermanentError, Saga, StepContext

LEDGER_SCHEMA = """
CREATE SCHEMA IF NOT EXISTS crash_ledger;
CREATE TABLE IF NOT EXISTS crash_ledger.calls (
    id              bigserial PRIMARY KEY,
    idempotency_key text NOT NULL,
    step            text NOT NULL,
    kind            text NOT NULL,
    pid             integer NOT NULL,
    loop_calls      integer NOT NULL,
    at              timestamptz NOT NULL DEFAULT clock_timestamp()
);
"""
_INSERT = (
    "INSERT INTO crash_ledger.calls (idempotency_key, step, kind, pid, loop_calls)"
    " VALUES (%s, %s, %s, %s, %s) RETURNING id"
)
_FIND = "SELECT id FROM crash_ledger.calls WHERE idempotency_key = %s ORDER BY id LIMIT 1"

_loop_calls: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, int] = weakref.WeakKeyDictionary()


def create_ledger(url: str) -> None:
    """Create the ledger's table (idempotent)."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(LEDGER_SCHEMA)


def executions(url: str) -> dict[str, int]:
    """Calls recorded per idempotency key."""
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT idempotency_key, count(*) FROM crash_ledger.calls GROUP BY 1"
        ).fetchall()
    return {str(k): int(n) for k, n in rows}


def most_calls_on_one_loop(url: str, keys: list[str]) -> int:
    """The highest `loop_calls` of the calls made with these idempotency keys (0: none)."""
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT coalesce(max(loop_calls), 0) FROM crash_ledger.calls"
            " WHERE idempotency_key = ANY(%s)",
            (keys,),
        ).fetchone()
    assert row is not None
    return int(row[0])


def _url() -> str:
    return os.environ["SAGA_DATABASE_URL"]


async def _perform_async(ctx: StepContext) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    _loop_calls[loop] = calls = _loop_calls.get(loop, 0) + 1
    async with await psycopg.AsyncConnection.connect(_url(), autocommit=True) as conn:
        cur = await conn.execute(
            _INSERT, (ctx.idempotency_key, ctx.step, ctx.kind, os.getpid(), calls)
        )
        row = await cur.fetchone()
    assert row is not None
    return {"effect": int(row[0]), "step": ctx.step}


async def _find_async(ctx: StepContext) -> Found | Absent:
    async with await psycopg.AsyncConnection.connect(_url(), autocommit=True) as conn:
        cur = await conn.execute(_FIND, (ctx.idempotency_key,))
        row = await cur.fetchone()
    if row is None:
        return Absent()
    return Found({"effect": int(row[0]), "step": ctx.step}, provider_reference=str(row[0]))


def _perform(ctx: StepContext) -> dict[str, Any]:
    with psycopg.connect(_url(), autocommit=True) as conn:
        row = conn.execute(
            _INSERT, (ctx.idempotency_key, ctx.step, ctx.kind, os.getpid(), 0)
        ).fetchone()
    assert row is not None
    return {"effect": int(row[0]), "step": ctx.step}


def _find(ctx: StepContext) -> Found | Absent:
    with psycopg.connect(_url(), autocommit=True) as conn:
        row = conn.execute(_FIND, (ctx.idempotency_key,)).fetchone()
    if row is None:
        return Absent()
    return Found({"effect": int(row[0]), "step": ctx.step}, provider_reference=str(row[0]))


class Parcel(BaseModel):
    """The delivery's input: `refuse` makes the carrier refuse it (compensation follows)."""

    key: str
    refuse: bool = False


delivery = Saga("delivery", version=1, input=Parcel, key=lambda p: p.key)


@delivery.step
async def book(ctx: StepContext, p: Parcel) -> dict[str, Any]:
    return await _perform_async(ctx)


@book.reconcile
async def find_booking(ctx: StepContext, p: Parcel) -> Found | Absent:
    return await _find_async(ctx)


@book.compensation
async def cancel_booking(ctx: StepContext, p: Parcel, result: dict[str, Any]) -> dict[str, Any]:
    return await _perform_async(ctx)


@cancel_booking.reconcile
async def find_cancellation(ctx: StepContext, p: Parcel, result: dict[str, Any]) -> Found | Absent:
    return await _find_async(ctx)


@delivery.step
def charge(ctx: StepContext, p: Parcel) -> dict[str, Any]:
    return _perform(ctx)


@charge.reconcile
def find_charge(ctx: StepContext, p: Parcel) -> Found | Absent:
    return _find(ctx)


@charge.compensation
def refund(ctx: StepContext, p: Parcel, result: dict[str, Any]) -> dict[str, Any]:
    return _perform(ctx)


@refund.reconcile
def find_refund(ctx: StepContext, p: Parcel, result: dict[str, Any]) -> Found | Absent:
    return _find(ctx)


@delivery.step
async def dispatch(ctx: StepContext, p: Parcel) -> dict[str, Any]:
    if p.refuse:
        raise PermanentError("the carrier refused the parcel")
    return await _perform_async(ctx)


@dispatch.reconcile
async def find_dispatch(ctx: StepContext, p: Parcel) -> Found | Absent:
    return await _find_async(ctx)


orch = AsyncOrchestrator(sagas=[delivery])
