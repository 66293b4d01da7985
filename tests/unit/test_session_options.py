"""The server settings of the orchestrator's connections: bounded by a lease."""

from __future__ import annotations

import pytest

from saga.orchestrator import session_options


def test_row_locks_and_idle_transactions_are_bounded_by_a_lease(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Both timeouts are the lease, in milliseconds, after the options the user gave."""
    monkeypatch.delenv("PGOPTIONS", raising=False)
    assert session_options("postgresql://h/db", 2.5) == (
        "-c idle_in_transaction_session_timeout=2500 -c lock_timeout=2500 -c saga.hash_version=2"
    )
    url = "postgresql://h/db?options=-c%20search_path%3Dapp"
    assert session_options(url, 10.0).startswith("-c search_path=app -c idle_in")
    monkeypatch.setenv("PGOPTIONS", "-c work_mem=64MB")
    assert session_options("postgresql://h/db", 1.0).startswith("-c work_mem=64MB -c idle_in")
