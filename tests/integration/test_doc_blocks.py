"""Every ```python block of README.md and of every docs/ page runs, in order, and its
sagas end as it says.

Each page is a test of its own (parametrized by its path). The blocks of a page share one
namespace, so a block may use the names an earlier block of the same page defined (the
first example's `renewal`, `Renewal`, `gateway`, ...); a page never relies on another
page's names. Each page runs against a fresh database of its own: `SAGA_DATABASE_URL`
is set to it, and the repository root is importable, so `from examples.fake_providers
import ...` works as it does for a reader in a clone of the repository.

A block is skipped only when its first line says why: `# not run: <reason>`. After each
block, a saga of the database that has come to `compensated` or `needs_review` fails the
test, unless the block announces it with a comment such as `# ends needs_review`: a
snippet whose saga was compensated on a `NameError` must not pass for a working one.
Blocks that are not Python are fenced as ```text, ```console or ```sh, and not run here.
"""

from __future__ import annotations

import logging
import os
import re
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest

from saga import Orchestrator
from saga.durable import isolated_steps

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
# Every Markdown page a reader is shown: the README and the site's pages.
PAGES = [README, *sorted(DOCS.rglob("*.md"))]
# A fence, possibly indented (inside a list item or an admonition).
FENCE = re.compile(r"^(?P<indent>\s*)```\s*(?P<lang>[^\s`]*)\s*$")
SKIP = re.compile(r"^#\s*not run:\s*(?P<reason>\S.*)$")
EXPECTS = re.compile(r"#.*\bends (?P<status>compensated|needs_review)\b")
UNEXPECTED = ("compensated", "needs_review")


@dataclass(frozen=True)
class Block:
    """One ```python block: where it starts (the line after the fence) and its section."""

    line: int
    section: str
    code: str
    page: str = "README.md"

    @property
    def skip_reason(self) -> str | None:
        first = self.code.lstrip("\n").splitlines()[0] if self.code.strip() else ""
        match = SKIP.match(first.strip())
        return match["reason"] if match else None

    @property
    def expected(self) -> set[str]:
        return {m["status"] for m in EXPECTS.finditer(self.code)}

    def where(self) -> str:
        return f"{self.page} line {self.line} (section {self.section!r})"


def python_blocks(text: str, page: str = "README.md") -> list[Block]:
    """The ```python blocks of a Markdown text, in order; an unclosed fence is an error.
    An indented block (in a list item) loses its fence's indentation."""
    blocks: list[Block] = []
    section = "(top)"
    fence: tuple[str, str, int] | None = None  # indent, language, first line of code
    body: list[str] = []
    for number, line in enumerate(text.splitlines(), start=1):
        match = FENCE.match(line)
        if fence is None:
            if line.startswith("## "):
                section = line[3:].strip()
            if match:
                fence, body = (match["indent"], match["lang"], number + 1), []
            continue
        if match and not match["lang"] and len(match["indent"]) <= len(fence[0]):
            indent, lang, start = fence
            if lang in ("python", "py"):
                code = "\n".join(text.removeprefix(indent) for text in body) + "\n"
                blocks.append(Block(start, section, code, page))
            fence = None
        else:
            body.append(line)
    assert fence is None, f"{page}: the fence opened at line {fence[2] - 1} is never closed"
    return blocks


def saga_statuses(url: str) -> dict[str, tuple[str, int, str, str | None]]:
    with psycopg.connect(url) as conn:
        rows = conn.execute("SELECT id::text, name, version, status, error FROM saga.sagas")
        return {r[0]: (r[1], r[2], r[3], r[4]) for r in rows}


@pytest.fixture
def isolated_process_state() -> Iterator[None]:
    """What a block may change for the whole process (a Logging section configures
    structlog and logging, a block may set environment variables) is put back after
    (structlog by the suite's autouse `_structlog_as_found`)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    library = logging.getLogger("saga")
    library_level = library.level
    environ = dict(os.environ)
    try:
        # A reader's process: the page's durable steps, not those of other tests.
        with isolated_steps():
            yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        library.setLevel(library_level)
        os.environ.clear()
        os.environ.update(environ)


def run_blocks(blocks: list[Block], database_url: str, source: Path = README) -> list[str]:
    """Run the blocks in order in one namespace; returns the skipped ones with their reason,
    and fails the calling test at the first block that raises or ends a saga unannounced."""
    namespace: dict[str, Any] = {"__name__": source.stem}
    skipped: list[str] = []
    try:
        for block in blocks:
            # Padded so that a traceback names the page's own line numbers. A skipped
            # block must still be Python.
            code = compile("\n" * (block.line - 1) + block.code, str(source), "exec")
            reason = block.skip_reason
            if reason is not None:
                skipped.append(f"{block.where()}: {reason}")
                continue
            before = saga_statuses(database_url)
            failure = None
            try:
                exec(code, namespace)
            except BaseException:
                failure = f"{block.where()} raised:\n{traceback.format_exc()}"
            if failure is not None:
                pytest.fail(failure, pytrace=False)
            for saga_id, (name, version, status, error) in saga_statuses(database_url).items():
                changed = before.get(saga_id, (None, None, None, None))[2] != status
                if changed and status in UNEXPECTED and status not in block.expected:
                    pytest.fail(
                        f"{block.where()}: saga {name!r} v{version} ({saga_id}) ended {status}"
                        f" ({error}); a block that expects this says so (`# ends {status}`)",
                        pytrace=False,
                    )
    finally:
        for value in list(namespace.values()):
            if isinstance(value, Orchestrator):
                value.close()
    return skipped


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def test_python_blocks_parse_in_order() -> None:
    """The extraction finds the blocks (pages without any would make the test vacuous)."""
    blocks = python_blocks(README.read_text(encoding="utf-8"))
    assert len(blocks) >= 5
    assert blocks[0].section == "What it does"
    every = [b for page in PAGES for b in python_blocks(page.read_text("utf-8"), _name(page))]
    assert len(every) >= 30
    assert {"docs/sagas.md", "docs/sessions.md", "docs/guardrails.md"} <= {b.page for b in every}


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_python_block_of_the_page_runs(
    page: Path, database_url: str, monkeypatch: pytest.MonkeyPatch, isolated_process_state: None
) -> None:
    """Each block runs with the names the blocks before it on its page defined; none
    raises, and no saga ends compensated or parked unless its block says it expects that."""
    blocks = python_blocks(page.read_text(encoding="utf-8"), _name(page))
    if not blocks:
        return  # a page with no Python to run (an API reference page, a table)
    monkeypatch.setenv("SAGA_DATABASE_URL", database_url)
    monkeypatch.syspath_prepend(str(ROOT))
    started = time.monotonic()
    skipped = run_blocks(blocks, database_url, page)
    print(f"{_name(page)}: {len(blocks)} blocks, {len(skipped)} skipped,"
          f" {time.monotonic() - started:.1f} s")  # fmt: skip
    for line in skipped:
        print(f"  skipped {line}")


PARKING = """# Title

## Parks

```python
from pydantic import BaseModel
from saga import Orchestrator, Saga, StepContext

class Job(BaseModel):
    key: str

job = Saga("job", input=Job, key=lambda j: j.key)

@job.step
def work(ctx: StepContext, j: Job) -> dict:
    return undefined_provider.call()
```

```text
not Python: not run
```

```python
# not run: shows the skip marker
raise AssertionError("never run")
```

```python
with Orchestrator(sagas=[job]) as orch:
    orch.execute(job, {"key": "k-1"}){comment}
```
"""


def test_a_block_whose_saga_parks_unannounced_fails(
    database_url: str, monkeypatch: pytest.MonkeyPatch, isolated_process_state: None
) -> None:
    """The check bites: a saga parked on a NameError fails the run, naming the block and
    the reason; announced with `# ends needs_review`, it passes. Text blocks are not run,
    and the skip marker skips with its reason."""
    monkeypatch.setenv("SAGA_DATABASE_URL", database_url)
    text = PARKING.replace("{comment}", "")
    blocks = python_blocks(text)
    assert [(b.line, b.section) for b in blocks] == [(6, "Parks"), (24, "Parks"), (29, "Parks")]
    with pytest.raises(pytest.fail.Exception) as failed:
        run_blocks(blocks, database_url)
    message = str(failed.value)
    assert "README.md line 29 (section 'Parks'): saga 'job' v1" in message
    assert "ended needs_review" in message and "NameError" in message

    announced = python_blocks(PARKING.replace("{comment}", "  # ends needs_review"))
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("TRUNCATE saga.sagas CASCADE")
    assert run_blocks(announced, database_url) == [
        "README.md line 24 (section 'Parks'): shows the skip marker"
    ]
