"""What PostgreSQL and the pool raise leaves the store as the orchestrator's own errors."""

from __future__ import annotations

import psycopg
import pytest
from psycopg import errors
from psycopg_pool import PoolTimeout

from saga import (
    DatabaseError,
    DatabaseInterrupted,
    DatabaseUnavailable,
    InsufficientPrivilege,
    LeaseLost,
    SchemaMissing,
    StepStateError,
)
from saga._db._store_base import translate
from saga._db.dbretry import is_transient

URL = "postgresql://alice:s3cret@db.example.com:6543/orders"


@pytest.mark.parametrize(
    "raised",
    [
        psycopg.OperationalError("server closed the connection unexpectedly"),
        errors.AdminShutdown("terminating connection due to administrator command"),
        PoolTimeout("couldn't get a connection after 30.00 sec"),
        errors.DeadlockDetected("deadlock detected"),
        errors.SerializationFailure("could not serialize access"),
    ],
)
def test_a_transient_failure_is_database_interrupted_and_still_retried(
    raised: psycopg.Error,
) -> None:
    """A lost connection, a shutdown, a pool timeout or a deadlock: `DatabaseInterrupted`
    (a `DatabaseUnavailable`, so batch jobs stop on it), which the retry loops still take
    for transient."""
    error = translate(raised, URL)
    assert type(error) is DatabaseInterrupted
    assert isinstance(error, DatabaseUnavailable)
    assert is_transient(error)
    assert str(error).startswith("database work at db.example.com:6543/orders was cut off: ")
    assert "s3cret" not in str(error)


@pytest.mark.parametrize(
    "raised",
    [
        errors.UndefinedTable('relation "saga.sagas" does not exist'),
        errors.InvalidSchemaName('schema "saga" does not exist'),
        errors.UndefinedFunction("function saga.write_saga_v4(jsonb) does not exist"),
    ],
)
def test_a_missing_schema_says_to_run_saga_migrate(raised: psycopg.Error) -> None:
    error = translate(raised, URL)
    assert type(error) is SchemaMissing
    assert not is_transient(error)
    assert str(error) == (
        f"the saga schema is missing from the database at db.example.com:6543/orders "
        f"({raised}); run `saga migrate`"
    )


def test_any_other_statement_error_names_its_sqlstate() -> None:
    error = translate(errors.NumericValueOutOfRange("integer out of range"), URL)
    assert type(error) is DatabaseError
    assert error.sqlstate == "22003"
    assert not is_transient(error)
    assert str(error) == (
        "PostgreSQL at db.example.com:6543/orders refused a statement [SQLSTATE 22003]: "
        "integer out of range"
    )


def test_a_missing_privilege_says_how_it_is_granted() -> None:
    error = translate(errors.InsufficientPrivilege("permission denied for table sagas"), URL)
    assert isinstance(error, InsufficientPrivilege) and isinstance(error, DatabaseError)
    assert error.sqlstate == "42501"
    assert not is_transient(error)
    assert str(error) == (
        "PostgreSQL at db.example.com:6543/orders refused a statement [SQLSTATE 42501]: "
        "permission denied for table sagas; the owner of the saga schema grants a role what "
        "it needs with `saga grant reader|worker|operator ROLE`"
    )


def test_a_password_quoted_by_the_server_is_scrubbed() -> None:
    error = translate(psycopg.OperationalError(f"could not connect with {URL}"), URL)
    assert "s3cret" not in str(error)


def test_the_fence_and_confirmation_refusals_keep_their_meaning() -> None:
    """saga.write_saga's SQLSTATEs: SG001 is `LeaseLost`, SG002 `StepStateError`."""

    class Fence(psycopg.Error):
        sqlstate = "SG001"

    class Confirmation(psycopg.Error):
        sqlstate = "SG002"

    assert type(translate(Fence("lease of saga x is held by another owner"), URL)) is LeaseLost
    assert type(translate(Confirmation("approval expired"), URL)) is StepStateError
