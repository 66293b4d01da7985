"""A saga app with two versions of `signup`, for the tests of upgrading sagas in flight
(`--app upgrade_app`).

Version 1 runs `account` (compensated by `close_account`), then `mail`, whose outcome is
lost while the input's `plan` is "broken" (it returns what cannot be stored): the saga
parks with `mail` unknown, and version 1 cannot retry it (not idempotent). Version 2
renames `account` to `create_account` (same effect, same compensation), declares `mail`
idempotent (the mail server dedupes by key), and adds `trial` after it. Each call appends
`name order_id pid` to calls.log in CLI_APP_DIR (see cli_app.log_call).
"""

from __future__ import annotations

from typing import Any

from cli_app import Job, log_call

from saga import AsyncOrchestrator, Orchestrator, Saga, StepContext


def _signup(version: int) -> Saga[Job]:
    return Saga(
        "signup",
        version=version,
        input=Job,
        key=lambda j: j.order_id,
        tenant=lambda j: j.tenant_id,
    )


signup_v1 = _signup(1)


@signup_v1.step
def account(ctx: StepContext, job: Job) -> dict[str, Any]:
    log_call("v1:account", job)
    return {"account_id": f"acc-{job.order_id}"}


@account.compensation
def close_account(ctx: StepContext, job: Job, result: Any) -> None:
    log_call("v1:close_account", job)


@signup_v1.step(name="mail")
def mail_v1(ctx: StepContext, job: Job) -> Any:
    log_call("v1:mail", job)
    if job.plan == "broken":
        return {"not", "json"}  # cannot be stored: the outcome is unknown
    return {"sent": True}


signup_v2 = _signup(2)


@signup_v2.step
def create_account(ctx: StepContext, job: Job) -> dict[str, Any]:
    log_call("v2:create_account", job)
    return {"account_id": f"acc-{job.order_id}"}


@create_account.compensation
def close_account_v2(ctx: StepContext, job: Job, result: Any) -> None:
    log_call("v2:close_account", job)


@signup_v2.step(name="mail", idempotent=True)
def mail_v2(ctx: StepContext, job: Job) -> dict[str, Any]:
    log_call(f"v2:mail:{ctx.idempotency_key}", job)
    return {"sent": True}


@signup_v2.step
def trial(ctx: StepContext, job: Job) -> dict[str, Any]:
    log_call("v2:trial", job)
    return {"days": 14}


# The release that upgrades: both versions registered.
orch = Orchestrator(sagas=[signup_v1, signup_v2], lease_seconds=1.0)
# The app of the release after: version 1 no longer registered (`saga versions` gates it).
only_v2 = Orchestrator(sagas=[signup_v2], lease_seconds=1.0)
# The same release behind an AsyncOrchestrator (`--app upgrade_app:aorch`).
aorch = AsyncOrchestrator(sagas=[signup_v1, signup_v2], lease_seconds=1.0)
