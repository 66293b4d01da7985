"""saga._acompat: each asyncio primitive has a blocking twin of the same shape, renamed to it
by the generator of the sync twins, and both behave alike."""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import sys
import threading
import time
from pathlib import Path

import pytest

from saga import _acompat

TOOL = Path(__file__).resolve().parents[2] / "tools" / "async_to_sync.py"


def _names() -> dict[str, str]:
    spec = importlib.util.spec_from_file_location("async_to_sync", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["async_to_sync"] = module
    spec.loader.exec_module(module)
    names: dict[str, str] = module.NAMES
    return names


# The drivers' primitives (the store's helpers, appended to the module, are its own).
ASYNC_PRIMITIVES = {
    "AEvent",
    "await_set",
    "asleep",
    "arun_blocking",
    "AWorker",
    "aspawn",
    "aworker_alive",
    "astop",
    "AThreadResult",
}


def test_each_asyncio_primitive_is_renamed_to_a_blocking_twin_of_the_same_shape() -> None:
    names = _names()
    coroutine_functions = {n for n, v in vars(_acompat).items() if inspect.iscoroutinefunction(v)}
    assert coroutine_functions - set(names) == set(), "async names without a blocking twin"
    for name in sorted(ASYNC_PRIMITIVES):
        assert hasattr(_acompat, name), name
        twin = names.get(name)
        assert twin is not None, f"{name} has no blocking twin in tools/async_to_sync.py"
        assert hasattr(_acompat, twin), f"{name} -> {twin}, which saga._acompat lacks"
        primitive, blocking = getattr(_acompat, name), getattr(_acompat, twin)
        if inspect.isfunction(primitive):
            assert list(inspect.signature(primitive).parameters) == list(
                inspect.signature(blocking).parameters
            ), name
        if inspect.isclass(primitive) and name.startswith("AThread"):
            public = {n for n in vars(primitive) if not n.startswith("_")}
            assert public == {n for n in vars(blocking) if not n.startswith("_")}, name


def test_waiting_for_an_event_answers_whether_it_is_set() -> None:
    event = _acompat.Event()
    started = time.monotonic()
    assert _acompat.wait_set(event, 0.05) is False
    assert time.monotonic() - started >= 0.05
    event.set()
    assert _acompat.wait_set(event, 10) is True

    async def main() -> tuple[bool, bool]:
        aevent = _acompat.AEvent()
        unset = await _acompat.await_set(aevent, 0.05)
        asyncio.get_running_loop().call_later(0.01, aevent.set)
        return unset, await _acompat.await_set(aevent, 10)

    assert asyncio.run(main()) == (False, True)


def test_a_threads_result_is_handed_over_or_not_waited_for_past_the_bound() -> None:
    def hand(result: _acompat.ThreadResult[int] | _acompat.AThreadResult[int], go: float) -> None:
        def later() -> None:
            time.sleep(go)
            if go:
                result.set_exception(ValueError("late"))
            else:
                result.set_result(7)

        threading.Thread(target=later, daemon=True).start()

    now: _acompat.ThreadResult[int] = _acompat.ThreadResult()
    hand(now, 0)
    assert now.wait(10) and now.result() == 7
    late: _acompat.ThreadResult[int] = _acompat.ThreadResult()
    hand(late, 0.2)
    assert not late.wait(0.01)
    assert late.wait(10)
    with pytest.raises(ValueError, match="late"):
        late.result()

    async def main() -> None:
        now: _acompat.AThreadResult[int] = _acompat.AThreadResult()
        hand(now, 0)
        assert await now.wait(10) and now.result() == 7
        late: _acompat.AThreadResult[int] = _acompat.AThreadResult()
        hand(late, 0.2)
        assert not await late.wait(0.01)
        assert await late.wait(10)
        with pytest.raises(ValueError, match="late"):
            late.result()

    asyncio.run(main())


def test_a_worker_runs_until_stopped() -> None:
    stopped = _acompat.Event()
    beats: list[int] = []

    def beat() -> None:
        while not _acompat.wait_set(stopped, 0.01):
            beats.append(1)

    worker = _acompat.spawn(beat, name="beat")
    assert worker.daemon and worker.name == "beat" and _acompat.worker_alive(worker)
    stopped.set()
    _acompat.stop(worker)
    assert not _acompat.worker_alive(worker)

    async def main() -> None:
        async def forever() -> None:
            while True:
                await _acompat.asleep(0.01)

        task = _acompat.aspawn(forever, name="beat")
        assert task.get_name() == "beat" and _acompat.aworker_alive(task)
        await _acompat.astop(task)
        assert not _acompat.aworker_alive(task)

    asyncio.run(main())
