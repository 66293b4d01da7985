"""A saga app run as a child process by the logging tests.

Run as `python log_app.py MODE RESULT_FILE` with `LOG_APP_DATABASE_URL` set. It prints
`LOG_APP READY`, waits for a line on stdin (the parent closes the read end of stdout
first, like `python app.py | head -1`), then starts and runs one two-step saga and writes
the saga's final status to RESULT_FILE. MODE is how the app sets up its logs:

- `default`: nothing; the library's defaults;
- `structlog_stdout`: `structlog.configure()` with structlog's own logger, on stdout;
- `logging_stdout`: `logging.basicConfig(level=INFO, stream=sys.stdout)`;
- `logging_info`: `logging.basicConfig(level=INFO)` (stderr).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import structlog
from pydantic import BaseModel

from saga import Orchestrator, RetryPolicy, Saga, StepContext, TransientError

ENV_URL = "LOG_APP_DATABASE_URL"


class Job(BaseModel):
    """The input of the logged saga."""

    job_id: str


saga: Saga[Job] = Saga("logged_job", input=Job, key=lambda j: j.job_id)
_flaky_calls = 0


@saga.step(retry=RetryPolicy(max_attempts=3, initial_delay=0.01, max_delay=0.02))
def reserve(ctx: StepContext, job: Job) -> dict[str, bool]:
    """Fails once (a warning-free retry), then succeeds."""
    global _flaky_calls
    _flaky_calls += 1
    if _flaky_calls == 1:
        raise TransientError("try again")
    return {"reserved": True}


@saga.step
def ship(ctx: StepContext, job: Job) -> dict[str, bool]:
    """Succeeds."""
    return {"shipped": True}


def _set_up_logs(mode: str) -> None:
    if mode == "structlog_stdout":
        structlog.configure(processors=[structlog.processors.KeyValueRenderer()])
    elif mode == "logging_stdout":
        logging.basicConfig(level=logging.INFO, stream=sys.stdout)
    elif mode == "logging_info":
        logging.basicConfig(level=logging.INFO)
    elif mode != "default":
        raise SystemExit(f"unknown mode {mode!r}")


def main(mode: str, result_file: str) -> int:
    """Wait for the parent, run one saga, write its final status."""
    _set_up_logs(mode)
    print("LOG_APP READY", flush=True)
    sys.stdin.readline()
    with Orchestrator(os.environ[ENV_URL], sagas=[saga]) as orch:
        handle = orch.start(saga, Job(job_id="j-1"))
        state = orch.run(handle.id)
    Path(result_file).write_text(str(state.status))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
