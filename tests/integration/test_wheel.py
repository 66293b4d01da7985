"""The built wheel carries the SQL migrations, and its `saga migrate` applies them."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parents[2]
TABLES = ("saga.sagas", "saga.operations", "saga.events")


def run(*args: str | Path, cwd: Path, timeout: float = 600) -> str:
    """Run a command and return its output; a failure shows everything it printed."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SAGA_DATABASE_URL")}
    proc = subprocess.run(
        [str(a) for a in args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, f"{args} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def build_wheel(out: Path) -> Path:
    if importlib.util.find_spec("hatchling") is not None:
        run(sys.executable, "-m", "build", "--wheel", "--no-isolation", "-o", out, ROOT, cwd=ROOT)
    else:  # pip fetches hatchling into an isolated build environment
        run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", out, ROOT, cwd=ROOT)
    (wheel,) = out.glob("saga_orchestrator-*.whl")
    return wheel


def test_installed_wheel_migrates_an_empty_database(
    tmp_path: Path, empty_database_url: str
) -> None:
    """A wheel built from the repository holds saga/migrations/0001_initial.sql, and the
    `saga migrate` it installs, run away from the source tree, creates the saga tables."""
    wheel = build_wheel(tmp_path / "dist")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    assert "saga/migrations/0001_initial.sql" in names, names

    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", venv, cwd=tmp_path)
    run(venv / "bin" / "python", "-m", "pip", "install", "--quiet", wheel, cwd=tmp_path)
    run(venv / "bin" / "saga", "migrate", "--database-url", empty_database_url, cwd=tmp_path)

    with psycopg.connect(empty_database_url) as conn:
        for table in TABLES:
            row = conn.execute("SELECT to_regclass(%s)::text", (table,)).fetchone()
            assert row is not None
            assert row[0] == table, f"{table} is missing after `saga migrate`"
