"""Row locks never outlive a frozen holder, and operator verbs never wait without bound."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import frozen_app
import psycopg
import pytest
from support import OrchestratorFactory, Order, order_saga, scalar

from saga import SagaState, StepContext, StepStateError

HERE = Path(__file__).resolve().parent


def _bounded(call: Callable[[], SagaState], *, timeout: float = 60.0) -> SagaState:
    """`call()` in a thread; fails when it has not returned within `timeout` seconds (it
    would block for as long as the lock's holder lives)."""
    outcome: list[SagaState] = []
    failure: list[BaseException] = []

    def target() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"still waiting after {timeout}s for the saga's row lock"
    if failure:
        raise failure[0]
    return outcome[0]


class _Frozen:
    """A `frozen_app.py` child whose lines are read with deadlines."""

    def __init__(self, url: str, order_id: str) -> None:
        env = {**os.environ, frozen_app.ENV_URL: url, frozen_app.ENV_BLOCK: "1"}
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "frozen_app.py"), order_id],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.output: list[str] = []

    def expect(self, prefix: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # the child prints its lines promptly, or dies
            self.output.append(line)
            if line.startswith(f"FROZEN_APP {prefix}"):
                return line.strip()
        raise AssertionError(f"child exited before {prefix!r}:\n{''.join(self.output)}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(timeout=30)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@pytest.fixture
def frozen() -> Iterator[list[_Frozen]]:
    started: list[_Frozen] = []
    yield started
    for child in started:
        child.kill()


def _row_locked(url: str, saga_id: str) -> bool:
    with psycopg.connect(url) as conn:
        try:
            conn.execute("SELECT 1 FROM saga.sagas WHERE id = %s FOR UPDATE NOWAIT", (saga_id,))
        except psycopg.errors.LockNotAvailable:
            return True
    return False


@pytest.mark.crash
@pytest.mark.parametrize("through", ["direct", "pgbouncer"])
def test_a_worker_frozen_in_a_cost_function_does_not_block_cancel(
    make_orch: OrchestratorFactory,
    database_url: str,
    frozen: list[_Frozen],
    through: str,
    request: pytest.FixtureRequest,
) -> None:
    """A child process is frozen (SIGSTOP) inside a cost function while its claim holds the
    saga row locked. `cancel()` returns within a bounded time (the server ends the frozen
    transaction once it has idled a lease), and after SIGKILL nothing of the frozen claim
    is left: no attempt, no lease event. Behind PgBouncer in transaction mode too, where
    the timeout is the claim transaction's own (`SET LOCAL`), not its connection's."""
    url = database_url if through == "direct" else str(request.getfixturevalue("pooled_url"))
    child = _Frozen(url, "o-1")
    frozen.append(child)
    saga_id = child.expect("STARTED").split()[2]
    child.expect("IN_COST")
    child.proc.send_signal(signal.SIGSTOP)
    assert _row_locked(database_url, saga_id)  # the claim's transaction holds the row

    orch = make_orch(frozen_app.SAGA, lease_seconds=1.0)
    try:
        state = _bounded(lambda: orch.cancel(saga_id, reason="frozen", actor="ops"))
    except StepStateError as exc:  # busy: the lock timeout came first; try again
        assert "busy" in str(exc)
        state = _bounded(lambda: orch.cancel(saga_id, reason="frozen", actor="ops"))
    assert state.status == "compensating"
    assert not _row_locked(database_url, saga_id)

    child.kill()
    done = orch.run(saga_id)
    assert done.status == "compensated"
    assert [(op.status, op.attempts) for op in done.operations] == [("pending", 0)]
    history = [e.event for e in orch.history(saga_id)]
    assert "attempt_started" not in history
    assert history.count("lease_acquired") == 1  # the parent's run, never the child's claim
    assert history[:2] == ["saga_started", "cancel_requested"]


def test_an_operator_verb_on_a_locked_saga_says_it_is_busy(
    make_orch: OrchestratorFactory,
) -> None:
    """While another transaction holds the saga row (longer than a lease), an operator verb
    gives up after the lock timeout with a clear "busy, try again" error, writing nothing."""
    saga = order_saga("locked")

    @saga.step
    def only(ctx: StepContext, order: Order) -> dict[str, Any]:
        return {}

    orch = make_orch(saga, lease_seconds=0.5)
    saga_id = orch.start(saga, Order(order_id="o-1")).id
    with psycopg.connect(orch.database_url) as holder:
        # Never idle in its transaction (it is waiting on the server), so only the lock
        # timeout ends the operator's wait.
        holder.execute("SELECT 1 FROM saga.sagas WHERE id = %s FOR UPDATE", (saga_id,))
        with pytest.raises(StepStateError, match=f"saga {saga_id} is busy: .*try again"):
            _bounded(lambda: orch.cancel(saga_id, reason="now", actor="ops"))
        holder.rollback()
    assert orch.get(saga_id).status == "pending"
    assert (
        scalar(orch.database_url, "SELECT count(*) FROM saga.events WHERE saga_id = %s", (saga_id,))
        == 1
    )
    assert orch.cancel(saga_id, reason="now", actor="ops").status == "compensating"
