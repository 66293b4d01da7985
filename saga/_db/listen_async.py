"""The connection of its own that LISTENs for runnable sagas: the workers' wake-ups and
the dashboard's live updates.

The orchestrator NOTIFYs `CHANNEL` when a saga becomes runnable by any worker (started,
resumed by an operator, handed back). LISTEN needs a session of its own on the server, so
the connection is opened apart from the pool, in autocommit and without prepared
statements: the URL may be a transaction pooler's, whose server sessions keep none for
us (and where LISTEN is of no use: `Listener.behind_pooler` tells). `saga/_db/listen.py` is
generated from this source by `tools/async_to_sync.py`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import psycopg
from psycopg import sql

from saga._db.database import behind_pooler_async
from saga._db.sqlfiles import load_queries

CHANNEL = "saga_runnable"

_SQL = load_queries("connections.sql")
_LISTEN = sql.SQL(_SQL["listen"]).format(channel=sql.Identifier(CHANNEL))
_MARKER = sql.SQL(_SQL["change_marker"])
_FALLBACK_MARKER = sql.SQL(_SQL["change_marker_fallback"])


def connection_failed(exc: BaseException) -> bool:
    """Whether `exc` is the database's or the network's: the listener's connection could
    not be made, or was lost, or a statement on it failed."""
    return isinstance(exc, psycopg.Error | OSError)


def unparsable_url(exc: BaseException) -> bool:
    """Whether `exc`, from connecting, is the driver's refusal of the URL itself (it does
    not parse): trying again never helps."""
    return isinstance(exc, psycopg.ProgrammingError)


def marker_refused(exc: BaseException) -> bool:
    """Whether `exc`, from `Listener.change_marker`, says the role may not read it."""
    return isinstance(exc, psycopg.errors.InsufficientPrivilege)


class AsyncListener:
    """A connection opened by `listening`: LISTEN on it, wait for notifications, read
    what tells that the saga tables changed."""

    def __init__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        self._conn = conn

    async def behind_pooler(self) -> bool:
        """Whether a connection pooler answers rather than PostgreSQL itself: the server
        session may change between two transactions, and a LISTEN would be lost."""
        return await behind_pooler_async(self._conn)

    async def listen(self) -> None:
        """LISTEN on `CHANNEL`."""
        await self._conn.execute(_LISTEN)

    async def notified(self, timeout: float) -> bool:
        """Wait for a notification, `timeout` seconds at most; whether one came."""
        notified = False
        # The generator ends after one notification (or the timeout): it holds the
        # connection's lock until then, so it is run to its end.
        async for _ in self._conn.notifies(timeout=timeout, stop_after=1):
            notified = True
        return notified

    async def change_marker(self, *, fallback: bool = False) -> Any:
        """A value that moves whenever the saga tables may have changed: the last value of
        the audit events' id sequence (every transition appends an event), or, with
        `fallback`, the latest `updated_at` of the sagas (for a role that may not read the
        sequence: `marker_refused`; that read scans the table)."""
        cur = await self._conn.execute(_FALLBACK_MARKER if fallback else _MARKER)
        return await cur.fetchone()


@asynccontextmanager
async def listening(url: str) -> AsyncIterator[AsyncListener]:
    """A connection of its own to the database at `url` (see the module's docstring),
    closed when the block ends."""
    conn = await psycopg.AsyncConnection.connect(url, autocommit=True, prepare_threshold=None)
    async with conn:
        yield AsyncListener(conn)
