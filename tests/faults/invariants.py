"""The invariants checked after every fault scenario, and the figures the soak run prints.

`saga.testing.check_invariants` checks what the orchestrator's own tables say (settled,
no lease held, the audit trail replays, compensations in reverse and at most once); here
the fake provider's ledger is held against them: no effect performed twice for one key,
no effect the saga does not account for, none recorded that did not happen, undo
effects only for performed steps and in reverse order, and outcomes that fit the plan.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import psycopg

from faults import app
from saga import Orchestrator, SagaState
from saga.testing import InvariantReport, check_invariants


@dataclass
class Summary:
    """What a scenario (or the soak run) ended with."""

    sagas: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    # effects performed more than once for one key (must be 0)
    duplicates: int = 0
    # repeated requests the provider recognised and did not perform again
    deduplicated: int = 0
    # late requests refused by a fenced endpoint
    stale: int = 0
    # sagas missing or unsettled, effects nobody accounts for, successes with no effect
    lost: int = 0
    parked: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)

    def assert_ok(self) -> None:
        assert not self.violations, f"{len(self.violations)} violation(s):\n  " + "\n  ".join(
            self.violations[:40]
        )
        assert self.duplicates == 0 and self.lost == 0


def reason_kind(reason: str) -> str:
    """A parked reason without its names and numbers, to count reasons alike together."""
    text = re.sub(r"'[^']*'", "'…'", reason)
    return re.sub(r"\d+(\.\d+)?", "N", text)[:140]


def _ledger(provider_url: str) -> list[dict[str, Any]]:
    with (
        psycopg.connect(provider_url) as conn,
        conn.cursor(row_factory=psycopg.rows.dict_row) as cur,
    ):
        cur.execute(
            "SELECT id, idempotency_key, saga_key, step, kind, position, performed, duplicate,"
            " stale FROM fault_provider.requests ORDER BY id"
        )
        return list(cur.fetchall())


def check(url: str, provider_url: str, keys: list[str]) -> Summary:
    """Every invariant, over the sagas started with `keys`."""
    summary = Summary()
    ledger = _ledger(provider_url)
    performed: Counter[str] = Counter(r["idempotency_key"] for r in ledger if r["performed"])
    summary.deduplicated = sum(1 for r in ledger if r["duplicate"] and not r["performed"])
    summary.stale = sum(1 for r in ledger if r["stale"])

    report: InvariantReport = check_invariants(
        url, effects=performed, sagas=app.ALL_SAGAS, raise_on_violation=False
    )
    summary.violations.extend(report.violations)
    summary.duplicates = sum(1 for n in performed.values() if n > 1)
    summary.sagas = report.sagas
    summary.statuses = report.statuses
    summary.parked = Counter(reason_kind(r) for r in report.parked.values())

    with Orchestrator(url, auto_migrate=False, pool_size=2) as orch:
        states = {s.key: s for s in orch.list(limit=2**31 - 1)}
    by_saga: dict[str, list[dict[str, Any]]] = {}
    for r in ledger:
        by_saga.setdefault(r["saga_key"], []).append(r)
    for key in keys:
        state = states.get(key)
        if state is None:
            summary.lost += 1
            summary.violations.append(f"saga {key} was started but is not in the database")
            continue
        if str(state.status) not in ("completed", "compensated", "needs_review"):
            summary.lost += 1
        problems, lost = _ledger_problems(state, by_saga.get(key, []))
        summary.lost += lost
        summary.violations.extend(f"saga {key} ({state.status}): {p}" for p in problems)
    return summary


def _ledger_problems(state: SagaState, rows: list[dict[str, Any]]) -> tuple[list[str], int]:
    problems: list[str] = []
    lost = 0
    status = str(state.status)
    ops = {(op.step, str(op.kind)): op for op in state.operations}
    done = {(r["step"], r["kind"]) for r in rows if r["performed"]}
    for (step, kind), op in ops.items():
        op_status = str(op.status)
        # Performed but not recorded: only an unknown outcome parked for a human may say so.
        awaits_human = op_status in ("unknown", "running") and status == "needs_review"
        if (step, kind) in done and op_status != "succeeded" and not awaits_human:
            lost += 1
            problems.append(f"{kind} {step!r} was performed but is {op_status}")
        if op_status == "succeeded" and (step, kind) not in done:
            lost += 1
            problems.append(f"{kind} {step!r} is succeeded but the provider never performed it")
    undo = [r for r in rows if r["performed"] and r["kind"] == "compensation"]
    for r in undo:
        if (r["step"], "action") not in done:
            problems.append(f"compensation of {r['step']!r} performed for a step never performed")
    positions = [r["position"] for r in undo]
    if positions != sorted(positions, reverse=True):
        problems.append(f"compensations performed out of reverse order: positions {positions}")
    if status == "completed" and undo:
        problems.append("completed, yet compensations were performed")
    if status == "compensated":
        definition = app.SAGAS[state.saga]
        for step in definition.steps:
            if step.compensation_op is None or (step.name, "action") not in done:
                continue
            if (step.name, "compensation") not in done:
                lost += 1
                problems.append(f"compensated, yet the effect of {step.name!r} was never undone")
    # The outcome must fit the plan: a planned permanent failure never completes, and a
    # saga without one compensates only when a step ran out of attempts.
    plan = state.input.get("plan", {})
    failing = any(v == "permanent" for k, v in plan.items() if not k.startswith("undo:"))
    if failing and status == "completed":
        problems.append("completed although its plan makes a step fail")
    if not failing and status == "compensated" and "ceiling" not in (state.error or ""):
        problems.append(f"compensated although nothing was planned to fail: {state.error}")
    return problems, lost


def table(summary: Summary, **extra: Any) -> str:
    """The summary as a small text table."""
    rows: list[tuple[str, str]] = [("sagas", str(summary.sagas))]
    rows += [(k, str(v)) for k, v in extra.items()]
    rows += [(f"  {status}", str(n)) for status, n in sorted(summary.statuses.items())]
    rows += [
        ("duplicates (effects performed twice)", str(summary.duplicates)),
        ("lost", str(summary.lost)),
        ("requests deduplicated by the provider", str(summary.deduplicated)),
        ("late requests refused by the fence", str(summary.stale)),
        ("violations", str(len(summary.violations))),
        ("parked", str(sum(summary.parked.values()))),
    ]
    rows += [(f"  {n} x {reason}", "") for reason, n in summary.parked.most_common()]
    width = max(len(k) for k, _ in rows if _ != "") + 2
    return "\n".join(f"{k:<{width}}{v}" if v else k for k, v in rows)
