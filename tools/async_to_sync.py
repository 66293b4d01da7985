"""Generate the blocking twins of the package's asyncio modules, and the flows' store Protocol.

The store, the driver, the lease keeper, the worker and the orchestrator are written once,
for asyncio, in a `*_async.py` source; their blocking twins are generated from it, as psycopg
generates its sync classes (its `tools/async_to_sync.py`). The conversion works on tokens, so
the source's comments, docstrings and layout carry over:

- `async def`, `async with` and `async for` lose their `async`, and `await` is dropped;
- names are renamed through `NAMES` (`AsyncStore` -> `Store`, `store_async` -> `store`, ...);
- a block opened by `if True:  # ASYNC` keeps its `else:` branch only, dedented: the place
  for the few lines that truly differ (most of that residue lives in `saga._acompat`);
- the result goes through `ruff format` and ruff's import sorting.

The flows' typed interface to the store, `saga/_flows/store_ops.py`, is generated too: the
signatures of the store's methods the flows call (see `PROTOCOLS`), bodies left out.

Usage: `python tools/async_to_sync.py` writes every twin (and that interface); `--check`
writes nothing and exits 1 naming each file that differs from what its source generates (a
hand edit, or a source changed without regenerating). CI runs `--check`.
"""

from __future__ import annotations

import argparse
import ast
import copy
import io
import subprocess
import sys
import textwrap
import tokenize
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Each source and the twin generated from it.
TWINS: dict[str, str] = {}

# Names renamed wherever they occur as a name token (never inside strings or comments).
NAMES: dict[str, str] = {
    "__aenter__": "__enter__",
    "__aexit__": "__exit__",
    "__aiter__": "__iter__",
    "__anext__": "__next__",
    "AsyncIterator": "Iterator",
    "AsyncIterable": "Iterable",
    "AsyncGenerator": "Generator",
    "asynccontextmanager": "contextmanager",
    "AbstractAsyncContextManager": "AbstractContextManager",
    "AsyncExitStack": "ExitStack",
    "aclose": "close",
    "AsyncConnection": "Connection",
    "AsyncConnectionPool": "ConnectionPool",
    "AsyncCursor": "Cursor",
    "AsyncRawCursor": "RawCursor",
    "AsyncTransaction": "Transaction",
    "AsyncPipeline": "Pipeline",
    "StopAsyncIteration": "StopIteration",
    "enter_async_context": "enter_context",
    # saga._acompat: each asyncio primitive and its blocking twin.
    "AEvent": "Event",
    "await_set": "wait_set",
    "asleep": "sleep",
    "arun_blocking": "run_blocking",
    "AWorker": "Worker",
    "aspawn": "spawn",
    "aworker_alive": "worker_alive",
    "astop": "stop",
    "AThreadResult": "ThreadResult",
}

HEADER = (
    "# WARNING: generated from {source} by tools/async_to_sync.py:\n"
    "# edit the source, then run `python tools/async_to_sync.py`. CI fails on any difference.\n"
)
_MARKER = "if True:  # ASYNC"


def register(source: str, target: str, names: dict[str, str]) -> None:
    """Declare a twin: `source` generates `target`, with `names` renamed besides `NAMES`."""
    TWINS[source] = target
    NAMES.update(names)


# ----- the twins ----------------------------------------------------------------------------

register(
    "saga/_drivers/leases_async.py",
    "saga/_drivers/leases.py",
    {
        "leases_async": "leases",
        "AsyncLeaseKeeper": "LeaseKeeper",
        "store_async": "store",
        "AsyncStore": "Store",
    },
)
register(
    "saga/_drivers/boundary_async.py",
    "saga/_drivers/boundary.py",
    {"boundary_async": "boundary", "acarry_out": "carry_out", "AConn": "Conn"},
)
register(
    "saga/_drivers/driver_async.py",
    "saga/_drivers/driver.py",
    {
        "driver_async": "driver",
        "AsyncRunner": "Runner",
        "acarry_out": "carry_out",
        "AConn": "Conn",
    },
)
# The store's parts (each a base of the store), then the store that puts them together.
for part, name in (
    ("conn", "StoreConnections"),
    ("drive", "DriveStore"),
    ("verbs", "VerbStore"),
    ("reads", "ReadStore"),
):
    register(
        f"saga/_db/_store_{part}_async.py",
        f"saga/_db/_store_{part}.py",
        {f"_store_{part}_async": f"_store_{part}", f"Async{name}": name},
    )
register(
    "saga/_db/store_async.py",
    "saga/_db/store.py",
    {"store_async": "store", "AsyncStore": "Store", "AConn": "Conn", "group_async": "group"},
)
register(
    "saga/_db/listen_async.py",
    "saga/_db/listen.py",
    {"listen_async": "listen", "AsyncListener": "Listener", "behind_pooler_async": "behind_pooler"},
)
register(
    "saga/_db/pool_async.py",
    "saga/_db/pool.py",
    {"pool_async": "pool", "AsyncStore": "Store", "store_async": "store"},
)
# The doors: the workers, then the orchestrators.
register(
    "saga/worker_async.py",
    "saga/worker.py",
    {
        "AsyncWorker": "Worker",
        "listen_async": "listen",
        "AsyncWorkerEngine": "WorkerEngine",
        "worker_async": "worker",
        "AsyncRunner": "Runner",
        "driver_async": "driver",
        "AsyncStore": "Store",
        "store_async": "store",
        "behind_pooler_async": "behind_pooler",
        "AsyncOrchestrator": "Orchestrator",
        "orchestrator_async": "orchestrator",
    },
)
register(
    "saga/_orchestrator_base_async.py",
    "saga/_orchestrator_base.py",
    {
        "AsyncOrchestratorBase": "OrchestratorBase",
        "_orchestrator_base_async": "_orchestrator_base",
        "pool_async": "pool",
        "AsyncWorker": "Worker",
        "worker_async": "worker",
        "AsyncRunner": "Runner",
        "driver_async": "driver",
        "AsyncStore": "Store",
        "store_async": "store",
        "AsyncLeaseKeeper": "LeaseKeeper",
        "AsyncLedger": "Ledger",
        "AsyncSession": "Session",
    },
)
register(
    "saga/orchestrator_async.py",
    "saga/orchestrator.py",
    {
        "AsyncOrchestrator": "Orchestrator",
        "orchestrator_async": "orchestrator",
        "AsyncOrchestratorBase": "OrchestratorBase",
        "_orchestrator_base_async": "_orchestrator_base",
    },
)


# ----- the flows' interface to the store -------------------------------------------------

# The flows name store calls by the methods of a Protocol (they may not import `saga._db`);
# it is generated from the signatures of the store's parts the flows call: every public
# method of these classes, in their order, with the blocking store's signatures (the
# connection as `Any`, a `DeferredRead` as `Deferred`) and `...` for a body.
PROTOCOLS: dict[str, tuple[tuple[str, str], ...]] = {
    "saga/_flows/store_ops.py": (
        ("saga/_db/_store_drive_async.py", "AsyncDriveStore"),
        ("saga/_db/_store_verbs_async.py", "AsyncVerbStore"),
    ),
}
_PROTOCOL_HEAD = '''"""The store's methods that flows call, as a typed interface.

A flow names a store call by a reference to one of these methods,
`yield from db(StoreOps.get_state, saga_id)`, never by a string: mypy checks the arguments
against the signature below and hands the result type back to the flow. The drivers call the
method of the same name on their store (`Store`, or the coroutine twin on `AsyncStore`).
These signatures are those of the store's source (see PROTOCOLS in tools/async_to_sync.py),
and tests/unit/test_store_ops.py checks that both stores provide every method here with the
same parameters and annotations.

A `_txn` method runs in the transaction the flow opened with `Begin`; its `conn` is passed
by the driver, so flows call it with `db_txn`, without the connection. A method answering a
`Deferred` returns a read that the flow runs with `Fetch` once the transaction committed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

{imports}

# A read deferred until the transaction commits (a coroutine function on `AsyncStore`).
Deferred = Callable[[], Any]


class StoreOps(Protocol):
    """The store's methods the flows use, with the blocking store's signatures."""

'''
# How a store annotation reads in the Protocol.
_CONNECTIONS = {"AConn", "Conn"}
_DEFERRED = "DeferredRead"


class _Annotation(ast.NodeTransformer):
    """A store annotation as the Protocol spells it."""

    def visit_Name(self, node: ast.Name) -> ast.expr:
        return ast.Name("Any") if node.id in _CONNECTIONS else node

    def visit_Subscript(self, node: ast.Subscript) -> ast.expr:
        if isinstance(node.value, ast.Name) and node.value.id == _DEFERRED:
            return ast.Name("Deferred")
        self.generic_visit(node)
        return node


def _imported(tree: ast.Module) -> dict[str, str]:
    """The module each name a source imports comes from."""
    return {
        alias.asname or alias.name: node.module
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
    }


def protocol(target: str) -> str:
    """What the Protocol `target` must hold (before formatting)."""
    methods: list[str] = []
    sources: dict[str, str] = {}
    for source, name in PROTOCOLS[target]:
        tree = ast.parse((ROOT / source).read_text(encoding="utf-8"))
        imported = _imported(tree)
        (cls,) = (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
        for node in cls.body:
            if not isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef):
                continue
            if node.name.startswith("_") or node.decorator_list:
                continue
            stub = _Annotation().visit(copy.deepcopy(node))
            stub.body = [ast.Expr(ast.Constant(...))]
            methods.append(ast.unparse(stub).removeprefix("async "))
            for used in ast.walk(stub):
                if isinstance(used, ast.Name) and used.id in imported:
                    sources[used.id] = imported[used.id]
    if any(module.startswith("saga._db") for module in sources.values()):
        raise SystemExit(f"{target}: a signature names a type of saga._db: {sorted(sources)}")
    imports = "\n".join(f"from {module} import {name}" for name, module in sorted(sources.items()))
    body = "\n\n".join(textwrap.indent(method, "    ") for method in methods)
    head = HEADER.format(source="the store's sources in saga/_db")
    return head + _PROTOCOL_HEAD.format(imports=imports) + body + "\n"


def _drop_async_blocks(text: str) -> str:
    """Keep the `else:` branch of each `if True:  # ASYNC` block, dedented one level."""
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.strip() != _MARKER:
            out.append(line)
            i += 1
            continue
        indent = line[: len(line) - len(line.lstrip())]
        body = indent + "    "
        i += 1
        while i < len(lines) and (lines[i].startswith(body) or not lines[i].strip()):
            i += 1
        if i < len(lines) and lines[i].rstrip() == indent + "else:":
            i += 1
            while i < len(lines) and (lines[i].startswith(body) or not lines[i].strip()):
                out.append(lines[i][4:] if lines[i].strip() else lines[i])
                i += 1
    return "".join(out)


def convert(text: str, source: str) -> str:
    """The blocking twin of an asyncio module's text (before formatting)."""
    text = _drop_async_blocks(text)
    lines = text.splitlines(keepends=True)
    tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    # (row, start column, end column, replacement), applied right to left on each line.
    edits: list[tuple[int, int, int, str]] = []
    for index, token in enumerate(tokens):
        if token.type != tokenize.NAME:
            continue
        (row, start), (_, end) = token.start, token.end
        following = tokens[index + 1] if index + 1 < len(tokens) else None
        if token.string == "await" or (
            token.string == "async"
            and following is not None
            and following.string in {"def", "with", "for"}
        ):
            line = lines[row - 1]
            while end < len(line) and line[end] == " ":
                end += 1
            edits.append((row, start, end, ""))
        elif token.string in NAMES:
            edits.append((row, start, end, NAMES[token.string]))
    for row, start, end, replacement in sorted(edits, reverse=True):
        line = lines[row - 1]
        lines[row - 1] = line[:start] + replacement + line[end:]
    return HEADER.format(source=source) + "".join(lines)


def _format(text: str, target: Path) -> str:
    ruff = [sys.executable, "-m", "ruff"]
    fixed = subprocess.run(
        [
            *ruff,
            "check",
            "--select",
            "I,F401",
            "--fix-only",
            "--quiet",
            "--stdin-filename",
            str(target),
            "-",
        ],
        input=text,
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout
    return subprocess.run(
        [*ruff, "format", "--quiet", "--stdin-filename", str(target), "-"],
        input=fixed,
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout


def generate(source: str) -> str:
    """What the twin of `source` must hold."""
    return _format(
        convert((ROOT / source).read_text(encoding="utf-8"), source), ROOT / TWINS[source]
    )


def generate_protocol(target: str) -> str:
    """What the Protocol `target` (a key of `PROTOCOLS`) must hold."""
    return _format(protocol(target), ROOT / target)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 on a difference"
    )
    args = parser.parse_args(argv)
    stale = []
    generated = [(target, partial(generate, source)) for source, target in TWINS.items()]
    generated += [(target, partial(generate_protocol, target)) for target in PROTOCOLS]
    for target, make in generated:
        wanted = make()
        path = ROOT / target
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != wanted:
                stale.append(target)
        else:
            path.write_text(wanted, encoding="utf-8")
    for target in stale:
        print(
            f"{target}: differs from what its asyncio source generates; "
            "run `python tools/async_to_sync.py`",
            file=sys.stderr,
        )
    return 1 if stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
