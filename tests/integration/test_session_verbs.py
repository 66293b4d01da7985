"""Operators' verbs on sessions, and how the next entry of the session's code meets
them: a cancelled session finishes its compensations when it is entered again, a
retried one settles its parked call again, a forked one points to its fork; a call that
used up its attempts fails for good in the entry that made it as in any later one."""

from __future__ import annotations

import time
from typing import Any

import pytest

from saga import (
    Found,
    Inconclusive,
    Orchestrator,
    PermanentError,
    RetryPolicy,
    SagaStatus,
    SessionParked,
    StepContext,
    StepStateError,
    TransientError,
    durable_step,
)
from saga.durable import isolated_steps


@pytest.fixture(autouse=True)
def _steps() -> Any:
    with isolated_steps():
        yield


def test_a_cancelled_session_finishes_its_compensations_at_its_next_entry(
    database_url: str,
) -> None:
    undone: list[int] = []

    @durable_step(name="book_seat")
    def book_seat(n: int) -> dict[str, int]:
        return {"seat": n}

    @book_seat.compensation
    def release_seat(ctx: StepContext, result: dict[str, int], n: int) -> None:
        undone.append(result["seat"])

    with Orchestrator(database_url) as orch:
        with pytest.raises(RuntimeError), orch.session("show-1") as run:
            book_seat(1)
            book_seat(2)
            raise RuntimeError("the process is told to stop")  # leaves the session open
        assert orch.cancel(run.id, reason="show cancelled", actor="ops").status == (
            SagaStatus.COMPENSATING
        )
        assert undone == []  # no worker drives a session: its next entry does

        with orch.session("show-1") as again:
            assert book_seat(1) == {"seat": 1}  # a call it made: replayed
            with pytest.raises(StepStateError, match="is compensated: a call it did not make"):
                book_seat(3)
        assert undone == [2, 1]
        assert orch.get(again.id).status == SagaStatus.COMPENSATED
        with orch.session("show-1"):
            pass
        assert undone == [2, 1]  # compensated once


def test_a_call_out_of_attempts_fails_for_good_and_compensates_in_the_same_entry(
    database_url: str,
) -> None:
    undone: list[str] = []

    @durable_step(name="hold_room")
    def hold_room(room: str) -> str:
        return f"hold-{room}"

    @hold_room.compensation
    def free_room(ctx: StepContext, result: str, room: str) -> None:
        undone.append(result)

    @durable_step(name="call_gateway", retry=RetryPolicy(max_attempts=2, initial_delay=0.01))
    def call_gateway(order: str) -> str:
        raise TransientError("503 from the gateway")

    with Orchestrator(database_url) as orch:
        failing = pytest.raises(PermanentError, match="ceiling of 2 attempts")
        with failing as raised, orch.session("trip-1") as run:
            hold_room("r1")
            call_gateway("o-1")
        assert isinstance(raised.value.__cause__, TransientError)
        assert undone == ["hold-r1"]
        assert orch.get(run.id).status == SagaStatus.COMPENSATED


def test_a_retried_session_settles_its_parked_call_again_at_the_next_entry(
    database_url: str,
) -> None:
    answers: list[Any] = [Inconclusive("the provider's status page is down")]
    sent: list[str] = []

    @durable_step(name="send_fax", timeout_seconds=0.2)
    def send_fax(to: str) -> dict[str, str]:
        sent.append(to)
        time.sleep(1.0)  # the reply never comes in time: the outcome is unknown
        return {"fax": to}

    @send_fax.reconcile
    def find_fax(ctx: StepContext, to: str) -> Any:
        return answers.pop(0)

    with Orchestrator(database_url) as orch:
        with pytest.raises(SessionParked, match="send_fax"), orch.session("fax-1") as run:
            send_fax("+1-555-0100")
        assert orch.get(run.id).status == SagaStatus.NEEDS_REVIEW

        answers.append(Found({"fax": "+1-555-0100", "found": "in the outbox"}))
        assert orch.retry(run.id, actor="ops").status.is_runnable
        with orch.session("fax-1") as again:
            assert send_fax("+1-555-0100") == {"fax": "+1-555-0100", "found": "in the outbox"}
        assert sent == ["+1-555-0100"]  # asked about, never sent again
        assert orch.get(again.id).status == SagaStatus.COMPLETED


def test_a_forked_session_points_its_code_to_the_fork(database_url: str) -> None:
    @durable_step(name="quote")
    def quote(item: str) -> int:
        return 10

    @durable_step(name="order")
    def order(item: str, price: int) -> str:
        raise PermanentError("the shop is closed")

    with Orchestrator(database_url) as orch:
        with pytest.raises(RuntimeError), orch.session("buy-1") as run:
            price = quote("pen")
            with pytest.raises(PermanentError):
                order("pen", price)
            raise RuntimeError("the code stops here: the session stays open")
        fork = orch.fork(run.id, "order", actor="ops")
        pointed = pytest.raises(StepStateError, match=f"goes on in its fork {fork.id}")
        with orch.session("buy-1"), pointed:
            order("pen", quote("pen") + 1)
