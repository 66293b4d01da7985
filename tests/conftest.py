"""Real PostgreSQL for the test suite: one server per session, one fresh database per test.

The server comes from `saga.testing.postgres_server`, as users' suites get it:
`SAGA_TEST_DATABASE_URL`, else a testcontainers PostgreSQL when a Docker engine answers,
else the embedded PostgreSQL. Migrations are applied once into a
template database; each test that asks for `database_url` gets a copy of it
(`CREATE DATABASE ... TEMPLATE`), dropped after the test. Nothing here runs unless a test
asks for one of these fixtures, so the unit tests never touch a database.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from saga.testing import postgres_server

_INTEGRATION_DIR = Path(__file__).resolve().parent / "integration"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test under tests/integration as `integration`."""
    for item in items:
        path = Path(str(item.path)).resolve()
        if path == _INTEGRATION_DIR or _INTEGRATION_DIR in path.parents:
            item.add_marker(pytest.mark.integration)


def _connect_autocommit(url: str) -> psycopg.Connection[Any]:
    return psycopg.connect(url, autocommit=True)


def _new_database_name(prefix: str) -> str:
    return f"{prefix}_{os.getpid()}_{secrets.token_hex(4)}"


def _drop_database(server: str, name: str) -> None:
    with _connect_autocommit(server) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


@pytest.fixture(scope="session")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The maintenance URL of the PostgreSQL server used by this test session."""
    with postgres_server(tmp_path_factory.mktemp("embedded") / "pgdata") as url:
        yield url


@pytest.fixture(scope="session")
def template_database(server_url: str) -> Iterator[str]:
    """Name of a database holding the migrated schema, copied by every `database_url`."""
    from saga.migrate import apply_migrations

    name = _new_database_name("saga_tpl")
    with _connect_autocommit(server_url) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        with _connect_autocommit(make_conninfo(server_url, dbname=name)) as conn:
            apply_migrations(conn)
        yield name
    finally:
        _drop_database(server_url, name)


@pytest.fixture
def database_url(server_url: str, template_database: str) -> Iterator[str]:
    """URL of a fresh, migrated database of this test only, dropped afterwards."""
    name = _new_database_name("saga_t")
    with _connect_autocommit(server_url) as conn:
        conn.execute(
            sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(template_database)
            )
        )
    try:
        yield make_conninfo(server_url, dbname=name)
    finally:
        _drop_database(server_url, name)


@pytest.fixture
def empty_database_url(server_url: str) -> Iterator[str]:
    """URL of a fresh database with no migrations applied, dropped afterwards."""
    name = _new_database_name("saga_e")
    with _connect_autocommit(server_url) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {} TEMPLATE template0").format(sql.Identifier(name)))
    try:
        yield make_conninfo(server_url, dbname=name)
    finally:
        _drop_database(server_url, name)
