"""Declaring sagas: ordered steps, each with an optional compensation and reconcile hook."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, overload

from pydantic import BaseModel, ConfigDict, Field

from saga.amounts import finite_amount
from saga.codec import ResultCodec
from saga.errors import SagaDefinitionError
from saga.keys import JsonValue, request_hash
from saga.retry import RetryPolicy
from saga.signatures import check_signature, is_async

InputT = TypeVar("InputT", bound=BaseModel)
Fn = TypeVar("Fn", bound=Callable[..., Any])

_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


def check_name(what: str, name: str) -> str:
    """`name`, unless it is not 1 to 100 letters, digits, '_', '-' or '.': then a
    `SagaDefinitionError` naming `what` (saga, step, durable step...)."""
    if not isinstance(name, str) or not name or not set(name) <= _NAME_CHARS or len(name) > 100:
        raise SagaDefinitionError(
            f"{what} name {name!r} is invalid: use 1 to 100 letters, digits, '_', '-' or '.'"
        )
    return name


class Ceilings(BaseModel):
    """Saga-wide ceilings, persisted with each instance; reaching one parks the saga.

    Attributes:
        max_operations: Most attempts of actions and compensations together, retries
            included.
        deadline_seconds: Wall-clock time from the saga's start after which no
            further attempt starts.
        spend_budget: Most spend: the declared costs of attempts started plus what
            step code reports with `ctx.spend()` (persisted as it is reported). An
            attempt starts only if the spend so far plus what it is expected to spend
            (its cost, else its max_cost, and at least what one earlier attempt of it
            reported) stays within the budget. An attempt lost to a crash or a timeout
            is counted at its declared worst case; one that declares none parks the
            saga for a human to count it.
        max_side_effects: Most attempts of steps and compensations that count as side
            effects: every one not declared `side_effect=False` (the default is True).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_operations: int | None = Field(default=None, gt=0)
    deadline_seconds: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    spend_budget: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    max_side_effects: int | None = Field(default=None, ge=0)


@dataclass(frozen=True, slots=True)
class Guards:
    """Per-operation guardrails (see `Saga.step` for their meaning)."""

    cost: float | Callable[..., float] | None = None
    max_cost: float | None = None
    side_effect: bool = True
    timeout_seconds: float | None = None
    deadline_seconds: float | None = None
    confirm: bool | Callable[[Any], bool] = False
    confirm_ttl_seconds: float = 600.0

    def __post_init__(self) -> None:
        for name in ("max_cost", "timeout_seconds", "deadline_seconds", "confirm_ttl_seconds"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int | float) and value > 0):
                raise SagaDefinitionError(f"{name} must be a positive number, got {value!r}")
        cost = self.cost
        if cost is not None and not (callable(cost) or finite_amount(cost) is not None):
            raise SagaDefinitionError(
                "cost must be a finite, non-negative number or a function returning one, "
                f"got {self.cost!r}"
            )
        if not (isinstance(self.confirm, bool) or callable(self.confirm)):
            raise SagaDefinitionError(f"confirm must be a bool or a function, got {self.confirm!r}")


class OperationSpec:
    """What steps and compensations share: function, retries, guards and hooks."""

    label: str
    # What the operation's function and its reconcile and prepare hooks are passed; its
    # cost function is passed the same but the context.
    takes: tuple[str, ...]

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        retry: RetryPolicy,
        idempotent: bool,
        guards: Guards,
        saga: Saga[Any],
    ) -> None:
        self.where = f"{self.label} of saga {saga.name!r}"
        check_retry(retry, self.where)
        check_signature(fn, self.where, self.takes)
        if callable(guards.cost):
            check_signature(guards.cost, f"cost function of {self.where}", self.takes[1:])
        if callable(guards.confirm):
            check_signature(guards.confirm, f"confirm function of {self.where}", ("request",))
        self.fn = fn
        # Decided once, at declaration: the driver awaits a coroutine function's call.
        self.is_async = is_async(fn)
        self.retry = retry
        self.idempotent = idempotent
        self.guards = guards
        self.reconcile_fn: Callable[..., Any] | None = None
        self.reconcile_window_seconds = 0.0
        self.reconcile_retry = RetryPolicy(initial_delay=0.5, max_delay=5.0)
        self.prepare_fn: Callable[..., Any] | None = None
        self.request_codec: ResultCodec | None = None
        self.codec = ResultCodec(fn, where=self.label)

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
        """Decorator: ask the provider, by key, whether an unknown attempt happened.

        The hook is passed what the operation is: `(ctx, input)` for a step, `(ctx,
        input, result)` for a compensation.

        Args:
            window_seconds: For how long an `Inconclusive` (or an unsettled `Absent`)
                answer is asked again, with backoff, before the saga parks; 0 parks
                at the first inconclusive answer.
            retry: Backoff between those asks (its delays are used; the window bounds
                the asks).
        """
        check_reconcile_window(window_seconds, f"reconcile of {self.where}")
        check_retry(retry, f"reconcile of {self.where}")

        def register(func: Fn) -> Fn:
            if self.reconcile_fn is not None:
                raise SagaDefinitionError(f"{self.label} already has a reconcile function")
            _check_callable(func, f"reconcile of {self.label}")
            check_signature(func, f"reconcile of {self.where}", self.takes)
            self.reconcile_fn = func
            self.reconcile_window_seconds = float(window_seconds)
            if retry is not None:
                self.reconcile_retry = retry
            return func

        return register(fn) if fn is not None else register

    def prepare(self, fn: Fn) -> Fn:
        """Decorator: compute the request (the typed intent) an attempt acts on.

        It is called before every attempt with the same arguments as the operation;
        the request and its hash are persisted before the call and the operation
        reads it as `ctx.request`. A request that changes while an earlier attempt's
        outcome is unknown parks the saga instead of acting.
        """
        if self.prepare_fn is not None:
            raise SagaDefinitionError(f"{self.label} already has a prepare function")
        _check_callable(fn, f"prepare of {self.label}")
        check_signature(fn, f"prepare of {self.where}", self.takes)
        self.prepare_fn = fn
        self.request_codec = ResultCodec(fn, where=f"request of {self.label}")
        return fn


class Compensation(OperationSpec):
    """The compensating action of one step (see `Step.compensation`)."""

    takes = ("ctx", "input", "result")

    def __init__(
        self,
        step: Step,
        fn: Callable[..., Any],
        *,
        retry: RetryPolicy,
        idempotent: bool,
        guards: Guards,
    ) -> None:
        self.step = step
        self.label = f"compensation of step {step.name!r}"
        super().__init__(fn, retry=retry, idempotent=idempotent, guards=guards, saga=step.saga)


class Step(OperationSpec):
    """One forward step of a saga; use it as a decorator target for its hooks."""

    takes = ("ctx", "input")

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
        guards: Guards,
    ) -> None:
        self.saga = saga
        self.name = name
        self.index = index
        self.pivot = pivot
        self.label = f"step {name!r}"
        self.compensation_op: Compensation | None = None
        super().__init__(fn, retry=retry, idempotent=idempotent, guards=guards, saga=saga)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Calling the step calls its function (handy in unit tests of step code)."""
        return self.fn(*args, **kwargs)

    @overload
    def compensation(self, fn: Callable[..., Any], /) -> Compensation: ...

    @overload
    def compensation(
        self,
        *,
        retry: RetryPolicy | None = None,
        idempotent: bool = False,
        cost: float | Callable[..., float] | None = None,
        max_cost: float | None = None,
        side_effect: bool = True,
        timeout_seconds: float | None = None,
        deadline_seconds: float | None = None,
    ) -> Callable[[Callable[..., Any]], Compensation]: ...

    def compensation(
        self,
        fn: Callable[..., Any] | None = None,
        *,
        retry: RetryPolicy | None = None,
        idempotent: bool = False,
        cost: float | Callable[..., float] | None = None,
        max_cost: float | None = None,
        side_effect: bool = True,
        timeout_seconds: float | None = None,
        deadline_seconds: float | None = None,
    ) -> Compensation | Callable[[Callable[..., Any]], Compensation]:
        """Decorator: declare the compensating action of this step (at most one).

        The function takes `(ctx, input, result)`: the saga input and the step's
        result as the step returned it (a model when its return annotation says so).
        It receives `result=None` when the step's outcome was unknown and it is
        compensated all the same (`compensate(include_unknown=True)`,
        `cancel(include_unknown=True)`): no result was recorded, and the effect may or
        may not be in place, whatever the step's return annotation. Type it so,
        `result: Charge | None`, and undo by what the input identifies (or look the
        effect up) when it is None. Its reconcile and prepare hooks take the same
        arguments; a function that cannot take them is refused here
        (`SagaDefinitionError`).

        The guard options mean what they mean for `Saga.step`; a `cost` function
        receives the saga input and the step's result (None likewise).
        """
        guards = Guards(
            cost=cost,
            max_cost=max_cost,
            side_effect=side_effect,
            timeout_seconds=timeout_seconds,
            deadline_seconds=deadline_seconds,
        )

        def register(func: Callable[..., Any]) -> Compensation:
            if self.compensation_op is not None:
                raise SagaDefinitionError(
                    f"step {self.name!r} of saga {self.saga.name!r} already has a compensation "
                    f"({self.compensation_op.fn.__name__})"
                )
            _check_callable(func, f"compensation of step {self.name!r}")
            self.compensation_op = Compensation(
                self, func, retry=retry or RetryPolicy(), idempotent=idempotent, guards=guards
            )
            return self.compensation_op

        return register(fn) if fn is not None else register


class Saga(Generic[InputT]):
    """A saga type: a name, a version, an input model and ordered steps.

    Args:
        name: Saga name, part of every idempotency key.
        version: Version of the definition; bump it when steps change meaning.
        input: Pydantic model of the saga's input.
        key: Business key of an instance (e.g. the renewal event id).
        tenant: Tenant of an instance; defaults to the empty tenant.
        volatile: Input fields left out of the request hash (timestamps, trace ids).
        ceilings: Saga-wide ceilings persisted with every instance (`Ceilings`).
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
        ceilings: Ceilings | None = None,
    ) -> None:
        self.name = check_name("saga", name)
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
        self.ceilings = ceilings or Ceilings()
        self.steps: list[Step] = []

    # A session (saga.session) is a saga whose steps are added as its code calls them.
    is_session = False

    def __repr__(self) -> str:
        return f"Saga({self.name!r}, version={self.version})"

    def adopt(self, ops: Sequence[Any]) -> None:
        """Learn the operations a snapshot of one of its instances holds: a session's
        definition adds a step per call its rows record; a declared saga knows its steps."""

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
        cost: float | Callable[..., float] | None = None,
        max_cost: float | None = None,
        side_effect: bool = True,
        timeout_seconds: float | None = None,
        deadline_seconds: float | None = None,
        confirm: bool | Callable[[Any], bool] = False,
        confirm_ttl_seconds: float = 600.0,
    ) -> Callable[[Callable[..., Any]], Step]: ...

    def step(
        self,
        fn: Callable[..., Any] | None = None,
        *,
        name: str | None = None,
        retry: RetryPolicy | None = None,
        idempotent: bool = False,
        pivot: bool = False,
        cost: float | Callable[..., float] | None = None,
        max_cost: float | None = None,
        side_effect: bool = True,
        timeout_seconds: float | None = None,
        deadline_seconds: float | None = None,
        confirm: bool | Callable[[Any], bool] = False,
        confirm_ttl_seconds: float = 600.0,
    ) -> Step | Callable[[Callable[..., Any]], Step]:
        """Decorator: append a step; it runs after the steps declared before it.

        The function takes `(ctx, input)`, sync or async; one that cannot be called
        so (too few or too many positional parameters, a required keyword-only one)
        is refused here with a `SagaDefinitionError` naming it, and so are hooks,
        `cost` and `confirm` functions of the wrong shape.

        Args:
            name: Step name (default: the function's name).
            retry: Retry policy of its attempts.
            idempotent: The provider dedupes on `ctx.idempotency_key`, so an attempt
                whose outcome is unknown may be retried with the same key.
            pivot: Point of no return: a later permanent failure parks the saga
                instead of compensating.
            cost: The attempt's cost, a finite, non-negative number or a function of
                the saga input returning one; counted against the saga's spend budget
                when an attempt starts. A function that raises, or returns anything
                else, parks the saga before the attempt, with the reason.
            max_cost: Per-step limit: an attempt costing more parks the saga. For a
                step that declares no `cost`, also its worst case: what its next
                attempt is expected to spend under the saga's budget, and what an
                attempt lost to a crash or a timeout is counted at.
            side_effect: Counts against the saga's `max_side_effects`.
            timeout_seconds: Longest attempt; one past it has an unknown outcome.
            deadline_seconds: Longest time from the first attempt, retries and waits
                included, after which no attempt starts.
            confirm: Pause in `awaiting_confirmation` before each attempt (True), or
                before each attempt for which this function of the request (the
                prepared request, else the input) returns True. One approval, one
                attempt: an approval releases exactly the attempt previewed, which
                uses it up as it starts; every retry (after a transient failure, an
                unknown outcome, a reconcile's Absent, an operator's retry) pauses
                for a new approval of a fresh preview. The preview shows everything
                the attempt reads (the prepared request, the whole input, volatile
                fields included, and earlier steps' results), and the approval is
                bound to the hash of all of it: if any of it differs when the attempt
                would start, a new approval is asked for.
            confirm_ttl_seconds: How long a confirmation may be approved, and how long
                an approval then stays good for starting its attempt: one whose
                confirmation has expired releases nothing, and a fresh preview is
                asked for.
        """
        guards = Guards(
            cost=cost,
            max_cost=max_cost,
            side_effect=side_effect,
            timeout_seconds=timeout_seconds,
            deadline_seconds=deadline_seconds,
            confirm=confirm,
            confirm_ttl_seconds=confirm_ttl_seconds,
        )

        def register(func: Callable[..., Any]) -> Step:
            _check_callable(func, "step")
            step_name = check_name("step", name or func.__name__)
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
                guards=guards,
            )
            self.steps.append(step)
            return step

        return register(fn) if fn is not None else register

    def step_named(self, name: str) -> Step | None:
        """The step called `name`, or None."""
        for step in self.steps:
            if step.name == name:
                return step
        return None

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


def check_retry(retry: object, where: str) -> None:
    """Refuse a `retry=` that is neither None nor a `RetryPolicy`, naming `where` it was given."""
    if retry is not None and not isinstance(retry, RetryPolicy):
        raise SagaDefinitionError(f"{where}: retry must be a RetryPolicy, got {retry!r}")


def check_reconcile_window(window_seconds: object, where: str) -> None:
    """Refuse a reconcile `window_seconds=` that is not a finite number of seconds >= 0
    (a bool is not a number of seconds), naming `where` it was given."""
    if not (
        isinstance(window_seconds, int | float)
        and not isinstance(window_seconds, bool)
        and math.isfinite(window_seconds)
        and window_seconds >= 0
    ):
        raise SagaDefinitionError(
            f"{where}: window_seconds must be a finite number >= 0, got {window_seconds!r}"
        )


def _check_callable(fn: object, what: str) -> None:
    if not callable(fn):
        raise SagaDefinitionError(f"{what} must be a function, got {fn!r}")
