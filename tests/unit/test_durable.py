"""Durable steps, the decorator side: options, hooks, keys, stored arguments, the session
and context of the current call, and the process-wide registry.

No session runs here: a stand-in object with a `call` method plays the session, which is
all a durable step asks of one.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import math
import re
import threading
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import structlog
from pydantic import BaseModel

from saga import RetryPolicy, SagaDefinitionError, StepContext
from saga.durable import (
    DurableCall,
    DurableStep,
    active_session,
    context_scope,
    current_context,
    durable_step,
    registered_step,
    session_scope,
)
from saga.keys import canonical_json, request_hash


def _name(prefix: str = "step") -> str:
    """A step name no other test uses (the registry is process-wide)."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def _ctx(step: str = "s", attempt: int = 1) -> StepContext:
    return StepContext(
        saga_id="saga-1",
        tenant_id="",
        step=step,
        kind="action",
        idempotency_key=f"key-{step}-{attempt}",
        attempt=attempt,
        fence=1,
        results={},
        log=structlog.get_logger(),
    )


class Charge(BaseModel):
    charge_id: str
    amount_cents: int


class RecordingSession:
    """Plays a session: records what the step hands it and answers a fixed value."""

    def __init__(self, answer: Any = "from-session") -> None:
        self.answer = answer
        self.calls: list[tuple[DurableStep[Any, Any], tuple[Any, ...], dict[str, Any]]] = []

    def call(
        self, step: DurableStep[Any, Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        self.calls.append((step, args, kwargs))
        return self.answer


# ----- the decorator -----------------------------------------------------------------------


def durable_plain_sync(order_id: str, amount_cents: int = 0) -> dict[str, Any]:
    """Charge an order."""
    return {"order_id": order_id, "amount_cents": amount_cents}


def test_bare_decorator_names_the_step_after_the_function_with_default_options() -> None:
    """`@durable_step` without options: the function's name, default retry, not
    idempotent, no timeout, no key function, no hooks."""
    step = durable_step(durable_plain_sync)

    assert isinstance(step, DurableStep)
    assert step.name == "durable_plain_sync"
    assert step.fn is durable_plain_sync
    assert step.key is None
    assert step.retry == RetryPolicy()
    assert step.idempotent is False
    assert step.timeout_seconds is None
    assert step.is_async is False
    assert step.compensation_fn is None
    assert step.reconcile_fn is None
    assert step.prepare_fn is None
    assert step.reconcile_window_seconds == 0.0
    assert step.reconcile_retry == RetryPolicy(initial_delay=0.5, max_delay=5.0)


def test_decorator_with_options_keeps_them() -> None:
    """`@durable_step(...)` stores name, key function, retry, idempotent and timeout."""
    name = _name("send-email")
    policy = RetryPolicy(max_attempts=7)

    def key(to: str, body: str) -> str:
        return to

    @durable_step(name=name, key=key, retry=policy, idempotent=True, timeout_seconds=2.5)
    def send_email(to: str, body: str) -> dict[str, Any]:
        return {"to": to}

    assert send_email.name == name
    assert send_email.key is key
    assert send_email.retry is policy
    assert send_email.idempotent is True
    assert send_email.timeout_seconds == 2.5


def test_the_step_keeps_the_function_name_docstring_and_signature() -> None:
    """The decorated object reads like the function: name, docstring, signature."""
    step = durable_step(name=_name())(durable_plain_sync)

    assert step.__name__ == "durable_plain_sync"
    assert step.__doc__ == "Charge an order."
    assert step.__wrapped__ is durable_plain_sync
    assert inspect.signature(step) == inspect.signature(durable_plain_sync)


def test_async_functions_are_flagged_async() -> None:
    """An async def (or a partial of one) is an async step."""

    async def fetch(order_id: str) -> int:
        return 1

    assert durable_step(name=_name())(fetch).is_async is True
    assert durable_step(name=_name())(functools.partial(fetch)).is_async is True
    assert durable_step(name=_name())(durable_plain_sync).is_async is False


@pytest.mark.parametrize("bad", ["", "has space", "a/b", "x" * 101, "<lambda>"])
def test_invalid_names_are_refused_by_the_declared_step_rule(bad: str) -> None:
    """Names follow the declared steps' rule: 1 to 100 letters, digits, '_', '-', '.'."""
    with pytest.raises(SagaDefinitionError, match=r"name .* is invalid"):
        durable_step(name=bad)(durable_plain_sync)


def test_a_lambda_needs_a_name() -> None:
    """A lambda's __name__ is not a valid step name: the error says so."""
    with pytest.raises(SagaDefinitionError, match="'<lambda>' is invalid"):
        durable_step(lambda x: x)
    step = durable_step(name=_name())(lambda x: x)
    assert step(3) == 3


def test_a_callable_without_a_name_needs_name() -> None:
    """A callable object has no __name__ to default to: name= is asked for."""

    class Adder:
        def __call__(self, a: int) -> int:
            return a + 1

    with pytest.raises(SagaDefinitionError, match="pass name="):
        durable_step(Adder())
    name = _name("adder")
    step = durable_step(name=name)(Adder())
    assert step(1) == 2
    assert step.__name__ == name


@pytest.mark.parametrize("bad", [0, -1, -0.5, "5"])
def test_timeout_must_be_positive(bad: Any) -> None:
    """timeout_seconds is checked as the declared steps' guards check it."""
    name = _name()
    with pytest.raises(SagaDefinitionError, match="timeout_seconds must be a positive number"):
        durable_step(name=name, timeout_seconds=bad)(durable_plain_sync)
    assert registered_step(name) is None


def test_retry_must_be_a_policy() -> None:
    with pytest.raises(SagaDefinitionError, match="retry must be a RetryPolicy"):
        durable_step(name=_name(), retry=3)(durable_plain_sync)  # type: ignore[call-overload]


def test_the_result_codec_follows_the_return_annotation() -> None:
    """Results are encoded and rebuilt from the function's return annotation, as for
    declared steps: a model comes back as a model."""

    @durable_step(name=_name())
    def charge(order_id: str) -> Charge:
        return Charge(charge_id="c1", amount_cents=5)

    stored = charge.codec.encode(charge("o1"))
    assert stored == {"charge_id": "c1", "amount_cents": 5}
    assert charge.codec.decode(stored) == Charge(charge_id="c1", amount_cents=5)
    with pytest.raises(TypeError, match="durable step"):
        charge.codec.encode({"nope": 1})


def test_a_session_call_stores_its_result_with_the_steps_codec_and_keeps_a_refusal() -> None:
    """The step a session runs for a call encodes its result with the durable step's own
    codec (the one JSON check); a refused result's TypeError is kept for the session by
    the call's operation name, so that the call's code can be told why it parked."""
    from saga.session import SessionSaga

    @durable_step(name=_name())
    def charge(order_id: str) -> Charge:
        return Charge(charge_id="c1", amount_cents=5)

    definition = SessionSaga("codec")
    step = definition.install("charge.0123456789ab", 0, charge, (("o1",), {}))
    stored = step.codec.encode(Charge(charge_id="c1", amount_cents=5))
    assert stored == charge.codec.encode(Charge(charge_id="c1", amount_cents=5))
    assert step.codec.decode(stored) == Charge(charge_id="c1", amount_cents=5)
    assert definition.refused == {}
    with pytest.raises(TypeError, match=f"result of durable step '{charge.name}'") as refused:
        step.codec.encode({"nope": object()})
    assert definition.refused == {"charge.0123456789ab": refused.value}


def test_a_durable_step_cannot_be_wrapped_again() -> None:
    step = durable_step(name=_name())(durable_plain_sync)
    with pytest.raises(SagaDefinitionError, match="already a durable step"):
        durable_step(name=_name())(step)


def test_a_key_function_that_cannot_take_the_arguments_is_refused() -> None:
    """key= must accept every call the step accepts, checked at decoration."""

    def key_of_one(to: str) -> str:
        return to

    with pytest.raises(SagaDefinitionError, match="key function of durable step"):
        durable_step(name=_name(), key=key_of_one)(durable_plain_sync)


# ----- hooks -------------------------------------------------------------------------------


def _charge_step() -> DurableStep[[str, int], dict[str, Any]]:
    @durable_step(name=_name("charge"))
    def charge(order_id: str, amount_cents: int) -> dict[str, Any]:
        return {"order_id": order_id}

    return charge


def test_compensation_is_stored_with_its_options_and_returned_unchanged() -> None:
    """`.compensation(...)` keeps the function, its retry and idempotent flag."""
    charge = _charge_step()
    policy = RetryPolicy(max_attempts=10)

    def refund(ctx: StepContext, result: Any, order_id: str, amount_cents: int) -> None:
        return None

    assert charge.compensation(retry=policy, idempotent=True)(refund) is refund
    assert charge.compensation_fn is refund
    assert charge.compensation_retry is policy
    assert charge.compensation_idempotent is True
    assert charge.compensation_is_async is False


def test_bare_compensation_has_default_options() -> None:
    charge = _charge_step()

    @charge.compensation
    async def refund(ctx: StepContext, result: Any, *args: Any, **kwargs: Any) -> None:
        return None

    assert charge.compensation_fn is refund
    assert charge.compensation_retry == RetryPolicy()
    assert charge.compensation_idempotent is False
    assert charge.compensation_is_async is True


def test_a_second_compensation_is_refused_naming_the_step() -> None:
    charge = _charge_step()

    @charge.compensation
    def refund(ctx: StepContext, result: Any, order_id: str, amount_cents: int) -> None:
        return None

    with pytest.raises(SagaDefinitionError, match=f"{charge.name!r} already has a compensation"):

        @charge.compensation
        def refund_again(ctx: StepContext, result: Any, *a: Any) -> None:
            return None

    assert charge.compensation_fn is refund


def _keyword_step() -> DurableStep[..., Any]:
    @durable_step(name=_name("kw"))
    def book(room: str, /, nights: int = 1, *, guest: str, note: str = "") -> None:
        return None

    return book


def _varargs_step() -> DurableStep[..., Any]:
    @durable_step(name=_name("var"))
    def tag(item: str, *labels: str, **extra: int) -> None:
        return None

    return tag


def _comp_ctx_result_only(ctx: Any, result: Any) -> None: ...
def _comp_swallows(ctx: Any, result: Any, *a: Any, **k: Any) -> None: ...
def _comp_matching(ctx: Any, result: Any, order_id: str, amount_cents: int) -> None: ...
def _comp_missing_result(ctx: Any, order_id: str, amount_cents: int) -> None: ...
def _comp_required_kwonly(
    ctx: Any, result: Any, order_id: str, amount_cents: int, *, reason: str
) -> None: ...


@pytest.mark.parametrize(
    ("fn", "ok"),
    [
        (_comp_matching, True),
        (_comp_swallows, True),
        (_comp_ctx_result_only, False),
        (_comp_missing_result, False),
        (_comp_required_kwonly, False),
    ],
)
def test_compensation_must_take_ctx_result_and_the_step_arguments(
    fn: Callable[..., Any], ok: bool
) -> None:
    """A compensation is called (ctx, result, *args, **kwargs); one that cannot take that
    is refused when declared, naming the step and what it must take."""
    charge = _charge_step()
    if ok:
        charge.compensation(fn)
        return
    with pytest.raises(SagaDefinitionError) as info:
        charge.compensation(fn)
    message = str(info.value)
    assert f"compensation of durable step {charge.name!r}" in message
    assert "must take (ctx, result, order_id, amount_cents)" in message
    assert charge.compensation_fn is None


def test_compensation_keyword_only_parameters_are_passed_by_keyword() -> None:
    """Keyword-only step parameters reach the compensation by name."""
    book = _keyword_step()

    def wrong_names(ctx: Any, result: Any, room: str, nights: int, who: str, note: str) -> None:
        return None

    with pytest.raises(SagaDefinitionError, match=r"must take \(ctx, result, room, nights, \*"):
        book.compensation(wrong_names)

    def right(ctx: Any, result: Any, room: str, nights: int, *, guest: str, note: str) -> None:
        return None

    book.compensation(right)


def test_compensation_of_a_varargs_step_must_take_varargs() -> None:
    """A step taking *labels and **extra passes any number of them on: its compensation
    must take *args and **kwargs."""
    tag = _varargs_step()

    def no_star(ctx: Any, result: Any, item: str, **extra: int) -> None: ...
    def no_kwargs(ctx: Any, result: Any, item: str, *labels: str) -> None: ...
    def both(ctx: Any, result: Any, item: str, *labels: str, **extra: int) -> None: ...

    with pytest.raises(SagaDefinitionError, match=r"takes \*labels, so it must take \*args"):
        tag.compensation(no_star)
    with pytest.raises(SagaDefinitionError, match=r"takes \*\*extra, so it must take \*\*kwargs"):
        tag.compensation(no_kwargs)
    tag.compensation(both)


def test_reconcile_is_stored_with_window_and_retry() -> None:
    charge = _charge_step()
    policy = RetryPolicy(initial_delay=1.0, max_delay=2.0)

    def look_up(ctx: StepContext, order_id: str, amount_cents: int) -> None:
        return None

    assert charge.reconcile(window_seconds=30, retry=policy)(look_up) is look_up
    assert charge.reconcile_fn is look_up
    assert charge.reconcile_window_seconds == 30.0
    assert charge.reconcile_retry is policy
    assert charge.reconcile_is_async is False


def test_bare_reconcile_and_prepare_may_be_async() -> None:
    charge = _charge_step()

    @charge.reconcile
    async def look_up(ctx: StepContext, order_id: str, amount_cents: int) -> None:
        return None

    @charge.prepare
    async def intent(ctx: StepContext, order_id: str, amount_cents: int) -> dict[str, int]:
        return {"amount_cents": amount_cents}

    assert charge.reconcile_fn is look_up
    assert charge.reconcile_is_async is True
    assert charge.reconcile_window_seconds == 0.0
    assert charge.reconcile_retry == RetryPolicy(initial_delay=0.5, max_delay=5.0)
    assert charge.prepare_fn is intent
    assert charge.prepare_is_async is True


@pytest.mark.parametrize("bad", [-1, "1", None, True, math.inf, math.nan])
def test_reconcile_window_must_be_a_finite_number_of_seconds(bad: Any) -> None:
    with pytest.raises(SagaDefinitionError, match="window_seconds must be a finite number >= 0"):
        _charge_step().reconcile(window_seconds=bad)


def test_hooks_take_ctx_and_the_step_arguments() -> None:
    """Reconcile and prepare are called (ctx, *args, **kwargs): a hook written as if it
    got a result, or missing arguments, is refused naming the step."""
    charge = _charge_step()

    def with_result(ctx: Any, result: Any, order_id: str, amount_cents: int) -> None: ...
    def too_few(ctx: Any, order_id: str) -> None: ...

    with pytest.raises(SagaDefinitionError, match=f"reconcile of durable step {charge.name!r}"):
        charge.reconcile(with_result)
    with pytest.raises(SagaDefinitionError, match=r"must take \(ctx, order_id, amount_cents\)"):
        charge.prepare(too_few)
    assert charge.reconcile_fn is None
    assert charge.prepare_fn is None


def test_a_second_reconcile_or_prepare_is_refused_naming_the_step() -> None:
    charge = _charge_step()

    def hook(ctx: Any, *args: Any) -> None: ...

    charge.reconcile(hook)
    charge.prepare(hook)
    with pytest.raises(SagaDefinitionError, match=f"{charge.name!r} already has a reconcile"):
        charge.reconcile(hook)
    with pytest.raises(SagaDefinitionError, match=f"{charge.name!r} already has a prepare"):
        charge.prepare(hook)


# ----- keys --------------------------------------------------------------------------------


def _pair_step() -> DurableStep[..., Any]:
    @durable_step(name=_name("pair"))
    def pair(a: int, b: int = 2) -> int:
        return a + b

    return pair


def test_the_key_is_the_same_however_the_call_spells_its_arguments() -> None:
    """f(1), f(a=1) and f(1, b=<default>) are one call: same key, arguments, hash."""
    pair = _pair_step()
    calls = [
        pair.call_of((1,), {}),
        pair.call_of((), {"a": 1}),
        pair.call_of((1, 2), {}),
        pair.call_of((1,), {"b": 2}),
        pair.call_of((), {"b": 2, "a": 1}),
    ]
    assert all(call == calls[0] for call in calls)
    assert calls[0] == DurableCall(
        step=pair.name,
        key=canonical_json({"a": 1, "b": 2}),
        arguments={"a": 1, "b": 2},
        request_hash=request_hash(
            {"step": pair.name, "key": '{"a":1,"b":2}', "arguments": {"a": 1, "b": 2}}
        ),
    )


def test_other_arguments_give_another_key() -> None:
    pair = _pair_step()
    assert pair.call_of((1,), {}).key != pair.call_of((1, 3), {}).key
    assert pair.call_of((1,), {}).key != pair.call_of((2,), {}).key


def test_varargs_and_kwargs_are_stored_under_their_own_names() -> None:
    tag = _varargs_step()
    call = tag.call_of(("box", "red", "big"), {"weight": 3})
    assert call.arguments == {"item": "box", "labels": ["red", "big"], "extra": {"weight": 3}}
    assert call.key == canonical_json(call.arguments)
    assert tag.call_of(("box",), {}).arguments == {"item": "box", "labels": [], "extra": {}}


class Opaque:
    def __repr__(self) -> str:
        return "Opaque()"


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (Opaque(), "Opaque"),
        ((1, 2), "tuple"),
        ({1: "x"}, "not a string"),
        (float("nan"), "nan"),
        (float(2**53), "too large"),
        ({"nested": [Opaque()]}, r"\.nested\[0\]"),
    ],
)
def test_arguments_that_are_not_json_need_key(value: Any, why: str) -> None:
    """Without key=, an argument that is not JSON (what check_json refuses, floats
    included) raises TypeError naming the step and the argument and asking for key=,
    before the function runs. No key is ever taken from a repr."""
    ran: list[object] = []

    @durable_step(name=_name("opaque"))
    def use(label: str, thing: Any) -> None:
        ran.append(thing)

    with pytest.raises(TypeError) as info:
        use.call_of(("x", value), {})
    message = str(info.value)
    assert message.startswith(f"durable step {use.name!r}: argument 'thing' is not JSON")
    assert "pass key=" in message
    assert re.search(why, message), message
    assert ran == []


def test_finite_floats_are_json() -> None:
    pair = _pair_step()
    assert pair.call_of((1.5,), {}).arguments == {"a": 1.5, "b": 2}


def test_key_function_names_the_call() -> None:
    """With key=, the key is what it returns; JSON arguments are still stored and
    hashed, so the same key with other arguments has another request hash."""

    @durable_step(name=_name("mail"), key=lambda to, body: to)
    def send(to: str, body: str) -> None:
        return None

    first = send.call_of(("ops@acme.com", "Refund approved"), {})
    again = send.call_of((), {"body": "Refund approved", "to": "ops@acme.com"})
    other = send.call_of(("ops@acme.com", "Something else"), {})
    assert first.key == "ops@acme.com"
    assert first.arguments == {"to": "ops@acme.com", "body": "Refund approved"}
    assert again == first
    assert other.key == first.key
    assert other.request_hash != first.request_hash


def test_key_function_is_passed_the_arguments_as_bound_with_defaults() -> None:
    """However the call spells its arguments, the key function sees them the same way:
    positional parameters by position, defaults filled in."""
    seen: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def key(*args: Any, **kwargs: Any) -> str:
        seen.append((args, kwargs))
        return "k"

    @durable_step(name=_name(), key=key)
    def book(room: str, nights: int = 1, *, guest: str = "anon") -> None:
        return None

    book.call_of(("r1",), {})
    book.call_of((), {"room": "r1", "nights": 1, "guest": "anon"})
    assert seen == [(("r1", 1), {"guest": "anon"})] * 2


def test_with_key_arguments_that_are_not_json_are_not_stored() -> None:
    @durable_step(name=_name(), key=lambda thing: "fixed")
    def use(thing: Any) -> None:
        return None

    call = use.call_of((Opaque(),), {})
    assert call.key == "fixed"
    assert call.arguments is None
    assert call.request_hash == request_hash({"step": use.name, "key": "fixed", "arguments": None})


@pytest.mark.parametrize("returned", [None, 42, b"bytes", ["a"]])
def test_a_key_function_must_return_a_str(returned: Any) -> None:
    @durable_step(name=_name(), key=lambda x: returned)
    def use(x: int) -> None:
        return None

    with pytest.raises(TypeError, match=f"durable step {use.name!r}: .*must return a str"):
        use.call_of((1,), {})


def test_a_key_function_that_raises_is_a_type_error_naming_the_step() -> None:
    def key(x: int) -> str:
        raise KeyError("missing")

    @durable_step(name=_name(), key=key)
    def use(x: int) -> None:
        return None

    with pytest.raises(TypeError, match=f"durable step {use.name!r}: its key function raised"):
        use.call_of((1,), {})


def test_a_key_postgres_cannot_store_is_refused() -> None:
    @durable_step(name=_name(), key=lambda x: "a\x00b")
    def use(x: int) -> None:
        return None

    with pytest.raises(TypeError, match="NUL"):
        use.call_of((1,), {})


@pytest.mark.parametrize(
    ("args", "kwargs", "python_says"),
    [
        ((), {}, "missing a required argument: 'a'"),
        ((1, 2, 3), {}, "too many positional arguments"),
        ((1,), {"c": 1}, "unexpected keyword argument 'c'"),
        ((1,), {"a": 1}, "multiple values for argument 'a'"),
    ],
)
def test_arguments_that_do_not_fit_raise_pythons_type_error_naming_the_step(
    args: tuple[Any, ...], kwargs: dict[str, Any], python_says: str
) -> None:
    pair = _pair_step()
    with pytest.raises(TypeError) as info:
        pair.call_of(args, kwargs)
    assert str(info.value).startswith(f"durable step {pair.name!r}: ")
    assert python_says in str(info.value)


# ----- stored arguments --------------------------------------------------------------------


def sig_plain(a: int, b: str) -> None: ...
def sig_defaults(a: int, b: int = 2, c: str = "c") -> None: ...
def sig_posonly(a: int, /, b: int, c: int = 3) -> None: ...
def sig_kwonly(a: int, *, b: int, c: int = 3) -> None: ...
def sig_varargs(a: int, *rest: int) -> None: ...
def sig_varkw(a: int, **extra: Any) -> None: ...
def sig_everything(
    a: int, /, b: int = 0, *rest: int, c: str, d: str = "d", **extra: Any
) -> None: ...
def sig_only_star(*args: Any, **kwargs: Any) -> None: ...
def sig_none() -> None: ...
def sig_posonly_kwargs_same_name(a: int, /, **extra: Any) -> None: ...


ROUND_TRIPS: list[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = [
    (sig_plain, (1, "x"), {}),
    (sig_plain, (), {"b": "x", "a": 1}),
    (sig_defaults, (1,), {}),
    (sig_defaults, (1,), {"c": "z"}),
    (sig_defaults, (1, 5, "q"), {}),
    (sig_posonly, (1, 2), {}),
    (sig_posonly, (1,), {"b": 2, "c": 9}),
    (sig_kwonly, (1,), {"b": 2}),
    (sig_kwonly, (), {"a": 1, "b": 2, "c": 4}),
    (sig_varargs, (1,), {}),
    (sig_varargs, (1, 2, 3, 4), {}),
    (sig_varkw, (1,), {"x": [1, {"y": None}], "z": True}),
    (sig_varkw, (), {"a": 1}),
    (sig_everything, (1,), {"c": "c"}),
    (sig_everything, (1, 2, 3, 4), {"c": "c", "d": "e", "x": 1}),
    (sig_only_star, (), {}),
    (sig_only_star, (1, "two", [3]), {"k": {"v": 1.5}}),
    (sig_none, (), {}),
    (sig_posonly_kwargs_same_name, (1,), {"a": 2}),
]


@pytest.mark.parametrize(("fn", "args", "kwargs"), ROUND_TRIPS)
def test_stored_arguments_rebuild_the_same_call(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """What a later process rebuilds from the ledger (the stored JSON, read back) binds
    to the signature exactly as the original call did."""
    step = durable_step(name=_name("rt"))(fn)
    stored = json.loads(canonical_json(step.call_of(args, kwargs).arguments))

    new_args, new_kwargs = step.arguments_of(stored)

    signature = inspect.signature(fn)
    expected = signature.bind(*args, **kwargs)
    expected.apply_defaults()
    rebuilt = signature.bind(*new_args, **new_kwargs)
    rebuilt.apply_defaults()
    assert rebuilt == expected
    # And the call made from them is the same call.
    assert step.call_of(new_args, new_kwargs) == step.call_of(args, kwargs)


def test_the_compensation_is_called_with_the_rebuilt_arguments() -> None:
    """The point of storing arguments: the compensation can be called as
    (ctx, result, *args, **kwargs) from what the ledger kept."""
    got: list[Any] = []

    @durable_step(name=_name("book"))
    def book(room: str, /, nights: int = 1, *, guest: str) -> dict[str, str]:
        return {"booking": room}

    @book.compensation
    def cancel(ctx: Any, result: Any, room: str, nights: int, *, guest: str) -> None:
        got.append((result, room, nights, guest))

    stored = json.loads(canonical_json(book.call_of(("r7",), {"guest": "ann"}).arguments))
    args, kwargs = book.arguments_of(stored)
    assert book.compensation_fn is not None
    book.compensation_fn(_ctx(), {"booking": "r7"}, *args, **kwargs)
    assert got == [({"booking": "r7"}, "r7", 1, "ann")]


def test_arguments_not_stored_cannot_be_rebuilt() -> None:
    pair = _pair_step()
    with pytest.raises(TypeError, match="were not stored"):
        pair.arguments_of(None)


def test_stored_arguments_that_no_longer_fit_are_refused() -> None:
    """Arguments stored for another signature (the step changed since) raise TypeError
    naming the step instead of calling the compensation wrongly."""
    pair = _pair_step()
    with pytest.raises(TypeError, match=f"durable step {pair.name!r}: .*'zzz'"):
        pair.arguments_of({"a": 1, "zzz": 2})
    with pytest.raises(TypeError, match=f"durable step {pair.name!r}: stored arguments"):
        pair.arguments_of({"b": 1})
    with pytest.raises(TypeError, match="JSON object"):
        pair.arguments_of([1, 2])


# ----- calling: outside and inside a session -----------------------------------------------


def test_outside_a_session_a_durable_step_is_a_plain_call() -> None:
    """Unit tests can call step code directly: nothing else happens."""
    assert active_session() is None
    step = durable_step(name=_name())(durable_plain_sync)
    assert step("o1", amount_cents=5) == {"order_id": "o1", "amount_cents": 5}


def test_outside_a_session_an_async_step_returns_its_coroutine() -> None:
    @durable_step(name=_name())
    async def fetch(x: int) -> int:
        await asyncio.sleep(0)
        return x * 2

    pending = fetch(21)
    assert inspect.iscoroutine(pending)
    assert asyncio.run(pending) == 42


def test_inside_a_session_the_call_goes_to_the_session() -> None:
    """In a session scope the function is not called: the session gets the step and the
    call's arguments, and its answer is the call's result. Leaving the scope restores
    plain calls."""
    ran: list[int] = []

    @durable_step(name=_name())
    def work(x: int, *, y: int = 0) -> int:
        ran.append(x)
        return x

    session = RecordingSession(answer=99)
    with session_scope(session) as entered:
        assert entered is session
        assert active_session() is session
        assert work(1, y=2) == 99
    assert session.calls == [(work, (1,), {"y": 2})]
    assert ran == []
    assert active_session() is None
    assert work(3) == 3


def test_session_scope_is_reset_when_the_block_raises_and_nests() -> None:
    outer, inner = RecordingSession(), RecordingSession()
    with session_scope(outer):
        with pytest.raises(RuntimeError), session_scope(inner):
            assert active_session() is inner
            raise RuntimeError("boom")
        assert active_session() is outer
    assert active_session() is None


def test_the_session_is_per_context() -> None:
    """Another thread (a fresh context) does not see this thread's session."""
    seen: list[object] = []
    with session_scope(RecordingSession()):
        thread = threading.Thread(target=lambda: seen.append(active_session()))
        thread.start()
        thread.join()
    assert seen == [None]


# ----- current_context ---------------------------------------------------------------------


def test_current_context_is_none_outside_a_call() -> None:
    assert current_context() is None


def test_context_scope_sets_and_resets_the_context() -> None:
    ctx = _ctx()
    with context_scope(ctx) as entered:
        assert entered is ctx
        assert current_context() is ctx
    assert current_context() is None


def test_context_is_reset_when_the_call_raises() -> None:
    with pytest.raises(ValueError), context_scope(_ctx()):
        raise ValueError("step failed")
    assert current_context() is None


def test_nested_context_scopes_restore_the_outer_one() -> None:
    outer, inner = _ctx("outer"), _ctx("inner")
    with context_scope(outer):
        with context_scope(inner):
            assert current_context() is inner
        assert current_context() is outer


def test_step_code_reads_its_context_as_the_runner_sets_it() -> None:
    """What the DESIGN's example does: step code asks current_context() for its key."""

    @durable_step(name=_name("mail"), key=lambda to: to, idempotent=True)
    def send(to: str) -> str:
        ctx = current_context()
        assert ctx is not None
        return ctx.idempotency_key

    with context_scope(_ctx("mail", attempt=2)):
        assert send("ops@acme.com") == "key-mail-2"


def test_context_follows_await_and_is_copied_into_tasks() -> None:
    """Async step code sees its context across awaits and in the tasks it starts, and
    neither the tasks nor the caller see it after the call."""
    ctx = _ctx("async")

    async def child() -> StepContext | None:
        await asyncio.sleep(0)
        return current_context()

    async def main() -> None:
        with context_scope(ctx):
            await asyncio.sleep(0)
            assert current_context() is ctx
            task = asyncio.create_task(child())
            assert await task is ctx
            gathered = await asyncio.gather(child(), child())
            assert list(gathered) == [ctx, ctx]
        assert current_context() is None
        assert await asyncio.create_task(child()) is None

    asyncio.run(main())


def test_concurrent_tasks_each_see_their_own_context() -> None:
    """Two calls in flight in one event loop do not see each other's context."""
    seen: dict[str, str | None] = {}

    async def call(name: str) -> None:
        with context_scope(_ctx(name)):
            for _ in range(3):
                await asyncio.sleep(0)
                found = current_context()
                seen[name] = found.step if found is not None else None
                assert seen[name] == name

    async def main() -> None:
        await asyncio.gather(call("a"), call("b"))
        assert current_context() is None

    asyncio.run(main())
    assert seen == {"a": "a", "b": "b"}


def test_context_is_reset_after_an_async_call_that_raises() -> None:
    async def main() -> None:
        with pytest.raises(KeyError), context_scope(_ctx()):
            await asyncio.sleep(0)
            raise KeyError("x")
        assert current_context() is None

    asyncio.run(main())


# ----- the registry ------------------------------------------------------------------------


def test_decorated_steps_are_registered_by_name() -> None:
    name = _name("reg")
    step = durable_step(name=name)(durable_plain_sync)
    assert registered_step(name) is step
    assert registered_step(_name("never")) is None


def test_a_different_function_under_a_used_name_is_refused_naming_both() -> None:
    name = _name("taken")

    def first(x: int) -> int:
        return x

    def second(x: int) -> int:
        return x

    step = durable_step(name=name)(first)
    with pytest.raises(SagaDefinitionError) as info:
        durable_step(name=name)(second)
    message = str(info.value)
    assert f"{__name__}.{first.__qualname__}" in message
    assert f"{__name__}.{second.__qualname__}" in message
    assert registered_step(name) is step


def test_the_same_function_decorated_again_replaces_its_registration() -> None:
    """A module imported twice (tests, reloads) defines the same function again (same
    module and qualname): that is not a conflict, and the newest definition wins."""
    name = _name("again")
    steps = []
    for version in range(2):

        def handler(x: int, _v: int = version) -> int:
            return x + _v

        steps.append(durable_step(name=name)(handler))
    assert steps[0].fn is not steps[1].fn
    assert registered_step(name) is steps[1]


def test_concurrent_registrations_of_one_name_let_exactly_one_through() -> None:
    """Threads decorating different functions under one name: one wins, the rest are
    refused, and the registry holds the winner."""
    name = _name("race")
    functions = []
    for i in range(8):
        namespace: dict[str, Any] = {}
        exec(f"def f{i}(x):\n    return x\n", namespace)
        functions.append(namespace[f"f{i}"])
    won: list[DurableStep[Any, Any]] = []
    refused: list[SagaDefinitionError] = []
    barrier = threading.Barrier(len(functions))

    def register(fn: Callable[..., Any]) -> None:
        barrier.wait()
        try:
            won.append(durable_step(name=name)(fn))
        except SagaDefinitionError as exc:
            refused.append(exc)

    threads = [threading.Thread(target=register, args=(fn,)) for fn in functions]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(won) == 1
    assert len(refused) == len(functions) - 1
    assert registered_step(name) is won[0]


def test_a_refused_declaration_registers_nothing() -> None:
    name = _name("bad")
    with pytest.raises(SagaDefinitionError):
        durable_step(name=name, timeout_seconds=-1)(durable_plain_sync)
    assert registered_step(name) is None


def test_isolated_steps_gives_a_block_a_registry_of_its_own() -> None:
    """Inside the block a name used outside is free; after it, the outer step is back and
    the inner one forgotten."""
    from saga.durable import isolated_steps, registered_step

    @durable_step(name="isolation_probe")
    def outer(x: int) -> int:
        return x

    with isolated_steps():
        assert registered_step("isolation_probe") is None

        @durable_step(name="isolation_probe")
        def inner(x: int) -> int:
            return -x

        assert registered_step("isolation_probe") is inner
    assert registered_step("isolation_probe") is outer
