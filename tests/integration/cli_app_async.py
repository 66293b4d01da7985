"""cli_app's sagas behind an AsyncOrchestrator (`--app cli_app_async`), with `relay`, a
saga whose steps and reconcile hook are coroutines.

`relay`'s steps log their calls to calls.log as cli_app's do; `fetch` also logs
`fetch-on-loop` when it runs in the main thread: an AsyncWorker awaits it on its event
loop there, where the sync Worker runs every step in a thread of its own. `forward` waits
for a confirmation when the plan is "confirm"; `CLI_APP_BLOCK=hang_after` makes it record
its message at the provider (a file), log `forward-sent`, and hang.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

from cli_app import ENV_BLOCK, LEASE_SECONDS, SAGAS, Job, log_call, state_dir

from saga import Absent, AsyncOrchestrator, Found, Saga, StepContext

relay = Saga("relay", version=1, input=Job, key=lambda j: j.order_id, tenant=lambda j: j.tenant_id)


@relay.step
async def fetch(ctx: StepContext, job: Job) -> dict[str, Any]:
    await asyncio.sleep(0.01)
    log_call("fetch", job)
    if threading.current_thread() is threading.main_thread():
        log_call("fetch-on-loop", job)
    return {"fetched": job.order_id}


@fetch.compensation(idempotent=True)
async def unfetch(ctx: StepContext, job: Job, result: Any) -> None:
    await asyncio.sleep(0)
    log_call("unfetch", job)


@relay.step(confirm=lambda job: job.plan == "confirm")
async def forward(ctx: StepContext, job: Job) -> dict[str, Any]:
    log_call("forward", job)
    (state_dir() / f"forwarded-{job.order_id}").write_text(ctx.idempotency_key)
    if os.environ.get(ENV_BLOCK) == "hang_after":
        log_call("forward-sent", job)
        await asyncio.sleep(3600)
    return {"forwarded": job.order_id}


@forward.reconcile
async def find_forward(ctx: StepContext, job: Job) -> Found | Absent:
    await asyncio.sleep(0)
    log_call("find_forward", job)
    if (state_dir() / f"forwarded-{job.order_id}").exists():
        return Found({"forwarded": job.order_id}, provider_reference=f"fw_{job.order_id}")
    return Absent()


ASYNC_SAGAS = (*SAGAS, relay)
orch = AsyncOrchestrator(sagas=ASYNC_SAGAS, lease_seconds=LEASE_SECONDS)
