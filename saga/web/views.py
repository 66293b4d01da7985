"""What the dashboard's pages show, read through the orchestrator's read API (`list`,
`get`, `history`, `workers`): blocking calls, made from a worker thread."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlencode

from saga._db._store_base import parse_id
from saga.cli import admin as operator
from saga.cli import format as fmt
from saga.errors import SagaNotFound
from saga.orchestrator import Orchestrator
from saga.remedies import parked_commands, saga_kind
from saga.state import HistoryEvent, OperationState, SagaState, SagaStatus, display_status
from saga.web import timeline

# Most sagas the list shows, and the needs-review queue.
DEFAULT_LIMIT = 100
MAX_LIMIT = 1000
# Operations one saga's page shows at most (a ledger channel may hold thousands): the
# rest are on its later pages, and its timeline and audit trail follow the page.
OPERATIONS_PER_PAGE = 100
# A value of an event's detail longer than this is folded away on the page.
_LONG_DETAIL = 160
# A result longer than this on one line is folded away, indented.
_SHORT_RESULT = 90


class FilterError(ValueError):
    """A filter of the list page that cannot be applied (the message says which)."""


@dataclass(frozen=True, slots=True)
class Filters:
    """The list page's filters, as given in its query string."""

    status: str | None = None
    saga: str | None = None
    tenant: str | None = None
    older_than: str | None = None
    limit: int = DEFAULT_LIMIT
    # A saga's business key, matched exactly (the search box).
    key: str | None = None

    @classmethod
    def parse(cls, query: Mapping[str, str]) -> Filters:
        """The filters of a query string; `FilterError` naming a bad one."""

        def text(name: str) -> str | None:
            value = query.get(name, "").strip()
            return value or None

        status = text("status")
        if status is not None and status not in {s.value for s in SagaStatus}:
            choices = ", ".join(s.value for s in SagaStatus)
            raise FilterError(f"unknown status {status!r}: choose one of {choices}")
        older_than = text("older_than")
        if older_than is not None:
            try:
                operator.parse_duration(older_than)
            except ValueError as exc:
                raise FilterError(f"age {older_than!r}: {exc}") from None
        raw_limit = text("limit")
        limit = DEFAULT_LIMIT
        if raw_limit is not None:
            if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= MAX_LIMIT:
                raise FilterError(f"limit {raw_limit!r}: give a whole number from 1 to {MAX_LIMIT}")
            limit = int(raw_limit)
        return cls(status, text("saga"), text("tenant"), older_than, limit, key=text("key"))

    @property
    def age(self) -> timedelta | None:
        """`older_than` as a duration."""
        return None if self.older_than is None else operator.parse_duration(self.older_than)

    @property
    def query(self) -> str:
        """The filters as a query string (without `?`), only those given."""
        pairs = [
            ("key", self.key),
            ("status", self.status),
            ("saga", self.saga),
            ("tenant", self.tenant),
            ("older_than", self.older_than),
            ("limit", None if self.limit == DEFAULT_LIMIT else str(self.limit)),
        ]
        return urlencode([(k, v) for k, v in pairs if v is not None])

    @property
    def active(self) -> bool:
        """Whether any filter narrows the list."""
        return bool(self.query)


class PageError(ValueError):
    """A page of a saga's operations that does not exist (the message says which do)."""


@dataclass(frozen=True, slots=True)
class Pages:
    """Which page of a saga's operations a page shows, of how many."""

    number: int
    total: int
    size: int = OPERATIONS_PER_PAGE

    @classmethod
    def parse(cls, value: str | None) -> int:
        """The page number a query string gives (1 without one); `PageError` when it is
        not a whole number from 1."""
        text = (value or "").strip()
        if not text:
            return 1
        if not text.isdigit() or int(text) < 1:
            raise PageError(f"page {text!r}: give a whole number from 1")
        return int(text)

    @property
    def count(self) -> int:
        """How many pages the operations fill (at least one)."""
        return max(1, -(-self.total // self.size))

    @property
    def offset(self) -> int:
        """How many operations come before this page's."""
        return (self.number - 1) * self.size

    @property
    def first(self) -> int:
        """The position (from 1) of this page's first operation."""
        return min(self.offset + 1, self.total)

    @property
    def last(self) -> int:
        """The position (from 1) of this page's last operation."""
        return min(self.offset + self.size, self.total)

    @property
    def previous(self) -> int | None:
        """The previous page's number; None on the first."""
        return self.number - 1 if self.number > 1 else None

    @property
    def next(self) -> int | None:
        """The next page's number; None on the last."""
        return self.number + 1 if self.number < self.count else None


@dataclass(frozen=True, slots=True)
class Row:
    """One saga of a list, with why it is where it is."""

    state: SagaState
    reason: str

    @property
    def kind(self) -> str:
        """`saga`, `session` or `channel` (a ledger channel)."""
        return saga_kind(self.state.saga)

    @property
    def status(self) -> str:
        """The status shown (`SagaState.display_status`): a session's or a channel's
        open, idle, parked, compensating or closed, else the stored one."""
        return self.state.display_status

    @property
    def commands(self) -> list[str]:
        """The `saga` command lines that take it on when it is parked (else none)."""
        return parked_commands(self.state, self.kind)


@dataclass(frozen=True, slots=True)
class ListPage:
    """The list page: the sagas the filters select and the needs-review queue."""

    filters: Filters
    rows: list[Row]
    queue: list[Row]
    names: list[str]
    now: datetime

    @property
    def fingerprint(self) -> str:
        """Changes whenever something the page shows of its sagas changes."""
        seen = [
            (r.state.id, r.status, r.state.updated_at.isoformat(), r.reason)
            for r in (*self.rows, *self.queue)
        ]
        return _digest(seen)


@dataclass(frozen=True, slots=True)
class OperationView:
    """One operation of a saga's page, with its result as text."""

    op: OperationState
    anchor: str
    # JSON on one line when short, else indented (`folded`: the page folds it away).
    result: str | None
    folded: bool
    request: str | None
    # `resolved by X` or `inherited from SOURCE` when no attempt of this saga timed its
    # outcome (`cli_format.Provenance`), and the full id of the saga it was inherited from.
    settled: str | None = None
    source: str | None = None

    @property
    def took(self) -> str:
        """How long its last attempt took, `-` when it has not ended; who settled it
        instead when a person did, or the saga it was inherited from."""
        if self.settled is not None:
            return self.settled
        if self.op.started_at is None or self.op.finished_at is None:
            return "-"
        return timeline.duration((self.op.finished_at - self.op.started_at).total_seconds())


@dataclass(frozen=True, slots=True)
class EventView:
    """One entry of the audit trail, with its offset from the saga's start."""

    index: int
    event: HistoryEvent
    offset: str
    took: str
    operation: str
    anchor: str | None
    short: list[tuple[str, str]]
    long: list[tuple[str, str]]


@dataclass(frozen=True, slots=True)
class SagaPage:
    """One saga's page: the saga, its timeline, operations and audit trail."""

    state: SagaState
    kind: str
    reason: str
    input: str
    operations: list[OperationView]
    events: list[EventView]
    timeline: timeline.Timeline
    mermaid: str
    now: datetime
    # The page of the operations shown (`state.operations` holds that page's only).
    pages: Pages
    # The status shown (`display_status`, told from all the operations, not this page's).
    status: str = ""

    @property
    def fingerprint(self) -> str:
        """As `page_fingerprint` of what it shows."""
        return page_fingerprint(self.state, self.pages)

    @property
    def commands(self) -> list[str]:
        """The `saga` command lines that take it on when it is parked (else none)."""
        return parked_commands(self.state, self.kind)


def saga_fingerprint(state: SagaState) -> str:
    """Changes whenever the saga or one of its operations changes."""
    return _digest(state.model_dump(mode="json"))


def page_fingerprint(state: SagaState, pages: Pages) -> str:
    """Changes whenever the saga, the operations of the page, or their count changes, or
    its shown status (a claim that expired turns a channel idle)."""
    return _digest([state.model_dump(mode="json"), pages.number, pages.total, state.display_status])


def _digest(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def reason(state: SagaState, known_kinds: Sequence[str]) -> str:
    """Why the saga is where it is, in the `saga` command's words (as `saga list` says
    it); empty when there is nothing to say."""
    if fmt.waiting_for_worker(state, known_kinds):
        return f"waiting for a worker: no live worker runs {state.saga} v{state.version}"
    if state.error:
        return fmt.cli_wording(state.error)
    driver = fmt.code_first(state.saga, state.status)
    if driver is not None and state.status.is_runnable and state.lease_owner is None:
        return driver
    return ""


def pretty_json(value: Any) -> str:
    """`value` as indented JSON, keys sorted."""
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, default=str)


def _result_text(result: Any) -> tuple[str | None, bool]:
    """A result as the page shows it: one line when short, else indented and folded."""
    if result is None:
        return None, False
    line = json.dumps(result, sort_keys=True, ensure_ascii=False, default=str)
    if len(line) <= _SHORT_RESULT:
        return line, False
    return pretty_json(result), True


class Reader:
    """The dashboard's reads, through one read-only `Orchestrator` (it never migrates and
    registers no saga). Every method blocks: call it from a worker thread."""

    def __init__(self, orch: Orchestrator) -> None:
        self.orch = orch

    def _known_kinds(self) -> list[str]:
        return sorted({kind for worker in self.orch.workers() for kind in worker.kinds})

    def list_page(self, filters: Filters) -> ListPage:
        """The sagas `filters` select, newest first, and the needs-review queue (the
        longest waiting first)."""
        states = self.orch.list(
            status=filters.status,
            saga=filters.saga,
            tenant=filters.tenant,
            limit=filters.limit,
            older_than=filters.age,
            key=filters.key,
        )
        parked = self.orch.list(status=SagaStatus.NEEDS_REVIEW.value, limit=DEFAULT_LIMIT)
        known = self._known_kinds()
        rows = [Row(s, reason(s, known)) for s in states]
        queue = [Row(s, reason(s, known)) for s in sorted(parked, key=lambda s: s.updated_at)]
        names = sorted({s.saga for s in (*states, *parked)})
        return ListPage(filters, rows, queue, names, datetime.now(UTC))

    def expand(self, text: str) -> str:
        """The full id of a saga given by its id, a unique prefix of it, or its business
        key (see `operator.expand_id`)."""
        return operator.expand_id(self.orch.store, text)

    def fingerprint(self, saga_id: str, page: int = 1) -> str:
        """`page_fingerprint` of the saga's page `page` as it is now (one cheap read)."""
        state, pages = self._page(saga_id, page)
        return page_fingerprint(state, pages)

    def _page(self, saga_id: str, page: int) -> tuple[SagaState, Pages]:
        """The saga with the operations of page `page` only (read with LIMIT and OFFSET),
        and which page that is; `SagaNotFound`, or `PageError` past the last page."""
        if parse_id(saga_id) is None:
            raise SagaNotFound(saga_id)
        size = OPERATIONS_PER_PAGE
        found = self.orch.store.get_state_page(saga_id, limit=size, offset=(page - 1) * size)
        if found is None:
            raise SagaNotFound(saga_id)
        state, total = found
        pages = Pages(page, total, size)
        if page > pages.count:
            raise PageError(
                f"page {page}: this {saga_kind(state.saga)} has {total} operation"
                f"{'s' if total != 1 else ''} on {pages.count} page"
                f"{'s' if pages.count != 1 else ''}"
            )
        return state, pages

    def mermaid(self, saga_id: str) -> str:
        """The saga as a Mermaid Gantt diagram (as `saga show --format mermaid`)."""
        return fmt.mermaid(self.orch.get(saga_id), self.orch.history(saga_id))

    def saga_page(self, saga_id: str, page: int = 1) -> SagaPage:
        """Everything one saga's page shows, with page `page` of its operations (the
        timeline and audit trail show theirs and the saga's own events); `SagaNotFound`
        when there is no such saga, `PageError` past its last page."""
        state, pages = self._page(saga_id, page)
        if pages.count == 1:
            history = self.orch.store.history(saga_id)
        else:
            shown = [(op.step, str(op.kind)) for op in state.operations]
            history = self.orch.store.history_of_operations(saga_id, shown)
        now = datetime.now(UTC)
        known = self._known_kinds() if state.status.is_runnable else []
        provenance = fmt.Provenance.of(history)
        ops = []
        for op in state.operations:
            settled = provenance.note(op)
            inherited = settled is not None and (op.step, op.kind) not in provenance.resolved_by
            ops.append(
                OperationView(
                    op,
                    timeline.operation_anchor(op.step, op.kind),
                    *_result_text(op.result),
                    None if op.request is None else pretty_json(op.request),
                    settled=settled,
                    source=provenance.source if inherited else None,
                )
            )
        live_claims = None
        if pages.count > 1 and state.status.is_runnable:
            live_claims = self.orch.store.count_live_claims(saga_id)
        return SagaPage(
            state=state,
            status=display_status(state, live_claims=live_claims),
            kind=saga_kind(state.saga),
            reason=reason(state, known),
            input=pretty_json(state.input),
            operations=ops,
            events=_events(state, history),
            timeline=timeline.build(state, history, now),
            mermaid=fmt.mermaid(state, history),
            now=now,
            pages=pages,
        )


def _events(state: SagaState, history: Sequence[HistoryEvent]) -> list[EventView]:
    start = min([state.created_at, *(e.at for e in history[:1])])
    started: dict[tuple[str | None, str | None, int | None], datetime] = {}
    views = []
    for index, e in enumerate(history):
        ident = (e.step, e.kind, e.attempt)
        took = ""
        if e.event == "attempt_started":
            started[ident] = e.at
        elif ident in started and e.event in _OUTCOMES:
            took = timeline.duration((e.at - started.pop(ident)).total_seconds())
        operation, anchor = "", None
        if e.step is not None:
            operation = e.step if e.kind in (None, "action") else f"↩ {e.step}"
            anchor = timeline.operation_anchor(e.step, e.kind)
        short: list[tuple[str, str]] = []
        long: list[tuple[str, str]] = []
        for key, value in e.detail.items():
            if value is None:
                continue
            text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
            text = fmt.cli_wording(text)
            (long if len(text) > _LONG_DETAIL or "\n" in text else short).append((key, text))
        views.append(
            EventView(
                index=index + 1,
                event=e,
                offset="+" + timeline.duration((e.at - start).total_seconds()),
                took=took,
                operation=operation,
                anchor=anchor,
                short=short,
                long=long,
            )
        )
    return views


_OUTCOMES = {
    "attempt_succeeded",
    "attempt_failed",
    "outcome_unknown",
    "attempt_not_called",
    "reconcile_found",
    "reconcile_absent",
    "reconcile_inconclusive",
}
