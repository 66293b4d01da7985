"""Declaring sagas: names, order, hooks and the errors raised at declaration time."""

import math
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from saga import (
    Compensation,
    RetryPolicy,
    Saga,
    SagaDefinitionError,
    Step,
    StepContext,
)


class Order(BaseModel):
    tenant_id: str
    order_id: str
    amount_cents: int
    trace_id: str | None = None


def _saga(name: str = "orders", **options: Any) -> Saga[Order]:
    return Saga(name, input=Order, key=lambda o: o.order_id, **options)


def test_steps_are_named_after_their_function() -> None:
    """Without name=, a step is named by its function's __name__."""
    saga = _saga()

    @saga.step
    def reserve_inventory(ctx: StepContext, o: Order) -> dict[str, Any]:
        return {}

    assert isinstance(reserve_inventory, Step)
    assert reserve_inventory.name == "reserve_inventory"
    assert saga.step_named("reserve_inventory") is reserve_inventory


def test_name_option_overrides_the_function_name() -> None:
    """name= gives the step its stored name, whatever the function is called."""
    saga = _saga()

    @saga.step(name="charge-card.v2")
    def charge(ctx: StepContext, o: Order) -> None:
        return None

    assert charge.name == "charge-card.v2"
    assert saga.step_named("charge") is None


def test_steps_keep_declaration_order() -> None:
    """Steps run in the order they were declared; their index says so."""
    saga = _saga()
    names = ["zeta", "alpha", "mid", "beta"]
    for name in names:
        saga.step(name=name)(lambda ctx, o: None)
    assert [s.name for s in saga.steps] == names
    assert [s.index for s in saga.steps] == [0, 1, 2, 3]


def test_step_options_are_kept() -> None:
    """retry, idempotent and pivot are recorded on the step; defaults are sane."""
    saga = _saga()
    policy = RetryPolicy(max_attempts=7)

    @saga.step(retry=policy, idempotent=True, pivot=True)
    def ship(ctx: StepContext, o: Order) -> None:
        return None

    @saga.step
    def notify(ctx: StepContext, o: Order) -> None:
        return None

    assert ship.retry == policy
    assert ship.idempotent and ship.pivot
    assert notify.retry == RetryPolicy()
    assert not notify.idempotent and not notify.pivot


def test_calling_a_step_calls_its_function() -> None:
    """A decorated step stays callable, so step code can be unit tested directly."""
    saga = _saga()
    calls: list[tuple[object, Order]] = []

    @saga.step
    def charge(ctx: Any, o: Order) -> dict[str, int]:
        calls.append((ctx, o))
        return {"charged": o.amount_cents}

    order = Order(tenant_id="t", order_id="o", amount_cents=5)
    assert charge("ctx", order) == {"charged": 5}
    assert calls == [("ctx", order)]


def test_compensation_is_attached_to_its_step() -> None:
    """@step.compensation declares the step's compensating action with its own options."""
    saga = _saga()

    @saga.step
    def reserve(ctx: StepContext, o: Order) -> dict[str, Any]:
        return {}

    @reserve.compensation(retry=RetryPolicy(max_attempts=10), idempotent=True)
    def release(ctx: StepContext, o: Order, result: dict[str, Any]) -> None:
        return None

    assert isinstance(release, Compensation)
    assert reserve.compensation_op is release
    assert release.step is reserve
    assert release.retry.max_attempts == 10
    assert release.idempotent


def test_compensation_decorator_without_parentheses() -> None:
    """@step.compensation also works bare, with default options."""
    saga = _saga()

    @saga.step
    def reserve(ctx: StepContext, o: Order) -> None:
        return None

    @reserve.compensation
    def release(ctx: StepContext, o: Order, result: None) -> None:
        return None

    assert reserve.compensation_op is release
    assert not release.idempotent
    assert release.retry == RetryPolicy()


def test_reconcile_hooks_are_recorded_and_returned_unchanged() -> None:
    """@step.reconcile and @compensation.reconcile register the function and return it."""
    saga = _saga()

    @saga.step
    def charge(ctx: StepContext, o: Order) -> None:
        return None

    def find_charge(ctx: StepContext, o: Order) -> None:
        return None

    def find_refund(ctx: StepContext, o: Order, result: None) -> None:
        return None

    @charge.compensation
    def refund(ctx: StepContext, o: Order, result: None) -> None:
        return None

    assert charge.reconcile(find_charge) is find_charge
    assert refund.reconcile(find_refund) is find_refund
    assert charge.reconcile_fn is find_charge
    assert refund.reconcile_fn is find_refund


# ----- declaration errors ---------------------------------------------------------------


def test_duplicate_step_name_is_refused() -> None:
    """Two steps with the same name raise SagaDefinitionError at declaration."""
    saga = _saga()

    @saga.step
    def charge(ctx: StepContext, o: Order) -> None:
        return None

    with pytest.raises(SagaDefinitionError, match="charge"):

        @saga.step(name="charge")
        def charge_again(ctx: StepContext, o: Order) -> None:
            return None

    assert [s.name for s in saga.steps] == ["charge"]


def test_second_compensation_is_refused() -> None:
    """A step has at most one compensation; a second raises SagaDefinitionError."""
    saga = _saga()

    @saga.step
    def reserve(ctx: StepContext, o: Order) -> None:
        return None

    @reserve.compensation
    def release(ctx: StepContext, o: Order, result: None) -> None:
        return None

    with pytest.raises(SagaDefinitionError, match="reserve"):

        @reserve.compensation
        def release_again(ctx: StepContext, o: Order, result: None) -> None:
            return None

    assert reserve.compensation_op is release


def test_second_reconcile_on_a_step_is_refused() -> None:
    """A step has at most one reconcile hook."""
    saga = _saga()

    @saga.step
    def charge(ctx: StepContext, o: Order) -> None:
        return None

    charge.reconcile(lambda ctx, o: None)
    with pytest.raises(SagaDefinitionError, match="charge"):
        charge.reconcile(lambda ctx, o: None)


@pytest.mark.parametrize("bad", [-1, "1", None, True, math.inf, math.nan])
def test_reconcile_window_must_be_a_finite_number_of_seconds(bad: Any) -> None:
    """A declared step's reconcile window is checked as a durable step's is, naming the
    step: a bool or an endless window is refused at declaration, not met at run time."""
    saga = _saga()

    @saga.step
    def charge(ctx: StepContext, o: Order) -> None:
        return None

    with pytest.raises(
        SagaDefinitionError, match=r"charge.*window_seconds must be a finite number >= 0"
    ):
        charge.reconcile(window_seconds=bad)


def test_retry_that_is_not_a_retry_policy_is_refused_naming_the_operation() -> None:
    """`retry=3` on a step, a compensation or a reconcile hook is refused when declared,
    with the operation named, instead of failing at the first retry."""
    saga = _saga()
    with pytest.raises(SagaDefinitionError, match=r"step 'charge'.*retry must be a RetryPolicy"):

        @saga.step(retry=3)  # type: ignore[arg-type]
        def charge(ctx: StepContext, o: Order) -> None:
            return None

    @saga.step
    def reserve(ctx: StepContext, o: Order) -> None:
        return None

    with pytest.raises(SagaDefinitionError, match=r"compensation of step 'reserve'.*RetryPolicy"):

        @reserve.compensation(retry={"max_attempts": 2})  # type: ignore[arg-type]
        def release(ctx: StepContext, o: Order, result: None) -> None:
            return None

    with pytest.raises(SagaDefinitionError, match=r"reconcile of step 'reserve'.*RetryPolicy"):
        reserve.reconcile(retry=1.5)  # type: ignore[arg-type]
    assert reserve.compensation_op is None and reserve.reconcile_fn is None
    assert [step.name for step in saga.steps] == ["reserve"]


def test_second_reconcile_on_a_compensation_is_refused() -> None:
    """A compensation has at most one reconcile hook."""
    saga = _saga()

    @saga.step
    def charge(ctx: StepContext, o: Order) -> None:
        return None

    @charge.compensation
    def refund(ctx: StepContext, o: Order, result: None) -> None:
        return None

    refund.reconcile(lambda ctx, o, result: None)
    with pytest.raises(SagaDefinitionError, match="charge"):
        refund.reconcile(lambda ctx, o, result: None)


@pytest.mark.parametrize(
    "name",
    ["", "has space", "colon:name", "percent%", "slash/name", "é", "x" * 101],
    ids=["empty", "space", "colon", "percent", "slash", "non-ascii", "too-long"],
)
def test_bad_step_names_are_refused(name: str) -> None:
    """Step names are 1-100 letters, digits, '_', '-' or '.'; others raise at declaration."""
    saga = _saga()
    with pytest.raises(SagaDefinitionError):
        saga.step(name=name)(lambda ctx, o: None)
    assert saga.steps == []


@pytest.mark.parametrize("name", ["", "re newal", "a:b", "x" * 101])
def test_bad_saga_names_are_refused(name: str) -> None:
    """Saga names follow the same rule as step names."""
    with pytest.raises(SagaDefinitionError):
        _saga(name)


def test_longest_allowed_names_are_accepted() -> None:
    """A 100-character name with every allowed kind of character is fine."""
    name = ("aZ0_-." * 17)[:100]
    saga = _saga(name)
    saga.step(name=name)(lambda ctx, o: None)
    assert saga.steps[0].name == name


@pytest.mark.parametrize("version", [0, -1, True, 1.0, "1"], ids=str)
def test_version_must_be_a_positive_int(version: Any) -> None:
    """version < 1 (or not an int) raises SagaDefinitionError."""
    with pytest.raises(SagaDefinitionError):
        _saga(version=version)


def test_volatile_fields_must_be_input_fields() -> None:
    """Naming a volatile field the input model lacks raises, naming the field."""
    with pytest.raises(SagaDefinitionError, match="requested_at"):
        _saga(volatile=("trace_id", "requested_at"))
    assert _saga(volatile=("trace_id",)).volatile == ("trace_id",)


def test_input_must_be_a_pydantic_model_class() -> None:
    """input= takes a pydantic model class, not a dict or an instance."""
    with pytest.raises(SagaDefinitionError):
        Saga("orders", input=dict, key=lambda o: "k")  # type: ignore[type-var]


def test_non_callable_step_is_refused() -> None:
    """Declaring something that is not callable as a step raises SagaDefinitionError."""
    saga = _saga()
    with pytest.raises(SagaDefinitionError):
        saga.step(name="x")(42)  # type: ignore[arg-type]


# ----- instances ------------------------------------------------------------------------


def test_identity_is_tenant_and_key() -> None:
    """identity() applies the tenant and key functions; no tenant function means ''."""
    order = Order(tenant_id="acme", order_id="o-1", amount_cents=1)
    tenanted = Saga("orders", input=Order, key=lambda o: o.order_id, tenant=lambda o: o.tenant_id)
    assert tenanted.identity(order) == ("acme", "o-1")
    assert _saga().identity(order) == ("", "o-1")


def test_empty_key_is_refused() -> None:
    """A saga instance needs a non-empty business key."""
    saga = Saga("orders", input=Order, key=lambda o: "")
    with pytest.raises(ValueError, match="key"):
        saga.identity(Order(tenant_id="t", order_id="o", amount_cents=1))


def test_validate_input_accepts_dicts_and_models() -> None:
    """Input may be a model or a dict; both are validated, bad data raises ValidationError."""
    saga = _saga()
    from_dict = saga.validate_input({"tenant_id": "t", "order_id": "o", "amount_cents": 3})
    assert from_dict == Order(tenant_id="t", order_id="o", amount_cents=3)
    model = Order(tenant_id="t", order_id="o", amount_cents=3)
    assert saga.validate_input(model) == model
    with pytest.raises(ValidationError):
        saga.validate_input({"tenant_id": "t", "order_id": "o", "amount_cents": "lots"})
