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
from saga import Orchestrator, Saga, StepContext

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


def test_a_park_whose_reply_was_lost_is_recognised_as_landed(database_url: str) -> None:
    """The fenced write that parks a saga whose driving raised loses its reply after it
    committed: run() recognises the park as landed and returns the parked saga (rather
    than taking its own released lease for a lost one)."""
    saga: Saga[_Order] = Saga("park_lost", version=1, input=_Order, key=lambda o: o.order_id)

    @saga.step
    def charge(ctx: StepContext, order: _Order) -> _Receipt:
        return _Receipt(receipt_id="r-1")

    @saga.step
    def ship(ctx: StepContext, order: _Order) -> dict[str, Any]:
        return {"receipt": ctx.results["charge"].receipt_id}

    with LostReplyProxy(database_url) as proxy, Orchestrator(proxy.url, sagas=[saga]) as orch:
        saga_id = orch.start(saga, _Order(order_id="o-1")).id
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(
                "UPDATE saga.operations SET status = 'succeeded', attempts = 1,"
                " result = '{\"bogus\": true}' WHERE saga_id = %s AND step = 'charge'",
                (saga_id,),
            )
        proxy.lose_reply("write_saga", "parked for review")
        with structlog.testing.capture_logs() as logs:
            state = orch.run(saga_id)
        seen = [e["event"] for e in logs]
        assert "write_landed" in seen and "lease_lost" not in seen, seen
        assert len(proxy.lost_replies("write_saga")) == 1
        assert state.status == "needs_review"
        assert state.error is not None and "ValidationError" in state.error
        assert [e.event for e in orch.history(saga_id)].count("saga_parked") == 1
