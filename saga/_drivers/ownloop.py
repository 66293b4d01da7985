"""Running async user code from blocking code: in an event loop of its own.

The blocking driver (`saga._drivers.driver`) calls an async step, or the awaitable a plain
step returned, through `run_in_own_loop`; the asyncio driver awaits them on its loop. This
module is written by hand: generated code cannot hold an `await`.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any

from saga._flows.drive import describe_error
from saga._flows.effects import AttemptTimedOut, MachineryFailedError, NotCalledError
from saga.logs import get_logger

_log = get_logger("saga")


def run_in_own_loop(
    make: Callable[[], Any],
    *,
    began: bool,
    timeout: float | None = None,
    timed_out: str = "",
) -> Any:
    """Await `make()` in a new event loop (bounded by `timeout`, past which
    `AttemptTimedOut(timed_out)`), telling the machinery's failures from the function's.

    `began`: user code already ran to produce the awaitable. If the loop fails before
    our coroutine starts, that is `NotCalledError` (nothing of the function ran) or,
    when `began`, `MachineryFailedError`; if it fails as it closes after the function
    returned, the result stands. An exception of the function itself is raised as it is.
    """
    entered = False
    returned: list[Any] = []

    async def main() -> Any:
        nonlocal entered
        entered = True
        # A TimeoutError is ours only when our deadline expired: the function's own is
        # its outcome, classified by its policy.
        scope = asyncio.timeout(timeout)
        try:
            async with scope:
                value = await make()
        except TimeoutError:
            if not scope.expired():
                raise
            raise AttemptTimedOut(timed_out) from None
        returned.append(value)
        return value

    coro = main()
    try:
        return asyncio.run(coro)
    except Exception as exc:
        if not entered:
            coro.close()
            if began:
                pending = make()
                if inspect.iscoroutine(pending):
                    pending.close()  # never to be awaited: no "never awaited" warning
                raise MachineryFailedError(exc) from exc
            raise NotCalledError(exc) from exc
        if returned:
            _log.warning("event_loop_close_failed", error=describe_error(exc))
            return returned[0]
        raise
