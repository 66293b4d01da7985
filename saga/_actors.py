"""Who an operator's change is recorded as: the actor given, or the OS user running it.

The doors (both orchestrators, the ledgers) and the `saga` command record an actor with
every operator verb; the check that one was given is the core's (`check_actor`)."""

from __future__ import annotations

import getpass
import os

from saga._core.requests import check_actor


def os_user() -> str:
    """The login name of the user running this process (`uid-N` when it has none)."""
    try:
        return getpass.getuser()
    except Exception:  # no login name in some containers
        getuid = getattr(os, "getuid", None)
        return f"uid-{getuid()}" if getuid is not None else "unknown-user"


def actor_or_os_user(verb: str, actor: str | None) -> str:
    """The actor an operator verb records: `actor`, or the OS user running the call when
    it is None; `ValueError` (see `check_actor`) when it is empty or blank."""
    return os_user() if actor is None else check_actor(verb, actor)
