"""The `saga` command's first moment, installed by `saga._entry`: SIGTERM and SIGINT are
caught before the command's code (and psycopg, pydantic, structlog... with it) is
imported, which takes a second or more; a signal in that time is remembered, not fatal.
`saga worker` then stops cleanly (exit 0, `stopped (SIGTERM)`) instead of being killed
while it starts, as when systemd or Kubernetes replaces a worker it has just started; the
other commands get the signal back once they are known (see `release`).

This module imports nothing but `signal`, and `import saga` loads none of the package
(its names are imported on first use), so the handler is in place within milliseconds.
"""

from __future__ import annotations

import signal

_CAUGHT = (signal.SIGTERM, signal.SIGINT)

# The first signal received since `main` started, while nobody else handled it.
received: signal.Signals | None = None


def _remember(signum: int, frame: object) -> None:
    global received
    if received is None:
        received = signal.Signals(signum)


def installed() -> bool:
    """Whether the handler of `main` still catches SIGTERM (not in `saga.cli.main` called
    from Python, nor once a command has taken over the signals)."""
    return signal.getsignal(signal.SIGTERM) is _remember


def take() -> signal.Signals | None:
    """Hand SIGTERM and SIGINT back to Python's default handling (SIGTERM ends the
    process, SIGINT raises KeyboardInterrupt) and return the signal remembered until then,
    if any. Defaults first: a signal is either remembered or handled, never lost."""
    if not installed():
        return None
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    return received


def release() -> None:
    """`take`, for a command that does not handle signals itself: a signal remembered
    until now is delivered again, as if it came now. SIGTERM ends the process, killed by
    the signal as it was before this handler existed (the command did nothing yet, and
    its supervisor sees the usual status); SIGINT raises KeyboardInterrupt, which the
    command reports as `interrupted`."""
    early = take()
    if early is not None:
        signal.raise_signal(early)


def install() -> None:
    """Catch SIGTERM and SIGINT, remembering the first, until a command takes them."""
    for signum in _CAUGHT:
        signal.signal(signum, _remember)
