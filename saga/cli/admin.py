"""Operator jobs behind the `saga` command: compensation-only batches, the reconcile sweep,
the purge's dry run, id prefixes and business keys, and the versions in flight."""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Literal

from saga._core import requests as interventions
from saga._core.planner import Planner
from saga._db._store_base import parse_id
from saga._db.store import Store
from saga.errors import DatabaseUnavailable, NotRegistered, SagaError, SagaNotFound
from saga.state import OperationStatus, SagaState, SagaStatus

if TYPE_CHECKING:
    from saga.orchestrator import Orchestrator

Result = Literal["done", "parked", "skipped"]
# Called before each saga of a batch: (position from 1, total, saga id).
Progress = Callable[[int, int, str], None]
# How long a batch waits for a saga another worker picked up meanwhile (seconds).
HANDOFF_WAIT_SECONDS = 30.0


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a batch job did with one saga."""

    saga_id: str
    saga: str
    result: Result
    detail: str


@dataclass(frozen=True, slots=True)
class PlannedSaga:
    """What compensating one saga would run, in order, and why it would stop early."""

    saga_id: str
    saga: str
    compensations: list[tuple[str, str]]
    stop: str | None = None
    skip: str | None = None
    # (step, ceiling now, ceiling after) of each failed compensation given a fresh budget.
    raises: list[tuple[str, int, int]] = field(default_factory=list)
    # (step, compensation) of each compensation that runs for a step of unknown outcome
    # (--include-unknown): it gets None as the step's result.
    null_results: list[tuple[str, str]] = field(default_factory=list)


@dataclass(slots=True)
class Report:
    """Outcomes of a batch job, in the order the sagas were handled."""

    outcomes: list[Outcome] = field(default_factory=list)
    selected: int = 0
    interrupted: bool = False

    def count(self, result: Result) -> int:
        """How many sagas ended with this result."""
        return sum(1 for o in self.outcomes if o.result == result)

    @property
    def complete(self) -> bool:
        """Every selected saga is done: nothing parked, skipped or left out."""
        return not self.interrupted and len(self.outcomes) == self.count("done")


def describe(state: SagaState) -> str:
    """`name vN` of a saga."""
    return f"{state.saga} v{state.version}"


def live_lease(state: SagaState, now: datetime | None = None) -> bool:
    """Whether a worker holds the saga's lease right now (by this host's clock)."""
    if state.lease_owner is None or state.lease_expires_at is None:
        return False
    return state.lease_expires_at > (now or datetime.now().astimezone())


def succeeded_pivot(orch: Orchestrator, state: SagaState) -> str | None:
    """The name of a pivot step of the saga that has succeeded, or None."""
    definition = orch.definition(state.saga, state.version)
    for step in definition.steps:
        if not step.pivot:
            continue
        op = next((o for o in state.operations if o.kind == "action" and o.step == step.name), None)
        if op is not None and op.status == OperationStatus.SUCCEEDED:
            return step.name
    return None


def refusal(orch: Orchestrator, state: SagaState, *, force: bool, batch: bool) -> str | None:
    """Why a compensation of this saga must not start here, or None when it may."""
    try:
        orch.definition(state.saga, state.version)  # registered, or a session
    except NotRegistered:
        return f"saga {describe(state)} is not registered by this app"
    if live_lease(state) and not force:
        return (
            f"leased by {state.lease_owner} until {state.lease_expires_at:%H:%M:%S}; "
            "pass --force to take the lease over"
        )
    if not force and state.status != SagaStatus.COMPENSATED:
        with orch.store.transaction() as conn:
            claimed = [c for c in orch.store.running_calls_txn(conn, state.id) if c.claimed]
        if claimed:
            held = ", ".join(
                f"call {c.step} is leased by {c.claim_owner} until {c.claim_expires_at:%H:%M:%S}"
                for c in claimed
                if c.claim_expires_at is not None
            )
            return f"{held}; pass --force to take the lease over"
    if batch:
        pivot = succeeded_pivot(orch, state)
        if pivot is not None:
            return (
                f"pivot step {pivot!r} succeeded, so it only goes forward; "
                "compensate it by id if you must"
            )
    return None


def plan_compensation(
    orch: Orchestrator, state: SagaState, *, include_unknown: bool
) -> PlannedSaga:
    """What compensating `state` would run (saga, step, key), changing nothing."""
    definition = orch.definition(state.saga, state.version)
    store = orch.store
    with store.transaction() as conn:
        loaded = store.load_txn(conn, state.id)
    if loaded is None:
        return PlannedSaga(state.id, describe(state), [], skip="the saga no longer exists")
    planner = Planner(definition, *loaded, now=datetime.now().astimezone())
    return _planned(planner, state, include_unknown=include_unknown)


def _planned(planner: Planner, state: SagaState, *, include_unknown: bool) -> PlannedSaga:
    runs, stop = interventions.compensation_plan(planner, include_unknown=include_unknown)
    raises = interventions.fresh_budgets(planner)
    nulls = interventions.null_result_compensations(planner, [step for step, _ in runs])
    return PlannedSaga(
        state.id, describe(state), runs, stop=stop, raises=raises, null_results=nulls
    )


def cancel_plan(
    orch: Orchestrator, state: SagaState, *, include_unknown: bool
) -> PlannedSaga | None:
    """What cancelling `state` would compensate, changing nothing; None when the cancel
    would start no compensation (the saga is completed, already compensating and
    `include_unknown` adds nothing, or past a pivot step, which `cancel` refuses)."""
    if state.status.is_terminal:
        return None
    definition = orch.definition(state.saga, state.version)
    with orch.store.transaction() as conn:
        loaded = orch.store.load_txn(conn, state.id)
    if loaded is None:
        return None
    planner = Planner(definition, *loaded, now=datetime.now().astimezone())
    if planner.saga.direction == "backward":
        if not (include_unknown and interventions.unknown_compensable(planner)):
            return None
    elif succeeded_pivot(orch, state) is not None:
        return None
    return _planned(planner, state, include_unknown=include_unknown)


def dry_run(
    orch: Orchestrator,
    states: Sequence[SagaState],
    *,
    include_unknown: bool,
    force: bool,
    batch: bool,
) -> list[PlannedSaga]:
    """The compensation plan of each saga, or why it would be skipped; writes nothing."""
    plans: list[PlannedSaga] = []
    for state in states:
        if state.status == SagaStatus.COMPENSATED:
            plans.append(PlannedSaga(state.id, describe(state), []))
            continue
        why = refusal(orch, state, force=force, batch=batch)
        if why is not None:
            plans.append(PlannedSaga(state.id, describe(state), [], skip=why))
            continue
        plans.append(plan_compensation(orch, state, include_unknown=include_unknown))
    return plans


def compensate_batch(
    orch: Orchestrator,
    states: Sequence[SagaState],
    *,
    include_unknown: bool,
    actor: str,
    force: bool,
    batch: bool,
    progress: Progress | None = None,
    on_outcome: Callable[[Outcome], None] | None = None,
) -> Report:
    """Compensate each saga here, in reverse, running no further step; one report."""
    return _run_batch(
        [
            (
                state.id,
                functools.partial(
                    _compensate_one,
                    orch,
                    state,
                    include_unknown=include_unknown,
                    actor=actor,
                    force=force,
                    batch=batch,
                ),
            )
            for state in states
        ],
        progress,
        on_outcome,
    )


def _run_batch(
    jobs: Sequence[tuple[str, Callable[[], Outcome]]],
    progress: Progress | None,
    on_outcome: Callable[[Outcome], None] | None,
) -> Report:
    """Run each saga's job in turn with progress and per-saga outcomes; Ctrl-C stops the
    batch after the saga in hand, and the report says it was interrupted."""
    report = Report(selected=len(jobs))
    for index, (saga_id, job) in enumerate(jobs, start=1):
        if progress is not None:
            progress(index, len(jobs), saga_id)
        try:
            outcome = job()
        except KeyboardInterrupt:
            report.interrupted = True
            break
        report.outcomes.append(outcome)
        if on_outcome is not None:
            on_outcome(outcome)
    return report


def _compensate_one(
    orch: Orchestrator,
    state: SagaState,
    *,
    include_unknown: bool,
    actor: str,
    force: bool,
    batch: bool,
) -> Outcome:
    name = describe(state)
    if state.status == SagaStatus.COMPENSATED:
        return Outcome(state.id, name, "done", "already compensated")
    why = refusal(orch, state, force=force, batch=batch)
    if why is not None:
        return Outcome(state.id, name, "skipped", why)
    try:
        after = orch.compensate(state.id, include_unknown=include_unknown, actor=actor, force=force)
        after = _await_handoff(orch, after)
    except DatabaseUnavailable:  # the database, not this saga: the batch stops
        raise
    except SagaError as exc:
        return Outcome(state.id, name, "skipped", str(exc))
    return _classify(orch, after, done_detail=_compensated_detail(after))


def reconcile(
    orch: Orchestrator,
    *,
    limit: int,
    progress: Progress | None = None,
    on_outcome: Callable[[Outcome], None] | None = None,
) -> Report:
    """Settle operations left running under an expired lease, or unknown.

    Each saga found is driven here: claiming it marks the orphaned attempt unknown,
    which its reconcile hook or an idempotent retry with the same key settles (else
    the saga parks for a human), and the saga then goes on as a worker would take it.
    """
    kinds = [f"{s.name}:{s.version}" for s in orch.registered()]
    found = orch.store.find_unsettled(kinds, limit=limit)
    first: dict[str, dict[str, object]] = {}
    for row in found:
        first.setdefault(str(row["id"]), row)
    return _run_batch(
        [
            (saga_id, functools.partial(_reconcile_one, orch, saga_id, row))
            for saga_id, row in first.items()
        ],
        progress,
        on_outcome,
    )


def _reconcile_one(orch: Orchestrator, saga_id: str, row: dict[str, object]) -> Outcome:
    name = f"{row['name']} v{row['version']}"
    step, kind = str(row["step"]), str(row["kind"])
    what = f"{step} ({kind})" if kind == "compensation" else step
    try:
        state = _await_handoff(orch, orch.run(saga_id))
    except DatabaseUnavailable:  # the database, not this saga: the batch stops
        raise
    except SagaError as exc:
        return Outcome(saga_id, name, "skipped", str(exc))
    try:
        op = state.operation(step, "compensation" if kind == "compensation" else "action")
        settled = f"{what}: {row['status']} -> {op.status}"
    except KeyError:
        settled = what
    return _classify(orch, state, done_detail=f"{settled}; saga {state.status}")


def _await_handoff(orch: Orchestrator, state: SagaState) -> SagaState:
    """When another worker picked the saga up first, wait (a little) for it to stop."""
    deadline = time.monotonic() + HANDOFF_WAIT_SECONDS
    while state.status.is_runnable and live_lease(state) and state.lease_owner != orch.owner:
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
        state = orch.get(state.id)
    return state


def _classify(orch: Orchestrator, state: SagaState, *, done_detail: str) -> Outcome:
    name = describe(state)
    if state.status == SagaStatus.NEEDS_REVIEW:
        return Outcome(state.id, name, "parked", f"needs_review: {state.error}")
    if state.status.is_runnable:
        holder = state.lease_owner or "nobody yet"
        return Outcome(state.id, name, "skipped", f"still {state.status}, driven by {holder}")
    return Outcome(state.id, name, "done", done_detail)


def _compensated_detail(state: SagaState) -> str:
    ran = [o.step for o in state.operations if o.kind == "compensation" and o.attempts > 0]
    if not ran:
        return f"{state.status} (nothing to undo)"
    return f"{state.status}: undid {', '.join(ran)}"


@dataclass(frozen=True, slots=True)
class PurgeCandidate:
    """An ended saga a purge would delete."""

    saga_id: str
    saga: str
    status: SagaStatus
    finished_at: datetime


def purge_candidates(
    orch: Orchestrator, *, older_than_days: float | None, limit: int
) -> tuple[list[PurgeCandidate], int]:
    """What `orch.purge(older_than_days=...)` would delete now, oldest first (at most
    `limit`), and how many in all; deletes nothing. A cutoff shorter than the
    orchestrator's retention is refused (`ValueError`), as `purge` refuses it."""
    days = orch.purge_cutoff_days(older_than_days)
    rows, total = orch.store.purgeable(retention_seconds=days * 86400.0, limit=limit)
    found = [
        PurgeCandidate(
            saga_id=str(row["id"]),
            saga=f"{row['name']} v{row['version']}",
            status=SagaStatus(row["status"]),
            finished_at=row["finished_at"],
        )
        for row in rows
    ]
    return found, total


def parse_duration(text: str) -> timedelta:
    """`90s`, `15m`, `1h`, `2d`, `1w`, `1h30m` or plain seconds; `ValueError` otherwise."""
    import re

    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
    cleaned = text.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", cleaned):
        return timedelta(seconds=float(cleaned))
    parts = re.findall(r"(\d+(?:\.\d+)?)([smhdw])", cleaned)
    if not parts or "".join(n + u for n, u in parts) != cleaned:
        raise ValueError(f"invalid duration {text!r}: use e.g. 90s, 15m, 1h, 2d or 1h30m")
    return timedelta(seconds=sum(float(n) * units[u] for n, u in parts))


# ----- id prefixes ---------------------------------------------------------------------

# The fewest hex digits of an id `expand_id` looks a saga up by, and how many candidates
# an ambiguous prefix names.
MIN_ID_PREFIX = 4
_CANDIDATES = 5
_PREFIX = re.compile(r"[0-9a-f][0-9a-f-]*")


class UnknownIdPrefix(SagaNotFound):
    """No saga id starts with the prefix given."""

    def __init__(self, prefix: str) -> None:
        super().__init__(prefix)
        self.args = (f"no saga id starts with {prefix!r}",)


class AmbiguousIdPrefix(ValueError):
    """Several saga ids start with the prefix given."""

    def __init__(self, prefix: str, candidates: Sequence[str], more: bool) -> None:
        listed = ", ".join(candidates) + (", ..." if more else "")
        super().__init__(
            f"saga id prefix {prefix!r} is ambiguous: it matches {listed}; give more of the id"
        )
        self.prefix = prefix
        self.candidates = list(candidates)


# How many sagas of one business key an ambiguous reference lists at most.
_KEY_CANDIDATES = 10


@dataclass(frozen=True, slots=True)
class SagaRef:
    """A saga an ambiguous reference could mean, and how the text given matched it:
    `key` (its business key) or `id prefix`."""

    saga_id: str
    saga: str
    version: int
    tenant_id: str
    key: str
    status: str
    matched: str


class AmbiguousReference(ValueError):
    """Several sagas answer to the text given: the key of more than one saga, or the key
    of one and the start of another's id. The message lists them (id, saga, version,
    tenant, status) and asks for the id of one."""

    def __init__(self, text: str, candidates: Sequence[SagaRef], more: bool) -> None:
        keyed = sum(1 for c in candidates if c.matched == "key")
        prefixed = len(candidates) - keyed
        parts = []
        if keyed:
            many = f"more than {keyed}" if more else str(keyed)
            parts.append(f"the key of {many} saga{'s' if keyed > 1 or more else ''}")
        if prefixed:
            parts.append(f"the start of {prefixed} saga id{'s' if prefixed > 1 else ''}")
        rows = [("ID", "SAGA", "VERSION", "TENANT", "STATUS", "MATCHED BY")]
        rows += [
            (c.saga_id, c.saga, str(c.version), c.tenant_id or "-", c.status, c.matched)
            for c in candidates
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        table = [
            "  " + "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip()
            for r in rows
        ]
        hint = f" (saga list --key {text!r} --tenant T --saga NAME narrows them)" if more else ""
        super().__init__(
            f"{text!r} is {' and '.join(parts)}: give the full id of the one you mean{hint}\n"
            + "\n".join(table)
        )
        self.text = text
        self.candidates = list(candidates)


class UnknownReference(SagaNotFound):
    """No saga has the id, or the business key, given."""

    def __init__(self, text: str, prefix: bool) -> None:
        super().__init__(text)
        if prefix:
            self.args = (f"no saga id starts with {text!r}, and no saga has it as its key",)
        else:
            self.args = (f"no saga has the id or the key {text!r}",)


def expand_id(store: Store, text: str) -> str:
    """The id of the saga `text` names: its id, a unique prefix of its id (as git takes a
    commit's), or its business key (exactly as the saga was started with it).

    Precedence, so that a reference never silently picks one of several sagas:
    a full id names the saga with that id, and is returned as it is (checked when used),
    unless no saga has it and it is the key of some (a key that is a uuid). Any other
    text is looked up as a key, and also, when it looks like an id prefix (hex digits and
    dashes, at least `MIN_ID_PREFIX` digits), as a prefix. When exactly one saga answers
    in all, that is the one; when several do (the key of several sagas, or the key of one
    and the prefix of another's id), `AmbiguousReference` lists them. Without any key
    match, prefixes behave as before: shorter than `MIN_ID_PREFIX` digits is
    `ValueError`, ambiguous is `AmbiguousIdPrefix` (naming a few). Nothing found is
    `UnknownReference` (a `SagaNotFound`). Both lookups read through an index."""
    full = parse_id(text)
    if full is not None:
        if store.saga_refs(ids=[str(full)]):
            return text
        keyed = _key_refs(store, text)
        if len(keyed) == 1:
            return keyed[0].saga_id
        if keyed:
            raise AmbiguousReference(text, keyed[:_KEY_CANDIDATES], len(keyed) > _KEY_CANDIDATES)
        return text
    keyed = _key_refs(store, text)
    prefix = text.strip().lower()
    digits = prefix.replace("-", "")
    is_prefix = _PREFIX.fullmatch(prefix) is not None and len(digits) <= 32
    if not keyed:
        if not is_prefix:
            raise UnknownReference(text, prefix=False)
        if len(digits) < MIN_ID_PREFIX:
            raise ValueError(
                f"saga id prefix {text!r} is too short: give at least {MIN_ID_PREFIX} "
                "characters of the id, or a saga's whole key"
            )
        found = store.ids_with_prefix(prefix, limit=_CANDIDATES + 1)
        if not found:
            raise UnknownReference(text, prefix=True)
        if len(found) > 1:
            raise AmbiguousIdPrefix(text, found[:_CANDIDATES], more=len(found) > _CANDIDATES)
        return found[0]
    more = len(keyed) > _KEY_CANDIDATES
    candidates = keyed[:_KEY_CANDIDATES]
    if is_prefix and len(digits) >= MIN_ID_PREFIX:
        listed = {c.saga_id for c in keyed}
        others = [i for i in store.ids_with_prefix(prefix, limit=_CANDIDATES) if i not in listed]
        candidates += [_ref(row, "id prefix") for row in store.saga_refs(ids=others)]
    if len(candidates) == 1:
        return candidates[0].saga_id
    raise AmbiguousReference(text, candidates, more)


def _key_refs(store: Store, key: str) -> list[SagaRef]:
    rows = store.saga_refs(key=key, limit=_KEY_CANDIDATES + 1)
    return [_ref(row, "key") for row in rows]


def _ref(row: dict[str, object], matched: str) -> SagaRef:
    return SagaRef(
        saga_id=str(row["id"]),
        saga=str(row["name"]),
        version=int(str(row["version"])),
        tenant_id=str(row["tenant_id"]),
        key=str(row["key"]),
        status=str(row["status"]),
        matched=matched,
    )


# ----- versions in flight --------------------------------------------------------------

IN_FLIGHT = (
    SagaStatus.PENDING,
    SagaStatus.RUNNING,
    SagaStatus.COMPENSATING,
    SagaStatus.AWAITING_CONFIRMATION,
    SagaStatus.NEEDS_REVIEW,
)


@dataclass(frozen=True, slots=True)
class VersionInFlight:
    """How many sagas of one name and version have not ended, by status, and whether the
    app asked about registers that version (None when no app was given)."""

    saga: str
    version: int
    counts: dict[SagaStatus, int]
    registered: bool | None

    @property
    def in_flight(self) -> int:
        """Every saga of this version that has not ended (parked ones included)."""
        return sum(self.counts.values())


def versions_in_flight(
    store: Store, registered: Collection[tuple[str, int]] | None = None
) -> list[VersionInFlight]:
    """Sagas not yet ended per (name, version), sorted; with `registered` (the app's
    name/version pairs), each says whether the app registers it, and registered versions
    with nothing in flight are listed too."""
    counts: dict[tuple[str, int], dict[SagaStatus, int]] = {}
    for name, version, status, n in store.in_flight_by_version():
        counts.setdefault((name, version), dict.fromkeys(IN_FLIGHT, 0))[SagaStatus(status)] = n
    for kind in registered or ():
        counts.setdefault(kind, dict.fromkeys(IN_FLIGHT, 0))
    return [
        VersionInFlight(
            saga=name,
            version=version,
            counts=by_status,
            registered=None if registered is None else (name, version) in registered,
        )
        for (name, version), by_status in sorted(counts.items())
    ]
