"""The app a command runs: the user's Orchestrator or AsyncOrchestrator, found by
`MODULE[:ATTR]` (`saga worker --app`, the crash kit's child processes), and an
AsyncOrchestrator behind the blocking calls the `saga` command's verbs make."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import os
import sys
from collections.abc import Awaitable
from typing import Any, TypeVar, cast

from saga._db.database import ENV_URL, describe_url
from saga._db.store import Store
from saga.durable import registered_step, registered_step_names
from saga.errors import DatabaseUnavailable
from saga.orchestrator import Orchestrator
from saga.orchestrator_async import AsyncOrchestrator

ENV_APP = "SAGA_APP"

T = TypeVar("T")
# What --app names: the orchestrator of the user's module, sync or asyncio.
App = Orchestrator | AsyncOrchestrator


class UsageError(Exception):
    """The command cannot run as invoked (exit code 2)."""


def error_line(exc: BaseException) -> str:
    """`exc` on one line, after the name of its type."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


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
        raise UsageError(f"--app {spec!r}: importing it failed: {error_line(exc)}") from None
    except DatabaseUnavailable:
        raise
    except Exception as exc:
        raise UsageError(f"--app {spec!r}: importing it failed: {error_line(exc)}") from None
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
    """An `AsyncOrchestrator` behind the blocking calls the verbs (and the batch jobs of
    `saga.cli.admin`) make of an `Orchestrator`.

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

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def blocking(app: App) -> Orchestrator:
    """`app` as the verbs call it: an Orchestrator as it is, an AsyncOrchestrator behind
    an `AsyncApp` (which answers every call an Orchestrator does, so it is typed as one)."""
    if isinstance(app, AsyncOrchestrator):
        return cast(Orchestrator, AsyncApp(app))
    return app
