"""The fault harness with AsyncWorker processes: SIGKILLs at the step protocol's
boundaries, then a fleet mixing both drivers; and lost replies under async workers."""

from __future__ import annotations

import signal
from pathlib import Path

import psycopg
import pytest

from faults import invariants
from faults.harness import WorkerProcess, quiesce, start_sagas
from faults.proxy import LostReplyProxy
from faults.soak import LOST_REPLY_WRITES, async_slots

pytestmark = [pytest.mark.integration, pytest.mark.crash]

SAGAS = 30
# Compensation points first: a saga reaches them only after a step failed, which the
# armed workers of the action points (each dying at its first match) would leave fewer
# sagas to do.
FAULTS = (
    "before_call:compensation",
    "after_call:compensation",
    "before_record:action",
    "before_call:action",
    "after_call:action",
    "after_record:action",
)


def _performed_by(provider_url: str, pids: set[int]) -> int:
    """Requests the fake provider received from these processes."""
    with psycopg.connect(provider_url) as conn:
        row = conn.execute(
            "SELECT count(*) FROM fault_provider.requests WHERE pid = ANY(%s)", (list(pids),)
        ).fetchone()
    assert row is not None
    return int(row[0])


def _unknown_outcomes(url: str) -> int:
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT count(*) FROM saga.events WHERE event = 'outcome_unknown'")
        found = row.fetchone()
    assert found is not None
    return int(found[0])


def test_soak_async_modes() -> None:
    """SOAK_ASYNC: 0 keeps every worker sync, 1 makes every one async, half every other
    slot (a fleet of two has one of each); anything else is refused."""
    assert async_slots("", 3) == [False, False, False]
    assert async_slots("0", 2) == [False, False]
    assert async_slots("1", 3) == [True, True, True]
    assert async_slots("half", 2) == [False, True]
    assert async_slots("HALF", 5) == [False, True, False, True, False]
    with pytest.raises(SystemExit):
        async_slots("some", 3)


def test_async_workers_killed_at_the_boundaries(
    database_url: str, provider_url: str, workers: list[WorkerProcess], log_dir: Path
) -> None:
    """AsyncWorker processes SIGKILLed at fault points of actions and compensations, one
    after the other on the same sagas, then a fleet of one sync and one async worker
    finishing them: every saga ends completed, compensated or parked with a reason, no
    effect was performed twice, none was lost, and every audit trail replays."""
    keys = start_sagas(database_url, SAGAS, seed="async-kills", prefix="ak")
    kills: list[str] = []
    for fault in FAULTS:
        worker = WorkerProcess(
            database_url,
            provider_url,
            log_dir,
            fault=fault,
            lease_seconds=1.0,
            async_worker=True,
        )
        workers.append(worker)
        code = worker.wait(timeout=60)
        assert code in (0, -signal.SIGKILL), worker.output()[-3000:]
        assert "(asyncio)" in worker.output(), worker.output()[-3000:]
        if code == -signal.SIGKILL:
            kills.append(fault)
    # Sagas are left at every action point (one kill stops a worker at its first match);
    # the compensation points need a failed step, which some sagas of this seed have.
    assert {f for f in FAULTS if f.endswith(":action")} <= set(kills), kills
    assert any(f.endswith(":compensation") for f in kills), kills

    fleet = [
        WorkerProcess(database_url, provider_url, log_dir, lease_seconds=1.0, async_worker=is_async)
        for is_async in async_slots("half", 2)
    ]
    workers.extend(fleet)
    for worker in fleet:
        assert worker.wait(timeout=120) == 0, worker.output()[-3000:]
    quiesce(database_url, timeout=60)

    async_pids = {w.pid for w in workers if w.async_worker}
    assert _performed_by(provider_url, async_pids) > 0
    summary = invariants.check(database_url, provider_url, keys)
    print(invariants.table(summary, kills=len(kills)))
    summary.assert_ok()
    assert summary.sagas == SAGAS
    assert sum(summary.statuses.values()) == SAGAS


def test_async_workers_ride_out_lost_replies(
    database_url: str, provider_url: str, workers: list[WorkerProcess], log_dir: Path
) -> None:
    """Two AsyncWorker processes reach PostgreSQL through the lost-reply proxy, which
    loses the reply of about one write in fifteen after it committed. Every saga settles
    by itself, the invariants hold, and since no process died no attempt was taken for
    unknown: every lost reply was recognised as a landed commit."""
    keys = start_sagas(database_url, SAGAS, seed=23, prefix="alost")
    with LostReplyProxy(database_url, seed=23) as proxy:
        for statement in LOST_REPLY_WRITES:
            proxy.lose_reply(statement, times=None, probability=1 / 15)
        for _ in range(2):
            workers.append(
                WorkerProcess(
                    proxy.url,
                    provider_url,
                    log_dir,
                    lease_seconds=3.0,
                    concurrency=3,
                    async_worker=True,
                )
            )
        for worker in workers:
            assert worker.wait(timeout=240) == 0, worker.output()[-3000:]
        lost = proxy.lost_replies()
    quiesce(database_url, timeout=30)
    summary = invariants.check(database_url, provider_url, keys)
    print(invariants.table(summary, lost_replies=len(lost)))
    summary.assert_ok()
    assert summary.sagas == SAGAS
    assert _performed_by(provider_url, {w.pid for w in workers}) > 0
    assert len(lost) >= 5, f"only {len(lost)} replies were lost"
    assert any("write_saga" in r.statement for r in lost)
    assert _unknown_outcomes(database_url) == 0
