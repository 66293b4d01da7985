"""SIGKILL of a worker process at every boundary of the step protocol, then recovery."""

from __future__ import annotations

import signal
import zlib
from pathlib import Path

import pytest

from faults import invariants
from faults.harness import WorkerProcess, quiesce, start_sagas
from saga.testing import FAULT_POINTS

pytestmark = [pytest.mark.integration, pytest.mark.crash]

SAGAS_PER_BOUNDARY = 24
# Armed workers started one after the other; each dies at its first matching boundary.
KILLS = 3


@pytest.mark.parametrize("kind", ["action", "compensation"])
@pytest.mark.parametrize("point", FAULT_POINTS)
def test_kill_at_every_boundary(
    point: str,
    kind: str,
    database_url: str,
    provider_url: str,
    workers: list[WorkerProcess],
    log_dir: Path,
) -> None:
    """Workers SIGKILLed at `point` of an action or a compensation, again and again: once
    recovered, every saga is settled, nothing ran twice, nothing was lost, and every audit
    trail replays to its saga's state."""
    fault = f"{point}:{kind}"
    seed = zlib.crc32(fault.encode())
    keys = start_sagas(database_url, SAGAS_PER_BOUNDARY, seed)
    kills = 0
    for _ in range(KILLS):
        worker = WorkerProcess(database_url, provider_url, log_dir, fault=fault, lease_seconds=1.0)
        workers.append(worker)
        code = worker.wait(timeout=60)
        assert code in (0, -signal.SIGKILL), worker.output()[-3000:]
        if code == 0:
            break  # nothing left that reaches this boundary
        kills += 1
    assert kills >= 1, f"no worker reached {fault}"

    quiesce(database_url, timeout=60)

    summary = invariants.check(database_url, provider_url, keys)
    print(invariants.table(summary, kills=kills))
    summary.assert_ok()
    assert summary.sagas == SAGAS_PER_BOUNDARY
