"""Settings of the connections behind a transaction pooler, and where workers LISTEN."""

from __future__ import annotations

import pytest

from saga._db.database import (
    ENV_PREPARED_STATEMENTS,
    Route,
    prepare_threshold,
    prepared_statements_setting,
    restarting,
)
from saga.orchestrator import connection_kwargs, transaction_settings
from saga.worker import ENV_LISTEN_URL, listen_target

DIRECT = Route(pooled=False)
POOLED = Route(pooled=True)


def test_prepared_statements_are_auto_by_default_and_follow_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(ENV_PREPARED_STATEMENTS, raising=False)
    assert prepared_statements_setting() is None
    for value, expected in (("on", True), ("OFF", False), ("auto", None), ("0", False)):
        monkeypatch.setenv(ENV_PREPARED_STATEMENTS, value)
        assert prepared_statements_setting() is expected
    assert prepared_statements_setting(True) is True  # the keyword wins
    monkeypatch.setenv(ENV_PREPARED_STATEMENTS, "sometimes")
    with pytest.raises(ValueError, match="on, off or auto"):
        prepared_statements_setting()


def test_auto_prepares_on_a_direct_connection_and_never_through_a_pooler() -> None:
    assert prepare_threshold(None, DIRECT) == 5
    assert prepare_threshold(None, POOLED) is None
    assert prepare_threshold(True, POOLED) == 5
    assert prepare_threshold(False, DIRECT) is None


def test_through_a_pooler_no_startup_option_and_the_timeouts_per_transaction(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PGOPTIONS", raising=False)
    direct = connection_kwargs("postgresql://h/db", 2.5, DIRECT, None)
    assert direct == {
        "autocommit": True,
        "prepare_threshold": 5,
        "options": "-c idle_in_transaction_session_timeout=2500 -c lock_timeout=2500"
        " -c saga.hash_version=2",
    }
    assert transaction_settings(DIRECT, 2.5) is None
    pooled = connection_kwargs("postgresql://h/db", 2.5, POOLED, None)
    assert pooled == {"autocommit": True, "prepare_threshold": None}
    assert transaction_settings(POOLED, 2.5) == {
        "idle_ms": "2500",
        "lock_ms": "2500",
        "hash_version": "2",
    }


def test_workers_listen_on_listen_url_else_the_environment_else_a_direct_database_url(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(ENV_LISTEN_URL, raising=False)
    db, direct = "postgresql://pooler:6432/app", "postgresql://db:5432/app"
    assert listen_target(direct, db, POOLED) == (direct, "listen_url")
    assert listen_target(None, db, DIRECT) == (db, "database_url")
    assert listen_target(None, db, None) == (db, "database_url")
    assert listen_target(None, db, POOLED) == (None, "database_url")  # polling
    monkeypatch.setenv(ENV_LISTEN_URL, direct)
    assert listen_target(None, db, POOLED) == (direct, ENV_LISTEN_URL)


def test_a_restarting_server_or_its_pooler_is_told_apart_from_an_unreachable_one() -> None:
    assert restarting(OSError("FATAL:  the database system is starting up"))
    assert restarting(
        OSError("ERROR:  server login has been failing, try again later (server_login_retry)")
    )
    assert not restarting(OSError("Connection refused"))
    assert not restarting(OSError('FATAL:  password authentication failed for user "x"'))


def test_statements_cut_by_the_server_are_transient() -> None:
    """statement_timeout, lock_timeout and an idle transaction ended by the server are
    retried like a lost connection; a constraint violation is not."""
    from psycopg import errors

    from saga._db.dbretry import is_transient

    for cut in (
        errors.QueryCanceled,
        errors.LockNotAvailable,
        errors.IdleInTransactionSessionTimeout,
    ):
        assert is_transient(cut("cut")), cut
    assert not is_transient(errors.UniqueViolation("no"))
