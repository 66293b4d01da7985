"""SIGKILL of a worker right after a batch claim: the sagas it took are reclaimed once their
leases expire, and every invariant holds."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from faults import invariants
from faults.harness import WorkerProcess, quiesce, scalar, start_sagas

pytestmark = [pytest.mark.integration, pytest.mark.crash]

SAGAS = 10
CONCURRENCY = 4


@pytest.mark.parametrize("async_worker", [False, True], ids=["sync", "async"])
def test_sagas_of_a_batch_claim_are_reclaimed_after_the_worker_is_killed(
    async_worker: bool,
    database_url: str,
    provider_url: str,
    workers: list[WorkerProcess],
    log_dir: Path,
) -> None:
    """A worker with four idle drivers claims four sagas in one transaction and is killed
    at the first call: the four stay leased to the dead worker until their leases expire,
    then another worker takes them over and settles them; nothing ran twice, nothing was
    lost."""
    keys = start_sagas(database_url, SAGAS, "batch-kill")
    worker = WorkerProcess(
        database_url,
        provider_url,
        log_dir,
        fault="before_call:action",
        concurrency=CONCURRENCY,
        lease_seconds=1.0,
        owner="doomed",
        async_worker=async_worker,
    )
    workers.append(worker)
    code = worker.wait(timeout=60)
    assert code == -signal.SIGKILL, worker.output()[-3000:]

    held = scalar(
        database_url,
        "SELECT ARRAY[count(*), count(DISTINCT updated_at)] FROM saga.sagas"
        " WHERE lease_owner = 'doomed'",
    )
    # One transaction wrote all four leases: now() is the same in each.
    assert held == [CONCURRENCY, 1], f"[sagas held, claim transactions]: {held}"

    quiesce(database_url, timeout=60)
    assert scalar(database_url, "SELECT count(*) FROM saga.sagas WHERE lease_owner = 'doomed'") == 0
    # Each saga the dead worker held was claimed again: once by it, at least once after.
    assert (
        scalar(
            database_url,
            "SELECT count(*) FROM saga.sagas AS s WHERE EXISTS (SELECT 1 FROM saga.events AS e"
            " WHERE e.saga_id = s.id AND e.event = 'lease_acquired'"
            " AND e.detail->>'owner' = 'doomed')"
            " AND s.fence < 2",
        )
        == 0
    )
    summary = invariants.check(database_url, provider_url, keys)
    print(invariants.table(summary, kills=1))
    summary.assert_ok()
    assert summary.sagas == SAGAS
