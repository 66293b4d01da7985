"""Rolling upgrades: the previous release keeps working on the schema this one migrates,
and a package refuses a schema newer than it understands.

The previous release is a commit of this repository, extracted with `git archive` and run
in child processes from its own tree. Update PREVIOUS_RELEASE at each release;
SAGA_TEST_PREVIOUS_RELEASE overrides it (e.g. to check a migration against an older one).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import textwrap
from io import BytesIO
from pathlib import Path
from typing import Any

import psycopg
import pytest
from support import wait_until

from saga import Orchestrator, SchemaTooNew
from saga._db.migrate import apply_migrations, load_migrations
from saga.cli import main as saga_main

REPO_ROOT = Path(__file__).resolve().parents[2]
TREES = ("saga", "migrations")

# The previous release: main with migrations 0001 to 0012 (saga.write_saga_v3, and the
# confirmation queries beside it).
PREVIOUS_RELEASE = os.environ.get(
    "SAGA_TEST_PREVIOUS_RELEASE", "85a34e6f7de907affc3161b34daa24bf2d548c22"
)

# Run by the previous release's package: migrate, then start a saga whose first step
# blocks (after telling the parent) until the parent creates the GO file.
_OLD_WORKER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path

    from pydantic import BaseModel

    import saga
    from saga import Orchestrator, Saga, StepContext

    class Order(BaseModel):
        order_id: str

    probe = Saga("upgrade_probe", input=Order, key=lambda o: o.order_id)

    @probe.step
    def charge(ctx: StepContext, order: Order) -> dict:
        Path(os.environ["UPGRADE_STARTED"]).write_text(ctx.saga_id)
        deadline = time.monotonic() + 120
        while not Path(os.environ["UPGRADE_GO"]).exists():
            if time.monotonic() > deadline:
                raise SystemExit("the parent never let the step finish")
            time.sleep(0.05)
        return {"charged": True}

    @probe.step
    def ship(ctx: StepContext, order: Order) -> dict:
        return {"shipped": True}

    print("PACKAGE", os.path.dirname(saga.__file__), flush=True)
    with Orchestrator(os.environ["UPGRADE_URL"], sagas=[probe]) as orch:
        state = orch.execute(probe, Order(order_id="o-1"))
        print("STATUS", state.status, flush=True)
        for op in state.operations:
            print("OP", op.step, op.kind, op.status, op.attempts, flush=True)
    """
)

_OLD_MIGRATE = textwrap.dedent(
    """
    import os
    import psycopg
    from saga.migrate import apply_migrations

    with psycopg.connect(os.environ["UPGRADE_URL"], autocommit=True) as conn:
        print("applied", apply_migrations(conn), "with", __import__("saga").__file__)
    """
)


@pytest.fixture
def previous_release(tmp_path: Path) -> Path:
    """The previous release's `saga` package and `migrations`, extracted from git."""
    if shutil.which("git") is None or not (REPO_ROOT / ".git").exists():
        pytest.skip("the previous release comes from git history, absent here")
    found = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "cat-file", "-e", f"{PREVIOUS_RELEASE}^{{commit}}"],
        capture_output=True,
    )
    if found.returncode != 0:
        pytest.skip(f"commit {PREVIOUS_RELEASE} is not in this clone (shallow?)")
    archive = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "archive", "--format=tar", PREVIOUS_RELEASE, *TREES],
        capture_output=True,
        check=True,
    )
    tree = tmp_path / "previous"
    with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
        tar.extractall(tree, filter="data")
    return tree


def _old_env(tree: Path, url: str, **extra: str) -> dict[str, str]:
    # PYTHONPATH comes before site-packages: `import saga` finds the old tree first.
    return {**os.environ, "PYTHONPATH": str(tree), "UPGRADE_URL": url, **extra}


def test_a_previous_release_worker_mid_step_records_its_outcome_after_the_upgrade(
    empty_database_url: str, previous_release: Path, tmp_path: Path
) -> None:
    """A worker of the previous release, mid-step while this package migrates the database,
    records the step's outcome and completes its saga: nothing is left unknown."""
    started, go = tmp_path / "started", tmp_path / "go"
    script = tmp_path / "old_worker.py"
    script.write_text(_OLD_WORKER, encoding="utf-8")
    env = _old_env(
        previous_release, empty_database_url, UPGRADE_STARTED=str(started), UPGRADE_GO=str(go)
    )
    child = subprocess.Popen(
        [sys.executable, str(script)],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        # The file is created, then written: wait for its content, not only for the file.
        wait_until(
            lambda: (started.exists() and started.read_text() != "") or child.poll() is not None,
            timeout=60,
        )
        assert child.poll() is None, f"the old worker exited early:\n{child.communicate()[0]}"
        saga_id = started.read_text()

        with psycopg.connect(empty_database_url, autocommit=True) as conn:
            applied = apply_migrations(conn)
        go.touch()
        out, _ = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate(timeout=30)

    assert child.returncode == 0, out
    old_versions = {m.version for m in load_migrations(previous_release / "migrations")}
    assert applied == [m.version for m in load_migrations() if m.version not in old_versions]
    assert f"PACKAGE {previous_release / 'saga'}" in out, out
    assert "STATUS completed" in out, out
    assert "OP charge action succeeded 1" in out, out
    with psycopg.connect(empty_database_url) as conn:
        versions = [int(r[0]) for r in conn.execute("SELECT version FROM saga.schema_migrations")]
    assert max(versions) == max(m.version for m in load_migrations())
    with Orchestrator(empty_database_url, auto_migrate=False) as orch:
        state = orch.get(saga_id)
    assert state.status == "completed"
    assert [(op.step, str(op.status)) for op in state.operations] == [
        ("charge", "succeeded"),
        ("ship", "succeeded"),
    ]
    assert "outcome_unknown" not in [e.event for e in orch.history(saga_id)]


# ----- what the previous release calls, before and after this package migrates -----------


def _functions(url: str) -> dict[str, tuple[str, str, str]]:
    """name(args) -> (arguments, result type, body) of every function in schema saga."""
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT p.proname::text, pg_get_function_identity_arguments(p.oid),"
            " pg_get_function_result(p.oid), p.prosrc"
            " FROM pg_proc AS p JOIN pg_namespace AS n ON n.oid = p.pronamespace"
            " WHERE n.nspname = 'saga'"
        ).fetchall()
    return {
        f"{name}({args})": (str(args), str(result), str(body)) for name, args, result, body in rows
    }


def _columns(url: str) -> dict[tuple[str, str], tuple[str, bool, Any]]:
    """(table, column) -> (type, nullable, default) of every column of schema saga."""
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT table_name::text, column_name::text, data_type::text,"
            " is_nullable = 'YES', column_default"
            " FROM information_schema.columns WHERE table_schema = 'saga'"
        ).fetchall()
    return {(t, c): (ty, bool(null), default) for t, c, ty, null, default in rows}


def _called(tree: Path, functions: dict[str, tuple[str, str, str]]) -> set[str]:
    """Functions of the schema that the code of `tree` calls, directly or through another."""
    by_name: dict[str, list[str]] = {}
    for signature in functions:
        by_name.setdefault(signature.split("(")[0], []).append(signature)
    calls = re.compile(r"\bsaga\.([a-z_0-9]+)\s*\(")
    texts = [
        p.read_text(encoding="utf-8")
        for p in (tree / "saga").rglob("*")
        if p.is_file() and p.suffix in (".py", ".sql")
    ]
    todo = {name for text in texts for name in calls.findall(text) if name in by_name}
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        seen.add(name)
        for signature in by_name[name]:
            todo |= {n for n in calls.findall(functions[signature][2]) if n in by_name} - seen
    return {signature for name in seen for signature in by_name[name]}


def test_migrating_keeps_every_function_and_column_the_previous_release_uses(
    empty_database_url: str, previous_release: Path
) -> None:
    """After this package migrates a database of the previous release, every SQL function
    that release calls is there unchanged, no column is gone or retyped, and every column
    added to an existing table is nullable or has a default (old INSERTs still work)."""
    migrated = subprocess.run(
        [sys.executable, "-c", _OLD_MIGRATE],
        env=_old_env(previous_release, empty_database_url),
        cwd=previous_release,  # `-c` puts the working directory first on sys.path
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert migrated.returncode == 0, migrated.stdout + migrated.stderr
    assert f"with {previous_release / 'saga' / '__init__.py'}" in migrated.stdout
    functions, columns = _functions(empty_database_url), _columns(empty_database_url)
    called = _called(previous_release, functions)
    assert "write_saga(p jsonb)" in called or "apply_transition(p jsonb)" in called

    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        apply_migrations(conn)
    functions_now, columns_now = _functions(empty_database_url), _columns(empty_database_url)

    removed = sorted(f for f in called if f not in functions_now)
    changed = sorted(f for f in called if f in functions_now and functions_now[f] != functions[f])
    assert (removed, changed) == ([], []), (
        "a migration removed or changed a function the previous release calls; give the new "
        "contract a new versioned name and drop the old one a release later"
    )
    gone = sorted(c for c in columns if columns_now.get(c, (None,))[0] != columns[c][0])
    assert gone == [], "a column the previous release has was dropped or retyped"
    tables = {t for t, _ in columns}
    required = sorted(
        (t, c)
        for (t, c), (_, nullable, default) in columns_now.items()
        if t in tables and (t, c) not in columns and not nullable and default is None
    )
    assert required == [], "a new NOT NULL column without a default breaks the old INSERTs"


# ----- a schema newer than the package ---------------------------------------------------


def test_a_schema_newer_than_the_package_is_refused(
    database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A database migrated by a newer release makes the package refuse to migrate or start,
    by `saga migrate` and by the orchestrator's auto-migration, naming both versions."""
    shipped = max(m.version for m in load_migrations())
    future = shipped + 7
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO saga.schema_migrations (version, name) VALUES (%s, 'from_the_future')",
            (future,),
        )
        with pytest.raises(SchemaTooNew) as refused:
            apply_migrations(conn)
    assert refused.value.database_version == future
    assert refused.value.package_version == shipped
    assert f"{future:04d}" in str(refused.value) and f"{shipped:04d}" in str(refused.value)

    orch = Orchestrator(database_url)
    try:
        with pytest.raises(SchemaTooNew, match=f"{future:04d}"):
            _ = orch.store
    finally:
        orch.close()

    capsys.readouterr()
    code = saga_main(["migrate", "--database-url", database_url])
    err = capsys.readouterr().err
    assert code == 1
    assert f"migration {future:04d}" in err and f"up to {shipped:04d}" in err
    with psycopg.connect(database_url) as conn:
        kept = conn.execute("SELECT max(version) FROM saga.schema_migrations").fetchone()
    assert kept is not None and kept[0] == future
