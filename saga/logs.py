"""The library's loggers: events go where the application sends them, and logging never fails.

Until the application configures structlog itself, events are `structlog.stdlib` events on
`logging.getLogger("saga")` (and its children), so the application's `logging` set-up
decides where they go and from which level: with none, Python shows warnings and errors on
stderr and drops the info events. Once the application has called `structlog.configure()`
(or a test uses `structlog.testing.capture_logs()`), events go through that configuration,
decided at each call. Either way a failing handler, processor or closed stream is
swallowed: the orchestrator's work never depends on its logs being written.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import structlog

from saga.redact import redact, scrub

# What the stdlib path renders: a "event key=value ..." message for any handler, and the
# fields themselves on the record as `saga_event` and `saga_fields`.
_RENDER = structlog.processors.KeyValueRenderer(sort_keys=False)


def _to_stdlib(logger: Any, method: str, event_dict: structlog.typing.EventDict) -> Any:
    exc_info = event_dict.pop("exc_info", None)
    event = str(event_dict.pop("event", ""))
    fields = dict(event_dict)
    rendered = _RENDER(logger, method, event_dict)
    message = f"{event} {rendered}" if rendered else event
    extra = {"saga_event": event, "saga_fields": fields}
    return (message,), {"exc_info": exc_info, "extra": extra}


_STDLIB_PROCESSORS: list[structlog.typing.Processor] = [
    structlog.stdlib.filter_by_level,
    _to_stdlib,
]


# The level of each logging method of `SafeLogger`.
_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "exception": logging.ERROR,
}


def _scrubbed(values: dict[str, Any]) -> dict[str, Any]:
    return {k: redact(v) if isinstance(v, str) else v for k, v in values.items()}


class SafeLogger:
    """A logger of the library: the application's structlog, else stdlib `logging`;
    every call swallows any exception raised while logging."""

    def __init__(self, name: str, *, channel: str | None = None, **initial: Any) -> None:
        self.name = name
        # The name a configured structlog's logger factory is given (`name` unless set):
        # the saga's own events are "saga.events" there, so an output can tell them apart.
        self.channel = channel or name
        self._initial = initial
        # `is_enabled_for`'s check, with the structlog configuration it was made under.
        self._check: tuple[tuple[Any, Any], Any] | None = None

    def bind(self, **values: Any) -> SafeLogger:
        """This logger with more bound fields."""
        return SafeLogger(self.name, channel=self.channel, **{**self._initial, **values})

    def resolve(self) -> Any:
        """The structlog logger this call goes through (configured now, or stdlib)."""
        if structlog.is_configured():
            return structlog.get_logger(self.channel, **self._initial)
        return structlog.wrap_logger(
            logging.getLogger(self.name),
            processors=_STDLIB_PROCESSORS,
            wrapper_class=structlog.stdlib.BoundLogger,
            cache_logger_on_first_use=False,
            **self._initial,
        )

    def is_enabled_for(self, level: int) -> bool:
        """Whether an event at `level` would be handled (True when that cannot be known)."""
        try:
            if not structlog.is_configured():
                return logging.getLogger(self.name).isEnabledFor(level)
            # The logger bound to check with is made again only when the configuration's
            # wrapper class or logger factory changes: binding one costs more than the
            # check, which is made for every committed write (`saga._drivers.observe`).
            config = structlog.get_config()
            under = (config["wrapper_class"], config["logger_factory"])
            made = self._check
            if made is None or made[0][0] is not under[0] or made[0][1] is not under[1]:
                made = self._check = (under, getattr(self.resolve().bind(), "is_enabled_for", None))
            check = made[1]
            return True if check is None else bool(check(level))
        except Exception:
            return True

    def _log(self, method: str, event: str, values: dict[str, Any]) -> None:
        # An event below the level handled is dropped before the logger is resolved and
        # its values scrubbed (which cost some twenty times the check).
        if not self.is_enabled_for(_LEVELS[method]):
            return
        # A log sink that fails (a closed pipe, a raising handler) changes nothing.
        with contextlib.suppress(Exception):
            getattr(self.resolve(), method)(event, **_scrubbed(values))

    def debug(self, event: str, **values: Any) -> None:
        """Log `event` at debug level."""
        self._log("debug", event, values)

    def info(self, event: str, **values: Any) -> None:
        """Log `event` at info level."""
        self._log("info", event, values)

    def warning(self, event: str, **values: Any) -> None:
        """Log `event` at warning level."""
        self._log("warning", event, values)

    def error(self, event: str, **values: Any) -> None:
        """Log `event` at error level."""
        self._log("error", event, values)

    def exception(self, event: str, **values: Any) -> None:
        """Log `event` at error level with the exception being handled."""
        self._log("exception", event, values)


def get_logger(name: str = "saga", **initial: Any) -> SafeLogger:
    """The library's logger `name` (a child of "saga"), bound with `initial` fields."""
    return SafeLogger(name, **initial)


# The events of the audit trail, one per committed transition of a saga: the stdlib
# `logging` record's logger is "saga" as for every library event; a configured structlog's
# logger factory is given "saga.events" (the `saga` command shows them with -v only).
EVENTS_CHANNEL = "saga.events"


def events_logger() -> SafeLogger:
    """The logger of the saga's own events (`saga_started`, `attempt_succeeded`...)."""
    return SafeLogger("saga", channel=EVENTS_CHANNEL)


def step_logger(**initial: Any) -> Any:
    """A step's `ctx.log`: the same destination as the library's events, but not guarded:
    what a step's own logging raises is the step's business. Resolved on its first use
    (most steps never log), through the logging configured then."""
    return _StepLog(initial)


class _StepLog:
    """A step's logger, made on the first use of any of its methods (`info`, `bind`...):
    the structlog logger `SafeLogger.resolve` gives, bound with the step's fields."""

    __slots__ = ("_initial", "_resolved")

    def __init__(self, initial: dict[str, Any]) -> None:
        self._initial = initial
        self._resolved: Any = None

    def __getattr__(self, name: str) -> Any:
        if self._resolved is None:
            self._resolved = SafeLogger("saga", **self._initial).resolve()
        return getattr(self._resolved, name)


def log_retry(
    what: str,
    exc: BaseException | None,
    *,
    attempt: int = 1,
    retry_in: float = 0.0,
    url: str | None = None,
) -> None:
    """Log a transient failure of database work that is about to be retried; no piece of
    the password of `url` (the URL the work connects with) shows in it."""
    get_logger("saga").warning(
        "database_retry",
        what=what,
        attempt=attempt,
        error=scrub(f"{type(exc).__name__}: {exc}".strip(), url),
        retry_in_seconds=round(retry_in, 3),
    )
