"""The call a session's code makes reaches the planner as a value: the session's planner
runs that call and no other, and the definition it shares with other planners holds none.

Time is an input, so nothing sleeps.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from saga import RetryPolicy
from saga._codefirst import SessionSaga
from saga._core import inputs
from saga._core.planner import Hold, Invoke, Planner, SagaRow, Sleep
from saga.durable import durable_step
from saga.keys import request_hash
from saga.state import OperationStatus, SagaStatus

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
OWNER = "host:1:abcd"


def _charge(order_id: str) -> str:
    return order_id


def _session() -> tuple[SessionSaga, Planner, inputs.CallAsked]:
    definition = SessionSaga(f"calls-{uuid.uuid4().hex[:8]}")
    durable = durable_step(
        name=f"charge-{uuid.uuid4().hex[:12]}",
        retry=RetryPolicy(max_attempts=3, initial_delay=2.0, max_delay=2.0, jitter=0.0),
    )(_charge)
    name = f"{durable.name}.0123456789ab"
    definition.install(name, 0, durable, (("o-1",), {}))
    row = SagaRow(
        id="session-1",
        name=definition.name,
        version=1,
        tenant_id="",
        key="run-1",
        input={},
        input_hash=request_hash({}),
        status=SagaStatus.RUNNING,
        error=None,
        direction="forward",
        fence=1,
        run_after=None,
    )
    asked = inputs.CallAsked(
        step=name,
        position=0,
        idempotency_key="key-1",
        request_hash="hash-1",
        arguments={"args": ["o-1"], "kwargs": {}},
        max_attempts=3,
        key="k",
    )
    return definition, Planner(definition, row, [], now=T0), asked


def _transition(planner: Planner, outcome: inputs.Outcome | None) -> inputs.Transition:
    return inputs.transition(
        planner, outcome, T0, may_call=True, owner=OWNER, max_inline_sleep=60.0
    )


def test_a_session_runs_the_call_its_code_asks_for_and_holds_otherwise() -> None:
    definition, planner, asked = _session()
    assert isinstance(_transition(planner, None).next, Hold)  # no call asked for
    done = _transition(planner, asked)
    assert planner.session_call == asked.step
    assert isinstance(done.next, Invoke) and done.next.op.step == asked.step
    assert [op.step for op in done.write.new_ops] == [asked.step]
    assert not hasattr(definition, "focus")


def test_a_planner_made_afresh_learns_the_call_from_its_outcome() -> None:
    """After a write whose reply was lost, the same outcome is applied to a planner of
    the rows as stored: the call it is about is the one that goes on."""
    definition, planner, asked = _session()
    started = _transition(planner, asked)
    assert isinstance(started.next, Invoke)
    fresh = Planner(definition, planner.saga, planner.ops, now=T0)
    assert fresh.session_call is None
    failed = inputs.Raised(asked.step, "action", "TransientError: busy", "retry", 2.0)
    nxt = _transition(fresh, failed).next
    assert isinstance(nxt, Sleep) and fresh.session_call == asked.step
    assert fresh.op(asked.step, "action").status == OperationStatus.PENDING


def test_planners_sharing_a_definition_do_not_share_a_call() -> None:
    definition, planner, asked = _session()
    _transition(planner, asked)
    other = Planner(definition, planner.saga, planner.ops, now=T0)
    assert other.session_call is None
    assert isinstance(_transition(other, None).next, Hold)
