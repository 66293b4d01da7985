"""Fork from a step: a saga no worker holds, going forward, is continued by a new saga
that inherits the results of the steps before the fork point without calling them, runs
the rest under keys of its own, and owns every effect from then on. What could run an
effect twice, or leave one to nobody, is refused and changes nothing."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
import session_fork_app as app
from faults.proxy import LostReplyProxy
from support import Order, order_saga, scalar

from saga import (
    AsyncOrchestrator,
    Orchestrator,
    PermanentError,
    Saga,
    SagaNotFound,
    SagaState,
    SagaStatus,
    SessionParked,
    StepContext,
    StepStateError,
)

HERE = Path(__file__).resolve().parent


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
        (
            "from_succeeded_step",
            "step 'charge' succeeded: a fork from 'charge' would run it again under a new key "
            "and repeat its effect",
        ),
        ("from_unknown_step", "'ship' has an unknown outcome: its effect may be in place"),
        ("no_such_step", "has no step 'pack'; its steps: reserve, charge, ship"),
        # Finished: forked only when no step from the fork point on would repeat an effect.
        ("completed", "step 'ship' succeeded: a fork from 'ship' would run it again"),
        ("compensated", "step 'reserve' before 'ship' was compensated: its effect is undone"),
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


# ----- sessions ---------------------------------------------------------------------------
#
# A session is forked from one of its calls: the fork is a session of the same name and
# tenant under a key of its own, holding the calls made before that one; its code, run
# again under that key, replays them and makes the calls from there on afresh.


@pytest.fixture
def shop() -> Iterator[None]:
    """The order app's call log, empty, and its ship step losing its outcome."""
    app.CALLS.clear()
    app.PLAN["ship"] = "unknown"
    yield
    app.CALLS.clear()


def _session(orch: Orchestrator, run_id: str) -> SagaState:
    (found,) = [s for s in orch.list() if s.key == run_id]
    return orch.get(found.id)


def _call(state: SagaState, step: str, nth: int = 0) -> str:
    """The operation name of the `nth` call of durable step `step` in a session."""
    calls = [op.step for op in state.operations if op.kind == "action"]
    return [c for c in calls if c.startswith(f"{step}.")][nth]


def _parked_session(
    orch: Orchestrator, order: str, amounts: tuple[int, ...] = (4990,), *, resolve: bool = True
) -> tuple[str, str]:
    """(run id, session id) of an order whose ship call lost its outcome, so the session
    parked; with `resolve`, an operator then settles that call as failed."""
    run_id = f"order-{order}-{uuid.uuid4().hex[:8]}"
    with pytest.raises(SessionParked, match="fork_ship"):
        app.place_order(orch, run_id, order, amounts)
    state = _session(orch, run_id)
    assert state.status == "needs_review"
    if resolve:
        orch.resolve(
            state.id, _call(state, "fork_ship"), outcome="failed", actor="ops", reason="no parcel"
        )
    return run_id, state.id


def test_a_session_fork_inherits_the_calls_before_its_point_without_calling_them(
    database_url: str, shop: None
) -> None:
    with Orchestrator(database_url) as orch:
        run_id, source_id = _parked_session(orch, "o-1")
        source = orch.get(source_id)
        reserve, charge, ship = (
            _call(source, s) for s in ("fork_reserve", "fork_charge", "fork_ship")
        )
        app.CALLS.clear()

        # A durable step's plain name names its one call.
        handle = orch.fork(source_id, "fork_ship", actor="ops@acme")
        assert app.CALLS == []  # forking calls nothing
        assert handle.created
        assert (handle.saga, handle.tenant_id, handle.key) == (
            "session/orders",
            "acme",
            f"{run_id}:fork:{ship}",
        )
        fork = orch.get(handle.id)
        assert (fork.status, fork.forked_from, fork.forked_to) == ("pending", source_id, None)
        assert [(op.step, op.kind, op.status) for op in fork.operations] == [
            (reserve, "action", "succeeded"),
            (charge, "action", "succeeded"),
        ]
        for call in (reserve, charge):
            inherited, original = fork.operation(call), source.operation(call)
            assert (inherited.result, inherited.attempts, inherited.request_hash) == (
                original.result,
                original.attempts,
                original.request_hash,
            )
            assert inherited.idempotency_key != original.idempotency_key

        after = orch.get(source_id)
        assert (after.status, after.forked_to) == (SagaStatus.FORKED, handle.id)
        assert f"forked to {handle.id} from call {ship!r}" in (after.error or "")
        forked = [e.detail for e in orch.history(source_id) if e.event == "saga_forked"]
        assert forked == [
            {
                "to": handle.id,
                "from_step": ship,
                "actor": "ops@acme",
                "inherited": [reserve, charge],
            }
        ]
        assert [e.event for e in orch.history(handle.id)] == ["session_started", "saga_forked_from"]

        # The same code under the fork's key replays reserve and charge and ships afresh.
        app.PLAN["ship"] = "ok"
        assert app.place_order(orch, handle.key, "o-1") == (1, 2)
        assert app.CALLS == ["ship o-1"]
        done = orch.get(handle.id)
        assert done.status == "completed"
        assert done.operation(ship).result == {"tracking": "t-o-1"}
        assert done.operation(ship).idempotency_key != source.operation(ship).idempotency_key
        assert app.place_order(orch, handle.key, "o-1") == (0, 3)  # all of it on record now
        assert app.CALLS == ["ship o-1"]


def test_a_session_fork_compensates_the_inherited_calls_with_their_arguments(
    database_url: str, shop: None
) -> None:
    """The fork owns what it inherited: when its code fails for good, the inherited calls
    are compensated in reverse, each with the arguments it was made with; the source,
    final, refuses every verb and names the fork."""
    with Orchestrator(database_url) as orch:
        _, source_id = _parked_session(orch, "o-2")
        fork = orch.fork(source_id, "fork_ship")
        app.CALLS.clear()
        app.PLAN["ship"] = "permanent"
        with pytest.raises(PermanentError, match="no carrier"):
            app.place_order(orch, fork.key, "o-2")
        assert app.CALLS == ["ship o-2", "refund ch-o-2-4990 4990", "release o-2"]
        assert orch.get(fork.id).status == "compensated"

        before, history = orch.get(source_id), len(orch.history(source_id))
        for verb in (
            lambda: orch.compensate(source_id, actor="ops"),
            lambda: orch.cancel(source_id, reason="no", actor="ops"),
        ):
            with pytest.raises(StepStateError, match=f"was forked to {fork.id}"):
                verb()
        assert orch.get(source_id) == before and len(orch.history(source_id)) == history
        assert app.CALLS == ["ship o-2", "refund ch-o-2-4990 4990", "release o-2"]


def test_a_call_that_failed_before_the_fork_point_is_inherited_and_replays_its_failure(
    database_url: str, shop: None
) -> None:
    """The card declines the first amount and the code goes on with another: the fork
    holds the declined call as failed, so its code takes the same path without calling
    anything again."""
    with Orchestrator(database_url) as orch:
        _, source_id = _parked_session(orch, "o-3", (20_000, 4990))
        source = orch.get(source_id)
        declined, charged = _call(source, "fork_charge", 0), _call(source, "fork_charge", 1)
        fork = orch.fork(source_id, "fork_ship")
        state = orch.get(fork.id)
        assert [(op.step, op.status) for op in state.operations] == [
            (_call(source, "fork_reserve"), "succeeded"),
            (declined, "failed"),
            (charged, "succeeded"),
        ]
        assert "card declined for 20000" in (state.operation(declined).error or "")
        app.CALLS.clear()
        app.PLAN["ship"] = "ok"
        assert app.place_order(orch, fork.key, "o-3", (20_000, 4990)) == (1, 2)
        assert app.CALLS == ["ship o-3"]


@pytest.mark.parametrize(
    ("case", "message"),
    [
        (
            "from_succeeded_call",
            r"call 'fork_charge\.[0-9a-f]{12}' succeeded: a fork from 'fork_charge\.[0-9a-f]{12}' "
            r"would run it again under a new key and repeat its effect",
        ),
        (
            "from_unknown_call",
            r"call 'fork_ship\.[0-9a-f]{12}' has an unknown outcome: its effect may be in place",
        ),
        (
            "no_such_call",
            r"has no call 'fork_pack'; its calls: fork_reserve\.[0-9a-f]{12}, "
            r"fork_charge\.[0-9a-f]{12}, fork_ship\.[0-9a-f]{12}$",
        ),
        (
            "ambiguous",
            r"called durable step 'fork_charge' 2 times \(fork_charge\.[0-9a-f]{12}, "
            r"fork_charge\.[0-9a-f]{12}\): fork from one of these calls, by its name",
        ),
        ("completed", r"call 'fork_ship\.[0-9a-f]{12}' succeeded: a fork from 'fork_ship"),
        (
            "compensated",
            r"call 'fork_reserve\.[0-9a-f]{12}' before 'fork_ship\.[0-9a-f]{12}' was compensated",
        ),
        ("key_taken", r"key 'taken' is taken by saga"),
    ],
)
def test_what_could_run_a_call_twice_is_refused_and_changes_nothing(
    database_url: str, shop: None, case: str, message: str
) -> None:
    with Orchestrator(database_url) as orch:
        from_step, key = "fork_ship", None
        if case in ("completed", "compensated"):
            app.PLAN["ship"] = "ok" if case == "completed" else "permanent"
            run_id = f"order-{uuid.uuid4()}"
            with contextlib.suppress(PermanentError):
                app.place_order(orch, run_id, "o-4")
            saga_id = _session(orch, run_id).id
        elif case == "from_unknown_call":
            _, saga_id = _parked_session(orch, "o-4", resolve=False)
        else:
            amounts = (20_000, 4990) if case == "ambiguous" else (4990,)
            _, saga_id = _parked_session(orch, "o-4", amounts)
            if case in ("from_succeeded_call", "ambiguous"):
                from_step = "fork_charge"
            elif case == "no_such_call":
                from_step = "fork_pack"
            elif case == "key_taken":
                key = "taken"
                app.PLAN["ship"] = "ok"
                app.place_order(orch, "taken", "o-other")
        parked = {"from_unknown_call": "needs_review", "completed": "completed"}
        expected = {**parked, "compensated": "compensated"}.get(case, "running")
        assert orch.get(saga_id).status == expected
        before, history, count = orch.get(saga_id), orch.history(saga_id), _sagas(database_url)
        with pytest.raises(StepStateError, match=message):
            orch.fork(saga_id, from_step, key=key)
        assert orch.get(saga_id) == before
        assert orch.history(saga_id) == history
        assert _sagas(database_url) == count


def test_asking_for_a_session_fork_again_returns_it_and_another_is_refused(
    database_url: str, shop: None
) -> None:
    with Orchestrator(database_url) as orch:
        run_id, source_id = _parked_session(orch, "o-5")
        ship = _call(orch.get(source_id), "fork_ship")
        first = orch.fork(source_id, ship)
        # Asked again by the call's name or its step's, with the default key or that key.
        for step, key in ((ship, None), ("fork_ship", None), ("fork_ship", first.key)):
            again = orch.fork(source_id, step, key=key)
            assert (again.id, again.key, again.created) == (first.id, first.key, False)
        already = f"already forked to {first.id} from step {ship!r}"
        for step, key in (("fork_ship", "o-5-other"), ("fork_charge", None), ("fork_pack", None)):
            with pytest.raises(StepStateError, match=already):
                orch.fork(source_id, step, key=key)
        assert _sagas(database_url) == 2
        assert first.key == f"{run_id}:fork:{ship}"


def test_a_session_held_by_a_live_process_is_not_forked(database_url: str, shop: None) -> None:
    """While code is inside the session's block (its lease live), the fork is refused;
    once the block ended the session is closed, and its call took an effect a fork from
    it would repeat."""
    run_id = f"order-{uuid.uuid4()}"
    inside, leave = threading.Event(), threading.Event()
    ids: list[str] = []

    def hold() -> None:
        with (
            Orchestrator(database_url) as holder,
            holder.session(run_id, tenant=app.TENANT, name=app.NAME) as run,
        ):
            app.reserve("o-6")
            ids.append(run.id)
            inside.set()
            leave.wait(30)

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert inside.wait(30)
        with Orchestrator(database_url) as orch:
            before = orch.get(ids[0])
            with pytest.raises(
                StepStateError, match=r"is held by .*: a process is inside its block"
            ):
                orch.fork(ids[0], "fork_reserve")
            assert orch.get(ids[0]) == before
    finally:
        leave.set()
        thread.join(30)
    with Orchestrator(database_url) as orch:
        with pytest.raises(StepStateError, match=r"call 'fork_reserve\.[0-9a-f]+' succeeded"):
            orch.fork(ids[0], "fork_reserve")
        assert _sagas(database_url) == 1


def test_a_session_killed_inside_a_call_is_not_forked_while_that_call_is_unknown(
    database_url: str, shop: None
) -> None:
    """SIGKILL inside charge, after it took effect: once the dead holder's lease ran out,
    a fork from charge is refused (the charge may be in place: it stays `running` until
    settled), and so is one from a later call while charge, inherited, is unknown."""
    run_id = f"order-{uuid.uuid4()}"
    child = subprocess.Popen(
        [sys.executable, str(HERE / "session_fork_app.py"), run_id, "o-7"],
        env={**os.environ, "SAGA_DATABASE_URL": database_url, "SESSION_FORK_APP_HANG": "charge"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert child.stdout is not None
        lines = [child.stdout.readline().strip() for _ in range(2)]
        assert lines == ["READY", "IN_CALL"], lines
    finally:
        child.kill()
        child.wait(30)
        if child.stdout is not None:
            child.stdout.close()
    with Orchestrator(database_url) as orch:
        state = _session(orch, run_id)
        deadline = time.monotonic() + 30
        while state.lease_expires_at is not None and state.lease_expires_at > datetime.now(UTC):
            assert time.monotonic() < deadline, "the killed holder's lease never ran out"
            time.sleep(0.1)
            state = orch.get(state.id)
        charge = _call(state, "fork_charge")
        assert state.operation(charge).status == "running"
        with pytest.raises(
            StepStateError, match=re.escape(f"call {charge!r} has an unknown outcome")
        ):
            orch.fork(state.id, "fork_charge")

        # Resumed by code that goes another way: it ships, and leaves charge unknown.
        app.PLAN["ship"] = "ok"
        parked = pytest.raises(SessionParked, match="unknown")
        with parked, orch.session(run_id, tenant=app.TENANT, name=app.NAME):
            app.ship("o-7")
        state = orch.get(state.id)
        assert (state.status, state.operation(charge).status) == ("needs_review", "unknown")
        history, count = orch.history(state.id), _sagas(database_url)
        unknown_before = re.escape(f"call {charge!r} before ") + (
            r"'fork_ship\.[0-9a-f]{12}' has an unknown outcome: reconcile or resolve it first"
        )
        with pytest.raises(StepStateError, match=unknown_before):
            orch.fork(state.id, "fork_ship")
        assert orch.get(state.id) == state and orch.history(state.id) == history
        assert _sagas(database_url) == count


def test_the_asyncio_door_forks_a_session_alike(database_url: str, shop: None) -> None:
    with Orchestrator(database_url) as orch:
        _, source_id = _parked_session(orch, "o-8")
    app.CALLS.clear()
    app.PLAN["ship"] = "ok"

    async def main() -> tuple[tuple[int, int], str, str, str | None]:
        async with AsyncOrchestrator(database_url) as aorch:
            handle = await aorch.fork(source_id, "fork_ship", actor="ops")
            counts = await app.aplace_order(aorch, handle.key, "o-8")
            with pytest.raises(StepStateError, match=f"was forked to {handle.id}"):
                await aorch.compensate(source_id, actor="ops")
            done = await aorch.get(handle.id)
            return counts, done.status, (await aorch.get(source_id)).status, done.forked_from

    assert asyncio.run(main()) == ((1, 2), "completed", "forked", source_id)
    assert app.CALLS == ["ship o-8"]
