"""Plain-text rendering for the `saga` command: tables, a saga's timeline, progress."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, TextIO

from saga.cli.admin import IN_FLIGHT, Outcome, PlannedSaga, PurgeCandidate, Report, VersionInFlight
from saga.remedies import parked_commands
from saga.session import LEDGER_PREFIX, SESSION_PREFIX
from saga.state import HistoryEvent, OperationKind, OperationState, SagaState
from saga.upgrade import UpgradePlan

_OUTCOME_EVENTS = {
    "attempt_succeeded",
    "attempt_failed",
    "outcome_unknown",
    "reconcile_found",
    "reconcile_absent",
    "reconcile_inconclusive",
}


# Library wording in messages (refusals, park reasons) and the command's flag for it.
_FLAG_WORDING = (
    ("compensate with include_unknown=True", "compensate with --include-unknown"),
    ("compensate with include_unknown", "compensate with --include-unknown"),
    ("include_unknown=True", "--include-unknown"),
    ("include_unknown", "--include-unknown"),
    ("raise its ceiling with extra attempts", "raise its ceiling with --extra-attempts N"),
    ("or force it", "or pass --force"),
    ("pass Orchestrator(confirmation_key=...) or set ", "set "),
)
_USED = re.compile(r"has used (\d+) of its (\d+) attempts")


def cli_wording(text: str, given: Mapping[str, object] | None = None) -> str:
    """A library message in the command's words: flags (`--include-unknown`), not Python
    keywords (`include_unknown=True`). `given` holds the flags the user passed (flag to
    value): a message never suggests one of them again as if it had not been passed."""
    for words, flag in _FLAG_WORDING:
        text = text.replace(words, flag)
    extra = (given or {}).get("--extra-attempts")
    if isinstance(extra, int) and extra > 0:
        used = _USED.search(text)
        needed = (
            f"; it needs at least {int(used[1]) - int(used[2]) + 1}" if used is not None else ""
        )
        text = text.replace(
            "raise its ceiling with --extra-attempts N to retry it",
            f"--extra-attempts {extra} does not raise its ceiling far enough{needed}",
        )
    if (given or {}).get("--include-unknown"):
        text = text.replace(", or compensate with --include-unknown", "")
    return text


def _escape(code: int) -> str:
    named = {0x09: "\\t", 0x0A: "\\n", 0x0D: "\\r"}
    if code in named:
        return named[code]
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


# Characters a terminal acts on rather than shows: C0 and C1 controls and DEL (ESC starts
# a sequence that may move the cursor, retitle the window or hide text; BEL rings; a
# newline or CR in a key forges a row), line and paragraph separators, and the bidi
# overrides and isolates that reorder what follows them.
_CONTROLS = {
    code: _escape(code)
    for code in (
        *range(0x00, 0x20),
        *range(0x7F, 0xA0),
        0x2028,
        0x2029,
        *range(0x202A, 0x202F),
        *range(0x2066, 0x206A),
    )
}
_CONTROLS_BUT_NEWLINE = {code: text for code, text in _CONTROLS.items() if code != 0x0A}


def printable(text: str, *, lines: bool = False) -> str:
    """`text` safe to print on a terminal: every control character shown as its escape
    (`\\x1b`, `\\n`, `\\u202e`), so that data (a tenant, a key, a provider's error)
    can neither drive the terminal nor forge a line of output. With `lines`, newlines are
    kept (a message of several lines). Human-readable output only: JSON stays exact."""
    return text.translate(_CONTROLS_BUT_NEWLINE if lines else _CONTROLS)


def table(rows: Sequence[Sequence[str]], headers: Sequence[str]) -> str:
    """Left-aligned columns separated by two spaces; the last column is not padded.
    Every cell is `printable`: one cell is one line."""
    rows = [[printable(cell) for cell in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    lines = []
    for row in [list(headers), *rows]:
        cells = [c.ljust(widths[i]) for i, c in enumerate(row[:-1])] + [row[-1]]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def one_line(text: str | None, width: int = 70) -> str:
    """`text` on one line, cut to `width` characters; `-` when empty."""
    if not text:
        return "-"
    flat = printable(" ".join(text.split()))
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def age(at: datetime | None, now: datetime | None = None) -> str:
    """How long ago, compactly: `42s`, `5m`, `3h`, `2d`."""
    if at is None:
        return "-"
    seconds = ((now or datetime.now().astimezone()) - at).total_seconds()
    if seconds < 0:
        return "just now"
    for size, unit in ((86400, "d"), (3600, "h"), (60, "m")):
        if seconds >= size:
            return f"{int(seconds // size)}{unit} ago"
    return f"{int(seconds)}s ago"


def timestamp(at: datetime | None) -> str:
    """Local time with milliseconds."""
    if at is None:
        return "-"
    return at.astimezone().strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def seconds(start: datetime | None, end: datetime | None) -> str:
    """A duration in seconds, `-` when either end is missing."""
    if start is None or end is None:
        return "-"
    return f"{(end - start).total_seconds():.3f}s"


def waiting_for_worker(state: SagaState, known_kinds: Collection[str]) -> bool:
    """A runnable saga that no live worker runs the kind of: it waits for one (sessions
    and ledger channels never do: their own callers drive them)."""
    return (
        state.status.is_runnable
        and state.lease_owner is None
        and code_first(state.saga) is None
        and f"{state.saga}:{state.version}" not in known_kinds
    )


def code_first(saga: str, status: str = "running") -> str | None:
    """What drives a runnable session or ledger channel named `saga` in `status` (no
    worker does); None for a declared saga."""
    session, ledger = saga.startswith(SESSION_PREFIX), saga.startswith(LEDGER_PREFIX)
    if status == "compensating" and (session or ledger):
        nxt = "its next entry, or " if session else ""
        return f"compensating: {nxt}`saga compensate ID --app MODULE` finishes it"
    if session:
        return "an open session: its next entry resumes it"
    if ledger:
        return "an open ledger channel: its callers claim its calls"
    return None


def status_text(state: SagaState) -> str:
    """The saga's status for people (`SagaState.display_status`), with the stored status
    after it when they differ (a session or ledger channel): `idle (running)`."""
    shown = state.display_status
    return shown if shown == state.status.value else f"{shown} ({state.status})"


def _list_reason(state: SagaState, known_kinds: Collection[str]) -> str:
    if waiting_for_worker(state, known_kinds):
        return f"waiting for a worker: no live worker runs {state.saga} v{state.version}"
    if state.error:
        return one_line(cli_wording(state.error), 60)
    driver = code_first(state.saga, state.status)
    if driver is not None and state.status.is_runnable and state.lease_owner is None:
        return driver
    return "-"


def saga_list(states: Sequence[SagaState], known_kinds: Collection[str]) -> str:
    """The table of `saga list`; `known_kinds` are the name:version pairs live workers run."""
    rows = [
        [
            s.id,
            f"{s.saga} v{s.version}",
            s.tenant_id or "-",
            s.key,
            s.display_status,
            age(s.updated_at),
            _list_reason(s, known_kinds),
        ]
        for s in states
    ]
    return table(rows, ["ID", "SAGA", "TENANT", "KEY", "STATUS", "UPDATED", "REASON"])


def to_json(
    state: SagaState,
    history: Sequence[HistoryEvent] | None = None,
    *,
    known_kinds: Collection[str] | None = None,
) -> str:
    """A saga (and its history) as one line of JSON; with `known_kinds`, also whether it
    waits for a worker that knows its kind."""
    data: dict[str, Any] = state.model_dump(mode="json")
    data["display_status"] = state.display_status
    if known_kinds is not None:
        data["waiting_for_worker"] = waiting_for_worker(state, known_kinds)
    if history is not None:
        data["history"] = [e.model_dump(mode="json") for e in history]
    return json.dumps(data, sort_keys=False, separators=(",", ":"))


def show(state: SagaState, history: Sequence[HistoryEvent]) -> str:
    """The saga, its operations and the timeline of every attempt."""
    now = datetime.now().astimezone()
    if state.lease_owner is None or state.lease_expires_at is None:
        lease = "none"
    else:
        live = "live" if state.lease_expires_at > now else "expired"
        lease = (
            f"{state.lease_owner} until {timestamp(state.lease_expires_at)} ({live}), "
            f"fence {state.fence}"
        )
    head = [
        ["saga", f"{state.id}  {state.saga} v{state.version}"],
        ["tenant", state.tenant_id or "-"],
        ["key", state.key],
        ["input", one_line(json.dumps(state.input, separators=(",", ":")), 100)],
        ["status", status_text(state)],
    ]
    if state.forked_from:
        head.append(["forked from", state.forked_from])
    if state.forked_to:
        head.append(["forked to", state.forked_to])
    if state.error:
        head.append(["reason", cli_wording(state.error)])
    if state.spend_budget is not None or state.spent:
        budget = "no budget" if state.spend_budget is None else f"of {state.spend_budget:g}"
        head.append(["spent", f"{state.spent:g} {budget}"])
    head += [
        ["created", f"{timestamp(state.created_at)} ({age(state.created_at, now)})"],
        ["updated", f"{timestamp(state.updated_at)} ({age(state.updated_at, now)})"],
        ["lease", lease],
    ]
    width = max(len(k) for k, _ in head)
    lines = [f"{k.ljust(width)}  {printable(v)}" for k, v in head]
    ops = _operations(state.operations, Provenance.of(history))
    lines += ["", "OPERATIONS", ops, "", "TIMELINE", _timeline(history)]
    commands = parked_commands(state)
    if commands:
        lines += ["", "WHAT TO RUN (one of these)", *(f"  {printable(c)}" for c in commands)]
    return "\n".join(lines)


def short_id(saga_id: str) -> str:
    """A saga id's first 8 characters, as the commands take it (a unique prefix)."""
    return saga_id[:8]


@dataclass(frozen=True, slots=True)
class Provenance:
    """Where operations' outcomes came from when no attempt of this saga's timed them:
    a person's `saga resolve`, or the saga a fork inherited them from. Read from the
    saga's audit trail (`orch.history`)."""

    # (step, kind) -> who resolved it, for those whose last outcome a person gave.
    resolved_by: Mapping[tuple[str, OperationKind], str]
    # The saga a fork was forked from, and the steps it inherited from it.
    source: str | None
    inherited: frozenset[str]

    @classmethod
    def of(cls, history: Sequence[HistoryEvent]) -> Provenance:
        """What the audit trail says: each `operation_resolved` stands until an attempt
        starts after it; a fork's `saga_forked_from` names its source and inherited steps."""
        resolved: dict[tuple[str, OperationKind], str] = {}
        source: str | None = None
        inherited: frozenset[str] = frozenset()
        for e in history:
            if e.event == "saga_forked_from":
                source = str(e.detail.get("saga_id") or "") or None
                inherited = frozenset(str(s) for s in e.detail.get("inherited") or ())
            if e.step is None:
                continue
            ident: tuple[str, OperationKind] = (e.step, e.kind or "action")
            if e.event == "operation_resolved":
                resolved[ident] = str(e.detail.get("actor") or "an operator")
            elif e.event == "attempt_started":
                resolved.pop(ident, None)
        return cls(resolved, source, inherited)

    def note(self, op: OperationState) -> str | None:
        """`resolved by X` or `inherited from SOURCE` (short id) for an operation whose
        outcome no attempt of this saga timed; None for the others."""
        who = self.resolved_by.get((op.step, op.kind))
        if who is not None:
            return f"resolved by {who}"
        if self.source is not None and op.kind == "action" and op.step in self.inherited:
            return f"inherited from {short_id(self.source)}"
        return None


def _operations(ops: Sequence[OperationState], provenance: Provenance) -> str:
    rows = [
        [
            op.step,
            op.kind,
            str(op.status),
            f"{op.attempts}/{op.max_attempts}",
            provenance.note(op) or seconds(op.started_at, op.finished_at),
            op.provider_reference or "-",
            op.idempotency_key,
            one_line(op.error, 60),
        ]
        for op in ops
    ]
    headers = ["STEP", "KIND", "STATUS", "ATTEMPTS", "LAST TOOK", "PROVIDER REF", "KEY", "ERROR"]
    return table(rows, headers)


def history(state: SagaState, events: Sequence[HistoryEvent]) -> str:
    """`saga history`: which saga, then its whole audit trail, oldest first, with who
    acted (an operator's events) in a column of its own, and more of each detail than
    `show` prints (`history_json` has all of it)."""
    tenant = state.tenant_id or "-"
    head = (
        f"saga {state.id}  {state.saga} v{state.version}  tenant {tenant}  key {state.key}  "
        f"{state.status}"
    )
    return printable(head) + "\n" + _timeline(events, actors=True)


def history_json(state: SagaState, events: Sequence[HistoryEvent]) -> str:
    """`saga history --json`: one JSON document, the saga's identity and its events
    oldest first, each `at` (ISO 8601), `event`, `step`, `kind` (`action` or
    `compensation`; null for a saga-level event), `attempt`, `actor` (who acted, for an
    operator's event; else null) and `detail` (the event's whole detail, actor included)."""
    data = {
        "id": state.id,
        "saga": state.saga,
        "version": state.version,
        "tenant_id": state.tenant_id,
        "key": state.key,
        "status": str(state.status),
        "events": [
            {
                "at": e.at.isoformat(),
                "event": e.event,
                "step": e.step,
                "kind": e.kind,
                "attempt": e.attempt,
                "actor": e.detail.get("actor"),
                "detail": e.detail,
            }
            for e in events
        ],
    }
    return json.dumps(data, separators=(",", ":"))


def _timeline(history: Sequence[HistoryEvent], *, actors: bool = False) -> str:
    started: dict[tuple[str | None, str | None, int | None], datetime] = {}
    rows = []
    for e in history:
        where = "-"
        if e.step is not None:
            where = e.step if e.kind in (None, "action") else f"{e.step} (compensation)"
            if e.attempt is not None:
                where += f" #{e.attempt}"
        ident = (e.step, e.kind, e.attempt)
        took = "-"
        if e.event == "attempt_started":
            started[ident] = e.at
        elif e.event in _OUTCOME_EVENTS and ident in started:
            took = seconds(started[ident], e.at)
        if actors:
            actor = e.detail.get("actor")
            shown = {k: v for k, v in e.detail.items() if k != "actor" and v is not None}
            detail = " ".join(f"{k}={_value(v)}" for k, v in shown.items())
            who = "-" if actor is None else str(actor)
            rows.append([timestamp(e.at), e.event, where, took, who, one_line(detail, 200)])
            continue
        detail = " ".join(f"{k}={_value(v)}" for k, v in e.detail.items() if v is not None)
        rows.append([timestamp(e.at), e.event, where, took, one_line(detail, 90)])
    if actors:
        return table(rows, ["AT", "EVENT", "OPERATION", "TOOK", "ACTOR", "DETAIL"])
    return table(rows, ["AT", "EVENT", "OPERATION", "TOOK", "DETAIL"])


def _value(value: Any) -> str:
    if isinstance(value, str):
        return value if value and " " not in value else json.dumps(value)
    return json.dumps(value, separators=(",", ":"))


def outcome_line(outcome: Outcome, given: Mapping[str, object] | None = None) -> str:
    """One saga of a batch report."""
    detail = cli_wording(outcome.detail, given)
    return printable(f"{outcome.result:<8} {outcome.saga_id}  {outcome.saga}  {detail}")


def outcome_json(outcome: Outcome, given: Mapping[str, object] | None = None) -> str:
    """One saga of a batch report as one line of JSON."""
    return _line(
        {
            "saga_id": outcome.saga_id,
            "saga": outcome.saga,
            "result": outcome.result,
            "detail": cli_wording(outcome.detail, given),
        }
    )


def summary_json(report: Report, what: str) -> str:
    """The last line of a batch job with --json: how many sagas ended how."""
    return _line(
        {
            "summary": True,
            "command": what,
            "selected": report.selected,
            "done": report.count("done"),
            "parked": report.count("parked"),
            "skipped": report.count("skipped"),
            "not_handled": report.selected - len(report.outcomes),
            "interrupted": report.interrupted,
        }
    )


def _line(data: Mapping[str, Any]) -> str:
    return json.dumps(data, separators=(",", ":"), default=str)


def summary(report: Report, what: str) -> str:
    """The last line of a batch job."""
    text = (
        f"{what}: {report.selected} selected: {report.count('done')} done, "
        f"{report.count('parked')} parked, {report.count('skipped')} skipped"
    )
    if report.interrupted:
        text += f", {report.selected - len(report.outcomes)} not handled (interrupted)"
    return text


def null_result_warning(saga_id: str, step: str, compensation: str) -> str:
    """Why a compensation run for a step of unknown outcome may undo nothing."""
    return (
        f"compensation {compensation!r} of step {step!r} will get None as the step's "
        "result (the step's outcome is unknown): if it acts only on a result, it will undo "
        "nothing while the saga ends compensated; check with the provider and resolve the "
        f"step first (saga resolve {saga_id} {step} --succeeded --result JSON, or --failed)"
    )


def plan(plans: Sequence[PlannedSaga]) -> str:
    """What a compensation dry run would do, saga by saga."""
    rows: list[list[str]] = []
    notes: list[str] = []
    for p in plans:
        if p.skip is not None:
            notes.append(f"skipped  {p.saga_id}  {p.saga}  {cli_wording(p.skip)}")
            continue
        if not p.compensations and p.stop is None:
            notes.append(f"nothing  {p.saga_id}  {p.saga}  no compensation to run")
        for step, key in p.compensations:
            rows.append([p.saga_id, p.saga, step, key])
        for step, before, after in p.raises:
            notes.append(
                f"raises   {p.saga_id}  {p.saga}  ceiling of the compensation of {step!r}: "
                f"{before} -> {after} attempts"
            )
        for step, name in p.null_results:
            notes.append(
                f"warning  {p.saga_id}  {p.saga}  {null_result_warning(p.saga_id, step, name)}"
            )
        if p.stop is not None:
            notes.append(f"parks    {p.saga_id}  {p.saga}  would stop: {cli_wording(p.stop)}")
    # One format whatever the flags: the table (its header even when nothing would run),
    # then one note per line, then the summary.
    out = [table(rows, ["SAGA ID", "SAGA", "COMPENSATES STEP", "IDEMPOTENCY KEY"])]
    out += [printable(note) for note in notes]
    runs = sum(len(p.compensations) for p in plans)
    would_park = sum(1 for p in plans if p.stop is not None and p.skip is None)
    skipped = sum(1 for p in plans if p.skip is not None)
    out.append(
        f"dry run: {len(plans)} selected: {len(plans) - would_park - skipped} would be done "
        f"({runs} compensations), {would_park} would park, {skipped} skipped; nothing was changed"
    )
    return "\n".join(out)


def plan_json(plans: Sequence[PlannedSaga]) -> list[str]:
    """A compensation dry run with --json: one line per saga, then a summary line."""
    lines = [
        _line(
            {
                "saga_id": p.saga_id,
                "saga": p.saga,
                "compensations": [{"step": s, "idempotency_key": k} for s, k in p.compensations],
                "raises": [
                    {"step": s, "max_attempts": before, "raised_to": after}
                    for s, before, after in p.raises
                ],
                "stop": None if p.stop is None else cli_wording(p.stop),
                "skip": None if p.skip is None else cli_wording(p.skip),
                "null_results": [
                    {
                        "step": s,
                        "compensation": n,
                        "warning": null_result_warning(p.saga_id, s, n),
                    }
                    for s, n in p.null_results
                ],
            }
        )
        for p in plans
    ]
    would_park = sum(1 for p in plans if p.stop is not None and p.skip is None)
    skipped = sum(1 for p in plans if p.skip is not None)
    lines.append(
        _line(
            {
                "summary": True,
                "command": "compensate",
                "dry_run": True,
                "selected": len(plans),
                "would_be_done": len(plans) - would_park - skipped,
                "compensations": sum(len(p.compensations) for p in plans),
                "would_park": would_park,
                "skipped": skipped,
            }
        )
    )
    return lines


class ProgressLine:
    """`[3/10] verb <id>` rewritten in place on a terminal; silent otherwise."""

    def __init__(self, verb: str, stream: TextIO | None = None) -> None:
        self.verb = verb
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty()
        self.shown = False

    def __call__(self, index: int, total: int, saga_id: str) -> None:
        if self.enabled:
            self.stream.write(f"\r\x1b[K[{index}/{total}] {self.verb} {saga_id}")
            self.stream.flush()
            self.shown = True

    def clear(self) -> None:
        """Erase the progress line before something else is printed."""
        if self.shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.shown = False


def purge_list(found: Sequence[PurgeCandidate], total: int) -> str:
    """What a purge would delete (id, saga, status, finished_at), and how many in all."""
    if not total:
        return "nothing to purge: no ended saga is past the retention"
    rows = [[c.saga_id, c.saga, str(c.status), timestamp(c.finished_at)] for c in found]
    lines = [table(rows, ["ID", "SAGA", "STATUS", "FINISHED"])]
    if total > len(found):
        lines.append(f"... and {total - len(found)} more (--limit shows more)")
    lines.append(f"would purge {total} ended saga(s); nothing was deleted")
    return "\n".join(lines)


def purge_json(found: Sequence[PurgeCandidate], total: int) -> list[str]:
    """A purge dry run with --json: one line per saga listed, then a summary line."""
    lines = [
        _line(
            {
                "saga_id": c.saga_id,
                "saga": c.saga,
                "status": str(c.status),
                "finished_at": c.finished_at.isoformat(),
            }
        )
        for c in found
    ]
    lines.append(
        _line(
            {
                "summary": True,
                "command": "purge",
                "dry_run": True,
                "listed": len(found),
                "would_purge": total,
            }
        )
    )
    return lines


def versions(rows: Sequence[VersionInFlight], app: str | None) -> str:
    """The table of `saga versions`: sagas in flight per name and version, by status,
    and (with an app) whether it registers the version."""
    headers = ["SAGA", "VERSION", *(s.value.upper() for s in IN_FLIGHT), "IN FLIGHT"]
    if app is not None:
        headers.append("REGISTERED")
    body = []
    for r in rows:
        cells = [r.saga, str(r.version), *(str(r.counts[s]) for s in IN_FLIGHT), str(r.in_flight)]
        if app is not None:
            cells.append("yes" if r.registered else "no")
        body.append(cells)
    lines = [table(body, headers)]
    missing = [r for r in rows if r.registered is False and r.in_flight]
    if missing:
        kinds = ", ".join(f"{r.saga} v{r.version}" for r in missing)
        lines.append(
            f"{sum(r.in_flight for r in missing)} saga(s) in flight of versions not registered "
            f"by {app} ({kinds}): no worker of this app drives them; keep those definitions "
            "registered until they drain"
        )
    return "\n".join(lines)


def upgrade(
    plan: UpgradePlan,
    *,
    dry_run: bool,
    actor: str | None = None,
    state: SagaState | None = None,
) -> str:
    """`saga upgrade`'s report on one saga: why it was refused, or what became (or would
    become) of each of its steps, and what happens next."""
    what = f"saga {plan.saga_id} ({plan.saga})"
    if not plan.allowed:
        lines = [
            f"refused: {what} stays at v{plan.from_version}, not upgraded to v{plan.to_version}:"
        ]
        lines += [f"  - {printable(r.replace('step_map', '--map'))}" for r in plan.reasons]
        return "\n".join(lines)
    if state is None or dry_run:
        head = (
            f"dry run: {what} can be upgraded from v{plan.from_version} to "
            f"v{plan.to_version}; nothing was changed"
        )
    else:
        head = f"upgraded {what} from v{plan.from_version} to v{plan.to_version}, by {actor}"
    rows = [
        [
            m.to or "-",
            m.move,
            "-" if m.step is None or m.step == m.to else m.step,
            m.status.value,
            str(m.attempts),
            m.key,
        ]
        for m in plan.moves
    ]
    lines = [head, indent(table(rows, ["STEP", "MOVE", "WAS", "STATUS", "ATTEMPTS", "KEY"]))]
    if state is not None and not dry_run:
        if state.status == "needs_review":
            lines.append(
                f"saga {state.id} stays needs_review: resume it under v{state.version} with "
                f"`saga retry {state.id}`"
            )
        else:
            lines.append(
                f"saga {state.id} is {state.status}: a worker of v{state.version} will drive it"
            )
    return "\n".join(lines)


def indent(text: str, prefix: str = "  ") -> str:
    """Every line of `text` indented by `prefix`."""
    return "\n".join(prefix + line for line in text.splitlines())


def versions_json(rows: Sequence[VersionInFlight]) -> list[str]:
    """`saga versions --json`: one line per name and version."""
    return [
        _line(
            {
                "saga": r.saga,
                "version": r.version,
                **{s.value: r.counts[s] for s in IN_FLIGHT},
                "in_flight": r.in_flight,
                "registered": r.registered,
            }
        )
        for r in rows
    ]


# ----- a saga as a Mermaid diagram (`saga show ID --format mermaid`) ----------------------

SpanOutcome = Literal["succeeded", "failed", "unknown", "not_called", "open"]
# The events that end an attempt, and the outcome each records. The reconcile events end
# one only when no outcome was recorded before (an attempt left running by a dead owner);
# otherwise they are a later verdict on an attempt already ended as unknown.
_SPAN_ENDS: dict[str, SpanOutcome] = {
    "attempt_succeeded": "succeeded",
    "attempt_failed": "failed",
    "outcome_unknown": "unknown",
    "attempt_not_called": "not_called",
}
_SPAN_LATE_ENDS: dict[str, SpanOutcome] = {
    "reconcile_found": "succeeded",
    "reconcile_absent": "failed",
    "reconcile_inconclusive": "unknown",
}


@dataclass(frozen=True, slots=True)
class AttemptSpan:
    """One attempt of an operation, from its `attempt_started` event to the event that
    recorded its outcome (`end` is None and `outcome` "open" while none has been)."""

    step: str
    kind: OperationKind
    attempt: int | None
    start: datetime
    end: datetime | None
    outcome: SpanOutcome
    # The outcome event's detail: `error`, `retry_in_seconds`, `reason`...
    detail: Mapping[str, Any]


def attempt_spans(history: Sequence[HistoryEvent]) -> list[AttemptSpan]:
    """The attempts of a saga's operations as time spans, in the order they started,
    read from its audit trail (oldest first, as `orch.history` returns it)."""
    spans: list[AttemptSpan] = []
    open_at: dict[tuple[str, OperationKind, int | None], int] = {}
    for e in history:
        if e.step is None:
            continue
        kind: OperationKind = e.kind or "action"
        ident = (e.step, kind, e.attempt)
        if e.event == "attempt_started":
            open_at[ident] = len(spans)
            spans.append(AttemptSpan(e.step, kind, e.attempt, e.at, None, "open", {}))
            continue
        outcome = _SPAN_ENDS.get(e.event) or _SPAN_LATE_ENDS.get(e.event)
        index = open_at.get(ident)
        if outcome is None or index is None:
            continue
        del open_at[ident]
        started = spans[index]
        spans[index] = AttemptSpan(
            started.step, started.kind, started.attempt, started.start, e.at, outcome, e.detail
        )
    return spans


# Tags of a Mermaid Gantt task, by the status of its operation.
_MERMAID_TAGS = {
    "succeeded": "done",
    "failed": "crit",
    "unknown": "crit, active",
    "running": "active",
    "pending": "active",
}
# What a Mermaid Gantt's title, sections and task names cannot hold: `#` starts an entity,
# `:` ends a task's name, `;` ends a statement.
_MERMAID_UNSAFE = re.compile(r"[#:;\r\n]+")


def _mermaid_text(text: str) -> str:
    return printable(" ".join(_MERMAID_UNSAFE.sub(" ", text).split())) or "-"


def _mermaid_ms(at: datetime) -> int:
    return round(at.timestamp() * 1000)


def _mermaid_axis(spans: Sequence[AttemptSpan], state: SagaState) -> str:
    """The axis labels' format: milliseconds for a saga of seconds, dates past a day."""
    if not spans:
        return "%H:%M:%S"
    last = max(state.updated_at, *(s.end or s.start for s in spans))
    seconds = (last - spans[0].start).total_seconds()
    if seconds < 60:
        return "%H:%M:%S.%L"
    return "%H:%M:%S" if seconds < 86400 else "%Y-%m-%d %H:%M"


def mermaid(state: SagaState, history: Sequence[HistoryEvent]) -> str:
    """The saga as a Mermaid Gantt diagram, for an incident ticket: one task per operation
    that was attempted, from its first attempt's start to its last attempt's end (or the
    saga's last change while one is still open), in the order the operations first ran;
    compensations in their own section, so the reverse order they ran in shows. Comment
    lines (`%%`) after the `gantt` header name the saga, its reason, and the operations
    never attempted."""
    spans = attempt_spans(history)
    first: dict[tuple[str, OperationKind], int] = {}
    for index, span in enumerate(spans):
        first.setdefault((span.step, span.kind), index)
    attempted = sorted(
        (op for op in state.operations if (op.step, op.kind) in first),
        key=lambda op: first[(op.step, op.kind)],
    )
    lines = [
        "gantt",
        printable(
            f"    %% saga {state.id}: {state.saga} v{state.version}, tenant "
            f"{state.tenant_id or '-'}, key {state.key}, {state.status}"
        ),
    ]
    if state.error:
        lines.append(f"    %% reason: {one_line(cli_wording(state.error), 200)}")
    title = f"{state.saga} v{state.version} · {state.key} · {state.status}"
    lines += [
        f"    title {_mermaid_text(title)}",
        "    dateFormat x",
        f"    axisFormat {_mermaid_axis(spans, state)}",
    ]
    section = None
    for number, op in enumerate(attempted, start=1):
        wanted = "Steps" if op.kind == "action" else "Compensations (in the order they ran)"
        if wanted != section:
            section = wanted
            lines.append(f"    section {section}")
        own = [s for s in spans if (s.step, s.kind) == (op.step, op.kind)]
        start = own[0].start
        end = own[-1].end or max(state.updated_at, start)
        name = op.step if op.kind == "action" else f"compensate {op.step}"
        tried = f"{op.attempts} attempt{'s' if op.attempts != 1 else ''}"
        tags = _MERMAID_TAGS.get(str(op.status), "active")
        lines.append(
            f"    {_mermaid_text(f'{name} {op.status}, {tried}')} :{tags}, op{number}, "
            f"{_mermaid_ms(start)}, {max(_mermaid_ms(end), _mermaid_ms(start) + 1)}"
        )
    provenance = Provenance.of(history)
    for op in state.operations:
        if (op.step, op.kind) not in first:
            what = op.step if op.kind == "action" else f"compensation of {op.step}"
            how = provenance.note(op) or "never attempted"
            lines.append(printable(f"    %% {what}: {op.status}, {how}"))
    return "\n".join(lines)
