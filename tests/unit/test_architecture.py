"""The layering the two doors rely on, pinned by walking the package's imports.

The core (the planner, its rows, checks and operator requests, the outcomes it applies,
the effects flows yield) does no I/O and reads no clock, so both drivers share it; the
runtime imports between the package's modules form no cycle; the workers depend on the
engine and drivers, never on the orchestrators that create them.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "saga"
CORE = (
    "saga._core.rows",
    "saga._core.planner",
    "saga._core.ceilings",
    "saga._core.confirmations",
    "saga._core.requests",
    "saga._core.inputs",
    "saga._flows.effects",
)
# Libraries that do I/O, run threads or event loops: none of them is reachable from the core.
DRIVER_LIBRARIES = {"psycopg", "psycopg_pool", "threading", "asyncio", "socket", "subprocess"}
# Calls that read a clock.
CLOCK_CALLS = {
    ("datetime", "now"),
    ("datetime", "utcnow"),
    ("datetime", "today"),
    ("time", "time"),
    ("time", "monotonic"),
    ("time", "perf_counter"),
}


def _source(module: str) -> Path:
    relative = Path(*module.split(".")[1:])
    package = PACKAGE / relative / "__init__.py"
    return package if package.exists() else PACKAGE / f"{relative}.py"


def _library_files() -> list[Path]:
    """The package's modules, the web and integration packages aside (they have tests of
    their own below)."""
    return sorted(
        path
        for path in PACKAGE.rglob("*.py")
        if path.relative_to(PACKAGE).parts[0] not in {"web", "integrations"}
    )


def _module_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("saga", *parts))


def _runtime_imports(module: str) -> set[str]:
    """Modules imported when `module` is imported (imports under TYPE_CHECKING and inside
    functions are not: they run later, or never)."""
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                submodules = {
                    f"{node.module}.{alias.name}"
                    for alias in node.names
                    if node.module.startswith("saga")
                    and _source(f"{node.module}.{alias.name}").exists()
                }
                found.update(submodules)
                if len(submodules) < len(node.names) or node.module == "saga":
                    found.add(node.module)
            elif isinstance(node, ast.If | ast.Try | ast.With):
                visit(node.body)
                visit(getattr(node, "orelse", []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
                visit(getattr(node, "finalbody", []))

    visit(ast.parse(_source(module).read_text(encoding="utf-8")).body)
    return found


def _graph() -> dict[str, set[str]]:
    return {
        _module_of(path): {m for m in _runtime_imports(_module_of(path)) if m.startswith("saga.")}
        for path in _library_files()
        if _module_of(path) != "saga"
    }


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    stack = [start]
    while stack:
        for dep in graph.get(stack.pop(), ()):
            if dep not in seen:
                seen.add(dep)
                stack.append(dep)
    return seen


@pytest.mark.parametrize("module", CORE)
def test_the_core_reaches_no_driver_library(module: str) -> None:
    """Nothing the core imports, directly or through other modules of the package, does
    database I/O, starts threads or runs an event loop."""
    graph = _graph()
    modules = _reachable(graph, module) | {module}
    outside = {
        imported.split(".")[0]
        for m in modules
        for imported in _runtime_imports(m)
        if not imported.startswith("saga")
    }
    assert not outside & DRIVER_LIBRARIES, (module, sorted(outside & DRIVER_LIBRARIES))


def _clock_calls(module: str) -> set[tuple[str, str]]:
    tree = ast.parse(_source(module).read_text(encoding="utf-8"))
    calls = {
        (node.func.value.id, node.func.attr)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
    }
    return calls & CLOCK_CALLS


@pytest.mark.parametrize("module", CORE)
def test_the_core_reads_no_clock(module: str) -> None:
    """Time is an input: no module of the core (the planner, its checks, the requests and
    outcomes it applies) reads a clock."""
    assert _clock_calls(module) == set()


def test_runtime_imports_form_no_cycle() -> None:
    """No module of the package imports itself back at import time."""
    graph = _graph()
    cycles = sorted(m for m in graph if m in _reachable(graph, m))
    assert cycles == []


@pytest.mark.parametrize(
    ("worker", "orchestrators"),
    [
        ("saga.worker", {"saga.orchestrator", "saga.orchestrator_async"}),
        ("saga.worker_async", {"saga.orchestrator", "saga.orchestrator_async"}),
    ],
)
def test_workers_do_not_import_the_orchestrators(worker: str, orchestrators: set[str]) -> None:
    """A worker depends on the engine it is given (a protocol of its own) and a driver,
    never on the orchestrator that made it: not at run time, not even for type checking."""
    assert not _reachable(_graph(), worker) & orchestrators
    tree = ast.parse(_source(worker).read_text(encoding="utf-8"))
    named = {
        node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module is not None
    } | {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    assert not named & orchestrators


# The `saga` command and the batch jobs behind it: they see the orchestrator's errors only.
COMMAND_MODULES = (
    "saga.cli",
    "saga.cli.parser",
    "saga.cli.commands",
    "saga.cli.serve",
    "saga.cli.console",
    "saga.cli.format",
    "saga.cli.admin",
    "saga._app",
)


@pytest.mark.parametrize("module", COMMAND_MODULES)
def test_the_command_and_batch_jobs_never_see_driver_errors(module: str) -> None:
    """psycopg's errors are translated inside the stores: the `saga` command and the
    batch jobs import no psycopg, so they cannot catch one (they catch `SagaError`s)."""
    tree = ast.parse(_source(module).read_text(encoding="utf-8"))
    named = {
        node.module.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module is not None
    } | {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    assert not named & {"psycopg", "psycopg_pool"}, module


def test_the_checks_see_what_they_look_for() -> None:
    """The walkers are not blind: the flows stamp inputs with the clock, and the sync
    driver imports threading."""
    assert ("datetime", "now") in _clock_calls("saga._flows.drive")
    assert "threading" in _runtime_imports("saga._drivers.driver")
    assert "saga._db.store" in _reachable(_graph(), "saga._drivers.driver")
    assert "psycopg" in _runtime_imports("saga._db.store")


# ----- agent integrations: optional, and never reached from the core ---------------------------

INTEGRATIONS = PACKAGE / "integrations"
# Agent frameworks (top-level import names) the package may integrate with, each only from a
# module of its own under saga/integrations/, installed with an extra.
AGENT_FRAMEWORKS = {
    "pydantic_ai",
    "pydantic_graph",
    "agents",  # the OpenAI Agents SDK
    "openai",
    "langchain",
    "langchain_core",
    "langgraph",
    "crewai",
    "autogen",
    "llama_index",
    "smolagents",
}


def _all_imports(path: Path) -> set[str]:
    """Every module `path` names in an import, wherever the import is (TYPE_CHECKING blocks
    and function bodies included); relative imports as `.name`."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                found.add("." * node.level + module)
            else:
                found.add(module)
                if module == "saga":
                    found.update(f"saga.{alias.name}" for alias in node.names)
    return found


@pytest.mark.parametrize("path", _library_files(), ids=_module_of)
def test_core_modules_import_no_integration_and_no_agent_framework(path: Path) -> None:
    """The core package works without any extra: no module of it imports the integrations
    or an agent framework, not even for type checking or inside a function."""
    imported = _all_imports(path)
    assert not {m for m in imported if m.split(".")[0] in AGENT_FRAMEWORKS}, path.name
    assert not {
        m for m in imported if m == "saga.integrations" or m.startswith("saga.integrations.")
    }, path.name
    assert not {m for m in imported if m.startswith(".")}, path.name


def test_the_shared_tool_call_module_imports_no_agent_framework() -> None:
    """`_tool_calls` is what every framework's integration builds on: it knows none of them."""
    imported = _all_imports(INTEGRATIONS / "_tool_calls.py")
    assert not {m for m in imported if m.split(".")[0] in AGENT_FRAMEWORKS}


@pytest.mark.parametrize("path", sorted(INTEGRATIONS.glob("*.py")), ids=lambda p: p.stem)
def test_each_integration_imports_its_own_framework_only(path: Path) -> None:
    """An integration imports one framework, the one its module is named after (so each
    extra installs what its module needs, and nothing else)."""
    frameworks = {m.split(".")[0] for m in _all_imports(path)} & AGENT_FRAMEWORKS
    own = {path.stem} if path.stem in AGENT_FRAMEWORKS else set()
    if path.stem == "pydantic_ai":
        own |= {"pydantic_graph"}
    if path.stem == "openai_agents":
        own |= {"agents"}  # the SDK's import name; it brings `openai`, which we do not import
    assert frameworks <= own, (path.name, sorted(frameworks - own))


@pytest.mark.parametrize("path", sorted(INTEGRATIONS.glob("*.py")), ids=lambda p: p.stem)
def test_integrations_share_only_the_framework_free_core(path: Path) -> None:
    """An integration builds on `_tool_calls`, never on another framework's integration
    (installing one extra must be enough to import its module)."""
    others = {
        f"saga.integrations.{other.stem}"
        for other in INTEGRATIONS.glob("*.py")
        if other.stem not in {path.stem, "__init__", "_tool_calls"}
    }
    assert not _all_imports(path) & others, path.name


def test_importing_the_core_loads_no_agent_framework() -> None:
    """At run time too: a process that imports every module of the core package (the
    frameworks installed or not) has loaded none of them."""
    modules = [
        "saga",
        *(
            _module_of(path)
            for path in _library_files()
            if path.stem != "__main__"  # __main__ runs the command
        ),
    ]
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {sorted(AGENT_FRAMEWORKS)!r}"
        " or m.startswith('saga.integrations')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=PACKAGE.parent,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


def test_the_integration_checks_see_what_they_look_for() -> None:
    """The walker finds the integrations' imports, and the core's."""
    assert "pydantic_ai" in _all_imports(INTEGRATIONS / "pydantic_ai.py")
    assert "saga.integrations._tool_calls" in _all_imports(INTEGRATIONS / "pydantic_ai.py")
    assert "agents" in _all_imports(INTEGRATIONS / "openai_agents.py")
    assert "saga.integrations._tool_calls" in _all_imports(INTEGRATIONS / "openai_agents.py")
    assert "saga.durable" in _all_imports(INTEGRATIONS / "_tool_calls.py")
