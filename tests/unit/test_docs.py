"""The documentation site: its Python compiles, imports only names that exist, and it builds.

Every ```python block under docs/ must compile, and every name it imports from `saga` must
be there: a renamed function fails here, not in a reader's terminal. The site itself is
built with `mkdocs build --strict` (as `make docs` does) into a temporary directory, so a
broken link, a page left out of the nav or a docstring griffe cannot parse fails the suite.
That built site's API reference must show no internal name (a base such as `Engine`, a
`_private` parameter or module), and in headless Chromium (Debian's `chromium` and
`chromium-driver`; skipped without them) its long code lines scroll sideways and the
copy button lies over no code. The README stays a front door: at most 300 lines, its
links reach files and headings that exist, and its first example is the manual's.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
FENCE = re.compile(r"^(?P<indent>\s*)```\s*(?P<lang>[^\s`]*)\s*$")
# What `make docs` needs; without them the build is skipped (the `docs` and `test` extras
# install them).
BUILD_MODULES = ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python")


@dataclass(frozen=True)
class Block:
    """One ```python block: its page, the line its code starts on, and the code."""

    page: Path
    line: int
    code: str

    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def fenced_blocks(page: Path) -> list[tuple[str, Block]]:
    """The fenced blocks of a Markdown page with their language; an unclosed fence fails."""
    blocks: list[tuple[str, Block]] = []
    opened: tuple[str, str, int] | None = None  # indent, language, first line of code
    body: list[str] = []
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), start=1):
        match = FENCE.match(line)
        if opened is None:
            if match:
                opened, body = (match["indent"], match["lang"], number + 1), []
            continue
        if match and not match["lang"] and len(match["indent"]) <= len(opened[0]):
            indent, lang, start = opened
            code = "\n".join(text.removeprefix(indent) for text in body) + "\n"
            blocks.append((lang, Block(page, start, code)))
            opened = None
        else:
            body.append(line)
    if opened is not None:
        pytest.fail(f"{page.relative_to(ROOT)}: the fence at line {opened[2] - 1} never closes")
    return blocks


def python_blocks() -> list[Block]:
    return [
        block
        for page in sorted(DOCS.rglob("*.md"))
        for lang, block in fenced_blocks(page)
        if lang in ("python", "py")
    ]


def test_the_docs_have_python_blocks() -> None:
    """The extraction finds the pages' examples (no blocks would make the checks vacuous)."""
    pages = {block.page.name for block in python_blocks()}
    assert len(python_blocks()) >= 15
    assert {"getting-started.md", "sagas.md", "sessions.md", "guardrails.md"} <= pages


def test_every_python_block_compiles() -> None:
    """Each ```python block of docs/ is valid Python (compiled, not run)."""
    failures = []
    for block in python_blocks():
        try:
            compile(block.code, block.where(), "exec")
        except SyntaxError as exc:
            failures.append(f"{block.where()}: line {exc.lineno} of the block: {exc.msg}")
    assert not failures, "\n".join(failures)


def test_every_name_imported_from_saga_exists() -> None:
    """`from saga... import X` in the docs names modules and attributes that exist."""
    failures = []
    for block in python_blocks():
        for node in ast.walk(ast.parse(block.code)):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module != "saga" and not node.module.startswith("saga."):
                    continue
                module = importlib.import_module(node.module)
                failures += [
                    f"{block.where()}: {node.module} has no {alias.name!r}"
                    for alias in node.names
                    if alias.name != "*" and not hasattr(module, alias.name)
                ]
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == "saga" or alias.name.startswith("saga."):
                        importlib.import_module(alias.name)
    assert not failures, "\n".join(failures)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a dotted name whose parent package is missing
        return False


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site built once for this module's tests, as `make docs` builds it."""
    missing = [name for name in BUILD_MODULES if not _installed(name)]
    if missing:
        pytest.skip(
            f"the docs extra is not installed (no {', '.join(missing)}): pip install '.[docs]'"
        )
    site = tmp_path_factory.mktemp("docs") / "site"
    # Material prints a notice about MkDocs 2.0 on every build; it is no warning of ours.
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
         str(ROOT / "mkdocs.yml"), "--site-dir", str(site)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    return site


def test_the_site_builds_strictly(site: Path) -> None:
    """`mkdocs build --strict` (what `make docs` runs) succeeds, API reference included."""
    reference = (site / "reference" / "testing.html").read_text(encoding="utf-8")
    assert "crash_test" in reference
    orchestrators = (site / "reference" / "orchestrators.html").read_text("utf-8")
    assert "AsyncOrchestrator" in orchestrators


# Public members of the orchestrators the reference leaves out (docs/reference/orchestrators.md).
UNDOCUMENTED = {
    "store",
    "lease_keeper",
    "runner",
    "runner_options",
    "purge_cutoff_days",
    "ensure_pool_size",
}


def test_the_reference_shows_every_verb_of_the_orchestrators(site: Path) -> None:
    """Each public method and property of `Orchestrator` and `AsyncOrchestrator` has its
    entry in the reference: the page names its members in an order of its own
    (`members:`), since they are defined in several modules."""
    from saga import AsyncOrchestrator, Orchestrator

    page = (site / "reference" / "orchestrators.html").read_text("utf-8")
    missing = [
        f"{door.__name__}.{name}"
        for door in (Orchestrator, AsyncOrchestrator)
        for name in dir(door)
        if not name.startswith("_")
        and name not in UNDOCUMENTED
        and f'id="saga.{door.__name__}.{name}"' not in page
    ]
    assert missing == []


def _public_paths() -> set[str]:
    """Full paths of the names `saga` exports (`saga.__all__`), under the module that
    defines each: what a base shown in the reference may be."""
    import saga

    paths = set()
    for name in saga.__all__:
        value = getattr(saga, name)
        paths.add(f"saga.{name}")
        paths.add(f"{getattr(value, '__module__', 'saga')}.{name}")
    return paths


def _type_variable(path: str) -> bool:
    """True when `path` names a type variable (the `P` of a base `Generic[P, R]`)."""
    from typing import ParamSpec, TypeVar

    module, _, name = path.rpartition(".")
    return isinstance(getattr(importlib.import_module(module), name, None), TypeVar | ParamSpec)


def test_the_api_reference_shows_no_internal_names(site: Path) -> None:
    """A public class shows no internal base (`Bases: Engine`), and no page shows a
    private name (`_SessionBase`, a `_spent` parameter) or a private module's path."""
    public = _public_paths()
    failures = []
    for page in sorted((site / "reference").glob("*.html")):
        text = page.read_text(encoding="utf-8")
        for bases in re.findall(r"Bases: <code>(.*?)</code>", text, re.DOTALL):
            failures += [
                f"{page.name}: Bases: {path}"
                for path in re.findall(r'title="\s*(?:[^"(]*\()?(saga\.[\w.]+)', bases)
                if path not in public and not _type_variable(path)
            ]
        visible = re.sub(r"<script.*?</script>|<style.*?</style>|<[^>]+>", " ", text, flags=re.S)
        failures += [
            f"{page.name}: shows {name}"
            for name in sorted(set(re.findall(r"(?<![\w.])_[A-Za-z]\w*", visible)))
        ]
        failures += [
            f"{page.name}: anchor {anchor}"
            for anchor in sorted(set(re.findall(r'id="(saga\.[\w.]*\._[\w.]*)"', text)))
        ]
    assert not failures, "\n".join(failures)


CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
# For each code block: can its code scroll sideways, and does any code text the reader
# can see (clipped to the scrolling box) lie under its copy button? Asked with the block
# scrolled to its start, then to its end.
CODE_BLOCKS = """
const blocks = [];
for (const pre of document.querySelectorAll('.md-content pre')) {
  const code = pre.querySelector(':scope > code');
  const button = pre.querySelector('.md-code__button');
  if (!code || !button) continue;
  const under = [];
  for (const scroll of [0, code.scrollWidth]) {
    code.scrollLeft = scroll;
    const b = button.getBoundingClientRect(), c = code.getBoundingClientRect();
    const left = c.left + code.clientLeft, right = left + code.clientWidth;
    const walker = document.createTreeWalker(code, NodeFilter.SHOW_TEXT);
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
      if (!node.textContent.trim()) continue;
      const range = document.createRange();
      range.selectNodeContents(node);
      for (const r of range.getClientRects()) {
        const l = Math.max(r.left, left), rr = Math.min(r.right, right);
        if (rr > l && rr > b.left && l < b.right && r.bottom > b.top && r.top < b.bottom)
          under.push(node.textContent.trim());
      }
    }
  }
  code.scrollLeft = 0;
  blocks.push({
    first: code.textContent.split('\\n')[0].slice(0, 60),
    scrollWidth: code.scrollWidth,
    clientWidth: code.clientWidth,
    overflowX: getComputedStyle(code).overflowX,
    under: under,
  });
}
return blocks;
"""


# Pages with code lines wider than the page.
LONG_LINES = ("getting-started.html", "production.html")


def test_long_code_lines_scroll_and_the_copy_button_covers_no_code(site: Path) -> None:
    """In headless Chromium, a code block wider than the page scrolls sideways (never cut
    off), and its copy button lies over no code text, scrolled to the start or the end."""
    if not CHROMEDRIVER.exists() or not CHROMIUM.exists():
        pytest.skip(
            f"the browser test needs {CHROMIUM} and {CHROMEDRIVER}: "
            "apt-get install -y chromium chromium-driver"
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    try:
        blocks = []
        for width, pages in ((1440, LONG_LINES), (390, LONG_LINES[:1])):  # desktop, phone
            driver.set_window_size(width, 1000)
            for page in pages:
                driver.get((site / page).as_uri())
                found = driver.execute_script(CODE_BLOCKS)
                assert found, f"{page}: no code block with a copy button"
                blocks += [{**block, "page": page, "width": width} for block in found]
    finally:
        driver.quit()
    wide = [block for block in blocks if block["scrollWidth"] > block["clientWidth"]]
    assert len({block["page"] for block in wide if block["width"] == 1440}) >= 2
    cut = [block for block in wide if block["overflowX"] not in ("auto", "scroll")]
    assert not cut, cut
    covered = [block for block in blocks if block["under"]]
    assert not covered, covered


def test_the_home_page_says_which_exceptions_fail_a_step() -> None:
    """docs/index.md names what fails a step as `RetryPolicy` classifies it: a `retry_on`
    error fails it too once its retries run out, an ambiguous one not listed is unknown."""
    from saga import PermanentError, RetryPolicy, TransientError

    policy = RetryPolicy()
    assert policy.classify(PermanentError("no")) == "failed"
    assert policy.classify(TransientError("later")) == "retry"
    assert policy.classify(ConnectionResetError()) == policy.classify(KeyError()) == "unknown"
    page = " ".join((DOCS / "index.md").read_text(encoding="utf-8").split())
    start = page.index("**An exception is not a verdict.**")
    bullet = page[start : page.index(" - **", start)]
    assert "Only `PermanentError`" not in bullet
    for words in (
        "`PermanentError` or an exception it lists in `fail_on`",
        "`retry_on` (by default `TransientError` alone) run out",
        "`max_attempts` is reached",
        "`ConnectionError` or `TimeoutError` not listed in `retry_on`",
        "outcome is unknown",
    ):
        assert words in bullet, words


README = ROOT / "README.md"
# A Markdown link to a file of the repository: [text](path) or [text](path#anchor).
LINK = re.compile(r"\]\((?P<path>[^)#\s]*)(?:#(?P<anchor>[^)\s]+))?\)")
HEADING = re.compile(r"^#{1,6}\s+(?P<title>.+?)\s*$")


def _slug(title: str) -> str:
    """The anchor GitHub (and MkDocs' toc, for these headings) gives a heading."""
    title = re.sub(r"[^\w\- ]", "", title.strip().lower())
    return title.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    anchors, fenced = set(), False
    for line in page.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and (heading := HEADING.match(line)):
            anchors.add(_slug(heading["title"]))
    return anchors


def test_the_readme_is_a_front_door_not_the_manual() -> None:
    """The README stays short (the pitch, the two commands, the first example, the doors
    and the limits); the manual is docs/."""
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines: move detail into docs/"
    text = "\n".join(lines)
    for words in ("make demo", "make test", "## Limits", "## Which door"):
        assert words in text, words


def test_the_readmes_links_reach_a_file_and_heading() -> None:
    """Every relative link of the README names a file of the repository (as GitHub reads
    it) and, with an anchor, a heading of that file."""
    failures, links = [], 0
    for match in LINK.finditer(README.read_text(encoding="utf-8")):
        path, anchor = match["path"], match["anchor"]
        if "://" in path or not (path or anchor):
            continue
        links += 1
        target = (ROOT / path) if path else README
        if not target.is_file():
            failures.append(f"{path}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            failures.append(f"{path}#{anchor}: no such heading")
    assert links >= 10
    assert not failures, "\n".join(failures)


def test_the_readmes_first_example_is_the_one_of_declared_sagas() -> None:
    """The one block the README shares with the manual, its first example, is the same
    text as the first example of docs/sagas.md: a fix in one that misses the other fails
    here instead of drifting."""
    readme = [block for lang, block in fenced_blocks(README) if lang == "python"]
    sagas = [block for lang, block in fenced_blocks(DOCS / "sagas.md") if lang == "python"]
    assert readme[0].code == sagas[0].code, "README.md's first example differs from sagas.md's"
