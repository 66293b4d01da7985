"""Durable steps: the decorator side of the code-first door.

A function decorated with `durable_step` stays a plain function outside a session: calling
it calls the function, nothing is stored, so step code can be unit-tested directly. Inside
a session (`session_scope`, entered by the session runner), a call is handed to the
session, which records it on the ledger under a key and replays its stored result when the
same key is called again.

This module holds what a session needs from a step and nothing that does I/O:

- `DurableStep`: the function, its options and hooks (compensation, reconcile, prepare);
  `call_of` turns a call's arguments into its key, stored arguments and request hash, and
  `arguments_of` rebuilds the arguments from what was stored, so a later process can call
  the compensation without the original Python objects;
- `current_context()` / `context_scope()`: the `StepContext` of the call in progress;
- `active_session()` / `session_scope()`: the session of the current context;
- a process-wide registry of steps by name (`registered_step`), filled at decoration time.

The current session and context live in `contextvars`: they follow `await`, are copied
into tasks made with `asyncio.create_task`, and are not seen by plain threads (run the
thread's work in `contextvars.copy_context().run(...)` to carry them).
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Generic, ParamSpec, Protocol, TypeVar, overload

from saga.codec import ResultCodec
from saga.context import StepContext
from saga.definition import Guards, check_name, check_reconcile_window, check_retry
from saga.errors import SagaDefinitionError
from saga.keys import JsonValue, canonical_json, check_json, request_hash, same_request
from saga.retry import RetryPolicy
from saga.signatures import describe_callable, is_async

P = ParamSpec("P")
R = TypeVar("R")
Fn = TypeVar("Fn", bound=Callable[..., Any])

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_VAR_POSITIONAL = inspect.Parameter.VAR_POSITIONAL
_KEYWORD_ONLY = inspect.Parameter.KEYWORD_ONLY
_VAR_KEYWORD = inspect.Parameter.VAR_KEYWORD

# check_json's advice is written for results; arguments get advice of their own.
_RESULT_ADVICE = " (return JSON values or a pydantic model)"


class SessionLike(Protocol):
    """What a session offers durable steps: running (or replaying) one call."""

    def call(
        self, step: DurableStep[Any, Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Run `step` with these arguments under the session's ledger, or replay it."""
        ...


_SESSION: ContextVar[SessionLike | None] = ContextVar("saga.durable.session", default=None)
_CONTEXT: ContextVar[StepContext | None] = ContextVar("saga.durable.context", default=None)


def active_session() -> SessionLike | None:
    """The session of the current context, or None (durable steps are then plain calls)."""
    return _SESSION.get()


@contextmanager
def session_scope(session: SessionLike) -> Iterator[SessionLike]:
    """Make `session` the active session inside the block, and restore the previous one
    (usually none) when the block exits, whether or not it raised."""
    token = _SESSION.set(session)
    try:
        yield session
    finally:
        _SESSION.reset(token)


def current_context() -> StepContext | None:
    """The `StepContext` of the durable call in progress in this context: its key,
    attempt, fence... None outside a durable call (and always outside a session)."""
    return _CONTEXT.get()


@contextmanager
def context_scope(ctx: StepContext) -> Iterator[StepContext]:
    """Make `ctx` what `current_context()` returns inside the block (the session runner
    wraps each call with it), and restore the previous value when the block exits,
    whether or not it raised."""
    token = _CONTEXT.set(ctx)
    try:
        yield ctx
    finally:
        _CONTEXT.reset(token)


@dataclass(frozen=True, slots=True)
class DurableCall:
    """One call of a durable step, as the ledger identifies it.

    Attributes:
        step: Name of the step.
        key: The call's key within the session: what `key=` returned, else the canonical
            JSON of the bound arguments.
        arguments: The arguments bound to the step's signature, defaults applied, as a
            JSON object by parameter name (`*args` as a list and `**kwargs` as an object,
            each under its own name); None when they are not JSON (a step with `key=`).
        request_hash: Hash of step, key and arguments: the same key with other arguments
            has another hash.
    """

    step: str
    key: str
    arguments: JsonValue | None
    request_hash: str

    def matches(self, stored_hash: str, version: int) -> bool:
        """Whether a call stored with `stored_hash` (of hash version `version`) is this
        one: the same step, key and arguments, compared under the stored row's version."""
        return same_request(
            stored_hash, call_fingerprint(self.step, self.key, self.arguments), version=version
        )


def call_fingerprint(step: str, key: str, arguments: JsonValue | None) -> dict[str, JsonValue]:
    """The fields a durable call's request hash covers: its step, key and arguments."""
    return {"step": step, "key": key, "arguments": arguments}


class DurableStep(Generic[P, R]):
    """A function whose calls inside a session are recorded on the ledger and replayed.

    Made by `durable_step`; calling it outside a session calls the function. Attributes:
    `name`, `fn`, `key` (the key function or None), `retry`, `idempotent`,
    `timeout_seconds`, `side_effect`, `is_async`, `codec` (its result's `ResultCodec`), `signature`,
    and what its hooks registered: `compensation_fn`, `compensation_is_async`,
    `compensation_retry`, `compensation_idempotent`, `compensation_codec`,
    `reconcile_fn`, `reconcile_is_async`, `reconcile_window_seconds`, `reconcile_retry`,
    `prepare_fn`, `prepare_is_async`, `request_codec`.
    """

    # Copied from the function by `functools.update_wrapper` (the step's name when the
    # function has none, e.g. a callable object).
    __name__: str
    __qualname__: str
    __wrapped__: Callable[..., Any]

    def __init__(
        self,
        fn: Callable[P, R],
        *,
        name: str | None = None,
        key: Callable[..., str] | None = None,
        retry: RetryPolicy | None = None,
        idempotent: bool = False,
        timeout_seconds: float | None = None,
        side_effect: bool = True,
    ) -> None:
        if isinstance(fn, DurableStep):
            raise SagaDefinitionError(f"{fn.name!r} is already a durable step")
        if not callable(fn):
            raise SagaDefinitionError(f"a durable step must be a function, got {fn!r}")
        functools.update_wrapper(self, fn)
        step_name = name if name is not None else getattr(fn, "__name__", None)
        if step_name is None:
            raise SagaDefinitionError(
                f"{describe_callable(fn)} has no __name__: pass name= to durable_step"
            )
        self.name: str = check_name("durable step", step_name)
        if "__name__" not in vars(self):
            self.__name__ = self.__qualname__ = self.name
        self.where = f"durable step {self.name!r}"
        check_retry(retry, self.where)
        try:
            Guards(timeout_seconds=timeout_seconds)
        except SagaDefinitionError as exc:
            raise SagaDefinitionError(f"{self.where}: {exc}") from None
        try:
            self.signature: inspect.Signature = inspect.signature(fn)
        except (TypeError, ValueError) as exc:
            raise SagaDefinitionError(
                f"{self.where}: the signature of {describe_callable(fn)} cannot be read "
                f"({exc}); its calls are keyed by their arguments, so wrap it in a def"
            ) from None
        self.fn: Callable[P, R] = fn
        self.key: Callable[..., str] | None = key
        if key is not None:
            if not callable(key):
                raise SagaDefinitionError(f"{self.where}: key must be a function, got {key!r}")
            self._check_takes(key, "key function", ())
        self.retry: RetryPolicy = retry or RetryPolicy()
        self.idempotent: bool = idempotent
        self.side_effect: bool = bool(side_effect)
        self.timeout_seconds: float | None = (
            float(timeout_seconds) if timeout_seconds is not None else None
        )
        self.is_async: bool = is_async(fn)
        self.codec = ResultCodec(fn, where=self.where)
        self.compensation_fn: Callable[..., Any] | None = None
        self.compensation_is_async: bool = False
        self.compensation_retry: RetryPolicy = RetryPolicy()
        self.compensation_idempotent: bool = False
        self.compensation_codec: ResultCodec | None = None
        self.reconcile_fn: Callable[..., Any] | None = None
        self.reconcile_is_async: bool = False
        self.reconcile_window_seconds: float = 0.0
        self.reconcile_retry: RetryPolicy = RetryPolicy(initial_delay=0.5, max_delay=5.0)
        self.prepare_fn: Callable[..., Any] | None = None
        self.prepare_is_async: bool = False
        self.request_codec: ResultCodec | None = None

    def __repr__(self) -> str:
        return f"<durable step {self.name!r} of {_qualified(self.fn)}>"

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        """Outside a session, call the function (an async one returns its coroutine);
        inside one, hand the call to the session, which runs it durably or replays it."""
        session = _SESSION.get()
        if session is None:
            return self.fn(*args, **kwargs)
        result: R = session.call(self, args, dict(kwargs))
        return result

    # ----- hooks ---------------------------------------------------------------------------

    @overload
    def compensation(self, fn: Fn, /) -> Fn: ...

    @overload
    def compensation(
        self, *, retry: RetryPolicy | None = None, idempotent: bool = False
    ) -> Callable[[Fn], Fn]: ...

    def compensation(
        self,
        fn: Fn | None = None,
        *,
        retry: RetryPolicy | None = None,
        idempotent: bool = False,
    ) -> Fn | Callable[[Fn], Fn]:
        """Decorator: declare the compensating action of this step (at most one).

        It is called as `(ctx, result, *args, **kwargs)`: the call's own arguments (as
        `arguments_of` rebuilds them from the ledger) after the context and the step's
        result. A function that cannot take them is refused here
        (`SagaDefinitionError`). Returns the function unchanged.

        Args:
            retry: Retry policy of its attempts.
            idempotent: The provider dedupes on `ctx.idempotency_key`, so an attempt
                whose outcome is unknown may be retried with the same key.
        """
        check_retry(retry, f"compensation of {self.where}")

        def register(func: Fn) -> Fn:
            self._check_unset(self.compensation_fn, "a compensation")
            self._check_takes(func, "compensation", ("ctx", "result"))
            codec = ResultCodec(func, where=f"compensation of {self.where}")
            self.compensation_fn = func
            self.compensation_is_async = is_async(func)
            self.compensation_retry = retry or RetryPolicy()
            self.compensation_idempotent = idempotent
            self.compensation_codec = codec
            return func

        return register(fn) if fn is not None else register

    @overload
    def reconcile(self, fn: Fn, /) -> Fn: ...

    @overload
    def reconcile(
        self, *, window_seconds: float = 0.0, retry: RetryPolicy | None = None
    ) -> Callable[[Fn], Fn]: ...

    def reconcile(
        self,
        fn: Fn | None = None,
        *,
        window_seconds: float = 0.0,
        retry: RetryPolicy | None = None,
    ) -> Fn | Callable[[Fn], Fn]:
        """Decorator: ask the provider, by key, whether a call whose outcome is unknown
        happened (`Found`, `Absent` or `Inconclusive`, as for declared steps).

        It is called as `(ctx, *args, **kwargs)` with the call's own arguments, sync or
        async. Returns the function unchanged.

        Args:
            window_seconds: For how long an `Inconclusive` (or an unsettled `Absent`)
                answer is asked again, with backoff, before the session parks; 0 parks
                at the first inconclusive answer.
            retry: Backoff between those asks.
        """
        check_reconcile_window(window_seconds, f"reconcile of {self.where}")
        check_retry(retry, f"reconcile of {self.where}")

        def register(func: Fn) -> Fn:
            self._check_unset(self.reconcile_fn, "a reconcile function")
            self._check_takes(func, "reconcile", ("ctx",))
            self.reconcile_fn = func
            self.reconcile_is_async = is_async(func)
            self.reconcile_window_seconds = float(window_seconds)
            if retry is not None:
                self.reconcile_retry = retry
            return func

        return register(fn) if fn is not None else register

    def prepare(self, fn: Fn, /) -> Fn:
        """Decorator: compute the request (the typed intent) an attempt acts on.

        It is called as `(ctx, *args, **kwargs)` before every attempt, sync or async; the
        attempt reads the request as `ctx.request`. Returns the function unchanged.
        """
        self._check_unset(self.prepare_fn, "a prepare function")
        self._check_takes(fn, "prepare", ("ctx",))
        codec = ResultCodec(fn, where=f"request of {self.where}")
        self.prepare_fn = fn
        self.prepare_is_async = is_async(fn)
        self.request_codec = codec
        return fn

    def _check_unset(self, hook: Callable[..., Any] | None, what: str) -> None:
        """Refuse a second hook of a kind (`what`) the step has one of already (`hook`)."""
        if hook is not None:
            raise SagaDefinitionError(
                f"{self.where} already has {what} ({describe_callable(hook)})"
            )

    def _check_takes(self, fn: object, what: str, leading: tuple[str, ...]) -> None:
        """Refuse `fn` unless it can be called with `leading` then the step's arguments,
        passed as `arguments_of` passes them (as far as its signature can be read)."""
        if not callable(fn):
            raise SagaDefinitionError(f"{what} of {self.where} must be a function, got {fn!r}")
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):
            return
        params = list(self.signature.parameters.values())
        positional = [p.name for p in params if p.kind in _POSITIONAL]
        keywords = [p.name for p in params if p.kind is _KEYWORD_ONLY]
        var_positional = next((p.name for p in params if p.kind is _VAR_POSITIONAL), None)
        var_keyword = next((p.name for p in params if p.kind is _VAR_KEYWORD), None)
        kinds = {p.kind for p in signature.parameters.values()}
        reason: str | None = None
        if var_positional is not None and _VAR_POSITIONAL not in kinds:
            reason = f"the step takes *{var_positional}, so it must take *args"
        elif var_keyword is not None and _VAR_KEYWORD not in kinds:
            reason = f"the step takes **{var_keyword}, so it must take **kwargs"
        else:
            try:
                signature.bind(
                    *([None] * (len(leading) + len(positional))),
                    **dict.fromkeys(keywords),
                )
            except TypeError as exc:
                reason = str(exc)
        if reason is None:
            return
        takes = [*leading, *positional]
        if var_positional is not None:
            takes.append(f"*{var_positional}")
        elif keywords:
            takes.append("*")
        takes.extend(keywords)
        if var_keyword is not None:
            takes.append(f"**{var_keyword}")
        raise SagaDefinitionError(
            f"{what} of {self.where}: {describe_callable(fn)}{signature} must take "
            f"({', '.join(takes)}): {reason}"
        )

    # ----- keys and arguments --------------------------------------------------------------

    def call_of(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> DurableCall:
        """The key, stored arguments and request hash of calling the step with `args`
        and `kwargs`, computed before anything runs.

        The arguments are bound to the step's signature with defaults applied, so
        `f(1)`, `f(a=1)` and `f(1, b=<default>)` are one call. The key is what `key=`
        returns for them (passed as the hooks are: positional parameters by position,
        keyword-only ones by keyword, defaults filled in), else their canonical JSON
        (never a `repr`).

        Raises:
            TypeError: The arguments do not fit the signature (Python's message, the step
                named); without `key=`, an argument is not JSON; the key function raised
                or returned something other than a str.
        """
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{self.where}: {exc}") from None
        bound.apply_defaults()
        arguments: dict[str, Any] = {}
        for param_name, value in bound.arguments.items():
            kind = self.signature.parameters[param_name].kind
            arguments[param_name] = list(value) if kind is _VAR_POSITIONAL else value
        problem = _not_json(arguments)
        if self.key is None:
            if problem is not None:
                raise TypeError(
                    f"{self.where}: argument {problem[0]!r} is not JSON ({problem[1]}); "
                    "calls are keyed by their arguments' JSON, never their repr: pass key= "
                    "(a function of the arguments returning a str) to durable_step"
                )
            key = canonical_json(arguments)
        else:
            key = self._key_of(bound.args, bound.kwargs)
        stored = arguments if problem is None else None
        return DurableCall(
            step=self.name,
            key=key,
            arguments=stored,
            request_hash=request_hash(call_fingerprint(self.name, key, stored)),
        )

    def _key_of(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        assert self.key is not None
        try:
            key = self.key(*args, **kwargs)
        except Exception as exc:
            raise TypeError(
                f"{self.where}: its key function raised {type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(key, str):
            raise TypeError(
                f"{self.where}: its key function must return a str, got "
                f"{type(key).__name__} {key!r}"
            )
        try:
            check_json(key, where="key")
        except TypeError as exc:
            raise TypeError(f"{self.where}: {exc}") from None
        return key

    def arguments_of(self, call_arguments: JsonValue) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Positional and keyword arguments rebuilt from a call's stored `arguments`.

        Positional-only and positional-or-keyword parameters are passed by position,
        `*args` expanded, keyword-only parameters and `**kwargs` by keyword, so a later
        process can call the compensation and hooks without the original objects.

        Raises:
            TypeError: The arguments were not stored (None: the step has `key=` and they
                were not JSON), or they no longer fit the step's signature.
        """
        if call_arguments is None:
            raise TypeError(
                f"{self.where}: the call's arguments were not stored (they were not JSON), "
                "so they cannot be rebuilt"
            )
        if not isinstance(call_arguments, dict):
            raise TypeError(
                f"{self.where}: stored arguments must be a JSON object, got "
                f"{type(call_arguments).__name__}"
            )
        unknown = sorted(set(call_arguments) - set(self.signature.parameters))
        if unknown:
            raise TypeError(
                f"{self.where}: stored arguments {unknown} are not parameters of "
                f"{describe_callable(self.fn)}{self.signature}"
            )
        args: list[Any] = []
        kwargs: dict[str, Any] = {}
        by_position = True
        for param in self.signature.parameters.values():
            if param.name not in call_arguments:
                # A parameter stored calls did not have: what follows goes by keyword.
                by_position = False
                continue
            value = call_arguments[param.name]
            if param.kind in _POSITIONAL and by_position:
                args.append(value)
            elif param.kind is _VAR_POSITIONAL and by_position:
                if not isinstance(value, list):
                    raise TypeError(f"{self.where}: stored *{param.name} must be a JSON list")
                args.extend(value)
            elif param.kind is _VAR_KEYWORD:
                if not isinstance(value, dict):
                    raise TypeError(f"{self.where}: stored **{param.name} must be a JSON object")
                kwargs.update(value)
            elif param.kind is _VAR_POSITIONAL:
                if value:
                    raise TypeError(
                        f"{self.where}: stored *{param.name} cannot be passed after a "
                        "missing positional parameter"
                    )
            else:
                kwargs[param.name] = value
        try:
            self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(
                f"{self.where}: stored arguments do not fit {describe_callable(self.fn)}"
                f"{self.signature}: {exc}"
            ) from None
        return tuple(args), kwargs


def _not_json(arguments: dict[str, Any]) -> tuple[str, str] | None:
    """(parameter, why) of the first argument that is not JSON, or None."""
    for param_name, value in arguments.items():
        try:
            check_json(value, where=param_name)
        except TypeError as exc:
            why = str(exc).removeprefix(f"{param_name}: ").removesuffix(_RESULT_ADVICE)
            return param_name, why
    return None


# ----- the decorator and the registry ------------------------------------------------------

_REGISTRY: dict[str, DurableStep[Any, Any]] = {}
_REGISTRY_LOCK = threading.Lock()


def _qualified(fn: Callable[..., Any]) -> str:
    module = getattr(fn, "__module__", None)
    name = describe_callable(fn)
    return f"{module}.{name}" if module else name


def _same_function(a: object, b: object) -> bool:
    """The same function, or the same one defined again (a module imported twice)."""
    if a is b:
        return True
    if not (inspect.isfunction(a) and inspect.isfunction(b)):
        return False
    return (a.__module__, a.__qualname__) == (b.__module__, b.__qualname__)


def _register(step: DurableStep[Any, Any]) -> None:
    with _REGISTRY_LOCK:
        existing = _REGISTRY.get(step.name)
        if existing is not None and not _same_function(existing.fn, step.fn):
            raise SagaDefinitionError(
                f"durable step name {step.name!r} is already used by {_qualified(existing.fn)}; "
                f"{_qualified(step.fn)} needs another name (pass name=)"
            )
        _REGISTRY[step.name] = step


@contextmanager
def isolated_steps() -> Iterator[None]:
    """A registry of its own for the block: it starts empty, and the steps registered
    before it are back after it (those registered inside are forgotten). For test suites
    whose tests define steps under names that other tests, or the application, use."""
    with _REGISTRY_LOCK:
        saved = dict(_REGISTRY)
        _REGISTRY.clear()
    try:
        yield
    finally:
        with _REGISTRY_LOCK:
            _REGISTRY.clear()
            _REGISTRY.update(saved)


def registered_step_names() -> list[str]:
    """The names of the durable steps registered in this process, sorted."""
    with _REGISTRY_LOCK:
        return sorted(_REGISTRY)


def registered_step(name: str) -> DurableStep[Any, Any] | None:
    """The durable step registered under `name` in this process, or None.

    Steps register when they are decorated, so a process finds the steps of every
    module it has imported (a session resumed elsewhere imports the same modules).
    """
    with _REGISTRY_LOCK:
        return _REGISTRY.get(name)


@overload
def durable_step(fn: Callable[P, R], /) -> DurableStep[P, R]: ...


@overload
def durable_step(
    *,
    name: str | None = None,
    key: Callable[..., str] | None = None,
    retry: RetryPolicy | None = None,
    idempotent: bool = False,
    timeout_seconds: float | None = None,
    side_effect: bool = True,
) -> Callable[[Callable[P, R]], DurableStep[P, R]]: ...


def durable_step(
    fn: Callable[P, R] | None = None,
    /,
    *,
    name: str | None = None,
    key: Callable[..., str] | None = None,
    retry: RetryPolicy | None = None,
    idempotent: bool = False,
    timeout_seconds: float | None = None,
    side_effect: bool = True,
) -> DurableStep[P, R] | Callable[[Callable[P, R]], DurableStep[P, R]]:
    """Decorator: make a sync or async function a durable step (`@durable_step` or
    `@durable_step(...)`).

    Outside a session the step is a plain call of the function. Inside one, its first
    call with a given key records the call and its outcome; a later call with the same
    key returns the stored result, and the same key with other arguments is an
    `IdempotencyConflict`. The step is registered under its name for this process; a
    different function under a name already used is refused (`SagaDefinitionError`).

    Args:
        name: Step name (default: the function's name), 1 to 100 letters, digits, '_',
            '-' or '.'.
        key: Function of the call's arguments returning the call's key (a str); it is
            passed the arguments bound to the signature, defaults applied, however the
            call spelled them, and must accept every call the step accepts (checked
            here). Without it the key is the canonical JSON of those arguments, and
            arguments that are not JSON raise `TypeError`.
        retry: Retry policy of its attempts (default `RetryPolicy()`).
        idempotent: The provider dedupes on `ctx.idempotency_key`, so an attempt whose
            outcome is unknown may be retried with the same key.
        timeout_seconds: Longest attempt; one past it has an unknown outcome.
        side_effect: False for a call that changes nothing outside (an LLM call, a
            computation): it counts against no `max_side_effects`, and a fork of a
            finished session may run it again (`Orchestrator.fork`).
    """

    def decorate(func: Callable[P, R]) -> DurableStep[P, R]:
        step = DurableStep(
            func,
            name=name,
            key=key,
            retry=retry,
            idempotent=idempotent,
            timeout_seconds=timeout_seconds,
            side_effect=side_effect,
        )
        _register(step)
        return step

    return decorate(fn) if fn is not None else decorate
