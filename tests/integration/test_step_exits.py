"""One step never takes a worker down: a step raising `SystemExit` or `KeyboardInterrupt`
(a library calling `sys.exit()`, an interrupt raised by code rather than by a signal)
leaves its attempt unknown, parked with the reason, while the worker process drives the
other sagas on and stops only when signalled."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import exits_app
import pytest
from exits_app import Job
from support import wait_until

from saga import AsyncOrchestrator, Orchestrator, SagaState, durable_step

pytestmark = [pytest.mark.integration]

APP = Path(exits_app.__file__).resolve()
SETTLED = ("completed", "needs_review")


class _WorkerChild:
    """`exits_app.py DOOR` as a child process; its output goes to a file."""

    def __init__(self, url: str, door: str, log: Path) -> None:
        self.log = log
        self._out = log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, str(APP), door],
            env={**os.environ, exits_app.ENV_URL: url},
            stdout=self._out,
            stderr=subprocess.STDOUT,
        )

    def output(self) -> str:
        self._out.flush()
        return self.log.read_text(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self._out.close()


@pytest.mark.parametrize("door", ["async", "sync"])
def test_a_step_raising_system_exit_or_keyboard_interrupt_leaves_the_worker_running(
    database_url: str, tmp_path: Path, door: str
) -> None:
    """Three healthy sagas and four misbehaving ones (SystemExit and KeyboardInterrupt, from
    an async step and from a plain one) in one worker process: each misbehaving attempt is
    unknown and its saga parked with a reason naming the exception, the healthy ones
    complete, and the worker still runs: it completes a saga started afterwards and exits
    0 on SIGTERM. (The asyncio worker used to die with the first SystemExit, leaving the
    healthy sagas pending or running.)"""
    sagas = {s.name: s for s in exits_app.ALL_SAGAS}
    with Orchestrator(database_url, sagas=exits_app.ALL_SAGAS) as orch:
        bad = {
            (name, how): orch.start(sagas[name], Job(job_id=f"{name}-{how}", how=how)).id
            for name in sagas
            for how in ("exit", "interrupt")
        }
        healthy = [
            orch.start(
                sagas["exits_async" if i % 2 else "exits_sync"], Job(job_id=f"ok-{i}", delay=0.5)
            ).id
            for i in range(3)
        ]
        child = _WorkerChild(database_url, door, tmp_path / "worker.log")
        try:

            def states() -> list[SagaState] | None:
                found = [orch.get(i) for i in [*bad.values(), *healthy]]
                if child.proc.poll() is not None:
                    return found  # it exited: look no further
                return found if all(s.status in SETTLED for s in found) else None

            wait_until(states, timeout=60)
            assert child.proc.poll() is None, (
                f"the worker exited with {child.proc.returncode}:\n{child.output()}"
            )
            assert [orch.get(i).status for i in healthy] == ["completed"] * 3
            for (name, how), saga_id in bad.items():
                state = orch.get(saga_id)
                assert state.status == "needs_review", (name, how, state)
                (op,) = state.operations
                assert (op.status, op.attempts) == ("unknown", 1), (name, how, op)
                named = (
                    f"SystemExit: {exits_app.EXIT_MESSAGE}"
                    if how == "exit"
                    else f"KeyboardInterrupt: {exits_app.INTERRUPT_MESSAGE}"
                )
                assert op.error is not None and named in op.error, (name, how, op.error)
                assert state.error is not None and named in state.error, (name, how, state.error)

            # Still claiming: a saga started now is driven to its end by the same process.
            late = orch.start(sagas["exits_async"], Job(job_id="late")).id
            wait_until(lambda: orch.get(late).status == "completed", timeout=30)
            assert child.proc.poll() is None, child.output()

            child.proc.send_signal(signal.SIGTERM)
            assert child.proc.wait(timeout=30) == 0, child.output()
            assert "EXITS_APP STOPPED" in child.output()
        finally:
            child.close()


def _only_session(orch: Orchestrator, key: str) -> SagaState:
    (state,) = [s for s in orch.list(limit=10) if s.key == key]
    return state


def test_a_session_call_raising_system_exit_is_recorded_unknown_and_exits_the_caller(
    database_url: str,
) -> None:
    """In a session the call's SystemExit goes on through the caller's code as raised (the
    process is the caller's), once the call is recorded unknown with the reason and the
    session parked; it used to stay `running`, saying nothing of what happened."""

    @durable_step(name="leave", key=lambda order: order)
    def leave(order: str) -> dict[str, str]:
        sys.exit(exits_app.EXIT_MESSAGE)

    with Orchestrator(database_url) as orch:
        with (
            pytest.raises(SystemExit, match=re.escape(exits_app.EXIT_MESSAGE)),
            orch.session("exits-sync"),
        ):
            leave("o-1")
        state = _only_session(orch, "exits-sync")
    assert state.status == "needs_review", state
    (op,) = state.operations
    assert op.status == "unknown" and op.error is not None
    assert f"SystemExit: {exits_app.EXIT_MESSAGE}" in op.error, op.error


@pytest.mark.parametrize("raised", [SystemExit, KeyboardInterrupt])
def test_an_async_session_call_raising_a_base_exception_is_recorded_unknown(
    database_url: str, raised: type[BaseException]
) -> None:
    """The same in the asyncio door, for KeyboardInterrupt too (raised by the code, on a
    loop that handles the real signal itself)."""

    @durable_step(name="stop_here", key=lambda order: order)
    async def stop_here(order: str) -> dict[str, str]:
        raise raised("raised by the call")

    async def main() -> None:
        async with AsyncOrchestrator(database_url) as orch, orch.session("exits-async"):
            await stop_here("o-1")

    with pytest.raises(raised, match="raised by the call"):
        asyncio.run(main())
    with Orchestrator(database_url) as orch:
        state = _only_session(orch, "exits-async")
    assert state.status == "needs_review", state
    (op,) = state.operations
    assert op.status == "unknown" and op.error is not None
    assert f"{raised.__name__}: raised by the call" in op.error, op.error
