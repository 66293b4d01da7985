"""Signatures are checked when a saga is declared, not when a step is called.

A step takes (ctx, input), a compensation (ctx, input, result), a reconcile or prepare hook
what its operation takes; a cost function takes the same but the context, a confirm function
the request. A function that cannot be called so is refused with a
`SagaDefinitionError` naming it, what it takes and what it must take.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import pytest
from pydantic import BaseModel

from saga import Saga, SagaDefinitionError, Step, StepContext


class Order(BaseModel):
    order_id: str


def _saga() -> Saga[Order]:
    return Saga("sig", input=Order, key=lambda o: o.order_id)


def _ok_step(saga: Saga[Order]) -> Step:
    def reserve(ctx: StepContext, o: Order) -> None:
        return None

    return saga.step(reserve)


# ----- wrong shapes -------------------------------------------------------------------------


def only_ctx(ctx: StepContext) -> None:
    return None


def three(ctx: StepContext, o: Order, extra: Any) -> None:
    return None


def keyword_only(ctx: StepContext, *, o: Order) -> None:
    return None


async def async_only_ctx(ctx: StepContext) -> None:
    return None


def four(ctx: StepContext, o: Order, result: Any, more: Any) -> None:
    return None


def no_args() -> float:
    return 1.0


def two_args(o: Order, result: Any) -> float:
    return 1.0


class Charger:
    def charge(self, ctx: StepContext) -> None:
        return None

    async def __call__(self, ctx: StepContext, o: Order, extra: Any) -> None:
        return None


WRONG_STEPS: dict[str, tuple[Callable[..., Any], str]] = {
    "too few": (only_ctx, "only_ctx(ctx: 'StepContext')"),
    "too many": (three, "three(ctx: 'StepContext', o: 'Order', extra: 'Any')"),
    "keyword-only": (keyword_only, "keyword_only(ctx: 'StepContext', *, o: 'Order')"),
    "async": (async_only_ctx, "async_only_ctx(ctx: 'StepContext')"),
    "partial": (functools.partial(three, None, None), "functools.partial(three)(extra"),
    "method": (Charger().charge, "Charger.charge"),
    "__call__": (Charger(), "Charger.__call__"),
}


@pytest.mark.parametrize("case", list(WRONG_STEPS))
def test_a_step_that_cannot_take_ctx_and_input_is_refused(case: str) -> None:
    fn, named = WRONG_STEPS[case]
    saga = _saga()
    with pytest.raises(SagaDefinitionError) as caught:
        saga.step(name="charge")(fn)
    message = str(caught.value)
    assert "step 'charge' of saga 'sig'" in message
    assert named in message, message
    assert "must take (ctx, input)" in message
    assert saga.steps == []  # nothing declared


def test_the_message_says_what_is_wrong() -> None:
    saga = _saga()
    with pytest.raises(SagaDefinitionError) as caught:
        saga.step(keyword_only)
    assert re.search(r"'o' is keyword-only", str(caught.value)), caught.value
    with pytest.raises(SagaDefinitionError) as caught:
        saga.step(only_ctx)
    assert "it takes 1 positional argument, not 2" in str(caught.value)
    with pytest.raises(SagaDefinitionError) as caught:
        saga.step(three)
    assert "its parameter 'extra' would get no argument" in str(caught.value)
    with pytest.raises(SagaDefinitionError) as caught:
        saga.step(name="x", cost=no_args)(lambda ctx, o: None)
    assert "it takes no positional arguments, not 1" in str(caught.value)


def step_shaped(ctx: StepContext, o: Order) -> None:
    return None


@pytest.mark.parametrize("fn", [only_ctx, step_shaped, keyword_only, four])
def test_a_compensation_must_take_ctx_input_and_result(fn: Callable[..., Any]) -> None:
    saga = _saga()
    step = _ok_step(saga)
    with pytest.raises(SagaDefinitionError) as caught:
        step.compensation(fn)
    message = str(caught.value)
    assert "compensation of step 'reserve'" in message
    assert fn.__qualname__ in message
    assert "must take (ctx, input, result)" in message
    assert step.compensation_op is None


def test_a_step_function_with_the_compensation_shape_is_refused_as_a_step() -> None:
    saga = _saga()
    with pytest.raises(SagaDefinitionError, match=r"must take \(ctx, input\)"):

        @saga.step
        def release(ctx: StepContext, o: Order, result: Any) -> None:
            return None


@pytest.mark.parametrize("hook", ["reconcile", "prepare"])
@pytest.mark.parametrize("fn", [only_ctx, three, keyword_only, async_only_ctx])
def test_reconcile_and_prepare_hooks_take_ctx_and_input(hook: str, fn: Callable[..., Any]) -> None:
    saga = _saga()
    step = _ok_step(saga)
    with pytest.raises(SagaDefinitionError) as caught:
        getattr(step, hook)(fn)
    message = str(caught.value)
    assert f"{hook} of step 'reserve'" in message
    assert fn.__qualname__ in message
    assert "must take (ctx, input)" in message
    assert getattr(step, f"{hook}_fn") is None


@pytest.mark.parametrize("hook", ["reconcile", "prepare"])
def test_a_compensations_hooks_take_what_it_takes(hook: str) -> None:
    """A compensation's hooks are passed what it is passed: (ctx, input, result)."""
    saga = _saga()
    comp = _ok_step(saga).compensation(lambda ctx, o, result: None)
    with pytest.raises(SagaDefinitionError) as caught:
        getattr(comp, hook)(step_shaped)
    message = str(caught.value)
    assert f"{hook} of compensation of step 'reserve' of saga 'sig'" in message
    assert "step_shaped(ctx: 'StepContext', o: 'Order')" in message
    assert "must take (ctx, input, result)" in message
    getattr(comp, hook)(three)


def test_cost_and_confirm_functions_are_checked() -> None:
    saga = _saga()
    for name, cost in (("a", two_args), ("b", no_args)):
        with pytest.raises(
            SagaDefinitionError, match=rf"cost function of step '{name}'.*must take \(input\)"
        ):
            saga.step(name=name, cost=cost)(lambda ctx, o: None)
    with pytest.raises(
        SagaDefinitionError, match=r"confirm function of step 'c'.*must take \(request\)"
    ):
        saga.step(name="c", confirm=two_args)(lambda ctx, o: None)
    step = _ok_step(saga)
    with pytest.raises(
        SagaDefinitionError,
        match=r"cost function of compensation of step 'reserve'.*must take \(input, result\)",
    ):
        step.compensation(cost=lambda o: 1.0)(lambda ctx, o, result: None)
    assert [s.name for s in saga.steps] == ["reserve"]
    assert step.compensation_op is None


# ----- right shapes -------------------------------------------------------------------------


class Provider:
    def reserve(self, ctx: StepContext, o: Order) -> None:
        return None

    def release(self, ctx: StepContext, o: Order, result: Any) -> None:
        return None

    @staticmethod
    def check(ctx: StepContext, o: Order) -> None:
        return None


class AsyncCallable:
    async def __call__(self, ctx: StepContext, o: Order) -> None:
        return None


def test_every_accepted_shape_declares() -> None:
    """Positional or keyword parameters, defaults, *args, **kwargs, async, partials,
    callable objects, bound and static methods, lambdas."""
    saga = _saga()
    provider = Provider()

    def with_default(ctx: StepContext, o: Order, dry_run: bool = False) -> None:
        return None

    def varargs(*args: Any) -> None:
        return None

    def varargs_after_ctx(ctx: StepContext, *rest: Any, **options: Any) -> None:
        return None

    def positional_only(ctx: StepContext, o: Order, /) -> None:
        return None

    def optional_keyword_only(ctx: StepContext, o: Order, *, note: str = "") -> None:
        return None

    async def async_step(ctx: StepContext, o: Order) -> None:
        return None

    def with_flag(flag: bool, ctx: StepContext, o: Order) -> None:
        return None

    accepted = [
        with_default,
        varargs,
        varargs_after_ctx,
        positional_only,
        optional_keyword_only,
        async_step,
        functools.partial(with_flag, True),
        AsyncCallable(),
        provider.reserve,
        Provider.check,
        lambda ctx, o: None,
    ]
    for index, fn in enumerate(accepted):
        step = saga.step(name=f"s{index}")(fn)
        step.reconcile(provider.reserve)
        step.prepare(async_step)
    comp = saga.steps[0].compensation(provider.release)
    comp.reconcile(lambda ctx, o, result: None)
    saga.steps[1].compensation(lambda ctx, o, result=None, *more: None)
    saga.steps[2].compensation(cost=lambda o, result: 1.0)(lambda ctx, o, result: None)
    saga.step(name="costly", cost=lambda o: 2.0, confirm=lambda request: True)(async_step)
    saga.step(name="flat", cost=3.0, confirm=True)(async_step)
    assert len(saga.steps) == len(accepted) + 2


def test_a_function_without_a_signature_is_not_refused() -> None:
    """Builtins inspect cannot read are let through rather than guessed at."""
    saga = _saga()
    saga.step(name="printed")(print)
    assert saga.step_named("printed") is not None
