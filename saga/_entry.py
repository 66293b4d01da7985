"""Entry point of the `saga` console script and of `python -m saga`.

It imports nothing but `saga._early` (which imports nothing but `signal`) before the signal
handler is in place; the command's own code is imported after (see `saga._early`).
"""

from __future__ import annotations

from saga import _early


def main() -> int:
    """Entry point of the `saga` console script and of `python -m saga`."""
    _early.install()
    from saga.cli import main as cli_main

    return cli_main()
