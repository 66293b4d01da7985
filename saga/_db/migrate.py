"""Apply the SQL migrations in order, once, under an advisory lock.

The upgrade policy (docs/deploying.md, "A new release of the package"): during a rolling
upgrade, workers of the previous release keep running against the schema the new release
has migrated, so a migration never removes or changes anything the previous release calls
or reads. A SQL function whose contract changes gets a new versioned name
(`saga.write_saga_v2` beside `saga.write_saga`); the old one is dropped one release later,
once no supported release calls it. Columns are added nullable or with a default, never
dropped or retyped in the release that stops using them. tests/integration/test_upgrade.py
checks this against the previous release's tree.

The advisory lock is transaction-scoped (`pg_advisory_xact_lock`) and every migration
runs in the one transaction that holds it, so migrating through a pooler in transaction
mode is as safe as on a direct connection: the lock and the DDL it guards share one server
session, and the lock ends with the transaction that took it, never left on a server
session the pooler hands to someone else. A direct URL is still the one to migrate with
(`saga migrate --database-url DIRECT`): a pooler's `query_timeout` or the server's
`statement_timeout` for the pooled role can cut a long migration short.

The other direction is refused: a package that finds the database at a migration newer
than the newest file it ships raises `SchemaTooNew` instead of running or migrating.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from saga.errors import InsufficientPrivilege, SchemaTooNew
from saga.logs import get_logger

_log = get_logger("saga.migrate")

# Arbitrary constant shared by every migrator of this project: two processes migrating
# the same database at once serialize on it instead of racing on CREATE TABLE.
_ADVISORY_LOCK_ID = 0x5A6A_0001
# A migrator idle this long (seconds) inside its transaction (frozen, or dead behind a
# proxy that keeps its connection open) has the transaction ended by the server, and
# with it the lock above: others wait for it no longer than that.
MIGRATION_IDLE_SECONDS = 10.0
_SCHEMA = sql.Identifier("saga")
_FILE_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


@dataclass(frozen=True, slots=True)
class Migration:
    """One migration file: `NNNN_description.sql`."""

    version: int
    name: str
    sql_text: str


def migrations_dir() -> Path:
    """Where the migration files are: inside the installed package, else the source tree."""
    packaged = resources.files("saga") / "migrations"
    if packaged.is_dir():
        return Path(str(packaged))
    source = Path(__file__).resolve().parents[2] / "migrations"
    if source.is_dir():
        return source
    raise FileNotFoundError("saga migrations are missing from this installation")


def load_migrations(directory: Path | None = None) -> list[Migration]:
    """All migrations, ordered by version; a malformed file name is an error."""
    found: list[Migration] = []
    for path in sorted((directory or migrations_dir()).glob("*.sql")):
        match = _FILE_NAME.match(path.name)
        if match is None:
            raise ValueError(f"migration file {path.name!r} is not named NNNN_description.sql")
        found.append(Migration(int(match[1]), match[2], path.read_text(encoding="utf-8")))
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise ValueError(f"two migration files share a version: {versions}")
    return found


def apply_migrations(conn: psycopg.Connection[Any]) -> list[int]:
    """Apply pending migrations in one transaction; returns the versions applied.

    Nothing but reads is run when none is pending, so a role without DDL rights (a
    worker's, `saga grant worker`) may call this on an up-to-date schema; a role that may
    not apply a pending migration gets `InsufficientPrivilege` saying who may."""
    try:
        return _apply_pending(conn)
    except psycopg.errors.InsufficientPrivilege as exc:
        raise _may_not_migrate(conn, exc) from None


def _apply_pending(conn: psycopg.Connection[Any]) -> list[int]:
    """`apply_migrations`, its errors as PostgreSQL raised them."""
    applied: list[int] = []
    with conn.transaction():
        # Transaction-local, so also right through a transaction pooler.
        conn.execute(
            "SELECT set_config('idle_in_transaction_session_timeout', %s, true)",
            (str(int(MIGRATION_IDLE_SECONDS * 1000)),),
        )
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_ADVISORY_LOCK_ID,))
        row = conn.execute("SELECT to_regclass('saga.schema_migrations') IS NOT NULL").fetchone()
        if not (row is not None and row[0]):
            _create_migrations_table(conn)
        cursor = conn.execute(sql.SQL("SELECT version FROM {}.schema_migrations").format(_SCHEMA))
        done = {int(row[0]) for row in cursor.fetchall()}
        migrations = load_migrations()
        check_not_newer(done, migrations)
        for migration in migrations:
            if migration.version in done:
                continue
            conn.execute(migration.sql_text.encode("utf-8"))
            conn.execute(
                sql.SQL("INSERT INTO {}.schema_migrations (version, name) VALUES (%s, %s)").format(
                    _SCHEMA
                ),
                (migration.version, migration.name),
            )
            applied.append(migration.version)
            _log.info("migration_applied", version=migration.version, name=migration.name)
    return applied


def _create_migrations_table(conn: psycopg.Connection[Any]) -> None:
    """Create the saga schema, when it does not exist, and its table of migrations.

    The schema is created only when missing: CREATE SCHEMA needs the CREATE privilege on
    the database even when the schema exists, and a DBA may have created it for the
    owner (`CREATE SCHEMA saga AUTHORIZATION owner`) without giving that."""
    row = conn.execute("SELECT to_regnamespace('saga') IS NOT NULL").fetchone()
    if not (row is not None and row[0]):
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(_SCHEMA))
    conn.execute(
        sql.SQL(
            "CREATE TABLE IF NOT EXISTS {}.schema_migrations ("
            " version integer PRIMARY KEY,"
            " name text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT now())"
        ).format(_SCHEMA)
    )


def _may_not_migrate(conn: psycopg.Connection[Any], exc: psycopg.Error) -> InsufficientPrivilege:
    """The error for a role that may not apply the migrations, naming it and who may."""
    said = " ".join(str(exc.diag.message_primary or exc).split())
    return InsufficientPrivilege(
        f"role {conn.info.user!r} may not migrate the saga schema ({said}): run `saga "
        "migrate` as the role that owns the schema saga, or as one allowed to make schemas "
        "in the database (it then owns it); workers and operators need no DDL",
        sqlstate=exc.sqlstate,
    )


def check_not_newer(applied: set[int], migrations: list[Migration]) -> None:
    """Raise `SchemaTooNew` when the database holds a migration newer than every file
    shipped: this package would run code older than the schema's own release."""
    shipped = max((m.version for m in migrations), default=0)
    newest = max(applied, default=0)
    if newest > shipped:
        raise SchemaTooNew(database_version=newest, package_version=shipped)


def migrate_database(url: str) -> list[int]:
    """Connect to `url` and apply pending migrations, as an orchestrator does on first use.

    A transient error (a connection terminated or a server restarting just then) is
    retried like any database work, for a bounded time: the migration is one transaction,
    so a failed try leaves nothing behind. What is not transient, or outlasts the retries,
    is raised (a refused or unreachable server as `DatabaseUnavailable`)."""
    from saga._db.database import unavailable
    from saga._db.dbretry import retrying

    try:
        for attempt in retrying("migrate"):
            # No prepared statement: the URL may be a transaction pooler's (see above).
            with attempt, psycopg.connect(url, autocommit=True, prepare_threshold=None) as conn:
                return apply_migrations(conn)
    except psycopg.OperationalError as exc:
        raise unavailable(url, exc) from None
    raise AssertionError("unreachable: retrying() reraises")  # pragma: no cover
