"""Group commit: the transitions of sagas driven at once (on one asyncio loop, or by
threads of the sync door) that are ready at the same moment are written in one statement
(saga.write_sagas_v2) and one commit, each saga fenced on its own row, with the same rows
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
import psycopg.sql
from async_support import SHAPES, Calls, event_rows, operation_rows
from faults.proxy import LostReplyProxy
from psycopg.types.json import Jsonb
from support import Order, order_saga

from saga import AsyncOrchestrator, LeaseLost, Orchestrator, Saga, SagaState, StepContext
from saga._core import inputs
from saga._core.planner import Invoke, Next, Planner, Write
from saga._db._store_base import write_params, writes_of
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
        proxy.lose_reply("write_sagas_v2", times=3)
        states = asyncio.run(main(proxy.url))
        lost = proxy.lost_replies("write_sagas_v2")
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
        proxy.lose_reply("write_sagas_v2", times=3)
        with (
            Orchestrator(proxy.url, sagas=[saga], pool_size=24) as orch,
            ThreadPoolExecutor(max_workers=8) as pool,
        ):
            running = [pool.submit(orch.execute, saga, Order(order_id=k)) for k in keys]
            states = [future.result(timeout=HANG_SECONDS) for future in running]
        lost = proxy.lost_replies("write_sagas_v2")
    assert lost, "no grouped write lost its reply"
    _each_once_and_none_unknown(database_url, saga, calls, keys, states)


def _until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + HANG_SECONDS
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


# ----- the set-based statement (saga.write_sagas_v2) against the write-by-write one ----------

# What differs between two transactions applying the same writes: the clock (now() of the
# saga and operation rows, clock_timestamp() of the events) and the events' ids.
_CLOCK_KEYS = ("updated_at", "lease_expires_at", "finished_at")
WriteArgs = dict[str, dict[str, Any]]


def _set_writes_saga() -> Saga[Order]:
    saga = order_saga("set_writes")

    @saga.step
    def reserve(ctx: StepContext, o: Order) -> dict[str, Any]:
        return {}

    @saga.step
    def ship(ctx: StepContext, o: Order) -> dict[str, Any]:
        return {}

    return saga


def _claimed_writes(
    database_url: str, names: tuple[str, ...], check: Callable[[WriteArgs, dict[str, str]], None]
) -> None:
    """Sagas started and claimed by one owner, one per name, and for each the argument of
    saga.write_saga_v4 that records its first step's success (new and changed operations
    and events), each with a token of its own: `check(writes, ids)` runs while the owner
    still holds every lease."""
    saga = _set_writes_saga()
    with Orchestrator(database_url, sagas=[saga], pool_size=4) as orch:
        ids = {name: orch.start(saga, Order(order_id=name)).id for name in names}
        runner = Runner(orch.store, orch.runner_options(), keeper=orch.lease_keeper)
        claimed = [runner.claim_next(["set_writes:1"], orch.definition) for _ in names]
        writes = _reserve_recorded(claimed, ids, orch.owner)
        args = {
            name: dict(
                write_params(
                    writes[name],
                    owner=orch.owner,
                    lease_seconds=orch.lease_seconds,
                    token=str(uuid.uuid4()),
                ).obj
            )
            for name in names
        }
        check(args, ids)


def _applied(
    database_url: str, function: str, batch: list[dict[str, Any]], ids: list[str]
) -> tuple[list[Any], dict[str, int], dict[str, list[Any]]]:
    """`function` (write_sagas_v1 or write_sagas_v2) applied to `batch` in a transaction
    that is rolled back: its answers, the calls of the write functions it made (counted
    by PostgreSQL for this transaction), and the rows it left on `ids`' sagas, their
    operations and events, with what the clock set left out."""
    with psycopg.connect(database_url) as conn:
        conn.execute("SET LOCAL track_functions = 'pl'")
        query = psycopg.sql.SQL("SELECT saga.{}(saga.hashed_under(2, %s::jsonb))").format(
            psycopg.sql.Identifier(function)
        )
        row = conn.execute(query, (writes_of([Jsonb(w) for w in batch]),)).fetchone()
        assert row is not None
        calls = dict(
            conn.execute(
                "SELECT funcname, calls FROM pg_stat_xact_user_functions"
                " WHERE schemaname = 'saga' AND funcname LIKE 'write\\_saga%%'"
            ).fetchall()
        )
        masks = list(_CLOCK_KEYS)
        rows = {
            "sagas": _column(
                conn,
                "SELECT to_jsonb(s) - %s::text[] FROM saga.sagas AS s"
                " WHERE s.id = ANY(%s::uuid[]) ORDER BY s.id",
                (masks, ids),
            ),
            "operations": _column(
                conn,
                "SELECT to_jsonb(o) - %s::text[] FROM saga.operations AS o"
                " WHERE o.saga_id = ANY(%s::uuid[]) ORDER BY o.saga_id, o.kind, o.step",
                (masks, ids),
            ),
            # Each saga's audit trail in the order of its ids.
            "events": _column(
                conn,
                "SELECT to_jsonb(e) - 'id' - 'at' FROM saga.events AS e"
                " WHERE e.saga_id = ANY(%s::uuid[]) ORDER BY e.saga_id, e.id",
                (ids,),
            ),
            # The whole batch's events in the order of their ids.
            "events_by_id": _column(
                conn,
                "SELECT e.saga_id::text || ' ' || e.event FROM saga.events AS e"
                " WHERE e.saga_id = ANY(%s::uuid[]) AND e.id > %s ORDER BY e.id",
                (ids, _events_before(conn)),
            ),
        }
        conn.rollback()
    return [_unclocked(answer) for answer in row[0]], calls, rows


def _events_before(conn: psycopg.Connection[Any]) -> int:
    """The largest event id committed before this transaction's writes: the events the
    transaction wrote are those above it (its own are not visible to another backend, so
    the highest committed id is read from outside)."""
    url = conn.info.dsn
    with psycopg.connect(url) as other:
        row = other.execute("SELECT COALESCE(max(id), 0) FROM saga.events").fetchone()
    assert row is not None
    return int(row[0])


def _column(conn: psycopg.Connection[Any], query: str, params: tuple[Any, ...]) -> list[Any]:
    return [row[0] for row in conn.execute(query.encode(), params).fetchall()]


def _unclocked(answer: dict[str, Any]) -> dict[str, Any]:
    """An answer with what the clock set left out of the state it carries."""
    state = answer.get("state")
    if not state:
        return answer
    return {
        "state": {
            "saga": {k: v for k, v in state["saga"].items() if k not in _CLOCK_KEYS},
            "operations": [
                {k: v for k, v in op.items() if k not in _CLOCK_KEYS} for op in state["operations"]
            ],
        }
    }


def _as_v1(
    database_url: str, batch: list[dict[str, Any]], ids: dict[str, str]
) -> tuple[list[Any], dict[str, int], dict[str, list[Any]]]:
    """The batch applied by write_sagas_v2 answers and writes what write_sagas_v1 answers
    and writes for it; v2's answers, function calls and rows."""
    saga_ids = sorted(ids.values())
    answers, calls, rows = _applied(database_url, "write_sagas_v2", batch, saga_ids)
    v1_answers, _, v1_rows = _applied(database_url, "write_sagas_v1", batch, saga_ids)
    assert answers == v1_answers
    assert rows["sagas"] == v1_rows["sagas"]
    assert rows["operations"] == v1_rows["operations"]
    assert rows["events"] == v1_rows["events"]
    return answers, calls, rows


def test_a_batch_of_ordinary_writes_is_applied_as_a_set_as_v1_applies_it(
    database_url: str,
) -> None:
    """Four sagas' writes, one of them by an owner whose lease was taken over, two asking
    for their state and one for a notification: write_sagas_v2 answers and writes exactly
    what write_sagas_v1 does (the refused write's SG001 and message included, its rows
    left as they were), events in batch order then in each write's order, without calling
    saga.write_saga_v4 for any of them."""
    names = ("first", "stolen", "second", "third")

    def check(writes: WriteArgs, ids: dict[str, str]) -> None:
        _steal(database_url, ids["stolen"])
        writes["first"]["return_state"] = True
        writes["third"]["return_state"] = True
        writes["second"]["notify"] = "set_writes:1"
        batch = [writes[name] for name in names]
        answers, calls, rows = _as_v1(database_url, batch, ids)
        assert calls == {"write_sagas_v2": 1}, calls  # no write_saga_v4, no fallback to v1
        first, stolen, second, third = answers
        assert stolen["sqlstate"] == "SG001"
        assert stolen["message"] == (
            f"lease of saga {ids['stolen']} (fence {writes['stolen']['fence']}) is no"
            f" longer held by {writes['stolen']['owner']}"
        )
        assert second == {"state": None}
        for name, answer in (("first", first), ("third", third)):
            assert answer["state"]["saga"]["id"] == ids[name]
            assert answer["state"]["saga"]["write_token"] == writes[name]["token"]
            assert [op["step"] for op in answer["state"]["operations"]] == ["reserve", "ship"]
        written = [ids[name] for name in names if name != "stolen"]
        order = [line.split()[0] for line in rows["events_by_id"]]
        assert order == sorted(order, key=written.index), rows["events_by_id"]
        assert len(set(order)) == 3

    _claimed_writes(database_url, names, check)


def test_the_state_a_set_write_returns_is_the_state_write_saga_v4_returns(
    database_url: str,
) -> None:
    """The state a write asks for, from the set statement and from saga.write_saga_v4
    called alone: the same object."""

    def check(writes: WriteArgs, ids: dict[str, str]) -> None:
        write = dict(writes["alone"], return_state=True)
        answers, calls, _ = _applied(database_url, "write_sagas_v2", [write], [ids["alone"]])
        assert calls == {"write_sagas_v2": 1}
        with psycopg.connect(database_url) as conn:
            row = conn.execute(
                "SELECT saga.write_saga_v4(saga.hashed_under(2, %s::jsonb) -> 0)",
                (writes_of([Jsonb(write)]),),
            ).fetchone()
            conn.rollback()
        assert row is not None
        assert answers == [_unclocked({"state": row[0]})]

    _claimed_writes(database_url, ("alone",), check)


def test_confirmations_and_a_saga_named_twice_go_write_by_write(database_url: str) -> None:
    """A write asking for a confirmation, one using up a confirmation never approved
    (SG002, refused alone), and two writes of one saga (the second sees the first: its
    token is the one left) are applied by saga.write_saga_v4 one by one, in batch order
    of the answers; the ordinary write beside them as a set. Answers and rows are
    write_sagas_v1's."""
    names = ("plain", "asks", "twice", "consumes")

    def check(writes: WriteArgs, ids: dict[str, str]) -> None:
        writes["asks"]["confirmations"] = [
            {
                "action": "ask",
                "step": "ship",
                "request_hash": "h-ask",
                "preview": {"ship": True},
                "expires_at": "2999-01-01T00:00:00+00:00",
            }
        ]
        writes["consumes"]["confirmations"] = [
            {"action": "consume", "step": "ship", "request_hash": "h-none", "attempt": 1}
        ]
        again = dict(writes["twice"], token=str(uuid.uuid4()))
        batch = [writes["plain"], writes["twice"], writes["asks"], again, writes["consumes"]]
        answers, calls, rows = _as_v1(database_url, batch, ids)
        # Four calls of write_saga_v4; the one that raised is not counted by PostgreSQL.
        assert calls == {"write_sagas_v2": 1, "write_saga_v4": 3}, calls
        assert [a.get("sqlstate") for a in answers] == [None, None, None, None, "SG002"]
        tokens = {row["id"]: row["write_token"] for row in rows["sagas"]}
        assert tokens[ids["twice"]] == again["token"]

    _claimed_writes(database_url, names, check)


def test_a_set_statement_that_raises_falls_back_to_v1_for_the_whole_batch(
    database_url: str,
) -> None:
    """Two sagas' writes, the second with an event that has no name: the set INSERT of the
    events raises, its subtransaction is rolled back, and the batch is applied by
    write_sagas_v1 (the first write lands, the second is refused alone with the not-null
    violation)."""

    def check(writes: WriteArgs, ids: dict[str, str]) -> None:
        writes["other"]["events"][0]["event"] = None
        answers, calls, rows = _as_v1(database_url, [writes["one"], writes["other"]], ids)
        # Two calls of write_saga_v4; the one that raised is not counted by PostgreSQL.
        assert calls == {"write_sagas_v2": 1, "write_sagas_v1": 1, "write_saga_v4": 1}, calls
        assert [a.get("sqlstate") for a in answers] == [None, "23502"]
        tokens = {row["id"]: row["write_token"] for row in rows["sagas"]}
        assert tokens[ids["one"]] == writes["one"]["token"]
        assert tokens[ids["other"]] != writes["other"]["token"]

    _claimed_writes(database_url, ("one", "other"), check)


def test_a_committed_set_write_notifies_and_leaves_its_token(database_url: str) -> None:
    """A batch committed through the store's statement: the write that asks for it sends
    its notification, and each written saga carries its write's token (what a writer
    whose reply was lost reads)."""

    def check(writes: WriteArgs, ids: dict[str, str]) -> None:
        writes["woken"]["notify"] = "set_writes:1"
        with psycopg.connect(database_url, autocommit=True) as listener:
            listener.execute("LISTEN saga_runnable")
            with psycopg.connect(database_url) as conn:
                conn.execute(
                    "SELECT saga.write_sagas_v2(saga.hashed_under(2, %s::jsonb))",
                    (writes_of([Jsonb(writes["quiet"]), Jsonb(writes["woken"])]),),
                )
            heard = [n.payload for n in listener.notifies(timeout=5.0, stop_after=1)]
        assert heard == ["set_writes:1"]
        with psycopg.connect(database_url) as conn:
            tokens = dict(
                conn.execute(
                    "SELECT id::text, write_token::text FROM saga.sagas WHERE id = ANY(%s::uuid[])",
                    (list(ids.values()),),
                ).fetchall()
            )
        assert tokens == {ids[name]: writes[name]["token"] for name in ids}

    _claimed_writes(database_url, ("quiet", "woken"), check)


def test_the_set_writes_are_planned_for_any_batch_and_leave_the_callers_setting(
    database_url: str,
) -> None:
    """saga.write_sagas_v2 runs with generic plans (migration 0027): its statements take the
    batch as arrays, and plans made for each batch's length were made again on most calls,
    which cost a worker's batches of two or three writes more than the set statements
    saved. The setting holds inside the function only: the caller's is as it was."""
    with Orchestrator(database_url):
        pass  # migrated
    with psycopg.connect(database_url) as conn:
        config = conn.execute(
            "SELECT proconfig FROM pg_proc WHERE oid = 'saga.write_sagas_v2(jsonb)'::regprocedure"
        ).fetchone()
        assert config == (["plan_cache_mode=force_generic_plan"],)
        conn.execute("SET plan_cache_mode = force_custom_plan")
        answers = conn.execute("SELECT saga.write_sagas_v2('[]'::jsonb)").fetchone()
        assert answers == ([],)
        assert conn.execute("SHOW plan_cache_mode").fetchone() == ("force_custom_plan",)
