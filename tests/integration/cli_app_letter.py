"""A second saga app for the CLI tests (`--app cli_app_letter`): a saga whose last step has
no compensation, so an unknown outcome there cannot be compensated past."""

from __future__ import annotations

from typing import Any

from cli_app import QUICK, Job, log_call

from saga import Orchestrator, Saga, StepContext

letter = Saga(
    "letter", version=1, input=Job, key=lambda j: j.order_id, tenant=lambda j: j.tenant_id
)


@letter.step
def book(ctx: StepContext, job: Job) -> dict[str, Any]:
    log_call("book", job)
    return {"booking": job.order_id}


@book.compensation(idempotent=True)
def unbook(ctx: StepContext, job: Job, result: Any) -> None:
    log_call("unbook", job)


@letter.step(retry=QUICK)
def post(ctx: StepContext, job: Job) -> Any:
    log_call("post", job)
    if job.plan == "unknown":
        return {"not", "json"}  # not JSON: the outcome cannot be stored, so it is unknown
    return {"posted": True}


orch = Orchestrator(sagas=[letter], lease_seconds=1.0)
