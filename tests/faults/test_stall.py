"""A stalled worker (SIGSTOP) loses its leases to another, then resumes (SIGCONT):
its late writes are refused by the fence."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from faults import invariants
from faults.harness import WorkerProcess, quiesce, scalar, start_sagas, wait_for
from saga import Orchestrator

pytestmark = [pytest.mark.integration, pytest.mark.crash]

SAGAS = 30
OWNER = "stalled-worker"


def _in_flight(url: str) -> list[str]:
    """Sagas the stalled worker holds with an attempt running."""
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT DISTINCT s.id::text FROM saga.sagas s JOIN saga.operations o"
            " ON o.saga_id = s.id WHERE s.lease_owner = %s AND o.status = 'running'",
            (OWNER,),
        ).fetchall()
    return [r[0] for r in rows]


def _open_transactions(url: str) -> int:
    return int(
        scalar(
            url,
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid() AND xact_start IS NOT NULL",
        )
    )


def _mid_call(url: str, pid: int) -> int:
    """Attempts the stalled worker has in flight inside their function: recorded running a
    while ago (its steps sleep 0.4 s before they call the provider), and not yet at
    the provider. An attempt recorded just now may not have been called yet: frozen there,
    it is never called once thawed, since its owner confirms the lease before a call."""
    return int(
        scalar(
            url,
            "SELECT count(*) FROM saga.sagas s JOIN saga.operations o ON o.saga_id = s.id"
            " WHERE s.lease_owner = %s AND o.status = 'running'"
            " AND o.started_at < now() - interval '100 milliseconds' AND NOT EXISTS ("
            " SELECT 1 FROM fault_provider.requests r WHERE r.idempotency_key ="
            " o.idempotency_key AND r.attempt = o.attempts AND r.pid = %s)",
            (OWNER, pid),
        )
    )


def _freeze_between_transactions(worker: WorkerProcess, url: str) -> None:
    """SIGSTOP the worker at a moment it has no transaction open (so it holds no row
    lock another worker would wait for), with attempts in flight of which one at least is
    inside its function and has not called the provider yet (so the thawed worker calls it
    late: on a loaded machine the freeze can otherwise land just after every call, between
    it and the write of its outcome, or just before one, which the thawed worker then
    never makes)."""
    for _ in range(200):
        wait_for(lambda: _in_flight(url), timeout=30, what="attempts in flight")
        worker.signal(signal.SIGSTOP)
        time.sleep(0.05)
        if _open_transactions(url) == 0 and _in_flight(url) and _mid_call(url, worker.pid):
            return
        worker.signal(signal.SIGCONT)
        time.sleep(0.02)
    raise AssertionError("could not freeze the worker between two transactions")


def _snapshot(orch: Orchestrator, ids: list[str]) -> dict[str, Any]:
    return {i: (orch.get(i).model_dump(), len(orch.history(i))) for i in ids}


def test_stalled_worker_is_fenced_out(
    database_url: str, provider_url: str, workers: list[WorkerProcess], log_dir: Path
) -> None:
    """A worker frozen mid-step past its lease: another worker takes its sagas over and
    finishes them; once thawed, the frozen worker's steps complete at the provider (which
    dedupes or refuses them) but every write it attempts is refused by the fence, so
    nothing it had in flight changes; the invariants hold."""
    keys = start_sagas(database_url, SAGAS, seed=5, prefix="stall")
    stalled = WorkerProcess(
        database_url, provider_url, log_dir, owner=OWNER, lease_seconds=1.0, step_delay=0.4
    )
    workers.append(stalled)
    _freeze_between_transactions(stalled, database_url)
    frozen = _in_flight(database_url)
    wait_for(
        lambda: (
            scalar(
                database_url,
                "SELECT count(*) FROM saga.sagas"
                " WHERE lease_owner = %s AND lease_expires_at > now()",
                (OWNER,),
            )
            == 0
        ),
        timeout=10,
        what="the frozen worker's leases expire",
    )

    quiesce(database_url, timeout=60)  # another worker takes over and finishes everything
    with Orchestrator(database_url, sagas=(), auto_migrate=False) as orch:
        before = _snapshot(orch, frozen)
        thawed_at = scalar(database_url, "SELECT now()")
        stalled.signal(signal.SIGCONT)
        assert stalled.wait(timeout=60) == 0, stalled.output()[-3000:]
        after = _snapshot(orch, frozen)
    assert after == before
    assert "lease_lost" in stalled.output()
    late = scalar(
        database_url,
        "SELECT count(*) FROM fault_provider.requests WHERE pid = %s AND at > %s",
        (stalled.pid, thawed_at),
    )
    assert late >= 1  # the thawed steps did call the provider...
    late_effects = scalar(
        database_url,
        "SELECT count(*) FROM fault_provider.requests WHERE pid = %s AND at > %s"
        " AND performed AND endpoint <> 'plain'",
        (stalled.pid, thawed_at),
    )
    assert late_effects == 0  # ...which deduplicated or refused every one it could

    summary = invariants.check(database_url, provider_url, keys)
    print(invariants.table(summary, frozen_in_flight=len(frozen), late_requests=late))
    summary.assert_ok()
    assert summary.sagas == SAGAS
