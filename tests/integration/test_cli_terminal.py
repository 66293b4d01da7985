"""What the `saga` command prints of data it does not control (tenants, keys, provider
error texts) cannot drive the terminal or forge a line: human-readable output shows
control characters as escapes; JSON output keeps them exact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from saga import Orchestrator

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

# A tenant that rings and recolours, a key whose newline would add a forged row, a
# provider's error that clears the screen, sets the window title and uses C1 controls.
TENANT = "ac\x1b[31mme\x07\u202eok"
FORGED = "6f0c0000-0000-0000-0000-000000000000  ledger v1  acme  x  completed  1s ago  -"
KEY = f"run-1\n{FORGED}\rcr"
ERROR = "declined\x1b[2J\x1b]0;pwned\x07 by \x9b31m the bank\x85next\u202eline\x01\x7f"
CALL_KEY = "charge\x1b[8m:o-1"
# What a terminal acts on: none of it may reach human-readable output.
CONTROLS = {chr(c) for c in (*range(0x20), *range(0x7F, 0xA0), 0x2028, 0x2029, 0x202E)}


def _saga(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAGA_")}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(ROOT)])
    return subprocess.run(
        [sys.executable, "-m", "saga", *args, "--database-url", url],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _raw(text: str) -> set[str]:
    """The control characters in `text`, but the newlines ending its lines."""
    return {c for c in text if c in CONTROLS and c != "\n"}


def _channel(url: str) -> str:
    with Orchestrator(url) as orch:
        call = orch.ledger.claim(KEY, CALL_KEY, "charge", {"amount_cents": 100}, tenant=TENANT)
        orch.ledger.fail(call, ERROR)
        return call.saga_id


def test_list_and_show_escape_control_characters_and_json_keeps_them(database_url: str) -> None:
    saga_id = _channel(database_url)

    listed = _saga(database_url, "list")
    assert listed.returncode == 0, listed.stderr
    assert not _raw(listed.stdout), repr(listed.stdout)
    lines = listed.stdout.splitlines()
    assert len(lines) == 2, lines  # the header and the one channel: no forged row
    assert lines[1].startswith(saga_id)
    assert "6f0c0000" in lines[1]  # shown, inside the key's cell
    assert "ac\\x1b[31mme\\x07\\u202eok" in lines[1]
    assert "run-1\\n6f0c0000" in lines[1]

    shown = _saga(database_url, "show", saga_id)
    assert shown.returncode == 0, shown.stderr
    assert not _raw(shown.stdout), repr(shown.stdout)
    assert not any(line.startswith("6f0c0000") for line in shown.stdout.splitlines())
    assert "declined\\x1b[2J\\x1b]0;pwned\\x07 by \\x9b31m" in shown.stdout
    assert "tenant   ac\\x1b[31mme\\x07\\u202eok\n" in shown.stdout
    assert "charge\\x1b[8m" in shown.stdout  # the call key, inside its idempotency key

    diagram = _saga(database_url, "show", saga_id, "--format", "mermaid")
    assert diagram.returncode == 0, diagram.stderr
    assert not _raw(diagram.stdout), repr(diagram.stdout)

    listed_json = _saga(database_url, "list", "--json")
    assert listed_json.returncode == 0, listed_json.stderr
    (row,) = [json.loads(line) for line in listed_json.stdout.splitlines()]
    assert (row["tenant_id"], row["key"]) == (TENANT, KEY)
    shown_json = _saga(database_url, "show", saga_id, "--json")
    data = json.loads(shown_json.stdout)
    assert (data["tenant_id"], data["key"]) == (TENANT, KEY)
    (op,) = data["operations"]
    assert ERROR in op["error"]
