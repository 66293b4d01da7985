"""saga-orchestrator: declared sagas on PostgreSQL that survive crashes and compensate."""

from saga.aorchestrator import AsyncOrchestrator
from saga.approvals import ApprovalRejected
from saga.aworker import AsyncWorker
from saga.context import StepContext
from saga.definition import Ceilings, Compensation, Saga, Step
from saga.durable import DurableStep, current_context, durable_step
from saga.errors import (
    DatabaseError,
    DatabaseInterrupted,
    DatabaseRefused,
    DatabaseUnavailable,
    IdempotencyConflict,
    InsufficientPrivilege,
    LeaseLost,
    NotRegistered,
    PermanentError,
    SagaDefinitionError,
    SagaError,
    SagaNotFound,
    SchemaMissing,
    SchemaTooNew,
    SessionBusy,
    SessionParked,
    StepStateError,
    SyncCallInEventLoop,
    TransientError,
)
from saga.ledger import AsyncLedger, Claim, Ledger
from saga.orchestrator import Orchestrator
from saga.outcomes import Absent, Found, Inconclusive
from saga.retry import RetryPolicy
from saga.session import AsyncSession, Session
from saga.state import (
    Confirmation,
    HistoryEvent,
    OperationState,
    OperationStatus,
    SagaHandle,
    SagaState,
    SagaStatus,
    WorkerInfo,
)
from saga.upgrade import UpgradePlan, UpgradeRefused
from saga.worker import Worker


def _installed_version() -> str:
    """The version of the installed distribution; `0+unknown` when it is not installed
    (the source tree imported from a checkout)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("saga-orchestrator")
    except PackageNotFoundError:
        return "0+unknown"


__version__ = _installed_version()

__all__ = [
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
