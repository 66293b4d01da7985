"""The store's listing reads: what the command, the dashboard and the operator verbs'
lookups show (sagas by filter, a page of operations, audit trails, ids by prefix).
`saga._db._store_reads` is generated from this module by tools/async_to_sync.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from saga._db._store_base import id_bounds, sql, state_from
from saga._db._store_conn_async import AsyncStoreConnections
from saga.state import Confirmation, HistoryEvent, SagaState


class AsyncReadStore(AsyncStoreConnections):
    """Sagas, their operations and their audit trails as the command and the dashboard list
    them."""

    async def list_states(
        self,
        *,
        status: str | None,
        name: str | None,
        tenant_id: str | None,
        limit: int,
        older_than_seconds: float | None = None,
        key: str | None = None,
    ) -> list[SagaState]:
        """Sagas matching the filters, newest first, with their operations; with `key`,
        only those of that business key (read through the key index)."""
        params = {
            "status": status,
            "name": name,
            "tenant_id": tenant_id,
            "limit": limit,
            "older_than_seconds": older_than_seconds,
            "key": key,
        }
        query = sql("list_sagas" if key is None else "list_sagas_by_key")
        async with self.transaction() as conn:
            cur = await conn.execute(query, params)
            rows = await cur.fetchall()
            saga_ids = {"saga_ids": [r["id"] for r in rows]}
            cur = await conn.execute(sql("get_operations_many"), saga_ids)
            ops = await cur.fetchall()
        by_saga: dict[str, list[dict[str, Any]]] = {}
        for op in ops:
            by_saga.setdefault(op["saga_id"], []).append(op)
        return [state_from(r, by_saga.get(r["id"], [])) for r in rows]

    async def get_state_page(
        self, saga_id: str, *, limit: int, offset: int
    ) -> tuple[SagaState, int] | None:
        """The saga with one page of its operations (`limit` of them from `offset`, in
        the order `get_state` gives them), and how many operations it has; None when
        there is no such saga."""
        page = {"saga_id": saga_id, "limit": limit, "offset": offset}
        async with self.transaction() as conn:
            cur = await conn.execute(sql("get_saga"), {"saga_id": saga_id})
            row = await cur.fetchone()
            if row is None:
                return None
            cur = await conn.execute(sql("count_operations"), {"saga_id": saga_id})
            counted = await cur.fetchone()
            cur = await conn.execute(sql("get_operations_page"), page)
            ops = await cur.fetchall()
        return state_from(row, ops), int(counted["total"]) if counted else 0

    async def count_live_claims(self, saga_id: str) -> int:
        """How many calls of the ledger channel `saga_id` are held under a live claim
        (`saga.state.display_status` of a channel whose operations are read a page at a
        time)."""
        async with self._connection() as conn:
            cur = await conn.execute(sql("count_live_claims"), {"saga_id": saga_id})
            row = await cur.fetchone()
        return int(row["total"]) if row else 0

    async def history_of_operations(
        self, saga_id: str, operations: Sequence[tuple[str, str]]
    ) -> list[HistoryEvent]:
        """The audit trail of a saga, oldest first, narrowed to its saga-level events and
        those of `operations` (pairs of step and kind)."""
        params = {
            "saga_id": saga_id,
            "steps": [step for step, _ in operations],
            "kinds": [kind for _, kind in operations],
        }
        async with self._connection() as conn:
            cur = await conn.execute(sql("get_history_of_operations"), params)
            rows = await cur.fetchall()
        return [HistoryEvent.model_validate(r) for r in rows]

    async def confirmations(self, saga_id: str) -> list[Confirmation]:
        """The confirmations of a saga, oldest first."""
        async with self._connection() as conn:
            cur = await conn.execute(sql("get_confirmations"), {"saga_id": saga_id})
            rows = await cur.fetchall()
        return [Confirmation.model_validate({**r, "saga_id": saga_id}) for r in rows]

    async def ids_with_prefix(self, prefix: str, *, limit: int) -> list[str]:
        """Ids of sagas that start with `prefix` (lowercase hex, dashes where a full id has
        them), in id order, at most `limit`; read through the primary key index."""
        low, high = id_bounds(prefix)
        params = {"low": low, "high": high, "pattern": prefix + "%", "limit": limit}
        async with self._connection() as conn:
            cur = await conn.execute(sql("saga_ids_by_prefix"), params)
            rows = await cur.fetchall()
        return [str(r["id"]) for r in rows]

    async def saga_refs(
        self, *, key: str | None = None, ids: Sequence[str] = (), limit: int = 0
    ) -> list[dict[str, Any]]:
        """Id, name, version, tenant_id, key and status of the sagas of business key
        `key` (at most `limit`, newest first), else of the sagas with these `ids`."""
        async with self._connection() as conn:
            if key is not None:
                cur = await conn.execute(sql("saga_refs_by_key"), {"key": key, "limit": limit})
            else:
                cur = await conn.execute(sql("saga_refs_by_id"), {"ids": list(ids)})
            return await cur.fetchall()

    async def in_flight_by_version(self) -> list[tuple[str, int, str, int]]:
        """(name, version, status, how many) of the sagas not ended yet, by name and
        version."""
        async with self._connection() as conn:
            cur = await conn.execute(sql("in_flight_by_version"))
            rows = await cur.fetchall()
        return [(r["name"], int(r["version"]), r["status"], int(r["sagas"])) for r in rows]
