"""Timeouts: an attempt abandoned at its timeout that still runs in this process is never
settled under it (no reconcile answer, no new attempt), so each key has one effect."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from support import OrchestratorFactory, Order, order_saga

from saga import Absent, Found, Saga, Step, StepContext
from saga._drivers import abandoned


@pytest.fixture
def ledger(database_url: str) -> Iterator[str]:
    """The provider's side: one row per effect performed, under its idempotency key."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE ledger (key text NOT NULL, attempt integer NOT NULL)")
    yield database_url
    _join_abandoned_threads()


def _join_abandoned_threads() -> None:
    # Abandoned attempts are daemon threads of this process: let them finish their effect.
    for thread in threading.enumerate():
        if thread.name == "saga-attempt":
            thread.join(30)


def _perform(url: str, key: str, attempt: int) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("INSERT INTO ledger (key, attempt) VALUES (%s, %s)", (key, attempt))


def _effects(url: str) -> list[tuple[str, int]]:
    with psycopg.connect(url) as conn:
        rows = conn.execute("SELECT key, attempt FROM ledger ORDER BY attempt").fetchall()
    return [(str(k), int(a)) for k, a in rows]


def _truthful_reconcile(step: Step, url: str, asked: list[int]) -> None:
    @step.reconcile
    def find(ctx: StepContext, order: Order) -> Found | Absent:
        asked.append(ctx.attempt)
        with psycopg.connect(url) as conn:
            row = conn.execute(
                "SELECT attempt FROM ledger WHERE key = %s", (ctx.idempotency_key,)
            ).fetchone()
        return Absent() if row is None else Found({"charged_by": int(row[0])})


def test_a_late_sync_attempt_is_waited_for_before_its_outcome_is_settled(
    make_orch: OrchestratorFactory, ledger: str
) -> None:
    """A sync step past its timeout runs on in its thread: the truthful reconcile hook is
    asked only once that thread has ended, finds its effect, and no second attempt runs."""
    saga: Saga[Order] = order_saga("late_charge")
    asked: list[int] = []

    @saga.step(timeout_seconds=0.2)
    def charge(ctx: StepContext, order: Order) -> dict[str, Any]:
        if ctx.attempt == 1:
            time.sleep(1.0)  # the provider is slow: the effect lands after the timeout
        _perform(ledger, ctx.idempotency_key, ctx.attempt)
        return {"charged_by": ctx.attempt}

    _truthful_reconcile(charge, ledger, asked)
    orch = make_orch(saga)
    state = orch.execute(saga, Order(order_id="o-1"))
    _join_abandoned_threads()

    key = state.operation("charge").idempotency_key
    assert _effects(ledger) == [(key, 1)]
    assert state.status == "completed"
    assert state.operation("charge").result == {"charged_by": 1}
    assert asked == [1]


def test_an_attempt_still_running_after_the_wait_parks_the_saga(
    make_orch: OrchestratorFactory, ledger: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An idempotent step whose abandoned attempt outlives the bounded wait is not retried:
    the saga parks naming the running attempt; an operator's retry while it still runs
    parks again without calling; once it has ended, the retry settles it with one effect."""
    monkeypatch.setattr(abandoned, "MIN_WAIT_SECONDS", 0.0)  # wait 3 x 0.2 s only
    saga: Saga[Order] = order_saga("stuck_charge")
    gate = threading.Event()
    calls: list[int] = []

    @saga.step(idempotent=True, timeout_seconds=0.2)
    def charge(ctx: StepContext, order: Order) -> dict[str, Any]:
        calls.append(ctx.attempt)
        if ctx.attempt == 1:
            gate.wait(60)
        _perform(ledger, ctx.idempotency_key, ctx.attempt)
        return {"charged_by": ctx.attempt}

    orch = make_orch(saga)
    try:
        parked = orch.execute(saga, Order(order_id="o-1"))
        assert parked.status == "needs_review"
        assert parked.error is not None and "still running in process" in parked.error
        assert "attempt 1 of step 'charge'" in parked.error
        assert parked.operation("charge").status == "unknown"
        assert parked.operation("charge").attempts == 1

        orch.retry(parked.id, extra_attempts=1)
        again = orch.run(parked.id)
        assert again.status == "needs_review"
        assert again.error is not None and "attempt 2 was not called" in again.error
        assert calls == [1]
        assert _effects(ledger) == []
    finally:
        gate.set()
    _join_abandoned_threads()
    key = parked.operation("charge").idempotency_key
    assert _effects(ledger) == [(key, 1)]

    orch.retry(parked.id, extra_attempts=1)
    done = orch.run(parked.id)
    assert done.status == "completed"
    # The idempotent retry reuses the key; the provider (this ledger) would dedupe it.
    assert {k for k, _ in _effects(ledger)} == {key}


def test_a_reconcile_is_not_asked_while_the_abandoned_attempt_runs(
    make_orch: OrchestratorFactory, ledger: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a reconcile hook, an attempt that outlives the wait parks the saga unasked; an
    operator's retry while it runs parks again, still unasked; after it ends, the hook
    finds its effect and the saga completes with that one effect."""
    monkeypatch.setattr(abandoned, "MIN_WAIT_SECONDS", 0.0)
    saga: Saga[Order] = order_saga("stuck_reconciled")
    gate = threading.Event()
    asked: list[int] = []

    @saga.step(timeout_seconds=0.2)
    def charge(ctx: StepContext, order: Order) -> dict[str, Any]:
        gate.wait(60)
        _perform(ledger, ctx.idempotency_key, ctx.attempt)
        return {"charged_by": ctx.attempt}

    _truthful_reconcile(charge, ledger, asked)
    orch = make_orch(saga)
    try:
        parked = orch.execute(saga, Order(order_id="o-1"))
        assert parked.status == "needs_review"
        assert parked.error is not None and "still running in process" in parked.error
        orch.retry(parked.id)
        again = orch.run(parked.id)
        assert again.status == "needs_review"
        assert again.error is not None and "not reconciled" in again.error
        assert asked == []
    finally:
        gate.set()
    _join_abandoned_threads()

    orch.retry(parked.id)
    done = orch.run(parked.id)
    key = parked.operation("charge").idempotency_key
    assert done.status == "completed"
    assert done.operation("charge").result == {"charged_by": 1}
    assert asked == [1]
    assert _effects(ledger) == [(key, 1)]


def test_an_async_attempt_is_cancelled_at_its_timeout(
    make_orch: OrchestratorFactory, ledger: str
) -> None:
    """An async step past its timeout is cancelled before the outcome is settled: its
    effect never happens, the retry's does, once."""
    saga: Saga[Order] = order_saga("async_charge")
    cancelled: list[int] = []
    asked: list[int] = []

    @saga.step(timeout_seconds=0.2)
    async def charge(ctx: StepContext, order: Order) -> dict[str, Any]:
        if ctx.attempt == 1:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.append(ctx.attempt)
                raise
        _perform(ledger, ctx.idempotency_key, ctx.attempt)
        return {"charged_by": ctx.attempt}

    _truthful_reconcile(charge, ledger, asked)
    orch = make_orch(saga)
    state = orch.execute(saga, Order(order_id="o-1"))
    assert cancelled == [1]
    assert state.status == "completed"
    assert asked == [1]
    key = state.operation("charge").idempotency_key
    assert _effects(ledger) == [(key, 2)]
