"""Fixtures of the fault scenarios: the provider's ledger and worker processes to clean up."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from faults import app
from faults.harness import WorkerProcess


@pytest.fixture
def provider_url(database_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The fake provider's ledger, in this test's database; known to step code here too."""
    app.create_provider(database_url)
    monkeypatch.setenv(app.ENV_PROVIDER_URL, database_url)
    return database_url


@pytest.fixture
def workers() -> Iterator[list[WorkerProcess]]:
    """Worker processes of a test; any still alive afterwards is killed."""
    started: list[WorkerProcess] = []
    yield started
    for worker in started:
        worker.kill()


@pytest.fixture
def log_dir(tmp_path: Path) -> Path:
    return tmp_path / "logs"
