"""A saga's timeline drawn to scale: where each operation's attempts, waits and unknown
outcomes fall in time, computed from the audit trail as percentages of the saga's span
(the page draws them as widths, with no script)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from saga.cli.format import AttemptSpan, Provenance, attempt_spans, cli_wording, one_line
from saga.session import LEDGER_PREFIX, SESSION_PREFIX
from saga.state import HistoryEvent, OperationKind, OperationState, SagaState, SagaStatus

BarKind = Literal["attempt", "wait", "phase"]
# How an attempt bar looks: its outcome, or why it has none.
AttemptTone = Literal["succeeded", "failed", "unknown", "not_called", "running", "no_outcome"]

# The smallest width (percent of the track) a bar is drawn with, so that an attempt of a
# millisecond in a saga of an hour still shows.
MIN_WIDTH = 0.35
# Tick spacings the axis picks from (seconds): the first that gives at most MAX_TICKS.
_TICK_STEPS = (
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5,
    1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800,
    3600, 7200, 10800, 21600, 43200, 86400, 172800, 604800,
)  # fmt: skip
MAX_TICKS = 8
# The narrowest phase bar (percent) that gets its name written in it, and the narrowest
# attempt bar that gets its number.
_MIN_LABELLED_WIDTH = 8.0
_MIN_NUMBERED_WIDTH = 1.5

# Saga-level events that start a phase of the saga lane, and the phase they start.
_PHASE_OF = {
    "saga_started": "pending",
    "session_started": "running",
    "lease_acquired": "running",
    "compensation_started": "compensating",
    "cancel_requested": "compensating",
    "saga_parked": "needs_review",
    "confirmation_requested": "awaiting_confirmation",
    "saga_completed": "completed",
    "saga_compensated": "compensated",
    "saga_forked": "forked",
}
# Operator events that make a parked saga go on in the direction it was going.
_RESUMES = {
    "operation_resolved",
    "retry_requested",
    "compensation_requested",
    "ceilings_raised",
    "ceiling_raised",
    "approval_used",
    "confirmation_approved",
}
_ENDED = {"completed", "compensated", "forked"}
# Events not worth a marker: the ends of the attempts' bars, and lease bookkeeping.
_UNMARKED = {"attempt_started", "attempt_succeeded", "attempt_failed", "outcome_unknown",
             "attempt_not_called", "lease_acquired", "lease_released"}  # fmt: skip
# Saga-level events that get a marker on the saga lane.
_SAGA_MARKS = {
    "compensation_started",
    "cancel_requested",
    "saga_parked",
    "saga_completed",
    "saga_compensated",
    "saga_forked",
    "lease_broken",
    "confirmation_requested",
    "deadline_passed",
}


@dataclass(frozen=True, slots=True)
class Bar:
    """Something with a duration on a lane: an attempt (`tone` is its outcome), a wait
    between two attempts, or a phase of the saga (`tone` names it)."""

    kind: BarKind
    tone: str
    left: float
    width: float
    text: str
    title: str
    attempt: int | None = None


@dataclass(frozen=True, slots=True)
class Marker:
    """An instant on a lane: an operator's request, a reconcile answer, a phase's start."""

    left: float
    event: str
    title: str


@dataclass(frozen=True, slots=True)
class Lane:
    """One row of the timeline: the saga's phases, or one operation's attempts."""

    label: str
    kind: Literal["saga", "action", "compensation"]
    step: str | None
    status: str
    note: str
    anchor: str
    bars: list[Bar] = field(default_factory=list)
    markers: list[Marker] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Tick:
    """A mark of the time axis, `label` after the saga's start."""

    left: float
    label: str


@dataclass(frozen=True, slots=True)
class Timeline:
    """The lanes of a saga, the axis, and the time span they are drawn against."""

    lanes: list[Lane]
    ticks: list[Tick]
    start: datetime
    end: datetime
    live: bool

    @property
    def seconds(self) -> float:
        """How long the drawn span lasts."""
        return (self.end - self.start).total_seconds()


def operation_anchor(step: str, kind: OperationKind | None) -> str:
    """The fragment id of an operation on the saga's page (`#op-action-charge`)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in step)
    return f"op-{kind or 'action'}-{safe}"


def duration(seconds: float) -> str:
    """A duration for people: `0`, `0.4 ms`, `850 ms`, `1.25 s`, `4 m 05 s`, `2 m`,
    `2 h 10 m`, `3 d 4 h`."""
    if seconds <= 0:
        return "0"
    if seconds < 1:
        return f"{seconds * 1000:.3g} ms"
    if seconds < 59.5:
        return f"{seconds:.3g} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} m {secs:02d} s" if secs else f"{minutes} m"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours} h {minutes:02d} m" if minutes else f"{hours} h"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours} h" if hours else f"{days} d"


def build(state: SagaState, history: Sequence[HistoryEvent], now: datetime) -> Timeline:
    """The timeline of `state` from its audit trail, drawn from its creation to its last
    event (to `now` while it may still move, and to a retry planned later)."""
    live = not state.status.is_terminal and state.status != SagaStatus.NEEDS_REVIEW
    start = min([state.created_at, *(e.at for e in history[:1])])
    ends = [state.updated_at, *(e.at for e in history[-1:])]
    if live:
        ends.append(now)
        ends += [op.next_attempt_at for op in state.operations if op.next_attempt_at]
    end = max(ends)
    if end - start < timedelta(milliseconds=1):
        end = start + timedelta(milliseconds=1)
    scale = _Scale(start, end)
    spans = attempt_spans(history)
    lanes = [_saga_lane(state, history, scale, end)]
    lanes += _operation_lanes(state, history, spans, scale, live=live, now=now)
    return Timeline(lanes=lanes, ticks=_ticks(scale), start=start, end=end, live=live)


class _Scale:
    """Times as percentages of the span from `start` to `end`."""

    def __init__(self, start: datetime, end: datetime) -> None:
        self.start = start
        self.total = (end - start).total_seconds()

    def at(self, when: datetime) -> float:
        offset = (when - self.start).total_seconds() / self.total * 100.0
        return round(min(max(offset, 0.0), 100.0), 3)

    def bar(self, begin: datetime, finish: datetime) -> tuple[float, float]:
        left = self.at(begin)
        width = max(self.at(finish) - left, MIN_WIDTH)
        if left + width > 100.0:
            left = max(100.0 - width, 0.0)
        return left, round(width, 3)


def _saga_lane(
    state: SagaState, history: Sequence[HistoryEvent], scale: _Scale, end: datetime
) -> Lane:
    """The saga's phases (pending, running, compensating, parked...) as bars, and its
    milestones as markers."""
    phases: list[tuple[str, datetime]] = []
    direction = "running"
    markers: list[Marker] = []
    for e in history:
        if e.step is None and e.event in _SAGA_MARKS:
            markers.append(Marker(scale.at(e.at), e.event, _event_title(e)))
        phase = _PHASE_OF.get(e.event)
        current = phases[-1][0] if phases else None
        if e.event == "attempt_started" and current in (None, "pending"):
            phase = "running"  # a ledger channel's calls take no lease of the saga
        if e.event in _RESUMES and current in ("needs_review", "awaiting_confirmation"):
            phase = direction
        if phase is None or phase == current or current in _ENDED:
            continue
        if phase == "running" and current not in (None, "pending"):
            continue  # a lease taken mid-way changes nothing the page shows
        if phase in ("running", "compensating"):
            direction = phase
        phases.append((phase, e.at))
    bars = []
    for index, (phase, since) in enumerate(phases):
        if phase in _ENDED:
            continue
        until = phases[index + 1][1] if index + 1 < len(phases) else end
        left, width = scale.bar(since, until)
        text = phase.replace("_", " ")
        took = duration((until - since).total_seconds())
        shown = text if width >= _MIN_LABELLED_WIDTH else ""
        bars.append(Bar("phase", phase, left, width, shown, f"{text} for {took}"))
    label = "saga"
    if state.saga.startswith(SESSION_PREFIX):
        label = "session"
    elif state.saga.startswith(LEDGER_PREFIX):
        label = "channel"
    return Lane(
        label=label,
        kind="saga",
        step=None,
        status=str(state.status),
        note=str(state.status).replace("_", " "),
        anchor="saga-lane",
        bars=bars,
        markers=markers,
    )


def _operation_lanes(
    state: SagaState,
    history: Sequence[HistoryEvent],
    spans: Sequence[AttemptSpan],
    scale: _Scale,
    *,
    live: bool,
    now: datetime,
) -> list[Lane]:
    """One lane per operation, in the order they first ran (so compensations follow the
    steps, in the reverse order they ran in), then those never attempted."""
    first: dict[tuple[str, OperationKind], int] = {}
    for index, span in enumerate(spans):
        first.setdefault((span.step, span.kind), index)
    ops: dict[tuple[str, OperationKind], OperationState] = {
        (op.step, op.kind): op for op in state.operations
    }
    keys = sorted(first, key=first.__getitem__)
    keys += [k for k in ops if k not in first]
    marks: dict[tuple[str, OperationKind], list[Marker]] = {}
    for e in history:
        if e.step is not None and e.event not in _UNMARKED:
            ident = (e.step, e.kind or "action")
            marks.setdefault(ident, []).append(Marker(scale.at(e.at), e.event, _event_title(e)))
    provenance = Provenance.of(history)
    lanes = []
    for step, kind in keys:
        op = ops.get((step, kind))
        own = [s for s in spans if (s.step, s.kind) == (step, kind)]
        bars = _attempt_bars(own, op, scale, live=live, now=now)
        status = str(op.status) if op is not None else "-"
        note = f"{status}, {op.attempts}/{op.max_attempts}" if op is not None else status
        settled = None if op is None else provenance.note(op)
        if settled is not None:
            note += f", {settled}"
        elif not own:
            note += ", never attempted"
        lanes.append(
            Lane(
                label=step if kind == "action" else f"↩ {step}",
                kind=kind,
                step=step,
                status=status,
                note=note,
                anchor=operation_anchor(step, kind),
                bars=bars,
                markers=marks.get((step, kind), []),
            )
        )
    return lanes


def _attempt_bars(
    spans: Sequence[AttemptSpan],
    op: OperationState | None,
    scale: _Scale,
    *,
    live: bool,
    now: datetime,
) -> list[Bar]:
    """An operation's attempts, the waits between them, and a retry planned later."""
    bars: list[Bar] = []
    previous_end: datetime | None = None
    for span in spans:
        if previous_end is not None and span.start > previous_end:
            left, width = scale.bar(previous_end, span.start)
            waited = duration((span.start - previous_end).total_seconds())
            title = f"waited {waited} before attempt {span.attempt}"
            bars.append(Bar("wait", "wait", left, width, "", title))
        tone, finish = _attempt_tone(span, live=live, now=now)
        left, width = scale.bar(span.start, finish)
        took = duration((finish - span.start).total_seconds())
        title = _attempt_title(span, tone, took)
        text = str(span.attempt or "") if width >= _MIN_NUMBERED_WIDTH else ""
        bars.append(Bar("attempt", tone, left, width, text, title, span.attempt))
        previous_end = span.end
    planned = op.next_attempt_at if op is not None else None
    if live and previous_end is not None and planned is not None and planned > previous_end:
        left, width = scale.bar(previous_end, planned)
        title = f"next attempt planned at {_utc(planned)}"
        bars.append(Bar("wait", "planned", left, width, "", title))
    return bars


def _attempt_tone(span: AttemptSpan, *, live: bool, now: datetime) -> tuple[AttemptTone, datetime]:
    if span.end is not None:
        tone: AttemptTone = span.outcome if span.outcome != "open" else "no_outcome"
        return tone, span.end
    # No outcome recorded: in flight while the saga may move, else left without one.
    return ("running", now) if live else ("no_outcome", max(span.start, now))


def _attempt_title(span: AttemptSpan, tone: AttemptTone, took: str) -> str:
    what = span.step if span.kind == "action" else f"compensation of {span.step}"
    said = {
        "succeeded": "succeeded",
        "failed": "failed",
        "unknown": "ended with an unknown outcome",
        "not_called": "was not called",
        "running": "is running",
        "no_outcome": "has no recorded outcome",
    }[tone]
    text = f"{what}, attempt {span.attempt}: {said} after {took}"
    error = span.detail.get("error") or span.detail.get("reason")
    if error:
        text += f": {one_line(cli_wording(str(error)), 200)}"
    retry = span.detail.get("retry_in_seconds")
    if isinstance(retry, int | float):
        text += f" (retry in {duration(float(retry))})"
    return text


def _event_title(e: HistoryEvent) -> str:
    parts = [f"{_utc(e.at)} {e.event}"]
    if e.step is not None:
        parts.append(e.step if e.kind in (None, "action") else f"compensation of {e.step}")
    detail = _detail_text(e.detail)
    if detail:
        parts.append(detail)
    return " · ".join(parts)


def _detail_text(detail: Mapping[str, Any]) -> str:
    text = " ".join(f"{k}={v}" for k, v in detail.items() if v is not None)
    return one_line(cli_wording(text), 200) if text else ""


def _utc(at: datetime) -> str:
    return at.astimezone(UTC).strftime("%H:%M:%S.%f")[:-3] + " UTC"


def _ticks(scale: _Scale) -> list[Tick]:
    step = next((s for s in _TICK_STEPS if scale.total / s <= MAX_TICKS), _TICK_STEPS[-1])
    ticks = []
    count = int(scale.total // step)
    for i in range(count + 1):
        offset = i * step
        ticks.append(Tick(round(offset / scale.total * 100.0, 3), f"+{duration(offset)}"))
    return ticks
