"""Exceptions raised by saga-orchestrator and by step code to steer retries."""

from __future__ import annotations


class SagaError(Exception):
    """Base class of every error the orchestrator raises."""


class SagaDefinitionError(SagaError):
    """The saga declaration is invalid (duplicate step, second compensation, bad option)."""


class IdempotencyConflict(SagaError):
    """The same idempotency key was used with a different request."""

    def __init__(self, message: str, *, saga: str, key: str) -> None:
        super().__init__(message)
        self.saga = saga
        self.key = key


class SagaNotFound(SagaError, LookupError):
    """No saga exists with this id."""

    def __init__(self, saga_id: str) -> None:
        super().__init__(f"no saga with id {saga_id!r}")
        self.saga_id = saga_id


class NotRegistered(SagaError, LookupError):
    """The saga's (name, version) is not registered with this orchestrator."""

    def __init__(self, name: str, version: int) -> None:
        super().__init__(
            f"saga {name!r} version {version} is not registered with this orchestrator; "
            f"register it with Orchestrator.register() or Orchestrator(sagas=[...])"
        )
        self.name = name
        self.version = version


class DatabaseUnavailable(SagaError, ConnectionError):
    """PostgreSQL could not be reached; the message names host and port, never the password."""


class DatabaseRefused(DatabaseUnavailable):
    """PostgreSQL answered and refused the connection (bad password, unknown role or
    database, an access rule): retrying will not help until the settings change."""


class DatabaseInterrupted(DatabaseUnavailable):
    """Database work was cut off for a reason that may pass (the connection was lost, the
    server is restarting or shutting down, no pooled connection came in time, a deadlock):
    the orchestrator retries it with backoff, and raises this once its retries ran out."""


class SchemaMissing(SagaError):
    """The saga schema (or a function of it) is missing from the database: run
    `saga migrate`, or let the orchestrator migrate on first use (`auto_migrate=True`)."""


class DatabaseError(SagaError):
    """PostgreSQL refused a statement for a reason that is neither the saga's state nor a
    lost connection; the message names the SQLSTATE and what the server said."""

    def __init__(self, message: str, *, sqlstate: str | None) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


class InsufficientPrivilege(DatabaseError):
    """The role connected lacks a privilege the work needs (SQLSTATE 42501); the message
    says which and how the owner of the saga schema grants it (`saga grant`)."""


class StepStateError(SagaError, ValueError):
    """An operator request does not fit the saga's current state (e.g. resolving a settled step)."""


class LeaseLost(SagaError):
    """This worker's lease was taken over; its writes are refused by the fencing token."""


class SchemaTooNew(SagaError):
    """The database's schema is newer than this package understands: upgrade the package."""

    def __init__(self, *, database_version: int, package_version: int) -> None:
        super().__init__(
            f"the saga schema in this database is at migration {database_version:04d}, newer "
            f"than this saga-orchestrator understands (it ships migrations up to "
            f"{package_version:04d}); a newer release has migrated this database: upgrade the "
            f"package rather than run or migrate with this one"
        )
        self.database_version = database_version
        self.package_version = package_version


class SessionBusy(SagaError):
    """Another live process or task holds the session (its lease), and it did not let go
    within the wait asked for; nothing was called."""


class SessionParked(SagaError):
    """The session cannot go on safely without a human (a call's outcome is unknown and
    neither a reconcile hook nor a same-key retry may settle it, a result that is not
    JSON, a ceiling); the message names the call and the remedy (`saga resolve`...)."""


class SyncCallInEventLoop(SagaError, RuntimeError):
    """A blocking call of the sync API was made from a running event loop, and refused
    before it did anything: use `AsyncOrchestrator`, or call it in a thread
    (`await asyncio.to_thread(...)`)."""


class PermanentError(Exception):
    """Raised by step code: the operation failed and must not be retried."""


class TransientError(Exception):
    """Raised by step code: the operation failed but may succeed if retried with the same key."""
