"""run(): the forward path, retries, compensation in reverse, pivots, non-JSON results, async."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest
from support import (
    FAST,
    OrchestratorFactory,
    Order,
    Receipt,
    actions,
    compensations,
    events,
    order_saga,
)

from saga import PermanentError, RetryPolicy, StepContext, TransientError

HEX64 = re.compile(r"^[0-9a-f]{64}$")


def test_happy_path_runs_every_step_once(make_orch: OrchestratorFactory) -> None:
    """Three steps run once each, in order; results are stored and visible to later steps."""
    saga = order_saga("happy")
    seen: dict[str, Any] = {}

    @saga.step
    def reserve(ctx: StepContext, o: Order) -> dict:
        seen["reserve"] = ctx
        return {"reserved": o.order_id}

    @saga.step
    def charge(ctx: StepContext, o: Order) -> Receipt:
        seen["charge"] = ctx
        seen["charge_results"] = dict(ctx.results)
        return Receipt(receipt_id=f"r-{o.order_id}", amount_cents=o.amount_cents)

    @saga.step
    def ship(ctx: StepContext, o: Order) -> dict:
        seen["ship"] = ctx
        seen["ship_results"] = dict(ctx.results)
        return {"shipment": "s-1"}

    orch = make_orch(saga)
    handle = orch.start(saga, Order(order_id="o-1", amount_cents=1250))
    state = orch.run(handle.id)

    assert state.status == "completed"
    assert state.id == handle.id
    assert actions(state) == [
        ("reserve", "succeeded", 1),
        ("charge", "succeeded", 1),
        ("ship", "succeeded", 1),
    ]
    assert state.operation("reserve").result == {"reserved": "o-1"}
    assert state.operation("charge").result == {"receipt_id": "r-o-1", "amount_cents": 1250}
    assert state.operation("ship").result == {"shipment": "s-1"}
    assert compensations(state) == {}
    assert state.lease_owner is None and state.lease_expires_at is None

    # Later steps see earlier results; a model result is seen as the model.
    assert seen["charge_results"] == {"reserve": {"reserved": "o-1"}}
    assert seen["ship_results"]["reserve"] == {"reserved": "o-1"}
    assert seen["ship_results"]["charge"] == Receipt(receipt_id="r-o-1", amount_cents=1250)
    assert isinstance(seen["ship_results"]["charge"], Receipt)

    for step in ("reserve", "charge", "ship"):
        ctx: StepContext = seen[step]
        op = state.operation(step)
        assert ctx.idempotency_key == f"happy:v1:acme:o-1:{step}"
        assert op.idempotency_key == ctx.idempotency_key
        assert HEX64.match(op.request_hash)
        assert ctx.attempt == 1
        assert ctx.saga_id == handle.id
        assert ctx.tenant_id == "acme"
        assert isinstance(ctx.fence, int) and ctx.fence >= 1

    # A terminal saga is returned as is; nothing runs again.
    seen.clear()
    assert orch.run(handle.id).status == "completed"
    assert seen == {}


def test_compensation_receives_the_model_result(make_orch: OrchestratorFactory) -> None:
    """A compensation receives its step's result rebuilt as the annotated pydantic model."""
    saga = order_saga("model-comp")
    received: list[Any] = []

    @saga.step
    def charge(ctx: StepContext, o: Order) -> Receipt:
        return Receipt(receipt_id="r-9", amount_cents=o.amount_cents)

    @charge.compensation
    def refund(ctx: StepContext, o: Order, result: Receipt) -> None:
        received.append(result)

    @saga.step
    def ship(ctx: StepContext, o: Order) -> dict:
        raise PermanentError("no carrier")

    orch = make_orch(saga)
    state = orch.run(orch.start(saga, Order(order_id="o-9", amount_cents=42)).id)

    assert state.status == "compensated"
    assert received == [Receipt(receipt_id="r-9", amount_cents=42)]
    assert isinstance(received[0], Receipt)


def test_transient_failures_are_retried_with_the_same_key(
    make_orch: OrchestratorFactory,
) -> None:
    """A step failing transiently twice succeeds on attempt 3, with one key at every attempt."""
    saga = order_saga("flaky")
    seen: list[tuple[str, int]] = []

    @saga.step(retry=FAST)
    def charge(ctx: StepContext, o: Order) -> dict:
        seen.append((ctx.idempotency_key, ctx.attempt))
        if ctx.attempt < 3:
            raise TransientError("gateway timeout")
        return {"charged": True}

    orch = make_orch(saga)
    handle = orch.start(saga, Order(order_id="o-1"))
    state = orch.run(handle.id)

    assert state.status == "completed"
    op = state.operation("charge")
    assert (op.status, op.attempts, op.max_attempts) == ("succeeded", 3, 3)
    assert op.result == {"charged": True}
    assert seen == [("flaky:v1:acme:o-1:charge", n) for n in (1, 2, 3)]
    failed = [e for e in orch.history(handle.id) if e.event == "attempt_failed"]
    assert [e.attempt for e in failed] == [1, 2]
    assert all(e.detail.get("retryable") is True for e in failed)


def test_exhausting_the_retry_ceiling_fails_and_compensates(
    make_orch: OrchestratorFactory,
) -> None:
    """A step still failing transiently at its ceiling fails; earlier steps are compensated."""
    saga = order_saga("ceiling")
    calls: list[str] = []

    @saga.step
    def reserve(ctx: StepContext, o: Order) -> dict:
        calls.append("reserve")
        return {"sku": "x"}

    @reserve.compensation
    def release(ctx: StepContext, o: Order, result: dict) -> None:
        calls.append(f"release:{result['sku']}")

    @saga.step(retry=FAST)
    def charge(ctx: StepContext, o: Order) -> dict:
        calls.append(f"charge:{ctx.attempt}")
        raise TransientError("still down")

    orch = make_orch(saga)
    state = orch.run(orch.start(saga, Order(order_id="o-1")).id)

    assert state.status == "compensated"
    assert calls == ["reserve", "charge:1", "charge:2", "charge:3", "release:x"]
    assert actions(state) == [("reserve", "succeeded", 1), ("charge", "failed", 3)]
    assert "still down" in (state.operation("charge").error or "")
    assert compensations(state) == {"reserve": ("succeeded", 1)}


def test_permanent_error_compensates_in_reverse_order(make_orch: OrchestratorFactory) -> None:
    """PermanentError fails at once; compensations of completed steps run in reverse order."""
    saga = order_saga("reverse")
    calls: list[str] = []

    @saga.step
    def a(ctx: StepContext, o: Order) -> dict:
        calls.append("a")
        return {"step": "a"}

    @a.compensation
    def undo_a(ctx: StepContext, o: Order, result: dict) -> None:
        calls.append("undo_a")
        assert ctx.idempotency_key.endswith(":a:compensate")

    @saga.step
    def b(ctx: StepContext, o: Order) -> dict:
        calls.append("b")
        return {"step": "b"}

    @b.compensation
    def undo_b(ctx: StepContext, o: Order, result: dict) -> None:
        calls.append("undo_b")

    @saga.step
    def c(ctx: StepContext, o: Order) -> dict:
        calls.append("c")
        return {"step": "c"}

    @c.compensation
    def undo_c(ctx: StepContext, o: Order, result: dict) -> None:
        calls.append("undo_c")

    @saga.step(retry=FAST)
    def d(ctx: StepContext, o: Order) -> dict:
        calls.append("d")
        raise PermanentError("card declined")

    @d.compensation
    def undo_d(ctx: StepContext, o: Order, result: dict) -> None:
        calls.append("undo_d")

    orch = make_orch(saga)
    handle = orch.start(saga, Order(order_id="o-1"))
    state = orch.run(handle.id)

    assert state.status == "compensated"
    assert calls == ["a", "b", "c", "d", "undo_c", "undo_b", "undo_a"]
    d_op = state.operation("d")
    assert (d_op.status, d_op.attempts) == ("failed", 1)
    assert "card declined" in (d_op.error or "")
    assert compensations(state) == {
        "c": ("succeeded", 1),
        "b": ("succeeded", 1),
        "a": ("succeeded", 1),
    }
    for step in ("a", "b", "c"):
        comp = state.operation(step, kind="compensation")
        assert comp.idempotency_key == f"reverse:v1:acme:o-1:{step}:compensate"
        assert comp.idempotency_key == state.operation(step).idempotency_key + ":compensate"
        assert HEX64.match(comp.request_hash)
        assert comp.max_attempts >= 1
    names = events(orch.history(handle.id))
    assert "compensation_started" in names
    assert "saga_compensated" in names


def test_unlisted_exception_leaves_the_outcome_unknown(make_orch: OrchestratorFactory) -> None:
    """An exception outside retry_on and fail_on is not a verdict: one attempt, its outcome
    unknown, and a step that is neither idempotent nor reconcilable parks; nothing is
    compensated."""
    saga = order_saga("unlisted")
    calls: list[str] = []

    @saga.step
    def reserve(ctx: StepContext, o: Order) -> dict:
        return {"sku": "x"}

    @reserve.compensation
    def release(ctx: StepContext, o: Order, result: dict) -> None:
        calls.append("release")

    @saga.step(retry=FAST)
    def charge(ctx: StepContext, o: Order) -> dict:
        calls.append(f"charge:{ctx.attempt}")
        raise ValueError("bad amount")

    orch = make_orch(saga)
    state = orch.run(orch.start(saga, Order(order_id="o-1")).id)

    assert calls == ["charge:1"]
    assert state.status == "needs_review"
    op = state.operation("charge")
    assert (op.status, op.attempts) == ("unknown", 1)
    assert "ValueError: bad amount" in (op.error or "")
    assert "ValueError: bad amount" in (state.error or "")
    assert compensations(state) == {}


def test_fail_on_exception_fails_at_once(make_orch: OrchestratorFactory) -> None:
    """An exception listed in fail_on is not retried: one attempt, then compensation."""
    saga = order_saga("fail-on")
    calls: list[int] = []

    @saga.step(retry=RetryPolicy(max_attempts=3, initial_delay=0.01, fail_on=(ValueError,)))
    def charge(ctx: StepContext, o: Order) -> dict:
        calls.append(ctx.attempt)
        raise ValueError("bad amount")

    orch = make_orch(saga)
    state = orch.run(orch.start(saga, Order(order_id="o-1")).id)

    assert calls == [1]
    assert state.status == "compensated"
    op = state.operation("charge")
    assert (op.status, op.attempts) == ("failed", 1)
    assert "bad amount" in (op.error or "")


def test_compensation_exhausting_its_ceiling_parks_the_saga(
    make_orch: OrchestratorFactory,
) -> None:
    """A compensation failing past its ceiling parks the saga in needs_review; nothing is lost."""
    saga = order_saga("stuck-comp")
    calls: list[str] = []

    @saga.step
    def reserve(ctx: StepContext, o: Order) -> dict:
        return {"sku": "x"}

    @reserve.compensation(retry=FAST)
    def release(ctx: StepContext, o: Order, result: dict) -> None:
        calls.append(f"release:{ctx.attempt}")
        raise TransientError("warehouse offline")

    @saga.step
    def charge(ctx: StepContext, o: Order) -> dict:
        return {"charge": "c-1"}

    @charge.compensation
    def refund(ctx: StepContext, o: Order, result: dict) -> None:
        calls.append("refund")

    @saga.step
    def ship(ctx: StepContext, o: Order) -> dict:
        raise PermanentError("no carrier")

    orch = make_orch(saga)
    handle = orch.start(saga, Order(order_id="o-1"))
    state = orch.run(handle.id)

    assert state.status == "needs_review"
    assert state.error
    assert calls == ["refund", "release:1", "release:2", "release:3"]
    assert actions(state) == [
        ("reserve", "succeeded", 1),
        ("charge", "succeeded", 1),
        ("ship", "failed", 1),
    ]
    assert compensations(state) == {"charge": ("succeeded", 1), "reserve": ("failed", 3)}
    assert "warehouse offline" in (state.operation("reserve", kind="compensation").error or "")
    assert "saga_parked" in events(orch.history(handle.id))

    # Parked means parked: running it again calls nothing.
    assert orch.run(handle.id).status == "needs_review"
    assert calls == ["refund", "release:1", "release:2", "release:3"]


def test_failure_after_a_pivot_parks_without_compensating(
    make_orch: OrchestratorFactory,
) -> None:
    """A permanent failure after a succeeded pivot step parks the saga; nothing is compensated."""
    saga = order_saga("pivoted")
    compensated: list[str] = []

    @saga.step
    def reserve(ctx: StepContext, o: Order) -> dict:
        return {"sku": "x"}

    @reserve.compensation
    def release(ctx: StepContext, o: Order, result: dict) -> None:
        compensated.append("release")

    @saga.step(pivot=True)
    def ship(ctx: StepContext, o: Order) -> dict:
        return {"shipment": "s-1"}

    @ship.compensation
    def recall(ctx: StepContext, o: Order, result: dict) -> None:
        compensated.append("recall")

    @saga.step
    def notify(ctx: StepContext, o: Order) -> dict:
        raise PermanentError("mailer rejected the address")

    orch = make_orch(saga)
    state = orch.run(orch.start(saga, Order(order_id="o-1")).id)

    assert state.status == "needs_review"
    assert state.error
    assert compensated == []
    assert all(op.attempts == 0 for op in state.operations if op.kind == "compensation")
    assert actions(state) == [
        ("reserve", "succeeded", 1),
        ("ship", "succeeded", 1),
        ("notify", "failed", 1),
    ]


class _NotJson:
    pass


@pytest.mark.parametrize("bad", [{1, 2}, _NotJson()], ids=["set", "object"])
def test_non_json_result_parks_the_saga(make_orch: OrchestratorFactory, bad: object) -> None:
    """A non-JSON result is a TypeError naming the step: op unknown, saga needs_review."""
    saga = order_saga("non-json")
    later: list[str] = []

    @saga.step
    def build_quote(ctx: StepContext, o: Order) -> Any:
        return bad

    @saga.step
    def charge(ctx: StepContext, o: Order) -> dict:
        later.append("charge")
        return {}

    orch = make_orch(saga)
    state = orch.run(orch.start(saga, Order(order_id="o-1")).id)

    assert state.status == "needs_review"
    op = state.operation("build_quote")
    assert op.status == "unknown"
    assert op.attempts == 1
    assert "TypeError" in (op.error or "")
    assert "build_quote" in (op.error or "")
    assert later == []
    assert all(op.attempts == 0 for op in state.operations if op.step == "charge")


def test_async_steps_run_beside_sync_steps(make_orch: OrchestratorFactory) -> None:
    """Async step and compensation functions are awaited like sync ones are called."""
    saga = order_saga("mixed")
    calls: list[str] = []

    @saga.step
    async def reserve(ctx: StepContext, o: Order) -> dict:
        await asyncio.sleep(0)
        calls.append("reserve")
        return {"sku": "x"}

    @reserve.compensation
    async def release(ctx: StepContext, o: Order, result: dict) -> None:
        await asyncio.sleep(0)
        calls.append(f"release:{result['sku']}")

    @saga.step
    def charge(ctx: StepContext, o: Order) -> Receipt:
        calls.append("charge")
        return Receipt(receipt_id="r-1", amount_cents=o.amount_cents)

    @charge.compensation
    async def refund(ctx: StepContext, o: Order, result: Receipt) -> None:
        calls.append(f"refund:{result.receipt_id}")

    @saga.step(retry=RetryPolicy(max_attempts=2, initial_delay=0.01, max_delay=0.01))
    async def ship(ctx: StepContext, o: Order) -> dict:
        calls.append(f"ship:{ctx.attempt}")
        if ctx.attempt == 1:
            raise TransientError("carrier busy")
        raise PermanentError("carrier refused")

    orch = make_orch(saga)
    state = orch.run(orch.start(saga, Order(order_id="o-1")).id)

    assert state.status == "compensated"
    assert calls == ["reserve", "charge", "ship:1", "ship:2", "refund:r-1", "release:x"]
    assert state.operation("reserve").result == {"sku": "x"}
    assert compensations(state) == {"charge": ("succeeded", 1), "reserve": ("succeeded", 1)}
