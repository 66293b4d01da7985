"""Migrations: from an empty database, applied twice or by two processes at once."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import psycopg
import pytest

from saga import Orchestrator
from saga._db import migrate
from saga._db.migrate import apply_migrations, load_migrations

REPO_ROOT = Path(__file__).resolve().parents[2]

_MIGRATE_ONCE = textwrap.dedent(
    """
    import os, sys
    import psycopg
    from saga._db.migrate import apply_migrations

    with psycopg.connect(os.environ["SAGA_TEST_MIGRATE_URL"], autocommit=True) as conn:
        applied = apply_migrations(conn)
    print("applied", applied)
    """
)


def _schema_summary(url: str) -> tuple[list[tuple[int, int]], int, list[str]]:
    """(version, rows) of schema_migrations, number of `saga` schemas, tables in `saga`."""
    with psycopg.connect(url) as conn:
        versions = conn.execute(
            "SELECT version, count(*)::int FROM saga.schema_migrations"
            " GROUP BY version ORDER BY version"
        ).fetchall()
        schemas = conn.execute(
            "SELECT count(*)::int FROM pg_namespace WHERE nspname = 'saga'"
        ).fetchone()
        tables = conn.execute(
            "SELECT tablename::text FROM pg_tables WHERE schemaname = 'saga' ORDER BY 1"
        ).fetchall()
    assert schemas is not None
    return [(int(v), int(n)) for v, n in versions], int(schemas[0]), [str(t[0]) for t in tables]


def test_applying_migrations_twice_leaves_one_schema(empty_database_url: str) -> None:
    """Migrating twice applies every file once; the second run applies nothing."""
    expected = [m.version for m in load_migrations()]
    assert expected, "no migration files found"

    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        first = apply_migrations(conn)
        second = apply_migrations(conn)

    assert first == expected
    assert second == []
    versions, schemas, tables = _schema_summary(empty_database_url)
    assert versions == [(v, 1) for v in expected]
    assert schemas == 1
    assert {"sagas", "operations", "events", "schema_migrations"} <= set(tables)


def test_two_processes_migrating_at_once_both_succeed(empty_database_url: str) -> None:
    """Two processes migrating the same empty database at once both succeed, one schema results."""
    env = {**os.environ, "SAGA_TEST_MIGRATE_URL": empty_database_url}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _MIGRATE_ONCE],
            env=env,
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [proc.communicate(timeout=60) for proc in procs]
    for proc, (out, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, f"migrator failed: {out}\n{err}"

    expected = [m.version for m in load_migrations()]
    # structlog may also print to stdout: keep only the lines the script printed.
    applied_lines = sorted(
        line for out, _ in outputs for line in out.splitlines() if line.startswith("applied ")
    )
    # Exactly one process applied the files; the other found them applied.
    assert applied_lines == sorted(["applied []", f"applied {expected}"])
    versions, schemas, _ = _schema_summary(empty_database_url)
    assert versions == [(v, 1) for v in expected]
    assert schemas == 1


def test_migrating_on_first_use_retries_a_connection_lost_meanwhile(
    empty_database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that starts while its connection is terminated (a failover, an operator's
    pg_terminate_backend) retries the migration instead of exiting: the migration is one
    transaction, so the try that failed left nothing behind."""
    real = migrate.apply_migrations
    tries: list[int] = []

    def flaky(conn: psycopg.Connection[Any]) -> list[int]:
        tries.append(1)
        if len(tries) == 1:
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return real(conn)

    monkeypatch.setattr(migrate, "apply_migrations", flaky)
    with Orchestrator(empty_database_url) as orch:
        assert orch.list() == []
    assert len(tries) == 2
    with psycopg.connect(empty_database_url) as conn:
        row = conn.execute("SELECT count(*) FROM saga.schema_migrations").fetchone()
    assert row is not None and row[0] == len(migrate.load_migrations())


_FROZEN_MIGRATOR = textwrap.dedent(
    """
    import os, time
    from saga._db import migrate

    def frozen():  # called inside the transaction that holds the migrations' lock
        print("FROZEN", flush=True)
        time.sleep(120)
        return []

    migrate.load_migrations = frozen
    migrate.migrate_database(os.environ["SAGA_TEST_MIGRATE_URL"])
    """
)


def test_a_migrator_frozen_inside_its_transaction_holds_the_lock_for_seconds_only(
    database_url: str,
) -> None:
    """A migrator that stops inside its transaction (a frozen process, or a dead one
    whose connection a proxy keeps open) has that transaction ended by the server after
    `MIGRATION_IDLE_SECONDS` idle: the next migration check (every orchestrator's first
    use, every worker's start) goes on instead of waiting on the lock for ever."""
    env = {**os.environ, "SAGA_TEST_MIGRATE_URL": database_url}
    with subprocess.Popen(
        [sys.executable, "-c", _FROZEN_MIGRATOR],
        env=env,
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
    ) as frozen:
        try:
            assert frozen.stdout is not None and frozen.stdout.readline().strip() == "FROZEN"
            done: list[list[int]] = []
            checker = threading.Thread(
                target=lambda: done.append(migrate.migrate_database(database_url)), daemon=True
            )
            checker.start()
            checker.join(migrate.MIGRATION_IDLE_SECONDS + 20)
            assert done == [[]], "the migration check still waits on the frozen migrator's lock"
        finally:
            frozen.kill()
