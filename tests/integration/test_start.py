"""start(): idempotent on (tenant, saga, key), loud on a conflicting request, validated input."""

from __future__ import annotations

import pydantic
import pytest
from support import OrchestratorFactory, Order, count_rows, order_saga

from saga import IdempotencyConflict, Saga, StepContext


def _checkout() -> Saga[Order]:
    saga = order_saga("checkout")

    @saga.step
    def reserve(ctx: StepContext, o: Order) -> dict:
        return {"reserved": o.order_id}

    return saga


def test_start_twice_returns_the_same_saga(
    make_orch: OrchestratorFactory, database_url: str
) -> None:
    """Starting the same (tenant, saga, key) twice returns one saga; the second is not created."""
    saga = _checkout()
    orch = make_orch(saga)

    first = orch.start(saga, Order(order_id="o-1"))
    second = orch.start(saga, Order(order_id="o-1"))

    assert first.created is True
    assert second.created is False
    assert second.id == first.id
    assert isinstance(first.id, str)
    assert (first.saga, first.version, first.tenant_id, first.key) == ("checkout", 1, "acme", "o-1")
    assert count_rows(database_url, "sagas") == 1


def test_volatile_fields_do_not_conflict(make_orch: OrchestratorFactory, database_url: str) -> None:
    """A retried start whose only change is a volatile field returns the existing saga."""
    saga = _checkout()
    orch = make_orch(saga)

    first = orch.start(saga, Order(order_id="o-1", requested_at="2024-01-01T00:00:00Z"))
    second = orch.start(saga, Order(order_id="o-1", requested_at="2024-01-01T00:05:00Z"))

    assert second.id == first.id
    assert second.created is False
    assert count_rows(database_url, "sagas") == 1


def test_different_business_input_is_a_loud_conflict(
    make_orch: OrchestratorFactory, database_url: str
) -> None:
    """Same key with different business fields raises IdempotencyConflict and writes nothing."""
    saga = _checkout()
    orch = make_orch(saga)
    orch.start(saga, Order(order_id="o-1", amount_cents=100))
    sagas_before = count_rows(database_url, "sagas")
    ops_before = count_rows(database_url, "operations")
    events_before = count_rows(database_url, "events")

    with pytest.raises(IdempotencyConflict) as excinfo:
        orch.start(saga, Order(order_id="o-1", amount_cents=999))

    message = str(excinfo.value)
    assert "checkout" in message
    assert "o-1" in message
    assert count_rows(database_url, "sagas") == sagas_before == 1
    assert count_rows(database_url, "operations") == ops_before
    assert count_rows(database_url, "events") == events_before


def test_same_key_in_another_tenant_is_another_saga(
    make_orch: OrchestratorFactory, database_url: str
) -> None:
    """Identity is (tenant, saga, key): the same key under two tenants makes two sagas."""
    saga = _checkout()
    orch = make_orch(saga)

    a = orch.start(saga, Order(tenant_id="t1", order_id="o-1"))
    b = orch.start(saga, Order(tenant_id="t2", order_id="o-1", amount_cents=5))

    assert a.id != b.id
    assert a.created and b.created
    assert count_rows(database_url, "sagas") == 2


def test_invalid_input_raises_before_anything_is_written(
    make_orch: OrchestratorFactory, database_url: str
) -> None:
    """Input that fails validation raises pydantic's ValidationError and writes no row."""
    saga = _checkout()
    orch = make_orch(saga)

    with pytest.raises(pydantic.ValidationError):
        orch.start(saga, {"order_id": "o-1", "amount_cents": "a lot"})
    with pytest.raises(pydantic.ValidationError):
        orch.start(saga, {"amount_cents": 5})  # no order_id
    # The saga's name where its object belongs: a TypeError that says so, not an
    # AttributeError from inside.
    with pytest.raises(TypeError, match=r"take the Saga object itself .*not str 'checkout'"):
        orch.start("checkout", {"order_id": "o-1", "amount_cents": 5})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="take the Saga object itself"):
        orch.execute("checkout", {"order_id": "o-1", "amount_cents": 5})  # type: ignore[arg-type]

    assert count_rows(database_url, "sagas") == 0
    assert count_rows(database_url, "operations") == 0
    assert count_rows(database_url, "events") == 0


def test_dict_input_is_validated_and_accepted(
    make_orch: OrchestratorFactory, database_url: str
) -> None:
    """A dict input is validated into the model; the model form of it is the same saga."""
    saga = _checkout()
    orch = make_orch(saga)

    handle = orch.start(saga, {"tenant_id": "acme", "order_id": "o-7", "amount_cents": "250"})
    again = orch.start(saga, Order(order_id="o-7", amount_cents=250))

    assert handle.created is True
    assert again.id == handle.id and again.created is False
    state = orch.get(handle.id)
    assert state.status == "pending"
    assert state.input["order_id"] == "o-7"
    assert state.input["amount_cents"] == 250
    assert (state.saga, state.tenant_id, state.key) == ("checkout", "acme", "o-7")
