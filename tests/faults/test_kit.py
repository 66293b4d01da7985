"""saga.testing on the renewal example, as docs/proving-it.md shows it, and its checks biting."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from faults.app import FaultInput
from saga import Orchestrator, Saga, StepContext
from saga.testing import InvariantViolation, check_invariants, crash_test

pytestmark = [pytest.mark.integration, pytest.mark.crash]


def renewal(run: str, **fields: Any) -> dict[str, Any]:
    return {
        "tenant_id": "acme",
        "renewal_event_id": f"evt-{run}",
        "order_id": "o-1",
        "amount_cents": 4990,
        **fields,
    }


def charges(url: str) -> dict[str, int]:
    """Charges and refunds the demo provider holds, per idempotency key."""
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT idempotency_key, count(*) FROM demo_provider.charges GROUP BY 1"
            " UNION ALL SELECT idempotency_key, count(*) FROM demo_provider.refunds GROUP BY 1"
        ).fetchall()
    return {str(k): int(n) for k, n in rows}


# Where a kill parks the renewal for a human: around the call of the pivot
# `create_shipment`, the one step that is neither idempotent nor reconcilable (the carrier
# takes no key). The transaction that records a step's outcome also starts the next step,
# so a kill just after the charge's outcome is committed (`after_record` of `charge`)
# leaves the shipment's attempt in flight too. The warehouse and the gateway dedupe on the
# key and their steps say so: a kill around either is retried (or reconciled) and completes.
PARKED = {
    "after_record:action:charge",
    "before_call:action:create_shipment",
    "after_call:action:create_shipment",
}


def test_renewal_survives_a_kill_at_every_fault_point(database_url: str) -> None:
    """The worked example of docs/proving-it.md: a renewal killed at each of the 4 fault
    points of each of its 3 steps is resumed; it completes, or is parked for a human where
    the step that is neither idempotent nor reconcilable (the shipment) was in flight; no
    charge is ever made twice."""
    report = crash_test(
        app="faults.renewal_app:orch",
        saga="renewal",
        input=renewal,
        database_url=database_url,
        effects=lambda key: charges(database_url).get(key, 0),
    )
    print(report.summary())
    assert report.baseline.status == "completed"
    assert len(report.runs) == 12 and len(report.killed) == 12
    assert set(report.parked) == PARKED
    assert all(
        "is unknown and it is neither idempotent nor has a reconcile hook" in reason
        for reason in report.parked.values()
    )
    assert all(r.status == "completed" for r in report.runs if r.fault not in report.parked)


def test_refused_renewal_survives_a_kill_in_every_compensation(database_url: str) -> None:
    """A renewal the carrier refuses is compensated (refund, then release); killed at each
    fault point of either compensation, it still ends compensated, in reverse order; only a
    kill before the refund's first attempt is committed (which also records the refused
    shipment) leaves the pivot step's outcome unknown, and parks it."""
    report = crash_test(
        app="faults.renewal_app:orch",
        saga="renewal",
        input=lambda run: renewal(run, ship_to="Atlantis"),
        database_url=database_url,
        kinds=("compensation",),
        effects=lambda key: charges(database_url).get(key, 0),
    )
    print(report.summary())
    assert report.baseline.status == "compensated"
    assert len(report.killed) == 8
    assert set(report.parked) == {"before_record:compensation:charge"}
    assert all(r.status == "compensated" for r in report.runs if r.fault not in report.parked)


tampered: Saga[FaultInput] = Saga("tampered", input=FaultInput, key=lambda i: i.key)


@tampered.step
def only(ctx: StepContext, data: FaultInput) -> dict[str, Any]:
    return {"ok": True}


def test_the_checks_catch_a_broken_saga(database_url: str) -> None:
    """check_invariants is not vacuous: a tampered attempt count, a held lease and an
    effect performed twice are each reported."""
    with Orchestrator(database_url, sagas=[tampered]) as orch:
        state = orch.execute(tampered, FaultInput(key="k-1"))
    assert check_invariants(database_url).ok
    key = state.operation("only").idempotency_key
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("UPDATE saga.operations SET attempts = 2")
        conn.execute("UPDATE saga.sagas SET lease_owner = 'ghost'")
    with pytest.raises(InvariantViolation) as caught:
        check_invariants(database_url, effects={key: 2})
    message = str(caught.value)
    assert "history replays to ('succeeded', 1), stored ('succeeded', 2)" in message
    assert "lease still held by ghost" in message
    assert f"effect performed 2 times for key {key}" in message
