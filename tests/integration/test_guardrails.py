"""Guardrails: ceilings, deadlines, timeouts, reconcile windows, confirmation, replan safety,
retention. Each shows the parked state, the recorded reason, and that nothing ran twice."""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest
from pydantic import BaseModel
from support import FAST, OrchestratorFactory, Order, count_rows, events, order_saga, scalar

from saga import (
    Absent,
    ApprovalRejected,
    Ceilings,
    Found,
    Inconclusive,
    Orchestrator,
    PermanentError,
    RetryPolicy,
    Saga,
    StepContext,
    StepStateError,
    TransientError,
)
from saga.approvals import preview_hash

KEY = "test-confirmation-key"


def _parked_detail(orch: Orchestrator, saga_id: str) -> dict[str, Any]:
    parked = [e for e in orch.history(saga_id) if e.event == "saga_parked"]
    assert parked, "the saga was not parked"
    return parked[-1].detail


# ----- ceilings ------------------------------------------------------------------------


def test_max_operations_parks_and_counts_retries(make_orch: OrchestratorFactory) -> None:
    """Retries count as operations; at the ceiling the saga parks naming it and the figures,
    and the counter lives in the database."""
    saga = Saga(
        "capped", input=Order, key=lambda o: o.order_id, ceilings=Ceilings(max_operations=2)
    )
    calls: list[int] = []

    @saga.step(retry=RetryPolicy(max_attempts=5, initial_delay=0.01, max_delay=0.01))
    def flaky(ctx: StepContext, order: Order) -> dict[str, Any]:
        calls.append(ctx.attempt)
        if ctx.attempt < 3:
            raise TransientError("not yet")
        return {"ok": True}

    orch = make_orch(saga)
    state = orch.execute(saga, Order(order_id="o-1"))

    assert state.status == "needs_review"
    assert calls == [1, 2]
    assert state.error is not None and "max_operations" in state.error and "2 of 2" in state.error
    assert state.operations_executed == 2 and state.max_operations == 2
    assert _parked_detail(orch, state.id)["ceiling"] == {
        "ceiling": "max_operations",
        "limit": 2,
        "executed": 2,
    }
    assert (
        scalar(
            orch.database_url,
            "SELECT operations_executed FROM saga.sagas WHERE id = %s",
            (state.id,),
        )
        == 2
    )
    # A fresh orchestrator does not get a fresh allowance.
    again = make_orch(saga).run(state.id)
    assert again.status == "needs_review" and calls == [1, 2]

    # An operator raises the ceiling explicitly (lowering is refused); counters carry on.
    with pytest.raises(StepStateError, match="only be raised"):
        orch.raise_ceilings(state.id, actor="ops", max_operations=1)
    raised = orch.raise_ceilings(state.id, actor="ops", max_operations=5)
    assert raised.status == "running" and raised.max_operations == 5
    done = orch.run(state.id)
    assert done.status == "completed"
    assert calls == [1, 2, 3] and done.operations_executed == 3
    raised_event = [e for e in orch.history(state.id) if e.event == "ceilings_raised"][-1]
    assert raised_event.detail["before"]["max_operations"] == 2
    assert raised_event.detail["after"]["max_operations"] == 5


def test_deadline_of_the_saga_stops_further_steps(make_orch: OrchestratorFactory) -> None:
    """Past the saga's wall-clock deadline no further attempt starts; the saga parks."""
    saga = Saga(
        "hurried", input=Order, key=lambda o: o.order_id, ceilings=Ceilings(deadline_seconds=0.3)
    )
    calls: list[str] = []

    @saga.step
    def slow(ctx: StepContext, order: Order) -> dict[str, Any]:
        calls.append("slow")
        time.sleep(0.4)
        return {}

    @saga.step
    def never(ctx: StepContext, order: Order) -> dict[str, Any]:
        calls.append("never")
        return {}

    orch = make_orch(saga)
    state = orch.execute(saga, Order(order_id="o-1"))
    assert state.status == "needs_review"
    assert calls == ["slow"]
    assert state.error is not None and "deadline" in state.error
    assert state.deadline_at is not None
    assert _parked_detail(orch, state.id)["ceiling"]["ceiling"] == "deadline"


def test_spend_budget_counts_declared_costs_and_reported_spend(
    make_orch: OrchestratorFactory,
) -> None:
    """Declared costs (from the input) and ctx.spend() count against the budget; the step
    that would exceed it does not start."""
    saga = Saga(
        "budgeted", input=Order, key=lambda o: o.order_id, ceilings=Ceilings(spend_budget=250)
    )
    calls: list[str] = []

    @saga.step(cost=lambda o: o.amount_cents)
    def first(ctx: StepContext, order: Order) -> dict[str, Any]:
        calls.append("first")
        ctx.spend(20)  # a fee found out while acting
        return {}

    @saga.step(cost=lambda o: o.amount_cents)
    def second(ctx: StepContext, order: Order) -> dict[str, Any]:
        calls.append("second")
        return {}

    orch = make_orch(saga)
    state = orch.execute(saga, Order(order_id="o-1", amount_cents=120))
    assert state.status == "needs_review"
    assert calls == ["first"]
    assert state.spent == 140
    assert state.error is not None and "spend_budget" in state.error
    assert "140 spent + 120" in state.error and "250" in state.error
    assert state.operation("first").cost == 120
    assert state.operation("second").attempts == 0


def test_side_effect_ceiling(make_orch: OrchestratorFactory) -> None:
    """Only operations declared side effects count against max_side_effects."""
    saga = Saga(
        "effects", input=Order, key=lambda o: o.order_id, ceilings=Ceilings(max_side_effects=1)
    )

    @saga.step(side_effect=False)
    def look(ctx: StepContext, order: Order) -> dict[str, Any]:
        return {}

    @saga.step
    def send_email(ctx: StepContext, order: Order) -> dict[str, Any]:
        return {}

    @saga.step
    def send_sms(ctx: StepContext, order: Order) -> dict[str, Any]:
        raise AssertionError("over the side-effect ceiling")

    orch = make_orch(saga)
    state = orch.execute(saga, Order(order_id="o-1"))
    assert state.status == "needs_review"
    assert [op.attempts for op in state.operations] == [1, 1, 0]
    assert state.side_effects == 1
    assert state.error is not None and "max_side_effects" in state.error


def test_per_step_limit_on_a_refund(make_orch: OrchestratorFactory) -> None:
    """A compensation above its per-step limit (refund at most N cents) parks, unrun."""
    saga = order_saga("refund_limit")
    refunds: list[int] = []

    @saga.step
    def charge(ctx: StepContext, order: Order) -> dict[str, Any]:
        return {"amount": order.amount_cents}

    @charge.compensation(cost=lambda o, result: result["amount"], max_cost=5000)
    def refund(ctx: StepContext, order: Order, result: dict[str, Any]) -> None:
        refunds.append(result["amount"])

    @saga.step
    def ship(ctx: StepContext, order: Order) -> dict[str, Any]:
        raise PermanentError("no carrier")

    orch = make_orch(saga)
    small = orch.execute(saga, Order(order_id="o-small", amount_cents=4990))
    large = orch.execute(saga, Order(order_id="o-large", amount_cents=6000))
    assert small.status == "compensated"
    assert large.status == "needs_review"
    assert refunds == [4990]
    assert large.error is not None and "max_cost" in large.error and "6000" in large.error
    assert _parked_detail(orch, large.id)["ceiling"] == {
        "ceiling": "max_cost",
        "limit": 5000,
        "cost": 6000,
    }


# ----- deadlines per attempt ---------------------------------------------------------------


def test_an_attempt_past_its_timeout_is_unknown_not_failed(
    make_orch: OrchestratorFactory,
) -> None:
    """A timed-out attempt may have had its effect: it is unknown; an idempotent step is
    retried with the same key, a plain one parks for a human."""
    saga = order_saga("timeouts")
    keys: list[str] = []

    @saga.step(idempotent=True, timeout_seconds=0.2)
    def charge(ctx: StepContext, order: Order) -> dict[str, Any]:
        keys.append(ctx.idempotency_key)
        if ctx.attempt == 1:
            time.sleep(1.0)
        return {"charged": True}

    plain = order_saga("timeouts_plain")

    @plain.step(timeout_seconds=0.2)
    def send(ctx: StepContext, order: Order) -> dict[str, Any]:
        time.sleep(1.0)
        return {}

    orch = make_orch(saga, plain)
    state = orch.execute(saga, Order(order_id="o-1"))
    assert state.status == "completed"
    assert len(keys) == 2 and len(set(keys)) == 1
    reasons = [e.detail["reason"] for e in orch.history(state.id) if e.event == "outcome_unknown"]
    assert reasons and "timeout" in reasons[0]

    parked = orch.execute(plain, Order(order_id="o-2"))
    assert parked.status == "needs_review"
    assert parked.operation("send").status == "unknown"


def test_a_step_deadline_bounds_its_retries(make_orch: OrchestratorFactory) -> None:
    """A step's overall deadline, waits included, ends its retries: it fails and the saga
    compensates what succeeded."""
    saga = order_saga("step_deadline")
    undone: list[str] = []

    @saga.step
    def reserve(ctx: StepContext, order: Order) -> dict[str, Any]:
        return {}

    @reserve.compensation
    def release(ctx: StepContext, order: Order, result: dict[str, Any]) -> None:
        undone.append("release")

    @saga.step(
        retry=RetryPolicy(max_attempts=50, initial_delay=0.1, max_delay=0.1, jitter=0.0),
        deadline_seconds=0.35,
    )
    def charge(ctx: StepContext, order: Order) -> dict[str, Any]:
        raise TransientError("gateway busy")

    orch = make_orch(saga)
    state = orch.execute(saga, Order(order_id="o-1"))
    assert state.status == "compensated"
    assert 2 <= state.operation("charge").attempts <= 5
    assert state.operation("charge").error is not None
    assert "deadline" in str(state.operation("charge").error)
    assert undone == ["release"]


# ----- reconciliation that allows for lag ---------------------------------------------------


def _unknown_then(answers: list[Any], *, window: float) -> tuple[Saga[Order], list[str]]:
    """A saga whose charge times out (unknown), then reconciles with the given answers."""
    saga = order_saga(f"lagging_{len(answers)}_{int(window)}")
    asked: list[str] = []

    @saga.step(timeout_seconds=0.1)
    def charge(ctx: StepContext, order: Order) -> dict[str, Any]:
        time.sleep(0.5)
        return {}

    @charge.reconcile(window_seconds=window, retry=FAST)
    def find(ctx: StepContext, order: Order) -> Found | Absent | Inconclusive:
        answer = answers[min(len(asked), len(answers) - 1)]
        asked.append(type(answer).__name__)
        return answer  # type: ignore[no-any-return]

    return saga, asked


def test_inconclusive_is_asked_again_within_the_window(make_orch: OrchestratorFactory) -> None:
    """Inconclusive and an unsettled Absent are asked again with backoff; Found settles it,
    the provider reference is kept apart from the result, every answer is audited."""
    saga, asked = _unknown_then(
        [
            Inconclusive("provider lagging"),
            Absent(settled=False),
            Found({"charge_id": "ch_1"}, provider_reference="ch_1"),
        ],
        window=10.0,
    )
    orch = make_orch(saga)
    state = orch.execute(saga, Order(order_id="o-1"))
    assert state.status == "completed"
    assert asked == ["Inconclusive", "Absent", "Found"]
    charge = state.operation("charge")
    assert charge.result == {"charge_id": "ch_1"} and charge.provider_reference == "ch_1"
    assert charge.attempts == 1
    names = events(orch.history(state.id))
    assert names.count("reconcile_inconclusive") == 1
    assert names.count("reconcile_absent") == 1
    assert names.count("reconcile_found") == 1


def test_inconclusive_past_the_window_parks(make_orch: OrchestratorFactory) -> None:
    """When the window closes without an answer, the saga parks saying how often it asked."""
    saga, asked = _unknown_then([Inconclusive("still lagging")], window=0.1)
    orch = make_orch(saga)
    state = orch.execute(saga, Order(order_id="o-1"))
    assert state.status == "needs_review"
    assert len(asked) >= 1
    assert state.error is not None and "still lagging" in state.error and "asked" in state.error
    assert state.operation("charge").status == "unknown"


# ----- dry run, then confirm -----------------------------------------------------------------


class Refund(BaseModel):
    """Input of the confirmation tests; `confirmed` is there to prove it confirms nothing."""

    order_id: str
    amount_cents: int
    confirmed: bool = False


class RefundRequest(BaseModel):
    """The typed intent of a refund, prepared before each attempt."""

    order_id: str
    amount_cents: int
    fee_cents: int


def _refund_saga(name: str, fees: list[int], calls: list[RefundRequest]) -> Saga[Refund]:
    saga: Saga[Refund] = Saga(name, input=Refund, key=lambda r: r.order_id)

    @saga.step(confirm=lambda req: req.amount_cents > 1000, confirm_ttl_seconds=5)
    def refund(ctx: StepContext, r: Refund) -> dict[str, Any]:
        calls.append(ctx.request)
        return {"refunded": ctx.request.amount_cents}

    @refund.prepare
    def plan_refund(ctx: StepContext, r: Refund) -> RefundRequest:
        # A volatile fact re-read before every attempt.
        return RefundRequest(order_id=r.order_id, amount_cents=r.amount_cents, fee_cents=fees[0])

    return saga


def test_a_large_refund_waits_for_a_signed_approval(database_url: str) -> None:
    """Over the limit, the saga pauses with a preview; only an approval signed with the
    orchestrator's key and bound to the exact request resumes it. The input's
    `confirmed: true` confirms nothing."""
    calls: list[RefundRequest] = []
    saga = _refund_saga("refunds", [30], calls)
    with Orchestrator(database_url, sagas=[saga], confirmation_key=KEY) as orch:
        small = orch.execute(saga, Refund(order_id="r-small", amount_cents=500))
        assert small.status == "completed" and len(calls) == 1

        state = orch.execute(saga, Refund(order_id="r-big", amount_cents=5000, confirmed=True))
        assert state.status == "awaiting_confirmation"
        assert len(calls) == 1
        preview = orch.preview(state.id)
        assert preview is not None
        # Bound to everything previewed, not the operation's idempotency request hash.
        assert preview.request_hash == preview_hash(preview.preview)
        assert preview.request_hash != state.operation("refund").request_hash
        assert preview.preview["payload"] == {
            "order_id": "r-big",
            "amount_cents": 5000,
            "fee_cents": 30,
        }
        assert preview.preview["target"] == "step 'refund'"
        assert orch.run(state.id).status == "awaiting_confirmation"  # running does not confirm

        with Orchestrator(database_url, sagas=[saga], confirmation_key="another key") as forger:
            forged = forger.approval(state.id, "refund", preview.request_hash, actor="mallory")
        with pytest.raises(ApprovalRejected):
            orch.confirm(state.id, "refund", preview.request_hash, forged)
        other = orch.approval(state.id, "refund", "0" * 64, actor="ops")
        with pytest.raises(ApprovalRejected):
            orch.confirm(state.id, "refund", preview.request_hash, other)
        with pytest.raises(StepStateError):
            orch.confirm(
                state.id,
                "refund",
                "0" * 64,
                orch.approval(state.id, "refund", "0" * 64, actor="ops"),
            )
        assert orch.get(state.id).status == "awaiting_confirmation"

        # The approvers' tooling holds the key but need not register the saga.
        with Orchestrator(database_url, confirmation_key=KEY) as approvers:
            token = approvers.approval(
                state.id, "refund", preview.request_hash, actor="ops@example"
            )
            resumed = approvers.confirm(state.id, "refund", preview.request_hash, token)
        assert resumed.status == "running"
        done = orch.run(state.id)
        assert done.status == "completed"
        assert [c.amount_cents for c in calls] == [500, 5000]
        approved = orch.confirmations(state.id)[-1]
        assert approved.approved_by == "ops@example"
        assert "confirmation_approved" in events(orch.history(state.id))


def test_a_changed_request_needs_a_new_confirmation(database_url: str) -> None:
    """Volatile facts are re-read on resume; when the request changed since the preview,
    the approval does not carry over: a new confirmation is asked for."""
    calls: list[RefundRequest] = []
    fees = [30]
    saga = _refund_saga("refunds_drift", fees, calls)
    with Orchestrator(database_url, sagas=[saga], confirmation_key=KEY) as orch:
        state = orch.execute(saga, Refund(order_id="r-1", amount_cents=5000))
        first = orch.preview(state.id)
        assert first is not None
        token = orch.approval(state.id, "refund", first.request_hash, actor="ops")
        orch.confirm(state.id, "refund", first.request_hash, token)
        fees[0] = 45  # the fee changed between the preview and the resume
        again = orch.run(state.id)
        assert again.status == "awaiting_confirmation"
        assert calls == []
        second = orch.preview(state.id)
        assert second is not None and second.request_hash != first.request_hash
        assert second.preview["payload"]["fee_cents"] == 45


def test_an_expired_confirmation_is_refused_and_previewed_again(database_url: str) -> None:
    """A confirmation past its expiry cannot be approved; running the saga prepares a
    fresh preview with a new expiry."""
    calls: list[RefundRequest] = []
    saga = _refund_saga("refunds_expiry", [30], calls)
    with Orchestrator(database_url, sagas=[saga], confirmation_key=KEY) as orch:
        state = orch.execute(saga, Refund(order_id="r-1", amount_cents=5000))
        pending = orch.preview(state.id)
        assert pending is not None
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute("UPDATE saga.confirmations SET expires_at = now() - interval '1 second'")
        token = orch.approval(state.id, "refund", pending.request_hash, actor="ops")
        with pytest.raises(StepStateError, match="expired"):
            orch.confirm(state.id, "refund", pending.request_hash, token)
        again = orch.run(state.id)
        assert again.status == "awaiting_confirmation"
        fresh = orch.preview(state.id)
        assert fresh is not None and fresh.expires_at > pending.expires_at
        assert calls == []


# ----- replan safety ---------------------------------------------------------------------------


class Payment(BaseModel):
    """The request of the replan test's payment step."""

    amount_cents: int


def test_a_request_that_changes_while_an_outcome_is_unknown_is_not_acted_on(
    make_orch: OrchestratorFactory,
) -> None:
    """The request is persisted before the call; when a retry after an unknown outcome
    computes a different one, the saga parks naming both, and no second effect runs."""
    saga = order_saga("replanned")
    amounts = [100]
    sent: list[int] = []
    gate = threading.Event()

    @saga.step(idempotent=True, timeout_seconds=0.2)
    def pay(ctx: StepContext, order: Order) -> dict[str, Any]:
        sent.append(ctx.request.amount_cents)
        gate.wait(2.0)  # the first attempt outlives its timeout: outcome unknown
        return {}

    @pay.prepare
    def plan(ctx: StepContext, order: Order) -> Payment:
        amount = amounts[0]
        amounts[0] = 250  # the model changed its mind before the retry
        return Payment(amount_cents=amount)

    orch = make_orch(saga)
    state = orch.execute(saga, Order(order_id="o-1"))
    gate.set()
    assert state.status == "needs_review"
    assert sent == [100]
    assert state.error is not None
    assert '"amount_cents":100' in state.error and '"amount_cents":250' in state.error
    assert state.operation("pay").request == {"amount_cents": 100}
    assert "request_changed" in events(orch.history(state.id))


# ----- key retention --------------------------------------------------------------------------


def test_purge_deletes_only_ended_sagas_past_the_retention(make_orch: OrchestratorFactory) -> None:
    """Purging keeps every saga that is running, parked or recent, with its operations."""
    saga = order_saga("retained")

    @saga.step
    def work(ctx: StepContext, order: Order) -> dict[str, Any]:
        if order.amount_cents == 13:
            raise PermanentError("unlucky")
        return {}

    orch = make_orch(saga)
    old_done = orch.execute(saga, Order(order_id="old-done")).id
    recent_done = orch.execute(saga, Order(order_id="recent-done")).id
    pending = orch.start(saga, Order(order_id="pending")).id
    url = orch.database_url
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "UPDATE saga.sagas SET finished_at = now() - interval '31 days',"
            " updated_at = now() - interval '31 days' WHERE id = %s",
            (old_done,),
        )
        conn.execute(
            "UPDATE saga.sagas SET updated_at = now() - interval '400 days',"
            " created_at = now() - interval '400 days' WHERE id = %s",
            (pending,),
        )
    with pytest.raises(ValueError, match="retention"):
        orch.purge(older_than_days=1)
    assert orch.purge(batch_size=1) == 1
    remaining = {s.id for s in orch.list()}
    assert remaining == {recent_done, pending}
    assert count_rows(url, "operations", old_done) == 0
    assert count_rows(url, "events", old_done) == 0  # no foreign key: purged explicitly
    assert count_rows(url, "operations", pending) == 1
    assert count_rows(url, "events", recent_done) > 0
    assert orch.purge() == 0
