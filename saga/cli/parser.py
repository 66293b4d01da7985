"""The `saga` command's arguments: the parser of every verb, and the values they take."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import NoReturn

from saga import __version__
from saga._app import ENV_APP
from saga._db.roles import ROLE_KINDS
from saga.cli import admin
from saga.orchestrator import ENV_APPROVAL_PUBLIC_KEY, ENV_CONFIRMATION_KEY
from saga.state import SagaStatus

EXIT_OK = 0
EXIT_PARTIAL = 1
EXIT_USAGE = 2
# --log-format.
LOG_FORMATS = ("console", "json")
# The retention `saga purge` applies without --app or --retention-days, as Orchestrator's.
DEFAULT_RETENTION_DAYS = 30.0
# How to install what `saga dashboard` needs.
WEB_EXTRA = "pip install 'saga-orchestrator[web]'"

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


def _port(text: str) -> int:
    port = _non_negative(text)
    if port > 65535:
        raise argparse.ArgumentTypeError(f"expected a port from 0 to 65535, got {port}")
    return port


def build_parser() -> argparse.ArgumentParser:
    """The parser of the `saga` command and its verbs."""
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
