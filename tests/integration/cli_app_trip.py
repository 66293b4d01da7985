"""A saga app for the CLI tests of cancel, resolve and the compensation dry run
(`--app cli_app_trip`): a trip whose hotel booking may have an unknown outcome, and whose
compensations write the result they receive to `undone-<step>-<order>.json` in
`CLI_APP_DIR`, so a test can tell what a compensation was given."""

from __future__ import annotations

import json
from typing import Any

from cli_app import QUICK, Job, log_call, state_dir

from saga import Orchestrator, Saga, StepContext

trip = Saga("trip", version=1, input=Job, key=lambda j: j.order_id, tenant=lambda j: j.tenant_id)


def _undone(step: str, job: Job, result: Any) -> None:
    (state_dir() / f"undone-{step}-{job.order_id}.json").write_text(json.dumps(result))


@trip.step
def book_flight(ctx: StepContext, job: Job) -> dict[str, Any]:
    log_call("book_flight", job)
    return {"flight": f"fl_{job.order_id}"}


@book_flight.compensation(idempotent=True)
def cancel_flight(ctx: StepContext, job: Job, result: Any) -> None:
    log_call("cancel_flight", job)
    _undone("book_flight", job, result)


@trip.step(retry=QUICK)
def book_hotel(ctx: StepContext, job: Job) -> Any:
    log_call("book_hotel", job)
    if job.plan == "unknown":
        return {"not", "json"}  # not JSON: the outcome cannot be stored, so it is unknown
    return {"hotel": f"ht_{job.order_id}"}


@book_hotel.compensation(idempotent=True)
def cancel_hotel(ctx: StepContext, job: Job, result: Any) -> None:
    log_call("cancel_hotel", job)
    _undone("book_hotel", job, result)


orch = Orchestrator(sagas=[trip], lease_seconds=1.0)
