"""get(), list() and history(): what an operator sees of sagas and their audit trail."""

from __future__ import annotations

import uuid

import pytest
from support import OrchestratorFactory, Order, events, is_subsequence, order_saga

from saga import PermanentError, Saga, SagaNotFound, StepContext


def _one_step(name: str, *, fail: bool = False) -> Saga[Order]:
    saga = order_saga(name)

    @saga.step
    def work(ctx: StepContext, o: Order) -> dict:
        if fail:
            raise PermanentError("nope")
        return {"done": o.order_id}

    return saga


def test_list_filters_and_orders_newest_first(make_orch: OrchestratorFactory) -> None:
    """list() filters by status, saga and tenant, honours limit, and returns newest first."""
    alpha = _one_step("alpha")
    beta = _one_step("beta", fail=True)
    orch = make_orch(alpha, beta)
    a1 = orch.start(alpha, Order(tenant_id="t1", order_id="a1")).id
    b1 = orch.start(beta, Order(tenant_id="t1", order_id="b1")).id
    a2 = orch.start(alpha, Order(tenant_id="t2", order_id="a2")).id
    b2 = orch.start(beta, Order(tenant_id="t2", order_id="b2")).id
    a3 = orch.start(alpha, Order(tenant_id="t2", order_id="a3")).id
    orch.run(a1)
    orch.run(b1)
    orch.run(a2)

    assert [s.id for s in orch.list()] == [a3, b2, a2, b1, a1]
    assert [s.id for s in orch.list(status="completed")] == [a2, a1]
    assert [s.id for s in orch.list(status="compensated")] == [b1]
    assert [s.id for s in orch.list(status="pending")] == [a3, b2]
    assert [s.id for s in orch.list(saga="alpha")] == [a3, a2, a1]
    assert [s.id for s in orch.list(tenant="t1")] == [b1, a1]
    assert [s.id for s in orch.list(saga="alpha", tenant="t2", status="pending")] == [a3]
    assert [s.id for s in orch.list(limit=2)] == [a3, b2]
    assert orch.list(status="needs_review") == []
    listed = orch.list(status="completed")[0]
    assert listed.saga == "alpha" and listed.tenant_id == "t2" and listed.key == "a2"
    assert listed == orch.get(a2)


def test_get_returns_the_saga_and_its_operations(make_orch: OrchestratorFactory) -> None:
    """get() returns identity, status, input and operations of a saga."""
    saga = _one_step("alpha")
    orch = make_orch(saga)
    saga_id = orch.start(saga, Order(order_id="o-1", amount_cents=7)).id

    state = orch.run(saga_id)
    got = orch.get(saga_id)

    assert got == state
    assert (got.id, got.saga, got.version, got.tenant_id, got.key) == (
        saga_id,
        "alpha",
        1,
        "acme",
        "o-1",
    )
    assert got.status == "completed"
    assert got.input["amount_cents"] == 7
    assert got.created_at <= got.updated_at
    assert got.operation("work").result == {"done": "o-1"}


def test_history_is_the_audit_trail_oldest_first(make_orch: OrchestratorFactory) -> None:
    """history() lists every transition oldest first, with step, kind and attempt."""
    saga = _one_step("alpha")
    orch = make_orch(saga)
    saga_id = orch.start(saga, Order(order_id="o-1")).id
    assert events(orch.history(saga_id)) == ["saga_started"]

    orch.run(saga_id)
    history = orch.history(saga_id)
    names = events(history)

    assert names[0] == "saga_started"
    assert is_subsequence(
        [
            "saga_started",
            "lease_acquired",
            "attempt_started",
            "attempt_succeeded",
            "saga_completed",
        ],
        names,
    ), names
    assert [e.at for e in history] == sorted(e.at for e in history)
    started = next(e for e in history if e.event == "attempt_started")
    assert (started.step, started.kind, started.attempt) == ("work", "action", 1)
    acquired = next(e for e in history if e.event == "lease_acquired")
    assert isinstance(acquired.detail.get("fence"), int)


def test_unknown_or_malformed_id_raises_saga_not_found(make_orch: OrchestratorFactory) -> None:
    """An id that names no saga, or is not an id at all, raises SagaNotFound everywhere."""
    saga = _one_step("alpha")
    orch = make_orch(saga)
    orch.start(saga, Order(order_id="o-1"))

    for bad in (str(uuid.uuid4()), "not-a-uuid", ""):
        with pytest.raises(SagaNotFound):
            orch.get(bad)
        with pytest.raises(SagaNotFound):
            orch.history(bad)
        with pytest.raises(SagaNotFound):
            orch.run(bad)
        with pytest.raises(SagaNotFound):
            orch.compensate(bad)
        with pytest.raises(SagaNotFound):
            orch.resolve(bad, "work", outcome="failed", actor="ops@example")
