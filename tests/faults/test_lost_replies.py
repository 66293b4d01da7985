"""Worker processes whose writes lose their replies at random: nothing twice, nothing lost,
nothing that was never called parked as unknown."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest

from faults import invariants
from faults.harness import WorkerProcess, quiesce, start_sagas
from faults.proxy import LostReplyProxy
from faults.soak import LOST_REPLY_WRITES

pytestmark = [pytest.mark.integration, pytest.mark.crash]

SAGAS = 40


def _unknown_outcomes(url: str) -> list[tuple[str, str, int]]:
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT s.key, e.step, e.attempt FROM saga.events AS e"
            " JOIN saga.sagas AS s ON s.id = e.saga_id WHERE e.event = 'outcome_unknown'"
        ).fetchall()
    return [(str(k), str(s), int(a)) for k, s, a in rows]


def test_workers_ride_out_lost_replies(
    database_url: str, provider_url: str, workers: list[WorkerProcess], log_dir: Path
) -> None:
    """Two worker processes reach PostgreSQL through the lost-reply proxy, which loses
    the reply of about one write in fifteen after it committed. Every saga settles by
    itself; the invariants hold; and since no process died, no attempt was ever taken
    for unknown: every lost reply was recognised as a landed commit."""
    keys = start_sagas(database_url, SAGAS, seed=11, prefix="lost")
    with LostReplyProxy(database_url, seed=11) as proxy:
        for statement in LOST_REPLY_WRITES:
            proxy.lose_reply(statement, times=None, probability=1 / 15)
        for _ in range(2):
            workers.append(
                WorkerProcess(proxy.url, provider_url, log_dir, lease_seconds=3.0, concurrency=3)
            )
        for worker in workers:
            assert worker.wait(timeout=240) == 0, worker.output()[-3000:]
        lost = proxy.lost_replies()
    quiesce(database_url, timeout=30)  # nothing left: the workers finished it all
    summary = invariants.check(database_url, provider_url, keys)
    print(invariants.table(summary, lost_replies=len(lost)))
    summary.assert_ok()
    assert summary.sagas == SAGAS
    assert len(lost) >= 10, f"only {len(lost)} replies were lost"
    assert any("write_saga" in r.statement for r in lost)
    assert _unknown_outcomes(database_url) == []
