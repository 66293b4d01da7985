"""Group commit for the asyncio door: the transitions that sagas driven on one event loop
have ready while a write is on the wire go out together, in one statement and one commit.

The batching is the one both doors share (`saga._db.group`). A write that finds nothing on
the wire goes out at once (with the writes made ready in the same turn of the loop): a
saga driven by itself (`execute()` in a loop) waits for nothing and costs what it did.
Writes that arrive while a batch is on the wire queue up and leave as the next batch,
when its reply is in. Each waiter gets its own answer: a write refused for its saga (a
lost fence, a refused confirmation) fails that saga alone, and nothing is answered before
the commit that made it durable.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from saga._db.group import Answers, Batching

P = TypeVar("P")
R = TypeVar("R")

# What one statement writes for a batch: one result per write, in order, each the write's
# answer or the error that refused it (the others' writes commit regardless).
WriteMany = Callable[[Sequence[P]], Awaitable[Answers[R]]]


class GroupCommit(Batching[P, R, "asyncio.Future[R]"]):
    """Batches concurrent writes of one event loop: `write_one` for a write that goes out
    alone, `write_many` for two or more.

    `batches` and `largest` count what was sent, for tests and the benchmark.
    """

    def __init__(
        self,
        write_one: Callable[[P], Awaitable[R]],
        write_many: WriteMany[P, R],
        *,
        withdraw_cancelled: bool = False,
    ) -> None:
        """`withdraw_cancelled`: a write whose caller is cancelled while it waits to be sent
        is withdrawn and never sent (a start: nothing has happened yet that it must
        record). Otherwise it still goes out (a transition's write records what its step
        did). A write already sent is in flight either way."""
        super().__init__()
        self._write_one = write_one
        self._write_many = write_many
        self._withdraw_cancelled = withdraw_cancelled
        self._writer: asyncio.Task[None] | None = None

    async def write(self, params: P) -> R:
        """Write `params` with whatever else is ready; its answer once it committed."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[R] = loop.create_future()
        self._queue.append((params, done))
        if self._writer is None:
            self._writer = loop.create_task(self._drain(), name="saga-group-commit")
        try:
            return await done
        except asyncio.CancelledError:
            if self._withdraw_cancelled:
                self._queue = [queued for queued in self._queue if queued[1] is not done]
            raise

    async def _drain(self) -> None:
        batch: list[tuple[P, asyncio.Future[R]]] = []
        try:
            while self._queue:
                batch = self._take()
                self._deliver(batch, await self._send(batch))
                batch = []
        except BaseException as exc:
            # Cancelled (the loop is closing) or a bug: no waiter is left hanging.
            for _, done in (*batch, *self._take()):
                if not done.done():
                    done.set_exception(exc)
            raise
        finally:
            self._writer = None

    async def _send(self, batch: list[tuple[P, asyncio.Future[R]]]) -> Answers[R] | BaseException:
        params = self._sending(batch)
        try:
            if len(params) == 1:
                return [await self._write_one(params[0])]
            return await self._write_many(params)
        except Exception as exc:
            # The statement failed as a whole (a lost connection, say): every write in it
            # is unsure in the same way, and each saga finds out whether it landed.
            return exc

    def _answer(self, waiter: asyncio.Future[R], answer: R | BaseException) -> None:
        if waiter.done():  # its saga's task was cancelled meanwhile
            return
        if isinstance(answer, BaseException):
            waiter.set_exception(answer)
        else:
            waiter.set_result(answer)
