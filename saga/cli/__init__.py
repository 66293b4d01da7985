"""The `saga` command line: migrate, run workers, inspect and recover sagas.

`main` parses the arguments (`saga.cli.parser`), runs the command (`saga.cli.commands`,
whose batch jobs are `saga.cli.admin`'s) and turns what it raises into one line on
stderr and an exit code."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence

from saga import _early
from saga._app import UsageError, error_line
from saga._db.database import ENV_URL, default_embedded_dir
from saga.cli import format as fmt
from saga.cli.commands import COMMANDS, given_flags
from saga.cli.console import configure_logging, log_level
from saga.cli.parser import EXIT_OK, EXIT_PARTIAL, EXIT_USAGE, build_parser
from saga.errors import SagaError, SchemaMissing, StepStateError
from saga.redact import scrub

__all__ = ["main"]

ENV_TRACEBACK = "SAGA_TRACEBACK"


def _schema_missing(exc: SchemaMissing, args: argparse.Namespace) -> str:
    """A missing schema; when the command fell back to the embedded PostgreSQL because no
    URL was set, that first: its advice to migrate would set up a database nobody meant."""
    if getattr(args, "database_url", None) or os.environ.get(ENV_URL):
        return str(exc)
    return (
        f"no database URL is set (--database-url URL, or {ENV_URL}), so this used the "
        f"embedded PostgreSQL in {default_embedded_dir()}, which has no saga schema: give "
        "the URL of your database, or run `saga migrate` to set up the embedded one"
    )


def _fail(message: str, code: int, urls: Sequence[str | None] = ()) -> int:
    # Whatever the error quotes of a database URL, its password is never printed.
    known = (*urls, os.environ.get(ENV_URL))
    if os.environ.get(ENV_TRACEBACK):
        print(scrub(traceback.format_exc(), *known), file=sys.stderr, end="")
    # Data it quotes (a key, a tenant, a provider's error) cannot drive the terminal.
    print(fmt.printable(scrub(f"saga: {message}", *known), lines=True), file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `saga` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    configure_logging(log_level(args), args.log_format)
    urls = (getattr(args, "database_url", None),)
    try:
        if args.command not in {"worker", "dashboard"}:  # they handle signals themselves
            _early.release()
        return COMMANDS[args.command](args)
    except UsageError as exc:
        return _fail(f"{args.command}: {exc}", EXIT_USAGE, urls)
    except StepStateError as exc:
        return _fail(f"refused: {fmt.cli_wording(str(exc), given_flags(args))}", EXIT_PARTIAL, urls)
    except SchemaMissing as exc:
        return _fail(_schema_missing(exc, args), EXIT_PARTIAL, urls)
    except SagaError as exc:
        return _fail(fmt.cli_wording(str(exc), given_flags(args)), EXIT_PARTIAL, urls)
    except ValueError as exc:
        return _fail(f"{args.command}: {exc}", EXIT_USAGE, urls)
    except KeyboardInterrupt:
        return _fail("interrupted", EXIT_PARTIAL, urls)
    except BrokenPipeError:
        # The reader of the output went away (`saga list | head`): nothing more to say.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
    except Exception as exc:
        return _fail(
            f"unexpected error: {error_line(exc)} (SAGA_TRACEBACK=1 shows where)",
            EXIT_PARTIAL,
            urls,
        )


if __name__ == "__main__":
    sys.exit(main())
