"""Fencing: once a lease is taken over, the stale owner's writes are refused."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import crash_app
import psycopg
import pytest
from support import (
    ChildApp,
    OrchestratorFactory,
    Order,
    count_rows,
    lease_expired,
    order_saga,
    wait_until,
)

from saga import SagaState, StepContext, StepStateError


@pytest.fixture
def children() -> Iterator[list[ChildApp]]:
    """Child processes of a test; any still alive after it is killed (and continued)."""
    started: list[ChildApp] = []
    yield started
    for child in started:
        if child.proc.poll() is None:
            child.signal(signal.SIGCONT)
        child.kill()


def _comparable(state: SagaState) -> dict[str, Any]:
    return state.model_dump()


@pytest.mark.crash
def test_frozen_owner_cannot_overwrite_the_new_owner(
    make_orch: OrchestratorFactory,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    children: list[ChildApp],
    tmp_path: Path,
) -> None:
    """A worker frozen mid-step past its lease loses the saga; its late write changes nothing."""
    crash_app.create_provider_tables(database_url)
    monkeypatch.setenv(crash_app.ENV_URL, database_url)
    gate = tmp_path / "gate"
    child = ChildApp(
        database_url,
        crash_app.IDEMPOTENT.name,
        "o-1",
        CRASH_APP_BLOCK="gate",
        CRASH_APP_GATE=str(gate),
    )
    children.append(child)
    saga_id = child.expect("STARTED").split()[1]
    stale_fence = int(child.expect("IN_CHARGE").split("fence=")[1])

    # SIGSTOP freezes the child's heartbeat too, so its lease runs out.
    child.signal(signal.SIGSTOP)
    wait_until(lambda: lease_expired(database_url, saga_id), timeout=15)

    orch = make_orch(*crash_app.ALL_SAGAS)
    taken_over = orch.run(saga_id)
    assert taken_over.status == "completed"
    assert taken_over.fence > stale_fence
    charge = taken_over.operation("charge")
    assert charge.status == "succeeded"
    assert charge.attempts == 2
    assert charge.result == {"charge_id": "ch_o-1", "pid": os.getpid()}
    events_before = count_rows(database_url, "events", saga_id)

    # Let the stale owner finish its step and try to record it.
    gate.touch()
    child.signal(signal.SIGCONT)
    child.expect("LEASE_LOST")
    child.expect("FINISHED")
    assert child.wait() == 0

    after = orch.get(saga_id)
    assert _comparable(after) == _comparable(taken_over)
    assert count_rows(database_url, "events", saga_id) == events_before
    with psycopg.connect(database_url) as conn:
        rows = conn.execute("SELECT count(*) FROM provider_charges").fetchone()
    assert rows is not None and rows[0] == 1


def test_takeover_after_lease_expiry_gets_a_higher_fence(
    make_orch: OrchestratorFactory, database_url: str
) -> None:
    """B takes over a saga whose lease A let lapse: B's fence is higher, A's outcome is refused."""
    saga = order_saga("fenced")
    entered = threading.Event()
    release = threading.Event()
    fences: list[tuple[str, int]] = []

    @saga.step(idempotent=True)
    def charge(ctx: StepContext, o: Order) -> dict:
        first = not entered.is_set()
        fences.append(("A" if first else "B", ctx.fence))
        if first:
            entered.set()
            assert release.wait(timeout=30)
        return {"by": "A" if first else "B"}

    # A long lease: A's heartbeat does not renew it during this test.
    a = make_orch(saga, lease_seconds=30.0, owner="worker-a")
    b = make_orch(saga, lease_seconds=30.0, owner="worker-b")
    saga_id = a.start(saga, Order(order_id="o-1")).id
    outcome: dict[str, Any] = {}

    def run_a() -> None:
        try:
            outcome["state"] = a.run(saga_id)
        except Exception as exc:  # reported below
            outcome["error"] = exc

    thread = threading.Thread(target=run_a, daemon=True)
    thread.start()
    try:
        assert entered.wait(timeout=30)
        # While A's lease is live, B returns the current state at once and runs nothing.
        held = b.run(saga_id)
        assert held.status == "running"
        assert held.lease_owner == "worker-a"
        assert held.lease_expires_at is not None
        assert [who for who, _ in fences] == ["A"]
        # Nor may an operator settle a step under a live lease.
        with pytest.raises(StepStateError):
            b.resolve(saga_id, "charge", outcome="failed", actor="ops@example")

        # A stalls past its lease (as in a long GC pause): expire it by the database clock.
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(
                "UPDATE saga.sagas SET lease_expires_at = now() - interval '1 second'"
                " WHERE id = %s::uuid",
                (saga_id,),
            )
        taken_over = b.run(saga_id)
    finally:
        release.set()
        thread.join(timeout=30)
    assert not thread.is_alive()

    assert taken_over.status == "completed"
    assert [who for who, _ in fences] == ["A", "B"]
    fence_a, fence_b = fences[0][1], fences[1][1]
    assert fence_b > fence_a
    assert taken_over.fence == fence_b
    assert taken_over.operation("charge").result == {"by": "B"}

    # A's late outcome was refused: nothing changed after B finished.
    assert "error" not in outcome or type(outcome["error"]).__name__ == "LeaseLost"
    final = b.get(saga_id)
    assert _comparable(final) == _comparable(taken_over)
    assert final.operation("charge").result == {"by": "B"}
