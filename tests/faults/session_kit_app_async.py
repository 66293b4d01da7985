"""A courier's delivery as an asyncio session of durable steps, for `saga.testing.crash_test`
(`app="faults.session_kit_app_async:aorch"`,
`session="faults.session_kit_app_async:deliver"`).

The session runs under an `AsyncOrchestrator` (`async with aorch.session(run_id)`), and
each call is awaited:

- `book_courier` (a coroutine): the courier dedupes on the key (`idempotent=True`); its
  compensation `cancel_courier` (a coroutine) too;
- `charge_sender` (a coroutine): the processor does not dedupe but finds a charge by its
  key (the reconcile hook `find_charge`); its compensation `refund_sender` is a plain
  function, and the refunds dedupe on their key;
- `notify_recipient` (a plain function, run in a thread): the notifier dedupes on the key;
- `hand_over` (a coroutine): the courier's hand-over is found by its key (a reconcile
  hook); with `refuse=True` the recipient refuses the parcel for good: the session
  compensates.

`deliver_with_ping` adds `ping_sender`, wrongly declared `idempotent=True` while the
pager does not dedupe: the kit must report its second page.

Requests land in `session_kit.requests` (see `faults.session_kit_app`, whose providers
this app shares).
"""

from __future__ import annotations

import asyncio
from typing import Any

from faults.session_kit_app import create_providers, find, perform
from saga import (
    Absent,
    AsyncOrchestrator,
    Found,
    PermanentError,
    StepContext,
    current_context,
    durable_step,
)


def _key() -> str:
    ctx = current_context()
    assert ctx is not None, "a durable step of this app runs inside a session"
    return ctx.idempotency_key


async def _perform(service: str, key: str, *, dedupe: bool) -> dict[str, Any]:
    return await asyncio.to_thread(perform, service, key, dedupe=dedupe)


async def _find(service: str, key: str) -> Found | Absent:
    return await asyncio.to_thread(find, service, key)


@durable_step(name="book_courier", key=lambda parcel: parcel, idempotent=True)
async def book_courier(parcel: str) -> dict[str, Any]:
    """Book a courier, who dedupes on the key."""
    return await _perform("courier", _key(), dedupe=True)


@book_courier.compensation(idempotent=True)
async def cancel_courier(ctx: StepContext, result: dict[str, Any], parcel: str) -> None:
    """Cancel the booking (the courier dedupes on the compensation's key)."""
    await _perform("courier-cancel", ctx.idempotency_key, dedupe=True)


@durable_step(name="charge_sender")
async def charge_sender(parcel: str, amount_cents: int) -> dict[str, Any]:
    """Charge the sender: the processor does not dedupe."""
    return await _perform("card", _key(), dedupe=False)


@charge_sender.reconcile
async def find_charge(ctx: StepContext, parcel: str, amount_cents: int) -> Found | Absent:
    """Ask the processor for the charge made under the call's key."""
    return await _find("card", ctx.idempotency_key)


@charge_sender.compensation(idempotent=True)
def refund_sender(ctx: StepContext, result: dict[str, Any], parcel: str, amount_cents: int) -> None:
    """Refund the sender (refunds dedupe on their key)."""
    perform("card-refund", ctx.idempotency_key, dedupe=True)


@durable_step(name="notify_recipient", idempotent=True)
def notify_recipient(parcel: str, message: str) -> dict[str, Any]:
    """Tell the recipient (a plain function); the notifier dedupes on the key."""
    return perform("notifier", _key(), dedupe=True)


@durable_step(name="hand_over")
async def hand_over(parcel: str, refuse: bool = False) -> dict[str, Any]:
    """Hand the parcel over; the courier's app records it under the key."""
    if refuse:
        raise PermanentError(f"the recipient refused parcel {parcel}")
    return await _perform("hand-over", _key(), dedupe=False)


@hand_over.reconcile
async def find_hand_over(ctx: StepContext, parcel: str, refuse: bool = False) -> Found | Absent:
    """Ask the courier's app whether the parcel was handed over."""
    return await _find("hand-over", ctx.idempotency_key)


@durable_step(name="ping_sender", idempotent=True)  # wrong: the pager does not dedupe
async def ping_sender(parcel: str) -> dict[str, Any]:
    """Page the sender: declared idempotent, which the pager is not."""
    return await _perform("pager", _key(), dedupe=False)


aorch = AsyncOrchestrator()  # SAGA_DATABASE_URL, which crash_test sets in its children


async def deliver(run_id: str, refuse: bool = False) -> None:
    """Deliver one parcel, in the session `run_id`."""
    await asyncio.to_thread(create_providers, aorch.database_url)
    async with aorch.session(run_id, tenant="courier"):
        await book_courier("p-1")
        await charge_sender("p-1", 1200)
        await notify_recipient("p-1", "on its way")
        await hand_over("p-1", refuse)


async def deliver_with_ping(run_id: str) -> None:
    """Charge the sender and page them, in the session `run_id`."""
    await asyncio.to_thread(create_providers, aorch.database_url)
    async with aorch.session(run_id, tenant="courier"):
        await charge_sender("p-2", 800)
        await ping_sender("p-2")
