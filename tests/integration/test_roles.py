"""Least privilege: migrations as a non-superuser schema owner, and the three roles that
`saga grant` gives (worker, operator, reader), used for real through the library and the
`saga` command."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import cli_app
import psycopg
import pytest
from cli_app import Job
from psycopg import sql
from psycopg.conninfo import make_conninfo
from test_cli import saga_cmd

from saga import InsufficientPrivilege, Orchestrator

PASSWORD = "role-test-password"


@dataclass(frozen=True)
class Roles:
    """Login roles of one test (cluster-wide, so uniquely named) and their URLs."""

    owner: str
    worker: str
    operator: str
    reader: str
    admin_url: str  # the test database, as the server's superuser

    def url(self, role: str) -> str:
        return make_conninfo(self.admin_url, user=role, password=PASSWORD)


@pytest.fixture
def roles(empty_database_url: str) -> Iterator[Roles]:
    """Four login roles with no special attribute, and a saga schema the DBA created for
    the owner (CREATE SCHEMA ... AUTHORIZATION): the owner has no CREATE on the database."""
    suffix = uuid.uuid4().hex[:8]
    made = Roles(
        f"saga_owner_{suffix}",
        f"saga_worker_{suffix}",
        f"saga_operator_{suffix}",
        f"saga_reader_{suffix}",
        empty_database_url,
    )
    names = [made.owner, made.worker, made.operator, made.reader]
    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        for name in names:
            conn.execute(
                sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
                    sql.Identifier(name), sql.Literal(PASSWORD)
                )
            )
        conn.execute(
            sql.SQL("CREATE SCHEMA saga AUTHORIZATION {}").format(sql.Identifier(made.owner))
        )
    try:
        yield made
    finally:
        with psycopg.connect(empty_database_url, autocommit=True) as conn:
            # One role at a time, the owner first: its default privileges name the others.
            for name in names:
                conn.execute(sql.SQL("DROP OWNED BY {} CASCADE").format(sql.Identifier(name)))
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = ANY(%s)",
                (names,),
            )
            for name in names:
                conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(name)))


def _grant_all(roles: Roles) -> None:
    owner = roles.url(roles.owner)
    for kind, role in (("worker", roles.worker), ("operator", roles.operator)):
        done = saga_cmd("grant", kind, role, "--database-url", owner)
        assert done.returncode == 0, done.stderr
        assert f"granted {kind} privileges" in done.stdout
    done = saga_cmd("grant", "reader", roles.reader, "--database-url", owner)
    assert done.returncode == 0, done.stderr


def test_a_schema_owner_that_is_no_superuser_migrates_and_grants(
    roles: Roles, app_dir: Path
) -> None:
    """`saga migrate` as the owner of a schema a DBA created needs neither superuser nor
    CREATE on the database, nor any extension; `saga grant` then gives each role its
    privileges."""
    migrated = saga_cmd("migrate", "--database-url", roles.url(roles.owner))
    assert migrated.returncode == 0, migrated.stderr
    assert "applied migrations" in migrated.stdout
    with psycopg.connect(roles.admin_url) as conn:
        row = conn.execute(
            "SELECT rolsuper, rolcreatedb, rolcreaterole FROM pg_roles WHERE rolname = %s",
            (roles.owner,),
        ).fetchone()
        assert row == (False, False, False)
        extensions = conn.execute("SELECT extname FROM pg_extension").fetchall()
        assert extensions == [("plpgsql",)]
        owners = conn.execute(
            "SELECT DISTINCT pg_get_userbyid(relowner) FROM pg_class c"
            " JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = 'saga'"
        ).fetchall()
        assert owners == [(roles.owner,)]
    _grant_all(roles)
    again = saga_cmd("grant", "worker", roles.worker, "--database-url", roles.url(roles.owner))
    assert again.returncode == 0, again.stderr  # granting twice is harmless
    missing = saga_cmd("grant", "worker", "no_such_role_x", "--database-url", roles.admin_url)
    assert missing.returncode == 2
    assert "role 'no_such_role_x' does not exist" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_each_role_does_its_job_and_no_more(roles: Roles, app_dir: Path) -> None:
    """The worker role drives sagas (through execute() and a worker, with the default
    auto_migrate on an up-to-date schema) but runs no DDL; the operator purges; the
    reader lists and shows, and cannot drive a saga: it is told what it lacks, and how to
    grant it, instead of a traceback."""
    assert saga_cmd("migrate", "--database-url", roles.url(roles.owner)).returncode == 0
    _grant_all(roles)

    with Orchestrator(roles.url(roles.worker), sagas=cli_app.SAGAS) as orch:
        done = orch.execute(cli_app.shop, Job(order_id="w-1"))
        assert done.status == "completed"
        started = orch.start(cli_app.shop, Job(order_id="w-2")).id
        orch.worker(concurrency=2, poll_seconds=0.1).run(until_idle=True)
        assert orch.get(started).status == "completed"
    with psycopg.connect(roles.url(roles.worker)) as conn:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("CREATE TABLE saga.intruder (id int)")
        conn.rollback()
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("DELETE FROM saga.sagas")
        conn.rollback()
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("INSERT INTO saga.schema_migrations VALUES (9999, 'x')")

    listed = saga_cmd("list", "--database-url", roles.url(roles.reader))
    assert listed.returncode == 0, listed.stderr
    assert started in listed.stdout
    shown = saga_cmd("show", started, "--database-url", roles.url(roles.reader))
    assert shown.returncode == 0, shown.stderr
    assert "completed" in shown.stdout

    refused = saga_cmd(
        "worker", "--app", "cli_app", "--database-url", roles.url(roles.reader), app_dir=app_dir
    )
    assert refused.returncode != 0
    assert f"role '{roles.reader}' cannot act as a saga worker" in refused.stderr
    assert f"saga grant worker {roles.reader}" in refused.stderr
    assert "it lacks INSERT, UPDATE on saga.sagas" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert "driving" not in refused.stderr  # refused before the worker is announced
    with Orchestrator(roles.url(roles.reader), sagas=cli_app.SAGAS) as orch:
        with pytest.raises(InsufficientPrivilege, match="saga grant"):
            orch.execute(cli_app.shop, Job(order_id="r-1"))
        assert [s.status for s in orch.list()] == ["completed", "completed"]

    with psycopg.connect(roles.admin_url, autocommit=True) as conn:
        conn.execute(
            "UPDATE saga.sagas SET finished_at = now() - interval '400 days',"
            " updated_at = now() - interval '400 days'"
        )
    purged = saga_cmd("purge", "--database-url", roles.url(roles.operator))
    assert purged.returncode == 0, purged.stderr
    assert "purged 2" in purged.stdout


def test_what_a_later_migration_creates_is_granted_already(roles: Roles) -> None:
    """The grants cover tables a later migration adds (default privileges of the owner)."""
    assert saga_cmd("migrate", "--database-url", roles.url(roles.owner)).returncode == 0
    _grant_all(roles)
    with psycopg.connect(roles.url(roles.owner), autocommit=True) as conn:
        conn.execute("CREATE TABLE saga.later_table (id bigserial PRIMARY KEY, note text)")
    with psycopg.connect(roles.admin_url) as conn:
        rows = conn.execute(
            "SELECT has_table_privilege(%s, 'saga.later_table', 'INSERT, UPDATE'),"
            " has_table_privilege(%s, 'saga.later_table', 'DELETE'),"
            " has_table_privilege(%s, 'saga.later_table', 'DELETE'),"
            " has_table_privilege(%s, 'saga.later_table', 'SELECT'),"
            " has_table_privilege(%s, 'saga.later_table', 'INSERT')",
            (roles.worker, roles.worker, roles.operator, roles.reader, roles.reader),
        ).fetchone()
    assert rows == (True, False, True, True, False)


def test_a_role_that_may_not_migrate_is_told_who_may(roles: Roles) -> None:
    """The worker role, on a database whose schema is not migrated yet, gets a message
    naming the owner's job, and nothing is half-written."""
    refused = saga_cmd("migrate", "--database-url", roles.url(roles.worker))
    assert refused.returncode != 0
    assert f"role '{roles.worker}' may not migrate the saga schema" in refused.stderr
    assert "Traceback" not in refused.stderr
    with psycopg.connect(roles.admin_url) as conn:
        row = conn.execute("SELECT to_regclass('saga.schema_migrations')").fetchone()
    assert row == (None,)
