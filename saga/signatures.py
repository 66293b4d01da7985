"""Checking, when a saga is declared, that user functions can take what they will be passed."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from saga.errors import SagaDefinitionError

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def check_signature(fn: Callable[..., Any], what: str, takes: Sequence[str]) -> None:
    """Raise `SagaDefinitionError` unless `fn` can be called with the arguments `takes`
    names, passed by position (as the orchestrator calls it).

    Defaults, `*args` and `**kwargs` are accepted; a required keyword-only parameter, a
    required parameter beyond those passed, or fewer positional parameters than passed are
    not. Sync and async functions, `functools.partial`, methods and objects with
    `__call__` are read alike; a callable whose signature cannot be read is let through.
    """
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    reason = _mismatch(signature, len(takes))
    if reason is None:
        return
    raise SagaDefinitionError(
        f"{what}: {describe_callable(fn)}{signature} must take ({', '.join(takes)}): {reason}"
    )


def _mismatch(signature: inspect.Signature, count: int) -> str | None:
    """Why a call with `count` positional arguments does not fit `signature`, or None."""
    params = list(signature.parameters.values())
    for param in params:
        if param.kind is inspect.Parameter.KEYWORD_ONLY and param.default is param.empty:
            return (
                f"its parameter {param.name!r} is keyword-only and has no default, but the "
                "arguments are passed by position"
            )
    positional = [p for p in params if p.kind in _POSITIONAL]
    varargs = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
    if not varargs and len(positional) < count:
        have = len(positional) or "no"
        plural = "" if len(positional) == 1 else "s"
        return f"it takes {have} positional argument{plural}, not {count}"
    required = [p for p in positional if p.default is p.empty]
    if len(required) > count:
        return f"its parameter {required[count].name!r} would get no argument"
    try:
        signature.bind(*([None] * count))
    except TypeError as exc:  # pragma: no cover - the rules above cover binding by position
        return str(exc)
    return None


def is_async(fn: Callable[..., Any]) -> bool:
    """Whether calling `fn` only creates a coroutine (async def, a partial of one, or an
    object whose `__call__` is one)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - the method, not callability
    )


def describe_callable(fn: Callable[..., Any]) -> str:
    """The qualified name of a user function as a message names it: `Class.method`,
    `functools.partial(name)`, `Class.__call__` for a callable object."""
    if isinstance(fn, functools.partial):
        return f"functools.partial({describe_callable(fn.func)})"
    name = getattr(fn, "__qualname__", None)
    if isinstance(name, str) and (inspect.isroutine(fn) or inspect.isclass(fn)):
        return name
    return f"{type(fn).__qualname__}.__call__"


def annotated_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The function whose annotations describe calling `fn`: the function a partial wraps,
    the `__call__` of a callable object, else `fn` itself."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    if inspect.isroutine(fn) or inspect.isclass(fn):
        return fn
    call = getattr(type(fn), "__call__", None)  # noqa: B004 - the method itself
    return call if call is not None and inspect.isroutine(call) else fn
