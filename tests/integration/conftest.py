"""Fixtures of the integration tests: orchestrators bound to the test's fresh database."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cli_app
import crash_app
import psycopg
import pytest
from support import ChildApp, OrchestratorFactory

from saga import Orchestrator, Saga


@pytest.fixture
def make_orch(database_url: str) -> Iterator[OrchestratorFactory]:
    """Build orchestrators on this test's database; every one is closed after the test."""
    made: list[Orchestrator] = []

    def make(
        *sagas: Saga[Any], lease_seconds: float = 10.0, owner: str | None = None
    ) -> Orchestrator:
        orch = Orchestrator(
            database_url, sagas=list(sagas), lease_seconds=lease_seconds, owner=owner
        )
        made.append(orch)
        return orch

    yield make
    for orch in reversed(made):
        orch.close()


@pytest.fixture
def app_url(database_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The test database, with the fake provider's tables, known to the step code here too."""
    crash_app.create_provider_tables(database_url)
    monkeypatch.setenv(crash_app.ENV_URL, database_url)
    return database_url


@pytest.fixture
def children() -> Iterator[list[ChildApp]]:
    """Child processes of a test; any still alive after it is killed."""
    started: list[ChildApp] = []
    yield started
    for child in started:
        child.kill()


@pytest.fixture
def app_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The directory the CLI app's steps log their calls to, here and in the command."""
    monkeypatch.setenv(cli_app.ENV_DIR, str(tmp_path))
    return tmp_path


@pytest.fixture
def calls(database_url: str) -> Iterator[list[tuple[str, int]]]:
    """(step, attempt) of every step call recorded with `support.record_step_call`, read
    from the test database when asked."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE step_log (id bigserial, step text, attempt int)")

    class Log(list[tuple[str, int]]):
        def __iter__(self) -> Iterator[tuple[str, int]]:
            with psycopg.connect(database_url) as conn:
                rows = conn.execute("SELECT step, attempt FROM step_log ORDER BY id").fetchall()
            return iter([(str(s), int(a)) for s, a in rows])

    yield Log()
