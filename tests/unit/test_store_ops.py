"""Flows name store calls by `StoreOps` methods; both stores must answer every one of them,
with the same parameters and annotations (`StoreOps` is generated from the store's source by
tools/async_to_sync.py; this checks both stores against it, the generated twin included)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from saga._db.store import Store
from saga._db.store_async import AsyncStore
from saga._flows.store_ops import StoreOps

OPS = sorted(
    name
    for name, value in vars(StoreOps).items()
    if inspect.isfunction(value) and not name.startswith("_")
)


def _parameters(fn: object) -> list[tuple[str, object, object]]:
    """Name, kind and default of each parameter."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]  # type: ignore[arg-type]


def _annotations(fn: object) -> list[str]:
    """Each parameter's annotation and the return's, as the Protocol spells them: the
    connection (`Conn`, `AConn`) as `Any`, a `DeferredRead[...]` as `Deferred`."""
    signature = inspect.signature(fn)  # type: ignore[arg-type]
    spelled = [str(p.annotation) for p in signature.parameters.values()]
    spelled.append(str(signature.return_annotation))
    spelled = [re.sub(r"\bA?Conn\b", "Any", text) for text in spelled]
    return [re.sub(r"^DeferredRead\[.*\]$", "Deferred", text) for text in spelled]


def test_store_ops_lists_the_methods_the_flows_call() -> None:
    """Every method named here is called through a typed reference somewhere, and every
    typed reference names a method here (mypy checks the second; this, the first). The
    Protocol holds every public method of the store's driving and verb parts: a method the
    flows do not call belongs to another part (`saga/_db/_store_reads_async.py`, or the
    store itself)."""
    package = Path(__file__).resolve().parents[2] / "saga"
    named = {
        name
        for path in package.rglob("*.py")
        for name in re.findall(r"\bStoreOps\.(\w+)", path.read_text(encoding="utf-8"))
    }
    assert named == set(OPS)
    assert all((name.endswith("_txn")) == ("conn" in _names(name)) for name in OPS)


def _names(name: str) -> list[str]:
    return [p[0] for p in _parameters(getattr(StoreOps, name))]


@pytest.mark.parametrize("store", [Store, AsyncStore], ids=lambda s: s.__name__)
@pytest.mark.parametrize("name", OPS)
def test_both_stores_provide_each_method_with_the_same_parameters(
    store: type[object], name: str
) -> None:
    method = getattr(store, name, None)
    assert method is not None, f"{store.__name__} has no {name}"
    assert _parameters(method) == _parameters(getattr(StoreOps, name))
    assert _annotations(method) == _annotations(getattr(StoreOps, name))
    assert inspect.iscoroutinefunction(method) == (store is AsyncStore)


def test_no_flow_names_a_store_method_by_a_string() -> None:
    saga = Path(__file__).resolve().parents[2] / "saga"
    sources = [*saga.glob("_flows/*.py"), saga / "_engine.py", saga / "session.py"]
    named = [
        f"{path.name}: {match.group(0)}"
        for path in sources
        for match in re.finditer(r"\bdb(_txn)?\(\s*[\"']", path.read_text())
    ]
    assert named == []
