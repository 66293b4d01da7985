"""Group commit: the transitions that sagas driven at the same time have ready while a
write is on the wire go out together, in one statement and one commit.

Both doors batch the same way (`Batching`). A write that finds nothing on the wire goes
out at once and alone: a saga driven by itself (`execute()` in a loop) waits for nothing
and costs what it did. Writes that arrive while a batch is on the wire queue up, and leave
together as the next batch once its reply is in. Each waiter gets its own answer: a write
refused for its saga (a lost fence, a refused confirmation) fails that saga alone; a
statement that fails as a whole (a lost connection) gives every write in it that error,
and each saga then finds out by itself whether its write landed (its write token, as for
a write sent alone). Nothing is answered before the commit that made it durable, so no
saga's next effect starts before its transition committed.

`GroupCommit` here is the threads' (the sync door: a `Worker`'s threads, or threads that
call `Orchestrator.run`): leader and followers. The thread whose write finds the wire free
leads: it sends its batch and, once the reply is in, hands the writes queued meanwhile to
the first of their threads, which leads the next batch, before it hands out its own
batch's answers. `saga._db.group_async.GroupCommit` is the event loop's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

P = TypeVar("P")
R = TypeVar("R")
W = TypeVar("W")

# One answer per write, in order: the write's result or the error that refused it (the
# others' writes commit regardless).
Answers = Sequence[R | BaseException]
WriteMany = Callable[[Sequence[P]], Answers[R]]


class Batching(Generic[P, R, W]):
    """What both doors' group commits share: the writes queued while a batch is on the
    wire, each with its waiter (a future, a thread's `_Waiter`), and how a batch's
    answers reach its waiters.

    `batches` and `largest` count what was sent, for tests and the benchmark.
    """

    def __init__(self) -> None:
        self._queue: list[tuple[P, W]] = []
        self.batches = 0
        self.largest = 0

    def _take(self) -> list[tuple[P, W]]:
        """The queued writes, as the next batch; nothing is left queued."""
        batch, self._queue = self._queue, []
        return batch

    def _sending(self, batch: Sequence[tuple[P, W]]) -> list[P]:
        """Count `batch` as sent; the parameters of its writes, in order."""
        self.batches += 1
        self.largest = max(self.largest, len(batch))
        return [params for params, _ in batch]

    def _deliver(self, batch: Sequence[tuple[P, W]], answers: Answers[R] | BaseException) -> None:
        """Give each waiter of `batch` its answer. `answers` is an error when the statement
        failed as a whole (a lost connection, say): every write in it is unsure in the
        same way, and each gets that error."""
        if isinstance(answers, BaseException):
            answers = [answers] * len(batch)
        for (_, waiter), answer in zip(batch, answers, strict=True):
            self._answer(waiter, answer)

    def _answer(self, waiter: W, answer: R | BaseException) -> None:
        raise NotImplementedError  # pragma: no cover


class _Waiter(Generic[R]):
    """A thread's write in the group: woken when it is answered, or when it is handed the
    lead of the batch it is in (`batch`). A write that went out at once (its thread leads)
    has no event: nobody wakes it."""

    __slots__ = ("answer", "batch", "woken")

    def __init__(self, woken: threading.Event | None) -> None:
        self.woken = woken
        self.answer: Any = None
        self.batch: list[tuple[Any, _Waiter[R]]] | None = None

    def result(self) -> R:
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer  # type: ignore[no-any-return]


class GroupCommit(Batching[P, R, "_Waiter[R]"]):
    """Batches the writes of concurrent threads: `write_one` for a write that goes out
    alone, `write_many` for two or more (see the module's doc)."""

    def __init__(
        self,
        write_one: Callable[[P], R],
        write_many: WriteMany[P, R],
        *,
        withdraw_cancelled: bool = False,
    ) -> None:
        """`withdraw_cancelled` is the asyncio door's (`saga._db.group_async`): a thread is
        not cancelled, and a write whose thread is interrupted while it waits to be sent is
        withdrawn whatever it says."""
        super().__init__()
        self._write_one = write_one
        self._write_many = write_many
        self._lock = threading.Lock()
        self._leading = False  # a batch is on the wire (its leader has not handed on yet)

    def write(self, params: P) -> R:
        """Write `params` with whatever else is ready; its answer once it committed."""
        with self._lock:
            if self._leading:
                waiter: _Waiter[R] = _Waiter(threading.Event())
                self._queue.append((params, waiter))
                batch = None
            else:
                self._leading = True
                waiter = _Waiter(None)
                batch = [(params, waiter)]
        if batch is None:
            batch = self._wait(waiter)
        if batch is not None:
            self._lead(batch)
        return waiter.result()

    def _wait(self, waiter: _Waiter[R]) -> list[tuple[P, _Waiter[R]]] | None:
        """Wait until `waiter` is answered (None) or handed the lead (its batch)."""
        assert waiter.woken is not None
        try:
            waiter.woken.wait()
        except BaseException:
            # Interrupted while queued (KeyboardInterrupt in the main thread): a write not
            # sent yet is withdrawn; a batch handed to this thread still goes out, or the
            # threads in it would wait for ever.
            with self._lock:
                self._queue = [queued for queued in self._queue if queued[1] is not waiter]
                handed = waiter.batch
            if handed is not None:
                self._lead(handed)
            raise
        return waiter.batch

    def _lead(self, batch: list[tuple[P, _Waiter[R]]]) -> None:
        """Send `batch`, hand the writes queued meanwhile to the first of their threads
        (the next leader), then answer this batch's waiters."""
        answers = self._send(batch)
        with self._lock:
            following = self._take()
            self._leading = bool(following)
            if following:
                following[0][1].batch = following
        if following:
            woken = following[0][1].woken
            assert woken is not None
            woken.set()
        self._deliver(batch, answers)

    def _send(self, batch: list[tuple[P, _Waiter[R]]]) -> Answers[R] | BaseException:
        params = self._sending(batch)
        try:
            if len(params) == 1:
                return [self._write_one(params[0])]
            return self._write_many(params)
        except BaseException as exc:
            # Also KeyboardInterrupt: its waiters get it rather than waiting for ever.
            return exc

    def _answer(self, waiter: _Waiter[R], answer: R | BaseException) -> None:
        waiter.answer = answer
        if waiter.woken is not None:
            waiter.woken.set()
