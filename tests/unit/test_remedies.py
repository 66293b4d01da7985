"""The command lines a parked saga's screens and messages name (`saga.remedies`), for
each way a saga parks."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from saga.remedies import parked_commands, resolve_commands
from saga.state import OperationState, SagaState

ID = "0f8c2d4e-0000-4000-8000-000000000001"
NOW = datetime(2026, 12, 6, tzinfo=UTC)


def _op(step: str, status: str, kind: str = "action") -> dict[str, Any]:
    return {
        "step": step,
        "kind": kind,
        "status": status,
        "attempts": 1,
        "max_attempts": 3,
        "idempotency_key": f"k:{step}:{kind}",
        "request_hash": "h",
    }


def _parked(*ops: dict[str, Any], status: str = "needs_review") -> SagaState:
    return SagaState(
        id=ID,
        saga="trip",
        version=1,
        tenant_id="",
        key="crashB-013",
        status=status,
        input={},
        created_at=NOW,
        updated_at=NOW,
        operations=[OperationState(**op) for op in ops],
    )


def test_an_unknown_step_is_resolved_or_compensated_with_it() -> None:
    state = _parked(_op("flight", "succeeded"), _op("hotel", "unknown"), _op("car", "pending"))
    assert parked_commands(state) == [
        f"saga resolve {ID} hotel --app MODULE --succeeded --result JSON",
        f"saga resolve {ID} hotel --app MODULE --failed --reason TEXT",
        f"saga compensate {ID} --app MODULE --include-unknown",
    ]


def test_a_failed_compensation_is_settled_by_hand_or_compensated_again() -> None:
    state = _parked(
        _op("flight", "succeeded"),
        _op("hotel", "failed"),
        _op("flight", "failed", "compensation"),
    )
    assert parked_commands(state) == [
        f"saga resolve {ID} flight --app MODULE --kind compensation --succeeded",
        f"saga compensate {ID} --app MODULE",
    ]


def test_a_saga_parked_on_a_ceiling_is_retried_or_compensated() -> None:
    state = _parked(_op("flight", "succeeded"), _op("hotel", "pending"))
    assert parked_commands(state) == [
        f"saga retry {ID} --app MODULE",
        f"saga compensate {ID} --app MODULE",
    ]


def test_a_channel_only_settles_its_calls_and_a_saga_not_parked_has_none() -> None:
    state = _parked(_op("send_email.10abb24cc789", "unknown"))
    assert parked_commands(state, "channel") == list(
        resolve_commands(ID, "send_email.10abb24cc789")
    )
    assert parked_commands(_parked(_op("flight", "unknown"), status="running")) == []


def test_a_step_name_the_shell_would_split_is_quoted() -> None:
    assert resolve_commands(ID, "book hotel")[0] == (
        f"saga resolve {ID} 'book hotel' --succeeded --result JSON"
    )
