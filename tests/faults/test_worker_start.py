"""A worker never exits on its own: one whose database cannot be reached when it starts
(a server restarting, its backends terminated, a network down) waits for it, logging
each try, and then drives its sagas; only a signal or `stop()` ends it."""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from faults.harness import WorkerProcess, scalar, settled_count, start_sagas, wait_for
from faults.proxy import connect_upstream, upstream_address

pytestmark = [pytest.mark.integration]

SAGAS = 4


class _Gate:
    """A TCP front for a PostgreSQL server: while shut, it takes each connection and
    closes it at once (what a client sees when its backend is terminated as it logs in:
    "server closed the connection unexpectedly"); once opened, it forwards."""

    def __init__(self, url: str) -> None:
        self.upstream = upstream_address(url)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = make_conninfo(url, host="127.0.0.1", port=self.listener.getsockname()[1])
        self.opened = threading.Event()
        self.shut_out = 0
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def open(self) -> None:
        self.opened.set()

    def close(self) -> None:
        for sock in [self.listener, *self._socks]:
            with contextlib.suppress(OSError):
                sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self.opened.is_set():
                self.shut_out += 1
                client.close()
                continue
            try:
                server = connect_upstream(self.upstream)
            except OSError:
                client.close()
                continue
            self._socks += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=_pump, args=(a, b), daemon=True).start()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := source.recv(65536):
            sink.sendall(data)
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)


@pytest.fixture
def gate(database_url: str) -> Iterator[_Gate]:
    front = _Gate(database_url)
    yield front
    front.close()


@pytest.mark.parametrize("door", ["sync", "async"])
def test_a_worker_that_cannot_reach_its_database_at_start_waits_for_it(
    database_url: str,
    provider_url: str,
    log_dir: Path,
    workers: list[WorkerProcess],
    gate: _Gate,
    door: str,
) -> None:
    """A worker process started while every connection to its database is cut at once
    stays up, logs `worker_database_unreachable` with backoff, and once the database
    answers drives every saga to its end and exits 0 (`until_idle`). It used to exit 1
    at its first connection (`DatabaseUnavailable: ... server closed the connection
    unexpectedly`): one `make soak` run ended `a worker exited with 1` that way, a
    replacement worker starting while the chaos terminated the backends."""
    keys = start_sagas(database_url, SAGAS, seed=9, prefix="start")
    worker = WorkerProcess(
        gate.url, provider_url, log_dir, until_idle=True, async_worker=door == "async"
    )
    workers.append(worker)

    def retried_twice() -> bool:
        assert worker.alive(), f"the worker exited with {worker.proc.poll()}:\n{worker.output()}"
        return worker.output().count("worker_database_unreachable") >= 2

    wait_for(retried_twice, timeout=30, what="the worker logging its retries")
    assert gate.shut_out >= 2
    gate.open()
    assert worker.wait(timeout=90) == 0, worker.output()[-3000:]
    assert settled_count(database_url) == len(keys)


@pytest.mark.parametrize("door", ["sync", "async"])
def test_an_unexpected_error_of_the_claim_loop_is_logged_and_tried_again(
    database_url: str, provider_url: str, log_dir: Path, workers: list[WorkerProcess], door: str
) -> None:
    """A claim loop failing with an error that is no lost connection (here the workers'
    table renamed away under a running worker: `UndefinedTable`) logs
    `worker_loop_failed` with its traceback and tries again, backing off; once the table is
    back, the worker drives the sagas started meanwhile, and SIGTERM stops it with exit 0.
    It used to raise the error out of `run`: the process exited 1."""
    worker = WorkerProcess(
        database_url, provider_url, log_dir, until_idle=False, async_worker=door == "async"
    )
    workers.append(worker)
    wait_for(
        lambda: scalar(database_url, "SELECT count(*) FROM saga.workers") == 1,
        timeout=30,
        what="the worker announced",
    )
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("ALTER TABLE saga.workers RENAME TO workers_away")
        try:

            def failed_twice() -> bool:
                assert worker.alive(), f"exited with {worker.proc.poll()}:\n{worker.output()}"
                return worker.output().count("worker_loop_failed") >= 2

            wait_for(failed_twice, timeout=30, what="the worker logging its loop's failures")
        finally:
            conn.execute("ALTER TABLE saga.workers_away RENAME TO workers")
    keys = start_sagas(database_url, SAGAS, seed=10, prefix="loop")
    wait_for(
        lambda: worker.alive() and settled_count(database_url) == len(keys),
        timeout=90,
        what="the sagas settled by the same worker",
    )
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0, worker.output()[-3000:]
