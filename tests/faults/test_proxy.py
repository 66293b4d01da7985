"""The lost-reply proxy itself: a client killed in a transaction ends it on the server."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import psycopg
import pytest

from faults.harness import wait_for
from faults.proxy import LostReplyProxy

pytestmark = [pytest.mark.integration, pytest.mark.crash]

LOCK = 290_429


def _lock_free(url: str) -> bool:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT pg_try_advisory_lock(%s)", (LOCK,)).fetchone()
        assert row is not None
        if row[0]:
            conn.execute("SELECT pg_advisory_unlock(%s)", (LOCK,))
        return bool(row[0])


def test_a_client_killed_in_a_transaction_leaves_nothing_held(database_url: str) -> None:
    """A process SIGKILLed with a transaction open through the proxy (an advisory lock
    taken, as `saga migrate` takes one): the server ends that transaction, and the lock
    is free again, as without the proxy. Kept open, it would hold every later migration
    (and a pooler's server connection) for ever."""
    code = textwrap.dedent(
        f"""
        import os, signal, sys, psycopg
        conn = psycopg.connect(sys.argv[1])
        conn.execute("SELECT pg_advisory_xact_lock({LOCK})")
        print("held", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    with LostReplyProxy(database_url) as proxy:
        child = subprocess.run(
            [sys.executable, "-c", code, proxy.url], capture_output=True, text=True, timeout=60
        )
        assert "held" in child.stdout, child.stderr
        wait_for(lambda: _lock_free(database_url), timeout=10, what="the lock to be free")
