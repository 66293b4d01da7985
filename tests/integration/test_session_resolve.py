"""`saga resolve ID STEP` on a session: STEP may be the durable step's name when exactly
one call of that step is unsettled; several are listed (exit 2), to be named."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import psycopg
import pytest

from saga import Orchestrator, SessionParked, durable_step
from saga.durable import isolated_steps


def _saga(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "saga", *args],
        env={**os.environ, "SAGA_DATABASE_URL": url},
        capture_output=True,
        text=True,
        timeout=60,
    )


def _parked_session(url: str, orders: tuple[str, ...]) -> tuple[str, str, list[str]]:
    """A session that charged `orders[:-1]` and parked on the charge of the last one,
    whose outcome is unknown; its run id, saga id and calls of cf_charge."""
    with isolated_steps():

        @durable_step(name="cf_charge", key=lambda order_id: order_id)
        def cf_charge(order_id: str) -> dict[str, str]:
            if order_id == orders[-1]:
                raise RuntimeError("the provider answered something unreadable")
            return {"charge_id": f"ch-{order_id}"}

        run_id = f"checkout-{uuid.uuid4()}"
        with Orchestrator(url) as orch:
            with pytest.raises(SessionParked), orch.session(run_id) as run:
                for order in orders:
                    cf_charge(order)
            calls = [op.step for op in orch.get(run.id).operations if op.kind == "action"]
    return run_id, run.id, calls


def test_a_parked_call_is_resolved_by_its_durable_steps_name(database_url: str) -> None:
    _, session_id, calls = _parked_session(database_url, ("o-1", "o-2"))
    resolved = _saga(
        database_url,
        "resolve",
        session_id,
        "cf_charge",
        "--succeeded",
        "--result",
        json.dumps({"charge_id": "ch-o-2"}),
        "--actor",
        "ops@acme",
    )
    assert resolved.returncode == 0, resolved.stderr
    with Orchestrator(database_url) as orch:
        state = orch.get(session_id)
    settled = {op.step: (op.status, op.result) for op in state.operations}
    assert settled == {
        calls[0]: ("succeeded", {"charge_id": "ch-o-1"}),
        calls[1]: ("succeeded", {"charge_id": "ch-o-2"}),
    }


def test_several_unsettled_calls_of_the_step_are_listed_to_be_named(database_url: str) -> None:
    _, session_id, calls = _parked_session(database_url, ("o-1", "o-2"))
    # Calls of one session run one at a time, and the first unknown one parks it: two
    # unsettled calls of one step are made here by marking the first unknown too.
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("UPDATE saga.operations SET status = 'unknown' WHERE step = %s", (calls[0],))
    refused = _saga(
        database_url, "resolve", session_id, "cf_charge", "--failed", "--reason", "none"
    )
    assert refused.returncode == 2, refused.stderr
    assert "2 unsettled calls of durable step 'cf_charge'" in refused.stderr
    assert all(call in refused.stderr for call in calls)
    named = _saga(
        database_url, "resolve", session_id, calls[1], "--failed", "--reason", "not charged"
    )
    assert named.returncode == 0, named.stderr
    assert "no unsettled call" not in named.stderr


def test_a_step_with_no_call_is_refused_naming_the_calls(database_url: str) -> None:
    _, session_id, calls = _parked_session(database_url, ("o-1",))
    refused = _saga(database_url, "resolve", session_id, "cf_refund", "--failed", "--reason", "x")
    assert refused.returncode == 1
    assert f"has no call 'cf_refund'; its calls: {calls[0]}" in refused.stderr
