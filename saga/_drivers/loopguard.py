"""Refusing blocking calls of the sync API from a running event loop."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from saga.errors import SyncCallInEventLoop

P = ParamSpec("P")
R = TypeVar("R")

# How the message names an instance of each class in its `asyncio.to_thread` example.
_INSTANCE_NAMES = {"Orchestrator": "orch", "Worker": "worker"}


def refuse_in_event_loop(qualname: str, *, runs_steps: bool) -> None:
    """Raise `SyncCallInEventLoop` when the calling thread runs an event loop.

    `qualname` is the method's qualified name (`Orchestrator.execute`). Such a call would
    block every task of the loop while it waits for the database, and an async step could
    not be run there (`asyncio.run` refuses inside a running loop).
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    owner, _, name = qualname.rpartition(".")
    instance = _INSTANCE_NAMES.get(owner, owner.lower() or "obj")
    why = (
        "it blocks the loop and cannot run async steps there"
        if runs_steps
        else "it blocks the loop while it waits for the database"
    )
    raise SyncCallInEventLoop(
        f"{qualname}() was called from a running event loop; {why}. Use AsyncOrchestrator, "
        f"or call it in a thread: await asyncio.to_thread({instance}.{name}, ...)"
    )


def sync_only(*, runs_steps: bool = False) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorator of a blocking public method: refused, before it does anything, when
    called from a running event loop (`refuse_in_event_loop`)."""

    def decorate(method: Callable[P, R]) -> Callable[P, R]:
        qualname = method.__qualname__

        @functools.wraps(method)
        def guarded(*args: P.args, **kwargs: P.kwargs) -> R:
            refuse_in_event_loop(qualname, runs_steps=runs_steps)
            return method(*args, **kwargs)

        return guarded

    return decorate
