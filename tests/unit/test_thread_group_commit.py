"""Group commit among threads (the sync door): a write that finds the wire free goes out
at once and alone; writes made ready while a batch is on the wire leave together next, led
by one of their own threads; each waiter gets its own answer, only once its statement
returned; and nobody is left waiting."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from saga._db.group import GroupCommit

WAIT = 10.0  # seconds: far longer than any of these takes, short enough to fail a hang


class Wire:
    """Fake statements: record each batch sent (and by which thread); a statement stays on
    the wire until `gate` opens."""

    def __init__(self) -> None:
        self.sent: list[list[str]] = []
        self.senders: list[str] = []
        self.gate = threading.Event()
        self.gate.set()
        self.on_wire = threading.Semaphore(0)
        # Statements (by their number, from 0) that fail as a whole, with what they raise.
        self.failures: dict[int, BaseException] = {}
        self.returned = threading.Event()

    def one(self, params: str) -> str:
        answer = self.many([params])[0]
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def many(self, batch: Sequence[str]) -> list[str | BaseException]:
        number = len(self.sent)
        self.sent.append(list(batch))
        self.senders.append(threading.current_thread().name)
        self.on_wire.release()
        assert self.gate.wait(WAIT)
        self.returned.set()
        if number in self.failures:
            raise self.failures[number]
        return [ValueError(f"refused {p}") if p.startswith("bad") else f"ok {p}" for p in batch]


def _group(wire: Wire) -> GroupCommit[str, str]:
    return GroupCommit(wire.one, wire.many)


class Writer(threading.Thread):
    """A thread that writes `params` through `group` and keeps what it got."""

    def __init__(self, group: GroupCommit[str, str], params: str) -> None:
        super().__init__(name=f"writer-{params}", daemon=True)
        self.group = group
        self.params = params
        self.answer: str | BaseException | None = None

    def run(self) -> None:
        try:
            self.answer = self.group.write(self.params)
        except BaseException as exc:
            self.answer = exc

    def result(self) -> str | BaseException | None:
        self.join(WAIT)
        assert not self.is_alive(), f"{self.name} is still waiting"
        return self.answer


def _until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def _queued(group: GroupCommit[Any, Any]) -> int:
    with group._lock:
        return len(group._queue)


def _held(wire: Wire, group: GroupCommit[str, str], params: str = "a") -> Writer:
    """A writer of `params` whose statement is on the wire, held there until the gate
    opens."""
    wire.gate.clear()
    writer = Writer(group, params)
    writer.start()
    assert wire.on_wire.acquire(timeout=WAIT)
    return writer


def _queue(group: GroupCommit[str, str], *params: str) -> list[Writer]:
    """Writers of `params`, each queued in turn behind the statement on the wire."""
    writers: list[Writer] = []
    for one in params:
        queued = _queued(group) + 1
        writers.append(Writer(group, one))
        writers[-1].start()
        _until(lambda queued=queued: _queued(group) == queued)
    return writers


def test_a_write_alone_goes_out_at_once_alone_and_in_its_own_thread() -> None:
    wire = Wire()
    group = _group(wire)
    assert group.write("a") == "ok a"
    assert group.write("b") == "ok b"
    assert wire.sent == [["a"], ["b"]]
    me = threading.current_thread().name
    assert wire.senders == [me, me]
    assert (group.batches, group.largest) == (2, 1)


def test_writes_ready_while_one_is_on_the_wire_leave_together_led_by_the_first() -> None:
    wire = Wire()
    group = _group(wire)
    first = _held(wire, group)
    rest = _queue(group, "b", "c", "d")
    assert wire.sent == [["a"]]
    wire.gate.set()
    assert first.result() == "ok a"
    assert [w.result() for w in rest] == ["ok b", "ok c", "ok d"]
    assert wire.sent == [["a"], ["b", "c", "d"]]
    # The first thread that queued led the next batch; the first leader went on its way.
    assert wire.senders == ["writer-a", "writer-b"]
    assert (group.batches, group.largest) == (2, 3)


def test_nothing_is_answered_before_its_statement_returned() -> None:
    """Durability: a queued write's thread goes on only after the statement that carried
    its write has returned (committed), never when its batch merely left."""
    wire = Wire()
    group = _group(wire)
    first = _held(wire, group)
    (second,) = _queue(group, "b")
    time.sleep(0.05)
    assert first.answer is None and second.answer is None
    wire.gate.set()
    assert second.result() == "ok b"
    assert wire.returned.is_set()


def test_a_write_refused_for_its_saga_fails_that_thread_alone() -> None:
    wire = Wire()
    group = _group(wire)
    first = _held(wire, group)
    rest = _queue(group, "b", "bad-c", "d")
    wire.gate.set()
    answers = [w.result() for w in rest]
    assert answers[0] == "ok b" and answers[2] == "ok d"
    assert isinstance(answers[1], ValueError) and str(answers[1]) == "refused bad-c"
    assert first.result() == "ok a"


def test_a_statement_that_fails_as_a_whole_fails_every_write_in_it() -> None:
    """A lost connection leaves every write of the batch unsure: each thread gets the
    error (and finds out on its own whether its write landed); the group carries on."""
    wire = Wire()
    group = _group(wire)
    wire.failures[1] = ConnectionError("server closed the connection")
    first = _held(wire, group)
    rest = _queue(group, "b", "c")
    wire.gate.set()
    assert first.result() == "ok a"
    assert [type(w.result()) for w in rest] == [ConnectionError] * 2
    assert group.write("d") == "ok d"
    assert wire.sent == [["a"], ["b", "c"], ["d"]]


def test_a_leader_interrupted_on_the_wire_leaves_no_thread_waiting() -> None:
    """Not only Exceptions: a BaseException raised in the leader's statement reaches the
    writes of its batch, the writes queued behind it still go out, and the group goes on."""
    wire = Wire()
    group = _group(wire)
    wire.failures[0] = KeyboardInterrupt()
    first = _held(wire, group)
    second, third = _queue(group, "b", "c")
    wire.gate.set()
    assert isinstance(first.result(), KeyboardInterrupt)
    assert (second.result(), third.result()) == ("ok b", "ok c")
    assert wire.sent == [["a"], ["b", "c"]]
    assert group.write("d") == "ok d"


def test_many_threads_each_get_their_own_answer_and_every_write_goes_out_once() -> None:
    wire = Wire()
    group = _group(wire)
    lock = threading.Lock()
    answers: dict[str, str] = {}

    def work(n: int) -> None:
        for i in range(200):
            params = f"{n}-{i}"
            answer = group.write(params)
            with lock:
                answers[params] = answer

    threads = [threading.Thread(target=work, args=(n,), daemon=True) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT * 3)
        assert not thread.is_alive()
    sent = [p for batch in wire.sent for p in batch]
    assert sorted(sent) == sorted(answers) and len(sent) == 8 * 200
    assert all(answer == f"ok {params}" for params, answer in answers.items())
    assert group.batches == len(wire.sent) and not group._leading


@pytest.mark.parametrize("handed_the_lead", [False, True])
def test_a_queued_thread_interrupted_while_waiting_strands_nobody(
    handed_the_lead: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KeyboardInterrupt in a thread waiting in the queue: a write not sent yet is
    withdrawn; a batch already handed to that thread still goes out."""
    wire = Wire()
    group = _group(wire)
    first = _held(wire, group)
    interrupted = Writer(group, "b")
    waits: list[Any] = []
    original = threading.Event.wait

    def interrupted_wait(self: threading.Event, timeout: float | None = None) -> bool:
        if threading.current_thread() is interrupted and not waits:
            waits.append(self)
            if handed_the_lead:
                assert original(self, WAIT)  # handed the lead, then interrupted
            raise KeyboardInterrupt
        return original(self, timeout)

    monkeypatch.setattr(threading.Event, "wait", interrupted_wait)
    interrupted.start()
    if handed_the_lead:
        _until(lambda: _queued(group) == 1)
        (third,) = _queue(group, "c")
        wire.gate.set()
        assert isinstance(interrupted.result(), KeyboardInterrupt)
        assert third.result() == "ok c"
        assert wire.sent == [["a"], ["b", "c"]]
    else:
        assert isinstance(interrupted.result(), KeyboardInterrupt)
        assert _queued(group) == 0
        wire.gate.set()
        assert wire.sent == [["a"]]
    assert first.result() == "ok a"
    assert group.write("d") == "ok d"
