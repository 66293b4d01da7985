"""saga-orchestrator: declared sagas on PostgreSQL that survive crashes and compensate."""

# The public names are imported on first use (PEP 562): `import saga` alone loads none
# of the package's dependencies (psycopg, pydantic, structlog...), so the `saga` command
# starts in milliseconds and handles SIGTERM from its first moment (see saga/_entry.py).
# `from saga import X`, `saga.X` and `saga.<submodule>` work as if imported eagerly; type
# checkers and IDEs read the imports below.

# The `typing.TYPE_CHECKING` convention without importing `typing` (which takes time).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from saga.approvals import ApprovalRejected
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
    from saga.orchestrator_async import AsyncOrchestrator
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
    from saga.worker_async import AsyncWorker

# Where each public name is defined: `saga.X` imports that module on first use.
_LAZY = {
    "Absent": "saga.outcomes",
    "ApprovalRejected": "saga.approvals",
    "AsyncLedger": "saga.ledger",
    "AsyncOrchestrator": "saga.orchestrator_async",
    "AsyncSession": "saga.session",
    "AsyncWorker": "saga.worker_async",
    "Ceilings": "saga.definition",
    "Claim": "saga.ledger",
    "Compensation": "saga.definition",
    "Confirmation": "saga.state",
    "DatabaseError": "saga.errors",
    "DatabaseInterrupted": "saga.errors",
    "DatabaseRefused": "saga.errors",
    "DatabaseUnavailable": "saga.errors",
    "DurableStep": "saga.durable",
    "Found": "saga.outcomes",
    "HistoryEvent": "saga.state",
    "IdempotencyConflict": "saga.errors",
    "Inconclusive": "saga.outcomes",
    "InsufficientPrivilege": "saga.errors",
    "LeaseLost": "saga.errors",
    "Ledger": "saga.ledger",
    "NotRegistered": "saga.errors",
    "OperationState": "saga.state",
    "OperationStatus": "saga.state",
    "Orchestrator": "saga.orchestrator",
    "PermanentError": "saga.errors",
    "RetryPolicy": "saga.retry",
    "Saga": "saga.definition",
    "SagaDefinitionError": "saga.errors",
    "SagaError": "saga.errors",
    "SagaHandle": "saga.state",
    "SagaNotFound": "saga.errors",
    "SagaState": "saga.state",
    "SagaStatus": "saga.state",
    "SchemaMissing": "saga.errors",
    "SchemaTooNew": "saga.errors",
    "Session": "saga.session",
    "SessionBusy": "saga.errors",
    "SessionParked": "saga.errors",
    "Step": "saga.definition",
    "StepContext": "saga.context",
    "StepStateError": "saga.errors",
    "SyncCallInEventLoop": "saga.errors",
    "TransientError": "saga.errors",
    "UpgradePlan": "saga.upgrade",
    "UpgradeRefused": "saga.upgrade",
    "Worker": "saga.worker",
    "WorkerInfo": "saga.state",
    "current_context": "saga.durable",
    "durable_step": "saga.durable",
}


if not TYPE_CHECKING:  # type checkers see the imports above, and no fallback for typos

    def __getattr__(name: str) -> object:
        import importlib

        if name in _LAZY:
            value = getattr(importlib.import_module(_LAZY[name]), name)
        elif name == "__version__":
            value = _installed_version()
        elif name.startswith("__"):
            raise AttributeError(f"module 'saga' has no attribute {name!r}")
        else:
            # A submodule (`saga.errors`, `saga.keys`), reachable as after an eager import.
            try:
                return importlib.import_module(f"saga.{name}")
            except ModuleNotFoundError as exc:
                if exc.name != f"saga.{name}":
                    raise
                raise AttributeError(f"module 'saga' has no attribute {name!r}") from None
        globals()[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*globals(), *__all__, "__version__"})


def _installed_version() -> str:
    """The version of the installed distribution; `0+unknown` when it is not installed
    (the source tree imported from a checkout)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("saga-orchestrator")
    except PackageNotFoundError:
        return "0+unknown"


if TYPE_CHECKING:
    __version__: str  # the installed version, read on first use

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
