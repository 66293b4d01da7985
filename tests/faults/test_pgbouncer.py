"""Behind a real PgBouncer in transaction mode (Debian's pgbouncer 1.18): the library, the
workers and `saga migrate` through it, then the fault harness (kills, lost replies,
terminations) through it: nothing twice, nothing lost, no saga stranded.

The `pgbouncer` fixture (tests/conftest.py) skips these tests only when pgbouncer is not
installed; `.ci/run` installs it and sets SAGA_TEST_REQUIRE_PGBOUNCER=1, so there they run.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.rows import tuple_row
from pydantic import BaseModel
from structlog.testing import capture_logs

from faults import app, invariants
from faults.harness import (
    TESTS_DIR,
    WorkerProcess,
    quiesce,
    scalar,
    settled_count,
    start_sagas,
    terminate_worker_backends,
    wait_for,
)
from faults.pgbouncer import PgBouncer
from faults.proxy import LostReplyProxy
from faults.soak import LOST_REPLY_WRITES
from saga import AsyncOrchestrator, Orchestrator, Saga, SagaStatus, StepContext
from saga._db.database import check_connection
from saga.testing import FAULT_POINTS
from saga.worker import ENV_LISTEN_URL

pytestmark = [pytest.mark.integration, pytest.mark.crash]

SAGAS = 40
OPEN = ("pending", "running", "compensating")


def _stranded(url: str) -> int:
    """Sagas still open or still leased once everything should have settled."""
    return int(
        scalar(
            url,
            "SELECT count(*) FROM saga.sagas WHERE status = ANY(%s)"
            " OR lease_expires_at IS NOT NULL",
            (list(OPEN),),
        )
    )


def _check(database_url: str, provider_url: str, keys: list[str], **extra: object) -> None:
    summary = invariants.check(database_url, provider_url, keys)
    print(invariants.table(summary, **extra))
    summary.assert_ok()
    assert summary.sagas == len(keys)
    assert _stranded(database_url) == 0


# ----- what the orchestrator finds and does behind the pooler ------------------------------


def test_the_pooler_is_detected_and_a_tcp_proxy_is_not(database_url: str, pooled_url: str) -> None:
    """PgBouncer hands out a backend key of its own: detected. A proxy that forwards bytes
    keeps the server's key (and its session): taken for the direct connection it is."""
    assert check_connection(pooled_url).pooled is True
    assert check_connection(database_url).pooled is False
    with LostReplyProxy(database_url) as proxy:
        assert check_connection(proxy.url).pooled is False


def test_behind_the_pooler_no_statement_is_prepared_and_timeouts_are_per_transaction(
    pooled_url: str, database_url: str
) -> None:
    """The pool's connections never prepare a statement, send no startup option PgBouncer
    refuses, and each transaction sets the lease-long timeouts for itself only: the server
    session, shared with other clients, keeps its defaults."""
    with Orchestrator(pooled_url, lease_seconds=3.0) as orch:
        store = orch.store
        assert orch.route is not None and orch.route.pooled
        with store.pool.connection() as conn:
            assert conn.prepare_threshold is None
            assert _lock_timeout(conn) == "0"
        with store.transaction() as conn:
            row = conn.execute(
                "SELECT current_setting('lock_timeout') AS lock,"
                " current_setting('idle_in_transaction_session_timeout') AS idle"
            ).fetchone()
            assert row == {"lock": "3s", "idle": "3s"}
        with store.pool.connection() as conn:
            assert _lock_timeout(conn) == "0"
    with Orchestrator(database_url) as direct, direct.store.pool.connection() as conn:
        assert conn.prepare_threshold == 5
    with (
        Orchestrator(pooled_url, prepared_statements=True) as forced,
        forced.store.pool.connection() as conn,
    ):
        assert conn.prepare_threshold == 5


def test_rows_written_behind_the_pooler_record_their_hash_version(
    pooled_url: str, database_url: str
) -> None:
    """The request hash version is said per transaction behind the pooler (migration
    0023), like the timeouts: the rows written record 2, and the shared server session
    keeps no setting an older release's transactions would pick up."""
    saga, data = app.make_input(24, 0, prefix="hashed")
    with Orchestrator(pooled_url, sagas=app.ALL_SAGAS) as orch:
        assert orch.execute(saga, data).status not in OPEN
        claim = orch.ledger.claim("run-1", "k-1", "charge", {"amount_cents": 4200})
        orch.ledger.complete(claim, {"charge_id": 1})
        with orch.store.pool.connection() as conn:
            row = conn.execute("SELECT current_setting('saga.hash_version', true) AS v").fetchone()
            assert row is not None and row["v"] in (None, "")
    with psycopg.connect(database_url) as conn:
        versions = conn.execute(
            "SELECT hash_version, count(*) FROM (SELECT hash_version FROM saga.operations "
            "UNION ALL SELECT hash_version FROM saga.sagas) AS rows GROUP BY 1"
        ).fetchall()
    assert len(versions) == 1 and versions[0][0] == 2 and versions[0][1] >= 4


def _lock_timeout(conn: psycopg.Connection[Any]) -> str:
    row = conn.cursor(row_factory=tuple_row).execute("SHOW lock_timeout").fetchone()
    assert row is not None
    return str(row[0])


def test_execute_and_workers_through_pgbouncer(
    pooled_url: str,
    database_url: str,
    provider_url: str,
    workers: list[WorkerProcess],
    log_dir: Path,
) -> None:
    """40 sagas through `execute()`, 20 through `AsyncOrchestrator.execute()`, and 40
    started through the pooler and driven by a sync and an asyncio worker process behind
    it: every statement past psycopg's prepare threshold many times over, and no
    prepared-statement error, duplicate, loss or stranded saga."""
    keys: list[str] = []
    with Orchestrator(pooled_url, sagas=app.ALL_SAGAS, lease_seconds=2.0) as orch:
        for index in range(SAGAS):
            saga, data = app.make_input(18, index, prefix="exec")
            state = orch.execute(saga, data)
            assert state.status not in OPEN, state
            keys.append(data.key)

    async def through_async() -> list[str]:
        done: list[str] = []
        async with AsyncOrchestrator(pooled_url, sagas=app.ALL_SAGAS, lease_seconds=2.0) as aorch:
            for index in range(SAGAS // 2):
                saga, data = app.make_input(18, index, prefix="aexec")
                state = await aorch.execute(saga, data)
                assert state.status not in OPEN, state
                done.append(data.key)
        return done

    keys += asyncio.run(through_async())
    keys += start_sagas(pooled_url, SAGAS, seed=18, prefix="worker")
    for async_worker in (False, True):
        workers.append(
            WorkerProcess(
                pooled_url, provider_url, log_dir, lease_seconds=2.0, async_worker=async_worker
            )
        )
    for worker in workers:
        assert worker.wait(timeout=120) == 0, worker.output()[-3000:]
        output = worker.output()
        assert "PreparedStatement" not in output and "InvalidSqlStatementName" not in output
        # The one line that says the worker polls: no LISTEN through the pooler.
        assert output.count("listen_unavailable") == 1, output[-3000:]
    _check(database_url, provider_url, keys, through="pgbouncer")
    assert len(keys) == SAGAS * 2 + SAGAS // 2


class Wake(BaseModel):
    key: str


def test_a_worker_behind_the_pooler_listens_on_its_direct_listen_url(
    pooled_url: str, database_url: str
) -> None:
    """With `listen_url` direct, a worker polling only every 30 s still picks up a saga
    started through the pooler at once; without it, it says once that it polls."""
    saga = Saga("pooled_wakeup", version=1, input=Wake, key=lambda w: w.key)

    @saga.step
    def only(ctx: StepContext, wake: Wake) -> dict[str, bool]:
        return {"ok": True}

    with Orchestrator(pooled_url, sagas=[saga]) as orch:
        worker = orch.worker(poll_seconds=30.0, listen_url=database_url)
        thread = threading.Thread(target=worker.run, kwargs={"handle_signals": False})
        with capture_logs() as logs:
            thread.start()
            try:
                time.sleep(1.0)  # idle, listening
                handle = orch.start(saga, Wake(key="w-1"))
                wait_for(
                    lambda: orch.get(handle.id).status == SagaStatus.COMPLETED,
                    timeout=10,
                    what="the saga driven after a NOTIFY",
                )
            finally:
                worker.stop()
                thread.join(30)
        assert not [e for e in logs if e["event"] == "listen_unavailable"]

        polling = orch.worker(poll_seconds=0.2)
        with capture_logs() as logs:
            polling.run(until_idle=True, handle_signals=False)
        warnings = [e for e in logs if e["event"] == "listen_unavailable"]
        assert len(warnings) == 1 and warnings[0]["log_level"] == "warning"

        # A listen_url that is the pooler's own is refused the same way, once.
        pooled_listener = orch.worker(poll_seconds=0.2, listen_url=pooled_url)
        with capture_logs() as logs:
            pooled_listener.run(until_idle=True, handle_signals=False)
            time.sleep(0.2)
        assert len([e for e in logs if e["event"] == "listen_unavailable"]) <= 1


def test_saga_migrate_through_the_pooler_is_safe(
    pgbouncer: PgBouncer, empty_database_url: str
) -> None:
    """`saga migrate` through the pooler, from two processes at once: the advisory lock is
    transaction-scoped, so both finish, the schema is migrated once, and no lock is left
    on a server session."""
    url = pgbouncer.url_for(empty_database_url)
    env = {k: v for k, v in os.environ.items() if k != "SAGA_DATABASE_URL"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "saga", "migrate", "--database-url", url],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [proc.communicate(timeout=120) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    assert any("applied migrations" in out for out, _ in outputs), outputs
    with psycopg.connect(empty_database_url) as conn:
        versions = conn.execute("SELECT count(*) FROM saga.schema_migrations").fetchone()
        locks = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND database ="
            " (SELECT oid FROM pg_database WHERE datname = current_database())"
        )
        assert versions is not None and versions[0] >= 16
        assert locks.fetchone() == (0,)


# ----- the fault harness through the pooler ------------------------------------------------


@pytest.mark.parametrize("point", FAULT_POINTS)
def test_kills_behind_the_pooler(
    point: str,
    pooled_url: str,
    database_url: str,
    provider_url: str,
    workers: list[WorkerProcess],
    log_dir: Path,
) -> None:
    """Worker processes behind the pooler SIGKILLed at `point` of an action, again and
    again (test_kill.py's scenario): recovered through the pooler, every saga settles once."""
    fault = f"{point}:action"
    keys = start_sagas(pooled_url, 16, zlib.crc32(fault.encode()), prefix="pgb")
    kills = 0
    for _ in range(3):
        worker = WorkerProcess(pooled_url, provider_url, log_dir, fault=fault, lease_seconds=1.0)
        workers.append(worker)
        code = worker.wait(timeout=60)
        assert code in (0, -signal.SIGKILL), worker.output()[-3000:]
        if code == 0:
            break
        kills += 1
    assert kills >= 1, f"no worker reached {fault}"
    quiesce(pooled_url, timeout=60)
    _check(database_url, provider_url, keys, kills=kills, through="pgbouncer")


def test_lost_replies_behind_the_pooler(
    pooled_url: str,
    database_url: str,
    provider_url: str,
    workers: list[WorkerProcess],
    log_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Replies lost between the workers and the pooler after the commit landed
    (test_lost_replies.py's scenario, the proxy in front of PgBouncer); the workers LISTEN
    on their direct listen_url. Every saga settles by itself, once."""
    monkeypatch.setenv(ENV_LISTEN_URL, database_url)
    keys = start_sagas(pooled_url, SAGAS, seed=19, prefix="pgblost")
    with LostReplyProxy(pooled_url, seed=19) as proxy:
        for statement in LOST_REPLY_WRITES:
            proxy.lose_reply(statement, times=None, probability=1 / 15)
        for _ in range(2):
            workers.append(
                WorkerProcess(proxy.url, provider_url, log_dir, lease_seconds=3.0, concurrency=3)
            )
        for worker in workers:
            assert worker.wait(timeout=240) == 0, worker.output()[-3000:]
            assert "listen_unavailable" not in worker.output()
        lost = proxy.lost_replies()
    quiesce(pooled_url, timeout=30)
    _check(database_url, provider_url, keys, lost_replies=len(lost), through="pgbouncer")
    assert len(lost) >= 10, f"only {len(lost)} replies were lost"


def test_server_connections_terminated_behind_the_pooler(
    pooled_url: str,
    database_url: str,
    provider_url: str,
    workers: list[WorkerProcess],
    log_dir: Path,
) -> None:
    """The server cuts PgBouncer's server connections while the workers behind it hold
    leases (test_terminate.py's scenario): the pooler reports the cut, the workers' work
    retries, and every saga settles once."""
    keys = start_sagas(pooled_url, SAGAS, seed=20, prefix="pgbterm")
    for _ in range(2):
        workers.append(
            WorkerProcess(pooled_url, provider_url, log_dir, lease_seconds=2.0, step_delay=0.05)
        )
    cuts = 0
    deadline = time.monotonic() + 60
    while cuts < 6 and settled_count(database_url) < SAGAS and time.monotonic() < deadline:
        wait_for(
            lambda: _leases_held(database_url) or settled_count(database_url) >= SAGAS,
            timeout=30,
            what="a lease held, or every saga settled",
        )
        if _leases_held(database_url) and terminate_worker_backends(database_url):
            cuts += 1
        time.sleep(0.3)
    assert cuts >= 3
    for worker in workers:
        assert worker.wait(timeout=120) == 0, worker.output()[-3000:]
    quiesce(pooled_url, timeout=30)
    _check(database_url, provider_url, keys, terminations=cuts, through="pgbouncer")


def _leases_held(url: str) -> int:
    return int(scalar(url, "SELECT count(*) FROM saga.sagas WHERE lease_expires_at > now()"))


def test_a_short_soak_behind_the_pooler(pgbouncer: Any) -> None:
    """`faults.soak` with SOAK_PGBOUNCER=1: its workers reach the sagas' server through
    the lost-reply proxy and a PgBouncer of its own, under kills, restarts of the server
    and terminations; 0 duplicates, 0 lost. (`pgbouncer` is asked for as its neighbours
    ask: skipped where pgbouncer is not installed, failed where CI requires it.)"""
    env = dict(os.environ)
    env.update(
        SOAK_PGBOUNCER="1",
        SOAK_SAGAS="150",
        SOAK_KILL_SECONDS="2",
        SOAK_RESTART_EVERY="4",
        SOAK_TIMEOUT_SECONDS="400",
        PYTHONPATH=os.pathsep.join([str(TESTS_DIR), env.get("PYTHONPATH", "")]),
    )
    proc = subprocess.run(
        [sys.executable, "-m", "faults.soak"],
        env=env,
        cwd=TESTS_DIR,
        capture_output=True,
        text=True,
        timeout=600,
    )
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert "sagas=150" in last and "duplicates=0 lost=0" in last, last


def test_the_dashboard_feed_polls_behind_the_pooler(pooled_url: str) -> None:
    """The dashboard's change feed does not LISTEN through the pooler (it says so once)
    and still sees a change, by its marker's polling, within a few polls."""
    from saga.web.live import ChangeFeed

    async def scenario() -> tuple[bool, int, int]:
        feed = ChangeFeed(pooled_url, poll_seconds=0.2)
        task = asyncio.create_task(feed.run())
        try:
            seen = await feed.wait(0, 5.0)  # the first bump, once connected
            await asyncio.sleep(0.5)
            seen = feed.generation
            with Orchestrator(pooled_url, sagas=app.ALL_SAGAS) as orch:
                saga, data = app.make_input(24, 0, prefix="feed")
                await asyncio.to_thread(orch.start, saga, data)
            changed = await feed.wait(seen, 5.0)
            return feed.listening, seen, changed
        finally:
            await feed.close()
            await asyncio.wait_for(task, 10)

    with capture_logs() as logs:
        listening, seen, changed = asyncio.run(scenario())
    assert listening is False
    assert changed > seen
    assert [e["event"] for e in logs].count("dashboard_listen_unavailable") == 1
