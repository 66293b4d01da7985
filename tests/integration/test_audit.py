"""Audit trail and logs: every transition is an event; log lines carry the operation's identity."""

from __future__ import annotations

from collections import Counter

import structlog.testing
from support import FAST, OrchestratorFactory, Order, count_rows, events, order_saga

from saga import StepContext, TransientError


def test_every_transition_is_appended_to_the_audit_trail(
    make_orch: OrchestratorFactory, database_url: str
) -> None:
    """Each attempt, failure, success and the saga's end are events; none is ever removed."""
    saga = order_saga("audited")

    @saga.step
    def reserve(ctx: StepContext, o: Order) -> dict:
        return {"sku": "x"}

    @saga.step(retry=FAST)
    def charge(ctx: StepContext, o: Order) -> dict:
        if ctx.attempt == 1:
            raise TransientError("timeout")
        return {"charged": True}

    orch = make_orch(saga)
    saga_id = orch.start(saga, Order(order_id="o-1")).id
    after_start = count_rows(database_url, "events", saga_id)
    assert after_start == len(orch.history(saga_id)) == 1

    # Starting again is idempotent and records nothing new.
    orch.start(saga, Order(order_id="o-1"))
    assert count_rows(database_url, "events", saga_id) == after_start

    first_history = orch.history(saga_id)
    orch.run(saga_id)
    history = orch.history(saga_id)

    assert count_rows(database_url, "events", saga_id) == len(history)
    # Append-only: the earlier trail is a prefix of the later one.
    assert history[: len(first_history)] == first_history
    counts = Counter(events(history))
    assert counts["saga_started"] == 1
    assert counts["attempt_started"] == 3
    assert counts["attempt_failed"] == 1
    assert counts["attempt_succeeded"] == 2
    assert counts["saga_completed"] == 1
    attempts = [(e.step, e.attempt) for e in history if e.event == "attempt_started"]
    assert attempts == [("reserve", 1), ("charge", 1), ("charge", 2)]
    failed = next(e for e in history if e.event == "attempt_failed")
    assert "timeout" in str(failed.detail.get("error"))


def test_log_lines_carry_saga_step_attempt_and_key(make_orch: OrchestratorFactory) -> None:
    """Library log lines and ctx.log lines are bound to saga_id, step, attempt and key."""
    saga = order_saga("logged")

    @saga.step
    def charge(ctx: StepContext, o: Order) -> dict:
        ctx.log.info("charging_card", amount_cents=o.amount_cents)
        return {"charged": True}

    orch = make_orch(saga)
    saga_id = orch.start(saga, Order(order_id="o-1")).id
    key = "logged:v1:acme:o-1:charge"

    with structlog.testing.capture_logs() as logs:
        orch.run(saga_id)

    from_step = [e for e in logs if e.get("event") == "charging_card"]
    assert len(from_step) == 1
    assert from_step[0]["saga_id"] == saga_id
    assert from_step[0]["step"] == "charge"
    assert from_step[0]["attempt"] == 1
    assert from_step[0]["idempotency_key"] == key
    assert from_step[0]["amount_cents"] == 100

    from_library = [
        e for e in logs if e.get("event") != "charging_card" and e.get("step") == "charge"
    ]
    assert from_library, f"no library log line about step 'charge': {logs}"
    for entry in from_library:
        assert entry["saga_id"] == saga_id
    assert any(e.get("attempt") == 1 and e.get("idempotency_key") == key for e in from_library), (
        from_library
    )
