"""All SQL of the orchestrator: named queries from sql/queries.sql run over a connection pool.

The store is written once: `AsyncStore` (`saga._db.store_async`, over an
`AsyncConnectionPool`) is the source, and `Store` (`saga._db.store`, over a
`ConnectionPool`) is generated from it by tools/async_to_sync.py; edit the source and
regenerate (CI checks the twin). Its methods come in parts, each a module written the same
way (an asyncio source and its generated twin), by what they serve:

- `_store_conn_async`: the pool, transactions and pipelines every part runs in;
- `_store_drive_async`: the driving loop's claims, leases, starts and writes;
- `_store_verbs_async`: what an operator verb reads and changes in its transaction;
- `_store_reads_async`: the listings of the command and the dashboard;
- this module: the workers' registry, the ledger and the batch jobs.

The flows' typed interface (`saga._flows.store_ops.StoreOps`) is generated from the first
two parts' signatures. What is not I/O (the queries, the mapping of rows and writes, the
translation of errors) is `saga._db._store_base`, which all import.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from saga._db._store_base import gauges_of, ledger_params, settle_query, sql
from saga._db._store_conn_async import AConn as AConn  # what the drivers' calls pass
from saga._db._store_drive_async import AsyncDriveStore
from saga._db._store_reads_async import AsyncReadStore
from saga._db._store_verbs_async import AsyncVerbStore
from saga._db.roles import RoleKind, check_privileges, privileges_query
from saga.state import DatabaseGauges, WorkerInfo


class AsyncStore(AsyncDriveStore, AsyncVerbStore, AsyncReadStore):
    """Reads and writes sagas, operations and events; the only place that speaks SQL.

    The pool's connections are in autocommit mode (as the orchestrator makes them): a
    single statement commits on its own, and `transaction` or `pipelined` group several.
    Its methods come in parts, by what they serve: the driving loop's
    (`saga._db._store_drive_async`), the operator verbs' (`_store_verbs_async`), the
    listings' (`_store_reads_async`); the workers' registry, the ledger and the batch jobs
    are here.
    """

    # ----- workers ---------------------------------------------------------------------

    async def next_claimable_at(self, kinds: Sequence[str]) -> datetime | None:
        """When the earliest saga of these kinds becomes claimable; None when none is open."""
        async with self._connection() as conn:
            cur = await conn.execute(sql("next_claimable_at"), {"kinds": list(kinds)})
            row = await cur.fetchone()
        return row["at"] if row else None

    async def upsert_worker(
        self, *, owner: str, kinds: Sequence[str], concurrency: int, ttl_seconds: float
    ) -> None:
        """Record (or refresh) a live worker and the kinds it runs."""
        params = {
            "owner": owner,
            "kinds": list(kinds),
            "concurrency": concurrency,
            "ttl_seconds": ttl_seconds,
        }
        async with self._connection() as conn:
            await conn.execute(sql("upsert_worker"), params)

    async def delete_worker(self, owner: str) -> None:
        """Remove a stopping worker's row (and long-dead workers' rows)."""
        async with self._connection() as conn:
            await conn.execute(sql("delete_worker"), {"owner": owner})

    async def live_workers(self) -> list[WorkerInfo]:
        """Workers whose heartbeat is still believed, newest first."""
        async with self._connection() as conn:
            cur = await conn.execute(sql("live_workers"))
            rows = await cur.fetchall()
        return [WorkerInfo.model_validate(r) for r in rows]

    async def count_open(self, kinds: Sequence[str]) -> int:
        """How many sagas of these name:version kinds are pending, running or compensating."""
        async with self._connection() as conn:
            cur = await conn.execute(sql("count_open_sagas"), {"kinds": list(kinds)})
            row = await cur.fetchone()
        return int(row["count"]) if row else 0

    async def database_gauges(self) -> list[DatabaseGauges]:
        """What the telemetry's gauges report of the database, per saga name that has
        something to report: parked sagas, unknown outcomes to settle, and the age of the
        longest-waiting claimable saga (one small query; see `database_gauges` in
        sql/queries.sql)."""
        async with self._connection() as conn:
            cur = await conn.execute(sql("database_gauges"))
            rows = await cur.fetchall()
        return gauges_of(rows)

    async def check_privileges(self, kind: RoleKind) -> None:
        """Raise `InsufficientPrivilege` when the connected role lacks what `kind` needs
        (`saga._db.roles`), naming what it lacks and the `saga grant` that gives it."""
        query, params = privileges_query(kind)
        async with self._connection() as conn:
            cur = await conn.execute(query, params)
            rows = await cur.fetchall()
        check_privileges(rows, kind, self._conninfo)

    # ----- the ledger ------------------------------------------------------------------

    async def ledger_claim(self, params: dict[str, Any]) -> dict[str, Any]:
        """Claim one call of a ledger channel (saga.ledger_claim, one statement): the
        verdict row."""
        async with self._connection() as conn:
            cur = await conn.execute(self.hashed("ledger_claim"), ledger_params(params))
            row = await cur.fetchone()
        assert row is not None
        return row

    async def ledger_close(self, params: dict[str, Any]) -> dict[str, Any]:
        """End a ledger channel whose calls are all settled (saga.ledger_close)."""
        async with self._connection() as conn:
            cur = await conn.execute(sql("ledger_close"), params)
            row = await cur.fetchone()
        assert row is not None
        return row

    async def ledger_settle(self, params: dict[str, Any]) -> dict[str, Any]:
        """Record a ledger call's outcome (saga.ledger_settle), or extend its claim without
        shortening it (saga.ledger_heartbeat_v1); `LeaseLost` when the claim is no longer
        the caller's."""
        async with self._connection() as conn:
            cur = await conn.execute(sql(settle_query(params)), ledger_params(params))
            row = await cur.fetchone()
        assert row is not None
        return row

    # ----- batch jobs ------------------------------------------------------------------

    async def find_unsettled(self, kinds: Sequence[str], *, limit: int) -> list[dict[str, Any]]:
        """Runnable sagas of these kinds with an operation running under an expired lease,
        or unknown: id, name, version and that operation's step, kind, status and key."""
        async with self._connection() as conn:
            cur = await conn.execute(
                sql("find_unsettled_sagas"), {"kinds": list(kinds), "limit": limit}
            )
            return await cur.fetchall()

    async def purgeable(
        self, *, retention_seconds: float, limit: int
    ) -> tuple[list[dict[str, Any]], int]:
        """The sagas `purge_finished` would delete with this cutoff, oldest first (at most
        `limit`: id, name, version, status, finished_at), and how many in all."""
        params = {"retention_seconds": retention_seconds, "limit": limit}
        async with self._connection() as conn:
            cur = await conn.execute(sql("list_purgeable_sagas"), params)
            rows = await cur.fetchall()
        return rows, int(rows[0]["total"]) if rows else 0

    async def purge_finished(self, *, retention_seconds: float, batch_size: int) -> int:
        """Delete one batch of sagas that ended before the retention cutoff; how many."""
        params = {"retention_seconds": retention_seconds, "batch_size": batch_size}
        async with self._connection() as conn:
            cur = await conn.execute(sql("purge_finished_sagas"), params)
            row = await cur.fetchone()
        return int(row["purged"]) if row else 0
