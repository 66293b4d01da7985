"""Declaring sagas: ordered steps, each with an optional compensation and reconcile hook."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, TypeVar, overload

from pydantic import BaseModel

from saga.codec import ResultCodec
from saga.errors import SagaDefinitionError
from saga.keys import JsonValue, request_hash
from saga.retry import RetryPolicy

InputT = TypeVar("InputT", bound=BaseModel)
Fn = TypeVar("Fn", bound=Callable[..., Any])

_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


def _check_name(what: str, name: str) -> str:
    if not isinstance(name, str) or not name or not set(name) <= _NAME_CHARS or len(name) > 100:
        raise SagaDefinitionError(
            f"{what} name {name!r} is invalid: use 1 to 100 letters, digits, '_', '-' or '.'"
        )
    return name


class Compensation:
    """The compensating action of one step (see `Step.compensation`)."""

    def __init__(
        self, step: Step, fn: Callable[..., Any], *, retry: RetryPolicy, idempotent: bool
    ) -> None:
        self.step = step
        self.fn = fn
        self.retry = retry
        self.idempotent = idempotent
        self.reconcile_fn: Callable[..., Any] | None = None
        self.is_async = inspect.iscoroutinefunction(fn)
        self.codec = ResultCodec(fn, where=f"compensation of step {step.name!r}")

    def reconcile(self, fn: Fn) -> Fn:
        """Decorator: ask the provider, by key, whether an unknown compensation happened."""
        if self.reconcile_fn is not None:
            raise SagaDefinitionError(
                f"compensation of step {self.step.name!r} already has a reconcile function"
            )
        self.reconcile_fn = fn
        return fn


class Step:
    """One forward step of a saga; use it as a decorator target for its hooks."""

    def __init__(
        self,
        saga: Saga[Any],
        fn: Callable[..., Any],
        *,
        name: str,
        index: int,
        retry: RetryPolicy,
        idempotent: bool,
        pivot: bool,
    ) -> None:
        self.saga = saga
        self.fn = fn
        self.name = name
        self.index = index
        self.retry = retry
        self.idempotent = idempotent
        self.pivot = pivot
        self.compensation_op: Compensation | None = None
        self.reconcile_fn: Callable[..., Any] | None = None
        self.is_async = inspect.iscoroutinefunction(fn)
        self.codec = ResultCodec(fn, where=f"step {name!r}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Calling the step calls its function (handy in unit tests of step code)."""
        return self.fn(*args, **kwargs)

    @overload
    def compensation(self, fn: Callable[..., Any], /) -> Compensation: ...

    @overload
    def compensation(
        self, *, retry: RetryPolicy | None = None, idempotent: bool = False
    ) -> Callable[[Callable[..., Any]], Compensation]: ...

    def compensation(
        self,
        fn: Callable[..., Any] | None = None,
        *,
        retry: RetryPolicy | None = None,
        idempotent: bool = False,
    ) -> Compensation | Callable[[Callable[..., Any]], Compensation]:
        """Decorator: declare the compensating action of this step (at most one)."""

        def register(func: Callable[..., Any]) -> Compensation:
            if self.compensation_op is not None:
                raise SagaDefinitionError(
                    f"step {self.name!r} of saga {self.saga.name!r} already has a compensation "
                    f"({self.compensation_op.fn.__name__})"
                )
            _check_callable(func, f"compensation of step {self.name!r}")
            self.compensation_op = Compensation(
                self, func, retry=retry or RetryPolicy(), idempotent=idempotent
            )
            return self.compensation_op

        return register(fn) if fn is not None else register

    def reconcile(self, fn: Fn) -> Fn:
        """Decorator: ask the provider, by key, whether an unknown attempt happened."""
        if self.reconcile_fn is not None:
            raise SagaDefinitionError(f"step {self.name!r} already has a reconcile function")
        _check_callable(fn, f"reconcile of step {self.name!r}")
        self.reconcile_fn = fn
        return fn


class Saga(Generic[InputT]):
    """A saga type: a name, a version, an input model and ordered steps.

    Args:
        name: Saga name, part of every idempotency key.
        version: Version of the definition; bump it when steps change meaning.
        input: Pydantic model of the saga's input.
        key: Business key of an instance (e.g. the renewal event id).
        tenant: Tenant of an instance; defaults to the empty tenant.
        volatile: Input fields left out of the request hash (timestamps, trace ids).
    """

    def __init__(
        self,
        name: str,
        *,
        version: int = 1,
        input: type[InputT],
        key: Callable[[InputT], str],
        tenant: Callable[[InputT], str] | None = None,
        volatile: Sequence[str] = (),
    ) -> None:
        self.name = _check_name("saga", name)
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise SagaDefinitionError(f"saga {name!r}: version must be a positive int")
        if not (isinstance(input, type) and issubclass(input, BaseModel)):
            raise SagaDefinitionError(f"saga {name!r}: input must be a pydantic model class")
        unknown = set(volatile) - set(input.model_fields)
        if unknown:
            raise SagaDefinitionError(
                f"saga {name!r}: volatile fields {sorted(unknown)} are not fields of "
                f"{input.__name__}"
            )
        self.version = version
        self.input = input
        self.key_fn = key
        self.tenant_fn = tenant
        self.volatile = tuple(volatile)
        self.steps: list[Step] = []

    def __repr__(self) -> str:
        return f"Saga({self.name!r}, version={self.version})"

    @overload
    def step(self, fn: Callable[..., Any], /) -> Step: ...

    @overload
    def step(
        self,
        *,
        name: str | None = None,
        retry: RetryPolicy | None = None,
        idempotent: bool = False,
        pivot: bool = False,
    ) -> Callable[[Callable[..., Any]], Step]: ...

    def step(
        self,
        fn: Callable[..., Any] | None = None,
        *,
        name: str | None = None,
        retry: RetryPolicy | None = None,
        idempotent: bool = False,
        pivot: bool = False,
    ) -> Step | Callable[[Callable[..., Any]], Step]:
        """Decorator: append a step; it runs after the steps declared before it."""

        def register(func: Callable[..., Any]) -> Step:
            _check_callable(func, "step")
            step_name = _check_name("step", name or func.__name__)
            if self.step_named(step_name) is not None:
                raise SagaDefinitionError(
                    f"saga {self.name!r} already has a step named {step_name!r}"
                )
            step = Step(
                self,
                func,
                name=step_name,
                index=len(self.steps),
                retry=retry or RetryPolicy(),
                idempotent=idempotent,
                pivot=pivot,
            )
            self.steps.append(step)
            return step

        return register(fn) if fn is not None else register

    def step_named(self, name: str) -> Step | None:
        """The step called `name`, or None."""
        return next((s for s in self.steps if s.name == name), None)

    def validate_input(self, data: InputT | dict[str, Any]) -> InputT:
        """Validate `data` against the input model (pydantic's ValidationError when invalid)."""
        if isinstance(data, self.input):
            return self.input.model_validate(data.model_dump())
        return self.input.model_validate(data)

    def identity(self, data: InputT) -> tuple[str, str]:
        """(tenant, key) of an instance, checked to be non-empty strings."""
        key = self.key_fn(data)
        tenant = self.tenant_fn(data) if self.tenant_fn is not None else ""
        if not isinstance(key, str) or not key:
            raise ValueError(f"saga {self.name!r}: key must be a non-empty str, got {key!r}")
        if not isinstance(tenant, str):
            raise ValueError(f"saga {self.name!r}: tenant must be a str, got {tenant!r}")
        return tenant, key

    def business_fields(self, data: InputT) -> dict[str, JsonValue]:
        """The input as JSON, without volatile fields: what the request hash covers."""
        return data.model_dump(mode="json", exclude=set(self.volatile))

    def input_hash(self, data: InputT) -> str:
        """Request hash of the saga input."""
        return request_hash(self.business_fields(data))


def _check_callable(fn: object, what: str) -> None:
    if not callable(fn):
        raise SagaDefinitionError(f"{what} must be a function, got {fn!r}")


def iter_registered(sagas: Iterable[Saga[Any]]) -> Iterable[tuple[tuple[str, int], Saga[Any]]]:
    """(name, version) -> saga pairs, for registries."""
    for saga in sagas:
        yield (saga.name, saga.version), saga
