"""The public surface: `saga.__all__` is pinned and every contract name imports from `saga`."""

import importlib

import pytest

import saga

# The exact public API. Adding or removing a name is a deliberate change: update this list.
EXPECTED_ALL = [
    "Absent",
    "ApprovalRejected",
    "AsyncLedger",
    "AsyncOrchestrator",
    "AsyncSession",
    "AsyncWorker",
    "Ceilings",
    "Claim",
    "Compensation",
    "Confirmation",
    "DatabaseError",
    "DatabaseInterrupted",
    "DatabaseRefused",
    "DatabaseUnavailable",
    "DurableStep",
    "Found",
    "HistoryEvent",
    "IdempotencyConflict",
    "Inconclusive",
    "InsufficientPrivilege",
    "LeaseLost",
    "Ledger",
    "NotRegistered",
    "OperationState",
    "OperationStatus",
    "Orchestrator",
    "PermanentError",
    "RetryPolicy",
    "Saga",
    "SagaDefinitionError",
    "SagaError",
    "SagaHandle",
    "SagaNotFound",
    "SagaState",
    "SagaStatus",
    "SchemaMissing",
    "SchemaTooNew",
    "Session",
    "SessionBusy",
    "SessionParked",
    "Step",
    "StepContext",
    "StepStateError",
    "SyncCallInEventLoop",
    "TransientError",
    "UpgradePlan",
    "UpgradeRefused",
    "Worker",
    "WorkerInfo",
    "current_context",
    "durable_step",
]

# Names the v0 API contract promises to users of `from saga import ...`.
CONTRACT_NAMES = [
    "Saga",
    "RetryPolicy",
    "Orchestrator",
    "StepContext",
    "PermanentError",
    "TransientError",
    "SagaDefinitionError",
    "IdempotencyConflict",
    "SagaNotFound",
    "NotRegistered",
    "DatabaseUnavailable",
    "StepStateError",
    "Found",
    "Absent",
    "Inconclusive",
    "SagaState",
    "OperationState",
    "SagaHandle",
    "HistoryEvent",
    "SagaStatus",
    "OperationStatus",
    "Worker",
]


def test_all_is_pinned() -> None:
    """saga.__all__ is exactly the reviewed list (sorted, no duplicates)."""
    assert sorted(saga.__all__) == EXPECTED_ALL
    assert len(set(saga.__all__)) == len(saga.__all__)


def test_every_name_in_all_exists() -> None:
    """`from saga import *` works: each listed name is an attribute of the package."""
    namespace: dict[str, object] = {}
    exec("from saga import *", namespace)
    missing = [name for name in saga.__all__ if name not in namespace]
    assert missing == []


@pytest.mark.parametrize("name", CONTRACT_NAMES)
def test_contract_name_is_public(name: str) -> None:
    """Each name of the documented contract imports from `saga` and is listed in __all__."""
    module = importlib.import_module("saga")
    assert getattr(module, name) is not None
    assert name in saga.__all__


def test_errors_share_the_documented_bases() -> None:
    """Orchestrator errors derive from SagaError; step-code errors are plain exceptions."""
    for error in (
        saga.SagaDefinitionError,
        saga.IdempotencyConflict,
        saga.SagaNotFound,
        saga.NotRegistered,
        saga.DatabaseUnavailable,
        saga.StepStateError,
        saga.LeaseLost,
        saga.SchemaTooNew,
        saga.SchemaMissing,
        saga.DatabaseError,
    ):
        assert issubclass(error, saga.SagaError)
    assert issubclass(saga.DatabaseUnavailable, ConnectionError)
    # A connection lost after the retries ran out is still "the database is unavailable".
    assert issubclass(saga.DatabaseInterrupted, saga.DatabaseUnavailable)
    assert issubclass(saga.SagaNotFound, LookupError)
    assert not issubclass(saga.PermanentError, saga.TransientError)
    assert not issubclass(saga.TransientError, saga.PermanentError)


def test_statuses_are_lowercase_str_enums() -> None:
    """Status values are the documented lowercase names and compare equal to plain strings."""
    assert [s.value for s in saga.SagaStatus] == [
        "pending",
        "running",
        "compensating",
        "completed",
        "compensated",
        "needs_review",
        "awaiting_confirmation",
        "forked",
    ]
    assert [s.value for s in saga.OperationStatus] == [
        "pending",
        "running",
        "succeeded",
        "failed",
        "unknown",
    ]
    assert str(saga.SagaStatus.NEEDS_REVIEW) == "needs_review"
    assert saga.SagaStatus("needs_review") is saga.SagaStatus.NEEDS_REVIEW
    assert saga.SagaStatus.COMPLETED.is_terminal
    assert saga.SagaStatus.COMPENSATED.is_terminal
    assert not saga.SagaStatus.NEEDS_REVIEW.is_terminal
    assert not saga.SagaStatus.NEEDS_REVIEW.is_runnable
    assert saga.SagaStatus.COMPENSATING.is_runnable


def test_reconcile_answers() -> None:
    """Found(result, provider_reference=None), Absent() and Inconclusive() are values."""
    found = saga.Found({"charge": "ch_1"})
    assert found.result == {"charge": "ch_1"}
    assert found.provider_reference is None
    assert saga.Found(None, provider_reference="p-1").provider_reference == "p-1"
    assert saga.Absent() == saga.Absent()
    assert saga.Inconclusive().reason is None


def test_py_typed_marker_ships() -> None:
    """The package is marked typed (py.typed), so users' type checkers read its hints."""
    from importlib.resources import files

    assert files("saga").joinpath("py.typed").is_file()


def test_saga_state_operation_lookup() -> None:
    """SagaState.operation(step, kind) finds an operation; KeyError when there is none."""
    from datetime import UTC, datetime

    now = datetime.now(UTC)
    op = saga.OperationState(
        step="charge",
        kind="action",
        status=saga.OperationStatus.SUCCEEDED,
        attempts=1,
        max_attempts=3,
        idempotency_key="renewal:v1:acme:evt-1:charge",
        request_hash="0" * 64,
    )
    state = saga.SagaState(
        id="s-1",
        saga="renewal",
        version=1,
        tenant_id="acme",
        key="evt-1",
        status=saga.SagaStatus.COMPLETED,
        input={},
        created_at=now,
        updated_at=now,
        operations=[op],
    )
    assert state.operation("charge") is op
    assert state.lease_owner is None and state.lease_expires_at is None
    with pytest.raises(KeyError):
        state.operation("charge", "compensation")
