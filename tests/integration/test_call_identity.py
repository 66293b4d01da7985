"""Two keys are two calls: a code-first call's identity rests on its whole key, never on
the short digest in its operation's name, in a session as in the ledger. The keys below
share the first 48 bits of their SHA-256, the digest of a call's short name."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from saga import AsyncOrchestrator, Orchestrator, durable_step
from saga.durable import DurableStep, isolated_steps
from saga.keys import call_operation_name, operation_key

KEYS = ("order-18388720", "order-38511392")


@pytest.fixture
def orch(database_url: str) -> Iterator[Orchestrator]:
    with Orchestrator(database_url) as made:
        yield made


def test_two_keys_with_one_short_name_are_two_ledger_calls(orch: Orchestrator) -> None:
    assert len({hashlib.sha256(k.encode()).hexdigest()[:12] for k in KEYS}) == 1
    claims = [
        orch.ledger.claim("run-1", key, "charge", {"order_id": key, "amount_cents": n})
        for n, key in enumerate(KEYS)
    ]
    assert [c.status for c in claims] == ["claimed", "claimed"]
    first, second = claims
    assert first.step == call_operation_name("charge", KEYS[0])  # the short name, for people
    assert second.step != first.step and second.step.startswith("charge.")
    for claim in claims:
        orch.ledger.complete(claim, {"charged": claim.key})
    for n, key in enumerate(KEYS):
        replay = orch.ledger.claim("run-1", key, "charge", {"order_id": key, "amount_cents": n})
        assert (replay.status, replay.result, replay.step) == (
            "replayed",
            {"charged": key},
            claims[n].step,
        )
    state = orch.get(first.saga_id)
    assert sorted(o.step for o in state.operations) == sorted(c.step for c in claims)


def _charge() -> DurableStep[Any, Any]:
    @durable_step(name="charge", key=lambda order_id, amount_cents: order_id)
    def charge(order_id: str, amount_cents: int) -> dict[str, Any]:
        calls.append(order_id)
        return {"charged": order_id, "amount_cents": amount_cents}

    return charge


calls: list[str] = []


def test_two_keys_with_one_short_name_are_two_session_calls(orch: Orchestrator) -> None:
    calls.clear()
    with isolated_steps():
        charge = _charge()
        with orch.session("ticket-1") as run:
            results = [charge(key, n) for n, key in enumerate(KEYS)]
        assert (run.executed, run.replayed) == (2, 0)
        with orch.session("ticket-1") as run:
            again = [charge(key, n) for n, key in enumerate(KEYS)]
        assert (run.executed, run.replayed) == (0, 2)
    assert calls == list(KEYS)
    assert results == again == [{"charged": key, "amount_cents": n} for n, key in enumerate(KEYS)]
    (session,) = orch.list()
    steps = [o.step for o in orch.get(session.id).operations]
    assert steps[0] == call_operation_name("charge", KEYS[0]) and len(set(steps)) == 2


def test_a_session_call_recorded_before_keeps_replaying(
    database_url: str, orch: Orchestrator
) -> None:
    calls.clear()
    with isolated_steps():
        charge = _charge()
        with orch.session("ticket-2") as run:
            charge(KEYS[0], 1)
        # As a release before this one wrote it: the idempotency key built on the short name.
        (session,) = orch.list()
        short = call_operation_name("charge", KEYS[0])
        legacy = operation_key(session.saga, session.version, "", "ticket-2", short, "action")
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(
                "UPDATE saga.operations SET idempotency_key = %s WHERE saga_id = %s AND step = %s",
                (legacy, session.id, short),
            )
        with orch.session("ticket-2") as run:
            assert charge(KEYS[0], 1) == {"charged": KEYS[0], "amount_cents": 1}
        assert (run.executed, run.replayed) == (0, 1)
    assert calls == [KEYS[0]]


def test_two_keys_with_one_short_name_are_two_calls_of_an_async_session(
    database_url: str,
) -> None:
    made: list[str] = []

    async def main() -> list[Any]:
        with isolated_steps():

            @durable_step(name="charge", key=lambda order_id: order_id)
            async def charge(order_id: str) -> dict[str, Any]:
                made.append(order_id)
                return {"charged": order_id}

            async with AsyncOrchestrator(database_url) as aorch:
                async with aorch.session("ticket-3") as run:
                    first = [await charge(key) for key in KEYS]
                async with aorch.session("ticket-3") as run:
                    again = [await charge(key) for key in KEYS]
                assert (run.executed, run.replayed) == (0, 2)
                return [first, again]

    first, again = asyncio.run(main())
    assert first == again == [{"charged": key} for key in KEYS]
    assert made == list(KEYS)
