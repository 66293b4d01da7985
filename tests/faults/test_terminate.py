"""pg_terminate_backend of the workers' connections while they hold leases."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from faults import invariants
from faults.harness import (
    WorkerProcess,
    quiesce,
    scalar,
    settled_count,
    start_sagas,
    terminate_worker_backends,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.crash]

SAGAS = 40


def _leases_held(url: str) -> int:
    return int(scalar(url, "SELECT count(*) FROM saga.sagas WHERE lease_expires_at > now()"))


def test_connections_terminated_under_held_leases(
    database_url: str, provider_url: str, workers: list[WorkerProcess], log_dir: Path
) -> None:
    """The server cuts every worker connection, six times, each time while leases are
    held: the workers' transactions retry, their leases stay fenced, and every saga ends
    settled with the invariants intact."""
    keys = start_sagas(database_url, SAGAS, seed=11, prefix="terminate")
    for _ in range(2):
        workers.append(
            WorkerProcess(database_url, provider_url, log_dir, lease_seconds=2.0, step_delay=0.05)
        )
    cuts = 0
    deadline = time.monotonic() + 60
    while cuts < 6 and settled_count(database_url) < SAGAS and time.monotonic() < deadline:
        # The last sagas may settle between the check above and this wait: then no lease
        # is held again, and there is nothing left to cut.
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
    quiesce(database_url, timeout=30)
    summary = invariants.check(database_url, provider_url, keys)
    print(invariants.table(summary, terminations=cuts))
    summary.assert_ok()
    assert summary.sagas == SAGAS
