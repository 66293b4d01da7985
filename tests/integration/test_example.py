"""The examples run end to end against a real PostgreSQL and tell the truth."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _run_example(name: str, database_url: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SAGA_DATABASE_URL": database_url}
    return subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        env=env,
        cwd=EXAMPLES.parent,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_renewal_example_tells_its_three_scenes(database_url: str) -> None:
    """A clean run completes, a crash after the charge leaves exactly one charge, a refused
    shipment is compensated in reverse order; the script checks each and exits 0."""
    proc = _run_example("renewal_saga.py", database_url)
    output = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}\n{output}\n{proc.stderr}"
    assert "FAILED" not in output + proc.stderr
    assert "-> saga completed: reserve_inventory succeeded, charge succeeded" in output
    assert "the child died by SIGKILL" in output
    assert "find_charge: outcome unknown; asked by key, the provider has ch_" in output
    assert "-> saga completed with exactly one charge at the provider" in output
    assert "create_shipment: the carrier refuses" in output
    assert "-> saga compensated in reverse order" in output
    refund_at = output.index("refund: refunded")
    release_at = output.index("release_inventory: released")
    assert refund_at < release_at, "the refund must run before the release"
    assert output.rstrip().endswith("All three scenes ended as told.")


def test_refund_example_waits_for_a_signed_approval(database_url: str) -> None:
    """A small refund runs; a large one waits despite `confirmed: true` in its payload, asks
    again when the fee changes, and is paid exactly once after the signed approval."""
    proc = _run_example("refund_with_confirmation.py", database_url)
    output = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}\n{output}\n{proc.stderr}"
    assert "-> awaiting_confirmation; the agent's input said confirmed=true, ignored" in output
    assert "-> asks again: fee_cents=45" in output
    assert "exactly one refund at the provider, approved by lead@acme" in output
    assert output.rstrip().endswith("All scenes ended as told.")
