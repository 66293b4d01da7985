# WARNING: generated from the store's sources in saga/_db by tools/async_to_sync.py:
# edit the source, then run `python tools/async_to_sync.py`. CI fails on any difference.
"""The store's methods that flows call, as a typed interface.

A flow names a store call by a reference to one of these methods,
`yield from db(StoreOps.get_state, saga_id)`, never by a string: mypy checks the arguments
against the signature below and hands the result type back to the flow. The drivers call the
method of the same name on their store (`Store`, or the coroutine twin on `AsyncStore`).
These signatures are those of the store's source (see PROTOCOLS in tools/async_to_sync.py),
and tests/unit/test_store_ops.py checks that both stores provide every method here with the
same parameters and annotations.

A `_txn` method runs in the transaction the flow opened with `Begin`; its `conn` is passed
by the driver, so flows call it with `db_txn`, without the connection. A method answering a
`Deferred` returns a read that the flow runs with `Fetch` once the transaction committed.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from datetime import datetime
from typing import Any, Protocol

from saga._core.live_calls import RunningCall
from saga._core.planner import ConfirmationRow, Event, OpRow, SagaRow, StartInSql, Write
from saga._core.rows import Loaded
from saga.state import HistoryEvent, SagaState

# A read deferred until the transaction commits (a coroutine function on `AsyncStore`).
Deferred = Callable[[], Any]


class StoreOps(Protocol):
    """The store's methods the flows use, with the blocking store's signatures."""

    def assert_fence_txn(
        self, conn: Any, saga_id: str, *, owner: str, fence: int, lease_seconds: float
    ) -> None: ...

    def claim_txn(
        self, conn: Any, saga_id: str, *, owner: str, lease_seconds: float
    ) -> Loaded | None: ...

    def claim_next_txn(
        self, conn: Any, *, kinds: Sequence[str], owner: str, lease_seconds: float
    ) -> Loaded | None: ...

    def claim_batch_started_txn(
        self,
        conn: Any,
        *,
        kinds: Sequence[str],
        owner: str,
        lease_seconds: float,
        now: datetime,
        tokens: Sequence[str],
        claim_tokens: Sequence[str],
        starts: Sequence[tuple[str, StartInSql]],
    ) -> Deferred: ...

    def save_batch_txn(
        self, conn: Any, writes: Sequence[tuple[Write, str]], *, owner: str, lease_seconds: float
    ) -> Deferred: ...

    def renew_leases(
        self, held: Collection[tuple[str, int]], *, owner: str, lease_seconds: float
    ) -> set[tuple[str, int]]: ...

    def release_lease(self, saga_id: str, *, owner: str, fence: int) -> None: ...

    def start_saga_txn(
        self,
        conn: Any,
        saga: SagaRow,
        ops: Sequence[OpRow],
        events: Sequence[Event],
        *,
        lease_seconds: float,
        notify: bool,
        token: str | None = None,
    ) -> dict[str, Any]: ...

    def start_saga(
        self,
        saga: SagaRow,
        ops: Sequence[OpRow],
        events: Sequence[Event],
        *,
        lease_seconds: float,
        notify: bool,
        token: str | None = None,
    ) -> dict[str, Any]: ...

    def claim_started(
        self, write: Write, *, start_token: str, owner: str, lease_seconds: float, token: str
    ) -> tuple[bool, SagaState | None]: ...

    def own_claim(self, *, owner: str, token: str) -> tuple[str, str, int] | None: ...

    def own_claims(self, *, owner: str, tokens: Sequence[str]) -> dict[str, str]: ...

    def write_token(self, saga_id: str) -> tuple[str | None, str | None] | None: ...

    def save_txn(
        self,
        conn: Any,
        write: Write,
        *,
        owner: str | None,
        lease_seconds: float | None = None,
        token: str | None = None,
    ) -> Deferred: ...

    def apply_transition(
        self, write: Write, *, owner: str, lease_seconds: float, token: str | None = None
    ) -> SagaState | None: ...

    def report_spend(
        self,
        saga_id: str,
        *,
        step: str,
        kind: str,
        attempt: int,
        total: float,
        owner: str,
        fence: int,
    ) -> bool: ...

    def load_txn(self, conn: Any, saga_id: str) -> Loaded | None: ...

    def get_state(self, saga_id: str) -> SagaState | None: ...

    def get_state_txn(self, conn: Any, saga_id: str) -> SagaState | None: ...

    def history(self, saga_id: str) -> list[HistoryEvent]: ...

    def lock_saga_txn(self, conn: Any, saga_id: str) -> tuple[SagaRow, bool] | None: ...

    def operations_txn(self, conn: Any, saga_id: str) -> list[OpRow]: ...

    def confirmations_txn(self, conn: Any, saga_id: str) -> list[ConfirmationRow]: ...

    def running_calls_txn(self, conn: Any, saga_id: str) -> list[RunningCall]: ...

    def operator_resolved_steps_txn(self, conn: Any, saga_id: str) -> set[str]: ...

    def break_lease_txn(self, conn: Any, saga_id: str) -> int: ...

    def break_claims_txn(self, conn: Any, saga_id: str, steps: Sequence[str]) -> dict[str, int]: ...

    def upgrade_saga_txn(
        self,
        conn: Any,
        saga_id: str,
        version: int,
        drop: Sequence[tuple[str, str]],
        renames: Sequence[tuple[str, str, str, int]],
    ) -> int: ...

    def record_fork_txn(self, conn: Any, source: str, fork: str) -> None: ...
