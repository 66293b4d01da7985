"""The agent examples run as the README and the docs say: each through a make target that
installs its framework's extra first, and an example started without its extra says how
to install it instead of a traceback.

`make -n` prints what a target would run (a fresh .venv included) without running it;
the examples themselves are run, offline, by tests/integration/test_pydantic_ai.py and
tests/integration/test_openai_agents.py.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = (ROOT / "README.md", ROOT / "docs" / "agents.md")
# make target -> (the optional extra it installs, the example it runs)
DEMOS = {
    "demo-agent": ("pydantic-ai", "examples/refund_agent_pydantic_ai.py"),
    "demo-agent-openai": ("openai-agents", "examples/openai_agents_agent.py"),
}


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_the_pages_run_each_agent_example_through_its_make_target(page: Path) -> None:
    text = " ".join(page.read_text(encoding="utf-8").split())
    for target, (_, example) in DEMOS.items():
        assert f"`make {target}` runs `{example}`" in text, f"{page.name}: {target}"


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
@pytest.mark.parametrize("target", DEMOS)
def test_each_agent_demo_installs_its_extra_then_runs_its_example(
    target: str, tmp_path: Path
) -> None:
    extra, example = DEMOS[target]
    venv = tmp_path / "venv"  # never made: -n only prints the commands
    done = subprocess.run(
        ["make", "-n", target, f"VENV={venv}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    commands = done.stdout.splitlines()
    install = next(i for i, line in enumerate(commands) if f"-e '.[{extra}]'" in line)
    run = next(i for i, line in enumerate(commands) if example in line)
    assert install < run
    assert commands[install].startswith(f"{venv}/bin/pip install")
    assert re.search(rf"{venv}/bin/python {re.escape(example)}\b", commands[run])


def test_the_openai_agents_example_without_the_sdk_says_how_to_install_it() -> None:
    """Started where the OpenAI Agents SDK is not installed, as the README ran it before."""
    example = ROOT / "examples" / "openai_agents_agent.py"
    hide_sdk = (
        "import runpy, sys; sys.modules['agents'] = None; "  # import agents now fails
        f"runpy.run_path({str(example)!r}, run_name='__main__')"
    )
    done = subprocess.run(
        [sys.executable, "-c", hide_sdk],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert "needs the OpenAI Agents SDK" in done.stderr
    assert "make demo-agent-openai" in done.stderr
    assert "pip install -e '.[openai-agents]'" in done.stderr
    assert done.stdout == ""
