"""An orchestrator's connections: the way to the server checked, the schema migrated, and a
store on a pool of its own.

`saga/_db/pool_async.py` is the source; `saga/_db/pool.py` is generated from it by
`tools/async_to_sync.py`.
"""

from __future__ import annotations

from typing import Any

from psycopg import AsyncConnection
from psycopg.rows import tuple_row
from psycopg_pool import AsyncConnectionPool

from saga._db._store_base import sql
from saga._db.database import (
    Route,
    check_connection,
    connection_kwargs,
    transaction_settings,
    unavailable,
)
from saga._db.jsonloads import use_on
from saga._db.migrate import migrate_database
from saga._db.store_async import AsyncStore
from saga.keys import HASH_VERSION

if True:  # ASYNC
    import asyncio

# How long opening the pool may wait for its first connection (seconds).
OPEN_TIMEOUT_SECONDS = 10.0


async def open_store(
    url: str,
    *,
    name: str,
    max_size: int,
    lease_seconds: float,
    prepared_statements: bool | None,
    auto_migrate: bool,
) -> tuple[Route, AsyncStore]:
    """The way to `url` (`check_connection`) and a store on a new pool of at most
    `max_size` connections named `name`, set for that way (`connection_kwargs`,
    `transaction_settings`); the schema migrated first when `auto_migrate`.
    `DatabaseUnavailable` when the pool cannot open."""
    if True:  # ASYNC
        # Blocking work (a connection, a migration), off the loop.
        route = await asyncio.to_thread(check_connection, url)
        if auto_migrate:
            await asyncio.to_thread(migrate_database, url)
    else:
        route = check_connection(url)
        if auto_migrate:
            migrate_database(url)
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        url,
        min_size=1,
        max_size=max_size,
        kwargs=connection_kwargs(url, lease_seconds, route, prepared_statements),
        open=False,
        name=name,
        configure=_configure,
    )
    try:
        await pool.open(wait=True, timeout=OPEN_TIMEOUT_SECONDS)
        said = not route.pooled and await _session_says_hash_version(pool)
    except Exception as exc:
        await pool.close()
        raise unavailable(url, exc) from None
    return route, AsyncStore(
        pool,
        transaction_settings=transaction_settings(route, lease_seconds),
        session_hash_version=said,
    )


async def _session_says_hash_version(pool: AsyncConnectionPool[Any]) -> bool:
    """Whether the pool's connections carry the request hash version from their startup
    options (`session_options`), so that the store may leave it out of its statements.
    A pooler `behind_pooler` does not detect may drop the options (PgBouncer's
    `ignore_startup_parameters`): its connections say nothing, and the statements keep
    saying the version themselves."""
    async with pool.connection() as conn:
        cur = conn.cursor(row_factory=tuple_row)
        await cur.execute(sql("session_hash_version"))
        row = await cur.fetchone()
    return row is not None and row[0] == str(HASH_VERSION)


async def _configure(conn: AsyncConnection[Any]) -> None:
    """A new connection of the pool reads JSON with orjson where that reads it as the
    json module does (`saga._db.jsonloads`)."""
    use_on(conn)
