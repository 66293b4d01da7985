"""What a worker waits for at start, and what it raises: a broken reply is waited for."""

from __future__ import annotations

import psycopg
from psycopg import errors

from saga.errors import DatabaseRefused
from saga.worker import unreachable

URL = "postgresql://saga@db.example:5432/app"


def test_a_reply_the_client_could_not_read_is_waited_for() -> None:
    """psycopg's `InternalError` without a SQLSTATE is its own protocol trouble: seen when a
    server restarts behind PgBouncer while a worker's start-up migration commits. The
    worker used to exit 1 on it; it waits and tries again."""
    broken = psycopg.InternalError("received 2 results from command 'COMMIT'")
    assert broken.sqlstate is None
    assert unreachable(broken, URL)


def test_a_refusal_with_a_sqlstate_is_raised() -> None:
    """The server's own verdicts still end the start at once, naming what is wrong."""
    assert not unreachable(errors.InsufficientPrivilege("permission denied"), URL)
    assert not unreachable(errors.InvalidCatalogName("database does not exist"), URL)
    assert not unreachable(DatabaseRefused("password authentication failed"), URL)
