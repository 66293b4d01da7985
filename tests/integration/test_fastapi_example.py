"""The FastAPI checkout example (examples/fastapi_checkout.py), driven over HTTP in process.

Each test builds the app on its fresh database, runs its lifespan (the orchestrator and the
`AsyncWorker` background task) through `app.router.lifespan_context`, and talks to it with
`httpx.AsyncClient` over `httpx.ASGITransport`: the same event loop runs the requests, the
worker and the async steps, as under uvicorn.
"""

from __future__ import annotations

import asyncio
import importlib
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import httpx
import pytest
from fastapi import FastAPI

ROOT = Path(__file__).resolve().parents[2]
ENDED = {"completed", "compensated", "needs_review"}
T = TypeVar("T")

ORDER: dict[str, Any] = {
    "checkout_id": "co-1001",
    "customer_id": "cus-42",
    "sku": "mug-blue",
    "quantity": 2,
    "amount_cents": 2400,
    "card_token": "tok_visa",
}


@pytest.fixture
def example(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The example module, imported from the repository root as a reader would."""
    monkeypatch.syspath_prepend(str(ROOT))
    return importlib.import_module("examples.fastapi_checkout")


def serve(
    example: ModuleType,
    database_url: str,
    scenario: Callable[[FastAPI, httpx.AsyncClient], Awaitable[T]],
) -> T:
    """Run `scenario` against the started app, then shut the app down (worker stopped,
    orchestrator closed); returns what the scenario returned."""

    async def main() -> T:
        app: FastAPI = example.create_app(database_url)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://shop.test") as c:
                return await scenario(app, c)

    return asyncio.run(main())


async def ended(client: httpx.AsyncClient, location: str, timeout: float = 30.0) -> Any:
    """GET `location` until the saga has ended; its last body."""
    deadline = time.monotonic() + timeout
    while True:
        response = await client.get(location)
        assert response.status_code == 200, response.text
        body = response.json()
        if body["status"] in ENDED:
            return body
        assert time.monotonic() < deadline, f"still {body['status']} after {timeout} s: {body}"
        await asyncio.sleep(0.05)


def operations(body: Any) -> dict[tuple[str, str], dict[str, Any]]:
    return {(op["step"], op["kind"]): op for op in body["operations"]}


def test_a_checkout_completes_and_a_repeated_post_charges_once(
    example: ModuleType, database_url: str
) -> None:
    """POST answers 202 with the saga's id and a Location; the worker in the app completes
    reserve, charge and ship; the same POST again (before and after completion) answers with
    the same id, and the card was charged exactly once, by the async step on the app's loop."""

    async def scenario(app: FastAPI, client: httpx.AsyncClient) -> None:
        payments = app.state.services.clients.payments
        charge_on_loops: list[asyncio.AbstractEventLoop] = []
        provider_charge = payments.charge

        async def noted_charge(*args: Any, **kwargs: Any) -> Any:  # notes the loop it runs on
            charge_on_loops.append(asyncio.get_running_loop())
            return await provider_charge(*args, **kwargs)

        payments.charge = noted_charge

        first = await client.post("/checkouts", json=ORDER)
        assert first.status_code == 202, first.text
        saga_id = first.json()["id"]
        assert first.json()["status"] in {"pending", "running", "completed"}
        assert first.headers["location"] == f"/checkouts/{saga_id}"

        again = await client.post("/checkouts", json=ORDER)  # a client retry, at once
        assert again.status_code == 202, again.text
        assert again.json()["id"] == saga_id

        body = await ended(client, first.headers["location"])
        assert body["id"] == saga_id
        assert body["status"] == "completed", body
        assert body["error"] is None
        ops = operations(body)
        for step in ("reserve_stock", "charge_card", "create_shipment"):
            assert ops[step, "action"]["status"] == "succeeded", body
            assert ops[step, "action"]["attempts"] == 1, body
        assert all(op["kind"] == "action" for op in body["operations"]), body

        late = await client.post("/checkouts", json=ORDER)  # a retry after completion
        assert late.status_code == 202, late.text
        assert late.json() == {"id": saga_id, "status": "completed"}

        # The async step was awaited on the app's own loop, with the app's client.
        assert charge_on_loops == [asyncio.get_running_loop()]
        clients = app.state.services.clients
        assert clients.payments.calls == 1
        assert len(clients.payments.charges) == 1
        (charge,) = clients.payments.charges.values()
        assert charge.amount_cents == ORDER["amount_cents"]
        assert len(clients.warehouse.reservations) == 1
        assert not clients.warehouse.released
        assert len(clients.carrier.shipments) == 1

    serve(example, database_url, scenario)


def test_a_declined_card_releases_the_stock(example: ModuleType, database_url: str) -> None:
    """A declined card fails the charge permanently: the reservation is released, nothing is
    shipped or charged, and the saga ends compensated with the decline as its error."""

    async def scenario(app: FastAPI, client: httpx.AsyncClient) -> None:
        order = {**ORDER, "checkout_id": "co-declined", "card_token": "tok_declined"}
        response = await client.post("/checkouts", json=order)
        assert response.status_code == 202, response.text

        body = await ended(client, response.headers["location"])
        assert body["status"] == "compensated", body
        ops = operations(body)
        assert ops["reserve_stock", "action"]["status"] == "succeeded"
        assert ops["charge_card", "action"]["status"] == "failed"
        assert ops["charge_card", "action"]["attempts"] == 1
        assert "declined" in (ops["charge_card", "action"]["error"] or "")
        assert ops["reserve_stock", "compensation"]["status"] == "succeeded"
        for never_ran in (("create_shipment", "action"), ("charge_card", "compensation")):
            assert ops.get(never_ran, {}).get("status") in {None, "pending"}, body

        clients = app.state.services.clients
        (reservation,) = clients.warehouse.reservations.values()
        assert clients.warehouse.released == {reservation.reservation_id}
        assert clients.payments.calls == 1
        assert not clients.payments.charges
        assert not clients.payments.refunded
        assert not clients.carrier.shipments

    serve(example, database_url, scenario)


def test_unknown_ids_conflicts_and_invalid_bodies(example: ModuleType, database_url: str) -> None:
    """An unknown id (well-formed or not) is 404; the same checkout_id with another amount
    is 409 and starts nothing; an invalid body is 422 and starts nothing."""

    async def scenario(app: FastAPI, client: httpx.AsyncClient) -> None:
        for unknown in ("00000000-0000-0000-0000-000000000000", "not-a-saga-id"):
            response = await client.get(f"/checkouts/{unknown}")
            assert response.status_code == 404, (unknown, response.text)

        first = await client.post("/checkouts", json=ORDER)
        assert first.status_code == 202, first.text
        conflict = await client.post("/checkouts", json={**ORDER, "amount_cents": 9900})
        assert conflict.status_code == 409, conflict.text
        assert "detail" in conflict.json()

        invalid = await client.post(
            "/checkouts", json={**ORDER, "checkout_id": "co-2", "quantity": 0}
        )
        assert invalid.status_code == 422, invalid.text

        body = await ended(client, first.headers["location"])
        assert body["status"] == "completed", body
        payments = app.state.services.clients.payments
        assert payments.calls == 1
        (charge,) = payments.charges.values()
        assert charge.amount_cents == ORDER["amount_cents"]

    serve(example, database_url, scenario)
