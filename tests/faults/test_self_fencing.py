"""Self-fencing: an owner whose lease may have ended never starts a call.

The sequence a pooled soak ran into: an owner is still alive but its lease lapses before
it calls (its heartbeats and replies held up behind a restarting server or a pooler); a
taker claims the saga, its reconcile hook finds nothing (`Absent`) and it retries the
step; then the first owner goes on. Here the first owner is held at the `before_call`
fault point, past its lease, while a second orchestrator takes over: the provider looks
keys up without fences, as most do, so only the orchestrator can keep its late call out.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import psycopg
import pytest
from pydantic import BaseModel
from structlog.testing import capture_logs

import saga._drivers.faults as fault_points
from faults.harness import scalar, wait_for
from saga import (
    Absent,
    AsyncOrchestrator,
    Found,
    Orchestrator,
    Saga,
    SagaStatus,
    StepContext,
)

pytestmark = [pytest.mark.integration, pytest.mark.crash]

LEASE = 1.0


class Booking(BaseModel):
    ref: str


def _booking_saga(url: str) -> Saga[Booking]:
    """One step at a provider that books every request it gets and looks bookings up by
    key: a late second request is a second booking."""
    saga: Saga[Booking] = Saga("lapse", version=1, input=Booking, key=lambda b: b.ref)

    @saga.step()
    def book(ctx: StepContext, data: Booking) -> dict[str, Any]:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO bookings (key, attempt, fence) VALUES (%s, %s, %s)",
                (ctx.idempotency_key, ctx.attempt, ctx.fence),
            )
        return {"booked": ctx.idempotency_key}

    @book.reconcile
    def find(ctx: StepContext, data: Booking) -> Found | Absent:
        with psycopg.connect(url) as conn:
            row = conn.execute(
                "SELECT key FROM bookings WHERE key = %s LIMIT 1", (ctx.idempotency_key,)
            ).fetchone()
        return Absent() if row is None else Found({"booked": row[0]})

    return saga


@pytest.fixture
def bookings(database_url: str) -> str:
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE bookings (key text, attempt int, fence bigint)")
    return database_url


@pytest.fixture
def held_before_call() -> Iterator[tuple[threading.Event, threading.Event]]:
    """(reached, release): the first thread to reach `before_call` waits there for
    `release`; any later one goes on."""
    reached, release = threading.Event(), threading.Event()
    first: list[int] = []

    def handler(name: str, context: Mapping[str, Any]) -> None:
        if name != "before_call" or first:
            return
        first.append(threading.get_ident())
        reached.set()
        release.wait(30)

    previous = fault_points.arm(handler)
    try:
        yield reached, release
    finally:
        release.set()
        fault_points.arm(previous)


def _stalled_run(url: str, saga: Saga[Booking], saga_id: str, door: str) -> Callable[[], None]:
    """The first owner's drive of `saga_id`, in the sync or the asyncio door."""
    if door == "sync":

        def run() -> None:
            with Orchestrator(url, sagas=[saga], lease_seconds=LEASE, owner="stalled") as orch:
                orch.run(saga_id)

        return run

    async def arun() -> None:
        async with AsyncOrchestrator(
            url, sagas=[saga], lease_seconds=LEASE, owner="stalled"
        ) as orch:
            await orch.run(saga_id)

    return lambda: asyncio.run(arun())


@pytest.mark.parametrize(
    ("door", "pooled"), [("sync", False), ("asyncio", False), ("sync", True), ("asyncio", True)]
)
def test_an_owner_whose_lease_lapsed_does_not_start_its_call(
    bookings: str,
    held_before_call: tuple[threading.Event, threading.Event],
    door: str,
    pooled: bool,
    request: pytest.FixtureRequest,
) -> None:
    """The first owner reaches its call past its lease, after a taker has reconciled
    (`Absent`) and booked: it confirms its lease before calling, finds it lost, and does
    not call. One booking, by the taker, under its newer fence. `pooled`: both owners
    reach the server through PgBouncer in transaction mode."""
    url = bookings
    orchestrators = str(request.getfixturevalue("pooled_url")) if pooled else url
    reached, release = held_before_call
    saga = _booking_saga(url)
    with Orchestrator(orchestrators, sagas=[saga], lease_seconds=LEASE, owner="taker") as taker:
        saga_id = taker.start(saga, Booking(ref="r-1")).id
        errors: list[BaseException] = []

        def stalled() -> None:
            try:
                _stalled_run(orchestrators, saga, saga_id, door)()
            except BaseException as exc:  # reported below
                errors.append(exc)

        thread = threading.Thread(target=stalled)
        thread.start()
        assert reached.wait(30), "the first owner never reached its call"
        wait_for(
            lambda: scalar(url, "SELECT lease_expires_at < now() FROM saga.sagas"),
            timeout=10,
            what="the first owner's lease to lapse",
        )
        state = taker.run(saga_id)
        assert state.status == SagaStatus.COMPLETED
        with capture_logs() as logs:
            release.set()
            thread.join(30)
        assert not thread.is_alive() and not errors, errors
        history = [(e.event, e.attempt) for e in taker.history(saga_id)]
        assert taker.get(saga_id).status == SagaStatus.COMPLETED
    with psycopg.connect(url) as conn:
        rows = conn.execute("SELECT attempt, fence FROM bookings ORDER BY attempt").fetchall()
    assert rows == [(2, 2)], f"bookings (attempt, fence): {rows}; history: {history}"
    assert any(entry["event"] == "lease_lost" for entry in logs), logs


@pytest.mark.parametrize("door", ["sync", "asyncio"])
def test_a_lease_confirmed_by_the_last_write_is_not_confirmed_again(
    bookings: str, door: str
) -> None:
    """Every call starts right after the write that recorded its attempt: that write
    confirms the lease, and no extra round trip is spent on it."""
    url = bookings
    saga = _booking_saga(url)
    with capture_logs() as logs:
        if door == "sync":
            with Orchestrator(url, sagas=[saga]) as orch:
                state = orch.run(orch.start(saga, Booking(ref="r-2")).id)
        else:

            async def main() -> Any:
                async with AsyncOrchestrator(url, sagas=[saga]) as orch:
                    return await orch.run((await orch.start(saga, Booking(ref="r-2"))).id)

            state = asyncio.run(main())
    assert state.status == SagaStatus.COMPLETED
    assert not [entry for entry in logs if entry["event"] == "lease_confirmed_again"]


@pytest.mark.parametrize("taker_owner", ["taker", "first"])
def test_a_claim_found_again_never_adopts_the_next_owners_attempt(
    database_url: str, provider_url: str, taker_owner: str
) -> None:
    """The pooled soak's duplicate, step by step. A claim lands but its reply is lost
    (behind a restarting server, a pooler); its owner finds it again by its token, then
    reads the saga. Before that read, its lease has run out and a taker has claimed the
    saga, reconciled step `a` (`Absent`, fence 2 seen by the fenced provider) and started
    attempt 2 under fence 2. The late read handed the first owner that running attempt,
    fence 2 and all: it called it, the taker called it, and the fenced provider performed
    both (same fence, nothing stale). Now the first owner sees the saga is no longer its
    claim's and calls nothing: one effect. `taker_owner="first"`: the taker is another
    driver of the same worker (same owner name, newer fence)."""
    from faults import app
    from faults.proxy import LostReplyProxy

    saga = app.SAGAS["fault4"]
    with Orchestrator(database_url, sagas=app.ALL_SAGAS) as starter:
        saga_id = starter.start(saga, app.FaultInput(key="race-1")).id
    loading, go_on = threading.Event(), threading.Event()
    taker_at_call, taker_go = threading.Event(), threading.Event()

    def hold_taker(name: str, context: Mapping[str, Any]) -> None:
        if name == "before_call" and threading.current_thread().name == "taker":
            taker_at_call.set()
            taker_go.wait(30)

    previous = fault_points.arm(hold_taker)
    with LostReplyProxy(database_url) as proxy:
        proxy.lose_reply("saga.write_saga", times=1)  # the claim's first write commits
        first = Orchestrator(proxy.url, sagas=app.ALL_SAGAS, lease_seconds=LEASE, owner="first")
        store: Any = first.store
        load_txn = store.load_txn

        def held_load(*args: Any, **kwargs: Any) -> Any:
            if not loading.is_set():  # the read after the claim was found again
                loading.set()
                go_on.wait(30)
            return load_txn(*args, **kwargs)

        store.load_txn = held_load
        taker = Orchestrator(
            database_url, sagas=app.ALL_SAGAS, lease_seconds=LEASE, owner=taker_owner
        )
        threads = [
            threading.Thread(target=lambda: first.run(saga_id), name="first"),
            threading.Thread(target=lambda: taker.run(saga_id), name="taker"),
        ]
        try:
            threads[0].start()
            assert loading.wait(30), "the first owner never found its claim again"
            assert proxy.lost_replies(), "the claim's reply was not lost"
            wait_for(
                lambda: scalar(database_url, "SELECT lease_expires_at < now() FROM saga.sagas"),
                timeout=10,
                what="the first owner's lease to lapse",
            )
            threads[1].start()
            assert taker_at_call.wait(30), "the taker never started attempt 2"
            go_on.set()
            threads[0].join(30)
            taker_go.set()
            threads[1].join(30)
            assert taker.get(saga_id).status == SagaStatus.COMPLETED
        finally:
            go_on.set()
            taker_go.set()
            for thread in threads:
                if thread.is_alive():
                    thread.join(30)
            fault_points.arm(previous)
            first.close()
            taker.close()
    with psycopg.connect(database_url) as conn:
        rows = conn.execute(
            "SELECT attempt, fence, performed FROM fault_provider.requests"
            " WHERE idempotency_key LIKE %s ORDER BY id",
            ("%:race-1:a",),
        ).fetchall()
    assert [r for r in rows if r[2]] == [(2, 2, True)], f"(attempt, fence, performed): {rows}"
