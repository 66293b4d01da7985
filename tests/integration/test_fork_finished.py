"""Forking a finished saga or session: refining step N+1 of a finished run without paying
for steps 1..N again, allowed when no step from the fork point on has an effect the
fork would repeat (declared side_effect=False, or compensated), refused naming the step
whose effect would repeat otherwise."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from support import Order, order_saga, scalar

from saga import Orchestrator, PermanentError, Saga, StepContext, StepStateError, durable_step
from saga.durable import isolated_steps


def _research_saga(calls: list[str], *, charge: bool = False, ship: str = "ok") -> Saga[Order]:
    """research (an LLM call), [charge (an effect, refunded)], draft (an LLM call),
    [ship, when `ship` is not "ok": it fails for good]."""
    saga = order_saga(f"research-{charge}-{ship}")

    @saga.step(side_effect=False)
    def research(ctx: StepContext, o: Order) -> dict[str, Any]:
        calls.append("research")
        return {"facts": 3}

    if charge:

        @saga.step
        def pay(ctx: StepContext, o: Order) -> dict[str, Any]:
            calls.append("pay")
            return {"charge_id": f"ch-{o.order_id}"}

        @pay.compensation
        def refund(ctx: StepContext, o: Order, result: Any) -> None:
            calls.append("refund")

    @saga.step(side_effect=False)
    def draft(ctx: StepContext, o: Order) -> dict[str, Any]:
        calls.append("draft")
        return {"text": f"draft {calls.count('draft')}"}

    if ship != "ok":

        @saga.step
        def ship_it(ctx: StepContext, o: Order) -> dict[str, Any]:
            calls.append("ship")
            raise PermanentError("no carrier")

    return saga


def test_a_completed_saga_is_forked_to_refine_its_last_step_without_running_the_others(
    database_url: str,
) -> None:
    calls: list[str] = []
    saga = _research_saga(calls)
    with Orchestrator(database_url, sagas=[saga]) as orch:
        source = orch.execute(saga, Order(order_id="o-1"))
        assert source.status == "completed" and calls == ["research", "draft"]
        fork = orch.fork(source.id, "draft", key="o-1:refined", actor="ops")
        done = orch.run(fork.id)
        assert done.status == "completed"
        assert calls == ["research", "draft", "draft"]  # research is not paid for again
        assert done.operation("research").result == {"facts": 3}
        assert done.operation("draft").result == {"text": "draft 2"}
        after = orch.get(source.id)
        assert (after.status, after.forked_to) == ("forked", fork.id)


def test_a_compensated_saga_is_forked_from_its_undone_step(database_url: str) -> None:
    calls: list[str] = []
    saga = _research_saga(calls, charge=True, ship="permanent")
    with Orchestrator(database_url, sagas=[saga]) as orch:
        source = orch.execute(saga, Order(order_id="o-2"))
        assert source.status == "compensated"
        assert calls == ["research", "pay", "draft", "ship", "refund"]
        # From ship on the charge before it was refunded: the fork cannot inherit it.
        with pytest.raises(StepStateError, match="step 'pay' before 'ship_it' was compensated"):
            orch.fork(source.id, "ship_it")
        fork = orch.fork(source.id, "pay")
        calls.clear()
        assert orch.run(fork.id).status == "compensated"
        assert calls == ["pay", "draft", "ship", "refund"]  # research inherited


def test_a_finished_saga_whose_later_step_took_an_effect_is_refused_naming_it(
    database_url: str,
) -> None:
    calls: list[str] = []
    saga = _research_saga(calls, charge=True)
    with Orchestrator(database_url, sagas=[saga]) as orch:
        source = orch.execute(saga, Order(order_id="o-3"))
        assert source.status == "completed"
        before, history = orch.get(source.id), orch.history(source.id)
        with pytest.raises(
            StepStateError,
            match=r"step 'pay' succeeded: a fork from 'research' would run it again under a "
            r"new key and repeat its effect \(it is not declared side_effect=False",
        ):
            orch.fork(source.id, "research")
        assert orch.get(source.id) == before and orch.history(source.id) == history
        assert scalar(database_url, "SELECT count(*) FROM saga.sagas") == 1
        # From after the charge on, nothing would repeat it.
        assert orch.run(orch.fork(source.id, "draft").id).status == "completed"


def test_a_closed_session_is_forked_from_a_call_without_side_effects(database_url: str) -> None:
    calls: list[str] = []
    with isolated_steps():

        @durable_step(name="plan", side_effect=False)
        def plan(question: str) -> str:
            calls.append("plan")
            return f"plan for {question}"

        @durable_step(name="answer", side_effect=False)
        def answer(steps: str) -> str:
            calls.append("answer")
            return f"answer {calls.count('answer')} after {steps}"

        @durable_step(name="email")
        def email(to: str, body: str) -> str:
            calls.append("email")
            return "sent"

        with Orchestrator(database_url) as orch:
            run_id = f"agent-{uuid.uuid4()}"
            with orch.session(run_id) as run:
                answer(plan("q"))
            assert orch.get(run.id).status == "completed"
            fork = orch.fork(run.id, "answer", key=f"{run_id}:refined")
            with orch.session(f"{run_id}:refined") as refined:
                assert answer(plan("q")) == "answer 2 after plan for q"
                assert (refined.executed, refined.replayed) == (1, 1)
            assert refined.id == fork.id
            assert calls == ["plan", "answer", "answer"]

            other = f"mail-{uuid.uuid4()}"
            with orch.session(other) as mailed:
                plan("q")
                email("a@example.com", "hi")
            with pytest.raises(StepStateError, match=r"call 'email\.[0-9a-f]+' succeeded"):
                orch.fork(mailed.id, "plan")
