"""When the dashboard's pages may be out of date: PostgreSQL's `LISTEN/NOTIFY` and a
cheap poll, shared by every open page.

The orchestrator NOTIFYs (channel `saga_runnable`, see `saga._db.listen_async`) only when a
saga becomes runnable by any worker: a saga started, resumed by an operator, or handed
back. A saga that completes, compensates or parks, or a step that succeeds while its
worker keeps the lease, sends nothing. So the feed also polls, every `poll_seconds`, the
last value of the audit events' id sequence: every transition appends an event, and that
read costs the same however many sagas and events there are (`max(updated_at)` of the
sagas would scan the table: no index has it). A role that may not read the sequence
falls back to that `max(updated_at)`, and the log says what to grant instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from typing import Any

import structlog

from saga._db.listen_async import AsyncListener, connection_failed, listening, marker_refused

_log = structlog.get_logger("saga.web")

# Longest wait (seconds) between two attempts to reconnect the listener.
_RETRY_MAX_SECONDS = 5.0
# Notifications closer together than this (seconds) wake the pages once.
_COALESCE_SECONDS = 0.25


class ChangeFeed:
    """A counter that grows whenever the saga tables may have changed, and the waits of
    the pages' streams on it. `run()` drives it (one connection, LISTEN and poll) until
    `close()`."""

    def __init__(self, database_url: str, *, poll_seconds: float = 1.0) -> None:
        if not poll_seconds > 0 or math.isinf(poll_seconds):
            raise ValueError(f"poll_seconds must be a positive number, got {poll_seconds!r}")
        self._url = database_url
        self.poll_seconds = poll_seconds
        self.generation = 0
        self.listening = False
        self._said_polling = False
        self.closed = False
        # Set, and replaced by a fresh one, at each change: a wait holds no lock, so a
        # page's stream cancelled mid-wait (its client gone) leaves nothing behind.
        self._changed = asyncio.Event()
        # Set when the role may not read the audit events' id sequence.
        self._fallback = False

    async def wait(self, seen: int, timeout: float) -> int:
        """The generation once it is past `seen`, or after `timeout` seconds, or when
        the feed closes (whichever comes first)."""
        if self.generation == seen and not self.closed:
            changed = self._changed
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await changed.wait()
        return self.generation

    async def close(self) -> None:
        """Stop: `run()` returns and every wait ends."""
        self.closed = True
        self._bump()

    def _bump(self) -> None:
        self.generation += 1
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def run(self) -> None:
        """LISTEN and poll until `close()`; reconnects with a bounded backoff when the
        connection fails (the pages still refresh on their own timer meanwhile)."""
        delay = 0.25
        while not self.closed:
            try:
                await self._listen()
            except Exception as exc:
                if not connection_failed(exc):
                    raise
                self.listening = False
                if self.closed:
                    return
                _log.warning("dashboard_listener_reconnecting", error=str(exc), in_seconds=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, _RETRY_MAX_SECONDS)
            else:
                delay = 0.25

    async def _listen(self) -> None:
        # A connection that prepares no statement: the marker query runs every poll, and the
        # URL may be a transaction pooler's, whose server sessions do not keep them for us.
        async with listening(self._url) as conn:
            if await conn.behind_pooler():
                # A transaction pooler keeps no session for LISTEN: the marker's polling
                # alone tells the pages when to refresh (the feed says "polling").
                if not self._said_polling:
                    self._said_polling = True
                    _log.warning(
                        "dashboard_listen_unavailable",
                        reason="a connection pooler answers on the database URL; the "
                        "pages refresh by polling",
                        polling_seconds=self.poll_seconds,
                    )
            else:
                await conn.listen()
                self.listening = True
            marker = await self._read_marker(conn)
            self._bump()  # anything missed while not listening
            # A sequence value is taken before its transaction commits: after a change,
            # wake the pages once more, so they read what has committed since.
            settling = False
            while not self.closed:
                notified = await conn.notified(self.poll_seconds)
                latest = await self._read_marker(conn)
                changed, marker = latest != marker, latest
                if notified or changed or settling:
                    self._bump()
                settling = changed or notified
                if notified:
                    await asyncio.sleep(_COALESCE_SECONDS)

    async def _read_marker(self, conn: AsyncListener) -> Any:
        try:
            return await conn.change_marker(fallback=self._fallback)
        except Exception as exc:
            if self._fallback or not marker_refused(exc):
                raise
            _log.warning(
                "dashboard_marker_fallback",
                reason="may not read saga.events_id_seq; polling max(updated_at) of "
                "saga.sagas instead, which scans the table",
                fix="GRANT SELECT ON SEQUENCE saga.events_id_seq TO <the dashboard's role>",
            )
            self._fallback = True
            return await conn.change_marker(fallback=True)
