"""One saga never takes a worker down: a saga its definition no longer fits is parked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg
import pytest
import structlog.testing
from pydantic import BaseModel

from faults import app
from faults.harness import WorkerProcess
from faults.proxy import LostReplyProxy
from saga import Absent, Orchestrator, Saga, StepContext

pytestmark = [pytest.mark.integration]


def test_a_worker_process_parks_a_saga_its_definition_no_longer_fits(
    database_url: str, provider_url: str, log_dir: Path, workers: list[WorkerProcess]
) -> None:
    """A saga whose stored operation names a step its (same-version) definition lacks is
    claimed first, by a worker process of concurrency 1: it is parked in needs_review with
    the reason, and the worker completes every healthy saga queued behind it and exits
    cleanly (it used to exit on the error, the claim rolled back, the saga first again)."""
    with Orchestrator(database_url, sagas=app.ALL_SAGAS) as orch:
        broken = orch.start(app.SAGAS["fault3"], app.FaultInput(key="broken")).id
        healthy = [
            orch.start(app.SAGAS[name], app.FaultInput(key=f"ok-{i}")).id
            for i, name in enumerate(["fault3", "fault4", "fault5", "fault6", "fault3"])
        ]
    with psycopg.connect(database_url, autocommit=True) as conn:
        # Step "a" renamed in the stored saga (as if renamed in code under the same version),
        # and that saga queued ahead of the others.
        conn.execute(
            "UPDATE saga.operations SET step = 'gone' WHERE saga_id = %s AND step = 'a'",
            (broken,),
        )
        conn.execute(
            "UPDATE saga.sagas SET run_after = now() - interval '1 day' WHERE id = %s", (broken,)
        )

    worker = WorkerProcess(database_url, provider_url, log_dir, concurrency=1, until_idle=True)
    workers.append(worker)
    code = worker.wait(timeout=120)
    assert code == 0, worker.output()[-3000:]

    with Orchestrator(database_url, sagas=app.ALL_SAGAS) as orch:
        assert [orch.get(s).status for s in healthy] == ["completed"] * len(healthy)
        parked = orch.get(broken)
        assert parked.status == "needs_review"
        assert parked.error is not None
        assert "fault3" in parked.error and "no step 'gone'" in parked.error, parked.error
        assert parked.lease_owner is None
        assert [op.attempts for op in parked.operations] == [0, 0, 0]
        history = orch.history(broken)
    assert [e.event for e in history][-3:] == ["lease_acquired", "saga_parked", "lease_released"]


class _Receipt(BaseModel):
    receipt_id: str


class _Order(BaseModel):
    order_id: str


def _bogus_charge_saga(name: str) -> Saga[_Order]:
    """charge, then ship, which reads charge's result; ship may be reconciled."""
    saga: Saga[_Order] = Saga(name, version=1, input=_Order, key=lambda o: o.order_id)

    @saga.step
    def charge(ctx: StepContext, order: _Order) -> _Receipt:
        return _Receipt(receipt_id="r-1")

    @saga.step
    def ship(ctx: StepContext, order: _Order) -> dict[str, Any]:
        return {"receipt": ctx.results["charge"].receipt_id}

    @ship.reconcile
    def find_shipment(ctx: StepContext, order: _Order) -> Absent:
        return Absent()

    return saga


def _store_bogus_charge(database_url: str, saga_id: str, *, ship: str | None) -> None:
    """charge succeeded with a result its model refuses; ship as given (None: untouched)."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            "UPDATE saga.operations SET status = 'succeeded', attempts = 1,"
            " result = '{\"bogus\": true}' WHERE saga_id = %s AND step = 'charge'",
            (saga_id,),
        )
        if ship is not None:
            conn.execute(
                "UPDATE saga.operations SET status = %s, attempts = 1"
                " WHERE saga_id = %s AND step = 'ship'",
                (ship, saga_id),
            )


def test_a_park_whose_reply_was_lost_is_recognised_as_landed(database_url: str) -> None:
    """The fenced write that parks a saga whose driving raised (here: the context of a
    reconcile cannot be built) loses its reply after it committed: run() recognises the
    park as landed and returns the parked saga (rather than taking its own released lease
    for a lost one)."""
    saga = _bogus_charge_saga("park_lost")
    with LostReplyProxy(database_url) as proxy, Orchestrator(proxy.url, sagas=[saga]) as orch:
        saga_id = orch.start(saga, _Order(order_id="o-1")).id
        _store_bogus_charge(database_url, saga_id, ship="unknown")
        proxy.lose_reply("write_saga", "parked for review")
        with structlog.testing.capture_logs() as logs:
            state = orch.run(saga_id)
        seen = [e["event"] for e in logs]
        assert "write_landed" in seen and "lease_lost" not in seen, seen
        assert len(proxy.lost_replies("write_saga")) == 1
        assert state.status == "needs_review"
        assert state.error is not None and "ValidationError" in state.error
        assert state.error.startswith("driving the saga raised"), state.error
        assert [e.event for e in orch.history(saga_id)].count("saga_parked") == 1


def test_a_step_whose_arguments_cannot_be_built_is_not_called_even_when_a_reply_is_lost(
    database_url: str,
) -> None:
    """ship's context reads charge's result, which its model refuses: ship's attempt,
    recorded as started, is recorded as not called (pending, never unknown), and the write
    that says so loses its reply after it committed: it is recognised as landed."""
    saga = _bogus_charge_saga("not_called_lost")
    with LostReplyProxy(database_url) as proxy, Orchestrator(proxy.url, sagas=[saga]) as orch:
        saga_id = orch.start(saga, _Order(order_id="o-1")).id
        _store_bogus_charge(database_url, saga_id, ship=None)
        proxy.lose_reply("write_saga", "was not called")
        with structlog.testing.capture_logs() as logs:
            state = orch.run(saga_id)
        seen = [e["event"] for e in logs]
        assert "write_landed" in seen and "lease_lost" not in seen, seen
        assert len(proxy.lost_replies("write_saga")) == 1
        assert state.status == "needs_review"
        assert state.error is not None and "ValidationError" in state.error
        assert state.operation("ship").status == "pending"
        trail = [e.event for e in orch.history(saga_id)]
        assert trail.count("attempt_not_called") == 1 and "outcome_unknown" not in trail
