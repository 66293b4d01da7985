"""A checkout behind a FastAPI app: the request starts a saga, a worker in the app drives it.

`POST /checkouts` validates the order, starts a `checkout` saga (idempotently on the
client's `checkout_id`) and answers 202 at once with the saga's id and a `Location` to
`GET /checkouts/{id}`, which shows how far it got. An `AsyncWorker`, running as a
background task of the app's lifespan, drives the sagas on the app's event loop: reserve
the stock, charge the card, create the shipment; a declined card releases the stock again.

The steps are async functions that call the app's own async clients (a warehouse, a
payment provider and a carrier, created in the lifespan and shared by every step), as a
real app's steps would call its `httpx.AsyncClient`-based clients. Here the providers are
in-memory fakes that, like real ones, dedupe on the idempotency key each step passes: a
retried step has no second effect. They are forgotten when the app stops.

Run it from the repository root (FastAPI and uvicorn are not dependencies of the package):

    pip install -e . fastapi uvicorn
    uvicorn examples.fastapi_checkout:app      # or: python examples/fastapi_checkout.py

    curl -i localhost:8000/checkouts -H 'content-type: application/json' -d '{"checkout_id":
      "co-1", "customer_id": "cus-1", "sku": "mug", "quantity": 2, "amount_cents": 2400,
      "card_token": "tok_visa"}'
    curl localhost:8000/checkouts/<id>

The database is `SAGA_DATABASE_URL`, else an embedded PostgreSQL (`create_app(url)` takes
one explicitly). Nothing connects at import: the orchestrator connects in the lifespan.
A `card_token` of `tok_declined` is declined; the saga then ends `compensated`.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import FastAPI, HTTPException, Request, Response, status
from pydantic import BaseModel, ConfigDict, Field

from saga import (
    Absent,
    AsyncOrchestrator,
    Found,
    IdempotencyConflict,
    PermanentError,
    RetryPolicy,
    Saga,
    SagaNotFound,
    SagaState,
    StepContext,
)

Identifier = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class CheckoutRequest(BaseModel):
    """The body of `POST /checkouts`, and the saga's input."""

    model_config = ConfigDict(extra="forbid")

    checkout_id: Identifier  # the client's idempotency key: a retried POST reuses it
    customer_id: Identifier
    sku: Identifier
    quantity: int = Field(gt=0, le=100)
    amount_cents: int = Field(gt=0, le=10_000_000)
    card_token: str = Field(min_length=1, max_length=64)


# ----- the app's clients: async, in-memory fakes that dedupe on the idempotency key --------


class Reservation(BaseModel):
    reservation_id: str


class Charge(BaseModel):
    charge_id: str
    amount_cents: int


class Shipment(BaseModel):
    shipment_id: str


class CardDeclined(Exception):
    """The payment provider refused the card (a definite no: nothing was charged)."""


async def _network() -> None:
    await asyncio.sleep(0.005)  # a stand-in for a round trip to the provider


@dataclass
class Warehouse:
    reservations: dict[str, Reservation] = field(default_factory=dict)  # by idempotency key
    released: set[str] = field(default_factory=set)  # reservation ids

    async def reserve(self, sku: str, quantity: int, *, idempotency_key: str) -> Reservation:
        await _network()
        new = Reservation(reservation_id=f"res_{uuid.uuid4().hex[:8]}")
        return self.reservations.setdefault(idempotency_key, new)

    async def release(self, reservation_id: str) -> None:
        await _network()
        self.released.add(reservation_id)  # releasing twice changes nothing


@dataclass
class PaymentProvider:
    charges: dict[str, Charge] = field(default_factory=dict)  # by idempotency key
    refunded: set[str] = field(default_factory=set)  # charge ids
    calls: int = 0  # charge requests received, repeated ones included

    async def charge(self, card_token: str, amount_cents: int, *, idempotency_key: str) -> Charge:
        await _network()
        self.calls += 1
        if card_token == "tok_declined":
            raise CardDeclined(f"card {card_token} declined")
        new = Charge(charge_id=f"ch_{uuid.uuid4().hex[:10]}", amount_cents=amount_cents)
        return self.charges.setdefault(idempotency_key, new)

    async def find(self, *, idempotency_key: str) -> Charge | None:
        await _network()
        return self.charges.get(idempotency_key)

    async def refund(self, charge_id: str) -> None:
        await _network()
        self.refunded.add(charge_id)


@dataclass
class Carrier:
    shipments: dict[str, Shipment] = field(default_factory=dict)  # by idempotency key

    async def ship(self, sku: str, quantity: int, *, idempotency_key: str) -> Shipment:
        await _network()
        new = Shipment(shipment_id=f"shp_{uuid.uuid4().hex[:8]}")
        return self.shipments.setdefault(idempotency_key, new)


@dataclass
class Clients:
    """The app's provider clients, created in the lifespan and shared by every step."""

    warehouse: Warehouse = field(default_factory=Warehouse)
    payments: PaymentProvider = field(default_factory=PaymentProvider)
    carrier: Carrier = field(default_factory=Carrier)


# ----- the saga: its steps close over the app's clients ------------------------------------


def checkout_saga(clients: Clients) -> Saga[CheckoutRequest]:
    """The checkout saga, its steps calling `clients` (one definition per app)."""
    checkout = Saga(
        "checkout",
        version=1,
        input=CheckoutRequest,
        key=lambda c: c.checkout_id,
        tenant=lambda c: c.customer_id,
    )

    @checkout.step(idempotent=True, retry=RetryPolicy(max_attempts=3, initial_delay=0.2))
    async def reserve_stock(ctx: StepContext, c: CheckoutRequest) -> Reservation:
        return await clients.warehouse.reserve(
            c.sku, c.quantity, idempotency_key=ctx.idempotency_key
        )

    @reserve_stock.compensation(idempotent=True, retry=RetryPolicy(max_attempts=10))
    async def release_stock(ctx: StepContext, c: CheckoutRequest, result: Reservation) -> None:
        await clients.warehouse.release(result.reservation_id)

    @checkout.step(idempotent=True)  # the provider dedupes on ctx.idempotency_key
    async def charge_card(ctx: StepContext, c: CheckoutRequest) -> Charge:
        try:
            return await clients.payments.charge(
                c.card_token, c.amount_cents, idempotency_key=ctx.idempotency_key
            )
        except CardDeclined as exc:
            # A definite "this did not happen": fail the step and compensate at once.
            raise PermanentError(str(exc)) from exc

    @charge_card.compensation(idempotent=True)
    async def refund_card(ctx: StepContext, c: CheckoutRequest, result: Charge) -> None:
        await clients.payments.refund(result.charge_id)

    @charge_card.reconcile  # asked when an attempt's outcome is unknown
    async def find_charge(ctx: StepContext, c: CheckoutRequest) -> Found | Absent:
        found = await clients.payments.find(idempotency_key=ctx.idempotency_key)
        return Absent() if found is None else Found(found, provider_reference=found.charge_id)

    @checkout.step(pivot=True, idempotent=True)  # the parcel leaves: no way back after this
    async def create_shipment(ctx: StepContext, c: CheckoutRequest) -> Shipment:
        return await clients.carrier.ship(c.sku, c.quantity, idempotency_key=ctx.idempotency_key)

    return checkout


# ----- the HTTP API ---------------------------------------------------------------------


class CheckoutAccepted(BaseModel):
    id: str
    status: str


class OperationView(BaseModel):
    step: str
    kind: str
    status: str
    attempts: int
    error: str | None


class CheckoutView(BaseModel):
    id: str
    status: str
    error: str | None
    operations: list[OperationView]

    @classmethod
    def of(cls, state: SagaState) -> CheckoutView:
        return cls(
            id=state.id,
            status=state.status.value,
            error=state.error,
            operations=[
                OperationView(
                    step=op.step,
                    kind=op.kind,
                    status=op.status.value,
                    attempts=op.attempts,
                    error=op.error,
                )
                for op in state.operations
            ],
        )


@dataclass
class Services:
    """What the lifespan builds and the routes use (`app.state.services`)."""

    clients: Clients
    saga: Saga[CheckoutRequest]
    orchestrator: AsyncOrchestrator


def create_app(database_url: str | None = None) -> FastAPI:
    """The checkout app on `database_url`, else `SAGA_DATABASE_URL`, else the embedded
    PostgreSQL. Nothing connects until the app starts (its lifespan)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        clients = Clients()
        saga = checkout_saga(clients)
        async with AsyncOrchestrator(database_url, sagas=[saga]) as orch:
            app.state.services = Services(clients=clients, saga=saga, orchestrator=orch)
            # Uvicorn owns the signals; it stops the worker through the lifespan's end.
            worker = orch.worker(concurrency=8)
            running = asyncio.create_task(worker.run(handle_signals=False), name="saga-worker")
            try:
                yield
            finally:
                worker.stop()  # in-flight steps finish (or their leases are released)
                await running

    app = FastAPI(title="Checkout", lifespan=lifespan)

    def services(request: Request) -> Services:
        found: Services = request.app.state.services
        return found

    @app.post("/checkouts", status_code=status.HTTP_202_ACCEPTED)
    async def start_checkout(
        body: CheckoutRequest, request: Request, response: Response
    ) -> CheckoutAccepted:
        """Start the checkout (the same `checkout_id` again: the same saga)."""
        s = services(request)
        try:
            handle = await s.orchestrator.start(s.saga, body)
        except IdempotencyConflict as exc:
            raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from exc
        state = await s.orchestrator.get(handle.id)
        response.headers["Location"] = str(request.url_for("get_checkout", saga_id=handle.id).path)
        return CheckoutAccepted(id=handle.id, status=state.status.value)

    @app.get("/checkouts/{saga_id}", name="get_checkout")
    async def get_checkout(saga_id: str, request: Request) -> CheckoutView:
        """The checkout saga's status, each operation's status and attempts, its error."""
        s = services(request)
        try:
            state = await s.orchestrator.get(saga_id)
        except SagaNotFound:
            state = None
        if state is None or state.saga != s.saga.name:  # another app's saga is not a checkout
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"no checkout {saga_id}")
        return CheckoutView.of(state)

    return app


app = create_app()


if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app)
