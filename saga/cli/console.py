"""What the `saga` command writes on stderr: its logs, in the --log-format chosen, and the
lines a long-running command announces itself with."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

import structlog

from saga.logs import EVENTS_CHANNEL

# The commands that run until stopped, which log at info by default.
_LONG_RUNNING = frozenset({"worker", "dashboard"})
_log_format = "console"


def log_level(args: argparse.Namespace) -> int:
    """The level the command logs at. -v: debug (every saga event); -q: warnings; else
    info for the long-running commands, whose lifecycle (started, stopping, migrations)
    an operator follows, and warnings for one-shot commands, whose output is their report
    on stdout."""
    if args.verbose:
        return logging.DEBUG
    if args.quiet or args.command not in _LONG_RUNNING:
        return logging.WARNING
    return logging.INFO


def configure_logging(level: int, log_format: str = "console") -> None:
    """Log from `level` up on stderr, in `log_format`: stdout carries the command's output
    (tables, JSON)."""
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


def stdlib_formatter() -> logging.Formatter:
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


def announce(text: str, event: str, *, level: str = "info", **fields: object) -> None:
    """A line of a long-running command on stderr (it started, where, it stopped), shown
    whatever the log level: as is, or with --log-format json as a JSON object whose
    `message` is the line, so that every line of stderr parses."""
    if _log_format == "json":
        now = datetime.now(UTC).isoformat().replace("+00:00", "Z")
        record = {"event": event, "message": text, **fields, "level": level, "timestamp": now}
        text = json.dumps(record, default=str)
    print(text, file=sys.stderr, flush=True)
