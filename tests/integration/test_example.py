"""The renewal example runs end to end against a real PostgreSQL and tells the truth."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "renewal_saga.py"


def test_renewal_example_tells_its_three_scenes(database_url: str) -> None:
    """A clean run completes, a crash after the charge leaves exactly one charge, a refused
    shipment is compensated in reverse order; the script checks each and exits 0."""
    env = {**os.environ, "SAGA_DATABASE_URL": database_url}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE)],
        env=env,
        cwd=EXAMPLE.parent.parent,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
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
