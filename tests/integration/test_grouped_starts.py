"""Group commit of starts: the starts made while one is on the wire leave together, in one
statement (saga.start_sagas_v1) and one commit, and each is answered as if it went alone:
two starts of one key, a start the database refuses, a reply lost after the commit."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg
import pytest
from faults.proxy import LostReplyProxy
from support import Order, order_saga, starts_held, wait_until

from saga import (
    AsyncOrchestrator,
    IdempotencyConflict,
    Orchestrator,
    Saga,
    SagaHandle,
    StepContext,
)
from saga.errors import SagaError

HANG_SECONDS = 30.0


def _saga(name: str) -> Saga[Order]:
    saga = order_saga(name)
    for step in ("reserve", "charge", "ship"):

        def call(ctx: StepContext, o: Order) -> dict[str, Any]:
            return {}

        saga.step(name=step)(call)
    return saga


async def _start_batch(
    url: str, saga: Saga[Order], first: Order, batch: Sequence[Order], database_url: str
) -> tuple[list[SagaHandle | BaseException], int]:
    """Start `first`, held on the wire, and `batch` meanwhile: `batch` leaves in one
    statement. Each start's handle or error, in order (`first`'s first), and the size of
    the largest statement."""
    async with AsyncOrchestrator(url, sagas=[saga]) as orch:
        store = await orch.store()
        with starts_held(database_url):
            lead = asyncio.ensure_future(orch.start(saga, first))
            while store.starts.batches < 1:
                await asyncio.sleep(0.005)
            rest = [asyncio.ensure_future(orch.start(saga, order)) for order in batch]
            while len(store.starts._queue) < len(batch):
                await asyncio.sleep(0.005)
        answers = await asyncio.wait_for(
            asyncio.gather(lead, *rest, return_exceptions=True), HANG_SECONDS
        )
        return list(answers), store.starts.largest


def _sagas(database_url: str) -> dict[str, tuple[str, int, int]]:
    """(id, operations, saga_started events) of every saga, by key."""
    with psycopg.connect(database_url) as conn:
        rows = conn.execute(
            "SELECT s.key, s.id::text,"
            " (SELECT count(*) FROM saga.operations AS o WHERE o.saga_id = s.id),"
            " (SELECT count(*) FROM saga.events AS e"
            "   WHERE e.saga_id = s.id AND e.event = 'saga_started')"
            " FROM saga.sagas AS s"
        ).fetchall()
    return {str(r[0]): (str(r[1]), int(r[2]), int(r[3])) for r in rows}


def test_two_starts_of_one_key_in_a_batch_end_as_two_concurrent_starts(
    database_url: str,
) -> None:
    """Two starts of one key in one statement: the first creates the saga, the second is
    answered with it (the same request) or refused as a conflict (another request), as
    two concurrent starts are when they go alone."""
    saga = _saga("grouped_same_key")
    answers, largest = asyncio.run(
        _start_batch(
            database_url,
            saga,
            Order(order_id="lead"),
            [
                Order(order_id="k"),
                Order(order_id="k"),
                Order(order_id="k", amount_cents=999),
                Order(order_id="other"),
            ],
            database_url,
        )
    )
    assert largest == 4
    lead, first, second, conflicting, other = answers
    assert isinstance(first, SagaHandle) and isinstance(second, SagaHandle)
    assert second.id == first.id
    assert isinstance(conflicting, IdempotencyConflict)
    assert isinstance(lead, SagaHandle) and isinstance(other, SagaHandle)
    sagas = _sagas(database_url)
    assert sorted(sagas) == ["k", "lead", "other"]
    assert sagas["k"] == (first.id, 3, 1)
    assert sagas["other"] == (other.id, 3, 1)


def test_a_start_the_database_refuses_fails_alone_in_its_batch(database_url: str) -> None:
    """One start of a statement is refused by the database (a trigger of the test
    database raises for its key): that start fails with the database's error, and the
    starts beside it in the statement are created, each with its operations and events."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            "CREATE FUNCTION saga.refuse_bad() RETURNS trigger LANGUAGE plpgsql AS $$"
            " BEGIN IF NEW.key = 'bad' THEN RAISE EXCEPTION 'refused for the test'"
            " USING ERRCODE = 'check_violation'; END IF; RETURN NEW; END $$"
        )
        conn.execute(
            "CREATE TRIGGER refuse_bad BEFORE INSERT ON saga.sagas"
            " FOR EACH ROW EXECUTE FUNCTION saga.refuse_bad()"
        )
    saga = _saga("grouped_refused")
    keys = ["a", "bad", "b"]
    answers, largest = asyncio.run(
        _start_batch(
            database_url,
            saga,
            Order(order_id="lead"),
            [Order(order_id=k) for k in keys],
            database_url,
        )
    )
    assert largest == 3
    lead, a, bad, b = answers
    assert isinstance(bad, SagaError), bad
    assert "refused for the test" in str(bad)
    assert isinstance(a, SagaHandle) and isinstance(b, SagaHandle)
    assert isinstance(lead, SagaHandle)
    sagas = _sagas(database_url)
    assert sorted(sagas) == ["a", "b", "lead"]
    assert sagas["a"] == (a.id, 3, 1)
    assert sagas["b"] == (b.id, 3, 1)


def test_a_start_cancelled_before_it_was_sent_is_never_sent(database_url: str) -> None:
    """A task cancelled while its start waits behind the one on the wire gets its
    cancellation and its saga is never created, as when starts went alone; the start
    queued beside it goes out and is created."""
    saga = _saga("grouped_cancelled")

    async def scenario() -> tuple[list[SagaHandle | BaseException], int]:
        async with AsyncOrchestrator(database_url, sagas=[saga]) as orch:
            store = await orch.store()
            with starts_held(database_url):
                lead = asyncio.ensure_future(orch.start(saga, Order(order_id="lead")))
                while store.starts.batches < 1:
                    await asyncio.sleep(0.005)
                gone = asyncio.ensure_future(orch.start(saga, Order(order_id="gone")))
                kept = asyncio.ensure_future(orch.start(saga, Order(order_id="kept")))
                while len(store.starts._queue) < 2:
                    await asyncio.sleep(0.005)
                gone.cancel()
                await asyncio.gather(gone, return_exceptions=True)
                assert len(store.starts._queue) == 1
            answers = await asyncio.wait_for(
                asyncio.gather(lead, gone, kept, return_exceptions=True), HANG_SECONDS
            )
            return list(answers), store.starts.batches

    (lead, gone, kept), batches = asyncio.run(scenario())
    assert isinstance(gone, asyncio.CancelledError), gone
    assert isinstance(lead, SagaHandle) and isinstance(kept, SagaHandle)
    assert batches == 2
    sagas = _sagas(database_url)
    assert sorted(sagas) == ["kept", "lead"]
    assert sagas["kept"] == (kept.id, 3, 1)


@pytest.mark.crash
def test_a_grouped_start_whose_reply_was_lost_returns_each_created_saga(
    database_url: str,
) -> None:
    """The reply of a statement of starts is lost after its commit (the connection
    drops): each start of it retries, recognises its own saga by its new id, and returns
    it created; no saga is created twice."""
    saga = _saga("grouped_lost_start")
    keys = [f"o-{n}" for n in range(6)]
    with LostReplyProxy(database_url) as proxy:
        proxy.lose_reply("start_sagas_v1", times=1)
        answers, largest = asyncio.run(
            _start_batch(
                proxy.url,
                saga,
                Order(order_id="lead"),
                [Order(order_id=k) for k in keys],
                database_url,
            )
        )
        assert len(proxy.lost_replies("start_sagas_v1")) == 1
    assert largest == len(keys)
    assert all(isinstance(a, SagaHandle) for a in answers), answers
    sagas = _sagas(database_url)
    assert sorted(sagas) == sorted(["lead", *keys])
    for key, handle in zip(["lead", *keys], answers, strict=True):
        assert isinstance(handle, SagaHandle)
        assert sagas[key] == (handle.id, 3, 1)


@pytest.mark.crash
def test_a_threads_grouped_start_whose_reply_was_lost_returns_each_created_saga(
    database_url: str,
) -> None:
    """The same through the sync door: eight threads of one Orchestrator start while a
    start is on the wire; the reply of the statement of the seven queued behind it is
    lost after its commit; each start returns its own saga, created once."""
    saga = _saga("grouped_lost_start_sync")
    keys = [f"o-{n}" for n in range(8)]
    with (
        LostReplyProxy(database_url) as proxy,
        Orchestrator(proxy.url, sagas=[saga]) as orch,
        ThreadPoolExecutor(len(keys)) as pool,
    ):
        proxy.lose_reply("start_sagas_v1", times=1)
        store = orch.store
        with starts_held(database_url):
            started = [pool.submit(orch.start, saga, Order(order_id=k)) for k in keys]
            wait_until(lambda: len(store.starts._queue) == len(keys) - 1, interval=0.005)
        handles = [future.result(timeout=HANG_SECONDS) for future in started]
        assert len(proxy.lost_replies("start_sagas_v1")) == 1
        assert store.starts.largest == len(keys) - 1
    sagas = _sagas(database_url)
    assert sorted(sagas) == sorted(keys)
    for key, handle in zip(keys, handles, strict=True):
        assert sagas[key] == (handle.id, 3, 1)
