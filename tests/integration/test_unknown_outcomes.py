"""Unknown outcomes stay unknown: unclassified exceptions, blocked or failed retries after an
unknown attempt, and results PostgreSQL cannot store, all against real PostgreSQL."""

from __future__ import annotations

import signal
from typing import Any

import crash_app
import psycopg
import pytest
from pydantic import BaseModel
from support import (
    FAST,
    ChildApp,
    OrchestratorFactory,
    Order,
    compensations,
    events,
    lease_expired,
    order_saga,
    wait_until,
)

from saga import Absent, Found, PermanentError, RetryPolicy, StepContext
from saga.testing import check_invariants


def _outcome_unknown(history: list[Any], step: str, kind: str = "action") -> list[Any]:
    return [e for e in history if e.event == "outcome_unknown" and (e.step, e.kind) == (step, kind)]


# ----- an exception is not a verdict (discipline 7) ---------------------------------------


def test_key_error_after_the_effect_is_reconciled_not_compensated(
    make_orch: OrchestratorFactory, database_url: str
) -> None:
    """A KeyError raised while parsing the carrier's answer, after the shipment was
    created, leaves the outcome unknown: the reconcile hook finds the shipment and the saga
    completes. The customer is not refunded while the parcel ships."""
    saga = order_saga("ship-parse")
    calls: list[str] = []
    shipments: dict[str, str] = {}

    @saga.step
    def charge(ctx: StepContext, o: Order) -> dict:
        calls.append("charge")
        return {"charged": o.amount_cents}

    @charge.compensation
    def refund(ctx: StepContext, o: Order, result: dict) -> None:
        calls.append("refund")

    @saga.step(retry=FAST)
    def ship(ctx: StepContext, o: Order) -> dict:
        calls.append(f"ship:{ctx.attempt}")
        shipments[ctx.idempotency_key] = "shp-1"  # the carrier created the shipment
        answer: dict[str, str] = {"id": "shp-1"}
        return {"shipment": answer["shipment_id"]}  # KeyError parsing the answer

    @ship.reconcile
    def find_shipment(ctx: StepContext, o: Order) -> Found | Absent:
        calls.append("find_shipment")
        found = shipments.get(ctx.idempotency_key)
        return Absent() if found is None else Found({"shipment": found}, provider_reference=found)

    orch = make_orch(saga)
    state = orch.run(orch.start(saga, Order(order_id="o-1")).id)

    assert state.status == "completed"
    assert calls == ["charge", "ship:1", "find_shipment"]
    op = state.operation("ship")
    assert (op.status, op.attempts, op.result) == ("succeeded", 1, {"shipment": "shp-1"})
    assert compensations(state) == {}
    (unknown,) = _outcome_unknown(orch.history(state.id), "ship")
    assert "KeyError" in unknown.detail["reason"]
    assert 'answer["shipment_id"]' in unknown.detail["traceback"]
    check_invariants(database_url, [state.id])


def test_key_error_without_reconcile_parks_and_compensates_nothing(
    make_orch: OrchestratorFactory, database_url: str
) -> None:
    """The same KeyError in a step with no reconcile hook that is not idempotent parks the
    saga in needs_review with the error and its traceback recorded; nothing is undone."""
    saga = order_saga("ship-parse-plain")
    calls: list[str] = []

    @saga.step
    def charge(ctx: StepContext, o: Order) -> dict:
        calls.append("charge")
        return {"charged": o.amount_cents}

    @charge.compensation
    def refund(ctx: StepContext, o: Order, result: dict) -> None:
        calls.append("refund")

    @saga.step(retry=FAST)
    def ship(ctx: StepContext, o: Order) -> dict:
        calls.append("ship")
        raise KeyError("shipment_id")

    orch = make_orch(saga)
    state = orch.run(orch.start(saga, Order(order_id="o-1")).id)

    assert state.status == "needs_review"
    assert calls == ["charge", "ship"]
    op = state.operation("ship")
    assert (op.status, op.attempts) == ("unknown", 1)
    assert "KeyError: 'shipment_id'" in (op.error or "")
    assert "KeyError: 'shipment_id'" in (state.error or "")
    assert compensations(state) == {}
    (unknown,) = _outcome_unknown(orch.history(state.id), "ship")
    assert unknown.attempt == 1
    assert "Traceback (most recent call last)" in unknown.detail["traceback"]
    assert "KeyError: 'shipment_id'" in unknown.detail["traceback"]
    check_invariants(database_url, [state.id])


def test_fail_on_key_error_fails_and_compensates(
    make_orch: OrchestratorFactory, database_url: str
) -> None:
    """With fail_on=(KeyError,) the step says a KeyError means "did not happen": the
    operation fails at once and the succeeded steps are compensated."""
    saga = order_saga("ship-fail-on")
    calls: list[str] = []

    @saga.step
    def charge(ctx: StepContext, o: Order) -> dict:
        calls.append("charge")
        return {"charged": o.amount_cents}

    @charge.compensation
    def refund(ctx: StepContext, o: Order, result: dict) -> None:
        calls.append("refund")

    @saga.step(retry=RetryPolicy(max_attempts=3, initial_delay=0.01, fail_on=(KeyError,)))
    def ship(ctx: StepContext, o: Order) -> dict:
        calls.append("ship")
        raise KeyError("shipment_id")

    orch = make_orch(saga)
    state = orch.run(orch.start(saga, Order(order_id="o-1")).id)

    assert state.status == "compensated"
    assert calls == ["charge", "ship", "refund"]
    assert (state.operation("ship").status, state.operation("ship").attempts) == ("failed", 1)
    assert compensations(state) == {"charge": ("succeeded", 1)}
    check_invariants(database_url, [state.id])


class RequestException(OSError):
    """Like `requests.exceptions.RequestException`: an OSError, not a ConnectionError."""


class LibraryConnectionError(RequestException):
    """Like `requests.exceptions.ConnectionError`, which is not the builtin ConnectionError."""


def test_a_library_connection_error_outside_retry_on_ends_unknown(
    make_orch: OrchestratorFactory, database_url: str
) -> None:
    """A library's own ConnectionError (not a subclass of the builtin, so not in the default
    retry_on) leaves each attempt unknown: the idempotent step is retried with the same key
    up to its ceiling, then the saga parks with the step unknown; it is never compensated."""
    saga = order_saga("http-charge")
    calls: list[tuple[str, int]] = []

    @saga.step
    def reserve(ctx: StepContext, o: Order) -> dict:
        return {"sku": "x"}

    @reserve.compensation
    def release(ctx: StepContext, o: Order, result: dict) -> None:
        calls.append(("release", 0))

    @saga.step(idempotent=True, retry=RetryPolicy(max_attempts=2, initial_delay=0.01))
    def charge(ctx: StepContext, o: Order) -> dict:
        calls.append((ctx.idempotency_key, ctx.attempt))
        raise LibraryConnectionError("Connection aborted: RemoteDisconnected")

    orch = make_orch(saga)
    state = orch.run(orch.start(saga, Order(order_id="o-1")).id)

    key = "http-charge:v1:acme:o-1:charge"
    assert calls == [(key, 1), (key, 2)]
    assert state.status == "needs_review"
    op = state.operation("charge")
    assert (op.status, op.attempts) == ("unknown", 2)
    assert "LibraryConnectionError" in (op.error or "")
    assert "ceiling of 2 attempts" in (state.error or "")
    assert compensations(state) == {}
    check_invariants(database_url, [state.id])


def test_an_unclassified_exception_in_a_compensation_leaves_it_unknown(
    make_orch: OrchestratorFactory, database_url: str
) -> None:
    """Compensations follow the same rule: a refund raising a ValueError may have refunded,
    so the compensation is unknown (not failed) and the saga parks."""
    saga = order_saga("refund-bug")

    @saga.step
    def charge(ctx: StepContext, o: Order) -> dict:
        return {"charged": o.amount_cents}

    @charge.compensation(retry=FAST)
    def refund(ctx: StepContext, o: Order, result: dict) -> None:
        raise ValueError("unexpected refund status 'pending_review'")

    @saga.step
    def ship(ctx: StepContext, o: Order) -> dict:
        raise PermanentError("no carrier")

    orch = make_orch(saga)
    state = orch.run(orch.start(saga, Order(order_id="o-1")).id)

    assert state.status == "needs_review"
    assert compensations(state) == {"charge": ("unknown", 1)}
    assert "ValueError" in (state.operation("charge", kind="compensation").error or "")
    assert _outcome_unknown(orch.history(state.id), "charge", "compensation")
    check_invariants(database_url, [state.id])


class Parcel(BaseModel):
    order_id: str
    note: str


def test_an_unclassified_exception_in_prepare_parks_without_compensating(
    make_orch: OrchestratorFactory, database_url: str
) -> None:
    """Nothing was called when a prepare hook raises, so its outcome is not unknown; but a
    bug there (neither PermanentError, fail_on nor retry_on) does not fail the step either:
    the saga parks with the attempt counted, the step pending, nothing compensated."""
    saga = order_saga("prepare-bug")
    calls: list[str] = []

    @saga.step
    def charge(ctx: StepContext, o: Order) -> dict:
        return {"charged": o.amount_cents}

    @charge.compensation
    def refund(ctx: StepContext, o: Order, result: dict) -> None:
        calls.append("refund")

    @saga.step(retry=FAST)
    def ship(ctx: StepContext, o: Order) -> dict:
        calls.append("ship")
        return {"shipped": True}

    @ship.prepare
    def plan(ctx: StepContext, o: Order) -> Parcel:
        raise KeyError("address")

    orch = make_orch(saga)
    state = orch.run(orch.start(saga, Order(order_id="o-1")).id)

    assert state.status == "needs_review"
    assert calls == []
    op = state.operation("ship")
    assert (op.status, op.attempts) == ("pending", 1)
    assert "KeyError: 'address'" in (state.error or "")
    assert compensations(state) == {}
    failed = [e for e in orch.history(state.id) if e.event == "attempt_failed"]
    assert "KeyError" in failed[0].detail["traceback"]
    check_invariants(database_url, [state.id])


# ----- a result PostgreSQL cannot store --------------------------------------------------


@pytest.mark.parametrize(
    "result",
    [{"note": "a\x00b"}, {"a\x00b": 1}, {"items": ["ok", "\ud800"]}],
    ids=["nul-in-string", "nul-in-key", "lone-surrogate"],
)
def test_a_result_jsonb_refuses_parks_the_saga(
    make_orch: OrchestratorFactory, database_url: str, result: dict[str, Any]
) -> None:
    """A JSON result with a NUL character or a lone surrogate is a TypeError naming the step,
    recorded: run() returns the saga parked with the step unknown, and raises nothing."""
    saga = order_saga("nul-result")

    @saga.step
    def charge(ctx: StepContext, o: Order) -> dict:
        return result

    orch = make_orch(saga)
    state = orch.run(orch.start(saga, Order(order_id="o-1")).id)

    assert state.status == "needs_review"
    op = state.operation("charge")
    assert (op.status, op.attempts, op.result) == ("unknown", 1, None)
    assert "TypeError: result of step 'charge'" in (op.error or "")
    assert "NUL" in (op.error or "") or "surrogate" in (op.error or "")
    assert state.error == op.error
    assert state.lease_owner is None
    check_invariants(database_url, [state.id])


def test_a_reconciled_result_jsonb_refuses_parks_the_saga(
    make_orch: OrchestratorFactory, database_url: str
) -> None:
    """A reconcile hook's Found(result) goes through the same check: asking again would find
    the same value, so the saga parks at once with the reason."""
    saga = order_saga("nul-found")
    asks: list[int] = []

    @saga.step
    def charge(ctx: StepContext, o: Order) -> dict:
        raise RuntimeError("lost the provider's answer")

    @charge.reconcile
    def find_charge(ctx: StepContext, o: Order) -> Found:
        asks.append(1)
        return Found({"memo": "paid\x00"})

    orch = make_orch(saga)
    state = orch.run(orch.start(saga, Order(order_id="o-1")).id)

    assert state.status == "needs_review"
    assert asks == [1]
    op = state.operation("charge")
    assert (op.status, op.result) == ("unknown", None)
    assert "reconcile found the effect" in (op.error or "")
    assert "result of step 'charge'" in (state.error or "")
    check_invariants(database_url, [state.id])


def test_a_prepared_request_jsonb_refuses_parks_the_saga(
    make_orch: OrchestratorFactory, database_url: str
) -> None:
    """A prepare hook's request is checked too: nothing is called, the saga parks."""
    saga = order_saga("nul-request")
    calls: list[str] = []

    @saga.step
    def ship(ctx: StepContext, o: Order) -> dict:
        calls.append("ship")
        return {}

    @ship.prepare
    def plan(ctx: StepContext, o: Order) -> Parcel:
        return Parcel(order_id=o.order_id, note="leave at door\x00")

    orch = make_orch(saga)
    state = orch.run(orch.start(saga, Order(order_id="o-1")).id)

    assert state.status == "needs_review"
    assert calls == []
    assert "NUL" in (state.error or "")
    assert "step 'ship'" in (state.error or "")
    check_invariants(database_url, [state.id])


# ----- unknown must stay unknown (real child processes, SIGKILL) ---------------------------


def _calls(url: str, step: str) -> list[tuple[str, int]]:
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT idempotency_key, attempt FROM step_calls WHERE step = %s ORDER BY id", (step,)
        ).fetchall()
    return [(str(k), int(a)) for k, a in rows]


def _killed_after_charging(url: str, children: list[ChildApp], saga: str) -> str:
    """Run `saga` in a child that is SIGKILLed right after the provider charged; the saga id."""
    child = ChildApp(url, saga, "o-1", CRASH_APP_BLOCK="after_effect")
    children.append(child)
    saga_id = child.expect("STARTED").split()[1]
    child.expect("CHARGED")
    child.signal(signal.SIGKILL)
    assert child.wait() == -signal.SIGKILL
    wait_until(lambda: lease_expired(url, saga_id), timeout=15)
    return saga_id


@pytest.mark.crash
def test_a_blocked_retry_leaves_the_step_unknown_and_compensate_undoes_it(
    make_orch: OrchestratorFactory, app_url: str, children: list[ChildApp]
) -> None:
    """Killed after the charge; its idempotent retry is blocked by the saga's side-effect
    ceiling, so the saga parks with the charge still unknown (not pending). compensate()
    then stops at it, and with include_unknown=True refunds it before releasing."""
    name = crash_app.CAPPED.name
    saga_id = _killed_after_charging(app_url, children, name)
    orch = make_orch(*crash_app.ALL_SAGAS)

    state = orch.run(saga_id)
    assert state.status == "needs_review"
    assert "max_side_effects" in (state.error or "")
    charge = state.operation("charge")
    assert (charge.status, charge.attempts) == ("unknown", 1)

    state = orch.compensate(saga_id)
    assert state.status == "needs_review"
    assert "'charge'" in (state.error or "") and "unknown" in (state.error or "")
    assert _calls(app_url, "refund") == [] and _calls(app_url, "release") == []

    state = orch.compensate(saga_id, include_unknown=True)
    assert state.status == "compensated"
    assert _calls(app_url, "refund") == [(f"{name}:v1::o-1:charge:compensate", 1)]
    assert _calls(app_url, "release") == [(f"{name}:v1::o-1:reserve:compensate", 1)]
    assert _calls(app_url, "charge") == [(f"{name}:v1::o-1:charge", 1)]
    check_invariants(app_url, [saga_id])


@pytest.mark.crash
def test_a_retry_failing_at_the_ceiling_after_an_unknown_attempt_parks(
    make_orch: OrchestratorFactory,
    app_url: str,
    children: list[ChildApp],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Killed after the charge; the idempotent retry (the last attempt) fails transiently.
    The charge may be in place, so the step is not failed and nothing is compensated: the
    saga parks with the step unknown and a reason naming the unknown attempt."""
    name = crash_app.RETRIED.name
    saga_id = _killed_after_charging(app_url, children, name)
    monkeypatch.setenv(crash_app.ENV_BLOCK, "transient")  # this process's charge fails
    orch = make_orch(*crash_app.ALL_SAGAS)

    state = orch.run(saga_id)

    assert state.status == "needs_review"
    key = f"{name}:v1::o-1:charge"
    assert _calls(app_url, "charge") == [(key, 1), (key, 2)]
    charge = state.operation("charge")
    assert (charge.status, charge.attempts) == ("unknown", 2)
    assert "TransientError" in (state.error or "")
    assert "earlier attempt's outcome is unknown" in (state.error or "")
    assert compensations(state) == {}
    assert _calls(app_url, "release") == []
    names = events(orch.history(saga_id))
    assert "compensation_started" not in names
    check_invariants(app_url, [saga_id])

    # Only a success, a reconcile answer or an operator settles it.
    orch.resolve(
        saga_id, "charge", outcome="succeeded", result={"charge_id": "ch_o-1"}, actor="ops@acme"
    )
    assert orch.run(saga_id).status == "completed"
    assert _calls(app_url, "charge") == [(key, 1), (key, 2)]
