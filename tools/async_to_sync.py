"""Generate the blocking twins of the package's asyncio modules.

The store, the driver, the lease keeper, the worker and the orchestrator are written once,
for asyncio, in a `*_async.py` source; their blocking twins are generated from it, as psycopg
generates its sync classes (its `tools/async_to_sync.py`). The conversion works on tokens, so
the source's comments, docstrings and layout carry over:

- `async def`, `async with` and `async for` lose their `async`, and `await` is dropped;
- names are renamed through `NAMES` (`AsyncStore` -> `Store`, `store_async` -> `store`, ...);
- a block opened by `if True:  # ASYNC` keeps its `else:` branch only, dedented: the place
  for the few lines that truly differ (most of that residue lives in `saga._acompat`);
- the result goes through `ruff format` and ruff's import sorting.

Usage: `python tools/async_to_sync.py` writes every twin; `--check` writes nothing and exits 1
naming each twin that differs from what its source generates (a hand edit, or a source
changed without regenerating). CI runs `--check`.
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
import tokenize
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
    "saga/_drivers/driver_async.py",
    "saga/_drivers/driver.py",
    {
        "driver_async": "driver",
        "AsyncRunner": "Runner",
        "acarry_out": "carry_out",
        "AConn": "Conn",
    },
)
register(
    "saga/_db/store_async.py",
    "saga/_db/store.py",
    {"store_async": "store", "AsyncStore": "Store", "AConn": "Conn", "group_async": "group"},
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 on a difference"
    )
    args = parser.parse_args(argv)
    stale = []
    for source, target in TWINS.items():
        wanted = generate(source)
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
