"""What a saga costs the database: commits per run, counted by PostgreSQL itself."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg
import pytest
from faults.proxy import LostReplyProxy
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from support import Order, order_saga, starts_held, wait_until

from saga import AsyncOrchestrator, Orchestrator, Saga, SagaState, StepContext, durable_step
from saga._core.planner import Invoke
from saga._db import _store_base
from saga._db.group import GroupCommit
from saga._drivers.driver import Runner


def _counters(server_url: str, dbname: str) -> tuple[int, int]:
    """(xact_commit, sessions) of `dbname`, read from the maintenance database."""
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute(
            "SELECT xact_commit, sessions FROM pg_stat_database WHERE datname = %s", (dbname,)
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def _settled(server_url: str, dbname: str) -> tuple[int, int]:
    """Counters once every backend of `dbname` has exited and flushed them."""
    deadline = time.monotonic() + 15.0
    while True:
        with psycopg.connect(server_url, autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = %s", (dbname,)
            ).fetchone()
        if row is not None and row[0] == 0:
            break
        assert time.monotonic() < deadline, "backends of the test database did not exit"
        time.sleep(0.05)
    # A backend leaves pg_stat_activity before it has flushed its counters, a window a
    # loaded machine widens: read them until three reads in a row agree.
    seen = [_counters(server_url, dbname)]
    while len(seen) < 3 or len(set(seen[-3:])) > 1:
        assert time.monotonic() < deadline, "the test database's counters did not settle"
        time.sleep(0.1)
        seen.append(_counters(server_url, dbname))
    return seen[-1]


def _without_autovacuum(database_url: str) -> None:
    """Keep autovacuum out of the test database's tables: its workers' transactions count
    in the same xact_commit, whenever its timer happens to fall inside a measurement."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        tables = conn.execute(
            "SELECT c.oid::regclass::text FROM pg_class AS c"
            " JOIN pg_namespace AS n ON n.oid = c.relnamespace"
            " WHERE n.nspname = 'saga' AND c.relkind = 'r'"
        ).fetchall()
        for (table,) in tables:
            conn.execute(
                sql.SQL(
                    "ALTER TABLE {} SET (autovacuum_enabled = false,"
                    " toast.autovacuum_enabled = false)"
                ).format(sql.Identifier(*table.split(".")))
            )


def _session_cost(server_url: str, database_url: str) -> int:
    """What opening one session commits: PostgreSQL counts a commit when a backend starts
    (it reads the catalogs in a transaction).

    The least of three bare connections, each measured alone: a commit from outside
    (an autovacuum worker's visit, which counts in the same xact_commit) can only add to
    one measurement. Taken too high, it would be subtracted once per session of every
    measurement of the work, and the least of those would then keep the one it spoiled."""
    dbname = str(conninfo_to_dict(database_url)["dbname"])
    costs: list[int] = []
    for _ in range(3):
        start_commits, start_sessions = _settled(server_url, dbname)
        psycopg.connect(database_url).close()
        commits, sessions = _settled(server_url, dbname)
        assert sessions - start_sessions == 1
        costs.append(commits - start_commits)
    assert min(costs) >= 1, costs
    return min(costs)


def _commits_of(
    server_url: str, database_url: str, per_session: int, work: Callable[[], None]
) -> int:
    """Commits `work` made in the database, less `per_session` for each session it opened."""
    dbname = str(conninfo_to_dict(database_url)["dbname"])
    commits, sessions = _settled(server_url, dbname)
    work()
    after_commits, after_sessions = _settled(server_url, dbname)
    return (after_commits - commits) - per_session * (after_sessions - sessions)


# Measurements of each run, the least of them kept: nothing of the work can commit less
# than it does, while a commit from outside it (an autovacuum worker's visit, the
# statistics of a busy server) can only add to one measurement, never to all of them.
TRIES = 3


def _least_commits_of(
    server_url: str, database_url: str, work: Callable[[int], Callable[[], None]]
) -> int:
    """The fewest commits of `work(attempt)` over TRIES attempts (each on keys of its own)."""
    _without_autovacuum(database_url)
    per_session = _session_cost(server_url, database_url)
    return min(
        _commits_of(server_url, database_url, per_session, work(attempt))
        for attempt in range(TRIES)
    )


# Sagas run first on a connection, so that every statement is past psycopg's prepare
# threshold (prepared at their sixth execution) before the saga that is counted.
WARM = 6


def _saga_of(steps: int) -> Saga[Order]:
    saga = order_saga(f"cost{steps}")
    for i in range(steps):

        def step(ctx: StepContext, order: Order, i: int = i) -> dict[str, Any]:
            return {"step": i, "key": ctx.idempotency_key}

        saga.step(name=f"s{i}")(step)
    return saga


@pytest.mark.parametrize("steps", [1, 3, 6])
def test_a_saga_of_n_steps_costs_n_plus_one_commits(
    database_url: str, server_url: str, steps: int
) -> None:
    """execute() commits n + 1 times: the start with the first attempt, then one per step
    transition, the last also completing the saga and returning its state."""
    saga = _saga_of(steps)
    states: list[SagaState] = []

    def work(sagas: int, attempt: int) -> Callable[[], None]:
        def run() -> None:
            with Orchestrator(database_url, sagas=[saga], auto_migrate=False) as orch:
                for i in range(sagas):
                    states.append(orch.execute(saga, Order(order_id=f"o-{sagas}-{attempt}-{i}")))

        return run

    # What one saga more costs on a warm connection: a connection pays once for psycopg
    # preparing each statement on its sixth execution (an empty commit each), not per saga.
    warm = _least_commits_of(server_url, database_url, lambda a: work(WARM, a))
    more = _least_commits_of(server_url, database_url, lambda a: work(WARM + 1, a))
    assert [s.status for s in states] == ["completed"] * (TRIES * (2 * WARM + 1))
    assert all([op.attempts for op in s.operations] == [1] * steps for s in states)
    assert more - warm == steps + 1


def test_start_then_run_costs_one_commit_more_than_execute(
    database_url: str, server_url: str
) -> None:
    """start() and run() apart cost n + 2 commits, one more than execute(): run() claims
    the saga with its first attempt without reading it first."""
    saga = _saga_of(3)
    states: list[SagaState] = []

    def work(sagas: int, attempt: int) -> Callable[[], None]:
        def run() -> None:
            with Orchestrator(database_url, sagas=[saga], auto_migrate=False) as orch:
                for i in range(sagas):
                    handle = orch.start(saga, Order(order_id=f"o-{sagas}-{attempt}-{i}"))
                    states.append(orch.run(handle.id))

        return run

    warm = _least_commits_of(server_url, database_url, lambda a: work(WARM, a))
    more = _least_commits_of(server_url, database_url, lambda a: work(WARM + 1, a))
    assert [s.status for s in states] == ["completed"] * (TRIES * (2 * WARM + 1))
    # start, claim with the first attempt, two transitions, the completion: no read of the
    # saga before the claim.
    assert more - warm == 3 + 2


@durable_step(name="cost_reserve")
def _reserve(order_id: str) -> dict[str, str]:
    return {"reserved": order_id}


@durable_step(name="cost_charge")
def _charge(order_id: str, amount_cents: int) -> dict[str, Any]:
    return {"charged": order_id, "amount_cents": amount_cents}


@durable_step(name="cost_ship")
def _ship(order_id: str) -> dict[str, str]:
    return {"shipped": order_id}


# A session's happy path: its opening (the row created already leased, one statement), each
# call's `running` before its effect and its outcome after, and its closing (the last write,
# which gives the lease back and reads the final state in the same statement).
SESSION_COMMITS = {1: 4, 3: 8}


@pytest.mark.parametrize("calls", sorted(SESSION_COMMITS))
def test_a_session_costs_two_commits_per_call_plus_its_opening_and_closing(
    database_url: str, server_url: str, calls: int
) -> None:
    """Each call commits `running` before its effect and its outcome after (never
    deferred: the result is durable before the session's code has it); opening the
    session and closing it are one commit each. More is a commit added back; fewer, a
    call's `running` or outcome without a commit of its own."""
    steps: list[Callable[[str], Any]] = [_reserve, lambda run: _charge(run, 100), _ship][:calls]
    ids: list[str] = []

    def work(sessions: int, attempt: int) -> Callable[[], None]:
        def run() -> None:
            with Orchestrator(database_url, auto_migrate=False) as orch:
                for i in range(sessions):
                    run_id = f"s-{sessions}-{attempt}-{i}"
                    with orch.session(run_id) as session:
                        for step in steps:
                            step(run_id)
                        assert (session.executed, session.replayed) == (calls, 0)
                    ids.append(session.id)

        return run

    warm = _least_commits_of(server_url, database_url, lambda a: work(WARM, a))
    more = _least_commits_of(server_url, database_url, lambda a: work(WARM + 1, a))
    with Orchestrator(database_url, auto_migrate=False) as orch:
        states = [orch.get(saga_id) for saga_id in ids]
    assert [s.status for s in states] == ["completed"] * (TRIES * (2 * WARM + 1))
    assert all([op.attempts for op in s.operations] == [1] * calls for s in states)
    assert more - warm == SESSION_COMMITS[calls] == 2 * calls + 2


# Sagas one batch claim takes in the claim measurement.
CLAIM_BATCH = 8


def test_a_batch_claim_starts_its_sagas_first_attempts_in_one_statement_and_one_commit(
    database_url: str, server_url: str
) -> None:
    """Sagas started, then one batch claim takes CLAIM_BATCH of them and records each one's
    first attempt as running, to be called once it has committed: one commit and one
    round trip for the whole batch (BEGIN, saga.claim_batch_v2, the reads of the
    operations and confirmations it took, COMMIT), no write statement beside it: as many
    commits as one read alone. The claim and the first move cost a saga 1/CLAIM_BATCH of
    a commit."""
    saga = _saga_of(3)
    kind = f"{saga.name}:{saga.version}"
    sent: list[list[str]] = []

    def work(claim: bool, attempt: int) -> Callable[[], None]:
        with Orchestrator(database_url, sagas=[saga], auto_migrate=False) as starter:
            for i in range(CLAIM_BATCH):
                starter.start(saga, Order(order_id=f"c-{claim}-{attempt}-{i}"))

        def run() -> None:
            with (
                LostReplyProxy(database_url) as proxy,
                Orchestrator(proxy.url, sagas=[saga], auto_migrate=False) as orch,
            ):
                if not claim:
                    # One statement alone: one commit.
                    assert orch.store.write_token(str(uuid.uuid4())) is None
                    return
                runner = Runner(orch.store, orch.runner_options(), keeper=orch.lease_keeper)
                before = len(proxy.statements())
                claimed = runner.claim_batch([kind], orch.definition, CLAIM_BATCH)
                sent.append(proxy.statements()[before:])
                assert len(claimed) == CLAIM_BATCH
                for planner, nxt in claimed:
                    assert isinstance(nxt, Invoke) and nxt.op.attempts == 1
                    assert planner.saga.fence == 1

        return run

    one_read = _least_commits_of(server_url, database_url, lambda a: work(False, a))
    claiming = _least_commits_of(server_url, database_url, lambda a: work(True, a))
    print(f"statements of one batch claim of {CLAIM_BATCH} sagas: {sent[-1]}")
    assert claiming == one_read
    assert len(sent) == TRIES
    for statements in sent:
        assert [s.split()[0] for s in statements] == [
            "BEGIN",
            "SELECT",
            "SELECT",
            "SELECT",
            "COMMIT",
        ]
        assert sum("saga.claim_batch_v2(" in s for s in statements) == 1
        assert not any("write_saga" in s for s in statements)


# Sagas of the worker measurement: enough that a worker at concurrency 8 keeps 8 in flight
# for most of the run.
WORKER_SAGAS = 200


def test_a_worker_at_concurrency_8_commits_less_per_saga_than_one_commit_per_transition(
    database_url: str, server_url: str
) -> None:
    """Sagas started, then driven by one sync Worker of 8 threads: the threads' transitions
    that are ready together share a statement and a commit (group commit), so a saga
    costs fewer commits than with every write committed alone (its start, its share of a
    batch claim that writes its first move, and one commit per later transition: at
    least n + 1, the same worker measured the same way). Everything the database
    committed counts: starts, claims, the worker's own polls, and the empty commit of
    each statement's preparation on each of the pool's connections (fixed costs that
    add about one commit per saga over 200 sagas)."""
    saga = _saga_of(3)
    states: list[str] = []
    grouped: list[int] = []

    def work(one_by_one: bool, attempt: int) -> Callable[[], None]:
        def run() -> None:
            keys = [f"w-{one_by_one}-{attempt}-{i}" for i in range(WORKER_SAGAS)]
            with Orchestrator(database_url, sagas=[saga], auto_migrate=False) as orch:
                ids = [orch.start(saga, Order(order_id=key)).id for key in keys]
                store = orch.store
                if one_by_one:
                    # The same worker with every write in a statement and a commit of its own.
                    one = store._write_one
                    store.group = GroupCommit(one, lambda batch: [one(p) for p in batch])
                orch.worker(concurrency=8).run(until_idle=True)
                states.extend(orch.get(saga_id).status for saga_id in ids)
                if not one_by_one:
                    grouped.append(store.group.largest)

        return run

    alone = _least_commits_of(server_url, database_url, lambda a: work(True, a)) / WORKER_SAGAS
    together = _least_commits_of(server_url, database_url, lambda a: work(False, a)) / WORKER_SAGAS
    print(
        f"commits per saga through a worker at concurrency 8: {alone:.2f} one by one, "
        f"{together:.2f} grouped (largest batches {grouped})"
    )
    assert states == ["completed"] * (2 * TRIES * WORKER_SAGAS)
    assert alone >= 3 + 1
    assert max(grouped) >= 2
    assert together < alone


def test_a_workers_grouped_writes_call_no_write_saga_per_saga(
    database_url: str, server_url: str
) -> None:
    """Sagas driven by one sync Worker of 8 threads, with PostgreSQL counting the calls of
    the saga schema's PL/pgSQL functions: grouped writes are applied as sets by
    saga.write_sagas_v2 (never falling back to write_sagas_v1), so saga.write_saga_v4 is
    called only by the statements that call it themselves (a write sent alone, through
    the lost-reply proxy's record of every statement) and by claims of just-started
    sagas, never once per saga of a grouped statement."""
    dbname = str(conninfo_to_dict(database_url)["dbname"])
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("ALTER DATABASE {} SET track_functions = 'pl'").format(sql.Identifier(dbname))
        )
    saga = _saga_of(3)
    keys = [f"f-{i}" for i in range(WORKER_SAGAS)]
    with LostReplyProxy(database_url) as proxy:
        with Orchestrator(proxy.url, sagas=[saga], auto_migrate=False) as orch:
            ids = [orch.start(saga, Order(order_id=key)).id for key in keys]
            orch.worker(concurrency=8).run(until_idle=True)
            assert [orch.get(saga_id).status for saga_id in ids] == ["completed"] * len(ids)
            largest = orch.store.group.largest
        statements = proxy.statements()
    _settled(server_url, dbname)  # every backend has exited and flushed its counters
    with psycopg.connect(database_url, autocommit=True) as conn:
        calls = dict(
            conn.execute(
                "SELECT funcname, calls FROM pg_stat_user_functions WHERE schemaname = 'saga'"
            ).fetchall()
        )
    grouped = sum("saga.write_sagas_v2(" in s for s in statements)
    alone = sum("saga.write_saga_v4(" in s for s in statements)
    claims = calls.get("claim_started_v1", 0)
    print(f"largest batch {largest}; {grouped} grouped statements, {alone} writes alone;")
    print(f"calls counted by PostgreSQL: {calls}")
    assert largest >= 2
    # Every batch claim starts its sagas' first attempts itself: no write of a first move
    # follows it (saga.claim_batch, which the previous release calls, is not called).
    assert calls["claim_batch_v2"] >= 1
    assert calls.get("claim_batch", 0) == 0
    assert calls["write_sagas_v2"] == grouped > 0
    assert calls.get("write_sagas_v1", 0) == 0
    assert alone <= calls.get("write_saga_v4", 0) <= alone + claims


def test_a_worker_reads_no_state_back_from_its_writes(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker drops the state a drive ends with: the write that gives a saga's lease
    back does not ask the server to build it (nor the worker to read it), while `run()`,
    whose caller gets that state, still reads it in the same statement."""
    decoded: list[str] = []
    real = _store_base.state_from

    def counted(row: dict[str, Any], ops: Any) -> SagaState:
        decoded.append(str(row["id"]))
        return real(row, ops)

    monkeypatch.setattr(_store_base, "state_from", counted)
    saga = _saga_of(3)
    with Orchestrator(database_url, sagas=[saga], auto_migrate=False) as orch:
        ids = [orch.start(saga, Order(order_id=f"nostate-{i}")).id for i in range(12)]
        orch.worker(concurrency=4).run(until_idle=True)
        assert decoded == []
        assert [orch.get(saga_id).status for saga_id in ids] == ["completed"] * len(ids)
        decoded.clear()
        ran = orch.start(saga, Order(order_id="nostate-run"))
        assert orch.run(ran.id).status == "completed"
        assert decoded == [ran.id]


# ----- starts made at the same time -----------------------------------------------------

# Starts made at once: the sync door's from as many threads.
CONCURRENT_STARTS = 8


def _all_sent_or_queued(starts: Any, count: int) -> bool:
    """Whether `count` starts are on the wire or queued behind it (`GroupCommit`)."""
    return bool(starts.batches >= 1 and starts.largest + len(starts._queue) == count)


def _written_as_a_lone_start(database_url: str, saga: Saga[Order], keys: list[str]) -> None:
    """The sagas of `keys` were written as a start made alone writes its saga."""
    with Orchestrator(database_url, sagas=[saga], auto_migrate=False) as orch:
        orch.start(saga, Order(order_id="lone"))
    lone = _start_rows(database_url, "lone")
    for key in keys:
        assert _start_rows(database_url, key) == lone


def _start_rows(database_url: str, key: str) -> tuple[Any, ...]:
    """What a start wrote for the saga of `key`: its row, its operations and its events,
    without what differs from saga to saga (ids, times, the key itself)."""
    with psycopg.connect(database_url) as conn:
        saga = conn.execute(
            "SELECT id, name, version, tenant_id, input_hash IS NOT NULL, status, direction,"
            " error, lease_owner, fence, run_after IS NOT NULL, write_token IS NOT NULL,"
            " hash_version, operations_executed, spent, side_effects FROM saga.sagas"
            " WHERE key = %s",
            (key,),
        ).fetchone()
        assert saga is not None
        ops = conn.execute(
            "SELECT step, kind, position, replace(idempotency_key, %s, '<key>'),"
            " length(request_hash), status, attempts, max_attempts, hash_version"
            " FROM saga.operations WHERE saga_id = %s ORDER BY kind, position",
            (key, saga[0]),
        ).fetchall()
        events = conn.execute(
            "SELECT e.event, e.step, e.kind, e.attempt,"
            " replace(replace(e.detail::text, %s, '<key>'), s.input_hash, '<hash>')"
            " FROM saga.events AS e JOIN saga.sagas AS s ON s.id = e.saga_id"
            " WHERE e.saga_id = %s ORDER BY e.id",
            (key, saga[0]),
        ).fetchall()
    return saga[1:], ops, events


def test_starts_made_at_once_from_threads_share_a_statement_and_a_commit(
    database_url: str, server_url: str
) -> None:
    """Eight threads of one sync Orchestrator start a saga each while a start is on the
    wire: the seven made meanwhile leave together, in one statement and one commit
    (saga.start_sagas_v1), and the eight starts cost fewer commits than eight, everything
    the orchestrator committed counted; each saga is written as a start alone writes it."""
    saga = _saga_of(3)
    largest: list[int] = []

    def work(attempt: int) -> Callable[[], None]:
        def run() -> None:
            keys = [f"t-{attempt}-{i}" for i in range(CONCURRENT_STARTS)]
            with (
                Orchestrator(database_url, sagas=[saga], auto_migrate=False) as orch,
                ThreadPoolExecutor(CONCURRENT_STARTS) as pool,
            ):
                store = orch.store
                with starts_held(database_url):
                    started = [pool.submit(orch.start, saga, Order(order_id=k)) for k in keys]
                    wait_until(
                        lambda: _all_sent_or_queued(store.starts, CONCURRENT_STARTS),
                        interval=0.005,
                    )
                for future in started:
                    future.result(timeout=30)
                largest.append(store.starts.largest)

        return run

    commits = _least_commits_of(server_url, database_url, work)
    print(f"{CONCURRENT_STARTS} starts from as many threads: {commits} commits")
    assert largest == [CONCURRENT_STARTS - 1] * TRIES
    assert commits < CONCURRENT_STARTS
    _written_as_a_lone_start(database_url, saga, [f"t-0-{i}" for i in range(CONCURRENT_STARTS)])


def test_starts_made_at_once_on_the_asyncio_door_share_a_statement_and_a_commit(
    database_url: str, server_url: str
) -> None:
    """Sixteen tasks of one AsyncOrchestrator start a saga each while a start is on the
    wire: they go out in two statements and two commits at most, and the sixteen starts
    cost fewer commits than sixteen, everything the orchestrator committed counted; each
    saga is written as a start alone writes it."""
    saga = _saga_of(3)
    count = 2 * CONCURRENT_STARTS

    def work(attempt: int) -> Callable[[], None]:
        async def main() -> None:
            keys = [f"a-{attempt}-{i}" for i in range(count)]
            async with AsyncOrchestrator(database_url, sagas=[saga], auto_migrate=False) as orch:
                store = await orch.store()
                with starts_held(database_url):
                    starting = asyncio.gather(*(orch.start(saga, Order(order_id=k)) for k in keys))
                    while not _all_sent_or_queued(store.starts, count):
                        await asyncio.sleep(0.005)
                await asyncio.wait_for(starting, 30)
                assert store.starts.batches <= 2

        return lambda: asyncio.run(main())

    commits = _least_commits_of(server_url, database_url, work)
    print(f"{count} starts from as many tasks: {commits} commits")
    assert commits < count
    _written_as_a_lone_start(database_url, saga, [f"a-0-{i}" for i in range(count)])
