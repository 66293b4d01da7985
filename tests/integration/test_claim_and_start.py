"""A batch claim that starts its sagas' first attempts in the same statement
(saga.claim_batch_v2): the rows and events it leaves are those of a claim whose first move
the worker plans and writes itself; only the next pending step of a saga with nothing else
to decide is started there, every other saga is claimed only and planned by the core; the
fence grows with the claim; and a worker killed after that commit leaves the attempt
counted, its outcome unknown to the next owner."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pytest
from faults.proxy import LostReplyProxy
from psycopg.rows import dict_row
from support import OrchestratorFactory, Order, scalar

from saga import Ceilings, LeaseLost, Orchestrator, Saga, StepContext
from saga._core import inputs
from saga._core.planner import Invoke, starts_in_sql
from saga._drivers.driver import Runner
from saga._flows.drive import Released


def _runner(orch: Orchestrator) -> Runner:
    return Runner(orch.store, orch.runner_options(), keeper=orch.lease_keeper)


def _step(ctx: StepContext, order: Order) -> dict[str, Any]:
    return {"step": ctx.step}


# Each variant's definition, by a name of its own: how its first step is declared, and the
# saga's ceilings.
def _plain(saga: Saga[Order]) -> None:
    saga.step(name="a", side_effect=False, deadline_seconds=30.0)(_step)
    saga.step(name="b")(_step)


def _prepared(saga: Saga[Order]) -> None:
    step = saga.step(name="a")(_step)
    step.prepare(lambda ctx, order: {"order": order.order_id})
    saga.step(name="b")(_step)


def _confirmed(saga: Saga[Order]) -> None:
    saga.step(name="a", confirm=True)(_step)


def _costed(saga: Saga[Order]) -> None:
    saga.step(name="a", cost=2.5)(_step)


VARIANTS: dict[str, tuple[Callable[[Saga[Order]], None], Ceilings | None]] = {
    "plain": (_plain, None),
    "prepared": (_prepared, None),
    "confirmed": (_confirmed, None),
    "costed": (_costed, None),
    "ceiling": (_plain, Ceilings(max_operations=5)),
}


def _variant(name: str, variant: str) -> Saga[Order]:
    declare, ceilings = VARIANTS[variant]
    saga = Saga(
        name,
        version=1,
        input=Order,
        key=lambda o: o.order_id,
        tenant=lambda o: o.tenant_id,
        ceilings=ceilings,
    )
    declare(saga)
    return saga


# Columns that differ between two sagas made alike: identity, clocks, tokens.
_SAGA_SKIP = {
    "id",
    "name",
    "key",
    "input",
    "input_hash",
    "created_at",
    "updated_at",
    "run_after",
    "lease_expires_at",
    "write_token",
    "deadline_at",
}
_OP_SKIP = {
    "saga_id",
    "idempotency_key",
    "request_hash",
    "request",
    "started_at",
    "finished_at",
    "next_attempt_at",
    "deadline_at",
    "updated_at",
    "created_at",
}


def _rows(url: str, saga_id: str, since: int) -> dict[str, Any]:
    """The saga's row, operations and the events after event id `since`, without what
    differs between two sagas made alike (the times an attempt started and its deadline
    are kept as whether they are set and how far apart)."""
    with psycopg.connect(url, row_factory=dict_row) as conn:
        saga = conn.execute("SELECT * FROM saga.sagas WHERE id = %s", (saga_id,)).fetchone()
        ops = conn.execute(
            "SELECT * FROM saga.operations WHERE saga_id = %s ORDER BY kind, position",
            (saga_id,),
        ).fetchall()
        events = conn.execute(
            "SELECT event, step, kind, attempt, detail FROM saga.events"
            " WHERE saga_id = %s AND id > %s ORDER BY id",
            (saga_id, since),
        ).fetchall()
        confirmations = conn.execute(
            "SELECT step, preview FROM saga.confirmations WHERE saga_id = %s", (saga_id,)
        ).fetchall()
    assert saga is not None
    return {
        "saga": {k: v for k, v in saga.items() if k not in _SAGA_SKIP},
        "saga_deadline": saga["deadline_at"] is not None,
        "ops": [
            {
                **{k: v for k, v in op.items() if k not in _OP_SKIP},
                "started": op["started_at"] is not None,
                "backoff": op["next_attempt_at"] is not None,
                "deadline_after_start": (
                    (op["deadline_at"] - op["started_at"]).total_seconds()
                    if op["deadline_at"] is not None and op["started_at"] is not None
                    else op["deadline_at"] is not None
                ),
            }
            for op in ops
        ],
        "events": events,
        "confirmations": len(confirmations),
    }


def _last_event(url: str) -> int:
    return int(scalar(url, "SELECT COALESCE(max(id), 0) FROM saga.events"))


def _after_a_failed_attempt(url: str, saga_id: str) -> None:
    """Leave the saga as a retryable failure of step a's first attempt leaves it once its
    backoff is over: running, `a` pending after one attempt, its error kept."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "UPDATE saga.sagas SET status = 'running', operations_executed = 1,"
            " run_after = now() - interval '1 second' WHERE id = %s",
            (saga_id,),
        )
        conn.execute(
            "UPDATE saga.operations SET attempts = 1, error = 'TransientError: later',"
            " started_at = now() - interval '2 seconds', finished_at = now() - interval '2 s',"
            " next_attempt_at = now() - interval '1 second'"
            " WHERE saga_id = %s AND step = 'a'",
            (saga_id,),
        )


def _left_running_by(other: Orchestrator, kind: str, saga_id: str, url: str) -> None:
    """Step a's first attempt started by `other`, whose lease then lapsed (a dead owner)."""
    claimed = _runner(other).claim_next([kind], other.definition)
    assert claimed is not None and claimed[0].saga.id == saga_id
    assert isinstance(claimed[1], Invoke)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "UPDATE saga.sagas SET lease_expires_at = now() - interval '1 second' WHERE id = %s",
            (saga_id,),
        )


# (variant, how the saga is left before the claim, whether the claim starts its attempt)
SCENARIOS = [
    ("plain", "fresh", True),
    ("plain", "retry", True),
    ("plain", "dead_owner", False),
    ("prepared", "fresh", False),
    ("confirmed", "fresh", False),
    ("costed", "fresh", False),
    ("ceiling", "fresh", False),
]


def _move(nxt: Any) -> tuple[Any, ...]:
    if isinstance(nxt, Invoke):
        return ("invoke", nxt.op.step, nxt.op.attempts, type(nxt.call).__name__)
    if isinstance(nxt, Released):
        return ("released", type(nxt.next).__name__, nxt.state.status if nxt.state else None)
    return (type(nxt).__name__,)


@pytest.mark.parametrize(("variant", "before", "in_sql"), SCENARIOS)
def test_a_claim_that_starts_in_sql_writes_what_the_planner_writes(
    database_url: str, make_orch: OrchestratorFactory, variant: str, before: str, in_sql: bool
) -> None:
    """Two sagas alike, left alike: one claimed by the batch claim that starts attempts in
    the database, the other claimed and planned by the worker (claim_next, its first move
    written by saga.write_saga_v4). Their rows, events and moves are the same; the attempt
    is started by the claim's statement (no write follows it) only where the core allows
    it and the rows leave nothing else to decide."""
    new, old = _variant(f"{variant}_new", variant), _variant(f"{variant}_old", variant)
    other = make_orch(new, old, owner="worker-0")
    seen: dict[str, Any] = {}
    with (
        LostReplyProxy(database_url) as proxy,
        Orchestrator(proxy.url, sagas=[new, old], owner="worker-1") as orch,
    ):
        runner = _runner(orch)
        for saga in (new, old):
            kind = f"{saga.name}:1"
            saga_id = orch.start(saga, Order(order_id=f"{saga.name}-1")).id
            if before == "retry":
                _after_a_failed_attempt(database_url, saga_id)
            elif before == "dead_owner":
                _left_running_by(other, kind, saga_id, database_url)
            since = _last_event(database_url)
            sent = len(proxy.statements())
            if saga is new:
                claimed = runner.claim_batch([kind], orch.definition, 4)
                assert len(claimed) == 1
                planner, nxt = claimed[0]
                writes = [s for s in proxy.statements()[sent:] if "saga.write_saga" in s]
                assert bool(writes) != in_sql, writes
            else:
                one = runner.claim_next([kind], orch.definition)
                assert one is not None
                planner, nxt = one
            assert planner.saga.id == saga_id
            seen[saga.name] = (_rows(database_url, saga_id, since), _move(nxt))
    new_rows, new_move = seen[new.name]
    old_rows, old_move = seen[old.name]
    assert _alike(new_rows) == _alike(old_rows)
    assert new_move == old_move


def _alike(rows: dict[str, Any]) -> Any:
    """`rows` without what differs between the two sagas' own names and inputs: their
    names in keys and previews, request hashes, and the times of a confirmation's
    expiry."""
    text = json.dumps(rows, default=lambda v: float(v) if isinstance(v, Decimal) else str(v))
    text = re.sub(r"[0-9a-f]{64}", "<hash>", text)
    text = re.sub(r"_(new|old)\b", "", text)
    text = re.sub(r"\d{4}-\d\d-\d\d[ T][0-9:.]+[+-]\d\d:\d\d", "<time>", text)
    return json.loads(text)


def test_only_the_steps_the_core_allows_are_started_by_the_database() -> None:
    """The core names the steps whose attempts the database may start: none with a
    prepare hook, a declared cost or a confirmation rule, none of a session."""
    plain, prepared = _variant("p", "plain"), _variant("q", "prepared")
    assert [(s.step, s.side_effect, s.deadline_seconds) for s in starts_in_sql(plain)] == [
        ("a", False, 30.0),
        ("b", True, None),
    ]
    assert [s.step for s in starts_in_sql(prepared)] == ["b"]
    assert starts_in_sql(_variant("c", "confirmed")) == ()
    assert starts_in_sql(_variant("d", "costed")) == ()


def test_a_batch_of_both_kinds_is_claimed_in_one_statement_and_driven(
    make_orch: OrchestratorFactory,
) -> None:
    """One claim takes sagas whose first attempt the database starts and sagas it claims
    only (a prepare hook comes first): each has its own lease and fence, the first are
    handed over with their attempts to call, the others with the move the core planned,
    and all of them are driven to completion."""
    plain, prepared = _variant("mixed_plain", "plain"), _variant("mixed_prepared", "prepared")
    orch = make_orch(plain, prepared)
    ids = {
        orch.start(saga, Order(order_id=f"{saga.name}-{i}")).id: saga.name
        for i in range(3)
        for saga in (plain, prepared)
    }
    runner = _runner(orch)
    claimed = runner.claim_batch(["mixed_plain:1", "mixed_prepared:1"], orch.definition, 8)
    assert sorted(planner.saga.id for planner, _ in claimed) == sorted(ids)
    for planner, nxt in claimed:
        if ids[planner.saga.id] == "mixed_plain":
            assert isinstance(nxt, Invoke) and (nxt.op.step, nxt.op.attempts) == ("a", 1)
        else:
            assert type(nxt).__name__ == "Prepare"
        assert planner.saga.fence == 1 and planner.saga.lease_owner == orch.owner
    for planner, nxt in claimed:
        state = runner.drive(planner, nxt)
        assert state is not None and state.status == "completed", state
    assert runner.claim_batch(["mixed_plain:1", "mixed_prepared:1"], orch.definition, 8) == []


def test_the_claim_grows_the_fence_and_a_previous_owners_write_is_refused(
    database_url: str, make_orch: OrchestratorFactory
) -> None:
    """A saga whose attempt a claim started is not taken while that lease lives. Once it
    has lapsed, the next claim takes it with the fence grown by one and does not start
    the attempt again: the running attempt is unknown to the new owner (a plain step is
    parked). The previous owner's late outcome is refused (LeaseLost) and changes
    nothing."""
    saga = _variant("fenced", "plain")
    first = make_orch(saga, owner="first")
    second = make_orch(saga, owner="second")
    saga_id = first.start(saga, Order(order_id="f-1")).id
    [(planner, nxt)] = _runner(first).claim_batch(["fenced:1"], first.definition, 4)
    assert isinstance(nxt, Invoke) and planner.saga.fence == 1
    assert _runner(second).claim_batch(["fenced:1"], second.definition, 4) == []

    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            "UPDATE saga.sagas SET lease_expires_at = now() - interval '1 second' WHERE id = %s",
            (saga_id,),
        )
    [(taken, move)] = _runner(second).claim_batch(["fenced:1"], second.definition, 4)
    assert taken.saga.fence == 2
    assert isinstance(move, Released) and move.state is not None
    assert move.state.status == "needs_review"
    a = move.state.operation("a")
    assert (a.status, a.attempts) == ("unknown", 1)

    outcome = inputs.outcome_of(
        planner.spec_of(nxt.op), nxt.op, returned={"late": True}, trace=lambda exc: ""
    )
    with pytest.raises(LeaseLost):
        _runner(first).run(_runner(first).flows.transact(planner, outcome))
    after = first.get(saga_id)
    assert after.status == "needs_review" and after.operation("a").status == "unknown"
    assert [e.event for e in first.history(saga_id)].count("attempt_started") == 1


def _killed_worker(database_url: str, point: str) -> dict[str, Saga[Any]]:
    """Start two sagas of each kind of `claim_start_app`, and run its worker in a child
    process SIGKILLed at fault point `point` of an action; the sagas, by id."""
    import claim_start_app

    claim_start_app.create_tables(database_url)
    with Orchestrator(database_url, sagas=claim_start_app.SAGAS) as starter:
        ids: dict[str, Saga[Any]] = {
            starter.start(saga, claim_start_app.Job(job_id=f"{saga.name}-{i}")).id: saga
            for saga in claim_start_app.SAGAS
            for i in range(2)
        }
    script = Path(__file__).resolve().parent / "claim_start_app.py"
    child = subprocess.run(
        [sys.executable, str(script)],
        env={**os.environ, claim_start_app.ENV_URL: database_url, "SAGA_FAULT": f"{point}:action"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert child.returncode == -signal.SIGKILL, child.stdout[-3000:] + child.stderr[-3000:]
    return ids


def _first_attempts(database_url: str) -> tuple[list[tuple[Any, ...]], int, int]:
    """(lease owner, fence, status and attempts of step `first`) of every saga, how many
    claim transactions wrote them (distinct updated_at), and how many steps were called."""
    with psycopg.connect(database_url) as conn:
        held = conn.execute(
            "SELECT s.lease_owner, s.fence, o.status, o.attempts"
            " FROM saga.sagas AS s JOIN saga.operations AS o ON o.saga_id = s.id"
            " AND o.step = 'first' ORDER BY s.id"
        ).fetchall()
        claims = conn.execute("SELECT count(DISTINCT updated_at) FROM saga.sagas").fetchone()
        calls = conn.execute("SELECT count(*) FROM step_calls").fetchone()
    assert claims is not None and calls is not None
    return held, int(claims[0]), int(calls[0])


def _calls(database_url: str) -> list[tuple[str, str, int]]:
    with psycopg.connect(database_url) as conn:
        rows = conn.execute("SELECT job_id, step, attempt FROM step_calls ORDER BY id").fetchall()
    return [(str(j), str(s), int(a)) for j, s, a in rows]


@pytest.mark.crash
def test_a_worker_killed_after_the_claim_that_started_its_attempts_leaves_them_unknown(
    database_url: str, make_orch: OrchestratorFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker process claims four sagas, their first attempts started by the claim's
    statement, and is SIGKILLed before calling any (fault point `before_call`). The
    attempts are counted and leased to the dead worker; once the leases lapse, another
    worker settles each as any unknown outcome: an idempotent step is retried with the
    same key (attempt 2), a plain one is parked for review, never called."""
    import claim_start_app

    monkeypatch.setenv(claim_start_app.ENV_URL, database_url)
    ids = _killed_worker(database_url, "before_call")
    held, claims, calls = _first_attempts(database_url)
    # One claim leased all four, each with its first attempt counted and running.
    assert held == [("doomed", 1, "running", 1)] * 4
    assert (claims, calls) == (1, 0)

    orch = make_orch(*claim_start_app.SAGAS, lease_seconds=2.0)
    orch.worker(concurrency=4, poll_seconds=0.1).run(until_idle=True)
    for saga_id, saga in ids.items():
        state = orch.get(saga_id)
        history = [(e.event, e.step, e.attempt) for e in orch.history(saga_id)]
        assert ("outcome_unknown", "first", 1) in history
        first = state.operation("first")
        if saga is claim_start_app.IDEMPOTENT:
            assert state.status == "completed", state.error
            assert first.attempts == 2
            assert ("unknown_retried", "first", 1) in history
        else:
            assert state.status == "needs_review"
            assert (first.status, first.attempts) == ("unknown", 1)
    assert sorted(_calls(database_url)) == sorted(
        (f"cs_idempotent-{i}", step, attempt)
        for i in range(2)
        for step, attempt in (("first", 2), ("second", 1))
    )


@pytest.mark.crash
def test_a_worker_killed_before_the_claim_that_starts_its_attempts_commits_leaves_nothing(
    database_url: str, make_orch: OrchestratorFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same worker SIGKILLed at `before_record`, once the claim's statement has run and
    before it commits: nothing of it is left (no lease, no attempt), and another worker
    drives every saga from its first attempt, each step once."""
    import claim_start_app

    monkeypatch.setenv(claim_start_app.ENV_URL, database_url)
    ids = _killed_worker(database_url, "before_record")
    held, _, calls = _first_attempts(database_url)
    assert held == [(None, 0, "pending", 0)] * 4
    assert calls == 0

    orch = make_orch(*claim_start_app.SAGAS, lease_seconds=2.0)
    orch.worker(concurrency=4, poll_seconds=0.1).run(until_idle=True)
    assert [orch.get(saga_id).status for saga_id in ids] == ["completed"] * 4
    assert sorted(_calls(database_url)) == sorted(
        (f"{saga.name}-{i}", step, 1)
        for saga in claim_start_app.SAGAS
        for i in range(2)
        for step in ("first", "second")
    )


@pytest.mark.crash
@pytest.mark.parametrize("lost", ["saga.claim_batch_v2", "saga.write_sagas_v2"])
def test_a_mixed_batch_claim_whose_reply_was_lost_carries_on_every_saga(
    database_url: str, lost: str
) -> None:
    """A claim of sagas whose attempts it starts and of sagas it claims only (their first
    moves written by one more statement): the reply of the claim, or of the first moves'
    write, is lost after its commit. The retry finds every saga by the token it stores
    (the started attempt's, the claim's, or the first move's) and carries each on from
    what was committed: every step is called once, no outcome is unknown."""
    called: list[tuple[str, str, int]] = []

    def record(ctx: StepContext, order: Order) -> dict[str, Any]:
        called.append((order.order_id, ctx.step, ctx.attempt))
        return {}

    plain = Saga("lost_plain", version=1, input=Order, key=lambda o: o.order_id)
    plain.step(name="a")(record)
    plain.step(name="b")(record)
    prepared = Saga("lost_prepared", version=1, input=Order, key=lambda o: o.order_id)
    step = prepared.step(name="a")(record)
    step.prepare(lambda ctx, order: {"order": order.order_id})
    prepared.step(name="b")(record)
    kinds = ["lost_plain:1", "lost_prepared:1"]
    with Orchestrator(database_url, sagas=[plain, prepared]) as starter:
        ids = [
            starter.start(saga, Order(order_id=f"{saga.name}-{i}")).id
            for i in range(2)
            for saga in (plain, prepared)
        ]
    with (
        LostReplyProxy(database_url) as proxy,
        Orchestrator(proxy.url, sagas=[plain, prepared], lease_seconds=30.0) as orch,
    ):
        proxy.lose_reply(lost)
        runner = _runner(orch)
        claimed = runner.claim_batch(kinds, orch.definition, 8)
        assert len(proxy.lost_replies(lost)) == 1 and not proxy.lost_replies()[0].failed
        assert sorted(planner.saga.id for planner, _ in claimed) == sorted(ids)
        for planner, nxt in claimed:
            state = runner.drive(planner, nxt)
            assert state is not None and state.status == "completed", state
        for saga_id in ids:
            assert "outcome_unknown" not in [e.event for e in orch.history(saga_id)]
            assert orch.get(saga_id).lease_owner is None
    assert sorted(called) == sorted(
        (f"{name}-{i}", step, 1)
        for name in ("lost_plain", "lost_prepared")
        for i in range(2)
        for step in ("a", "b")
    )


def test_a_claim_that_starts_attempts_reads_the_head_of_a_long_queue_not_all_of_it(
    make_orch: OrchestratorFactory,
) -> None:
    """A claim of 8 that starts their first attempts reads those 8 and their operations, not
    the queue behind them: with 6,000 sagas queued (and stale statistics) it reads about
    the buffers of the same claim of 8 with nothing queued at all, far from one per saga
    queued."""
    warm = _variant("queued_warm", "plain")
    first, second = _variant("queued_one", "plain"), _variant("queued_two", "plain")
    orch = make_orch(warm, first, second)
    heads = {
        saga.name: [orch.start(saga, Order(order_id=f"head-{i}")).id for i in range(8)]
        for saga in (warm, first, second)
    }
    call = (
        "SELECT * FROM saga.claim_batch_v2(%s, 'probe', 10, 8, now(),"
        " ARRAY(SELECT gen_random_uuid() FROM generate_series(1, 8)),"
        " ARRAY(SELECT gen_random_uuid() FROM generate_series(1, 8)),"
        " %s, ARRAY['a', 'b'], ARRAY[0, 1], ARRAY[30, NULL]::float8[])"
    )

    def claim(conn: psycopg.Connection[Any], kind: str) -> int:
        plan = conn.execute(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {call}", ([kind], [kind] * 2))
        top = plan.fetchone()[0][0]["Plan"]  # type: ignore[index]
        return int(top["Shared Hit Blocks"]) + int(top["Shared Read Blocks"])

    with psycopg.connect(orch.database_url, autocommit=True) as conn:
        conn.execute("UPDATE saga.sagas SET run_after = now() - interval '1 day'")
        # A first claim in the session reads the catalogs and plans the statements.
        claim(conn, "queued_warm:1")
        alone = claim(conn, "queued_two:1")
        conn.execute(
            "INSERT INTO saga.sagas (id, name, version, tenant_id, key, input, input_hash,"
            " run_after)"
            " SELECT gen_random_uuid(), 'queued_one', 1, 't', 'k' || i, '{}', 'h',"
            "        now() - make_interval(secs => 6001 - i)"
            " FROM generate_series(1, 6000) AS i"
        )
        queued = claim(conn, "queued_one:1")
        started = conn.execute(
            "SELECT s.name, s.id::text FROM saga.sagas AS s JOIN saga.operations AS o"
            " ON o.saga_id = s.id AND o.step = 'a' AND o.status = 'running'"
            " WHERE s.lease_owner = 'probe'"
        ).fetchall()
    assert sorted(started) == sorted((name, i) for name, ids in heads.items() for i in ids)
    # Reading the queue through an index costs a buffer access per saga queued (6,000);
    # with the queue there, the indexes the claim writes to are a level deeper, and the
    # claim a few dozen accesses dearer (60 to 130 measured).
    assert queued < alone + 1000, f"a claim of 8 read {queued} buffers, {alone} with no queue"
