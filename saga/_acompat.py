"""The few primitives that differ between the asyncio sources and their blocking twins."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

# the doors

_Method = TypeVar("_Method", bound=Callable[..., Any])


def sync_only(*, runs_steps: bool = False) -> Callable[[_Method], _Method]:
    """The asyncio twin of `saga._drivers.loopguard.sync_only`, which refuses a blocking
    method called from a running event loop: an asyncio method is made for the loop, so
    there is nothing to refuse and the method is returned as it is."""

    def keep(method: _Method) -> _Method:
        return method

    return keep
