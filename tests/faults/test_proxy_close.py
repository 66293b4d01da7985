"""The harness's proxy behaves as a network does when a client process dies: the server
side of its connection is closed, so its backend ends and its transaction rolls back."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from faults.harness import scalar, wait_for
from faults.proxy import LostReplyProxy

pytestmark = [pytest.mark.integration]


def test_a_killed_client_leaves_no_transaction_open_behind_the_proxy(database_url: str) -> None:
    """A client SIGKILLed inside a transaction that holds an advisory lock (as a worker
    killed while checking migrations at start holds the migrations' lock): its backend is
    gone within seconds, and the lock with it. The proxy used to keep the server side open
    for as long as it ran, the backend idle in transaction: every later migration check,
    every worker starting and the soak's final quiescing waited on that lock for ever
    (`sagas still open after 120s of quiescing`)."""
    with LostReplyProxy(database_url) as proxy:
        child = subprocess.Popen(
            [
                sys.executable,
                "-c",
                textwrap.dedent(
                    f"""
                    import time, psycopg
                    conn = psycopg.connect({proxy.url!r}, application_name="killed-client")
                    conn.execute("SELECT pg_advisory_xact_lock(4242)")
                    print("LOCKED", flush=True)
                    time.sleep(120)
                    """
                ),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "LOCKED"
        finally:
            child.kill()
            child.wait(timeout=30)
            if child.stdout is not None:
                child.stdout.close()
        backends = "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'killed-client'"
        wait_for(lambda: scalar(database_url, backends) == 0, timeout=10, what="backend ended")
        assert scalar(database_url, "SELECT pg_try_advisory_lock(4242)") is True
