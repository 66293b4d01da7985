"""`--app` finds an AsyncOrchestrator as it finds an Orchestrator, and the verbs call it
through `AsyncApp` (no database needed: nothing here connects)."""

from __future__ import annotations

import asyncio
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from saga import AsyncOrchestrator, Orchestrator
from saga._app import AsyncApp, UsageError, blocking, load_app

BODY = """
    from saga import AsyncOrchestrator, Orchestrator, Saga
    from pydantic import BaseModel

    class In(BaseModel):
        k: str

    s = Saga("s", version=1, input=In, key=lambda i: i.k)
    s.step(name="one")(lambda ctx, i: None)
    {extra}
"""
FILES = {
    "aapp_one": "orch = AsyncOrchestrator(sagas=[s], owner='me')",
    "aapp_mixed": "a = Orchestrator(sagas=[s])\n    b = AsyncOrchestrator(sagas=[s])",
    "aapp_empty": "orch = AsyncOrchestrator()",
}


@pytest.fixture
def apps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name, extra in FILES.items():
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(BODY.format(extra=extra)))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("SAGA_DATABASE_URL", raising=False)
    yield
    for name in FILES:
        sys.modules.pop(name, None)


@pytest.mark.usefixtures("apps")
def test_load_app_finds_an_async_orchestrator_or_explains() -> None:
    """A lone AsyncOrchestrator is found by itself, or by name; one beside an Orchestrator
    must be named; one with no saga registered is refused, as an Orchestrator is."""
    found = load_app("aapp_one", None)
    assert isinstance(found, AsyncOrchestrator)
    assert found is sys.modules["aapp_one"].orch
    assert load_app("aapp_mixed:b", None) is sys.modules["aapp_mixed"].b
    assert isinstance(load_app("aapp_mixed:a", None), Orchestrator)
    with pytest.raises(UsageError, match=r"several Orchestrators \(a, b\)"):
        load_app("aapp_mixed", None)
    with pytest.raises(UsageError, match="has no registered saga"):
        load_app("aapp_empty", None)


@pytest.mark.usefixtures("apps")
def test_verbs_call_an_async_app_through_one_event_loop() -> None:
    """`blocking` leaves an Orchestrator as it is and puts an AsyncOrchestrator behind an
    AsyncApp: plain methods and attributes are the app's, the owner can be renamed,
    awaitables are run to completion on its loop, and leaving it closes the app there."""
    sync_app = load_app("aapp_mixed:a", None)
    assert blocking(sync_app) is sync_app
    app = load_app("aapp_one", None)
    assert isinstance(app, AsyncOrchestrator)
    view = blocking(app)
    assert isinstance(view, AsyncApp)
    assert [s.name for s in view.registered()] == ["s"]
    assert view.definition("s", 1) is app.definition("s", 1)
    assert view.owner == "me" and view.lease_seconds == app.lease_seconds
    view.owner = "saga-cli:me"
    assert app.owner == "saga-cli:me"
    with view:
        assert view.purge_cutoff_days(None) == app.retention_days
        assert view.wait(asyncio.sleep(0, result="awaited")) == "awaited"
