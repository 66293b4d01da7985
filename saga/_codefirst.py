"""Code-first definitions: the saga a session or a ledger channel is, a step per call.

A session's (or a ledger channel's) saga row has no declared definition: its steps are
the durable steps its code called, added as the calls happen. `code_first_definition`
gives the engine that definition for a row named with a session's or a channel's prefix;
`SessionSaga.install` makes the step that runs one call (its durable step's function
bound to the call's arguments, with its compensation and reconcile hook).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict

from saga.codec import ResultCodec
from saga.definition import Guards, Saga, Step
from saga.durable import DurableStep, context_scope, registered_step
from saga.errors import PermanentError
from saga.outcomes import Found
from saga.remedies import LEDGER_PREFIX, SESSION_PREFIX, resolve_commands
from saga.retry import RetryPolicy
from saga.signatures import is_async


class _NoInput(BaseModel):
    """A session has no input of its own: its calls carry their arguments."""

    model_config = ConfigDict(extra="allow")


def _no_key(_: _NoInput) -> str:
    return ""


class SessionSaga(Saga[_NoInput]):
    """The definition of one session: a step per call, added as the calls happen."""

    is_session = True

    def __init__(self, name: str, *, prefix: str = SESSION_PREFIX) -> None:
        super().__init__(name, version=1, input=_NoInput, key=_no_key)  # checks the name
        self.name = prefix + name
        # The exception a call raised in this process, by operation: re-raised to the
        # session's code as it was, rather than as the text the ledger keeps.
        self.raised: dict[str, BaseException] = {}
        # Why a call's result could not be stored (its codec's TypeError), by operation:
        # the session's code gets a TypeError of its own, the session is parked.
        self.refused: dict[str, TypeError] = {}
        # The calls whose reconcile hook found their effect in this process: settled
        # without running, so counted as reconciled, neither executed nor replayed.
        self.found: set[str] = set()

    def adopt(self, ops: Sequence[Any]) -> None:
        """Install a step for each call the rows record that this definition does not
        know yet (made by an earlier process): its durable step as registered here, and
        its arguments as stored, for the compensations and reconciles that run without
        the code calling it again."""
        known = {step.name for step in self.steps}
        actions = [op for op in ops if op.kind == "action"]
        for index, op in enumerate(actions):
            if op.step in known:
                continue
            durable = registered_step(op.step.rsplit(".", 1)[0])
            args = None
            if durable is not None and op.request is not None:
                try:
                    args = durable.arguments_of(op.request)
                except TypeError:
                    args = None  # the step's signature changed: its hooks say so if run
            self.install(op.step, getattr(op, "position", index), durable, args)

    def install(
        self, name: str, position: int, durable: DurableStep[Any, Any] | None, args: Any
    ) -> Step:
        """The step that runs call `name`: `durable`'s function bound to the call's
        arguments (`args` as `(positional, keywords)`, or None when they are not known
        here)."""
        self.steps = [s for s in self.steps if s.name != name]
        if durable is None:
            step = Step(
                self,
                _not_here(name),
                name=name,
                index=position,
                retry=_ONE_ATTEMPT,
                idempotent=False,
                pivot=False,
                guards=Guards(),
            )
            # Whether the step has a compensation is not known here: undoing the session
            # stops at this call (and parks) rather than passing over it as if it had none.
            step.compensation(retry=_ONE_ATTEMPT)(_not_here_to_undo(name))
            self.steps.append(step)
            return step
        step = Step(
            self,
            _action(durable, args, self.raised, name),
            name=name,
            index=position,
            retry=durable.retry,
            idempotent=durable.idempotent,
            pivot=False,
            guards=Guards(timeout_seconds=durable.timeout_seconds, side_effect=durable.side_effect),
        )
        step.codec = _Reported(durable.codec, self.refused, name)
        if durable.compensation_fn is not None:
            step.compensation(
                retry=durable.compensation_retry, idempotent=durable.compensation_idempotent
            )(_compensation(durable, args, name))
        if durable.reconcile_fn is not None:
            step.reconcile(
                window_seconds=durable.reconcile_window_seconds, retry=durable.reconcile_retry
            )(_hook(durable.reconcile_fn, args, name, self.found))
        self.steps.append(step)
        return step


_ONE_ATTEMPT = RetryPolicy(max_attempts=1)


class _Reported(ResultCodec):
    """A call's result codec (`inner`, which does all the encoding and checking) that
    also keeps the `TypeError` of a result it refuses in `refused[name]`, for the session
    to tell the call's code why the call parked the session."""

    def __init__(self, inner: ResultCodec, refused: dict[str, TypeError], name: str) -> None:
        # Nothing of ResultCodec's own set-up: every value goes through `inner`.
        self.where = inner.where
        self._inner = inner
        self._refused = refused
        self._name = name

    def encode(self, value: object) -> Any:
        """`inner`'s JSON for `value`; its TypeError is kept, then raised."""
        try:
            return self._inner.encode(value)
        except TypeError as exc:
            self._refused[self._name] = exc
            raise

    def decode(self, stored: Any) -> Any:
        """`inner`'s value for `stored`."""
        return self._inner.decode(stored)


def code_first_definition(name: str) -> SessionSaga | None:
    """The definition of a session's or a ledger channel's saga row named `name` (their
    calls' steps are those of the durable steps registered in this process), or None when
    `name` is a declared saga's."""
    for prefix in (SESSION_PREFIX, LEDGER_PREFIX):
        if name.startswith(prefix):
            return SessionSaga(name.removeprefix(prefix), prefix=prefix)
    return None


def _not_here(name: str) -> Callable[..., Any]:
    def call(ctx: Any, _input: Any) -> Any:
        raise PermanentError(
            f"call {name!r} was made by an earlier process and its durable step is not "
            "imported here"
        )

    return call


def _not_here_to_undo(name: str) -> Callable[..., Any]:
    step = name.rsplit(".", 1)[0]

    def call(ctx: Any, _input: Any, result: Any) -> Any:
        raise PermanentError(
            f"call {name!r} cannot be undone here: its durable step {step!r} is not imported "
            "in this process, so whether it has a compensation is not known; run this with "
            "the module that defines it imported (`--app`), or undo it by hand and settle it "
            f"with `{resolve_commands('ID', name, 'compensation')[0]}`"
        )

    return call


def _arguments(args: Any, name: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if args is None:
        raise PermanentError(
            f"the arguments of call {name!r} were not JSON, so they were not stored: only "
            "the process that made the call could run this; settle it by hand and resolve it"
        )
    return args  # type: ignore[no-any-return]


def _action(
    durable: DurableStep[Any, Any], args: Any, raised: dict[str, BaseException], name: str
) -> Callable[..., Any]:
    if durable.is_async:

        async def acall(ctx: Any, _input: Any) -> Any:
            positional, keywords = _arguments(args, name)
            with context_scope(ctx):
                try:
                    return await durable.fn(*positional, **keywords)
                except BaseException as exc:
                    raised[name] = exc
                    raise

        return acall

    def call(ctx: Any, _input: Any) -> Any:
        positional, keywords = _arguments(args, name)
        with context_scope(ctx):
            try:
                return durable.fn(*positional, **keywords)
            except BaseException as exc:
                raised[name] = exc
                raise

    return call


def _compensation(durable: DurableStep[Any, Any], args: Any, name: str) -> Callable[..., Any]:
    fn = durable.compensation_fn
    assert fn is not None
    if is_async(fn):

        async def acall(ctx: Any, _input: Any, result: Any) -> Any:
            positional, keywords = _arguments(args, name)
            with context_scope(ctx):
                return await fn(ctx, result, *positional, **keywords)

        return acall

    def call(ctx: Any, _input: Any, result: Any) -> Any:
        positional, keywords = _arguments(args, name)
        with context_scope(ctx):
            return fn(ctx, result, *positional, **keywords)

    return call


def _hook(
    fn: Callable[..., Any], args: Any, name: str, found: set[str] | None = None
) -> Callable[..., Any]:
    """A durable step's reconcile or prepare hook as its call's step calls it: with the
    context, then the call's own arguments. With `found`, a reconcile hook's `Found`
    answer adds the call's name to it."""

    def noted(answer: Any) -> Any:
        if found is not None and isinstance(answer, Found):
            found.add(name)
        return answer

    if is_async(fn):

        async def acall(ctx: Any, _input: Any) -> Any:
            positional, keywords = _arguments(args, name)
            with context_scope(ctx):
                return noted(await fn(ctx, *positional, **keywords))

        return acall

    def call(ctx: Any, _input: Any) -> Any:
        positional, keywords = _arguments(args, name)
        with context_scope(ctx):
            return noted(fn(ctx, *positional, **keywords))

    return call
