"""Several worker processes racing for the same sagas."""

from __future__ import annotations

from pathlib import Path

import pytest

from faults import invariants
from faults.harness import WorkerProcess, scalar, start_sagas

pytestmark = [pytest.mark.integration]

SAGAS = 60


def test_workers_racing_for_the_same_sagas(
    database_url: str, provider_url: str, workers: list[WorkerProcess], log_dir: Path
) -> None:
    """Three workers of four threads start at the same moment on the same sagas: each
    attempt is made by exactly one of them, so the provider sees no repeated request at
    all, and the invariants hold."""
    keys = start_sagas(database_url, SAGAS, seed=3, prefix="race")
    for _ in range(3):
        workers.append(WorkerProcess(database_url, provider_url, log_dir, lease_seconds=2.0))
    for worker in workers:
        assert worker.wait(timeout=120) == 0, worker.output()[-3000:]
    summary = invariants.check(database_url, provider_url, keys)
    print(invariants.table(summary))
    summary.assert_ok()
    assert summary.sagas == SAGAS
    # Without faults nothing is ever asked twice, and the work was shared.
    assert summary.deduplicated == 0 and summary.stale == 0
    assert summary.statuses["needs_review"] == 0
    repeated = scalar(
        database_url,
        "SELECT count(*) FROM (SELECT idempotency_key, attempt FROM fault_provider.requests"
        " GROUP BY 1, 2 HAVING count(*) > 1) AS r",
    )
    assert repeated == 0
    pids = scalar(database_url, "SELECT count(DISTINCT pid) FROM fault_provider.requests")
    assert pids >= 2
