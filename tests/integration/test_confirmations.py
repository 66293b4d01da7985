"""Confirmations: one approval releases exactly one attempt, and the approver sees exactly
what the step receives.

An approval is consumed by the attempt it releases, in the transaction that records that
attempt as running; every retry (after a transient failure, an unknown outcome, a
reconcile's Absent, an operator's retry) asks again with a fresh preview; an approval
whose confirmation expired releases nothing. The preview shows the whole saga input,
volatile fields included, and the hash an approval is bound to covers all of it.
"""

from __future__ import annotations

import signal
from datetime import datetime
from typing import Any

import crash_app
import psycopg
import pytest
from crash_app import CrashOrder
from pydantic import BaseModel
from support import FAST, ChildApp, Order, events, lease_expired, order_saga, wait_until

from saga import (
    ApprovalRejected,
    Orchestrator,
    Saga,
    StepContext,
    StepStateError,
    TransientError,
)
from saga._core.planner import Planner, action_request_hash
from saga.approvals import preview_hash
from saga.state import Confirmation

KEY = "test-confirmation-key"


def _pending(orch: Orchestrator, saga_id: str) -> Confirmation:
    pending = orch.preview(saga_id)
    assert pending is not None, f"saga {saga_id} waits for no confirmation"
    return pending


def _approve(orch: Orchestrator, saga_id: str, step: str) -> tuple[Confirmation, str]:
    """Approve what the saga previews now; the preview and the token used."""
    pending = _pending(orch, saga_id)
    token = orch.approval(saga_id, step, pending.request_hash, actor="ops@example")
    resumed = orch.confirm(saga_id, step, pending.request_hash, token)
    assert resumed.status == "running"
    return pending, token


def _used(orch: Orchestrator, saga_id: str) -> dict[str, int | None]:
    """request hash -> the attempt its approval released (None: not used)."""
    return {c.request_hash: c.consumed_attempt for c in orch.confirmations(saga_id)}


# ----- one approval, one attempt ----------------------------------------------------------


def test_a_retry_after_a_transient_failure_asks_for_a_new_confirmation(
    database_url: str,
) -> None:
    """The first attempt fails transiently: attempt 2 waits for a new confirmation with a
    fresh preview, and runs only after a second approval; the first approval cannot
    approve it."""
    saga = order_saga("confirm_transient")
    calls: list[int] = []

    @saga.step(confirm=True, retry=FAST)
    def payout(ctx: StepContext, order: Order) -> dict[str, Any]:
        calls.append(ctx.attempt)
        if ctx.attempt == 1:
            raise TransientError("gateway busy")
        return {"paid": order.amount_cents}

    with Orchestrator(database_url, sagas=[saga], confirmation_key=KEY) as orch:
        state = orch.execute(saga, Order(order_id="o-1"))
        assert state.status == "awaiting_confirmation"
        first, first_token = _approve(orch, state.id, "payout")

        again = orch.run(state.id)
        assert calls == [1]
        assert again.status == "awaiting_confirmation", again.error
        assert first.preview["attempt"] == 1
        second = _pending(orch, state.id)
        assert second.request_hash != first.request_hash
        assert second.preview["attempt"] == 2
        assert second.requested_at > first.requested_at
        # The token of the first approval is bound to the first preview's hash.
        with pytest.raises(ApprovalRejected):
            orch.confirm(state.id, "payout", second.request_hash, first_token)
        with pytest.raises(StepStateError, match="does not match"):
            orch.confirm(state.id, "payout", first.request_hash, first_token)
        assert orch.run(state.id).status == "awaiting_confirmation" and calls == [1]

        _approve(orch, state.id, "payout")
        done = orch.run(state.id)
        assert done.status == "completed", done.error
        assert calls == [1, 2]
        assert _used(orch, state.id) == {first.request_hash: 1, second.request_hash: 2}
        trail = events(orch.history(state.id))
        assert trail.count("confirmation_requested") == 2
        assert trail.count("approval_used") == 2


def test_an_approval_whose_confirmation_expired_releases_no_attempt(database_url: str) -> None:
    """Approved, but the confirmation expired before the attempt could start: nothing
    runs, a fresh preview is asked for (the same request, so the same row, its approval
    withdrawn), and only a new approval releases the attempt."""
    saga = order_saga("confirm_expired_approval")
    calls: list[int] = []

    @saga.step(confirm=True, confirm_ttl_seconds=30)
    def payout(ctx: StepContext, order: Order) -> dict[str, Any]:
        calls.append(ctx.attempt)
        return {"paid": order.amount_cents}

    with Orchestrator(database_url, sagas=[saga], confirmation_key=KEY) as orch:
        state = orch.execute(saga, Order(order_id="o-1"))
        first, _ = _approve(orch, state.id, "payout")
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute("UPDATE saga.confirmations SET expires_at = now() - interval '1 second'")

        again = orch.run(state.id)
        assert calls == []
        assert again.status == "awaiting_confirmation", again.error
        fresh = _pending(orch, state.id)
        assert fresh.request_hash == first.request_hash
        assert fresh.expires_at > datetime.now().astimezone()
        [row] = orch.confirmations(state.id)
        assert (row.approved_by, row.approved_at, row.consumed_attempt) == (None, None, None)
        expired = [e for e in orch.history(state.id) if e.event == "approval_expired"]
        assert len(expired) == 1 and expired[0].detail["approved_by"] == "ops@example"

        _approve(orch, state.id, "payout")
        done = orch.run(state.id)
        assert done.status == "completed", done.error
        assert calls == [1]
        assert _used(orch, state.id) == {first.request_hash: 1}


@pytest.mark.crash
@pytest.mark.parametrize(
    ("saga", "block", "signal_line"),
    [
        (crash_app.CONFIRMED, "after_effect", "CHARGED"),  # unknown, retried with the key
        (crash_app.CONFIRMED_RECONCILED, "before_effect", "IN_CHARGE"),  # reconcile: Absent
    ],
    ids=["idempotent_retry", "reconcile_absent"],
)
def test_a_retry_after_a_crash_in_an_approved_attempt_asks_again(
    app_url: str, children: list[ChildApp], saga: Saga[CrashOrder], block: str, signal_line: str
) -> None:
    """The approved attempt is SIGKILLed in the step: its retry (idempotent, or after the
    provider answered Absent) waits for a new approval; the dead attempt's is used up."""
    with Orchestrator(
        app_url, sagas=crash_app.ALL_SAGAS, confirmation_key=KEY, lease_seconds=2.0
    ) as orch:
        waiting = orch.execute(saga, CrashOrder(order_id="o-1"))
        assert waiting.status == "awaiting_confirmation"
        first, _ = _approve(orch, waiting.id, "charge")

        child = ChildApp(app_url, saga.name, "o-1", CRASH_APP_BLOCK=block)
        children.append(child)
        assert child.expect("STARTED").split()[1] == waiting.id
        child.expect(signal_line)
        child.signal(signal.SIGKILL)
        assert child.wait() == -signal.SIGKILL
        wait_until(lambda: lease_expired(app_url, waiting.id), timeout=15)

        again = orch.run(waiting.id)
        assert again.status == "awaiting_confirmation", again.error
        assert _charge_calls(app_url) == [1]
        second = _pending(orch, waiting.id)
        assert second.preview["attempt"] == 2 and second.request_hash != first.request_hash
        assert _used(orch, waiting.id) == {first.request_hash: 1, second.request_hash: None}

        _approve(orch, waiting.id, "charge")
        done = orch.run(waiting.id)
        assert done.status == "completed", done.error
        assert _charge_calls(app_url) == [1, 2]
        assert _used(orch, waiting.id) == {first.request_hash: 1, second.request_hash: 2}
        with psycopg.connect(app_url) as conn:
            charged = conn.execute("SELECT count(*) FROM provider_charges").fetchone()
        assert charged == (1,)


def _charge_calls(url: str) -> list[int]:
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT attempt FROM step_calls WHERE step = 'charge' ORDER BY id"
        ).fetchall()
    return [int(r[0]) for r in rows]


def test_an_approval_is_used_once_even_by_a_stale_snapshot(database_url: str) -> None:
    """Two planners read the same approved confirmation; the first to record its attempt
    uses the approval up, and the database refuses the second, writing nothing of it."""
    saga = order_saga("confirm_stale")

    @saga.step(confirm=True)
    def payout(ctx: StepContext, order: Order) -> dict[str, Any]:
        return {}

    with Orchestrator(database_url, sagas=[saga], confirmation_key=KEY) as orch:
        state = orch.execute(saga, Order(order_id="o-1"))
        _approve(orch, state.id, "payout")
        store = orch.store
        planners = []
        for _ in range(2):
            with store.transaction() as conn:
                loaded = store.load_txn(conn, state.id)
            assert loaded is not None
            planners.append(Planner(saga, *loaded, now=datetime.now().astimezone()))
        for planner in planners:
            planner.advance()
            assert planner.saga.status == "running"
            assert planner.op("payout", "action").status == "running"
            assert [c.consumed_attempt for c in planner.confirmations] == [1]

        def write(planner: Planner) -> None:
            with store.transaction() as conn:
                store.save_txn(conn, planner.write(None, owner=None), owner=None)

        write(planners[0])
        before = orch.history(state.id)
        with pytest.raises(StepStateError, match="already released attempt 1"):
            write(planners[1])
        assert orch.history(state.id) == before
        assert events(before).count("attempt_started") == 1


# ----- what the approver sees is what the step receives -----------------------------------


class Transfer(BaseModel):
    """A wire transfer; `memo` is volatile (left out of the idempotency request hash)."""

    transfer_id: str
    amount_cents: int
    memo: str = ""


class WireRequest(BaseModel):
    """The prepared intent of a wire."""

    amount_cents: int


def _wires(name: str, *, prepared: bool, received: list[str]) -> Saga[Transfer]:
    saga: Saga[Transfer] = Saga(
        name, input=Transfer, key=lambda t: t.transfer_id, volatile=("memo",)
    )

    @saga.step(confirm=True)
    def wire(ctx: StepContext, transfer: Transfer) -> dict[str, Any]:
        received.append(transfer.memo)
        return {"wired": transfer.amount_cents}

    if prepared:

        @wire.prepare
        def plan_wire(ctx: StepContext, transfer: Transfer) -> WireRequest:
            return WireRequest(amount_cents=transfer.amount_cents)

    return saga


@pytest.mark.parametrize("prepared", [False, True], ids=["input", "prepared"])
def test_the_preview_and_its_hash_cover_the_volatile_input_fields(
    database_url: str, prepared: bool
) -> None:
    """A volatile memo reaches the step, so the preview shows it (as the payload without a
    prepare, beside the prepared request with one) and the hash an approval is bound to
    covers it; an approval over the operation's request hash, which leaves the memo out,
    is refused. The operation's own request hash is unchanged."""
    received: list[str] = []
    saga = _wires(
        f"wires_{'prepared' if prepared else 'plain'}", prepared=prepared, received=received
    )
    transfer = Transfer(transfer_id="w-1", amount_cents=100, memo="wire to 999")
    with Orchestrator(database_url, sagas=[saga], confirmation_key=KEY) as orch:
        state = orch.execute(saga, transfer)
        assert state.status == "awaiting_confirmation"
        pending = _pending(orch, state.id)
        shown = pending.preview
        if prepared:
            assert shown["payload"] == {"amount_cents": 100}
            assert shown["input"] == transfer.model_dump(mode="json")
        else:
            assert shown["payload"] == transfer.model_dump(mode="json")
        assert "wire to 999" in str(shown)

        # The hash is of the whole preview: another memo would be another hash.
        assert shown["request_hash"] == pending.request_hash == preview_hash(shown)
        where = "input" if prepared else "payload"
        altered = {**shown, where: {**shown[where], "memo": "wire to 1"}}
        assert preview_hash(altered) != pending.request_hash

        op = orch.get(state.id).operation("wire")
        if not prepared:
            assert op.request_hash == action_request_hash(
                "wire", {"transfer_id": "w-1", "amount_cents": 100}
            )
        assert op.request_hash != pending.request_hash
        stale = orch.approval(state.id, "wire", op.request_hash, actor="ops")
        with pytest.raises(StepStateError, match="does not match"):
            orch.confirm(state.id, "wire", op.request_hash, stale)
        assert received == []

        _approve(orch, state.id, "wire")
        done = orch.run(state.id)
        assert done.status == "completed", done.error
        assert received == ["wire to 999"]


def test_a_preview_shows_the_results_the_step_can_read(database_url: str) -> None:
    """A confirmed step reads the results of the steps before it (ctx.results): they are
    previewed and hashed too."""
    saga = order_saga("confirm_results")
    seen: list[dict[str, Any]] = []

    @saga.step
    def quote(ctx: StepContext, order: Order) -> dict[str, Any]:
        return {"iban": "DE00 999"}

    @saga.step(confirm=True)
    def pay(ctx: StepContext, order: Order) -> dict[str, Any]:
        seen.append(ctx.results["quote"])
        return {}

    with Orchestrator(database_url, sagas=[saga], confirmation_key=KEY) as orch:
        state = orch.execute(saga, Order(order_id="o-1", requested_at="2024-05-01"))
        pending = _pending(orch, state.id)
        assert pending.preview["results"] == {"quote": {"iban": "DE00 999"}}
        assert pending.preview["payload"]["requested_at"] == "2024-05-01"
        assert pending.request_hash == preview_hash(pending.preview)
        _approve(orch, state.id, "pay")
        assert orch.run(state.id).status == "completed"
        assert seen == [{"iban": "DE00 999"}]
