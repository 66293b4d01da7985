"""A lease is a liveness signal: a process killed while it waits out a backoff in-process
blocks nobody beyond `lease_seconds`, and `run(id, wait_seconds=...)` takes its saga over."""

from __future__ import annotations

import signal
import threading
import time

import crash_app
import psycopg
import pytest
from support import ChildApp, OrchestratorFactory, scalar, wait_until

from saga import Orchestrator, SagaState, StepStateError

pytestmark = pytest.mark.crash

# Far longer than the 1-second lease, far shorter than the long backoff: a bound that only
# a lease stretched to the backoff's end can miss (seconds).
WELL_PAST_THE_LEASE = 30.0


def _in_backoff(url: str, children: list[ChildApp], saga: str, order_id: str) -> str:
    """Start `saga` in a child and return once its charge failed and the child waits out
    the backoff in-process, the failure committed."""
    child = ChildApp(url, saga, order_id)
    children.append(child)
    saga_id = child.expect("STARTED").split()[1]
    child.expect("FAILING")

    def waiting() -> bool:
        status, attempts, next_at = _charge_row(url, saga_id)
        return status == "pending" and attempts == 1 and next_at is not None

    wait_until(waiting, timeout=20)
    return saga_id


def _charge_row(url: str, saga_id: str) -> tuple[str, int, object]:
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT status, attempts, next_attempt_at FROM saga.operations"
            " WHERE saga_id = %s::uuid AND step = 'charge' AND kind = 'action'",
            (saga_id,),
        ).fetchone()
    assert row is not None
    return str(row[0]), int(row[1]), row[2]


def _charge_calls(url: str) -> list[int]:
    with psycopg.connect(url) as conn:
        rows = conn.execute("SELECT attempt FROM step_calls WHERE step = 'charge' ORDER BY id")
        return [int(r[0]) for r in rows.fetchall()]


def _kill(child: ChildApp) -> None:
    child.signal(signal.SIGKILL)
    assert child.wait() == -signal.SIGKILL


def _try_cancel(orch: Orchestrator, saga_id: str) -> SagaState | None:
    try:
        return orch.cancel(saga_id, reason="customer asked", actor="ops")
    except StepStateError as exc:
        assert "leased by" in str(exc) or "busy" in str(exc), exc
        return None


def test_cancel_is_not_blocked_by_a_dead_owner_for_its_backoff(
    make_orch: OrchestratorFactory, app_url: str, children: list[ChildApp]
) -> None:
    """Killed during a 600 s in-process backoff: the dead owner's lease ends within about
    lease_seconds, so cancel goes through long before the backoff ends; no worker starts
    the charge early meanwhile, and the saga compensates without calling it again."""
    saga_id = _in_backoff(app_url, children, crash_app.LONG_BACKOFF.name, "o-long")
    orch = make_orch(*crash_app.ALL_SAGAS)
    child = children[-1]
    backoff_ends = _charge_row(app_url, saga_id)[2]
    _kill(child)

    state = wait_until(
        lambda: _try_cancel(orch, saga_id), timeout=WELL_PAST_THE_LEASE, interval=0.2
    )

    assert state.status == "compensating"
    assert scalar(app_url, "SELECT now() < %s", (backoff_ends,))
    assert orch.run(saga_id).status == "compensated"
    assert _charge_calls(app_url) == [1]


def test_a_live_owner_keeps_its_saga_through_the_backoff_and_run_waits_for_a_dead_one(
    make_orch: OrchestratorFactory, app_url: str, children: list[ChildApp]
) -> None:
    """While the child waits out a 10 s backoff its lease is renewed by heartbeat (still
    live after several lease lengths), so run() here takes nothing over. Once the child is
    killed, run(id, wait_seconds=...) waits for its lease to end (not for the backoff's
    end), claims the saga and drives it to completion with the second attempt."""
    saga_id = _in_backoff(app_url, children, crash_app.BACKOFF.name, "o-wait")
    backoff_ends = _charge_row(app_url, saga_id)[2]
    orch = make_orch(*crash_app.ALL_SAGAS)
    child = children[-1]
    # A worker here meanwhile, for several lease lengths, finds nothing it may claim.
    worker = orch.worker(concurrency=1, poll_seconds=0.1)
    thread = threading.Thread(target=worker.run, kwargs={"handle_signals": False})
    thread.start()
    time.sleep(3 * crash_app.LEASE_SECONDS)
    worker.stop()
    thread.join(timeout=30)

    held = orch.run(saga_id)
    assert held.status == "running"
    assert held.lease_owner is not None and held.lease_owner != orch.owner
    assert held.lease_expires_at is not None
    assert _charge_calls(app_url) == [1]
    _kill(child)

    state = orch.run(saga_id, wait_seconds=WELL_PAST_THE_LEASE)

    assert state.status == "completed", state.error
    assert _charge_calls(app_url) == [1, 2]
    taken = scalar(
        app_url,
        "SELECT min(at) FROM saga.events WHERE saga_id = %s::uuid"
        " AND event = 'lease_acquired' AND detail->>'owner' = %s",
        (saga_id, orch.owner),
    )
    # Taken over while the backoff still ran: the dead owner's lease was not stretched.
    assert taken < backoff_ends


def test_run_wait_seconds_returns_the_holders_state_when_the_wait_runs_out(
    make_orch: OrchestratorFactory, app_url: str, children: list[ChildApp]
) -> None:
    """A live holder that outlasts wait_seconds: run returns the current state, its
    lease_owner and lease_expires_at saying who holds it, having called nothing."""
    saga_id = _in_backoff(app_url, children, crash_app.LONG_BACKOFF.name, "o-held")
    orch = make_orch(*crash_app.ALL_SAGAS)

    state = orch.run(saga_id, wait_seconds=2 * crash_app.LEASE_SECONDS)

    assert state.status == "running"
    assert state.lease_owner is not None and state.lease_owner != orch.owner
    assert _charge_calls(app_url) == [1]
    with pytest.raises(ValueError, match="wait_seconds"):
        orch.run(saga_id, wait_seconds=-1.0)
