"""The store's connections: the pool, the transactions and pipelines its methods run in,
and what their answers are read with.

`AsyncStoreConnections` is the base every part of the store builds on (`saga._db.store_async`
puts them together into `AsyncStore`); `saga._db._store_conn` is generated from this module
by tools/async_to_sync.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, Generic, LiteralString, Protocol, TypeVar, cast

import psycopg
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

from saga._core.rows import Loaded
from saga._db._store_base import loaded_from_rows, sql, state_of, translate
from saga.state import SagaState

AConn = psycopg.AsyncConnection[dict[str, Any]]
T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


@asynccontextmanager
async def _translated(conninfo: str) -> AsyncIterator[None]:
    """Raise what PostgreSQL or the pool raised inside the block as the orchestrator's
    error (`translate`); the transaction was rolled back with it."""
    try:
        yield
    except psycopg.Error as exc:
        raise translate(exc, conninfo) from exc


async def sync_pipeline(conn: AConn) -> None:
    """End a pipeline's batch with a Sync and collect its results (the round trip a fetch
    would make anyway). A claim's transaction then waits for its client, which plans the
    first move (user code) with the saga row locked: synced, the server counts that wait
    as idle in transaction, and ends the transaction of a frozen client once it exceeds
    idle_in_transaction_session_timeout (unsynced, the server waits for the rest of the
    batch with no timeout at all)."""
    pipeline = conn._pipeline
    if isinstance(pipeline, psycopg.AsyncPipeline):
        await pipeline.sync()


async def read_loaded(
    saga: psycopg.AsyncCursor[dict[str, Any]],
    ops: psycopg.AsyncCursor[dict[str, Any]],
    confirmations: psycopg.AsyncCursor[dict[str, Any]],
) -> Loaded | None:
    """A saga as its lease holder reads it, from the results of its three reads."""
    return loaded_from_rows(
        await saga.fetchone(), await ops.fetchall(), await confirmations.fetchall()
    )


class DeferredRead(Protocol[T_co]):
    """The answer of a statement queued in a transaction (`save_txn`, `save_batch_txn`,
    `claim_batch_started_txn`), read by calling this once the transaction has committed:
    at once in a plain transaction, after the block in a pipelined one."""

    async def __call__(self) -> T_co: ...


class RowRead(Generic[T]):
    """A `DeferredRead` of a statement that answers in one result row, made into its
    answer by `answer`."""

    __slots__ = ("_answer", "_cursor")

    def __init__(
        self,
        cursor: psycopg.AsyncCursor[dict[str, Any]],
        answer: Callable[[dict[str, Any] | None], T],
    ) -> None:
        self._cursor = cursor
        self._answer = answer

    async def __call__(self) -> T:
        """The statement's answer, from its result row."""
        return self._answer(await self._cursor.fetchone())


def state_answer(row: dict[str, Any] | None) -> SagaState | None:
    """The state saga.write_saga returned, from its result row (see `save_txn`)."""
    return state_of(row["state"] if row else None)


class AsyncStoreConnections:
    """The pool a store reads and writes through, and the connections it hands its methods.

    The pool's connections are in autocommit mode (as the orchestrator makes them): a
    single statement commits on its own, and `transaction` or `pipelined` group several.
    """

    def __init__(
        self,
        pool: AsyncConnectionPool[Any],
        *,
        transaction_settings: dict[str, str] | None = None,
        session_hash_version: bool = False,
    ) -> None:
        self.pool = pool
        # Through a transaction pooler: the timeouts each transaction sets for itself.
        self.transaction_settings = transaction_settings
        # On a direct connection: the session says the request hash version (a startup
        # option, `session_options`), so the writing statements need not (`hashed`).
        self.session_hash_version = session_hash_version
        # The pool's URL, for errors that say which database (never its password).
        self._conninfo = pool.conninfo if isinstance(pool.conninfo, str) else ""

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[AConn]:
        """A connection inside one transaction, committed when the block exits cleanly."""
        async with self._connection() as conn, conn.transaction():
            await self._set_timeouts(conn)
            yield conn

    def hashed(self, name: str) -> LiteralString:
        """The named statement `name`, one that writes operations or sagas, as these
        connections need it. Through a pooler, `name` says the request hash version of the
        rows it writes in the statement (saga.hashed_under, migration 0023), since the
        statement may run in a transaction of its own; on a direct connection whose session
        says it from the start (read when the pool opens) `name`_direct, the same statement
        without saga.hashed_under, is sent."""
        return sql(f"{name}_direct") if self.session_hash_version else sql(name)

    async def _set_timeouts(self, conn: AConn) -> None:
        """The transaction's own timeouts, when the connection may not carry them
        (`transaction_settings`); queued without a round trip in a pipeline."""
        if self.transaction_settings is not None:
            await conn.execute(sql("transaction_settings"), self.transaction_settings)

    @asynccontextmanager
    async def _connection(self) -> AsyncIterator[AConn]:
        # An autocommit connection: one statement is one transaction, and costs no
        # BEGIN and COMMIT of its own (for statements that need no company). Whatever
        # psycopg raises inside leaves as the orchestrator's error (`translate`).
        async with _translated(self._conninfo), self.pool.connection() as conn:
            conn.row_factory = dict_row
            yield cast(AConn, conn)

    @asynccontextmanager
    async def pipelined(self) -> AsyncIterator[AConn]:
        """One transaction sent in a pipeline: statements go out without waiting, and the
        whole of it (BEGIN to COMMIT) costs one round trip unless a result is fetched
        inside. Results of deferred reads are fetched after the block. A failed fence check
        (`assert_fence_txn`, or a fenced `save_txn`) becomes `LeaseLost`, with everything
        queued rolled back."""
        async with self._connection() as conn, conn.pipeline(), conn.transaction():
            await self._set_timeouts(conn)
            yield conn
