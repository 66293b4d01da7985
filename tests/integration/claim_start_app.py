"""A worker run as a child process by the claim-and-start crash test, and imported by it.

Run as `python claim_start_app.py` with `CLAIM_START_APP_DATABASE_URL` set (and usually
`SAGA_FAULT`): it drives the sagas of `SAGAS` with one worker of 4 drivers under a 1-second
lease, owner `doomed`, until none is open. Every step call is recorded in the table
`step_calls` of that database (`create_tables`), with the process that made it. The parent
imports this module to register the very same definitions.
"""

from __future__ import annotations

import os
from typing import Any

import psycopg
from pydantic import BaseModel

from saga import Orchestrator, Saga, StepContext

ENV_URL = "CLAIM_START_APP_DATABASE_URL"
LEASE_SECONDS = 1.0


class Job(BaseModel):
    """Input of the sagas here."""

    job_id: str


def create_tables(url: str) -> None:
    """The log of every step call, in the test database."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE step_calls (id bigserial, job_id text, step text, attempt int, pid int)"
        )


def _record(ctx: StepContext, job: Job) -> dict[str, Any]:
    with psycopg.connect(os.environ[ENV_URL], autocommit=True) as conn:
        conn.execute(
            "INSERT INTO step_calls (job_id, step, attempt, pid) VALUES (%s, %s, %s, %s)",
            (job.job_id, ctx.step, ctx.attempt, os.getpid()),
        )
    return {"step": ctx.step}


def _saga(name: str, *, idempotent: bool) -> Saga[Job]:
    saga = Saga(name, version=1, input=Job, key=lambda j: j.job_id)
    saga.step(name="first", idempotent=idempotent)(_record)
    saga.step(name="second", idempotent=idempotent)(_record)
    return saga


# Retried with the same key once its attempt's outcome is unknown; parked then.
IDEMPOTENT = _saga("cs_idempotent", idempotent=True)
PLAIN = _saga("cs_plain", idempotent=False)
SAGAS = [IDEMPOTENT, PLAIN]


def main() -> None:
    with Orchestrator(
        os.environ[ENV_URL], sagas=SAGAS, lease_seconds=LEASE_SECONDS, owner="doomed"
    ) as orch:
        orch.worker(concurrency=4, poll_seconds=0.1).run(until_idle=True)


if __name__ == "__main__":
    main()
