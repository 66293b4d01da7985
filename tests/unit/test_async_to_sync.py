"""The generator of the sync twins: what it turns an asyncio source into, and its check."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "async_to_sync.py"


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("async_to_sync", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["async_to_sync"] = module
    spec.loader.exec_module(module)
    return module


SOURCE = '''"""A sample asyncio module: its docstring says `await` and stays as written."""

from __future__ import annotations

import asyncio
import time

from saga._db.store_async import AsyncStore


class AsyncThing:
    async def __aenter__(self) -> AsyncThing:
        return self

    async def go(self, store: AsyncStore) -> int:
        # comments are kept
        async with store.lock:
            found = await store.fetch("await")  # and trailing ones
        if True:  # ASYNC
            await asyncio.sleep(1)
        else:
            time.sleep(1)
        async for row in store.rows():
            found += row
        return found
'''


def test_the_twin_drops_async_and_await_renames_and_keeps_the_sync_branch() -> None:
    tool = _tool()
    tool.NAMES.update({"AsyncThing": "Thing", "AsyncStore": "Store", "store_async": "store"})
    twin = tool._format(tool.convert(SOURCE, "saga/thing_async.py"), TOOL.parent / "thing.py")
    assert twin.startswith("# WARNING: generated from saga/thing_async.py")
    assert "async " not in twin.replace("`await`", "") and "await " not in twin.split('"""')[2]
    assert "class Thing:" in twin and "def __enter__(self) -> Thing:" in twin
    assert "from saga._db.store import Store" in twin
    assert "with store.lock:" in twin and "for row in store.rows():" in twin
    assert 'found = store.fetch("await")  # and trailing ones' in twin
    assert "# comments are kept" in twin
    assert "time.sleep(1)" in twin and "import asyncio" not in twin  # unused now, dropped
    assert "its docstring says `await` and stays as written" in twin


def test_check_names_a_twin_edited_by_hand(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    tool = _tool()
    (tmp_path / "saga").mkdir()
    (tmp_path / "saga" / "thing_async.py").write_text(SOURCE)
    monkeypatch.setattr(tool, "ROOT", tmp_path)
    monkeypatch.setattr(tool, "TWINS", {"saga/thing_async.py": "saga/thing.py"})
    monkeypatch.setattr(tool, "PROTOCOLS", {})
    assert tool.main([]) == 0
    assert tool.main(["--check"]) == 0
    twin = tmp_path / "saga" / "thing.py"
    twin.write_text(twin.read_text().replace("return found", "return found + 1"))
    assert tool.main(["--check"]) == 1
    assert "saga/thing.py: differs from what its asyncio source generates" in (
        capsys.readouterr().err
    )
    assert tool.main([]) == 0
    assert "return found + 1" not in twin.read_text()


STORE_PART = '''"""A part of a store."""

from __future__ import annotations

from collections.abc import Sequence

from saga._db._store_conn_async import AConn, DeferredRead
from saga.state import SagaState


class AsyncPart:
    async def save_txn(self, conn: AConn, ids: Sequence[str]) -> DeferredRead[SagaState]:
        """Its docstring is left out."""
        return DeferredRead(conn, ids)

    async def get_state(self, saga_id: str, *, fresh: bool = False) -> SagaState | None:
        return None

    async def _private(self) -> None:
        pass
'''


def test_the_protocol_holds_the_signatures_of_the_parts_the_flows_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tool = _tool()
    (tmp_path / "saga").mkdir()
    (tmp_path / "saga" / "part_async.py").write_text(STORE_PART)
    monkeypatch.setattr(tool, "ROOT", tmp_path)
    monkeypatch.setattr(tool, "PROTOCOLS", {"saga/ops.py": (("saga/part_async.py", "AsyncPart"),)})
    ops = tool.protocol("saga/ops.py")
    assert ops.startswith("# WARNING: generated from the store's sources")
    assert "def save_txn(self, conn: Any, ids: Sequence[str]) -> Deferred:\n        ..." in ops
    assert "def get_state(self, saga_id: str, *, fresh: bool=False) -> SagaState | None:" in ops
    assert "from collections.abc import Sequence" in ops
    assert "from saga.state import SagaState" in ops
    assert "_private" not in ops and "docstring" not in ops and "async def" not in ops
    assert "saga._db" not in ops
