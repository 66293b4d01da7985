"""The store's part the operator verbs run in their transaction: the saga row locked,
leases and claims broken, upgrades, forks, and the rows a verb plans from. The flows name
these methods in `saga._flows.store_ops.StoreOps` (generated from this module and
`_store_drive_async`); `saga._db._store_verbs` is generated from this module by
tools/async_to_sync.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import psycopg

from saga._core.live_calls import RunningCall
from saga._core.planner import ConfirmationRow, OpRow, SagaRow
from saga._db._store_base import confirmation_row, op_row, saga_row, sql, upgrade_params
from saga._db._store_conn_async import AConn, AsyncStoreConnections
from saga.errors import StepStateError


class AsyncVerbStore(AsyncStoreConnections):
    """What an operator verb reads and changes inside its transaction."""

    async def lock_saga_txn(self, conn: AConn, saga_id: str) -> tuple[SagaRow, bool] | None:
        """The saga row locked for an operator change, and whether a live lease holds it.
        `StepStateError` when another transaction holds the row past the lock timeout (a
        lease, see the orchestrator): the saga is busy, and the change is not waited for."""
        try:
            cur = await conn.execute(sql("lock_saga"), {"saga_id": saga_id})
            row = await cur.fetchone()
        except psycopg.errors.LockNotAvailable:
            raise StepStateError(
                f"saga {saga_id} is busy: another transaction has held it locked longer than "
                "the lock timeout (a worker planning its next move, or frozen doing so); "
                "try again"
            ) from None
        if row is None:
            return None
        return saga_row(row), bool(row["live_lease"])

    async def operations_txn(self, conn: AConn, saga_id: str) -> list[OpRow]:
        """The operation rows of a saga."""
        cur = await conn.execute(sql("get_operations"), {"saga_id": saga_id})
        return [op_row(r) for r in await cur.fetchall()]

    async def confirmations_txn(self, conn: AConn, saga_id: str) -> list[ConfirmationRow]:
        """The confirmation rows of a saga."""
        cur = await conn.execute(sql("get_confirmations"), {"saga_id": saga_id})
        return [confirmation_row(r) for r in await cur.fetchall()]

    async def running_calls_txn(self, conn: AConn, saga_id: str) -> list[RunningCall]:
        """The saga's operations left running, with the live claims that hold them."""
        cur = await conn.execute(sql("running_calls"), {"saga_id": saga_id})
        return [RunningCall(**r) for r in await cur.fetchall()]

    async def operator_resolved_steps_txn(self, conn: AConn, saga_id: str) -> set[str]:
        """The steps of the saga whose action an operator resolved as succeeded."""
        cur = await conn.execute(sql("operator_resolved_steps"), {"saga_id": saga_id})
        return {str(r["step"]) for r in await cur.fetchall()}

    async def break_lease_txn(self, conn: AConn, saga_id: str) -> int:
        """End a live lease for an operator: the fence grows, so its holder's writes fail."""
        cur = await conn.execute(sql("break_lease"), {"saga_id": saga_id})
        row = await cur.fetchone()
        assert row is not None  # the caller holds the saga row locked
        return int(row["fence"])

    async def break_claims_txn(
        self, conn: AConn, saga_id: str, steps: Sequence[str]
    ) -> dict[str, int]:
        """End the live claims of these calls for an operator: each fence grows, so the
        holders' writes fail. The new fence of each call, by name."""
        cur = await conn.execute(sql("break_claims"), {"saga_id": saga_id, "steps": list(steps)})
        return {r["step"]: int(r["claim_fence"]) for r in await cur.fetchall()}

    async def upgrade_saga_txn(
        self,
        conn: AConn,
        saga_id: str,
        version: int,
        drop: Sequence[tuple[str, str]],
        renames: Sequence[tuple[str, str, str, int]],
    ) -> int:
        """Move a saga the caller holds locked to `version` (see `saga.upgrade`): delete
        the `drop` rows (kind, step), rename the kept ones (kind, step, new step, new
        position), grow the fence and end any lease. Returns the new fence."""
        for name, params in upgrade_params(saga_id, version, drop, renames):
            await conn.execute(sql(name), params)
        cur = await conn.execute(sql("upgrade_saga"), {"saga_id": saga_id, "version": version})
        row = await cur.fetchone()
        assert row is not None  # the caller holds the saga row locked
        return int(row["fence"])

    async def record_fork_txn(self, conn: AConn, source: str, fork: str) -> None:
        """Make the fork and its source name each other."""
        await conn.execute(sql("record_fork"), {"source": source, "fork": fork})
