"""Group commit: the transitions of sagas driven at once (on one asyncio loop, or by
threads of the sync door) that are ready at the same moment are written in one statement
(saga.write_sagas_v1) and one commit, each saga fenced on its own row, with the same rows
and events as one by one."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

import psycopg
from async_support import SHAPES, Calls, event_rows, operation_rows
from faults.proxy import LostReplyProxy
from support import Order, order_saga

from saga import AsyncOrchestrator, LeaseLost, Orchestrator, Saga, SagaState, StepContext
from saga._core import inputs
from saga._core.planner import Invoke, Next, Planner, Write
from saga._drivers.driver import Runner

HANG_SECONDS = 60.0


def test_gathered_sagas_of_every_shape_write_what_they_write_one_by_one(
    database_url: str,
) -> None:
    """Four copies of each saga shape the suite has (retries, compensation, unknown
    outcomes, reconcile, a park, a timeout), gathered in one loop so that their writes
    share statements: each ends as the same saga driven alone by the sync door, with the
    same operations, audit trail and calls, and writes did go out together."""
    calls, sagas, reference = _driven_alone(database_url)
    copies = [(shape, f"{shape}-{n}") for shape in sagas for n in range(4)]

    async def main() -> tuple[list[SagaState], list[list[Any]], int, int]:
        async with AsyncOrchestrator(database_url, sagas=list(sagas.values())) as orch:
            states = await asyncio.wait_for(
                asyncio.gather(
                    *(orch.execute(sagas[shape], Order(order_id=key)) for shape, key in copies)
                ),
                HANG_SECONDS,
            )
            histories = [await orch.history(s.id) for s in states]
            group = (await orch.store()).group
            return states, histories, group.largest, group.batches

    states, histories, largest, batches = asyncio.run(main())
    _as_alone(calls, reference, copies, states, histories)
    assert largest >= 2, "no two transitions were ever written together"
    assert batches < sum(len(h) for h in histories)


Reference = dict[str, tuple[SagaState, list[Any]]]


def _driven_alone(database_url: str) -> tuple[Calls, dict[str, Saga[Order]], Reference]:
    """Every saga shape, and one saga of each driven alone by the sync door: its final
    state and audit trail, by shape."""
    calls = Calls()
    sagas = {shape: factory(calls) for shape, (factory, _) in SHAPES.items()}
    reference: Reference = {}
    with Orchestrator(database_url, sagas=list(sagas.values())) as orch:
        for shape, saga in sagas.items():
            state = orch.execute(saga, Order(order_id=f"{shape}-alone"))
            reference[shape] = (state, orch.history(state.id))
    return calls, sagas, reference


def _as_alone(
    calls: Calls,
    reference: Reference,
    copies: list[tuple[str, str]],
    states: list[SagaState],
    histories: list[list[Any]],
) -> None:
    """Each copy ended as its shape's saga driven alone: status, operations, audit trail
    and calls."""
    for (shape, key), state, history in zip(copies, states, histories, strict=True):
        alone, alone_history = reference[shape]
        assert state.status == SHAPES[shape][1], (key, state.error)
        assert operation_rows(state) == operation_rows(alone), key
        assert event_rows(history, key) == event_rows(alone_history, f"{shape}-alone"), key
        assert calls.sequence(key) == calls.sequence(f"{shape}-alone"), key


def _steal(url: str, saga_id: str) -> None:
    """Another worker takes the saga over: a new fence and owner on its row."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "UPDATE saga.sagas SET fence = fence + 1, lease_owner = 'thief' WHERE id = %s",
            (saga_id,),
        )


def test_a_lost_lease_fails_its_own_write_and_not_the_others_in_the_statement(
    database_url: str,
) -> None:
    """Two claimed sagas record their first step's success in one statement; one of them
    was taken over meanwhile. Its write is refused with LeaseLost and leaves nothing; the
    other's commits."""
    saga = order_saga("grouped")

    @saga.step
    async def reserve(ctx: StepContext, o: Order) -> dict[str, Any]:
        return {}

    @saga.step
    async def ship(ctx: StepContext, o: Order) -> dict[str, Any]:
        return {}

    async def main() -> tuple[list[Any], int, dict[str, str]]:
        async with AsyncOrchestrator(database_url, sagas=[saga]) as orch:
            ids = {}
            for order_id in ("kept", "stolen"):
                ids[order_id] = (await orch.start(saga, Order(order_id=order_id))).id
            runner = await orch.runner()
            claimed = [await runner.claim_next(["grouped:1"], orch.definition) for _ in ids]
            await asyncio.to_thread(_steal, database_url, ids["stolen"])
            writes = _reserve_recorded(claimed, ids, orch.owner)
            store = await orch.store()
            results = await asyncio.gather(
                *(
                    store.apply_transition(
                        writes[name],
                        owner=orch.owner,
                        lease_seconds=orch.lease_seconds,
                        token=tokens[name],
                    )
                    for name in ("kept", "stolen")
                ),
                return_exceptions=True,
            )
            return results, store.group.largest, ids

    tokens = {name: str(uuid.uuid4()) for name in ("kept", "stolen")}
    results, largest, ids = asyncio.run(main())
    assert largest == 2
    assert not isinstance(results[0], BaseException)
    assert isinstance(results[1], LeaseLost)
    _only_the_stolen_write_was_refused(database_url, saga, ids, tokens)


def _reserve_recorded(
    claimed: list[tuple[Planner, Next] | None], ids: dict[str, str], owner: str
) -> dict[str, Write]:
    """The write that records `reserve`'s success, for each claimed saga (by name)."""
    planners = {}
    for found in claimed:
        assert found is not None
        planner, nxt = found
        assert isinstance(nxt, Invoke) and nxt.op.step == "reserve"
        planners[planner.saga.id] = planner
    now = datetime.now(UTC)
    writes = {}
    for name, saga_id in ids.items():
        planner = planners[saga_id]
        inputs.apply(planner, inputs.Returned("reserve", "action", {}), now)
        writes[name] = planner.write(planner.advance(now), owner=owner)
    return writes


def _only_the_stolen_write_was_refused(
    database_url: str, saga: Saga[Order], ids: dict[str, str], tokens: dict[str, str]
) -> None:
    """Every saga's write but "stolen"'s landed (its token is the saga's); the stolen
    saga's left nothing, and its lease is still the thief's."""
    with Orchestrator(database_url, sagas=[saga]) as orch:
        kept, stolen = orch.get(ids["kept"]), orch.get(ids["stolen"])
        assert kept.operation("reserve").status == "succeeded"
        assert kept.operation("ship").status == "running"
        assert stolen.operation("reserve").status == "running"
        assert stolen.lease_owner == "thief"
        assert "attempt_succeeded" not in [e.event for e in orch.history(ids["stolen"])]
    with psycopg.connect(database_url) as conn:
        written = dict(
            conn.execute(
                "SELECT id::text, write_token::text FROM saga.sagas WHERE id = ANY(%s::uuid[])",
                (list(ids.values()),),
            ).fetchall()
        )
    for name, saga_id in ids.items():
        assert (written[saga_id] == tokens[name]) == (name != "stolen"), name


def test_a_statement_whose_reply_was_lost_is_found_landed_by_each_saga(
    database_url: str,
) -> None:
    """The replies of grouped writes are lost after their commit (the connection drops):
    every saga of the statement finds its own write landed, by its token, and goes on;
    no step runs twice and nothing is left unknown."""
    calls = Calls()
    saga = order_saga("grouped_lost")

    @saga.step
    async def reserve(ctx: StepContext, o: Order) -> dict[str, Any]:
        calls.hit(o, "reserve")
        return {}

    @saga.step
    async def charge(ctx: StepContext, o: Order) -> dict[str, Any]:
        calls.hit(o, "charge")
        return {}

    @saga.step
    async def ship(ctx: StepContext, o: Order) -> dict[str, Any]:
        calls.hit(o, "ship")
        return {}

    keys = [f"o-{n}" for n in range(8)]

    async def main(url: str) -> list[SagaState]:
        async with AsyncOrchestrator(url, sagas=[saga]) as orch:
            return await asyncio.wait_for(
                asyncio.gather(*(orch.execute(saga, Order(order_id=k)) for k in keys)),
                HANG_SECONDS,
            )

    with LostReplyProxy(database_url) as proxy:
        proxy.lose_reply("write_sagas_v1", times=3)
        states = asyncio.run(main(proxy.url))
        lost = proxy.lost_replies("write_sagas_v1")
    assert lost, "no grouped write lost its reply"
    _each_once_and_none_unknown(database_url, saga, calls, keys, states)


def _each_once_and_none_unknown(
    database_url: str, saga: Saga[Order], calls: Calls, keys: list[str], states: list[SagaState]
) -> None:
    """Every saga completed, each of its steps called once, and no attempt was ever taken
    for unknown."""
    assert [s.status for s in states] == ["completed"] * len(keys)
    for key in keys:
        assert calls.of(key) == {"reserve": 1, "charge": 1, "ship": 1}
    with Orchestrator(database_url, sagas=[saga]) as orch:
        for state in states:
            assert not [e for e in orch.history(state.id) if "unknown" in e.event], state.id


# ----- the sync door: threads ---------------------------------------------------------------


def test_threads_driving_sagas_of_every_shape_write_what_they_write_one_by_one(
    database_url: str,
) -> None:
    """Four copies of each saga shape, driven by eight threads of one sync Orchestrator so
    that their writes share statements: each ends as the same saga driven alone, with the
    same operations, audit trail and calls, and writes did go out together."""
    calls, sagas, reference = _driven_alone(database_url)
    copies = [(shape, f"{shape}-{n}") for shape in sagas for n in range(4)]
    with Orchestrator(database_url, sagas=list(sagas.values()), pool_size=24) as orch:
        with ThreadPoolExecutor(max_workers=8) as pool:
            running = [
                pool.submit(orch.execute, sagas[shape], Order(order_id=key))
                for shape, key in copies
            ]
            states = [future.result(timeout=HANG_SECONDS) for future in running]
        histories = [orch.history(s.id) for s in states]
        group = orch.store.group
        largest, batches = group.largest, group.batches
    _as_alone(calls, reference, copies, states, histories)
    assert largest >= 2, "no two transitions were ever written together"
    assert batches < sum(len(h) for h in histories)


def test_a_lost_lease_fails_its_own_write_and_not_the_others_in_a_threads_batch(
    database_url: str,
) -> None:
    """Two claimed sagas record their first step's success from two threads, queued
    behind a third saga's write held on the wire (its row locked by another transaction),
    so that the two leave in one statement; one of them was taken over meanwhile. Its
    write is refused with LeaseLost and leaves nothing; the other's commits."""
    saga = order_saga("grouped_sync")

    @saga.step
    def reserve(ctx: StepContext, o: Order) -> dict[str, Any]:
        return {}

    @saga.step
    def ship(ctx: StepContext, o: Order) -> dict[str, Any]:
        return {}

    names = ("held", "kept", "stolen")
    tokens = {name: str(uuid.uuid4()) for name in names}
    with Orchestrator(database_url, sagas=[saga], pool_size=12) as orch:
        ids = {name: orch.start(saga, Order(order_id=name)).id for name in names}
        runner = Runner(orch.store, orch.runner_options(), keeper=orch.lease_keeper)
        claimed = [runner.claim_next(["grouped_sync:1"], orch.definition) for _ in names]
        _steal(database_url, ids["stolen"])
        writes = _reserve_recorded(claimed, ids, orch.owner)
        store = orch.store
        results: dict[str, Any] = {}

        def apply(name: str) -> None:
            try:
                results[name] = store.apply_transition(
                    writes[name],
                    owner=orch.owner,
                    lease_seconds=orch.lease_seconds,
                    token=tokens[name],
                )
            except Exception as exc:
                results[name] = exc

        threads = {name: threading.Thread(target=apply, args=(name,)) for name in names}
        with psycopg.connect(database_url) as lock:
            lock.execute("SELECT 1 FROM saga.sagas WHERE id = %s FOR UPDATE", (ids["held"],))
            threads["held"].start()
            _until(lambda: store.group.batches == 1)  # "held" is on the wire, waiting
            for name in ("kept", "stolen"):
                threads[name].start()
            _until(lambda: len(store.group._queue) == 2)
        for thread in threads.values():
            thread.join(HANG_SECONDS)
        assert (store.group.batches, store.group.largest) == (2, 2)
        assert not isinstance(results["held"], BaseException)
        assert not isinstance(results["kept"], BaseException)
        assert isinstance(results["stolen"], LeaseLost)
    _only_the_stolen_write_was_refused(database_url, saga, ids, tokens)


def test_a_threads_statement_whose_reply_was_lost_is_found_landed_by_each_saga(
    database_url: str,
) -> None:
    """Eight threads of one sync Orchestrator: the replies of grouped writes are lost after
    their commit; every saga of the statement finds its own write landed, by its token,
    and goes on; no step runs twice and nothing is left unknown."""
    calls = Calls()
    saga = order_saga("grouped_lost_sync")
    for step in ("reserve", "charge", "ship"):

        def call(ctx: StepContext, o: Order, step: str = step) -> dict[str, Any]:
            calls.hit(o, step)
            return {}

        saga.step(name=step)(call)

    keys = [f"o-{n}" for n in range(16)]
    with LostReplyProxy(database_url) as proxy:
        proxy.lose_reply("write_sagas_v1", times=3)
        with (
            Orchestrator(proxy.url, sagas=[saga], pool_size=24) as orch,
            ThreadPoolExecutor(max_workers=8) as pool,
        ):
            running = [pool.submit(orch.execute, saga, Order(order_id=k)) for k in keys]
            states = [future.result(timeout=HANG_SECONDS) for future in running]
        lost = proxy.lost_replies("write_sagas_v1")
    assert lost, "no grouped write lost its reply"
    _each_once_and_none_unknown(database_url, saga, calls, keys, states)


def _until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + HANG_SECONDS
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)
