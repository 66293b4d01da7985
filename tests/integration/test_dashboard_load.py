"""The dashboard (`saga dashboard`, served for real by the command) under load and on
another loopback address: a storm of live-update streams closed at once, SIGTERM with
streams open, the `Host` names it answers to, and the page of a long ledger channel."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psycopg
import pytest
from support import wait_until

from saga import Orchestrator

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
# Streams of the storm: enough to reproduce the lock misuse of the change feed's wait.
STORM = 300
# How long an open page may take to show a change (seconds): the feed polls every second.
UPDATE_SECONDS = 8.0
# How long SIGTERM may take to stop the server with streams open (seconds): the server
# gives open streams 2 s to end, and without that bound it would wait on them forever; the
# rest is the process's own exit, which a loaded machine slows.
STOP_SECONDS = 10.0


@dataclass
class Served:
    """A `saga dashboard` process, the address it printed, and its stderr."""

    process: subprocess.Popen[bytes]
    host: str
    port: int
    log: Path

    @property
    def base(self) -> str:
        return f"http://{self.host}:{self.port}"

    def text(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[object]:
    """Start `saga dashboard --port 0 ...` on a database; every one is stopped after."""
    started: list[Served] = []

    def start(url: str, *args: str, host: str = "127.0.0.1") -> Served:
        log = tmp_path / f"dashboard-{len(started)}.txt"
        env = {k: v for k, v in os.environ.items() if not k.startswith("SAGA_")}
        env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(ROOT)])
        with log.open("wb") as err:
            command = [sys.executable, "-m", "saga", "dashboard", "--port", "0"]
            process = subprocess.Popen(
                [*command, "--database-url", url, "--host", host, *args],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        served = Served(process, host, 0, log)
        started.append(served)
        pattern = rf"http://{re.escape(host)}:(\d+)/"
        found = wait_until(
            lambda: re.search(pattern, served.text()) or process.poll() is not None, timeout=60
        )
        assert process.poll() is None, f"saga dashboard exited: {served.text()}"
        assert isinstance(found, re.Match)
        served.port = int(found.group(1))
        return served

    yield start
    for served in started:
        if served.process.poll() is None:
            served.process.kill()
            served.process.wait(10)


class _Stream:
    """One server-sent events stream, read on a raw socket (a few hundred of these are
    much lighter than as many HTTP clients)."""

    def __init__(self, served: Served, path: str) -> None:
        self.served = served
        self.path = path
        self.received = b""
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self._reader, self._writer = await asyncio.open_connection(
            self.served.host, self.served.port
        )
        host = f"{self.served.host}:{self.served.port}"
        self._writer.write(f"GET {self.path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        await self._writer.drain()

    async def until(self, event: bytes, timeout: float) -> bool:
        """Read until `event: <event>` arrives (True) or `timeout` seconds pass."""
        assert self._reader is not None
        deadline = time.monotonic() + timeout
        while b"event: " + event not in self.received:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                chunk = await asyncio.wait_for(self._reader.read(65536), left)
            except TimeoutError:
                return False
            if not chunk:
                return False
            self.received += chunk
        return True

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.transport.abort()


async def _storm(served: Served, path: str, count: int) -> int:
    """Open `count` streams, and close them all at once when half have been answered;
    how many had been answered."""
    streams = [_Stream(served, path) for _ in range(count)]
    answered = 0
    half = asyncio.Event()

    async def one(stream: _Stream) -> None:
        nonlocal answered
        await stream.open()
        if await stream.until(b"status", 60):
            answered += 1
            if answered >= count // 2:
                half.set()

    tasks = [asyncio.create_task(one(s)) for s in streams]
    try:
        await asyncio.wait_for(half.wait(), 90)
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.abort()
        await asyncio.gather(*tasks, return_exceptions=True)
    return answered


async def _update_after_change(served: Served, path: str, change: object) -> float | None:
    """Seconds a fresh stream takes to show an update after `change()`; None when none
    came within UPDATE_SECONDS."""
    stream = _Stream(served, path)
    await stream.open()
    try:
        assert await stream.until(b"status", 15), stream.received.decode(errors="replace")
        stream.received = b""
        assert callable(change)
        await asyncio.to_thread(change)
        started = time.monotonic()
        if not await stream.until(b"update", UPDATE_SECONDS):
            return None
        return time.monotonic() - started
    finally:
        stream.abort()


def _stop(served: Served) -> float:
    """Seconds SIGTERM takes to stop the server (it must exit cleanly)."""
    started = time.monotonic()
    served.process.send_signal(signal.SIGTERM)
    try:
        served.process.wait(15)
    except subprocess.TimeoutExpired:
        pytest.fail(f"SIGTERM left saga dashboard running 15 s later:\n{served.text()[-3000:]}")
    took = time.monotonic() - started
    assert served.process.returncode == 0, served.text()
    return took


def test_a_storm_of_streams_closed_at_once_leaves_live_updates_and_sigterm_working(
    database_url: str, serve: object
) -> None:
    with Orchestrator(database_url) as orch:
        call = orch.ledger.claim("storm", "charge:1", "charge", {"amount_cents": 100})
        orch.ledger.complete(call, {"charge_id": "ch-1"})
        assert callable(serve)
        served: Served = serve(database_url)
        path = f"/sagas/{call.saga_id}/stream"

        answered = asyncio.run(_storm(served, path, STORM))
        assert answered >= STORM // 2

        def change() -> None:
            orch.ledger.claim("storm", "charge:2", "charge", {"amount_cents": 200})

        took = asyncio.run(_update_after_change(served, path, change))
        log = served.text()
        assert "Lock is not acquired" not in log, log[-3000:]
        assert "Traceback" not in log, log[-3000:]
        assert took is not None, f"no update within {UPDATE_SECONDS}s of a change"

        async def stop_with_streams_open() -> float:
            streams = [_Stream(served, path) for _ in range(20)]
            for stream in streams:
                await stream.open()
            try:
                for stream in streams:
                    assert await stream.until(b"status", 15)
                return await asyncio.to_thread(_stop, served)
            finally:
                for stream in streams:
                    stream.abort()

        stopped_in = asyncio.run(stop_with_streams_open())
        assert stopped_in < STOP_SECONDS, f"SIGTERM took {stopped_in:.1f}s"
        assert "saga dashboard: stopped" in served.text()


def test_on_another_loopback_address_it_answers_its_own_host_and_refuses_others(
    database_url: str, serve: object
) -> None:
    assert callable(serve)
    served: Served = serve(database_url, host="127.0.0.2")
    assert f"http://127.0.0.2:{served.port}/" in served.text()
    page = httpx.get(served.base + "/", timeout=10)
    assert page.status_code == 200, page.text
    assert 'data-stream="/stream' in page.text
    for foreign in ("evil.example", f"evil.example:{served.port}", "127.0.0.3"):
        refused = httpx.get(served.base + "/", headers={"Host": foreign}, timeout=10)
        assert refused.status_code == 400, (foreign, refused.status_code)
    # The loopback names a browser on this machine may use still work.
    for name in ("localhost", "127.0.0.1"):
        ok = httpx.get(served.base + "/", headers={"Host": f"{name}:{served.port}"}, timeout=10)
        assert ok.status_code == 200, (name, ok.status_code)
    assert _stop(served) < STOP_SECONDS


# The calls of the long channel, and how many a page of it shows.
LONG_CHANNEL = 2000
PER_PAGE = 100
# Between the first and last positions of a page's operations.
DASH = "\N{EN DASH}"


def _long_channel(url: str, calls: int) -> str:
    """A ledger channel of `calls` settled calls; its saga id. One call is made through
    the ledger, the others are copies of it (its operation and its events, each under a
    step and key of its own) made in SQL: through the API, 2,000 calls take 20 s here."""
    with Orchestrator(url) as orch:
        call = orch.ledger.claim("long", "charge:0", "charge", {"amount_cents": 100})
        orch.ledger.complete(call, {"charge_id": "ch-0"})
    with psycopg.connect(url) as conn:
        conn.execute(
            """
            INSERT INTO saga.operations
            SELECT (jsonb_populate_record(o, jsonb_build_object(
                       'step', o.step || '-' || n,
                       'position', o.position + n,
                       'idempotency_key', o.idempotency_key || '-' || n))).*
            FROM saga.operations AS o, generate_series(1, %(copies)s) AS n
            WHERE o.saga_id = %(saga_id)s
            """,
            {"copies": calls - 1, "saga_id": call.saga_id},
        )
        conn.execute(
            """
            INSERT INTO saga.events (saga_id, at, event, step, kind, attempt, detail)
            SELECT e.saga_id, e.at, e.event, e.step || '-' || n, e.kind, e.attempt, e.detail
            FROM saga.events AS e, generate_series(1, %(copies)s) AS n
            WHERE e.saga_id = %(saga_id)s AND e.step IS NOT NULL
            ORDER BY n, e.id
            """,
            {"copies": calls - 1, "saga_id": call.saga_id},
        )
    return call.saga_id


def _operation_steps(html: str) -> list[str]:
    return re.findall(r'<tr id="[^"]*" data-step="([^"]*)" data-kind="action">', html)


def test_the_page_of_a_long_ledger_channel_shows_one_page_of_its_calls(
    database_url: str, serve: object
) -> None:
    saga_id = _long_channel(database_url, LONG_CHANNEL)
    assert callable(serve)
    served: Served = serve(database_url)
    started = time.monotonic()
    first = httpx.get(f"{served.base}/sagas/{saga_id}", timeout=60)
    took = time.monotonic() - started
    assert first.status_code == 200, first.text[:2000]
    # The whole channel on one page weighed 5 MB and took 3 s.
    assert len(first.content) < 600_000, len(first.content)
    assert took < 2.0, took
    steps = _operation_steps(first.text)
    assert len(steps) == PER_PAGE
    assert f"operations 1{DASH}{PER_PAGE} of {LONG_CHANNEL}, page 1 of 20" in first.text
    assert 'href="?page=2" rel="next"' in first.text
    assert 'rel="prev"' not in first.text
    # The audit trail follows the page: two events per call shown, and the saga's own.
    assert first.text.count('class="event-row"') < 3 * PER_PAGE

    last = httpx.get(f"{served.base}/sagas/{saga_id}?page=20", timeout=60)
    assert last.status_code == 200
    later_steps = _operation_steps(last.text)
    assert len(later_steps) == PER_PAGE
    assert not set(steps) & set(later_steps)
    assert any(step.endswith(f"-{LONG_CHANNEL - 1}") for step in later_steps)
    shown = f"operations {LONG_CHANNEL - PER_PAGE + 1}{DASH}{LONG_CHANNEL} of {LONG_CHANNEL}"
    assert shown in last.text
    assert 'href="?page=19" rel="prev"' in last.text
    assert 'rel="next"' not in last.text

    # A page past the last, or not a page number: said, not a stack trace.
    past = httpx.get(f"{served.base}/sagas/{saga_id}?page=21", timeout=60)
    assert past.status_code == 404
    assert f"has {LONG_CHANNEL} operations on 20 pages" in past.text
    assert httpx.get(f"{served.base}/sagas/{saga_id}?page=x", timeout=60).status_code == 400

    # The page's stream keeps the page: its updates show the same calls.
    stream_url = re.search(r'data-stream="([^"]*)"', last.text)
    assert stream_url is not None and "page=20" in stream_url.group(1)

    async def first_update() -> str:
        stream = _Stream(served, f"/sagas/{saga_id}/stream?page=20")
        await stream.open()
        try:
            # The update, then the status line that follows it: the update has all come.
            assert await stream.until(b"update", 15), stream.received[-2000:]
            assert await stream.until(b"status", 15), stream.received[-2000:]
            return stream.received.decode(errors="replace")
        finally:
            stream.abort()

    update = asyncio.run(first_update())
    assert any(step.endswith(f"-{LONG_CHANNEL - 1}") for step in _operation_steps(update))

    # A call claimed now is on the last page; the first page says the channel is open.
    assert re.search(r'id="saga-status"[^>]*>idle<', first.text), first.text[:2000]
    with Orchestrator(database_url) as orch:
        orch.ledger.claim("long", "charge:new", "charge", {"amount_cents": 1})
    held = httpx.get(f"{served.base}/sagas/{saga_id}", timeout=60)
    assert re.search(r'id="saga-status"[^>]*>open<', held.text), held.text[:2000]
    assert _stop(served) < STOP_SECONDS
