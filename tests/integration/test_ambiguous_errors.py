"""Ambiguous errors: a `ConnectionError` or `TimeoutError` raised by step code may come
after the provider acted, so by default it is retried only where a retry is safe (an
idempotent operation, or one whose reconcile hook is asked first); any other operation
is called once and parks. Both doors, real PostgreSQL."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from async_support import event_rows, operation_rows
from support import Order, order_saga

from saga import (
    Absent,
    AsyncOrchestrator,
    Found,
    HistoryEvent,
    Orchestrator,
    PermanentError,
    RetryPolicy,
    Saga,
    SagaState,
    SessionParked,
    StepContext,
    TransientError,
    current_context,
    durable_step,
)
from saga.testing import check_invariants

# The default policy, with backoffs short enough for a test (seconds).
QUICK = RetryPolicy(initial_delay=0.01, max_delay=0.02)
DOORS = ("sync", "asyncio")


class Hotel:
    """A provider that records every booking made under each idempotency key, and may cut
    the reply off after booking (`cut_after`) or fail before it (`refuse`)."""

    def __init__(self) -> None:
        self.bookings: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()

    def book(self, key: str, *, cut_after: BaseException | None = None) -> dict[str, str]:
        self.calls[key] += 1
        self.bookings[key] += 1
        if cut_after is not None:
            raise cut_after
        return {"booking": f"bk-{key[-8:]}"}


def drive(door: str, url: str, saga: Saga[Order], order: Order) -> tuple[SagaState, list[Any]]:
    """Start and run `saga` for `order` in `door`; its final state and audit trail."""
    if door == "sync":
        with Orchestrator(url, sagas=[saga]) as orch:
            handle = orch.start(saga, order)
            return orch.run(handle.id), orch.history(handle.id)

    async def main() -> tuple[SagaState, list[HistoryEvent]]:
        async with AsyncOrchestrator(url, sagas=[saga]) as aorch:
            handle = await aorch.start(saga, order)
            state = await asyncio.wait_for(aorch.run(handle.id), 30)
            return state, await aorch.history(handle.id)

    return asyncio.run(main())


def hotel_saga(
    hotel: Hotel,
    name: str,
    cut: Callable[[], BaseException],
    *,
    is_async: bool = False,
    retry: RetryPolicy = QUICK,
    timeout_seconds: float | None = None,
) -> Saga[Order]:
    """book_hotel books, then its reply is cut off by `cut()` on the first attempt."""
    saga = order_saga(name)

    def book(ctx: StepContext) -> dict[str, str]:
        return hotel.book(ctx.idempotency_key, cut_after=cut() if ctx.attempt == 1 else None)

    if is_async:

        @saga.step(name="book_hotel", retry=retry, timeout_seconds=timeout_seconds)
        async def book_async(ctx: StepContext, o: Order) -> dict[str, str]:
            await asyncio.sleep(0)
            return book(ctx)

    else:

        @saga.step(name="book_hotel", retry=retry, timeout_seconds=timeout_seconds)
        def book_sync(ctx: StepContext, o: Order) -> dict[str, str]:
            return book(ctx)

    return saga


def _named(history: list[Any], event: str) -> list[Any]:
    return [e for e in history if e.event == event]


# ----- a plain step is never called again ---------------------------------------------------


@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize("is_async", [False, True], ids=["sync_step", "async_step"])
def test_a_plain_step_whose_reply_timed_out_is_called_once_and_parks(
    database_url: str, door: str, is_async: bool
) -> None:
    """The hotel books, then the step raises TimeoutError (a read timeout after the request
    reached the provider). Not idempotent, no reconcile hook: called once, one booking, the
    saga parks naming the exception, in both doors."""
    hotel = Hotel()
    saga = hotel_saga(hotel, "hotel", lambda: TimeoutError("read timed out"), is_async=is_async)
    state, history = drive(door, database_url, saga, Order(order_id="trip-1"))
    (op,) = state.operations
    assert list(hotel.bookings.values()) == [1]
    assert (state.status, op.status, op.attempts) == ("needs_review", "unknown", 1)
    assert "TimeoutError: read timed out" in (state.error or "")
    assert "ambiguous" in (op.error or "")
    (unknown,) = _named(history, "outcome_unknown")
    assert "TimeoutError: read timed out" in unknown.detail["traceback"]
    assert not _named(history, "attempt_failed")
    check_invariants(database_url).raise_if_violated()


@pytest.mark.parametrize(
    "cut",
    [
        lambda: ConnectionResetError(104, "Connection reset by peer"),
        lambda: BrokenPipeError(32, "Broken pipe"),
        lambda: ConnectionError("server closed the connection"),
    ],
    ids=["ConnectionResetError", "BrokenPipeError", "ConnectionError"],
)
def test_subclasses_of_the_ambiguous_errors_are_ambiguous_too(
    database_url: str, cut: Callable[[], BaseException]
) -> None:
    """ConnectionError and its subclasses park a plain step too."""
    hotel = Hotel()
    saga = hotel_saga(hotel, "hotel_sub", cut)
    state, _ = drive("sync", database_url, saga, Order(order_id="trip-2"))
    assert list(hotel.bookings.values()) == [1]
    assert state.status == "needs_review"
    assert type(cut()).__name__ in (state.error or "")


def test_both_doors_write_the_same_rows_and_events(database_url: str) -> None:
    """The same plain step cut off by a TimeoutError: the sync and asyncio doors record the
    same operations and the same audit trail."""
    seen = {}
    for door in DOORS:
        hotel = Hotel()
        saga = hotel_saga(hotel, "hotel_twin", lambda: TimeoutError("read timed out"))
        order = Order(order_id=f"twin-{door}")
        state, history = drive(door, database_url, saga, order)
        rows = [e for e in event_rows(history, order.order_id) if e[0] != "lease_released"]
        # The traceback names the file and line of each door's frames: compared apart.
        rows = [(*e[:4], {k: v for k, v in e[4].items() if k != "traceback"}) for e in rows]
        seen[door] = (state.status, operation_rows(state), rows)
    assert seen["sync"] == seen["asyncio"]


@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize("timeout_seconds", [None, 30.0], ids=["no_timeout", "timeout_30s"])
def test_asyncio_wait_for_timing_out_inside_a_step_parks_it_in_both_doors(
    database_url: str, door: str, timeout_seconds: float | None
) -> None:
    """An async step books, then waits for the confirmation with `asyncio.wait_for`, which
    times out: asyncio's TimeoutError is the step's outcome, with or without the step's
    own `timeout_seconds`: called once, parked naming it, in both doors."""
    hotel = Hotel()
    saga = order_saga("hotel_wait_for")

    async def confirmation() -> None:
        await asyncio.sleep(5)

    @saga.step(retry=QUICK, timeout_seconds=timeout_seconds)
    async def book_hotel(ctx: StepContext, o: Order) -> dict[str, str]:
        hotel.book(ctx.idempotency_key)
        await asyncio.wait_for(confirmation(), 0.01)
        return {"booking": "bk-1"}

    state, _ = drive(door, database_url, saga, Order(order_id="trip-13"))
    (op,) = state.operations
    assert list(hotel.bookings.values()) == [1]
    assert (state.status, op.status, op.attempts) == ("needs_review", "unknown", 1)
    assert "raised TimeoutError" in (state.error or "")


# ----- where a retry is safe, it is made ----------------------------------------------------


@pytest.mark.parametrize("door", DOORS)
def test_an_idempotent_step_is_retried_with_the_same_key(database_url: str, door: str) -> None:
    """Declared idempotent (the provider dedupes on the key): the ambiguous attempt is
    unknown, then retried with the same key after the policy's backoff, and the saga
    completes."""
    keys: list[str] = []
    called_at: list[float] = []
    saga = order_saga("hotel_idem")

    @saga.step(retry=RetryPolicy(initial_delay=0.3, max_delay=0.3, jitter=0.0), idempotent=True)
    def book_hotel(ctx: StepContext, o: Order) -> dict[str, str]:
        keys.append(ctx.idempotency_key)
        called_at.append(time.monotonic())
        if ctx.attempt == 1:
            raise ConnectionResetError(104, "Connection reset by peer")
        return {"booking": "bk-1"}

    state, history = drive(door, database_url, saga, Order(order_id="trip-3"))
    (op,) = state.operations
    assert (state.status, op.status, op.attempts) == ("completed", "succeeded", 2)
    assert len(keys) == 2 and keys[0] == keys[1] == op.idempotency_key
    assert called_at[1] - called_at[0] >= 0.3  # the policy's backoff, not at once
    assert [e.event for e in history if e.event in ("outcome_unknown", "unknown_retried")] == [
        "outcome_unknown",
        "unknown_retried",
    ]


@pytest.mark.parametrize("door", DOORS)
def test_an_idempotent_step_timing_out_at_every_attempt_parks_at_its_ceiling(
    database_url: str, door: str
) -> None:
    """Every attempt's reply cut off: the last one's outcome is unknown, so reaching the
    ceiling parks the saga (it never turns failed and compensates around an effect)."""
    calls: list[int] = []
    saga = order_saga("hotel_ceiling")

    @saga.step(retry=QUICK, idempotent=True)
    def book_hotel(ctx: StepContext, o: Order) -> dict[str, str]:
        calls.append(ctx.attempt)
        raise TimeoutError("read timed out")

    state, _ = drive(door, database_url, saga, Order(order_id="trip-4"))
    (op,) = state.operations
    assert calls == [1, 2, 3]
    assert (state.status, op.status, op.attempts) == ("needs_review", "unknown", 3)
    assert "ceiling of 3 attempts" in (state.error or "")


@pytest.mark.parametrize("door", DOORS)
def test_a_reconcile_hook_that_finds_the_booking_settles_it_without_a_second_call(
    database_url: str, door: str
) -> None:
    """A reconcile hook is asked first: Found settles the step, which is not called again."""
    hotel = Hotel()
    saga = order_saga("hotel_found")

    @saga.step(retry=QUICK)
    def book_hotel(ctx: StepContext, o: Order) -> dict[str, str]:
        return hotel.book(ctx.idempotency_key, cut_after=TimeoutError("read timed out"))

    @book_hotel.reconcile
    def find_booking(ctx: StepContext, o: Order) -> Found | Absent:
        if hotel.bookings[ctx.idempotency_key]:
            return Found({"booking": "bk-found"}, provider_reference="bk-found")
        return Absent()

    state, history = drive(door, database_url, saga, Order(order_id="trip-5"))
    (op,) = state.operations
    assert list(hotel.calls.values()) == [1]
    assert (state.status, op.status, op.attempts) == ("completed", "succeeded", 1)
    assert op.result == {"booking": "bk-found"}
    assert _named(history, "reconcile_found")


@pytest.mark.parametrize("door", DOORS)
def test_a_reconcile_hook_that_finds_nothing_lets_the_step_retry_with_the_same_key(
    database_url: str, door: str
) -> None:
    """The connection was refused before the request left: the hook answers Absent and the
    step is retried with the same key; one booking in the end."""
    hotel = Hotel()
    keys: list[str] = []
    saga = order_saga("hotel_absent")

    @saga.step(retry=QUICK)
    async def book_hotel(ctx: StepContext, o: Order) -> dict[str, str]:
        keys.append(ctx.idempotency_key)
        if ctx.attempt == 1:
            raise ConnectionRefusedError(111, "Connection refused")
        return hotel.book(ctx.idempotency_key)

    @book_hotel.reconcile
    def find_booking(ctx: StepContext, o: Order) -> Found | Absent:
        return Absent() if not hotel.bookings[ctx.idempotency_key] else Found({"booking": "x"})

    state, history = drive(door, database_url, saga, Order(order_id="trip-6"))
    (op,) = state.operations
    assert (state.status, op.status, op.attempts) == ("completed", "succeeded", 2)
    assert list(hotel.bookings.values()) == [1]
    assert keys[0] == keys[1]
    assert _named(history, "reconcile_absent")


# ----- what stays as it was -----------------------------------------------------------------


@pytest.mark.parametrize("door", DOORS)
def test_a_transient_error_is_still_retried(database_url: str, door: str) -> None:
    """TransientError is the step's own word that nothing happened: a plain step retries."""
    calls: list[int] = []
    saga = order_saga("hotel_transient")

    @saga.step(retry=QUICK)
    def book_hotel(ctx: StepContext, o: Order) -> dict[str, str]:
        calls.append(ctx.attempt)
        if ctx.attempt == 1:
            raise TransientError("rate limited, nothing booked")
        return {"booking": "bk-1"}

    state, _ = drive(door, database_url, saga, Order(order_id="trip-7"))
    assert calls == [1, 2]
    assert state.status == "completed"


def test_an_explicit_retry_on_keeps_retrying_an_ambiguous_error(database_url: str) -> None:
    """Listing TimeoutError in retry_on is the user's word that a retry is safe: kept."""
    hotel = Hotel()
    policy = RetryPolicy(initial_delay=0.01, max_delay=0.02, retry_on=(TimeoutError,))
    saga = hotel_saga(hotel, "hotel_explicit", lambda: TimeoutError("read timed out"), retry=policy)
    state, _ = drive("sync", database_url, saga, Order(order_id="trip-8"))
    assert state.status == "completed"
    assert list(hotel.calls.values()) == [2]


def test_a_prepare_hook_raising_a_connection_error_is_retried(database_url: str) -> None:
    """Nothing is called while a prepare hook runs: its ConnectionError stays transient."""
    asked: list[int] = []
    saga = order_saga("hotel_prepare")

    @saga.step(retry=QUICK)
    def book_hotel(ctx: StepContext, o: Order) -> dict[str, Any]:
        return {"rate": ctx.request["rate"]}

    @book_hotel.prepare
    def quote(ctx: StepContext, o: Order) -> dict[str, int]:
        asked.append(ctx.attempt)
        if len(asked) == 1:
            raise ConnectionResetError(104, "Connection reset by peer")
        return {"rate": 120}

    state, _ = drive("sync", database_url, saga, Order(order_id="trip-9"))
    assert state.status == "completed"
    assert len(asked) == 2


# ----- compensations follow the same rule ---------------------------------------------------


@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize("idempotent", [False, True], ids=["plain", "idempotent"])
def test_a_compensation_cut_off_by_a_timeout_follows_the_same_rule(
    database_url: str, door: str, idempotent: bool
) -> None:
    """The cancellation's reply is cut off: a plain compensation is called once and parks
    the saga naming the error; an idempotent one is retried with the same key."""
    cancels: list[str] = []
    saga = order_saga("hotel_cancel")

    @saga.step(retry=QUICK)
    def book_hotel(ctx: StepContext, o: Order) -> dict[str, str]:
        return {"booking": "bk-1"}

    @book_hotel.compensation(retry=QUICK, idempotent=idempotent)
    def cancel_hotel(ctx: StepContext, o: Order, result: dict[str, str]) -> None:
        cancels.append(ctx.idempotency_key)
        if len(cancels) == 1:
            raise TimeoutError("read timed out")

    @saga.step(retry=QUICK)
    def book_flight(ctx: StepContext, o: Order) -> None:
        raise PermanentError("no seats")

    state, _ = drive(door, database_url, saga, Order(order_id="trip-10"))
    comp = next(op for op in state.operations if op.kind == "compensation")
    if idempotent:
        assert (state.status, comp.status, comp.attempts) == ("compensated", "succeeded", 2)
        assert cancels[0] == cancels[1]
    else:
        assert (state.status, comp.status, comp.attempts) == ("needs_review", "unknown", 1)
        assert cancels == [comp.idempotency_key]
        assert "TimeoutError: read timed out" in (state.error or "")


# ----- the step's own timeout is not the orchestrator's, nor the reverse --------------------


@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize("is_async", [False, True], ids=["sync_step", "async_step"])
def test_a_steps_own_timeout_is_not_taken_for_the_orchestrators(
    database_url: str, door: str, is_async: bool
) -> None:
    """A step with `timeout_seconds=30` whose client times out at once: the saga parks at
    once, naming the step's TimeoutError, not a timeout of 30 s."""
    hotel = Hotel()
    saga = hotel_saga(
        hotel,
        "hotel_own_timeout",
        lambda: TimeoutError("client read timeout"),
        is_async=is_async,
        timeout_seconds=30.0,
    )
    began = time.monotonic()
    state, _ = drive(door, database_url, saga, Order(order_id="trip-11"))
    assert time.monotonic() - began < 15
    assert state.status == "needs_review"
    assert "TimeoutError: client read timeout" in (state.error or "")
    assert "exceeded its timeout" not in (state.error or "")
    assert list(hotel.calls.values()) == [1]


@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize("is_async", [False, True], ids=["sync_step", "async_step"])
def test_the_orchestrators_timeout_is_not_taken_for_the_steps(
    database_url: str, door: str, is_async: bool
) -> None:
    """A step that lists TimeoutError in retry_on and runs past `timeout_seconds`: the
    orchestrator's timeout is no TimeoutError of the step, so it is not retried by that
    word; the attempt is unknown (a plain step parks)."""
    calls: list[int] = []
    policy = RetryPolicy(initial_delay=0.01, max_delay=0.02, retry_on=(TimeoutError,))
    saga = order_saga("hotel_our_timeout")

    if is_async:

        @saga.step(name="book_hotel", retry=policy, timeout_seconds=0.2)
        async def book_async(ctx: StepContext, o: Order) -> None:
            calls.append(ctx.attempt)
            await asyncio.sleep(2)

    else:

        @saga.step(name="book_hotel", retry=policy, timeout_seconds=0.2)
        def book_sync(ctx: StepContext, o: Order) -> None:
            calls.append(ctx.attempt)
            time.sleep(0.4)

    state, _ = drive(door, database_url, saga, Order(order_id="trip-12"))
    (op,) = state.operations
    assert calls == [1]
    assert (state.status, op.status) == ("needs_review", "unknown")
    assert "exceeded its timeout of 0.2s" in (state.error or "")


# ----- sessions of durable steps ------------------------------------------------------------


@durable_step(name="book_room", key=lambda room: room, retry=QUICK)
def book_room(room: str) -> dict[str, str]:
    return _SESSION_HOTEL.book(room, cut_after=TimeoutError("read timed out"))


_SESSION_HOTEL = Hotel()


def test_a_durable_step_cut_off_by_a_timeout_is_called_once_and_parks_the_session(
    database_url: str,
) -> None:
    """In a session, a plain durable step whose reply timed out is not called again: the
    session parks, naming the error."""
    _SESSION_HOTEL.bookings.clear()
    with (
        Orchestrator(database_url) as orch,
        pytest.raises(SessionParked) as parked,
        orch.session("ticket-1"),
    ):
        book_room("room-7")
    assert list(_SESSION_HOTEL.bookings.values()) == [1]
    assert "TimeoutError: read timed out" in str(parked.value)


_NOTES: list[int] = []


@durable_step(name="send_note", key=lambda to: to, retry=QUICK, idempotent=True)
def send_note(to: str) -> dict[str, str]:
    ctx = current_context()
    assert ctx is not None
    _NOTES.append(ctx.attempt)
    if ctx.attempt == 1:
        raise ConnectionResetError(104, "Connection reset by peer")
    return {"sent": to}


def test_an_idempotent_durable_step_cut_off_is_retried_in_its_session(database_url: str) -> None:
    """An idempotent durable step whose connection was reset is retried with the same key
    inside the session, and its result returned to the caller."""
    _NOTES.clear()
    with Orchestrator(database_url) as orch, orch.session("ticket-2") as run:
        assert send_note("ops@acme.test") == {"sent": "ops@acme.test"}
    assert _NOTES == [1, 2]
    assert run.executed == 1
