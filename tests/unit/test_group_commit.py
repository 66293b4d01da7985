"""Group commit on one event loop: what is ready together goes out together, each waiter
gets its own answer, and nobody is left waiting."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from saga._db.group_async import GroupCommit


class Wire:
    """Fake statements: record each batch sent, answer after `gate` opens."""

    def __init__(self) -> None:
        self.sent: list[list[str]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail_statement: Exception | None = None

    async def one(self, params: str) -> str:
        return (await self.many([params]))[0]  # type: ignore[return-value]

    async def many(self, batch: Sequence[str]) -> list[str | BaseException]:
        self.sent.append(list(batch))
        await self.gate.wait()
        if self.fail_statement is not None:
            raise self.fail_statement
        return [ValueError(f"refused {p}") if p.startswith("bad") else f"ok {p}" for p in batch]


def _group(wire: Wire) -> GroupCommit[str, str]:
    return GroupCommit(wire.one, wire.many)


def test_a_write_alone_goes_out_at_once_and_alone() -> None:
    async def main() -> None:
        wire = Wire()
        group = _group(wire)
        assert await group.write("a") == "ok a"
        assert await group.write("b") == "ok b"
        assert wire.sent == [["a"], ["b"]]
        assert (group.batches, group.largest) == (2, 1)

    asyncio.run(main())


def test_writes_ready_while_one_is_on_the_wire_leave_together_next() -> None:
    async def main() -> None:
        wire = Wire()
        group = _group(wire)
        wire.gate.clear()
        first = asyncio.ensure_future(group.write("a"))
        await asyncio.sleep(0)  # "a" is on the wire
        rest = [asyncio.ensure_future(group.write(p)) for p in ("b", "c", "d")]
        await asyncio.sleep(0)
        assert wire.sent == [["a"]]
        wire.gate.set()
        assert await first == "ok a"
        assert await asyncio.gather(*rest) == ["ok b", "ok c", "ok d"]
        assert wire.sent == [["a"], ["b", "c", "d"]]
        assert (group.batches, group.largest) == (2, 3)

    asyncio.run(main())


def test_a_write_refused_for_its_saga_fails_that_waiter_alone() -> None:
    async def main() -> None:
        wire = Wire()
        group = _group(wire)
        results = await asyncio.gather(
            *(group.write(p) for p in ("a", "bad-b", "c")), return_exceptions=True
        )
        assert wire.sent == [["a", "bad-b", "c"]]
        assert results[0] == "ok a" and results[2] == "ok c"
        assert isinstance(results[1], ValueError) and str(results[1]) == "refused bad-b"

    asyncio.run(main())


def test_a_statement_that_fails_as_a_whole_fails_every_write_in_it() -> None:
    """A lost connection leaves every write of the batch unsure: each waiter gets the
    error (and finds out on its own whether its write landed)."""

    async def main() -> None:
        wire = Wire()
        wire.fail_statement = ConnectionError("server closed the connection")
        group = _group(wire)
        results = await asyncio.gather(
            *(group.write(p) for p in ("a", "b")), return_exceptions=True
        )
        assert [type(r) for r in results] == [ConnectionError, ConnectionError]
        wire.fail_statement = None
        assert await group.write("c") == "ok c"  # the group carries on

    asyncio.run(main())


def test_a_cancelled_waiter_does_not_disturb_the_others() -> None:
    async def main() -> None:
        wire = Wire()
        group = _group(wire)
        wire.gate.clear()
        first = asyncio.ensure_future(group.write("a"))
        await asyncio.sleep(0)
        second = asyncio.ensure_future(group.write("b"))
        third = asyncio.ensure_future(group.write("c"))
        await asyncio.sleep(0)
        second.cancel()
        wire.gate.set()
        assert await first == "ok a"
        assert await third == "ok c"
        with pytest.raises(asyncio.CancelledError):
            await second
        # The cancelled caller's write was sent all the same: it may have landed.
        assert wire.sent == [["a"], ["b", "c"]]

    asyncio.run(main())


def test_a_writer_cancelled_mid_batch_leaves_no_waiter_hanging() -> None:
    async def main() -> None:
        wire = Wire()
        group = _group(wire)
        wire.gate.clear()
        waiters = [asyncio.ensure_future(group.write(p)) for p in ("a", "b")]
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        writer = group._writer
        assert writer is not None
        writer.cancel()
        results = await asyncio.wait_for(asyncio.gather(*waiters, return_exceptions=True), 5)
        assert all(isinstance(r, asyncio.CancelledError) for r in results)
        wire.gate.set()
        assert await group.write("c") == "ok c"

    asyncio.run(main())
