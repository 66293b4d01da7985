"""A PostgreSQL restart in the middle of a run: workers reconnect and carry on."""

from __future__ import annotations

from pathlib import Path

import pytest

from faults import invariants
from faults.harness import (
    WorkerProcess,
    private_postgres,
    quiesce,
    settled_count,
    start_sagas,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.crash]

SAGAS = 40


def test_workers_ride_out_a_postgres_restart(
    provider_url: str, workers: list[WorkerProcess], private_dir: Path, log_dir: Path
) -> None:
    """The sagas' server (a private one) restarts twice under two busy workers: they
    reconnect with bounded backoff, finish every saga by themselves and exit cleanly; the
    invariants hold. The provider lives on another server, which stays up."""
    with private_postgres(private_dir) as pg:
        keys = start_sagas(pg.url, SAGAS, seed=7, prefix="restart")
        for _ in range(2):
            workers.append(
                WorkerProcess(pg.url, provider_url, log_dir, lease_seconds=2.0, step_delay=0.05)
            )
        for restart in (1, 2):
            wait_for(
                lambda n=restart: settled_count(pg.url) >= n * SAGAS // 4,
                timeout=60,
                what=f"progress before restart {restart}",
            )
            pg.restart()
        for worker in workers:
            assert worker.wait(timeout=120) == 0, worker.output()[-3000:]
        assert pg.restarts == 2
        logs = "".join(w.output() for w in workers)
        assert "database_retry" in logs or "worker_database_error" in logs
        quiesce(pg.url, timeout=30)  # nothing left: the workers finished it all
        summary = invariants.check(pg.url, provider_url, keys)
        print(invariants.table(summary, restarts=pg.restarts))
        summary.assert_ok()
        assert summary.sagas == SAGAS
