"""A saga app the `saga` command loads in the CLI tests (`--app cli_app`).

Every call of a step, compensation or reconcile hook appends `name order_id pid` to
`calls.log` in `CLI_APP_DIR`, so a test can tell which process ran what. The saga
input's `plan` steers the `shop` saga; `CLI_APP_BLOCK` steers the `pack` step of the
`parcel` saga in this process only:

- `gate`: log `pack-waiting`, then wait for the file `gate` in `CLI_APP_DIR`;
- `hang_after`: record the parcel at the provider (a file), log `pack-packed`, hang.

The tests import this module too, to start sagas with the very same definitions.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from saga import (
    Absent,
    Ceilings,
    Found,
    Orchestrator,
    PermanentError,
    RetryPolicy,
    Saga,
    StepContext,
    TransientError,
)

ENV_DIR = "CLI_APP_DIR"
ENV_BLOCK = "CLI_APP_BLOCK"
LEASE_SECONDS = 1.0
QUICK = RetryPolicy(max_attempts=2, initial_delay=0.01, max_delay=0.02)


class Job(BaseModel):
    """Input of the test sagas: `plan` is "ok", "unknown" (charge's outcome is lost) or
    "broken_notify" (notify fails until the file `fixed` exists)."""

    order_id: str
    tenant_id: str = "acme"
    plan: str = "ok"


def state_dir() -> Path:
    """The directory shared by the test and the command's process."""
    return Path(os.environ[ENV_DIR])


def log_call(name: str, job: Job) -> None:
    """Append one line to calls.log (O_APPEND: lines of several processes never mix)."""
    with open(state_dir() / "calls.log", "a", encoding="utf-8") as out:
        out.write(f"{name} {job.order_id} {os.getpid()}\n")


def calls() -> list[tuple[str, str, int]]:
    """(name, order_id, pid) of every call so far, in order."""
    path = state_dir() / "calls.log"
    if not path.exists():
        return []
    rows = [line.split() for line in path.read_text(encoding="utf-8").splitlines()]
    return [(name, order, int(pid)) for name, order, pid in rows]


def _saga(name: str) -> Saga[Job]:
    return Saga(name, version=1, input=Job, key=lambda j: j.order_id, tenant=lambda j: j.tenant_id)


shop = _saga("shop")


@shop.step
def reserve(ctx: StepContext, job: Job) -> dict[str, Any]:
    log_call("reserve", job)
    return {"sku": f"sku-{job.order_id}"}


@reserve.compensation(idempotent=True)
def release(ctx: StepContext, job: Job, result: Any) -> None:
    log_call("release", job)


@shop.step(retry=QUICK)
def charge(ctx: StepContext, job: Job) -> Any:
    log_call("charge", job)
    if job.plan == "unknown":
        return {"not", "json"}  # not JSON: the outcome cannot be stored, so it is unknown
    return {"charge_id": f"ch_{job.order_id}"}


@charge.compensation(idempotent=True)
def refund(ctx: StepContext, job: Job, result: Any) -> None:
    log_call("refund", job)


@shop.step(pivot=True)
def ship(ctx: StepContext, job: Job) -> dict[str, Any]:
    log_call("ship", job)
    return {"shipment": f"sh_{job.order_id}"}


@shop.step(retry=RetryPolicy(max_attempts=1))
def notify(ctx: StepContext, job: Job) -> dict[str, Any]:
    log_call("notify", job)
    if job.plan == "broken_notify" and not (state_dir() / "fixed").exists():
        raise PermanentError("mail relay rejected the message")
    return {"sent": True}


parcel = _saga("parcel")


@parcel.step
def label(ctx: StepContext, job: Job) -> dict[str, Any]:
    log_call("label", job)
    return {"label": job.order_id}


@parcel.step(retry=QUICK)
def pack(ctx: StepContext, job: Job) -> dict[str, Any]:
    log_call("pack", job)
    block = os.environ.get(ENV_BLOCK)
    if block == "gate":
        log_call("pack-waiting", job)
        while not (state_dir() / "gate").exists():
            time.sleep(0.02)
    (state_dir() / f"packed-{job.order_id}").write_text(ctx.idempotency_key)
    if block == "hang_after":
        log_call("pack-packed", job)
        while True:
            time.sleep(60)
    return {"parcel": f"p_{job.order_id}"}


@pack.reconcile
def find_parcel(ctx: StepContext, job: Job) -> Found | Absent:
    log_call("find_parcel", job)
    if (state_dir() / f"packed-{job.order_id}").exists():
        return Found({"parcel": f"p_{job.order_id}"}, provider_reference=f"p_{job.order_id}")
    return Absent()


@parcel.step
def dispatch(ctx: StepContext, job: Job) -> dict[str, Any]:
    log_call("dispatch", job)
    return {"dispatched": True}


# A step that is neither idempotent nor reconcilable: a crash in it needs a human.
fragile = _saga("fragile")


@fragile.step
def post_letter(ctx: StepContext, job: Job) -> dict[str, Any]:
    log_call("post_letter", job)
    if os.environ.get(ENV_BLOCK) == "hang_after":
        log_call("post_letter-posted", job)
        while True:
            time.sleep(60)
    return {"posted": True}


# A refund an operator must approve when it is large; capped in operations.
refund_saga = Saga(
    "refund",
    version=1,
    input=Job,
    key=lambda j: j.order_id,
    tenant=lambda j: j.tenant_id,
    ceilings=Ceilings(max_operations=1),
)


@refund_saga.step(confirm=lambda job: job.plan == "large")
def pay_back(ctx: StepContext, job: Job) -> dict[str, Any]:
    log_call("pay_back", job)
    return {"refunded": True}


@refund_saga.step
def receipt(ctx: StepContext, job: Job) -> dict[str, Any]:
    log_call("receipt", job)
    return {"sent": True}


# A refund provider that is down until the file `refunds_up` exists in CLI_APP_DIR.
billing = _saga("billing")


@billing.step
def hold(ctx: StepContext, job: Job) -> dict[str, Any]:
    log_call("hold", job)
    return {"hold": job.order_id}


@hold.compensation(retry=QUICK, idempotent=True)
def unhold(ctx: StepContext, job: Job, result: Any) -> None:
    log_call("unhold", job)


@billing.step
def bill(ctx: StepContext, job: Job) -> dict[str, Any]:
    log_call("bill", job)
    return {"bill": job.order_id}


@bill.compensation(retry=QUICK, idempotent=True)
def refund_bill(ctx: StepContext, job: Job, result: Any) -> None:
    log_call("refund_bill", job)
    if not (state_dir() / "refunds_up").exists():
        raise TransientError("refund provider is down")


@billing.step
def deliver(ctx: StepContext, job: Job) -> dict[str, Any]:
    log_call("deliver", job)
    raise PermanentError("no courier")


SAGAS = (shop, parcel, fragile, refund_saga, billing)
orch = Orchestrator(sagas=SAGAS, lease_seconds=LEASE_SECONDS)
