"""The blocking store answers the flows' typed store calls: mypy checks that `Store` has
every `StoreOps` method with a compatible signature (the asyncio twin's coroutines cannot
be checked structurally; tests/unit/test_store_ops.py compares their parameters)."""

from __future__ import annotations

from saga._db.store import Store
from saga._flows.store_ops import StoreOps


def as_store_ops(store: Store) -> StoreOps:
    """`store` as the interface the flows name their calls by."""
    return store
