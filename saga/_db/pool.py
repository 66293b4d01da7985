# WARNING: generated from saga/_db/pool_async.py by tools/async_to_sync.py:
# edit the source, then run `python tools/async_to_sync.py`. CI fails on any difference.
"""An orchestrator's connections: the way to the server checked, the schema migrated, and a
store on a pool of its own.

`saga/_db/pool_async.py` is the source; `saga/_db/pool.py` is generated from it by
`tools/async_to_sync.py`.
"""

from __future__ import annotations

from typing import Any

from psycopg import Connection
from psycopg_pool import ConnectionPool

from saga._db.database import (
    Route,
    check_connection,
    connection_kwargs,
    transaction_settings,
    unavailable,
)
from saga._db.jsonloads import use_on
from saga._db.migrate import migrate_database
from saga._db.store import Store

# How long opening the pool may wait for its first connection (seconds).
OPEN_TIMEOUT_SECONDS = 10.0


def open_store(
    url: str,
    *,
    name: str,
    max_size: int,
    lease_seconds: float,
    prepared_statements: bool | None,
    auto_migrate: bool,
) -> tuple[Route, Store]:
    """The way to `url` (`check_connection`) and a store on a new pool of at most
    `max_size` connections named `name`, set for that way (`connection_kwargs`,
    `transaction_settings`); the schema migrated first when `auto_migrate`.
    `DatabaseUnavailable` when the pool cannot open."""
    route = check_connection(url)
    if auto_migrate:
        migrate_database(url)
    pool: ConnectionPool[Any] = ConnectionPool(
        url,
        min_size=1,
        max_size=max_size,
        kwargs=connection_kwargs(url, lease_seconds, route, prepared_statements),
        open=False,
        name=name,
        configure=_configure,
    )
    try:
        pool.open(wait=True, timeout=OPEN_TIMEOUT_SECONDS)
    except Exception as exc:
        pool.close()
        raise unavailable(url, exc) from None
    return route, Store(pool, transaction_settings=transaction_settings(route, lease_seconds))


def _configure(conn: Connection[Any]) -> None:
    """A new connection of the pool reads JSON with orjson where that reads it as the
    json module does (`saga._db.jsonloads`)."""
    use_on(conn)
