"""A DBA's `statement_timeout` and `lock_timeout` (2 s) cut the workers' statements: each
cut is a transient error, retried like a lost connection, and no saga is stranded."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from faults import invariants
from faults.harness import WorkerProcess, quiesce, scalar, settled_count, start_sagas

pytestmark = [pytest.mark.integration, pytest.mark.crash]

SAGAS = 30
HOLD_SECONDS = 3.0  # longer than the DBA's 2 s: whatever waits for these rows is cut


def _set_server_timeouts(database_url: str) -> None:
    with psycopg.connect(database_url, autocommit=True) as conn:
        dbname = conn.info.dbname
        for setting in ("statement_timeout", "lock_timeout"):
            conn.execute(
                sql.SQL("ALTER DATABASE {} SET {} = '2s'").format(
                    sql.Identifier(dbname), sql.Identifier(setting)
                )
            )


def _hold_running_rows(database_url: str, stop: threading.Event, holds: list[int]) -> None:
    """Lock the rows of sagas being driven, HOLD_SECONDS at a time: the workers' heartbeats
    and writes on them wait, and the server cuts them at 2 s."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("SET statement_timeout = 0")
        while not stop.is_set():
            with conn.transaction():
                rows = conn.execute(
                    "SELECT id FROM saga.sagas WHERE lease_expires_at > now()"
                    " ORDER BY random() LIMIT 3 FOR UPDATE SKIP LOCKED"
                ).fetchall()
                if rows:
                    holds.append(len(rows))
                    stop.wait(HOLD_SECONDS)
            stop.wait(0.3)


@pytest.mark.parametrize("through", ["direct", "pgbouncer"])
def test_statements_cut_by_the_server_strand_no_saga(
    through: str,
    database_url: str,
    provider_url: str,
    workers: list[WorkerProcess],
    log_dir: Path,
    request: pytest.FixtureRequest,
) -> None:
    _set_server_timeouts(database_url)
    url = database_url if through == "direct" else str(request.getfixturevalue("pooled_url"))
    assert scalar(url, "SHOW statement_timeout") == "2s"
    keys = start_sagas(url, SAGAS, seed=21, prefix=f"timeout-{through}")
    stop = threading.Event()
    holds: list[int] = []
    holder = threading.Thread(target=_hold_running_rows, args=(database_url, stop, holds))
    for _ in range(2):
        workers.append(WorkerProcess(url, provider_url, log_dir, lease_seconds=5.0, step_delay=0.3))
    holder.start()
    try:
        deadline = time.monotonic() + 120
        while settled_count(database_url) < SAGAS and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        stop.set()
        holder.join(30)
    for worker in workers:
        assert worker.wait(timeout=120) == 0, worker.output()[-3000:]
    cuts = sum(
        worker.output().count("canceling statement due to statement timeout")
        + worker.output().count("canceling statement due to lock timeout")
        for worker in workers
    )
    quiesce(url, timeout=60)
    summary = invariants.check(database_url, provider_url, keys)
    print(invariants.table(summary, holds=len(holds), statements_cut=cuts, through=through))
    summary.assert_ok()
    assert summary.sagas == SAGAS
    assert (
        int(
            scalar(
                database_url,
                "SELECT count(*) FROM saga.sagas"
                " WHERE status IN ('pending', 'running', 'compensating')",
            )
        )
        == 0
    )
    assert len(holds) >= 3 and cuts >= 1, (len(holds), cuts)
