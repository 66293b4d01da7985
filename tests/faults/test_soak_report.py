"""The soak's account of a worker process that ended on its own: how it ended, its whole
log and every worker's log of the run, kept."""

from __future__ import annotations

from pathlib import Path

import pytest
from psycopg.conninfo import make_conninfo

from faults.harness import WorkerProcess
from faults.soak import exit_reason, worker_exit_report

pytestmark = [pytest.mark.integration]


def test_the_soak_reports_a_worker_that_ended_with_its_reason_and_whole_log(
    database_url: str, provider_url: str, tmp_path: Path, workers: list[WorkerProcess]
) -> None:
    """A worker process that exits on its own (here, given a database that does not
    exist, a refusal it rightly does not wait out) is reported with its exit status, its
    last line (the error) and its whole log, not its last 3,000 characters; its log and
    its fleet's are copied to a directory that outlives the run. (The soak used to print
    the tail of the log, then delete every log with its temporary directory.)"""
    logs = tmp_path / "run-logs"
    (logs / "worker-0-other.log").parent.mkdir(parents=True)
    (logs / "worker-0-other.log").write_text("another worker's log\n")
    url = make_conninfo(database_url, dbname="no_such_soak_db")
    worker = WorkerProcess(url, provider_url, logs, async_worker=True)
    workers.append(worker)
    code = worker.wait(timeout=60)
    assert code == 1, worker.output()
    keep = tmp_path / "kept"

    report = worker_exit_report(worker, code, keep)

    output = worker.output()
    assert output.startswith("FAULT_WORKER ready") and "Traceback" in output
    assert output in report
    head = report.splitlines()[0]
    assert f"worker pid {worker.pid} (asyncio) exited with 1 after" in head, head
    assert "no_such_soak_db" in head and "does not exist" in head, head
    assert sorted(p.name for p in keep.iterdir()) == sorted(p.name for p in logs.iterdir())
    assert (keep / worker.log_path.name).read_text() == output
    assert exit_reason(-9) == "killed by SIGKILL" and exit_reason(-15) == "killed by SIGTERM"
