"""The agent example (examples/agent_tool_calls.py), run as real processes.

Each run is a child process on this test's database, as a user runs it; a crash is the
example killing itself with SIGKILL inside a tool, after the provider recorded the
effect. The effects are counted here too, in the provider tables the tools write.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import LiteralString

import psycopg
import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "agent_tool_calls.py"
EXIT_COMPENSATED = 3
EXIT_BAD_EFFECTS = 1


def run(database_url: str, ticket: str, *flags: str) -> subprocess.CompletedProcess[str]:
    """One run of the example for `ticket`, with a 1 s lease so a killed run's session
    can be entered again at once."""
    return subprocess.run(
        [
            sys.executable,
            str(EXAMPLE),
            "--database-url",
            database_url,
            "--ticket",
            ticket,
            "--lease-seconds",
            "1",
            *flags,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def shown(proc: subprocess.CompletedProcess[str]) -> str:
    return f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"


def tool_call_ids(output: str) -> set[str]:
    return set(re.findall(r"\bcall_[0-9a-f]{12}\b", output))


def count(database_url: str, query: LiteralString, *params: object) -> int:
    with psycopg.connect(database_url) as conn:
        row = conn.execute(query, params).fetchone()
    assert row is not None
    return int(row[0])


def effects(database_url: str, ticket: str) -> dict[str, int]:
    """The ticket's effects at the providers, counted by business fields."""
    order, new_order = f"o-{ticket}", f"o-{ticket}-red"
    return {
        "charges": count(
            database_url, "SELECT count(*) FROM demo_agent.charges WHERE order_id = %s", new_order
        ),
        "refunds of the payment": count(
            database_url,
            "SELECT count(*) FROM demo_agent.refunds WHERE payment_id = %s",
            f"pay-{order}",
        ),
        "refunds of the charge": count(
            database_url,
            "SELECT count(*) FROM demo_agent.refunds r JOIN demo_agent.charges c"
            " ON r.payment_id = c.charge_id WHERE c.order_id = %s",
            new_order,
        ),
        "emails": count(
            database_url,
            "SELECT count(*) FROM demo_agent.emails WHERE to_address = %s AND template = %s"
            " AND order_id = %s",
            "ana@example.com",
            "exchange_confirmed",
            new_order,
        ),
    }


HANDLED = {"charges": 1, "refunds of the payment": 1, "refunds of the charge": 0, "emails": 1}
SUMMARY = (
    "effects:  charges 1, refunds of the original payment 1, refunds of the new charge 0, emails 1"
)


def test_a_clean_run_makes_each_effect_once_and_a_second_run_replays_them(
    database_url: str,
) -> None:
    first = run(database_url, "T-1")
    assert first.returncode == 0, shown(first)
    assert "completed" in first.stdout
    assert "executed: 3\n" in first.stdout and "replayed: 0\n" in first.stdout
    assert "calls:    charge_card called, refund called, send_email called" in first.stdout
    assert SUMMARY in first.stdout and "no effect happened twice" in first.stdout
    assert effects(database_url, "T-1") == HANDLED

    # Run again: the planner plans with new tool_call_ids, the session replays every call.
    again = run(database_url, "T-1")
    assert again.returncode == 0, shown(again)
    assert "executed: 0\n" in again.stdout and "replayed: 3\n" in again.stdout
    assert "calls:    charge_card replayed, refund replayed, send_email replayed" in again.stdout
    assert len(tool_call_ids(first.stdout)) == len(tool_call_ids(again.stdout)) == 3
    assert not tool_call_ids(first.stdout) & tool_call_ids(again.stdout)
    assert effects(database_url, "T-1") == HANDLED


@pytest.mark.crash
@pytest.mark.parametrize(
    ("tool", "calls"),
    [
        (
            "charge_card",
            "charge_card settled by its reconcile hook, refund called, send_email called",
        ),
        ("refund", "charge_card replayed, refund retried under its key, send_email called"),
        (
            "send_email",
            "charge_card replayed, refund replayed, send_email retried under its key",
        ),
    ],
)
def test_a_run_killed_after_the_effect_resumes_without_doing_it_again(
    database_url: str, tool: str, calls: str
) -> None:
    ticket = f"T-crash-{tool}"
    killed = run(database_url, ticket, "--crash-in", tool)
    assert killed.returncode == -signal.SIGKILL, shown(killed)
    assert f"!! {tool}: the provider recorded" in killed.stdout
    assert "Summary" not in killed.stdout

    resumed = run(database_url, ticket)
    assert resumed.returncode == 0, shown(resumed)
    assert f"calls:    {calls}" in resumed.stdout, shown(resumed)
    # A call settled by its reconcile hook is counted so, not as executed; a same-key
    # retry ran the call again, so it is executed.
    executed, reconciled = {"charge_card": (2, 1), "refund": (2, 0), "send_email": (1, 0)}[tool]
    assert f"executed: {executed}\n" in resumed.stdout, shown(resumed)
    assert f"reconciled: {reconciled}\n" in resumed.stdout, shown(resumed)
    assert SUMMARY in resumed.stdout and "no effect happened twice" in resumed.stdout
    assert not tool_call_ids(killed.stdout) & tool_call_ids(resumed.stdout)
    assert effects(database_url, ticket) == HANDLED


def test_a_permanent_failure_refunds_the_charge_once_and_exits_3(database_url: str) -> None:
    failed = run(database_url, "T-fail", "--fail-permanently")
    assert failed.returncode == EXIT_COMPENSATED, shown(failed)
    assert "compensated" in failed.stdout
    assert "calls:    charge_card called, refund failed" in failed.stdout
    assert "compensation refund_card: refunded ch_" in failed.stdout
    assert "the card provider refuses to refund pay-o-T-fail" in failed.stdout
    expected = {"charges": 1, "refunds of the payment": 0, "refunds of the charge": 1, "emails": 0}
    assert effects(database_url, "T-fail") == expected

    # The session is over: a later run replays the charge and the failure, and does nothing.
    again = run(database_url, "T-fail")
    assert again.returncode == EXIT_COMPENSATED, shown(again)
    assert "executed: 0\n" in again.stdout and "replayed: 1\n" in again.stdout
    assert effects(database_url, "T-fail") == expected


def test_an_effect_made_twice_is_reported_and_fails_the_run(database_url: str) -> None:
    assert run(database_url, "T-twice").returncode == 0
    with psycopg.connect(database_url) as conn:  # a second charge, as a bad key would make
        conn.execute(
            "INSERT INTO demo_agent.charges (charge_id, idempotency_key, order_id, amount_cents)"
            " VALUES ('ch_extra', 'another-key', 'o-T-twice-red', 2600)"
        )
    again = run(database_url, "T-twice")
    assert again.returncode == EXIT_BAD_EFFECTS, shown(again)
    assert "FAILED: ticket T-twice: order o-T-twice-red was charged 2 times" in again.stderr
