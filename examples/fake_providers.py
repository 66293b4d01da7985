"""In-memory stand-ins for the providers of the README's first example.

A warehouse (`inventory`), a payment gateway (`gateway`) and a carrier (`carrier`). Like
real providers that dedupe, each remembers its answer per idempotency key: a call repeated
with the same key gets the first answer back and has no second effect. They live in this
process only; `renewal_saga.py` simulates its providers in PostgreSQL, where a crash test
can count their effects.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any


class _Deduping:
    """Answers kept per idempotency key; the first call under a key decides the answer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.answers: dict[str, dict[str, Any]] = {}

    def _once(self, key: str, answer: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            return dict(self.answers.setdefault(key, answer))


class Inventory(_Deduping):
    """Reservations of stock for an order."""

    def __init__(self) -> None:
        super().__init__()
        self.released: set[str] = set()

    def reserve(self, order_id: str, *, idempotency_key: str) -> dict[str, str]:
        """Reserve the order's stock; returns `{"reservation_id": ...}`."""
        answer = {"reservation_id": f"res_{uuid.uuid4().hex[:8]}", "order_id": order_id}
        return {"reservation_id": str(self._once(idempotency_key, answer)["reservation_id"])}

    def release(self, reservation_id: str, *, idempotency_key: str) -> None:
        """Give a reservation's stock back (releasing twice changes nothing)."""
        self._once(idempotency_key, {"released": reservation_id})
        with self._lock:
            self.released.add(reservation_id)


class Gateway(_Deduping):
    """Card charges, found again by their idempotency key."""

    def charge(self, amount_cents: int, *, idempotency_key: str) -> dict[str, Any]:
        """Charge once per key; returns `{"charge_id": ..., "amount_cents": ...}`."""
        answer = {"charge_id": f"ch_{uuid.uuid4().hex[:10]}", "amount_cents": amount_cents}
        return self._once(idempotency_key, answer)

    def find(self, *, idempotency_key: str) -> dict[str, Any] | None:
        """The charge made under this key, or None when there is none."""
        with self._lock:
            found = self.answers.get(idempotency_key)
        return None if found is None else dict(found)

    def refund(self, charge_id: str, *, idempotency_key: str) -> None:
        """Refund a charge once per key."""
        self._once(idempotency_key, {"refunded": charge_id})


class Carrier(_Deduping):
    """Shipments: once one is booked, the parcel leaves the warehouse."""

    def ship(self, order_id: str, *, idempotency_key: str) -> dict[str, str]:
        """Book the order's shipment once per key; returns `{"shipment_id": ...}`."""
        answer = {"shipment_id": f"shp_{uuid.uuid4().hex[:8]}", "order_id": order_id}
        return {"shipment_id": str(self._once(idempotency_key, answer)["shipment_id"])}


inventory = Inventory()
gateway = Gateway()
carrier = Carrier()
