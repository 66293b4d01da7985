"""The store is written once, for asyncio, and its sync twin is generated: on the same
rows, `AsyncStore` answers every reader of the CLI, the dashboard and the operator jobs as
`Store` does, including those the sync store alone had before they shared one source."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import cli_app
from cli_app import Job
from support import OrchestratorFactory
from test_cli import _park_unknown

from saga import AsyncOrchestrator


def test_the_asyncio_store_reads_what_the_sync_store_reads(
    make_orch: OrchestratorFactory, database_url: str, app_dir: Path
) -> None:
    orch = make_orch(*cli_app.SAGAS)
    done = orch.start(cli_app.shop, Job(order_id="o-done")).id
    assert orch.run(done).status == "completed"
    parked = _park_unknown(orch, "o-parked")
    pending = orch.start(cli_app.shop, Job(order_id="o-pending")).id

    reads: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
        ("ids_with_prefix", (parked[:6],), {"limit": 10}),
        ("saga_refs", (), {"key": "o-parked", "limit": 5}),
        ("saga_refs", (), {"ids": [done, pending]}),
        ("get_state_page", (parked,), {"limit": 2, "offset": 1}),
        ("count_live_claims", (parked,), {}),
        ("history_of_operations", (parked, [("charge", "action")]), {}),
        ("in_flight_by_version", (), {}),
        ("purgeable", (), {"retention_seconds": 0, "limit": 10}),
        ("find_unsettled", (["shop:1"],), {"limit": 10}),
        ("list_states", (), {"status": None, "name": "shop", "tenant_id": None, "limit": 10}),
        ("history", (done,), {}),
    ]
    store = orch.store
    expected = [getattr(store, method)(*args, **kwargs) for method, args, kwargs in reads]

    # What the sync store answers is what these rows hold.
    by_method = dict(zip([method for method, _, _ in reads], expected, strict=False))
    assert parked in by_method["ids_with_prefix"]
    page = by_method["get_state_page"]
    assert page is not None and page[0].id == parked and len(page[0].operations) == 2
    assert {ref["id"] for ref in expected[2]} == {done, pending}
    assert [row["id"] for row in by_method["purgeable"][0]] == [done]
    assert {event.step for event in by_method["history_of_operations"]} <= {None, "charge"}

    async def read_async() -> list[Any]:
        door = AsyncOrchestrator(database_url, sagas=list(cli_app.SAGAS))
        try:
            astore = await door.store()
            return [
                await getattr(astore, method)(*args, **kwargs) for method, args, kwargs in reads
            ]
        finally:
            await door.close()

    assert asyncio.run(read_async()) == expected
