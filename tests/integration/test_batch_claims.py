"""Batch claims: a worker with k idle drivers claims up to k sagas in one statement and one
commit, each with its own lease, fence and first move, and hands one to each driver.

Everything a claim of one saga guarantees holds for each saga of a batch: the oldest
runnable sagas are taken first, only registered kinds are taken, a claim whose reply was
lost strands none of the sagas it took, and one saga whose first write is refused leaves
the others of its batch to be driven.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from faults.proxy import LostReplyProxy
from support import OrchestratorFactory, Order, order_saga, scalar, wait_until
from test_worker import running

from saga import Orchestrator, Saga, StepContext
from saga._drivers.driver import Runner


def _runner(orch: Orchestrator) -> Runner:
    return Runner(orch.store, orch.runner_options(), keeper=orch.lease_keeper)


@pytest.fixture
def calls(database_url: str) -> Iterator[list[tuple[str, str, int]]]:
    """(order id, step, attempt) of every step call, read from the test database."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE step_log (id bigserial, order_id text, step text, attempt int)")

    class Log(list[tuple[str, str, int]]):
        def __iter__(self) -> Iterator[tuple[str, str, int]]:
            with psycopg.connect(database_url) as conn:
                rows = conn.execute(
                    "SELECT order_id, step, attempt FROM step_log ORDER BY id"
                ).fetchall()
            return iter([(str(o), str(s), int(a)) for o, s, a in rows])

    yield Log()


def _two_steps(url: str, name: str) -> Saga[Order]:
    """`reserve` then `charge`, neither idempotent: a spurious unknown parks the saga."""
    saga = order_saga(name)

    def record(ctx: StepContext, order: Order) -> None:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO step_log (order_id, step, attempt) VALUES (%s, %s, %s)",
                (order.order_id, ctx.step, ctx.attempt),
            )

    @saga.step
    def reserve(ctx: StepContext, order: Order) -> dict[str, Any]:
        record(ctx, order)
        return {"reserved": order.order_id}

    @saga.step
    def charge(ctx: StepContext, order: Order) -> dict[str, Any]:
        record(ctx, order)
        return {"charged": order.amount_cents}

    return saga


def _leases(url: str, ids: list[str]) -> list[tuple[str, str | None, int, Any, Any]]:
    """(id, lease owner, fence, updated_at, lease_expires_at) of these sagas, in order."""
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT id::text, lease_owner, fence, updated_at, lease_expires_at"
            " FROM saga.sagas WHERE id = ANY(%s::uuid[])",
            (ids,),
        ).fetchall()
    by_id = {row[0]: row for row in rows}
    return [by_id[saga_id] for saga_id in ids]


def test_a_batch_claim_takes_k_sagas_in_one_commit_and_all_are_driven(
    database_url: str, make_orch: OrchestratorFactory, calls: list[tuple[str, str, int]]
) -> None:
    """Four drivers idle, five sagas queued: one claim takes the four that have waited
    longest, each under its own lease and fence with its first attempt recorded, all in
    one transaction; each is then driven to its end. The fifth is left for the next claim."""
    saga = _two_steps(database_url, "batched")
    orch = make_orch(saga)
    ids = [orch.start(saga, Order(order_id=f"o-{i}")).id for i in range(5)]
    runner = _runner(orch)

    claimed = runner.claim_batch(["batched:1"], orch.definition, 4)

    assert [planner.saga.id for planner, _ in claimed] == ids[:4]
    leases = _leases(database_url, ids)
    assert [owner for _, owner, _, _, _ in leases] == [orch.owner] * 4 + [None]
    assert [fence for _, _, fence, _, _ in leases[:4]] == [1, 1, 1, 1]
    # One transaction: now() (its start) is the same in every row it claimed and wrote.
    assert len({updated for _, _, _, updated, _ in leases[:4]}) == 1
    assert len({expires for _, _, _, _, expires in leases[:4]}) == 1
    for planner, _ in claimed:
        reserve = next(op for op in planner.ops if op.step == "reserve")
        assert (reserve.status, reserve.attempts) == ("running", 1)
    assert list(calls) == []  # nothing is called before the claim committed

    states = [runner.drive(planner, nxt) for planner, nxt in claimed]
    assert [s.status if s else None for s in states] == ["completed"] * 4

    rest = runner.claim_batch(["batched:1"], orch.definition, 4)
    assert [planner.saga.id for planner, _ in rest] == [ids[4]]
    assert runner.drive(*rest[0]) is not None
    assert runner.claim_batch(["batched:1"], orch.definition, 4) == []
    assert sorted(calls) == sorted(
        (f"o-{i}", step, 1) for i in range(5) for step in ("reserve", "charge")
    )


def test_a_worker_fills_its_idle_drivers_with_one_claim(
    database_url: str, make_orch: OrchestratorFactory
) -> None:
    """A worker at concurrency 6 with six sagas queued holds all six after one claim (one
    transaction wrote every lease), and drives them all to completion."""
    saga = order_saga("filled")
    go = threading.Event()

    @saga.step
    def wait_for_go(ctx: StepContext, order: Order) -> dict[str, Any]:
        assert go.wait(20)
        return {}

    orch = make_orch(saga)
    ids = [orch.start(saga, Order(order_id=f"o-{i}")).id for i in range(6)]
    worker = orch.worker(concurrency=6, poll_seconds=0.2)
    with running(worker, until_idle=True) as thread:
        wait_until(lambda: worker.in_flight == 6, timeout=20)
        leases = _leases(database_url, ids)
        assert {owner for _, owner, _, _, _ in leases} == {orch.owner}
        assert len({updated for _, _, _, updated, _ in leases}) == 1
        go.set()
        thread.join(20)
    assert [orch.get(saga_id).status for saga_id in ids] == ["completed"] * 6


def test_a_batch_claim_takes_only_registered_kinds(make_orch: OrchestratorFactory) -> None:
    """Sagas of a (name, version) this worker does not register are passed over, wherever
    they are in the queue."""
    mine, theirs = order_saga("mine"), order_saga("theirs")
    for saga in (mine, theirs):

        @saga.step
        def only(ctx: StepContext, order: Order) -> dict[str, Any]:
            return {}

    starter = make_orch(mine, theirs)
    started = [
        (saga.name, starter.start(saga, Order(order_id=f"o-{i}")).id)
        for i in range(3)
        for saga in (theirs, mine)
    ]
    orch = make_orch(mine)
    claimed = _runner(orch).claim_batch(["mine:1"], orch.definition, 8)
    assert [p.saga.id for p, _ in claimed] == [sid for name, sid in started if name == "mine"]
    for name, saga_id in started:
        if name == "theirs":
            assert orch.get(saga_id).lease_owner is None


def test_a_saga_whose_first_write_is_refused_is_parked_and_the_batch_driven(
    database_url: str, make_orch: OrchestratorFactory, calls: list[tuple[str, str, int]]
) -> None:
    """The first write of one saga of a batch fails in the database: that saga alone is
    parked with the reason; the claims and first moves of the others commit, and they are
    driven to completion."""
    saga = _two_steps(database_url, "refused")
    orch = make_orch(saga)
    ids = [orch.start(saga, Order(order_id=f"o-{i}")).id for i in range(3)]
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$"
            " BEGIN RAISE EXCEPTION 'refused by the test'; END $$"
        )
        conn.execute(
            "CREATE TRIGGER refuse BEFORE UPDATE ON saga.operations FOR EACH ROW"
            f" WHEN (NEW.saga_id = '{ids[1]}' AND NEW.status = 'running') EXECUTE FUNCTION refuse()"
        )
    runner = _runner(orch)
    claimed = runner.claim_batch(["refused:1"], orch.definition, 3)
    assert [planner.saga.id for planner, _ in claimed] == [ids[0], ids[2]]
    parked = orch.get(ids[1])
    assert parked.status == "needs_review"
    assert parked.error is not None and "refused by the test" in parked.error
    assert parked.lease_owner is None
    for planner, nxt in claimed:
        runner.drive(planner, nxt)
    assert [orch.get(i).status for i in (ids[0], ids[2])] == ["completed", "completed"]
    assert all(order_id != "o-1" for order_id, _, _ in calls)


def _buffers_of(conn: psycopg.Connection[Any], query: str, params: tuple[Any, ...]) -> int:
    plan = conn.execute(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {query}", params).fetchone()
    assert plan is not None
    top = plan[0][0]["Plan"]
    return int(top["Shared Hit Blocks"]) + int(top["Shared Read Blocks"])


def test_a_batch_claim_reads_the_head_of_a_long_queue_not_all_of_it(
    make_orch: OrchestratorFactory,
) -> None:
    """With 6,000 sagas queued and stale statistics, a claim of 8 walks the runnable index
    in order and stops at the eighth saga it can lock: the 8 that have waited longest."""
    saga = order_saga("queued")

    @saga.step
    def only(ctx: StepContext, order: Order) -> dict[str, Any]:
        return {}

    orch = make_orch(saga)
    first = orch.start(saga, Order(order_id="first")).id
    with psycopg.connect(orch.database_url, autocommit=True) as conn:
        conn.execute("UPDATE saga.sagas SET run_after = now() - interval '1 day'")
        conn.execute(
            "INSERT INTO saga.sagas (id, name, version, tenant_id, key, input, input_hash,"
            " run_after)"
            " SELECT gen_random_uuid(), 'queued', 1, 't', 'k' || i, '{}', 'h',"
            "        now() - make_interval(secs => 6001 - i)"
            " FROM generate_series(1, 6000) AS i"
        )
        backlog = _buffers_of(
            conn,
            "SELECT count(*) FROM saga.sagas WHERE status = 'pending' AND name = %s",
            ("queued",),
        )
        # A first call in the session reads the catalogs; it claims nothing (no such kind).
        conn.execute("SELECT * FROM saga.claim_batch(%s, 'probe', 10, 8)", (["other:1"],))
        conn.execute("SELECT * FROM saga.claim_next(%s, 'probe', 10)", (["other:1"],))
        # A claim of one, given back: the claim of 8 then takes the same head of the queue.
        one = _buffers_of(conn, "SELECT * FROM saga.claim_next(%s, 'one', 10)", (["queued:1"],))
        conn.execute("UPDATE saga.sagas SET lease_owner = NULL WHERE lease_owner = 'one'")
        claim = _buffers_of(
            conn, "SELECT * FROM saga.claim_batch(%s, 'probe', 10, 8)", (["queued:1"],)
        )
        keys = [
            row[0]
            for row in conn.execute(
                "SELECT CASE WHEN id = %s::uuid THEN 'first' ELSE key END FROM saga.sagas"
                " WHERE lease_owner = 'probe' ORDER BY run_after",
                (first,),
            ).fetchall()
        ]
    assert keys == ["first"] + [f"k{i}" for i in range(1, 8)]
    # Reading the queue costs `backlog` pages (about 160); a claim of 8 what 8 claims of
    # one cost (each reads and writes its saga's heap page and index entries), not more.
    assert claim <= 8 * one, f"a claim of 8 read {claim} buffers, a claim of one {one}"
    assert claim * 2 < backlog, f"a claim of 8 read {claim} buffers with {backlog} pages queued"


@pytest.fixture
def proxy(database_url: str) -> Iterator[LostReplyProxy]:
    with LostReplyProxy(database_url) as made:
        yield made


def _unknown_events(orch: Orchestrator, saga_id: str) -> list[str]:
    return [f"{e.step}#{e.attempt}" for e in orch.history(saga_id) if e.event == "outcome_unknown"]


@pytest.mark.crash
def test_a_batch_claim_whose_reply_was_lost_carries_on_every_saga_it_took(
    database_url: str, proxy: LostReplyProxy, calls: list[tuple[str, str, int]]
) -> None:
    """The commit of a claim of three sagas, which starts each one's first attempt, lands
    and its reply is lost: the retry finds all three by the tokens the claim stored and
    carries each on from the attempt it started; none is called twice, none is left to
    its lease's expiry."""
    saga = _two_steps(database_url, "lost_batch")
    with Orchestrator(database_url, sagas=[saga]) as starter:
        ids = [starter.start(saga, Order(order_id=f"o-{i}")).id for i in range(3)]
    with Orchestrator(proxy.url, sagas=[saga], lease_seconds=30.0) as orch:
        runner = _runner(orch)
        proxy.lose_reply("saga.claim_batch_v2")
        claimed = runner.claim_batch(["lost_batch:1"], orch.definition, 4)
        assert len(proxy.lost_replies()) == 1 and not proxy.lost_replies()[0].failed
        assert sorted(planner.saga.id for planner, _ in claimed) == sorted(ids)
        for planner, nxt in claimed:
            state = runner.drive(planner, nxt)
            assert state is not None and state.status == "completed", state
        for saga_id in ids:
            assert _unknown_events(orch, saga_id) == []
    assert sorted(calls) == sorted(
        (f"o-{i}", step, 1) for i in range(3) for step in ("reserve", "charge")
    )


@pytest.mark.crash
def test_a_worker_batch_claim_whose_reply_was_lost_strands_none(
    database_url: str, proxy: LostReplyProxy, calls: list[tuple[str, str, int]]
) -> None:
    """A worker's batch claim commits and its reply is lost: the worker drives every saga
    it took, each step once, with no unknown outcome, well before any lease expires."""
    saga = _two_steps(database_url, "lost_worker_batch")
    with Orchestrator(database_url, sagas=[saga]) as starter:
        ids = [starter.start(saga, Order(order_id=f"o-{i}")).id for i in range(5)]
    with Orchestrator(proxy.url, sagas=[saga], lease_seconds=60.0) as orch:
        proxy.lose_reply("saga.claim_batch_v2")
        worker = orch.worker(concurrency=8, poll_seconds=0.2)
        with running(worker, until_idle=True) as thread:
            thread.join(30)
            assert not thread.is_alive(), "the worker did not finish"
        assert len(proxy.lost_replies()) == 1
        for saga_id in ids:
            state = orch.get(saga_id)
            assert state.status == "completed", state.error
            assert _unknown_events(orch, saga_id) == []
    assert sorted(calls) == sorted(
        (f"o-{i}", step, 1) for i in range(5) for step in ("reserve", "charge")
    )
    assert scalar(database_url, "SELECT count(*) FROM saga.sagas WHERE fence <> 1") == 0
