"""A worker process whose sagas' steps may raise `SystemExit` or `KeyboardInterrupt`.

Run as `python exits_app.py sync|async` with `EXITS_APP_DATABASE_URL` set: it runs a
`Worker` (sync) or an `AsyncWorker` (async) over the sagas below until SIGTERM, printing
`EXITS_APP READY` once it has started and `EXITS_APP STOPPED` when `run` returned. The
parent imports this module to start the same sagas.

Each saga has one step, async (`exits_async`) or plain (`exits_sync`); the input's `how`
says what it does: `ok` returns after `delay` seconds, `exit` calls `sys.exit()` (as a
library might), `interrupt` raises `KeyboardInterrupt` (no signal is involved).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from typing import Any, Literal

from pydantic import BaseModel

from saga import AsyncOrchestrator, Orchestrator, Saga, StepContext

ENV_URL = "EXITS_APP_DATABASE_URL"
EXIT_MESSAGE = "a library called sys.exit()"
INTERRUPT_MESSAGE = "raised by the step, not by a signal"


class Job(BaseModel):
    """Input of the sagas: what the step does."""

    job_id: str
    how: Literal["ok", "exit", "interrupt"] = "ok"
    delay: float = 0.0


def _misbehave(job: Job) -> None:
    if job.how == "exit":
        sys.exit(EXIT_MESSAGE)
    if job.how == "interrupt":
        raise KeyboardInterrupt(INTERRUPT_MESSAGE)


exits_async: Saga[Job] = Saga("exits_async", version=1, input=Job, key=lambda j: j.job_id)
exits_sync: Saga[Job] = Saga("exits_sync", version=1, input=Job, key=lambda j: j.job_id)


@exits_async.step
async def work_async(ctx: StepContext, job: Job) -> dict[str, Any]:
    await asyncio.sleep(job.delay)
    _misbehave(job)
    return {"done": job.job_id}


@exits_sync.step
def work_sync(ctx: StepContext, job: Job) -> dict[str, Any]:
    time.sleep(job.delay)
    _misbehave(job)
    return {"done": job.job_id}


ALL_SAGAS = (exits_async, exits_sync)
WORKER_SETTINGS: dict[str, Any] = {
    "concurrency": 8,
    "poll_seconds": 0.2,
    "grace_seconds": 2.0,
}


def _say(line: str) -> None:
    print(f"EXITS_APP {line}", flush=True)


async def _run_async(url: str) -> None:
    async with AsyncOrchestrator(url, sagas=ALL_SAGAS, lease_seconds=2.0) as orch:
        worker = orch.worker(**WORKER_SETTINGS)
        _say("READY")
        await worker.run(handle_signals=True)


def main(argv: list[str]) -> int:
    (door,) = argv
    url = os.environ[ENV_URL]
    if door == "async":
        asyncio.run(_run_async(url))
    else:
        with Orchestrator(url, sagas=ALL_SAGAS, lease_seconds=2.0) as orch:
            worker = orch.worker(**WORKER_SETTINGS)
            _say("READY")
            worker.run(handle_signals=True)
    _say("STOPPED")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
