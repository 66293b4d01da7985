"""A commit that landed while its reply was lost is recognised as landed, on every write.

The orchestrator under test reaches PostgreSQL through `faults.proxy.LostReplyProxy`,
which lets a chosen write commit and then closes the connection before the client reads
the reply. Step code records its calls straight in the test database (not through the
proxy). The invariant for every write: the retry finds the write landed, nothing is
applied twice, and nothing that was never called is ever parked as unknown.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from typing import Any

import crash_app
import psycopg
import pytest
from faults.proxy import LostReplyProxy
from support import FAST, ChildApp, Order, lease_expired, order_saga, record_step_call, wait_until

from saga import Ceilings, Orchestrator, RetryPolicy, Saga, StepContext, TransientError

pytestmark = pytest.mark.crash


@pytest.fixture
def proxy(database_url: str) -> Iterator[LostReplyProxy]:
    with LostReplyProxy(database_url) as made:
        yield made


def _two_steps(url: str, name: str, *, fail_first: bool = False) -> Saga[Order]:
    """`reserve` then `charge`, neither idempotent: a spurious unknown parks the saga."""
    saga = order_saga(name)

    @saga.step(retry=FAST)
    def reserve(ctx: StepContext, order: Order) -> dict[str, Any]:
        record_step_call(url, ctx)
        if fail_first and ctx.attempt == 1:
            raise TransientError("provider busy")
        return {"reserved": order.order_id}

    @saga.step
    def charge(ctx: StepContext, order: Order) -> dict[str, Any]:
        record_step_call(url, ctx)
        return {"charged": order.amount_cents}

    return saga


def _unknown_events(orch: Orchestrator, saga_id: str) -> list[str]:
    return [f"{e.step}#{e.attempt}" for e in orch.history(saga_id) if e.event == "outcome_unknown"]


@pytest.mark.parametrize("started_by", ["the same orchestrator", "another process"])
def test_claim_of_run_whose_reply_was_lost_is_carried_on(
    database_url: str, proxy: LostReplyProxy, calls: list[tuple[str, int]], started_by: str
) -> None:
    """run()'s claim commits, its reply is lost: the retry drives the saga it holds. A
    saga the orchestrator has just started is claimed in one statement (claim_started);
    any other in a claim transaction whose write carries the lease_acquired event."""
    saga = _two_steps(database_url, f"lost_claim_{started_by.split()[0]}")
    with Orchestrator(proxy.url, sagas=[saga], lease_seconds=2.0) as orch:
        if started_by == "another process":
            with Orchestrator(database_url, sagas=[saga]) as starter:
                handle = starter.start(saga, Order(order_id="o-1"))
            proxy.lose_reply("saga.write_saga", '"lease_acquired"')
        else:
            handle = orch.start(saga, Order(order_id="o-1"))
            proxy.lose_reply("saga.claim_started", '"lease_acquired"')
        state = orch.run(handle.id)
        assert len(proxy.lost_replies()) == 1 and not proxy.lost_replies()[0].failed
        assert state.status == "completed", state.error
        assert list(calls) == [("reserve", 1), ("charge", 1)]
        assert _unknown_events(orch, handle.id) == []


def test_worker_claim_whose_reply_was_lost_is_carried_on(
    database_url: str, proxy: LostReplyProxy, calls: list[tuple[str, int]]
) -> None:
    """A worker's claim, which starts the saga's first attempt in the same statement,
    commits and its reply is lost: the worker drives the saga it took from that attempt."""
    saga = _two_steps(database_url, "lost_worker_claim")
    with Orchestrator(database_url, sagas=[saga]) as starter:
        handle = starter.start(saga, Order(order_id="o-1"))
    with Orchestrator(proxy.url, sagas=[saga], lease_seconds=2.0) as orch:
        proxy.lose_reply("saga.claim_batch_v2")
        orch.worker(concurrency=2, poll_seconds=0.2).run(until_idle=True)
        assert len(proxy.lost_replies()) == 1
        state = orch.get(handle.id)
        assert state.status == "completed", state.error
        assert list(calls) == [("reserve", 1), ("charge", 1)]
        assert _unknown_events(orch, handle.id) == []


def test_execute_whose_start_reply_was_lost_drives_its_saga(
    database_url: str, proxy: LostReplyProxy, calls: list[tuple[str, int]]
) -> None:
    """execute()'s start commits (the saga leased to it, its first attempt recorded) and
    the reply is lost: execute() retries its start, recognises its saga, drives it."""
    saga = _two_steps(database_url, "lost_start")
    with Orchestrator(proxy.url, sagas=[saga], lease_seconds=2.0) as orch:
        proxy.lose_reply("start_saga")
        state = orch.execute(saga, Order(order_id="o-1"))
        assert len(proxy.lost_replies("start_saga")) == 1
        assert state.status == "completed", state.error
        assert list(calls) == [("reserve", 1), ("charge", 1)]
        assert _unknown_events(orch, state.id) == []
        assert orch.get(state.id).lease_owner is None


def test_start_whose_reply_was_lost_returns_the_created_saga(
    database_url: str, proxy: LostReplyProxy
) -> None:
    saga = _two_steps(database_url, "lost_plain_start")
    with Orchestrator(proxy.url, sagas=[saga]) as orch:
        proxy.lose_reply("start_saga")
        handle = orch.start(saga, Order(order_id="o-1"))
        assert len(proxy.lost_replies("start_saga")) == 1
        assert handle.created
        assert orch.get(handle.id).status == "pending"


def test_attempt_started_after_a_backoff_whose_reply_was_lost_is_called(
    database_url: str, proxy: LostReplyProxy, calls: list[tuple[str, int]]
) -> None:
    """After an in-process backoff the write that starts attempt 2 commits and its reply
    is lost: the same owner calls that attempt instead of marking it unknown."""
    saga = _two_steps(database_url, "lost_after_backoff", fail_first=True)
    with Orchestrator(proxy.url, sagas=[saga], lease_seconds=2.0) as orch:
        handle = orch.start(saga, Order(order_id="o-1"))
        proxy.lose_reply("saga.write_saga", '"attempt_started"', '"attempt":2')
        state = orch.run(handle.id)
        assert len(proxy.lost_replies()) == 1
        assert state.status == "completed", state.error
        assert list(calls) == [("reserve", 1), ("reserve", 2), ("charge", 1)]
        assert _unknown_events(orch, handle.id) == []
        reserve = state.operation("reserve")
        assert reserve.attempts == 2


def test_outcome_whose_reply_was_lost_is_not_applied_twice(
    database_url: str, proxy: LostReplyProxy, calls: list[tuple[str, int]]
) -> None:
    """A step's success and the next attempt's start commit together; the reply is lost."""
    saga = _two_steps(database_url, "lost_outcome")
    with Orchestrator(proxy.url, sagas=[saga], lease_seconds=2.0) as orch:
        handle = orch.start(saga, Order(order_id="o-1"))
        proxy.lose_reply("saga.write_saga", '"attempt_succeeded"', '"step":"reserve"')
        state = orch.run(handle.id)
        assert len(proxy.lost_replies()) == 1
        assert state.status == "completed", state.error
        assert list(calls) == [("reserve", 1), ("charge", 1)]
        assert _unknown_events(orch, handle.id) == []


def test_stop_whose_reply_was_lost_returns_the_final_state(
    database_url: str, proxy: LostReplyProxy, calls: list[tuple[str, int]]
) -> None:
    """The last write completes the saga and gives the lease back; its reply is lost."""
    saga = _two_steps(database_url, "lost_stop")
    with Orchestrator(proxy.url, sagas=[saga], lease_seconds=2.0) as orch:
        handle = orch.start(saga, Order(order_id="o-1"))
        proxy.lose_reply("saga.write_saga", '"saga_completed"')
        state = orch.run(handle.id)
        assert len(proxy.lost_replies()) == 1
        assert state.status == "completed", state.error
        assert [e.event for e in orch.history(handle.id)].count("saga_completed") == 1


def _prepared_saga(url: str) -> Saga[Order]:
    saga = order_saga("lost_prepare")

    @saga.step
    def quote(ctx: StepContext, order: Order) -> dict[str, Any]:
        record_step_call(url, ctx)
        return {"quote": ctx.request}

    @quote.prepare
    def price(ctx: StepContext, order: Order) -> dict[str, Any]:
        return {"amount_cents": order.amount_cents}

    return saga


def test_prepared_request_whose_reply_was_lost_is_called(
    database_url: str, proxy: LostReplyProxy, calls: list[tuple[str, int]]
) -> None:
    """The prepared request is committed with the attempt's start; the reply is lost."""
    saga = _prepared_saga(database_url)
    with Orchestrator(proxy.url, sagas=[saga], lease_seconds=2.0) as orch:
        handle = orch.start(saga, Order(order_id="o-1"))
        proxy.lose_reply("saga.write_saga", '"request_prepared"')
        state = orch.run(handle.id)
        assert len(proxy.lost_replies()) == 1
        assert state.status == "completed", state.error
        assert list(calls) == [("quote", 1)]
        assert _unknown_events(orch, handle.id) == []


def _killed_in_charge(
    url: str, children: list[ChildApp], order_id: str, block: str, signal_line: str
) -> str:
    """A child SIGKILLed in the reconciled saga's charge step; its lease then expired."""
    child = ChildApp(url, crash_app.RECONCILED.name, order_id, CRASH_APP_BLOCK=block)
    children.append(child)
    saga_id = child.expect("STARTED").split()[1]
    child.expect(signal_line)
    child.signal(signal.SIGKILL)
    assert child.wait() == -signal.SIGKILL
    wait_until(lambda: lease_expired(url, saga_id), timeout=15)
    return saga_id


def test_reconcile_answer_whose_reply_was_lost_is_not_applied_twice(
    app_url: str, proxy: LostReplyProxy, children: list[ChildApp]
) -> None:
    """Killed after charging: reconcile finds the charge, and that answer is committed with
    the start of the next step; the reply is lost. The next step is called, once, and
    nothing is parked as unknown."""
    saga_id = _killed_in_charge(app_url, children, "o-1", "after_effect", "CHARGED")

    with Orchestrator(proxy.url, sagas=crash_app.ALL_SAGAS, lease_seconds=2.0) as orch:
        proxy.lose_reply("saga.write_saga", '"reconcile_found"')
        state = orch.run(saga_id)
        assert len(proxy.lost_replies()) == 1
        assert state.status == "completed", state.error
        assert _unknown_events(orch, saga_id) == ["charge#1"]  # the killed attempt only
        with psycopg.connect(app_url) as conn:
            confirms = conn.execute(
                "SELECT count(*) FROM step_calls WHERE step = 'confirm'"
            ).fetchone()
        assert confirms == (1,)
        assert state.operation("confirm").attempts == 1


def test_reconcile_absent_whose_reply_was_lost_retries_once(
    app_url: str, proxy: LostReplyProxy, children: list[ChildApp]
) -> None:
    """Killed before charging: reconcile answers Absent, and the retry with the same key is
    started in the same commit; the reply is lost. The retry is called once."""
    saga_id = _killed_in_charge(app_url, children, "o-2", "before_effect", "IN_CHARGE")

    with Orchestrator(proxy.url, sagas=crash_app.ALL_SAGAS, lease_seconds=2.0) as orch:
        proxy.lose_reply("saga.write_saga", '"reconcile_absent"')
        state = orch.run(saga_id)
        assert len(proxy.lost_replies()) == 1
        assert state.status == "completed", state.error
        charge = state.operation("charge")
        assert charge.attempts == 2  # the killed attempt and one retry, not a third
        assert _unknown_events(orch, saga_id) == ["charge#1"]


def test_operator_change_whose_reply_was_lost_is_not_applied_twice(
    database_url: str, proxy: LostReplyProxy
) -> None:
    """cancel() commits and its reply is lost: the retry recognises the landed change."""
    saga = _two_steps(database_url, "lost_cancel")
    with Orchestrator(proxy.url, sagas=[saga]) as orch:
        handle = orch.start(saga, Order(order_id="o-1"))
        proxy.lose_reply("saga.write_saga", '"cancel_requested"')
        state = orch.cancel(handle.id, reason="customer asked", actor="ops")
        assert len(proxy.lost_replies()) == 1
        assert state.status == "compensating"
        assert [e.event for e in orch.history(handle.id)].count("cancel_requested") == 1


def test_heartbeat_whose_reply_was_lost_keeps_the_step_alive(
    database_url: str, proxy: LostReplyProxy, calls: list[tuple[str, int]]
) -> None:
    """A heartbeat commits and its reply is lost while a long step runs: the step's
    outcome is recorded, not taken for a dead worker's."""
    saga = order_saga("lost_heartbeat")
    release = threading.Event()

    @saga.step
    def slow(ctx: StepContext, order: Order) -> dict[str, Any]:
        record_step_call(database_url, ctx)
        release.wait(3.0)
        return {"slow": True}

    with Orchestrator(proxy.url, sagas=[saga], lease_seconds=1.5) as orch:
        handle = orch.start(saga, Order(order_id="o-1"))
        proxy.lose_reply("AS h(id, fence)", times=2)
        state = orch.run(handle.id)
        assert len(proxy.lost_replies("AS h(id, fence)")) >= 1
        assert state.status == "completed", state.error
        assert list(calls) == [("slow", 1)]
        assert _unknown_events(orch, handle.id) == []


def test_proxy_loses_only_what_it_is_told(database_url: str, proxy: LostReplyProxy) -> None:
    """The proxy forwards everything else untouched: a whole saga without rules."""
    saga = order_saga("proxied")

    @saga.step(retry=RetryPolicy(max_attempts=1))
    def only(ctx: StepContext, order: Order) -> dict[str, Any]:
        return {"ok": order.order_id}

    with Orchestrator(proxy.url, sagas=[saga]) as orch:
        state = orch.execute(saga, Order(order_id="o-1"))
    assert state.status == "completed"
    assert proxy.lost_replies() == []


def test_confirmation_writes_whose_replies_were_lost_are_not_applied_twice(
    database_url: str, proxy: LostReplyProxy, calls: list[tuple[str, int]]
) -> None:
    """The request for a confirmation, and then the approval, each commit and lose their
    reply: each is recognised as landed, and the step runs once, after the approval."""
    saga = order_saga("lost_confirmation")

    @saga.step(confirm=True)
    def payout(ctx: StepContext, order: Order) -> dict[str, Any]:
        record_step_call(database_url, ctx)
        return {"paid": order.amount_cents}

    with Orchestrator(proxy.url, sagas=[saga], confirmation_key="k" * 32) as orch:
        handle = orch.start(saga, Order(order_id="o-1"))
        # run() of a saga it has just started claims it and asks in one statement.
        proxy.lose_reply("saga.claim_started", '"confirmation_requested"')
        waiting = orch.run(handle.id)
        assert len(proxy.lost_replies()) == 1
        assert waiting.status == "awaiting_confirmation", waiting.error
        preview = orch.preview(handle.id)
        assert preview is not None
        approval = orch.approval(handle.id, "payout", preview.request_hash, actor="ops")
        proxy.lose_reply("saga.write_saga", '"confirmation_approved"')
        resumed = orch.confirm(handle.id, "payout", preview.request_hash, approval)
        assert len(proxy.lost_replies()) == 2
        assert resumed.status == "running"
        done = orch.run(handle.id)
        assert done.status == "completed", done.error
        trail = [e.event for e in orch.history(handle.id)]
        assert trail.count("confirmation_requested") == 1
        assert trail.count("confirmation_approved") == 1
        assert list(calls) == [("payout", 1)]


def test_spend_report_and_outcome_whose_replies_were_lost_count_the_spend_once(
    database_url: str, proxy: LostReplyProxy, calls: list[tuple[str, int]]
) -> None:
    """ctx.spend()'s write commits and its reply is lost, then the outcome's: the retries
    find both landed, and the saga counts the spend once."""
    saga = Saga(
        "lost_spend",
        input=Order,
        key=lambda o: o.order_id,
        ceilings=Ceilings(spend_budget=100),
    )

    @saga.step
    def pay(ctx: StepContext, order: Order) -> dict[str, Any]:
        record_step_call(database_url, ctx)
        ctx.spend(30)
        return {"paid": True}

    with Orchestrator(proxy.url, sagas=[saga], lease_seconds=2.0) as orch:
        proxy.lose_reply("attempt_spend = GREATEST")
        proxy.lose_reply("saga.write_saga", '"attempt_succeeded"')
        state = orch.execute(saga, Order(order_id="o-1"))
        assert len(proxy.lost_replies("attempt_spend")) == 1
        assert len(proxy.lost_replies("saga.write_saga")) == 1
        assert state.status == "completed", state.error
        assert state.spent == 30 and state.operation("pay").spent == 30
        assert list(calls) == [("pay", 1)]


@pytest.mark.parametrize("prepared", [False, True], ids=["claim", "after_prepare"])
def test_an_approval_releases_one_attempt_when_its_start_lost_the_reply(
    database_url: str, proxy: LostReplyProxy, calls: list[tuple[str, int]], prepared: bool
) -> None:
    """The write that starts the approved attempt (and uses the approval up) commits and
    its reply is lost, at the claim's first move or after a prepare: that attempt is
    called once, and its transient failure's retry waits for a new approval."""
    saga = order_saga(f"lost_approved_start_{'prepared' if prepared else 'plain'}")

    @saga.step(confirm=True, retry=FAST)
    def payout(ctx: StepContext, order: Order) -> dict[str, Any]:
        record_step_call(database_url, ctx)
        if ctx.attempt == 1:
            raise TransientError("gateway busy")
        return {"paid": order.amount_cents}

    if prepared:

        @payout.prepare
        def plan(ctx: StepContext, order: Order) -> dict[str, Any]:
            return {"amount_cents": order.amount_cents}

    with Orchestrator(proxy.url, sagas=[saga], confirmation_key="k" * 32) as orch:

        def approve() -> str:
            pending = orch.preview(handle.id)
            assert pending is not None
            token = orch.approval(handle.id, "payout", pending.request_hash, actor="ops")
            orch.confirm(handle.id, "payout", pending.request_hash, token)
            return pending.request_hash

        handle = orch.start(saga, Order(order_id="o-1"))
        assert orch.run(handle.id).status == "awaiting_confirmation"
        first = approve()
        proxy.lose_reply("saga.write_saga", '"attempt_started"')
        state = orch.run(handle.id)
        assert len(proxy.lost_replies()) == 1
        assert list(calls) == [("payout", 1)]
        assert state.status == "awaiting_confirmation", state.error
        assert _unknown_events(orch, handle.id) == []
        used = {c.request_hash: c.consumed_attempt for c in orch.confirmations(handle.id)}
        assert used[first] == 1

        second = approve()
        done = orch.run(handle.id)
        assert done.status == "completed", done.error
        assert list(calls) == [("payout", 1), ("payout", 2)]
        used = {c.request_hash: c.consumed_attempt for c in orch.confirmations(handle.id)}
        assert used == {first: 1, second: 2}
