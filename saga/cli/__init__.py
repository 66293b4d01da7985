"""The `saga` command line: migrate, run workers, inspect and recover sagas."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import inspect
import json
import logging
import os
import signal
import socket
import sys
import traceback
from collections.abc import Awaitable, Callable, Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, Literal, NoReturn, TypeVar, cast

import pydantic
import structlog

from saga import __version__, _entry
from saga._actors import os_user
from saga._core.requests import AmbiguousCall
from saga._db.database import (
    ENV_URL,
    check_connection,
    default_embedded_dir,
    describe_url,
    resolve_database_url,
)
from saga._db.migrate import migrate_database
from saga._db.roles import ROLE_KINDS, grant_role, role_kind
from saga._db.store import Store
from saga.approvals import ApprovalSigner
from saga.cli import admin
from saga.cli import format as fmt
from saga.durable import registered_step, registered_step_names
from saga.errors import (
    DatabaseUnavailable,
    NotRegistered,
    SagaError,
    SchemaMissing,
    StepStateError,
)
from saga.logs import EVENTS_CHANNEL, get_logger
from saga.orchestrator import ENV_APPROVAL_PUBLIC_KEY, ENV_CONFIRMATION_KEY, Orchestrator
from saga.orchestrator_async import AsyncOrchestrator
from saga.redact import scrub
from saga.session import LEDGER_PREFIX, SESSION_PREFIX
from saga.state import SagaState, SagaStatus
from saga.upgrade import UpgradePlan, UpgradeRefused
from saga.worker import Worker, unreachable
from saga.worker_async import AsyncWorker

EXIT_OK = 0
EXIT_PARTIAL = 1
EXIT_USAGE = 2
ENV_APP = "SAGA_APP"
ENV_TRACEBACK = "SAGA_TRACEBACK"
# --log-format; and the commands that run until stopped, which log at info by default.
LOG_FORMATS = ("console", "json")
_LONG_RUNNING = frozenset({"worker", "dashboard"})
_log_format = "console"
# The retention `saga purge` applies without --app or --retention-days, as Orchestrator's.
DEFAULT_RETENTION_DAYS = 30.0

T = TypeVar("T")
# What --app names: the orchestrator of the user's module, sync or asyncio.
App = Orchestrator | AsyncOrchestrator

_EPILOG = """exit codes:
  0  done
  1  not done: something stayed parked, was skipped or refused (a live lease without
     --force, a step already settled), no such saga, or the database was unreachable
  2  usage error: bad arguments, or an --app that cannot be loaded

The database comes from --database-url, else SAGA_DATABASE_URL, else an embedded
PostgreSQL in a local data directory (SAGA_EMBEDDED_DIR). Commands that run your
code or need its saga definitions (worker, compensate, resolve, retry, cancel, fork,
reconcile, upgrade) load it with --app MODULE[:ATTR] or SAGA_APP: MODULE is imported
(from the current directory or PYTHONPATH) and ATTR names its Orchestrator or
AsyncOrchestrator (found by itself when there is only one; an AsyncOrchestrator's
worker is an AsyncWorker on an event loop).
An ID names a saga by its id, a unique prefix of its id (at least 4 characters), or its
business key (as started, e.g. `saga show crashB-013`); a text that names several sagas
(a key of several tenants or saga names, or a key that is also an id prefix) lists them
and exits 2: give the full id of the one you mean.
Mutating commands are recorded in each saga's audit trail with --actor (default:
your OS user). Errors are one line on stderr; SAGA_TRACEBACK=1 adds the traceback.

Run `saga COMMAND --help` for the options of a command."""


_CANCEL_EXIT_CODES = """exit codes of cancel:
  0  cancelled: the saga is compensating (a worker undoes what succeeded), or already
     was; with --run, it ended compensated
  1  not done, nothing written: the saga has ended (completed or compensated alike:
     there is nothing to cancel; `saga compensate ID` undoes a completed saga) or was
     forked, a pivot step succeeded, a live worker holds it (without --force), or the
     answer to the confirmation was no; or it is parked in needs_review (already
     parked, or with --run after its compensation stopped)
  2  usage error: bad arguments, or a cancel that would park the saga in needs_review
     without a terminal to confirm it on and without --yes (nothing written)"""


class UsageError(Exception):
    """The command cannot run as invoked (exit code 2)."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


# ----- arguments -----------------------------------------------------------------------


def _duration(text: str) -> float:
    try:
        return admin.parse_duration(text).total_seconds()
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _whole_at_least(least: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"expected a number of at least {least}, got {value}")
        return value

    return parse


_positive = _whole_at_least(1)
_non_negative = _whole_at_least(0)


def _amount(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a non-negative number, got {text!r}")
    return value


def _listen_address(text: str) -> tuple[str, int]:
    """(host, port) of `[HOST:]PORT`; host "" (every interface) when not given."""
    host, _, port = text.rpartition(":")
    try:
        number = int(port)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected [HOST:]PORT, got {text!r}") from None
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"port must be from 0 to 65535, got {number}")
    return host.strip("[]"), number


def _status(text: str) -> str:
    try:
        return SagaStatus(text).value
    except ValueError:
        choices = ", ".join(s.value for s in SagaStatus)
        raise argparse.ArgumentTypeError(f"unknown status {text!r} (one of: {choices})") from None


def _step_rename(text: str) -> tuple[str, str]:
    old, sep, new = text.partition("=")
    if not sep or not old.strip() or not new.strip():
        raise argparse.ArgumentTypeError(f"expected OLD=NEW (two step names), got {text!r}")
    return old.strip(), new.strip()


def _parser() -> argparse.ArgumentParser:
    common = _Parser(add_help=False)
    common.add_argument(
        "--database-url", metavar="URL", help="PostgreSQL URL (overrides SAGA_DATABASE_URL)"
    )
    loudness = common.add_mutually_exclusive_group()
    loudness.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="log at debug level on stderr: every saga event as it commits, besides the rest",
    )
    loudness.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="log warnings and errors only (the default of one-shot commands; worker and "
        "dashboard log info too: starting, stopping, migrations)",
    )
    common.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="console",
        help="how logs are written on stderr: console (one readable line each, the "
        "default) or json (one JSON object per line, for a log collector)",
    )
    app = _Parser(add_help=False)
    app.add_argument(
        "--app",
        metavar="MODULE[:ATTR]",
        default=os.environ.get(ENV_APP),
        help="module registering your sagas, and the name of its Orchestrator or "
        "AsyncOrchestrator (or SAGA_APP)",
    )
    actor = _Parser(add_help=False)
    actor.add_argument(
        "--actor", metavar="NAME", help="who runs this, for the audit trail (default: OS user)"
    )
    acting = _Parser(add_help=False, parents=[actor])
    acting.add_argument(
        "--force",
        action="store_true",
        help="act even when a live worker holds the saga: take its lease over",
    )
    drive = _Parser(add_help=False)
    drive.add_argument(
        "--run",
        action="store_true",
        help="drive the saga here until it stops, instead of leaving it to a worker",
    )

    parser = _Parser(
        prog="saga",
        description="Operate saga-orchestrator sagas on PostgreSQL.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"saga {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True

    def add(name: str, helptext: str, *parents: _Parser) -> _Parser:
        return commands.add_parser(
            name,
            help=helptext,
            description=helptext[0].upper() + helptext[1:] + ".",
            parents=[common, *parents],
            epilog=_EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )

    add("migrate", "apply pending schema migrations (idempotent, safe from two hosts at once)")

    granting = add(
        "grant",
        "give an existing role the privileges of a reader (list, show, the dashboard), a "
        "worker (drive sagas; no DDL) or an operator (every verb but migrate), on the saga "
        "schema now and on what later migrations create; run as the schema's owner",
    )
    granting.add_argument("kind", choices=ROLE_KINDS, help="which privileges")
    granting.add_argument("role", metavar="ROLE", help="the role to grant them to")

    worker = add("worker", "run a worker until SIGTERM or SIGINT, then stop gracefully", app)
    worker.add_argument("--concurrency", type=_positive, default=4, help="sagas at once (4)")
    worker.add_argument(
        "--listen-url",
        metavar="URL",
        help="a direct PostgreSQL URL of the same database for LISTEN wake-ups, when the "
        "database URL is a transaction pooler's (else SAGA_LISTEN_URL; else the database URL "
        "itself, polling with one warning where a pooler answers)",
    )
    worker.add_argument(
        "--metrics-port",
        type=_listen_address,
        metavar="[HOST:]PORT",
        help="serve OpenTelemetry metrics for Prometheus at http://HOST:PORT/metrics (every "
        "interface unless HOST is given; port 0 takes a free one); needs the otel extra",
    )

    listing = add("list", "list sagas, newest first")
    listing.add_argument("--status", type=_status, help="only sagas in this status")
    listing.add_argument("--saga", metavar="NAME", help="only sagas of this name")
    listing.add_argument("--tenant", metavar="T", help="only sagas of this tenant")
    listing.add_argument(
        "--key",
        metavar="KEY",
        help="only sagas of this business key, matched exactly (one per saga name and tenant)",
    )
    listing.add_argument(
        "--older-than",
        type=_duration,
        metavar="AGE",
        help="only sagas unchanged for at least AGE (90s, 15m, 1h, 2d)",
    )
    listing.add_argument("--limit", type=_positive, default=50, help="at most this many (50)")
    listing.add_argument("--json", action="store_true", help="one JSON object per line")

    show = add("show", "show a saga, its operations and the timeline of every attempt")
    show.add_argument("saga_id", metavar="ID")
    show.add_argument("--json", action="store_true", help="one JSON object with its history")
    show.add_argument(
        "--format",
        choices=("text", "json", "mermaid"),
        help="text (the default), json (as --json), or mermaid: a Mermaid Gantt diagram of "
        "its operations, to paste into an incident ticket",
    )

    history = add(
        "history",
        "print a saga's audit trail, oldest first: every event with when, which operation "
        "and attempt, who (for an operator's action) and its detail",
    )
    history.add_argument("saga_id", metavar="ID")
    history.add_argument(
        "--json",
        action="store_true",
        help="one JSON document: the saga (id, saga, version, tenant_id, key, status) and "
        "its events (at, event, step, kind, attempt, actor, detail)",
    )

    comp = add(
        "compensate",
        "compensation-only recovery: undo what succeeded, in reverse, running no further "
        "step; one saga by ID, or a batch selected by --status",
        app,
        acting,
    )
    comp.add_argument("saga_id", metavar="ID", nargs="?", help="the saga to compensate")
    comp.add_argument("--status", type=_status, help="batch: sagas in this status")
    comp.add_argument("--saga", metavar="NAME", help="batch: only sagas of this name")
    comp.add_argument("--tenant", metavar="T", help="batch: only sagas of this tenant")
    comp.add_argument(
        "--older-than", type=_duration, metavar="AGE", help="batch: unchanged for at least AGE"
    )
    comp.add_argument("--limit", type=_positive, default=100, help="batch: at most this many")
    comp.add_argument(
        "--dry-run",
        action="store_true",
        help="list the compensations that would run (saga, step, key); change nothing",
    )
    comp.add_argument(
        "--include-unknown",
        action="store_true",
        help="also compensate steps whose outcome is unknown (their compensation gets null)",
    )
    comp.add_argument(
        "--json",
        action="store_true",
        help="one JSON object per saga (JSON Lines), then a summary object",
    )

    resolve = add(
        "resolve",
        "settle an unknown or parked step after checking with the provider",
        app,
        acting,
        drive,
    )
    resolve.add_argument("saga_id", metavar="ID")
    resolve.add_argument("step", metavar="STEP")
    outcome = resolve.add_mutually_exclusive_group(required=True)
    outcome.add_argument("--succeeded", action="store_true", help="the effect happened")
    outcome.add_argument("--failed", action="store_true", help="it did not: compensate")
    resolve.add_argument("--result", metavar="JSON", help="with --succeeded: the step's result")
    resolve.add_argument("--reason", metavar="TEXT", help="why (required with --failed)")
    resolve.add_argument(
        "--kind",
        choices=("action", "compensation"),
        help="which operation of STEP (default: its open compensation, else the step)",
    )

    retry = add(
        "retry",
        "resume a parked saga after a fix, at the operation it stopped at",
        app,
        acting,
        drive,
    )
    retry.add_argument("saga_id", metavar="ID")
    retry.add_argument(
        "--extra-attempts",
        type=_non_negative,
        default=0,
        metavar="N",
        help="raise that operation's ceiling by N (attempts made still count)",
    )
    ceilings = retry.add_argument_group(
        "saga ceilings", "raise the saga's own ceilings instead (never lowered; counters stay)"
    )
    ceilings.add_argument("--max-operations", type=_positive, metavar="N")
    ceilings.add_argument("--spend-budget", type=_amount, metavar="AMOUNT")
    ceilings.add_argument("--max-side-effects", type=_non_negative, metavar="N")
    ceilings.add_argument("--extend-deadline", type=_duration, metavar="AGE")

    preview = add("preview", "show what a saga awaiting confirmation would do, and its hash")
    preview.add_argument("saga_id", metavar="ID")
    preview.add_argument("--json", action="store_true", help="the preview as one JSON object")

    confirm = add(
        "confirm",
        "approve the exact pending preview of a step awaiting confirmation (it releases "
        "one attempt), signing the approval with the Ed25519 private key of --private-key "
        f"(signed approvals; the app verifies with {ENV_APPROVAL_PUBLIC_KEY}), else with "
        f"the HMAC key in {ENV_CONFIRMATION_KEY}",
        app,
        acting,
        drive,
    )
    confirm.add_argument("saga_id", metavar="ID")
    confirm.add_argument("step", metavar="STEP")
    confirm.add_argument("request_hash", metavar="REQUEST_HASH", help="as `saga preview` shows")
    confirm.add_argument(
        "--private-key",
        metavar="FILE",
        help="sign with the approvers' Ed25519 private key in FILE (PEM, as `saga keygen` "
        "writes it); workers verify the approval with the public key before the attempt",
    )

    keygen = add(
        "keygen",
        "create an Ed25519 key pair for signed approvals: the private key is written to "
        "FILE for the approvers (`saga confirm --private-key FILE`), the public key is "
        f"printed for every worker and the app ({ENV_APPROVAL_PUBLIC_KEY})",
    )
    keygen.add_argument(
        "--private-key",
        metavar="FILE",
        required=True,
        help="where to write the private key (PEM, readable by its owner only)",
    )
    keygen.add_argument(
        "--overwrite", action="store_true", help="replace FILE when it exists already"
    )

    purge = add(
        "purge",
        "delete completed, compensated and forked sagas older than the retention, in batches; "
        "sagas still running or parked are never touched. With --app the retention is "
        "the retention_days of the app's Orchestrator",
        app,
    )
    purge.add_argument(
        "--retention-days",
        type=_amount,
        metavar="DAYS",
        help="keep ended sagas at least this long (default: the app's retention_days "
        f"with --app, else {DEFAULT_RETENTION_DAYS:g}; never shorter than the app's)",
    )
    purge.add_argument(
        "--older-than",
        type=_duration,
        metavar="AGE",
        help="delete only sagas ended longer ago than AGE (at least the retention)",
    )
    purge.add_argument(
        "--dry-run",
        action="store_true",
        help="list the sagas that would be deleted (id, saga, status, finished); delete nothing",
    )
    purge.add_argument(
        "--limit",
        type=_positive,
        default=100,
        metavar="N",
        help="with --dry-run: list at most N (100)",
    )
    purge.add_argument("--batch-size", type=_positive, default=1000, help="rows per batch (1000)")
    purge.add_argument(
        "--json",
        action="store_true",
        help="JSON Lines: with --dry-run one object per saga, then a summary object",
    )

    cancel = add("cancel", "stop a saga's forward progress and compensate it", app, acting, drive)
    cancel.add_argument("saga_id", metavar="ID")
    cancel.add_argument("--reason", metavar="TEXT", required=True, help="why, for the audit trail")
    cancel.add_argument(
        "--include-unknown",
        action="store_true",
        help="also compensate steps whose outcome is unknown (their compensation gets None "
        "as the step's result); on a saga already compensating, or parked at such a step, "
        "compensate them now",
    )
    cancel.add_argument(
        "--yes",
        action="store_true",
        help="cancel without asking when the compensation would stop at a step and park the "
        "saga in needs_review (without a terminal to ask on, it is refused otherwise)",
    )
    cancel.epilog = _CANCEL_EXIT_CODES + _EPILOG[_EPILOG.index("\n\nThe database") :]

    fork = add(
        "fork",
        "continue a parked saga as a new saga that runs from STEP on, keeping the results "
        "of the steps before it; the old saga becomes forked and never runs again",
        app,
        actor,
    )
    fork.add_argument("saga_id", metavar="ID")
    fork.add_argument(
        "--from",
        dest="from_step",
        metavar="STEP",
        required=True,
        help="the first step the new saga runs (the steps before it must have succeeded); "
        "for a session, the first call it makes again (a call's name, or a durable step's "
        "name called once)",
    )
    fork.add_argument(
        "--key",
        metavar="KEY",
        help="idempotency key of the new saga (default: '<saga key>:fork:<STEP>')",
    )
    fork.add_argument(
        "--json",
        action="store_true",
        help="one JSON object: id, key, created, forked_from, from_step",
    )

    rec = add(
        "reconcile",
        "settle operations left running under an expired lease (or unknown) through their "
        "reconcile hook or an idempotent retry",
        app,
    )
    rec.add_argument("--limit", type=_positive, default=100, help="at most this many sagas")
    rec.add_argument(
        "--json",
        action="store_true",
        help="one JSON object per saga (JSON Lines), then a summary object",
    )

    upgrade = add(
        "upgrade",
        "move sagas in flight that no worker holds to a newer registered version of their "
        "definition, when every step that took effect maps, in order, onto a step of that "
        "version with the same compensation; one saga by ID, or a batch selected by --saga "
        "and --version",
        app,
        actor,
    )
    upgrade.add_argument("saga_id", metavar="ID", nargs="?", help="the saga to upgrade")
    upgrade.add_argument(
        "--to",
        dest="to_version",
        type=_positive,
        required=True,
        metavar="N",
        help="the version to move them to: newer than theirs, registered by --app beside theirs",
    )
    upgrade.add_argument(
        "--map",
        dest="step_map",
        type=_step_rename,
        action="append",
        default=[],
        metavar="OLD=NEW",
        help="the step NEW of version N carries the saga's step OLD (repeatable; default: "
        "the step of the same name)",
    )
    upgrade.add_argument("--saga", metavar="NAME", help="batch: sagas of this name")
    upgrade.add_argument(
        "--version", dest="from_version", type=_positive, metavar="V", help="batch: of version V"
    )
    upgrade.add_argument(
        "--status",
        type=_status,
        action="append",
        help="batch: only sagas in this status (repeatable; default: every saga in flight)",
    )
    upgrade.add_argument(
        "--limit", type=_positive, default=1000, help="batch: at most this many (1000)"
    )
    upgrade.add_argument(
        "--dry-run",
        action="store_true",
        help="say what each upgrade would do, or why it would be refused; change nothing",
    )
    upgrade.add_argument(
        "--json",
        action="store_true",
        help="one JSON object per saga (JSON Lines), then a summary object",
    )

    versions = add(
        "versions",
        "count the sagas in flight (not ended) per saga name and version; with --app, "
        "whether the app registers each version: old definitions must stay registered "
        "until their sagas drain (or are upgraded); exits 1 when a version in flight is not "
        "registered by the app, to gate a deploy",
    )
    versions.add_argument(
        "--app",
        metavar="MODULE[:ATTR]",
        default=os.environ.get(ENV_APP),
        help="also say whether this app registers each version (or SAGA_APP)",
    )
    versions.add_argument("--json", action="store_true", help="one JSON object per line")

    dashboard = add(
        "dashboard",
        "serve a read-only web dashboard of the sagas (the list, the needs-review queue, "
        "each saga's timeline), updated live, until SIGINT or SIGTERM; needs the web "
        f"extra: {WEB_EXTRA}",
    )
    dashboard.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (127.0.0.1: this machine only; the dashboard has no login)",
    )
    dashboard.add_argument(
        "--port", type=_port, default=8080, help="port to listen on (8080; 0: any free port)"
    )
    return parser


# ----- set-up --------------------------------------------------------------------------


def _log_level(args: argparse.Namespace) -> int:
    """-v: debug (every saga event); -q: warnings; else info for the long-running commands,
    whose lifecycle (started, stopping, migrations) an operator follows, and warnings for
    one-shot commands, whose output is their report on stdout."""
    if args.verbose:
        return logging.DEBUG
    if args.quiet or args.command not in _LONG_RUNNING:
        return logging.WARNING
    return logging.INFO


def _configure_logging(level: int, log_format: str = "console") -> None:
    # stdout carries the command's output (tables, JSON); logs go to stderr.
    processors: list[structlog.typing.Processor] = []
    if level > logging.DEBUG:
        # The saga's own events (one per committed transition) are debug here.
        processors.append(_drop_saga_events)
    processors += [
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso"),
    ]
    if log_format == "json":
        processors += [
            _add_logger_name,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(default=str),
        ]
    else:
        processors.append(structlog.dev.ConsoleRenderer(colors=False))
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=_stderr_logger,
        cache_logger_on_first_use=False,
    )
    global _log_format
    _log_format = log_format


def _stdlib_formatter() -> logging.Formatter:
    """Records of stdlib `logging` (uvicorn's, under `saga dashboard`) as the saga
    command's own logs look, in the --log-format chosen."""
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer(default=str)
        if _log_format == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    return structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[
            structlog.stdlib.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            *([structlog.stdlib.add_logger_name] if _log_format == "json" else []),
        ],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
    )


class _StderrLogger(structlog.PrintLogger):
    """structlog's PrintLogger on stderr, knowing the name it was asked for."""

    def __init__(self, name: str) -> None:
        super().__init__(sys.stderr)
        self.name = name


def _stderr_logger(*args: object) -> structlog.PrintLogger:
    # sys.stderr as it is when the logger is made (loggers are not cached), not as it was
    # at configure time: code that swaps stderr (a test harness) never gets a closed file.
    return _StderrLogger(str(args[0]) if args else "saga")


def _drop_saga_events(
    logger: Any, method: str, event_dict: structlog.typing.EventDict
) -> structlog.typing.EventDict:
    if getattr(logger, "name", None) == EVENTS_CHANNEL and method in ("debug", "info"):
        raise structlog.DropEvent
    return event_dict


def _add_logger_name(
    logger: Any, method: str, event_dict: structlog.typing.EventDict
) -> structlog.typing.EventDict:
    name = getattr(logger, "name", None)
    if name:
        event_dict.setdefault("logger", name)
    return event_dict


def _announce(text: str, event: str, *, level: str = "info", **fields: object) -> None:
    """A line of a long-running command on stderr (it started, where, it stopped), shown
    whatever the log level: as is, or with --log-format json as a JSON object whose
    `message` is the line, so that every line of stderr parses."""
    if _log_format == "json":
        now = datetime.now(UTC).isoformat().replace("+00:00", "Z")
        record = {"event": event, "message": text, **fields, "level": level, "timestamp": now}
        text = json.dumps(record, default=str)
    print(text, file=sys.stderr, flush=True)


def _actor(args: argparse.Namespace) -> str:
    actor = getattr(args, "actor", None)
    if actor is None:
        return os_user()
    if not actor.strip():
        raise UsageError(
            f"--actor {actor!r} names nobody: give who runs this (a person or a system), "
            "for the saga's audit trail, or leave it out to use your OS user"
        )
    return str(actor)


def load_app(spec: str | None, database_url: str | None) -> App:
    """Import `MODULE[:ATTR]` and return its Orchestrator or AsyncOrchestrator;
    `UsageError` otherwise."""
    if not spec:
        raise UsageError(f"this command runs your code: pass --app MODULE[:ATTR] or set {ENV_APP}")
    module_name, _, attr = spec.partition(":")
    if not module_name:
        raise UsageError(f"--app {spec!r}: expected MODULE[:ATTR]")
    if database_url:
        # Set before the import, so an app's `Orchestrator()` resolves to this database.
        os.environ[ENV_URL] = database_url
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    steps_before = set(registered_step_names())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if module_name == missing or module_name.startswith(missing + "."):
            raise UsageError(
                f"--app {spec!r}: no module named {module_name!r} "
                "(run from its directory or add it to PYTHONPATH)"
            ) from None
        raise UsageError(f"--app {spec!r}: importing it failed: {_one_line(exc)}") from None
    except DatabaseUnavailable:
        raise
    except Exception as exc:
        raise UsageError(f"--app {spec!r}: importing it failed: {_one_line(exc)}") from None
    orch: App
    if attr:
        found: Any = module
        for part in attr.split("."):
            if not hasattr(found, part):
                raise UsageError(f"--app {spec!r}: module {module_name!r} has no {attr!r}")
            found = getattr(found, part)
        if not isinstance(found, Orchestrator | AsyncOrchestrator):
            raise UsageError(
                f"--app {spec!r}: {attr!r} is a {type(found).__name__}, not an Orchestrator "
                "or an AsyncOrchestrator"
            )
        orch = found
    else:
        candidates: dict[int, tuple[str, App]] = {}
        for name, value in vars(module).items():
            if isinstance(value, Orchestrator | AsyncOrchestrator):
                candidates.setdefault(id(value), (name, value))
        if not candidates:
            raise UsageError(
                f"--app {spec!r}: module {module_name!r} has no Orchestrator (or "
                "AsyncOrchestrator) at its top level; name one with MODULE:ATTR"
            )
        if len(candidates) > 1:
            names = ", ".join(sorted(n for n, _ in candidates.values()))
            raise UsageError(
                f"--app {spec!r}: module {module_name!r} has several Orchestrators ({names}); "
                "pick one with MODULE:ATTR"
            )
        orch = next(iter(candidates.values()))[1]
    own_url = getattr(orch, "_explicit_url", None)
    if database_url and own_url and own_url != database_url:
        raise UsageError(
            f"--app {spec!r}: its Orchestrator names its own database "
            f"({describe_url(own_url)}), not --database-url ({describe_url(database_url)})"
        )
    if not orch.registered() and not _defines_durable_steps(module, steps_before):
        raise UsageError(
            f"--app {spec!r}: its Orchestrator has no registered saga, and the module "
            "defines no durable step"
        )
    return orch


def _defines_durable_steps(module: Any, before: set[str]) -> bool:
    """Whether importing the app registered durable steps, or its module defines some (a
    session's definition comes from the durable steps its app imports)."""
    names = registered_step_names()
    if set(names) - before:
        return True
    for name in names:
        step = registered_step(name)
        if step is not None and getattr(step.fn, "__module__", None) == module.__name__:
            return True
    return False


class AsyncApp:
    """An `AsyncOrchestrator` behind the blocking calls the verbs (and `saga.cli.admin`'s
    batch jobs) make of an `Orchestrator`.

    Each coroutine method runs to completion on one event loop of this command, the loop
    the orchestrator's connections are bound to: user code runs as the app's workers run
    it (async steps awaited on the loop). Plain methods and attributes (`registered`,
    `definition`, `owner`, ...) are the app's own. `store` is a sync `Store` on the same
    database, for what the verbs read around the user code (id prefixes, compensation
    plans, the reconcile sweep's candidates); nothing is written through it. `close()`
    closes the app on its loop, then the loop.
    """

    def __init__(self, app: AsyncOrchestrator) -> None:
        self._app = app
        self._loop = asyncio.Runner()
        self._reader: Orchestrator | None = None

    @property
    def owner(self) -> str:
        return str(self._app.owner)

    @owner.setter
    def owner(self, value: str) -> None:
        self._app.owner = value

    @property
    def store(self) -> Store:
        """A sync Store on the app's database (opened on first use, migrating as the app
        would)."""
        if self._reader is None:
            self._reader = Orchestrator(
                self._app.database_url,
                auto_migrate=self._app.auto_migrate,
                lease_seconds=self._app.lease_seconds,
                owner=self._app.owner,
                pool_size=2,
            )
        return self._reader.store

    def wait(self, awaitable: Awaitable[T]) -> T:
        """Run `awaitable` to completion on this command's event loop."""

        async def result() -> T:
            return await awaitable

        return self._loop.run(result())

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._app, name)
        if not callable(value):
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            result = value(*args, **kwargs)
            return self.wait(result) if inspect.isawaitable(result) else result

        return call

    def close(self) -> None:
        """Close the app (on its loop), the loop, and the sync store."""
        try:
            self.wait(self._app.close())
        finally:
            self._loop.close()
            if self._reader is not None:
                self._reader.close()
                self._reader = None

    def __enter__(self) -> AsyncApp:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def blocking(app: App) -> Orchestrator:
    """`app` as the verbs call it: an Orchestrator as it is, an AsyncOrchestrator behind
    an `AsyncApp` (which answers every call an Orchestrator does, so it is typed as one)."""
    if isinstance(app, AsyncOrchestrator):
        return cast(Orchestrator, AsyncApp(app))
    return app


def _reader(database_url: str | None) -> Orchestrator:
    # Read-only commands never migrate: a missing schema is reported instead.
    return Orchestrator(database_url or None, auto_migrate=False)


def _operator(args: argparse.Namespace, *, runs_code: bool = True) -> Orchestrator:
    actor = _actor(args)  # a blank --actor is refused before the app is even loaded
    if args.app or runs_code:
        orch = blocking(load_app(args.app, args.database_url))
    else:
        # A change that runs no code of the app (settling a ledger call, say) needs none.
        orch = Orchestrator(args.database_url or None, auto_migrate=False)
    # Leases this command takes are named after who ran it, in the audit trail too.
    orch.owner = f"saga-cli:{actor}@{socket.gethostname()}:{os.getpid()}"
    return orch


def _full_id(orch: Orchestrator, args: argparse.Namespace) -> str:
    """The saga id given, expanded from a unique prefix (`saga show 6f0c`) or a business
    key (`saga show crashB-013`); see `admin.expand_id` for the precedence."""
    args.saga_id = admin.expand_id(orch.store, args.saga_id)
    return str(args.saga_id)


def _given(args: argparse.Namespace) -> dict[str, object]:
    """The flags of this run that messages might otherwise suggest, with their values."""
    return {
        "--include-unknown": getattr(args, "include_unknown", False),
        "--extra-attempts": getattr(args, "extra_attempts", 0),
        "--force": getattr(args, "force", False),
    }


# ----- commands ------------------------------------------------------------------------


def _migrate(args: argparse.Namespace) -> int:
    url = resolve_database_url(args.database_url)
    check_connection(url)
    applied = migrate_database(url)
    if applied:
        print(f"applied migrations: {', '.join(f'{v:04d}' for v in applied)}")
    else:
        print("schema is up to date")
    return EXIT_OK


def _grant(args: argparse.Namespace) -> int:
    url = resolve_database_url(args.database_url)
    check_connection(url)
    kind = role_kind(args.kind)
    grant_role(url, kind, args.role)
    print(f"granted {kind} privileges on the saga schema to {args.role}")
    return EXIT_OK


class _StopSignals:
    """SIGTERM and SIGINT for `saga worker`, from its first moment: before the app is
    imported and the database reached, a signal is remembered (the worker then stops
    before it drives anything); once the worker exists, it stops it gracefully."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._worker: Worker | AsyncWorker | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopSignals:
        early = _entry.installed()
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._previous[signum] = signal.signal(signum, self._on_signal)
        # One that came while the command itself was being imported (see saga/_entry.py).
        if early and _entry.received is not None:
            self._on_signal(_entry.received, None)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.received = signal.Signals(signum).name
        get_logger("saga.worker").info("worker_stopping", signal=self.received)
        if self._worker is not None:
            self._worker.stop()

    @contextlib.contextmanager
    def on_loop(self) -> Iterator[None]:
        """The same handling through the running event loop, which wakes at once."""
        loop = asyncio.get_running_loop()
        installed: list[signal.Signals] = []
        for signum in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(signum, self._on_signal, signum, None)
            except (NotImplementedError, RuntimeError, ValueError):
                continue
            installed.append(signum)
        try:
            yield
        finally:
            for signum in installed:
                loop.remove_signal_handler(signum)
                signal.signal(signum, self._on_signal)

    def hand_to(self, worker: Worker | AsyncWorker) -> None:
        """From now on a signal stops `worker` (at once if one came already)."""
        self._worker = worker
        if self.received is not None:
            worker.stop()


def _worker(args: argparse.Namespace) -> int:
    # Signals first: a SIGTERM while the app is imported or the database reached (a
    # deployment replacing a worker it has just started) stops it with exit 0.
    with _StopSignals() as signals:
        orch = load_app(args.app, args.database_url)
        if args.metrics_port is not None and signals.received is None:
            _serve_metrics(*args.metrics_port)
        if isinstance(orch, AsyncOrchestrator):
            return asyncio.run(
                _async_worker(orch, args.concurrency, args.listen_url, signals=signals)
            )
        with orch:
            kinds = ", ".join(f"{s.name} v{s.version}" for s in orch.registered())
            # Connect (and migrate) now, and check the role may drive sagas: a refused
            # login, a malformed URL or a role without the privileges fails before the
            # worker is announced. A database it cannot reach yet is waited for by the
            # worker (logged).
            try:
                if signals.received is None:
                    orch.store.check_privileges("worker")
            except Exception as exc:
                if not unreachable(exc, orch.database_url):
                    raise
            if signals.received is None:
                _announce(
                    f"worker {orch.owner}: driving {kinds} with concurrency {args.concurrency} "
                    f"on {describe_url(orch.database_url)}; SIGTERM or Ctrl-C stops it "
                    "gracefully",
                    "worker_ready",
                    owner=orch.owner,
                )
                worker = orch.worker(concurrency=args.concurrency, listen_url=args.listen_url)
                signals.hand_to(worker)
                worker.run(handle_signals=False)
        _announce(_stopped(orch.owner, signals), "worker_exited", owner=orch.owner)
        return EXIT_OK


def _stopped(owner: str, signals: _StopSignals) -> str:
    if signals.received is None:
        return f"worker {owner}: stopped"
    return f"worker {owner}: stopped ({signals.received})"


def _serve_metrics(host: str, port: int) -> None:
    """`saga worker --metrics-port`: serve the process's metrics for Prometheus (see
    `saga.telemetry.serve_prometheus`) before the worker starts."""
    from saga.telemetry import MetricsUnavailable, serve_prometheus

    try:
        bound = serve_prometheus(port, host)
    except MetricsUnavailable as exc:
        raise UsageError(f"--metrics-port: {exc}") from None
    except OSError as exc:
        raise UsageError(f"--metrics-port: cannot listen on {host or '*'}:{port}: {exc}") from None
    shown = f"[{host}]" if ":" in host else host or "0.0.0.0"
    _announce(f"metrics for Prometheus at http://{shown}:{bound}/metrics", "metrics_serving")


async def _async_worker(
    orch: AsyncOrchestrator,
    concurrency: int,
    listen_url: str | None = None,
    *,
    signals: _StopSignals | None = None,
) -> int:
    """`saga worker` for an AsyncOrchestrator app: an AsyncWorker on this loop, stopped
    gracefully by SIGTERM or SIGINT; the orchestrator is closed before the loop ends."""
    with contextlib.ExitStack() as stack:
        if signals is None:
            signals = stack.enter_context(_StopSignals())
        stack.enter_context(signals.on_loop())
        try:
            kinds = ", ".join(f"{s.name} v{s.version}" for s in orch.registered())
            # As for a sync app: refusals fail here, an unreachable database is waited for.
            try:
                if signals.received is None:
                    await (await orch.store()).check_privileges("worker")
            except Exception as exc:
                if not unreachable(exc, orch.database_url):
                    raise
            if signals.received is None:
                _announce(
                    f"worker {orch.owner}: driving {kinds} with concurrency {concurrency} "
                    f"(asyncio) on {describe_url(orch.database_url)}; SIGTERM or Ctrl-C "
                    "stops it gracefully",
                    "worker_ready",
                    owner=orch.owner,
                )
                worker = orch.worker(concurrency=concurrency, listen_url=listen_url)
                signals.hand_to(worker)
                await worker.run(handle_signals=False)
        finally:
            await orch.close()
        _announce(_stopped(orch.owner, signals), "worker_exited", owner=orch.owner)
    return EXIT_OK


def _list(args: argparse.Namespace) -> int:
    from datetime import timedelta

    with _reader(args.database_url) as orch:
        states = orch.list(
            status=args.status,
            saga=args.saga,
            tenant=args.tenant,
            limit=args.limit,
            older_than=None if args.older_than is None else timedelta(seconds=args.older_than),
            key=args.key,
        )
        known = {kind for worker in orch.workers() for kind in worker.kinds}
    if args.json:
        for state in states:
            print(fmt.to_json(state, known_kinds=known))
    elif states:
        print(fmt.saga_list(states, known))
    else:
        print("no sagas match", file=sys.stderr)
    return EXIT_OK


def _show(args: argparse.Namespace) -> int:
    if args.json and args.format not in (None, "json"):
        raise UsageError(f"--json and --format {args.format} ask for two formats; give one")
    form = "json" if args.json else args.format or "text"
    with _reader(args.database_url) as orch:
        state = orch.get(_full_id(orch, args))
        history = orch.history(state.id)
    if form == "json":
        print(fmt.to_json(state, history))
    elif form == "mermaid":
        print(fmt.mermaid(state, history))
    else:
        print(fmt.show(state, history))
    return EXIT_OK


def _history(args: argparse.Namespace) -> int:
    with _reader(args.database_url) as orch:
        state = orch.get(_full_id(orch, args))
        history = orch.history(state.id)
    print(fmt.history_json(state, history) if args.json else fmt.history(state, history))
    return EXIT_OK


def _compensate(args: argparse.Namespace) -> int:
    batch_only = [
        ("--status", args.status),
        ("--saga", args.saga),
        ("--tenant", args.tenant),
        ("--older-than", args.older_than),
    ]
    if args.saga_id and args.status:
        raise UsageError("give either a saga ID or --status for a batch, not both")
    if args.saga_id is None and args.status is None:
        raise UsageError("give a saga ID, or select a batch with --status (e.g. needs_review)")
    if args.saga_id is not None:
        extra = [flag for flag, value in batch_only if value is not None]
        if extra:
            raise UsageError(f"{', '.join(extra)} select a batch; they do not go with a saga ID")
    orch = _operator(args)
    actor = _actor(args)
    with orch:
        if args.saga_id is not None:
            states = [orch.get(_full_id(orch, args))]
        else:
            from datetime import timedelta

            states = orch.list(
                status=args.status,
                saga=args.saga,
                tenant=args.tenant,
                limit=args.limit,
                older_than=None if args.older_than is None else timedelta(seconds=args.older_than),
            )
        batch = args.saga_id is None
        if args.dry_run:
            plans = admin.dry_run(
                orch, states, include_unknown=args.include_unknown, force=args.force, batch=batch
            )
            print("\n".join(fmt.plan_json(plans)) if args.json else fmt.plan(plans))
            return EXIT_OK
        if batch and not states and not args.json:
            print("compensate: no sagas match; nothing to do")
            return EXIT_OK
        progress = fmt.ProgressLine("compensating")
        show = _outcome_printer(args, progress)

        report = admin.compensate_batch(
            orch,
            states,
            include_unknown=args.include_unknown,
            actor=actor,
            force=args.force,
            batch=batch,
            progress=progress,
            on_outcome=show,
        )
        progress.clear()
    if args.json:
        print(fmt.summary_json(report, "compensate"))
    else:
        print(fmt.summary(report, "compensate"))
    return EXIT_OK if report.complete else EXIT_PARTIAL


def _outcome_printer(
    args: argparse.Namespace, progress: fmt.ProgressLine
) -> Callable[[admin.Outcome], None]:
    """How a batch job prints each saga's outcome: a text line, or a JSON line."""
    given = _given(args)

    def show(outcome: admin.Outcome) -> None:
        progress.clear()
        if args.json:
            print(fmt.outcome_json(outcome, given), flush=True)
        else:
            print(fmt.outcome_line(outcome, given), flush=True)

    return show


def _resolve(args: argparse.Namespace) -> int:
    if args.failed and not args.reason:
        raise UsageError("--failed needs --reason TEXT saying why")
    if args.failed and args.result is not None:
        raise UsageError("--result goes with --succeeded, not --failed")
    result: Any = None
    if args.result is not None:
        try:
            result = json.loads(args.result)
        except json.JSONDecodeError as exc:
            raise UsageError(f"--result is not valid JSON: {exc}") from None
    orch = _operator(args, runs_code=args.run)
    actor = _actor(args)
    outcome: Literal["succeeded", "failed"] = "succeeded" if args.succeeded else "failed"
    with orch:
        saga_id = _full_id(orch, args)
        try:
            state = orch.resolve(
                saga_id,
                args.step,
                outcome=outcome,
                result=result,
                actor=actor,
                reason=args.reason,
                kind=args.kind,
                force=args.force,
            )
        except pydantic.ValidationError as exc:
            raise UsageError(f"--result does not fit step {args.step!r}: {_errors(exc)}") from None
        except AmbiguousCall as exc:
            raise UsageError(str(exc)) from None
        except NotRegistered as exc:
            if args.app:
                raise
            raise UsageError(
                f"pass --app MODULE[:ATTR] (or set {ENV_APP}) naming the module that "
                f"registers saga {exc.name!r} version {exc.version}: its steps' results are "
                "checked by your code"
            ) from None
        last = orch.history(state.id)[-1]
        if last.event == "result_amended":
            print(
                f"amended the result of {last.step!r} of saga {state.id}, by {actor}: "
                f"{fmt.one_line(json.dumps(last.detail.get('previous_result'), default=str))} -> "
                f"{fmt.one_line(json.dumps(last.detail.get('result'), default=str))}"
            )
        else:
            print(f"resolved {args.step!r} of saga {state.id} as {outcome}, by {actor}")
        if args.succeeded and args.result is None:
            _warn_null_result(orch, state, args.step, args.kind)
        return _after_request(orch, state, args.run, _given(args))


def _warn_null_result(orch: Orchestrator, state: SagaState, step: str, kind: str | None) -> None:
    """A step resolved as succeeded without --result has the result null, which its
    compensation receives: say so when it has one."""
    try:
        op = state.operation(step, "compensation" if kind == "compensation" else "action")
    except KeyError:
        return
    if op.kind != "action" or op.result is not None:
        return  # the compensation itself was resolved, or the step has its result
    declared = orch.definition(state.saga, state.version).step_named(step)
    comp = None if declared is None else declared.compensation_op
    if comp is None:
        return
    name = getattr(comp.fn, "__name__", "compensation")
    print(
        f"saga: warning: {step!r} is resolved as succeeded without --result, so its "
        f"compensation {name!r} will receive null as the step's result if the saga is "
        "compensated; if it needs one, give what the provider returned before then: "
        f"saga resolve {state.id} {step} --succeeded --result JSON",
        file=sys.stderr,
    )


def _retry(args: argparse.Namespace) -> int:
    orch = _operator(args)
    actor = _actor(args)
    raising = {
        "max_operations": args.max_operations,
        "spend_budget": args.spend_budget,
        "max_side_effects": args.max_side_effects,
        "extend_deadline_seconds": args.extend_deadline,
    }
    if any(v is not None for v in raising.values()):
        if args.extra_attempts:
            raise UsageError("--extra-attempts and the saga ceiling options go in two runs")
        with orch:
            state = orch.raise_ceilings(
                _full_id(orch, args), actor=actor, force=args.force, **raising
            )
            given = ", ".join(f"{k}={v:g}" for k, v in raising.items() if v is not None)
            print(f"raised ceilings of saga {state.id}, by {actor}: {given}")
            return _after_request(orch, state, args.run, _given(args))
    with orch:
        state = orch.retry(
            _full_id(orch, args),
            extra_attempts=args.extra_attempts,
            actor=actor,
            force=args.force,
        )
        last = next(e for e in reversed(orch.history(state.id)) if e.event == "retry_requested")
        what = last.step if last.kind == "action" else f"compensation of {last.step}"
        print(
            f"retrying {what!r} of saga {state.id}, by {actor}: "
            f"ceiling {last.detail.get('previous_max_attempts')} -> "
            f"{last.detail.get('max_attempts')}, {last.attempt or 0} attempt(s) used"
        )
        return _after_request(orch, state, args.run, _given(args))


def _cancel(args: argparse.Namespace) -> int:
    orch = _operator(args)
    actor = _actor(args)
    with orch:
        before = orch.get(_full_id(orch, args))
        if before.status is SagaStatus.COMPENSATED:
            raise StepStateError(_nothing_to_cancel(before))
        planned = admin.cancel_plan(orch, before, include_unknown=args.include_unknown)
        preview = _cancel_preview(planned, include_unknown=args.include_unknown)
        why = admin.refusal(orch, before, force=args.force, batch=False) if preview else None
        if why is not None:  # refused anyway: no warning, and no question asked
            raise StepStateError(why)
        for line in preview:
            print(line, flush=True)
        parks = planned is not None and planned.stop is not None
        if parks and not args.yes and not _confirmed(f"cancel saga {before.id} anyway? [y/N] "):
            print(f"cancel: nothing was changed; saga {before.id} is {before.status}")
            return EXIT_PARTIAL
        state = orch.cancel(
            before.id,
            reason=args.reason,
            actor=actor,
            include_unknown=args.include_unknown,
            force=args.force,
        )
        if state.status == SagaStatus.COMPENSATED:
            # Compensated meanwhile (a cancel itself drives nothing): as above.
            raise StepStateError(_nothing_to_cancel(state))
        if before.status == state.status and before.updated_at == state.updated_at:
            print(f"saga {state.id} is already {state.status}; nothing to cancel")
        else:
            print(f"cancelled saga {state.id}, by {actor}: {args.reason}")
        return _after_request(orch, state, args.run, _given(args))


def _nothing_to_cancel(state: SagaState) -> str:
    """A compensated saga is refused as a completed one is: it has ended."""
    return (
        f"saga {state.id} is compensated: it has ended and what it did is undone, so there "
        "is nothing to cancel"
    )


def _confirmed(question: str) -> bool:
    """The operator's yes on a terminal; `UsageError` when there is none to ask on."""
    if not (sys.stdin.isatty() and sys.stderr.isatty()):
        raise UsageError(
            "this cancel would leave the saga parked in needs_review (see above) and there "
            "is no terminal to confirm it on: pass --yes to cancel anyway; nothing was changed"
        )
    print(question, end="", file=sys.stderr, flush=True)
    try:
        answer = sys.stdin.readline()
    except KeyboardInterrupt:
        answer = ""
    return answer.strip().lower() in ("y", "yes")


def _fork(args: argparse.Namespace) -> int:
    orch = _operator(args)
    actor = _actor(args)
    with orch:
        source = _full_id(orch, args)
        # The same fork asked for again (same step and key) is returned, not made twice.
        handle = orch.fork(source, args.from_step, key=args.key, actor=actor)
        if args.json:
            print(
                json.dumps(
                    {
                        "id": handle.id,
                        "key": handle.key,
                        "created": handle.created,
                        "forked_from": source,
                        "from_step": args.from_step,
                    },
                    separators=(",", ":"),
                )
            )
            return EXIT_OK
        print(handle.id)
        if handle.created and handle.saga.startswith(SESSION_PREFIX):
            print(
                f"session {handle.id} was forked from {source} at call {args.from_step!r}, by "
                f"{actor}: it is pending; run the session's code with run id {handle.key!r} "
                "to continue it"
            )
        elif handle.created:
            print(
                f"saga {handle.id} was forked from {source} at step {args.from_step!r}, by "
                f"{actor}: it is pending, a worker will drive it"
            )
        else:
            status = orch.get(handle.id).status
            print(
                f"saga {source} was already forked to {handle.id} at step "
                f"{args.from_step!r} (key {handle.key}); nothing changed, the fork is {status}"
            )
        return EXIT_OK


def _cancel_preview(planned: admin.PlannedSaga | None, *, include_unknown: bool) -> list[str]:
    """What a cancel will do, said before it acts: the compensations that will get None
    as a step's result, and, when its compensation will stop, what it undoes before the
    saga parks, and why. Nothing when it runs to the end with every result."""
    if planned is None:
        return []
    lines = [
        f"cancel: warning: {fmt.null_result_warning(planned.saga_id, step, name)}"
        for step, name in planned.null_results
    ]
    if planned.stop is not None:
        undo = ", ".join(repr(step) for step, _ in planned.compensations)
        runs = (
            f"it will run the compensations of {undo}, then" if undo else "it will undo nothing and"
        )
        lines.insert(
            0,
            f"cancel: {runs} the saga will park in needs_review: "
            + fmt.cli_wording(planned.stop, {"--include-unknown": include_unknown}).replace(
                "compensate with --include-unknown", "cancel with --include-unknown"
            ),
        )
    return lines


def _preview(args: argparse.Namespace) -> int:
    with _reader(args.database_url) as orch:
        state = orch.get(_full_id(orch, args))
        pending = orch.preview(state.id)
    if pending is None:
        print(f"saga {state.id} is {state.status}: it waits for no confirmation")
        return EXIT_PARTIAL
    if args.json:
        print(pending.model_dump_json())
        return EXIT_OK
    view = pending.preview
    print(f"saga {state.id} ({state.saga} v{state.version}, key {state.key})")
    print(f"  waits for confirmation of {view.get('target')} until {pending.expires_at}")
    print(f"  request hash: {pending.request_hash}")
    print(f"  attempt:      {view.get('attempt')} (an approval releases this attempt only)")
    print(f"  amount:       {view.get('amount')}")
    print(f"  payload:      {json.dumps(view.get('payload'), sort_keys=True)}")
    if "input" in view:
        print(f"  input:        {json.dumps(view['input'], sort_keys=True)}")
    if view.get("results"):
        print(f"  results:      {json.dumps(view['results'], sort_keys=True)}")
    for check in view.get("policy_checks", []):
        print(f"  check:        {json.dumps(check, sort_keys=True)}")
    print(f"approve with: saga confirm {state.id} {pending.step} {pending.request_hash}")
    return EXIT_OK


def _confirm(args: argparse.Namespace) -> int:
    # A key file that cannot be read is refused before the app is loaded.
    signer = None if args.private_key is None else _signer(args.private_key)
    orch = _operator(args)
    actor = _actor(args)
    with orch:
        saga_id = _full_id(orch, args)
        if signer is None:
            token = orch.approval(saga_id, args.step, args.request_hash, actor=actor)
        else:
            token = signer.approval(saga_id, args.step, args.request_hash, actor=actor)
        state = orch.confirm(saga_id, args.step, args.request_hash, token)
        print(f"confirmed {args.step!r} of saga {state.id}, request {args.request_hash}")
        signed = "" if signer is None else f", signed with key {signer.key_id}"
        print(f"approved by {actor}{signed}")
        return _after_request(orch, state, args.run, _given(args))


def _signer(path: str) -> ApprovalSigner:
    """The approvers' signer of the private key in the file `path`; `UsageError` saying
    what is wrong with it."""
    try:
        return ApprovalSigner.from_private_key(Path(path))
    except ValueError as exc:
        raise UsageError(f"--private-key {path}: {exc}") from None


def _keygen(args: argparse.Namespace) -> int:
    signer = ApprovalSigner.generate()
    path = Path(args.private_key)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if args.overwrite else os.O_EXCL)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        raise UsageError(
            f"--private-key {path} exists already: keep that key, or pass --overwrite to "
            "replace it (approvals it signed are then refused by workers given the new key)"
        ) from None
    except OSError as exc:
        raise UsageError(f"--private-key {path}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "w", encoding="ascii") as out:
        os.fchmod(out.fileno(), 0o600)  # also when an existing file is replaced
        out.write(signer.private_key_pem())
    print(signer.public_key)
    print(
        f"wrote the private key {signer.key_id} to {path}: keep it with the approvers "
        f"(saga confirm ID STEP HASH --private-key {path}). Give the public key above to "
        f"every worker and to the app: {ENV_APPROVAL_PUBLIC_KEY}=<public key> or "
        "Orchestrator(approval_public_key=...)",
        file=sys.stderr,
    )
    return EXIT_OK


def _purge(args: argparse.Namespace) -> int:
    app = blocking(load_app(args.app, args.database_url)) if args.app else None
    days, source = _purge_cutoff(args, None if app is None else app.retention_days)
    verb = "dry run: would purge" if args.dry_run else "purging"
    print(f"{verb} sagas that ended more than {days:g} days ago ({source})", file=sys.stderr)
    # The app's own Orchestrator purges with its retention; else one with the chosen one.
    retention = DEFAULT_RETENTION_DAYS if args.retention_days is None else args.retention_days
    orch = app or Orchestrator(
        args.database_url or None, auto_migrate=False, retention_days=retention
    )
    with orch:
        if args.dry_run:
            found, total = admin.purge_candidates(orch, older_than_days=days, limit=args.limit)
            if args.json:
                print("\n".join(fmt.purge_json(found, total)))
            else:
                print(fmt.purge_list(found, total))
            return EXIT_OK
        deleted = orch.purge(older_than_days=days, batch_size=args.batch_size)
    if args.json:
        summary = {"summary": True, "command": "purge", "purged": deleted, "older_than_days": days}
        print(json.dumps(summary, separators=(",", ":")))
    else:
        print(f"purged {deleted} ended saga(s)")
    return EXIT_OK


def _purge_cutoff(args: argparse.Namespace, app_retention: float | None) -> tuple[float, str]:
    """The age in days past which `purge` deletes an ended saga, and where it comes from:
    --older-than, else --retention-days, else the app's retention_days, else the default.
    Neither option may go below the app's retention (nor --older-than below the
    retention)."""
    if app_retention is None:
        retention = DEFAULT_RETENTION_DAYS
        source = "the default retention; --app applies your app's retention_days"
    else:
        retention = app_retention
        source = f"retention_days of the app's orchestrator, {args.app}"
    if args.retention_days is not None:
        if app_retention is not None and args.retention_days < app_retention:
            raise UsageError(
                f"--retention-days {args.retention_days:g} is shorter than the retention of "
                f"{app_retention:g} days of the app's orchestrator ({args.app}): purge never "
                "deletes what the app keeps"
            )
        retention, source = args.retention_days, "--retention-days"
    if args.older_than is None:
        return retention, source
    days = args.older_than / 86400.0
    if days < retention:
        raise UsageError(
            f"--older-than ({days:g} days) is shorter than the retention of {retention:g} "
            f"days ({source})"
        )
    return days, f"--older-than; the retention is {retention:g} days, {source}"


def _after_request(
    orch: Orchestrator, state: SagaState, run: bool, given: dict[str, object]
) -> int:
    if run and state.status.is_runnable:
        state = orch.run(state.id)
    if state.status == SagaStatus.NEEDS_REVIEW:
        reason = fmt.printable(fmt.cli_wording(state.error or "", given))
        print(f"saga {state.id} is needs_review: {reason}")
        return EXIT_PARTIAL
    if state.status.is_runnable:
        holder = f"; {state.lease_owner} is driving it" if state.lease_owner else ""
        drive = fmt.code_first(state.saga, state.status) or "a worker will drive it"
        print(f"saga {state.id} is {fmt.status_text(state)}: {drive}{holder}")
    else:
        print(f"saga {state.id} is {fmt.status_text(state)}")
    return EXIT_OK


def _reconcile(args: argparse.Namespace) -> int:
    orch = _operator(args)
    progress = fmt.ProgressLine("reconciling")
    show = _outcome_printer(args, progress)
    with orch:
        report = admin.reconcile(orch, limit=args.limit, progress=progress, on_outcome=show)
        progress.clear()
    if args.json:
        print(fmt.summary_json(report, "reconcile"))
    elif not report.selected:
        print("reconcile: no operation is left running under an expired lease or unknown")
    else:
        print(fmt.summary(report, "reconcile"))
    return EXIT_OK if report.complete else EXIT_PARTIAL


def _upgrade(args: argparse.Namespace) -> int:
    step_map: dict[str, str] = {}
    for old, new in args.step_map:
        if step_map.get(old, new) != new:
            raise UsageError(f"--map {old}=... is given twice: {old}={step_map[old]}, {old}={new}")
        step_map[old] = new
    batch_only = [
        ("--saga", args.saga),
        ("--version", args.from_version),
        ("--status", args.status),
    ]
    if args.saga_id is not None:
        extra = [flag for flag, value in batch_only if value is not None]
        if extra:
            raise UsageError(f"{', '.join(extra)} select a batch; they do not go with a saga ID")
    elif args.saga is None or args.from_version is None:
        raise UsageError("give a saga ID, or select a batch with --saga NAME and --version V")
    orch = _operator(args)
    actor = _actor(args)
    refused = upgraded = 0
    with orch:
        if args.saga_id is not None:
            ids = [_full_id(orch, args)]
        else:
            ids = [
                s.id
                for s in orch.list(saga=args.saga, limit=args.limit)
                if s.version == args.from_version
                and not s.status.is_terminal
                and (not args.status or s.status in args.status)
            ]
        for saga_id in ids:
            try:
                if args.dry_run:
                    plan = orch.upgrade_plan(saga_id, args.to_version, step_map=step_map)
                    if not plan.allowed:
                        raise UpgradeRefused(plan)
                    state = None
                else:
                    state = orch.upgrade(saga_id, args.to_version, step_map=step_map, actor=actor)
                    plan = _last_upgrade(orch, state)
            except UpgradeRefused as exc:
                refused += 1
                _print_upgrade(args, exc.plan, None)
                continue
            upgraded += 1
            _print_upgrade(args, plan, state, actor)
    if args.json:
        summary = {
            "summary": True,
            "command": "upgrade",
            "dry_run": args.dry_run,
            "allowed": upgraded,  # with --dry-run: would be upgraded
            "upgraded": 0 if args.dry_run else upgraded,
            "refused": refused,
        }
        print(json.dumps(summary, separators=(",", ":")))
    elif args.saga_id is None:
        verb = "can be upgraded" if args.dry_run else "upgraded"
        print(
            f"upgrade: {len(ids)} saga(s) of {args.saga} v{args.from_version} selected, "
            f"{upgraded} {verb} to v{args.to_version}, {refused} refused"
        )
    return EXIT_PARTIAL if refused else EXIT_OK


def _last_upgrade(orch: Orchestrator, state: SagaState) -> UpgradePlan:
    """The plan the upgrade that left `state` made, as its `saga_upgraded` event records it."""
    event = next(e for e in reversed(orch.history(state.id)) if e.event == "saga_upgraded")
    return UpgradePlan.recorded(state, event)


def _print_upgrade(
    args: argparse.Namespace,
    plan: UpgradePlan,
    state: SagaState | None,
    actor: str | None = None,
) -> None:
    if args.json:
        data = plan.as_dict()
        data["dry_run"] = args.dry_run
        data["upgraded"] = state is not None
        print(json.dumps(data, separators=(",", ":")), flush=True)
        return
    print(fmt.upgrade(plan, dry_run=args.dry_run, actor=actor, state=state), flush=True)


def _versions(args: argparse.Namespace) -> int:
    registered: set[tuple[str, int]] | None = None
    if args.app:
        app = blocking(load_app(args.app, args.database_url))
        registered = {(s.name, s.version) for s in app.registered()}
        app.close()
    with _reader(args.database_url) as orch:
        rows = admin.versions_in_flight(orch.store, registered)
    if args.json:
        for line in fmt.versions_json(rows):
            print(line)
    elif rows:
        print(fmt.versions(rows, args.app))
    else:
        print("no saga is in flight", file=sys.stderr)
    # A pre-deploy gate: sagas in flight of a version the app does not register would
    # wait for a worker that never comes (sessions and ledger channels have no version).
    stranded = [
        r
        for r in rows
        if r.registered is False
        and r.in_flight
        and not r.saga.startswith((SESSION_PREFIX, LEDGER_PREFIX))
    ]
    return EXIT_PARTIAL if stranded else EXIT_OK


# How to install what `saga dashboard` needs, and the modules it needs.
WEB_EXTRA = "pip install 'saga-orchestrator[web]'"
_WEB_MODULES = {"starlette", "jinja2", "uvicorn"}


def _port(text: str) -> int:
    port = _non_negative(text)
    if port > 65535:
        raise argparse.ArgumentTypeError(f"expected a port from 0 to 65535, got {port}")
    return port


def _dashboard(args: argparse.Namespace) -> int:
    try:
        # Imported here only: the dashboard's dependencies are an optional extra.
        from saga import web
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").partition(".")[0]
        if missing not in _WEB_MODULES:
            raise
        raise UsageError(
            f"the dashboard needs the web extra, and {missing} is not installed: {WEB_EXTRA}"
        ) from None
    # A signal while the command and the web framework were imported stops it cleanly.
    early = _entry.take()
    if early is not None:
        _announce(f"saga dashboard: stopped ({early.name})", "dashboard_stopped")
        return EXIT_OK
    try:
        web.serve(
            args.database_url,
            host=args.host,
            port=args.port,
            verbose=args.verbose,
            log_formatter=_stdlib_formatter(),
            announce=_announce,
        )
    except web.DashboardError as exc:
        raise UsageError(str(exc)) from None
    return EXIT_OK


_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "migrate": _migrate,
    "grant": _grant,
    "worker": _worker,
    "list": _list,
    "show": _show,
    "history": _history,
    "compensate": _compensate,
    "resolve": _resolve,
    "retry": _retry,
    "cancel": _cancel,
    "fork": _fork,
    "reconcile": _reconcile,
    "preview": _preview,
    "confirm": _confirm,
    "keygen": _keygen,
    "purge": _purge,
    "upgrade": _upgrade,
    "versions": _versions,
    "dashboard": _dashboard,
}


# ----- errors --------------------------------------------------------------------------


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _errors(exc: pydantic.ValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ())) or "value"
        parts.append(f"{where}: {err.get('msg')}")
    return "; ".join(parts)


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
    args = _parser().parse_args(argv)
    _configure_logging(_log_level(args), args.log_format)
    urls = (getattr(args, "database_url", None),)
    try:
        if args.command not in {"worker", "dashboard"}:  # they handle signals themselves
            _entry.release()
        return _COMMANDS[args.command](args)
    except UsageError as exc:
        return _fail(f"{args.command}: {exc}", EXIT_USAGE, urls)
    except StepStateError as exc:
        return _fail(f"refused: {fmt.cli_wording(str(exc), _given(args))}", EXIT_PARTIAL, urls)
    except SchemaMissing as exc:
        return _fail(_schema_missing(exc, args), EXIT_PARTIAL, urls)
    except SagaError as exc:
        return _fail(fmt.cli_wording(str(exc), _given(args)), EXIT_PARTIAL, urls)
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
            f"unexpected error: {_one_line(exc)} (SAGA_TRACEBACK=1 shows where)", EXIT_PARTIAL, urls
        )


if __name__ == "__main__":
    sys.exit(main())
