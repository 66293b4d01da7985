"""Real PostgreSQL for the test suite: one server per session, one fresh database per test.

The server comes from `saga.testing.postgres_server`, as users' suites get it:
`SAGA_TEST_DATABASE_URL`, else a testcontainers PostgreSQL when a Docker engine answers,
else the embedded PostgreSQL, in a directory of this session only (`private_root`,
outside pytest's shared temporary base, which any other pytest run of the same user may
chmod). Migrations are applied once into a
template database; each test that asks for `database_url` gets a copy of it
(`CREATE DATABASE ... TEMPLATE`), dropped after the test. Nothing here runs unless a test
asks for one of these fixtures, so the unit tests never touch a database.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import structlog
from hypothesis import HealthCheck, settings
from psycopg import sql
from psycopg.conninfo import make_conninfo

from saga._db import embedded
from saga.testing import postgres_server

_INTEGRATION_DIR = Path(__file__).resolve().parent / "integration"
_FAULTS_DIR = Path(__file__).resolve().parent / "faults"


# Set by the controller of a parallel run (pytest-xdist, `-n N`) for its workers: the URL of
# the one server every worker uses, and the data directory of that server when it is the
# embedded one. Not for users: they set SAGA_TEST_DATABASE_URL.
_ENV_SHARED_URL = "SAGA_TEST_SHARED_SERVER_URL"
_ENV_SHARED_DIR = "SAGA_TEST_SHARED_EMBEDDED_DIR"

# Fixtures through which a test reaches the suite's database server.
_SERVER_FIXTURES = frozenset({"server_url", "postgres_server_url"})


# Property tests assert what holds for every input, never how fast inputs are made: on a
# shared machine under load, Hypothesis's timing checks (a deadline per example, "input
# generation is slow") fail tests whose property held.
settings.register_profile("suite", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("suite")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--server-tests-only",
        action="store_true",
        help="run only the tests that use the suite's database server (a fixture such as"
        " database_url): a second run against another server skips the tests that could"
        " not tell the two apart",
    )
    parser.addoption(
        "--skip-long-faults",
        action="store_true",
        help="leave out the fault scenarios of tests/faults (run them in another pass)",
    )


def _xdist_controller(config: pytest.Config) -> bool:
    """This process hands tests to pytest-xdist workers (`-n N`, N > 0)."""
    if hasattr(config, "workerinput"):
        return False
    return bool(getattr(config.option, "numprocesses", None)) and (
        getattr(config.option, "dist", "no") != "no"
    )


def pytest_configure(config: pytest.Config) -> None:
    """In a parallel run, the controller starts the suite's one server (the embedded one,
    or a container) before the workers start, and hands its URL to them: one server for
    all, started once, stopped when the run ends. Each worker migrates a template of its
    own on it, and each test still gets a fresh database."""
    if not _xdist_controller(config) or os.environ.get(_ENV_SHARED_URL):
        return
    if os.environ.get("SAGA_TEST_DATABASE_URL"):
        return  # the workers use it as it is
    stack = contextlib.ExitStack()
    root = Path(tempfile.mkdtemp(prefix="saga-test-"))
    stack.callback(shutil.rmtree, root, ignore_errors=True)
    data_dir = root / "pgdata"
    stack.callback(embedded.detach, data_dir)
    url = stack.enter_context(postgres_server(data_dir))
    os.environ[_ENV_SHARED_URL] = url
    os.environ[_ENV_SHARED_DIR] = str(data_dir)
    config.add_cleanup(stack.close)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test under tests/integration as `integration`; leave out what
    `--server-tests-only` and `--skip-long-faults` say."""
    keep: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    for item in items:
        path = Path(str(item.path)).resolve()
        if path == _INTEGRATION_DIR or _INTEGRATION_DIR in path.parents:
            item.add_marker(pytest.mark.integration)
        no_server = not _SERVER_FIXTURES & set(getattr(item, "fixturenames", ()))
        a_fault = path == _FAULTS_DIR or _FAULTS_DIR in path.parents
        if (config.getoption("server_tests_only") and no_server) or (
            config.getoption("skip_long_faults") and a_fault
        ):
            dropped.append(item)
        else:
            keep.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


@pytest.fixture(autouse=True)
def _structlog_as_found() -> Iterator[None]:
    """Leave structlog's configuration as the test found it: a test that runs the `saga`
    command in-process (`saga.cli.main` configures structlog for its process) must not
    change what the events of the tests after it go through (`capture_logs` replaces the
    processors only, not a filtering wrapper class a configuration left behind)."""
    was_configured = structlog.is_configured()
    saved = structlog.get_config()
    yield
    if was_configured:
        structlog.configure(**saved)
    else:
        structlog.reset_defaults()


def _connect_autocommit(url: str) -> psycopg.Connection[Any]:
    return psycopg.connect(url, autocommit=True)


def _new_database_name(prefix: str) -> str:
    return f"{prefix}_{os.getpid()}_{secrets.token_hex(4)}"


def _drop_database(server: str, name: str) -> None:
    with _connect_autocommit(server) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


@pytest.fixture(scope="session")
def private_root() -> Iterator[Path]:
    """A directory of this session only, removed at its end: `tempfile.mkdtemp` (mode
    0o700, ours), not under pytest's `/tmp/pytest-of-<user>`, whose mode every other pytest
    run of the same user resets to 0o700. Running as root, the embedded server runs as
    another system user that must traverse to its data directory: a reset base directory
    would lock it out of a data directory placed there."""
    root = Path(tempfile.mkdtemp(prefix="saga-test-"))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def private_dir(private_root: Path, request: pytest.FixtureRequest) -> Iterator[Path]:
    """A fresh directory of this test, under `private_root` (for embedded servers a test
    starts itself; `tmp_path` is fine for anything else)."""
    name = re.sub(r"[^\w.-]", "_", request.node.name)[:40]
    path = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=private_root))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def embedded_data_dir(private_root: Path) -> Path:
    """Where this session's embedded PostgreSQL lives, when the suite uses one (in a
    parallel run, the one the controller started for all workers)."""
    shared = os.environ.get(_ENV_SHARED_DIR)
    return Path(shared) if shared else private_root / "pgdata"


@pytest.fixture(scope="session")
def server_url(embedded_data_dir: Path) -> Iterator[str]:
    """The maintenance URL of the PostgreSQL server used by this test session."""
    shared = os.environ.get(_ENV_SHARED_URL)
    if shared:
        yield shared  # started and stopped by the controller of this parallel run
        return
    try:
        with postgres_server(embedded_data_dir) as url:
            yield url
    finally:
        # Stop the embedded server (if this session started one) before its directory goes.
        embedded.detach(embedded_data_dir)


@pytest.fixture(scope="session")
def template_database(server_url: str) -> Iterator[str]:
    """Name of a database holding the migrated schema, copied by every `database_url`."""
    from saga._db.migrate import apply_migrations

    name = _new_database_name("saga_tpl")
    with _connect_autocommit(server_url) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        with _connect_autocommit(make_conninfo(server_url, dbname=name)) as conn:
            apply_migrations(conn)
        yield name
    finally:
        _drop_database(server_url, name)


@pytest.fixture
def database_url(server_url: str, template_database: str) -> Iterator[str]:
    """URL of a fresh, migrated database of this test only, dropped afterwards."""
    name = _new_database_name("saga_t")
    with _connect_autocommit(server_url) as conn:
        conn.execute(
            sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(template_database)
            )
        )
    try:
        yield make_conninfo(server_url, dbname=name)
    finally:
        _drop_database(server_url, name)


@pytest.fixture
def empty_database_url(server_url: str) -> Iterator[str]:
    """URL of a fresh database with no migrations applied, dropped afterwards."""
    name = _new_database_name("saga_e")
    with _connect_autocommit(server_url) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {} TEMPLATE template0").format(sql.Identifier(name)))
    try:
        yield make_conninfo(server_url, dbname=name)
    finally:
        _drop_database(server_url, name)


@pytest.fixture(scope="session")
def pgbouncer(server_url: str) -> Iterator[Any]:
    """A real PgBouncer (`faults.pgbouncer.PgBouncer`) in transaction mode in front of this
    session's server. Skipped when pgbouncer is not installed, unless
    `SAGA_TEST_REQUIRE_PGBOUNCER=1` (as `.ci/run` sets it), which fails instead."""
    from faults.pgbouncer import ENV_REQUIRE, PgBouncer, find_pgbouncer

    if find_pgbouncer() is None:
        reason = "pgbouncer is not installed (Debian: apt-get install pgbouncer)"
        if os.environ.get(ENV_REQUIRE) == "1":
            pytest.fail(f"{reason}, and {ENV_REQUIRE}=1 requires it")
        pytest.skip(reason)
    with PgBouncer(server_url) as bouncer:
        yield bouncer


@pytest.fixture
def pooled_url(pgbouncer: Any, database_url: str) -> str:
    """`database_url` as reached through the session's PgBouncer in transaction mode."""
    return str(pgbouncer.url_for(database_url))
