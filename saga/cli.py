"""The `saga` command line; today `saga migrate`, more operator verbs to come."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import psycopg

from saga.database import check_connection, resolve_database_url, unavailable
from saga.errors import SagaError
from saga.migrate import apply_migrations

EXIT_OK = 0
EXIT_PARTIAL = 1
EXIT_USAGE = 2

_EPILOG = """exit codes:
  0  done
  1  partial: something stayed parked or was refused (also: the database was unreachable)
  2  usage error

The database comes from --database-url, else SAGA_DATABASE_URL, else an embedded
PostgreSQL in a local data directory (SAGA_EMBEDDED_DIR)."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="saga",
        description="Operate saga-orchestrator sagas on PostgreSQL.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    migrate = commands.add_parser(
        "migrate", help="apply pending schema migrations (idempotent, safe from two hosts at once)"
    )
    migrate.add_argument("--database-url", help="PostgreSQL URL (overrides SAGA_DATABASE_URL)")
    return parser


def _migrate(database_url: str | None) -> int:
    url = resolve_database_url(database_url)
    check_connection(url)
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            applied = apply_migrations(conn)
    except psycopg.OperationalError as exc:
        raise unavailable(url, exc) from None
    if applied:
        print(f"applied migrations: {', '.join(f'{v:04d}' for v in applied)}")
    else:
        print("schema is up to date")
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `saga` console script; returns the exit code."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "migrate":
            return _migrate(args.database_url)
    except SagaError as exc:
        print(f"saga: {exc}", file=sys.stderr)
        return EXIT_PARTIAL
    except (psycopg.Error, OSError, ValueError) as exc:
        print(f"saga: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_PARTIAL
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
