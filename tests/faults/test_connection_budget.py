"""The connection budget: N worker processes of concurrency C use at most
N * (2C + 2 + 1) connections (sync; N * (C + 2 + 1) asyncio): the pool, sized for C by
default, and one connection for LISTEN. Behind PgBouncer, the server sees at most its
`default_pool_size` for them."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from faults import app, invariants
from faults.harness import WorkerProcess, quiesce, start_sagas
from faults.pgbouncer import PgBouncer
from saga import AsyncOrchestrator, Orchestrator

pytestmark = [pytest.mark.integration, pytest.mark.crash]

SAGAS = 40
CONCURRENCY = 3


def sync_budget(workers: int, concurrency: int) -> int:
    """Connections of `workers` sync worker processes: each one's pool (2C + 2) and LISTEN."""
    return workers * (2 * concurrency + 2 + 1)


def _connections(conn: psycopg.Connection[Any]) -> int:
    """Client connections to this database but the sampler's and the provider's."""
    row = conn.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
        " AND coalesce(application_name, '') <> %s",
        (app.PROVIDER_APP_NAME,),
    ).fetchone()
    assert row is not None
    return int(row[0])


class _Peak:
    """Samples `_connections` every 20 ms in a thread, on one connection of its own (a
    connection per sample would count the previous one's backend while it exits); `peak`
    is the most it saw."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            while not self._stop.is_set():
                self.peak = max(self.peak, _connections(conn))
                self._stop.wait(0.02)

    def __enter__(self) -> _Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def test_the_pool_follows_the_workers_concurrency_by_default(database_url: str) -> None:
    """Not given, the pool is sized for the worker: 2C + 2 (sync), C + 2 (asyncio); a
    `pool_size` given is a floor the worker only grows to its need."""
    for concurrency in (1, 3, 12):
        with Orchestrator(database_url, sagas=app.ALL_SAGAS) as orch:
            orch.worker(concurrency=concurrency).run(until_idle=True, handle_signals=False)
            assert orch.store.pool.max_size == 2 * concurrency + 2
    with Orchestrator(database_url, sagas=app.ALL_SAGAS, pool_size=30) as orch:
        orch.worker(concurrency=3).run(until_idle=True, handle_signals=False)
        assert orch.store.pool.max_size == 30
    with Orchestrator(database_url, sagas=app.ALL_SAGAS, pool_size=4) as orch:
        orch.worker(concurrency=3).run(until_idle=True, handle_signals=False)
        assert orch.store.pool.max_size == 8

    async def sized(concurrency: int) -> int:
        async with AsyncOrchestrator(database_url, sagas=app.ALL_SAGAS) as aorch:
            await aorch.worker(concurrency=concurrency).run(until_idle=True, handle_signals=False)
            return (await aorch.store()).pool.max_size

    assert asyncio.run(sized(5)) == 5 + 2


def test_n_worker_processes_stay_within_the_budget(
    database_url: str, provider_url: str, workers: list[WorkerProcess], log_dir: Path
) -> None:
    """Two sync worker processes of concurrency 3 on 40 sagas with slow steps: the peak
    of their connections, sampled every 20 ms, is within 2 * (2 * 3 + 2 + 1) = 18."""
    keys = start_sagas(database_url, SAGAS, seed=22, prefix="budget")
    with _Peak(database_url) as sampled:
        for _ in range(2):
            workers.append(
                WorkerProcess(
                    database_url,
                    provider_url,
                    log_dir,
                    concurrency=CONCURRENCY,
                    lease_seconds=2.0,
                    step_delay=0.05,
                )
            )
        for worker in workers:
            assert worker.wait(timeout=120) == 0, worker.output()[-3000:]
    quiesce(database_url, timeout=30)
    summary = invariants.check(database_url, provider_url, keys)
    budget = sync_budget(2, CONCURRENCY)
    print(invariants.table(summary, peak_connections=sampled.peak, budget=budget))
    summary.assert_ok()
    assert 2 <= sampled.peak <= budget, (sampled.peak, budget)


def test_behind_pgbouncer_the_server_sees_at_most_its_pool(
    pgbouncer: PgBouncer,  # skips the test where pgbouncer is not installed
    database_url: str,
    server_url: str,
    provider_url: str,
    workers: list[WorkerProcess],
    log_dir: Path,
) -> None:
    """Four worker processes of concurrency 3 behind a PgBouncer whose default_pool_size
    is 4: they open up to 4 * 9 client connections to it, the server sees at most 4."""
    with PgBouncer(server_url, default_pool_size=4) as bouncer:
        url = bouncer.url_for(database_url)
        keys = start_sagas(url, SAGAS, seed=23, prefix="budget-pgb")
        with _Peak(database_url) as sampled:
            for _ in range(4):
                workers.append(
                    WorkerProcess(
                        url,
                        provider_url,
                        log_dir,
                        concurrency=CONCURRENCY,
                        lease_seconds=3.0,
                        step_delay=0.05,
                    )
                )
            for worker in workers:
                assert worker.wait(timeout=180) == 0, worker.output()[-3000:]
        quiesce(url, timeout=30)
        time.sleep(0.1)
    summary = invariants.check(database_url, provider_url, keys)
    print(invariants.table(summary, peak_server_connections=sampled.peak, pool=4))
    summary.assert_ok()
    assert 1 <= sampled.peak <= 4, sampled.peak
