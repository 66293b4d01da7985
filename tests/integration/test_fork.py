"""Fork from a step: a saga no worker holds, going forward, is continued by a new saga
that inherits the results of the steps before the fork point without calling them, runs
the rest under keys of its own, and owns every effect from then on. What could run an
effect twice, or leave one to nobody, is refused and changes nothing."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest
from faults.proxy import LostReplyProxy
from support import Order, order_saga, scalar

from saga import (
    AsyncOrchestrator,
    Orchestrator,
    PermanentError,
    Saga,
    SagaNotFound,
    SagaStatus,
    StepContext,
    StepStateError,
)


class Shop:
    """Step code for a reserve / charge / ship saga; what ship does is set per test."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.ship = "unknown"  # unknown (RuntimeError) | permanent | ok

    def saga(self, name: str = "forks") -> Saga[Order]:
        saga = order_saga(name)

        @saga.step
        def reserve(ctx: StepContext, o: Order) -> dict[str, Any]:
            self.calls.append("reserve")
            return {"sku": "x", "key": ctx.idempotency_key}

        @reserve.compensation
        def release(ctx: StepContext, o: Order, result: Any) -> None:
            self.calls.append("release")

        @saga.step
        def charge(ctx: StepContext, o: Order) -> dict[str, Any]:
            self.calls.append("charge")
            return {"charge_id": f"ch-{o.order_id}"}

        @charge.compensation
        def refund(ctx: StepContext, o: Order, result: Any) -> None:
            self.calls.append(f"refund {result['charge_id']}")

        @saga.step
        def ship(ctx: StepContext, o: Order) -> dict[str, Any]:
            self.calls.append("ship")
            if self.ship == "unknown":
                raise RuntimeError("carrier timed out")
            if self.ship == "permanent":
                raise PermanentError("no carrier")
            return {"tracking": "t-1"}

        return saga


def _parked_then_resolved(orch: Orchestrator, shop: Shop, saga: Saga[Order], order: str) -> str:
    """A saga parked at ship (outcome unknown), which an operator resolves as failed."""
    state = orch.execute(saga, Order(order_id=order))
    assert state.status == "needs_review"
    orch.resolve(state.id, "ship", outcome="failed", actor="ops", reason="carrier: no parcel")
    return state.id


def _sagas(url: str) -> int:
    return int(scalar(url, "SELECT count(*) FROM saga.sagas"))


def test_a_fork_runs_from_its_step_on_and_inherits_what_came_before(
    database_url: str,
) -> None:
    shop = Shop()
    saga = shop.saga()
    with Orchestrator(database_url, sagas=[saga]) as orch:
        source_id = _parked_then_resolved(orch, shop, saga, "o-1")
        source = orch.get(source_id)
        shop.calls.clear()
        shop.ship = "ok"

        handle = orch.fork(source_id, "ship", actor="ops@acme")
        assert handle.created and handle.key == "o-1:fork:ship"
        assert orch.get(handle.id).status == "pending"
        done = orch.run(handle.id)

        assert done.status == "completed"
        assert shop.calls == ["ship"]  # the inherited steps are not called again
        assert done.forked_from == source_id and done.forked_to is None
        for step in ("reserve", "charge"):
            inherited, original = done.operation(step), source.operation(step)
            assert inherited.status == "succeeded"
            assert inherited.result == original.result
            assert inherited.attempts == original.attempts
        # The steps the fork runs have keys of its own, never the source's.
        assert done.operation("ship").idempotency_key != source.operation("ship").idempotency_key
        assert done.operation("ship").result == {"tracking": "t-1"}

        after = orch.get(source_id)
        assert after.status == SagaStatus.FORKED and after.status.is_terminal
        assert after.forked_to == handle.id
        assert f"forked to {handle.id} from step 'ship'" in (after.error or "")
        forked = [e for e in orch.history(source_id) if e.event == "saga_forked"]
        assert [e.detail for e in forked] == [
            {
                "to": handle.id,
                "from_step": "ship",
                "actor": "ops@acme",
                "inherited": ["reserve", "charge"],
            }
        ]
        started = [e.event for e in orch.history(handle.id)][:2]
        assert started == ["saga_started", "saga_forked_from"]


def test_the_fork_owns_the_inherited_effects_and_the_source_refuses_every_verb(
    database_url: str,
) -> None:
    """A fork that fails for good compensates the inherited steps too, in reverse and
    once; the source, final, refuses compensate, retry, cancel and resolve, naming the
    fork, so nothing is undone twice."""
    shop = Shop()
    saga = shop.saga()
    with Orchestrator(database_url, sagas=[saga]) as orch:
        source_id = _parked_then_resolved(orch, shop, saga, "o-2")
        shop.calls.clear()
        shop.ship = "permanent"
        fork = orch.fork(source_id, "ship")
        done = orch.run(fork.id)
        assert done.status == "compensated"
        assert shop.calls == ["ship", "refund ch-o-2", "release"]

        before = orch.get(source_id)
        history = len(orch.history(source_id))
        for verb in (
            lambda: orch.compensate(source_id, actor="ops"),
            lambda: orch.retry(source_id, actor="ops"),
            lambda: orch.cancel(source_id, reason="no", actor="ops"),
            lambda: orch.resolve(source_id, "ship", outcome="failed", actor="ops"),
        ):
            with pytest.raises(StepStateError, match=f"was forked to {fork.id}"):
                verb()
        assert orch.get(source_id) == before
        assert len(orch.history(source_id)) == history
        assert shop.calls == ["ship", "refund ch-o-2", "release"]


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("from_succeeded_step", "step 'charge' succeeded: a fork from 'charge' would run it"),
        ("from_unknown_step", "'ship' has an unknown outcome: its effect may be in place"),
        ("no_such_step", "has no step 'pack'; its steps: reserve, charge, ship"),
        ("completed", "is completed: only a saga going forward"),
        ("compensated", "is compensated: only a saga going forward"),
        ("key_taken", "is taken by saga"),
    ],
)
def test_what_could_run_an_effect_twice_is_refused_and_changes_nothing(
    database_url: str, case: str, message: str
) -> None:
    shop = Shop()
    saga = shop.saga()
    with Orchestrator(database_url, sagas=[saga]) as orch:
        from_step, key = "ship", None
        if case in ("completed", "compensated"):
            shop.ship = "ok" if case == "completed" else "permanent"
            saga_id = orch.execute(saga, Order(order_id="o-3")).id
        elif case == "from_unknown_step":
            saga_id = orch.execute(saga, Order(order_id="o-3")).id  # parked, ship unknown
        else:
            saga_id = _parked_then_resolved(orch, shop, saga, "o-3")
            if case == "from_succeeded_step":
                from_step = "charge"
            elif case == "no_such_step":
                from_step = "pack"
            else:
                key = "o-other"
                orch.start(saga, Order(order_id="o-other"))
        before, history, count = orch.get(saga_id), orch.history(saga_id), _sagas(database_url)
        with pytest.raises(StepStateError, match=message):
            orch.fork(saga_id, from_step, key=key)
        assert orch.get(saga_id) == before
        assert orch.history(saga_id) == history
        assert _sagas(database_url) == count


def test_asking_for_the_fork_again_returns_it_and_another_key_is_refused(
    database_url: str,
) -> None:
    shop = Shop()
    saga = shop.saga()
    with Orchestrator(database_url, sagas=[saga]) as orch:
        source_id = _parked_then_resolved(orch, shop, saga, "o-4")
        first = orch.fork(source_id, "ship", key="o-4-again")
        again = orch.fork(source_id, "ship", key="o-4-again")
        assert again.id == first.id and first.created and not again.created
        with pytest.raises(StepStateError, match=f"already forked to {first.id} from step 'ship'"):
            orch.fork(source_id, "ship", key="o-4-third")
        with pytest.raises(StepStateError, match=f"already forked to {first.id} from step 'ship'"):
            orch.fork(source_id, "charge", key="o-4-again")
        assert _sagas(database_url) == 2


def test_a_forked_saga_is_purged_after_the_retention_period_like_a_finished_one(
    database_url: str,
) -> None:
    shop = Shop()
    saga = shop.saga()
    with Orchestrator(database_url, sagas=[saga]) as orch:
        source_id = _parked_then_resolved(orch, shop, saga, "o-7")
        shop.ship = "ok"
        fork = orch.fork(source_id, "ship")
        assert orch.run(fork.id).status == "completed"
        assert orch.get(source_id).finished_at is not None
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute("UPDATE saga.sagas SET finished_at = finished_at - interval '31 days'")
        assert orch.purge() == 2  # the default retention is 30 days
        with pytest.raises(SagaNotFound):
            orch.fork(source_id, "ship")


def test_a_fork_whose_commit_reply_was_lost_is_found_landed_once(database_url: str) -> None:
    """The fork's transaction commits and the connection drops before its reply: the
    retry finds the fork by its token and returns it; there is one fork, not two."""
    shop = Shop()
    saga = shop.saga()
    with Orchestrator(database_url, sagas=[saga]) as orch:
        source_id = _parked_then_resolved(orch, shop, saga, "o-5")
    with LostReplyProxy(database_url) as proxy, Orchestrator(proxy.url, sagas=[saga]) as orch:
        orch.get(source_id)  # connected, migrated: the next COMMIT is the fork's
        proxy.lose_reply("COMMIT")
        handle = orch.fork(source_id, "ship")
        assert proxy.lost_replies("COMMIT")
        assert orch.get(source_id).forked_to == handle.id
    assert _sagas(database_url) == 2


def test_the_asyncio_door_forks_alike(database_url: str) -> None:
    shop = Shop()
    saga = shop.saga()
    with Orchestrator(database_url, sagas=[saga]) as orch:
        source_id = _parked_then_resolved(orch, shop, saga, "o-6")
    shop.calls.clear()
    shop.ship = "ok"

    async def main() -> tuple[str, str, str | None]:
        async with AsyncOrchestrator(database_url, sagas=[saga]) as orch:
            handle = await orch.fork(source_id, "ship", actor="ops")
            done = await orch.run(handle.id)
            with pytest.raises(StepStateError, match="was forked to"):
                await orch.compensate(source_id, actor="ops")
            return done.status, (await orch.get(source_id)).status, done.forked_from

    status, source_status, forked_from = asyncio.run(main())
    assert (status, source_status, forked_from) == ("completed", "forked", source_id)
    assert shop.calls == ["ship"]
