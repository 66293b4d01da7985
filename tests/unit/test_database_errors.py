"""Connection errors name where PostgreSQL was expected, never the password (no server used)."""

import pytest

from saga import DatabaseUnavailable
from saga._db.database import describe_url, resolve_database_url, unavailable


def test_unavailable_names_host_and_port_but_not_the_password() -> None:
    """DatabaseUnavailable says host:port/db and scrubs the password from the reason."""
    url = "postgresql://app:s3cr3t-pw@db.example.com:6543/orders"
    error = unavailable(url, OSError("password s3cr3t-pw rejected\nmore detail"))
    assert isinstance(error, DatabaseUnavailable)
    message = str(error)
    assert "db.example.com:6543/orders" in message
    assert "s3cr3t-pw" not in message
    assert "more detail" not in message


def test_describe_url_defaults_and_garbage() -> None:
    """Missing host/port default to localhost:5432; an unparsable URL is shown with its
    credentials (everything up to the last `@`) and `password=` values masked."""
    assert describe_url("postgresql://u:pw@/db") == "localhost:5432/db"
    assert "pw" not in describe_url("postgresql://u:pw@h:1/db")
    assert describe_url("not a url = = =") == "not a url = = ="
    assert describe_url("alice:s3cr3t@db.example.com/orders") == "***@db.example.com/orders"
    assert describe_url("postgresql://a:s3/cr3t@h/db") == "postgresql://***@h/db"
    assert describe_url("host=h password='s3 cr3t") == "host=h password=***"


def test_explicit_url_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """An explicit URL is used as is; otherwise SAGA_DATABASE_URL (no server is started)."""
    monkeypatch.setenv("SAGA_DATABASE_URL", "postgresql://env-host/db")
    assert resolve_database_url("postgresql://explicit/db") == "postgresql://explicit/db"
    assert resolve_database_url() == "postgresql://env-host/db"
