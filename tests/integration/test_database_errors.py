"""A statement PostgreSQL refuses reaches the user as the orchestrator's own error, from
the library (both doors) and from the `saga` command, never as a raw driver error."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo
from test_cli import saga_cmd

from saga import AsyncOrchestrator, DatabaseError, Orchestrator, SchemaMissing


def test_a_database_without_the_schema_raises_schema_missing(empty_database_url: str) -> None:
    """With auto-migration off, the first read names the database and says what to run;
    the driver's error stays attached as the cause for a traceback."""
    orch = Orchestrator(empty_database_url, auto_migrate=False)
    try:
        with pytest.raises(SchemaMissing, match=r"run `saga migrate`$") as excinfo:
            orch.list()
    finally:
        orch.close()
    assert "does not exist" in str(excinfo.value)
    assert isinstance(excinfo.value.__cause__, psycopg.errors.UndefinedTable)


def test_the_asyncio_door_raises_the_same_error(empty_database_url: str) -> None:
    async def main() -> None:
        async with AsyncOrchestrator(empty_database_url, auto_migrate=False) as orch:
            with pytest.raises(SchemaMissing, match=r"run `saga migrate`$"):
                await orch.get(str(uuid.uuid4()))

    asyncio.run(main())


@pytest.fixture
def unprivileged_url(database_url: str) -> Iterator[str]:
    """A role that may log in to the migrated database but holds no right on its schema."""
    role = f"saga_nobody_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        conn.execute(sql.SQL("REVOKE ALL ON SCHEMA saga FROM PUBLIC"))
    try:
        yield make_conninfo(database_url, user=role, password="")
    finally:
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_a_refused_statement_is_database_error_naming_its_sqlstate(unprivileged_url: str) -> None:
    orch = Orchestrator(unprivileged_url, auto_migrate=False)
    try:
        with pytest.raises(DatabaseError) as excinfo:
            orch.list()
    finally:
        orch.close()
    assert excinfo.value.sqlstate == "42501"
    assert "refused a statement [SQLSTATE 42501]: permission denied for schema saga" in str(
        excinfo.value
    )


def test_the_saga_command_prints_it_on_one_line(unprivileged_url: str) -> None:
    result = saga_cmd("list", "--database-url", unprivileged_url)
    assert result.returncode == 1
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("saga: PostgreSQL at ")
    assert lines[0].endswith(
        "refused a statement [SQLSTATE 42501]: permission denied for schema saga; the owner "
        "of the saga schema grants a role what it needs with `saga grant "
        "reader|worker|operator ROLE`"
    )
