"""The parts of the package and the rules between them, pinned by walking its imports.

Every import counts: at module level, under `TYPE_CHECKING`, and inside functions (a lazy
import is a dependency all the same, and a type-only one is what mypy and a reader follow).

The map below is the whole picture: the floors, bottom up (a module imports modules of its
own floor or of lower ones only), the parts that share a floor without importing each
other, what the core and the flows may import, and where psycopg may be imported. The
rules it does not hold yet are listed once, in `KNOWN_VIOLATIONS`, each with the reason it
is still there; an entry that is no longer needed fails `test_known_violations_are_still_needed`,
so the list only shrinks.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterable, Mapping
from functools import cache
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "saga"

# ----- the map ----------------------------------------------------------------------------------

# The floors, bottom up. An entry names a module, or with `.*` a folder (its package and every
# module in it); a module's floor is that of its longest entry.
FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("vocabulary", ("saga.errors", "saga.keys", "saga.state", "saga.amounts", "saga.outcomes",
                    "saga.redact", "saga.logs", "saga.retry", "saga.signatures", "saga.codec",
                    "saga.context", "saga.definition", "saga.approvals", "saga.remedies",
                    "saga._acompat", "saga._early")),
    ("core",       ("saga._core.*",)),
    ("code-first", ("saga.durable", "saga._codefirst", "saga.telemetry", "saga.upgrade",
                    "saga._actors")),
    ("flows | db", ("saga._flows.*", "saga._db.*")),
    ("drivers",    ("saga._drivers.*",)),
    ("engine",     ("saga._engine",)),
    ("doors",      ("saga.session", "saga.ledger", "saga.worker", "saga.worker_async")),
    ("orchestrators", ("saga.orchestrator", "saga.orchestrator_async", "saga._orchestrator_base",
                       "saga._orchestrator_base_async")),
    ("face",       ("saga", "saga._app", "saga.integrations.*")),
    ("commands",   ("saga.cli.*", "saga.testing")),
    ("dashboard",  ("saga.web.*", "saga._entry", "saga.__main__")),
)  # fmt: skip
# Parts on one floor that never import each other.
SIDE_BY_SIDE = (("saga._flows.*", "saga._db.*"),)
# Parts that import less than their floor allows: only these floors, and their own part.
ONLY_FROM = {
    "saga._core.*": ("vocabulary",),  # decisions: no I/O, no flows, no store
    "saga._flows.*": ("vocabulary", "core"),  # the loop: effects as values, never the I/O
}
# The one arrow that may run up: a lazy import of an optional extra.
ALLOWED_UPWARD = {
    ("saga.cli.serve", "saga.web"): "`saga dashboard` imports the dashboard (`web` extra) when run",
}
# Driver libraries: only `_db` imports them; these modules aside, each for its reason.
DATABASE_LIBRARIES = {"psycopg", "psycopg_pool"}
DATABASE_OUTSIDE_DB = {
    "saga.redact": "hides a URL's password with psycopg's own conninfo parser (a lazy import): "
    "the vocabulary cannot reach `_db`",
}
# The library proper: what a program that uses the package imports (the command, its
# dashboard and the process entry aside). It never imports the command or the dashboard.
FACES = ("saga.cli.*", "saga.web.*", "saga._entry", "saga.__main__")
# The doors an orchestrator creates: they take an engine protocol, never the orchestrator.
DOORS = ("saga.session", "saga.ledger", "saga.worker", "saga.worker_async")
ORCHESTRATORS = {
    "saga.orchestrator",
    "saga.orchestrator_async",
    "saga._orchestrator_base",
    "saga._orchestrator_base_async",
}

# The rules above that the code does not hold yet: (importer, imported) -> why it is still there.
# Empty: every rule holds. A new entry needs a reason, and the test below fails once the
# entry is no longer needed.
KNOWN_VIOLATIONS: dict[tuple[str, str], str] = {}

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

# ----- the walk ---------------------------------------------------------------------------------


def _module_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("saga", *parts))


@cache
def _modules() -> dict[str, Path]:
    """Every module of the package, by name."""
    return {_module_of(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _known(name: str) -> str:
    """The package's module that `name` (a module, or a name in one) is."""
    while name not in _modules():
        name = name.rpartition(".")[0]
    return name


@cache
def _imports(module: str) -> frozenset[str]:
    """Every module `module` imports, wherever the import is (module level, `TYPE_CHECKING`
    blocks, function bodies): the package's modules by name, other libraries by their
    top-level name."""
    tree = ast.parse(_modules()[module].read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
            if node.module.split(".")[0] == "saga":
                names = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            found.add(_known(name) if name.split(".")[0] == "saga" else name.split(".")[0])
    found.discard(module)
    return frozenset(found)


def _graph() -> dict[str, set[str]]:
    """The package's modules and, for each, the modules of the package it imports."""
    return {m: {d for d in _imports(m) if d.split(".")[0] == "saga"} for m in _modules()}


def _libraries(module: str) -> set[str]:
    return {d for d in _imports(module) if d.split(".")[0] != "saga"}


def _matches(entry: str, module: str) -> bool:
    if entry.endswith(".*"):
        return module == entry[:-2] or module.startswith(entry[:-1])
    return module == entry


def _part(module: str) -> str:
    """The entry of `FLOORS` that places `module` (its longest), or "" for none."""
    entries = [entry for _, entries in FLOORS for entry in entries if _matches(entry, module)]
    return max(entries, key=len, default="")


def _floor(module: str) -> int:
    part = _part(module)
    return next(index for index, (_, entries) in enumerate(FLOORS) if part in entries)


def _floor_name(module: str) -> str:
    return FLOORS[_floor(module)][0]


def _reachable(graph: Mapping[str, Iterable[str]], start: str) -> set[str]:
    seen: set[str] = set()
    stack = [start]
    while stack:
        for dep in graph.get(stack.pop(), ()):
            if dep not in seen:
                seen.add(dep)
                stack.append(dep)
    return seen


def _without_known(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    return {m: {d for d in deps if (m, d) not in KNOWN_VIOLATIONS} for m, deps in graph.items()}


def _broken(rule: str) -> set[tuple[str, str]]:
    """The imports (importer, imported) that break `rule`, known violations included."""
    graph = _graph()
    edges = {(m, d) for m, deps in graph.items() for d in deps}
    libraries = {(m, lib) for m in graph for lib in _libraries(m)}
    if rule == "floors":
        return {(m, d) for m, d in edges if _floor(d) > _floor(m) and (m, d) not in ALLOWED_UPWARD}
    if rule == "side by side":
        sides = {frozenset(pair) for pair in SIDE_BY_SIDE}
        return {(m, d) for m, d in edges if frozenset((_part(m), _part(d))) in sides}
    if rule == "only from":
        return {
            (m, d)
            for m, d in edges
            if _part(m) in ONLY_FROM
            and _part(d) != _part(m)
            and _floor_name(d) not in ONLY_FROM[_part(m)]
        }
    if rule == "faces":
        faces = [entry for entry in FACES if entry.endswith(".*")]
        return {
            (m, d)
            for m, d in edges
            if not any(_matches(entry, m) for entry in FACES)
            and any(_matches(entry, d) for entry in faces)
        }
    if rule == "doors":
        return {(m, d) for m, d in edges if m in DOORS and d in ORCHESTRATORS}
    if rule == "database":
        return {
            (m, lib)
            for m, lib in libraries
            if lib in DATABASE_LIBRARIES
            and _part(m) != "saga._db.*"
            and m not in DATABASE_OUTSIDE_DB
        }
    if rule == "core libraries":
        return {
            (m, lib)
            for m, lib in libraries
            if _part(m) == "saga._core.*" and lib in DRIVER_LIBRARIES
        }
    if rule == "circles":
        # An import closes a circle when what it imports leads back to the importer
        # through imports other than the known violations.
        rest = _without_known(graph)
        return {(m, d) for m, d in edges if m in _reachable(rest, d)}
    raise AssertionError(rule)


RULES = (
    "floors",
    "side by side",
    "only from",
    "faces",
    "doors",
    "database",
    "core libraries",
    "circles",
)


def _unknown(rule: str) -> list[tuple[str, str]]:
    return sorted(_broken(rule) - KNOWN_VIOLATIONS.keys())


def _circles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected sets of more than one module (Tarjan's, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, deps = work[-1]
            for dep in deps:
                if dep not in index:
                    index[dep] = low[dep] = len(index)
                    stack.append(dep)
                    on_stack.add(dep)
                    work.append((dep, iter(sorted(graph.get(dep, ())))))
                    break
                if dep in on_stack:
                    low[node] = min(low[node], index[dep])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    members = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        members.append(member)
                        if member == node:
                            break
                    if len(members) > 1:
                        found.append(sorted(members))
    return found


# ----- the map holds -----------------------------------------------------------------------------


def test_every_module_has_a_floor() -> None:
    """A new module is placed on the map before it is imported anywhere."""
    assert [m for m in _modules() if not _part(m)] == []


def test_modules_import_their_own_floor_or_lower_ones() -> None:
    """No import runs up a floor (the lazy import behind `saga dashboard` aside)."""
    assert _unknown("floors") == []


def test_the_flows_and_the_store_do_not_import_each_other() -> None:
    """`_flows` and `_db` share a floor: the loop names store calls as effects, the store
    knows nothing of the loop."""
    assert _unknown("side by side") == []


def test_the_core_and_the_flows_import_only_what_they_may() -> None:
    """The core imports the vocabulary only; the flows the vocabulary and the core (not
    telemetry, fault points or the store, which the drivers carry out)."""
    assert _unknown("only from") == []


def test_imports_form_no_circle() -> None:
    """No module imports itself back, through any chain of imports (type-only and lazy
    ones included)."""
    assert _unknown("circles") == []
    assert _circles(_without_known(_graph())) == []


def test_only_the_store_imports_the_database_driver() -> None:
    """psycopg and its pool are imported by `_db` only, so their errors are translated in
    one place (the command and the batch jobs catch `SagaError`s)."""
    assert _unknown("database") == []


def test_the_library_never_imports_the_command_or_the_dashboard() -> None:
    """The command and the dashboard sit on top: a program that uses the package, the kit
    included, imports neither (the process entry starts the command)."""
    assert _unknown("faces") == []


def test_doors_never_import_the_orchestrators() -> None:
    """A session, a ledger and a worker take the engine they need as a protocol of their
    own, never the orchestrator that makes them: not at run time, not for type checking,
    not through another module."""
    assert _unknown("doors") == []
    rest = _without_known(_graph())
    assert {door: sorted(_reachable(rest, door) & ORCHESTRATORS) for door in DOORS} == {
        door: [] for door in DOORS
    }


def test_known_violations_are_still_needed() -> None:
    """Each known violation still breaks a rule: one that is fixed leaves the list."""
    broken = set().union(*(_broken(rule) for rule in RULES))
    assert sorted(KNOWN_VIOLATIONS.keys() - broken) == []


# ----- the core: no I/O, no clock ---------------------------------------------------------------

CORE = (*sorted(m for m in _modules() if _part(m) == "saga._core.*"), "saga._flows.effects")


def test_the_core_imports_no_driver_library() -> None:
    """No module of the core imports psycopg, threading, asyncio, sockets or processes,
    not even for type checking or inside a function."""
    assert _unknown("core libraries") == []


@pytest.mark.parametrize("module", CORE)
def test_the_core_reaches_no_driver_library(module: str) -> None:
    """Nothing the core imports, directly or through other modules of the package, does
    database I/O, starts threads or runs an event loop."""
    modules = _reachable(_graph(), module) | {module}
    outside = set().union(*(_libraries(m) for m in modules))
    assert not outside & DRIVER_LIBRARIES, (module, sorted(outside & DRIVER_LIBRARIES))


def _clock_calls(module: str) -> set[tuple[str, str]]:
    tree = ast.parse(_modules()[module].read_text(encoding="utf-8"))
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


def test_the_checks_see_what_they_look_for() -> None:
    """The walkers are not blind: they see imports at module level, under `TYPE_CHECKING`
    and inside functions, and the rules catch what they are about."""
    assert ("datetime", "now") in _clock_calls("saga._flows.drive")
    assert "threading" in _libraries("saga._drivers.driver")
    assert "saga._db.store" in _reachable(_graph(), "saga._drivers.driver")
    assert "psycopg" in _libraries("saga._db._store_conn")
    assert "psycopg" in _libraries("saga.redact")  # inside a function
    assert "saga.cli" in _imports("saga._entry")  # inside a function
    assert "saga._drivers.driver" in _imports("saga.session")  # under TYPE_CHECKING
    assert "saga.cli.format" in _imports("saga.web.views")  # `from saga.cli import format`
    assert ("saga.cli.serve", "saga.web") not in _broken("floors")  # the one allowed climb
    assert ("saga.orchestrator", "saga._engine") not in _broken("floors")
    assert _floor("saga._core.planner") < _floor("saga._engine") < _floor("saga.orchestrator")
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# ----- agent integrations: optional, and never reached from the core ---------------------------

INTEGRATIONS = PACKAGE / "integrations"


def _library_files() -> list[Path]:
    """The package's modules, the web and integration packages aside (they have tests of
    their own)."""
    return sorted(
        path
        for path in PACKAGE.rglob("*.py")
        if path.relative_to(PACKAGE).parts[0] not in {"web", "integrations"}
    )


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
