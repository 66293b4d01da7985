"""Helpers of the asyncio tests: saga shapes mixing sync and async steps, call counters, and
a record of what a saga wrote (operations and events) with run-specific facts left out,
so that what `Orchestrator` and `AsyncOrchestrator` write can be compared."""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from collections.abc import Callable
from typing import Any

from support import Order, Receipt, order_saga

from saga import (
    Found,
    HistoryEvent,
    PermanentError,
    RetryPolicy,
    Saga,
    SagaState,
    StepContext,
    TransientError,
)

# Three attempts, 10 ms apart: retries without slowing the suite (seconds).
QUICK3 = RetryPolicy(max_attempts=3, initial_delay=0.01, max_delay=0.01)

# Detail fields that say who ran an attempt, when, or for how long: they differ between any
# two runs, whatever drives them.
RUN_SPECIFIC = frozenset(
    {
        "owner",
        "fence",
        "token",
        "lease_owner",
        "lease_expires_at",
        "expires_at",
        "at",
        "started_at",
        "finished_at",
        "next_attempt_at",
        "run_after",
        "delay",
        "delay_seconds",
        "wait_seconds",
        "elapsed",
        "elapsed_seconds",
        "duration",
        "duration_seconds",
        "seconds",
        "traceback",
        "pid",
        "thread",
        "host",
        "saga_id",
        "id",
    }
)


class Calls:
    """How many times each (order id, function) was called: the side effects of a test."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()
        self.order: list[tuple[str, str]] = []

    def hit(self, order: Order, what: str) -> None:
        self.counts[(order.order_id, what)] += 1
        self.order.append((order.order_id, what))

    def of(self, order_id: str) -> dict[str, int]:
        """function -> calls, for one order."""
        return {what: n for (oid, what), n in self.counts.items() if oid == order_id}

    def sequence(self, order_id: str) -> list[str]:
        """The functions called for one order, in call order."""
        return [what for oid, what in self.order if oid == order_id]


# ----- the shapes ---------------------------------------------------------------------------
#
# Each shape decides by `ctx.attempt` alone, never by what happened to another saga, so the
# same definition driven twice (under two keys) behaves the same both times.


def happy_shape(calls: Calls, name: str = "d_happy") -> Saga[Order]:
    """reserve (sync, its request from an async prepare hook) -> charge (async, a model
    result) -> ship (async, reads earlier results)."""
    saga = order_saga(name)

    @saga.step
    def reserve(ctx: StepContext, o: Order) -> dict[str, Any]:
        calls.hit(o, "reserve")
        assert ctx.request == {"sku": "x", "qty": 1}
        return dict(ctx.request)

    @reserve.prepare
    async def reserve_request(ctx: StepContext, o: Order) -> dict[str, Any]:
        await asyncio.sleep(0)
        calls.hit(o, "reserve_request")
        return {"sku": "x", "qty": 1}

    @saga.step
    async def charge(ctx: StepContext, o: Order) -> Receipt:
        await asyncio.sleep(0)
        calls.hit(o, "charge")
        return Receipt(receipt_id="r-1", amount_cents=o.amount_cents)

    @saga.step
    async def ship(ctx: StepContext, o: Order) -> dict[str, Any]:
        await asyncio.sleep(0)
        calls.hit(o, "ship")
        receipt = ctx.results["charge"]
        assert isinstance(receipt, Receipt)
        return {
            "shipped": True,
            "receipt": receipt.receipt_id,
            "sku": ctx.results["reserve"]["sku"],
        }

    return saga


def transient_shape(calls: Calls, name: str = "d_transient") -> Saga[Order]:
    """reserve (async) -> charge (sync, fails transiently twice) -> notify (async,
    idempotent, its connection reset once: unknown, retried with the same key; its request
    from a sync prepare hook asked before each attempt)."""
    saga = order_saga(name)

    @saga.step
    async def reserve(ctx: StepContext, o: Order) -> dict[str, Any]:
        calls.hit(o, "reserve")
        return {"sku": "x"}

    @saga.step(retry=QUICK3)
    def charge(ctx: StepContext, o: Order) -> dict[str, Any]:
        calls.hit(o, f"charge:{ctx.attempt}")
        if ctx.attempt < 3:
            raise TransientError(f"gateway busy (attempt {ctx.attempt})")
        return {"charged": o.amount_cents}

    @saga.step(retry=QUICK3, idempotent=True)  # the mailer dedupes on the key
    async def notify(ctx: StepContext, o: Order) -> dict[str, Any]:
        await asyncio.sleep(0)
        calls.hit(o, f"notify:{ctx.attempt}")
        if ctx.attempt == 1:
            raise ConnectionError("smtp reset")
        return {"sent": ctx.request["template"]}

    @notify.prepare
    def notify_request(ctx: StepContext, o: Order) -> dict[str, Any]:
        calls.hit(o, f"notify_request:{ctx.attempt}")
        return {"template": "receipt", "amount_cents": o.amount_cents}

    return saga


def permanent_shape(calls: Calls, name: str = "d_permanent") -> Saga[Order]:
    """a (sync, async undo) -> b (async, sync undo) -> c (async, PermanentError): compensated
    in reverse, b's undo before a's."""
    saga = order_saga(name)

    @saga.step
    def a(ctx: StepContext, o: Order) -> dict[str, Any]:
        calls.hit(o, "a")
        return {"step": "a"}

    @a.compensation
    async def undo_a(ctx: StepContext, o: Order, result: dict[str, Any]) -> None:
        await asyncio.sleep(0)
        assert result == {"step": "a"}
        calls.hit(o, "undo_a")

    @saga.step
    async def b(ctx: StepContext, o: Order) -> Receipt:
        calls.hit(o, "b")
        return Receipt(receipt_id="rb", amount_cents=o.amount_cents)

    @b.compensation
    def undo_b(ctx: StepContext, o: Order, result: Receipt) -> None:
        assert isinstance(result, Receipt)
        calls.hit(o, "undo_b")

    @saga.step
    async def c(ctx: StepContext, o: Order) -> dict[str, Any]:
        calls.hit(o, "c")
        raise PermanentError("card declined")

    return saga


def unknown_retried_shape(calls: Calls, name: str = "d_unknown_retry") -> Saga[Order]:
    """charge (async, idempotent) and ship (sync, idempotent) each raise an unclassified
    exception at attempt 1: unknown, retried with the same key, succeeded at attempt 2."""
    saga = order_saga(name)

    @saga.step(idempotent=True, retry=QUICK3)
    async def charge(ctx: StepContext, o: Order) -> dict[str, Any]:
        await asyncio.sleep(0)
        calls.hit(o, f"charge:{ctx.attempt}")
        if ctx.attempt == 1:
            raise KeyError("charge_id")  # parsing the provider's answer, after the effect
        return {"charge_id": "ch-1"}

    @saga.step(idempotent=True, retry=QUICK3)
    def ship(ctx: StepContext, o: Order) -> dict[str, Any]:
        calls.hit(o, f"ship:{ctx.attempt}")
        if ctx.attempt == 1:
            raise ValueError("bad carrier reply")
        return {"tracking": "t-1"}

    return saga


def reconciled_shape(calls: Calls, name: str = "d_reconciled") -> Saga[Order]:
    """charge (sync) and ship (async) each raise an unclassified exception once; their
    reconcile hooks (async for charge, sync for ship) answer Found: called once each."""
    saga = order_saga(name)

    @saga.step
    def charge(ctx: StepContext, o: Order) -> dict[str, Any]:
        calls.hit(o, "charge")
        raise ValueError("unparseable gateway reply")

    @charge.reconcile
    async def find_charge(ctx: StepContext, o: Order) -> Found:
        await asyncio.sleep(0)
        calls.hit(o, "find_charge")
        return Found({"charge_id": "ch-9"}, provider_reference="ch-9")

    @saga.step
    async def ship(ctx: StepContext, o: Order) -> dict[str, Any]:
        calls.hit(o, "ship")
        raise RuntimeError("carrier hung up")

    @ship.reconcile
    def find_shipment(ctx: StepContext, o: Order) -> Found:
        calls.hit(o, "find_shipment")
        return Found({"tracking": "t-9"})

    return saga


def review_shape(calls: Calls, name: str = "d_review") -> Saga[Order]:
    """reserve (async, compensable) -> charge (sync, not idempotent, no reconcile) raising an
    unclassified exception: unknown, parked in needs_review, nothing compensated."""
    saga = order_saga(name)

    @saga.step
    async def reserve(ctx: StepContext, o: Order) -> dict[str, Any]:
        calls.hit(o, "reserve")
        return {"sku": "x"}

    @reserve.compensation
    async def release(ctx: StepContext, o: Order, result: dict[str, Any] | None) -> None:
        calls.hit(o, "release")

    @saga.step(retry=QUICK3)
    def charge(ctx: StepContext, o: Order) -> dict[str, Any]:
        calls.hit(o, "charge")
        raise RuntimeError("socket closed after send")

    @saga.step
    async def ship(ctx: StepContext, o: Order) -> dict[str, Any]:
        calls.hit(o, "ship")
        return {}

    return saga


def timed_out_shape(calls: Calls, name: str = "d_timed_out") -> Saga[Order]:
    """reserve (sync) -> charge (async, idempotent, timeout 0.2 s) whose attempt 1 sleeps
    past its timeout: cancelled, unknown, retried with the same key, succeeded."""
    saga = order_saga(name)

    @saga.step
    def reserve(ctx: StepContext, o: Order) -> dict[str, Any]:
        calls.hit(o, "reserve")
        return {"sku": "x"}

    @saga.step(idempotent=True, timeout_seconds=0.2, retry=QUICK3)
    async def charge(ctx: StepContext, o: Order) -> dict[str, Any]:
        calls.hit(o, f"charge:{ctx.attempt}")
        if ctx.attempt == 1:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                calls.hit(o, "charge:cancelled")
                raise
        return {"charged_by": ctx.attempt}

    return saga


ShapeFactory = Callable[[Calls], Saga[Order]]

SHAPES: dict[str, tuple[ShapeFactory, str]] = {
    # shape -> (factory, the status a run ends in)
    "happy": (happy_shape, "completed"),
    "transient": (transient_shape, "completed"),
    "permanent": (permanent_shape, "compensated"),
    "unknown_retried": (unknown_retried_shape, "completed"),
    "reconciled": (reconciled_shape, "completed"),
    "review": (review_shape, "needs_review"),
    "timed_out": (timed_out_shape, "completed"),
}


# ----- what a saga wrote, comparable across runs ---------------------------------------------


_HEXES = re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b")
_SHA256 = re.compile(r"\b[0-9a-f]{64}\b")  # request and input hashes: they cover the key
_NUMBERS_WITH_UNITS = re.compile(r"\d+(\.\d+)?\s*(s|ms|seconds)\b")


def error_shape(error: str | None, order_id: str) -> str | None:
    """The first line of an error, with the order id, uuids and durations blanked: what it
    says, not which run or how fast (tracebacks go through different frames per driver)."""
    if error is None:
        return None
    first = error.strip().splitlines()[0] if error.strip() else ""
    first = first.replace(order_id, "<order>")
    first = _HEXES.sub("<uuid>", first)
    first = _SHA256.sub("<sha256>", first)
    return _NUMBERS_WITH_UNITS.sub("<duration>", first)


def _normal(value: Any, order_id: str) -> Any:
    if isinstance(value, dict):
        return {k: _normal(v, order_id) for k, v in sorted(value.items()) if k not in RUN_SPECIFIC}
    if isinstance(value, list):
        return [_normal(v, order_id) for v in value]
    if isinstance(value, str):
        return error_shape(value, order_id)
    if isinstance(value, float):
        return "<number>"  # timings and backoffs
    return value


def operation_rows(state: SagaState) -> list[tuple[Any, ...]]:
    """(step, kind, status, attempts, max_attempts, result, error shape, provider reference,
    reconcile asks, key, hash present, prepared request) of every operation, in the order
    the store returns them."""
    return [
        (
            op.step,
            str(op.kind),
            str(op.status),
            op.attempts,
            op.max_attempts,
            op.result,
            error_shape(op.error, state.key),
            op.provider_reference,
            op.reconcile_asks,
            op.idempotency_key.replace(state.key, "<order>"),
            op.request_hash is not None and len(op.request_hash) == 64,
            op.request,
        )
        for op in state.operations
    ]


def event_rows(history: list[HistoryEvent], order_id: str) -> list[tuple[Any, ...]]:
    """(event, step, kind, attempt, detail without run-specific fields) of a history."""
    return [
        (
            e.event,
            e.step,
            None if e.kind is None else str(e.kind),
            e.attempt,
            _normal(e.detail, order_id),
        )
        for e in history
    ]
