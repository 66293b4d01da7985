"""Crash-test your sagas: a real PostgreSQL fixture, kills at every fault point, invariants.

Use it from your pytest suite (it needs pytest; testcontainers is optional):

    # conftest.py
    pytest_plugins = ["saga.testing"]        # the postgres_server_url and postgres_url fixtures

    # test_renewal_crash.py
    from saga.testing import crash_test

    def test_renewal_survives_kills(postgres_url):
        report = crash_test(
            app="myapp:orch", saga="renewal", database_url=postgres_url,
            input=lambda run: {"tenant_id": "acme", "renewal_event_id": f"evt-{run}", ...},
        )
        assert report.killed

`crash_test` runs the saga once without faults in a child process, then once per
fault point that run went through, in a fresh child armed to SIGKILL itself there
(`SAGA_FAULT=POINT:KIND:STEP`), resumes every killed saga in another child, and checks
`check_invariants` on all of them. `check_invariants` and `replay_history` work on any
database the orchestrator uses.

A session of durable steps is crash-tested through the function that runs it:

    report = crash_test("myapp:orch", session="myapp:handle_ticket",
                        database_url=postgres_url, input=lambda run: f"ticket-{run}")

Each call of the session is killed at each fault point (`POINT:KIND:CALL`), and the
session is resumed by calling the function again with the same arguments in a fresh
child process.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, cast

import pytest
from pydantic import BaseModel

from saga._app import load_app
from saga._db.scratch import throwaway_database
from saga._drivers import faults
from saga.definition import Saga
from saga.errors import PermanentError, SessionBusy, SessionParked
from saga.orchestrator import Orchestrator
from saga.orchestrator_async import AsyncOrchestrator
from saga.redact import scrub
from saga.session import AsyncSession, Session
from saga.signatures import is_async
from saga.state import HistoryEvent, OperationState, SagaState

__all__ = [
    "FAULT_POINTS",
    "CrashReport",
    "CrashRun",
    "InvariantReport",
    "InvariantViolation",
    "Replayed",
    "check_invariants",
    "crash_test",
    "postgres_server",
    "postgres_server_url",
    "postgres_url",
    "replay_history",
]

FAULT_POINTS = faults.POINTS
ENV_TEST_URL = "SAGA_TEST_DATABASE_URL"
SETTLED = ("completed", "compensated", "needs_review")
# How long the Docker probe may take before falling back to the embedded server (seconds).
DOCKER_PING_TIMEOUT_SECONDS = 2
_MARK = "SAGA_TESTING "


# ----- a real PostgreSQL --------------------------------------------------------------------


@contextlib.contextmanager
def postgres_server(data_dir: Path | None = None) -> Iterator[str]:
    """A PostgreSQL server's maintenance URL: `SAGA_TEST_DATABASE_URL`, else a
    testcontainers PostgreSQL when a Docker engine answers, else the embedded PostgreSQL
    (in `data_dir`, or a fresh temporary directory)."""
    configured = os.environ.get(ENV_TEST_URL)
    if configured:
        yield configured
        return
    if _docker_answers():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from testcontainers.postgres import PostgresContainer

            container = PostgresContainer("postgres:16-alpine", driver=None)
            container.start()
        try:
            yield str(container.get_connection_url())
        finally:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                container.stop()
        return
    import tempfile

    from saga._db.database import embedded_database_url

    with contextlib.ExitStack() as stack:
        if data_dir is None:
            data_dir = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "pgdata"
        yield embedded_database_url(data_dir)


def _docker_answers() -> bool:
    if not os.environ.get("DOCKER_HOST") and not Path("/var/run/docker.sock").exists():
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            import docker  # type: ignore[import-untyped]

            client = docker.from_env(timeout=DOCKER_PING_TIMEOUT_SECONDS)
            try:
                return bool(client.ping())
            finally:
                client.close()
        except Exception:
            return False
        finally:
            gc.collect()


@pytest.fixture(scope="session")
def postgres_server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Maintenance URL of the PostgreSQL server of this test session (see `postgres_server`)."""
    with postgres_server(tmp_path_factory.mktemp("saga-embedded") / "pgdata") as url:
        yield url


@pytest.fixture
def postgres_url(postgres_server_url: str) -> Iterator[str]:
    """URL of a fresh, empty database of this test only (the orchestrator migrates it on
    first use), dropped afterwards."""
    name = f"saga_test_{os.getpid()}_{secrets.token_hex(4)}"
    with throwaway_database(postgres_server_url, name) as url:
        yield url


# ----- replaying the audit trail ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Replayed:
    """What a saga's audit trail says its state is."""

    status: str
    error: str | None
    direction: str
    # (step, kind) -> (status, attempts)
    operations: dict[tuple[str, str], tuple[str, int]]


def replay_history(
    events: Sequence[HistoryEvent], *, ceilings: Mapping[tuple[str, str], int] | None = None
) -> Replayed:
    """Derive a saga's status and each operation's status and attempts from its events alone.

    `ceilings` are the operations' current `max_attempts`; they tell whether a settled
    "absent" answer of a reconcile hook at the ceiling failed the operation (earlier
    ceilings are read from `retry_requested` events).
    """
    status, error, direction = "pending", None, "forward"
    # (step, kind) -> [status, attempts, an attempt's outcome is unknown and unsettled]
    ops: dict[tuple[str, str], list[Any]] = {}
    ceilings = dict(ceilings or {})

    def ceiling_at(index: int, key: tuple[str, str]) -> int:
        for later in events[index + 1 :]:
            if later.event == "retry_requested" and (later.step, later.kind) == key:
                return int(later.detail.get("previous_max_attempts", ceilings.get(key, 0)))
        return ceilings.get(key, 0)

    def resume() -> str:
        return "compensating" if direction == "backward" else "running"

    for index, e in enumerate(events):
        name, detail = e.event, e.detail
        if e.step is not None and e.kind is not None:
            key = (e.step, e.kind)
            op = ops.setdefault(key, ["pending", 0, False])
            if e.attempt is not None:
                op[1] = max(op[1], e.attempt)
            if name == "attempt_started":
                op[0] = "running"
            elif name in ("attempt_succeeded", "reconcile_found"):
                op[0], op[2] = "succeeded", False
            elif name == "attempt_failed" and detail.get("parked"):
                pass  # prepare raised an unclassified exception: nothing failed, it parked
            elif name == "attempt_failed":
                retrying = detail.get("retryable") and detail.get("retry_in_seconds") is not None
                # After an unknown attempt, a failed retry leaves the operation unknown.
                op[0] = "unknown" if op[2] else "pending" if retrying else "failed"
            elif name == "outcome_unknown":
                op[0], op[2] = "unknown", True
            elif name == "reconcile_absent" and detail.get("settled", True):
                op[0] = "pending" if op[1] < ceiling_at(index, key) else "failed"
                op[2] = False
            elif name == "deadline_passed":
                op[0] = "failed"
            elif name == "operation_resolved":
                op[0] = "succeeded" if detail.get("outcome") == "succeeded" else "failed"
                op[2] = False
                if status not in ("completed", "compensated"):
                    status, error = resume(), None
            elif name == "retry_requested":
                if detail.get("previous_status") == "failed":
                    op[0] = "pending"
                status, error = resume(), None
            elif name == "confirmation_requested":
                status = "awaiting_confirmation"
            elif name in ("confirmation_approved", "confirmation_expired"):
                status, error = resume(), None
            continue
        if name == "saga_started":
            status = "pending"
        elif name == "lease_acquired" and status == "pending":
            status = "running"
        elif name == "compensation_started":
            direction, status, error = "backward", "compensating", detail.get("reason")
        elif name == "compensation_requested" and status != "compensated":
            direction, status, error = "backward", "compensating", None
        elif name == "ceilings_raised" and status == "needs_review":
            status, error = resume(), None
        elif name == "saga_parked":
            status, error = "needs_review", detail.get("reason")
        elif name == "saga_completed":
            status, error = "completed", None
        elif name == "saga_compensated":
            status = "compensated"
    return Replayed(
        status=status,
        error=error,
        direction=direction,
        operations={k: (v[0], v[1]) for k, v in ops.items()},
    )


# ----- invariants ---------------------------------------------------------------------------


class InvariantViolation(AssertionError):
    """A saga broke one of the invariants; the message lists every violation found."""


@dataclass
class InvariantReport:
    """What `check_invariants` found."""

    sagas: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    # saga id -> the reason it waits for a human
    parked: dict[str, str] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No violation was found."""
        return not self.violations

    def raise_if_violated(self) -> None:
        """Raise `InvariantViolation` listing every violation, if there is any."""
        if self.violations:
            shown = "\n  ".join(self.violations[:50])
            more = (
                f"\n  ... and {len(self.violations) - 50} more" if len(self.violations) > 50 else ""
            )
            raise InvariantViolation(f"{len(self.violations)} violation(s):\n  {shown}{more}")


EffectCounter = Callable[[str], int] | Mapping[str, int]

_SUCCESS_EVENTS = ("attempt_succeeded", "reconcile_found")


def check_invariants(
    database_url: str,
    saga_ids: Iterable[str] | None = None,
    *,
    effects: EffectCounter | None = None,
    sagas: Iterable[Saga[Any]] = (),
    raise_on_violation: bool = True,
) -> InvariantReport:
    """Check the invariants of sagas that should have settled (all sagas by default).

    - each saga is `completed`, `compensated` or `needs_review` with a reason;
    - no lease is left held;
    - its audit trail replays to its stored status and to every operation's status and
      attempt count (`replay_history`);
    - compensations ran only for sagas that started compensating, only for steps that
      succeeded (or whose outcome was unknown when `include_unknown` was asked), at most
      once each, and in reverse step order: none started before the compensation of
      every later step had succeeded; a compensated saga has all of them succeeded;
    - with `effects` (a function or mapping from idempotency key to the number of
      effects your provider performed for it), no key has more than one.
    - with `sagas` (the definitions), a compensated saga compensated every succeeded
      step that declares a compensation.

    Raises `InvariantViolation` (an `AssertionError`) unless `raise_on_violation=False`.
    """
    report = InvariantReport()
    definitions = {(s.name, s.version): s for s in sagas}
    with Orchestrator(database_url, auto_migrate=False, pool_size=2) as orch:
        if saga_ids is None:
            states = orch.list(limit=2**31 - 1)
        else:
            states = [orch.get(i) for i in saga_ids]
        for state in states:
            history = orch.history(state.id)
            report.sagas += 1
            report.statuses[str(state.status)] += 1
            if str(state.status) == "needs_review":
                report.parked[state.id] = state.error or ""
            problems = _saga_problems(state, history, effects, definitions)
            report.violations.extend(f"saga {state.id} ({state.key}): {p}" for p in problems)
    if raise_on_violation:
        report.raise_if_violated()
    return report


def _saga_problems(
    state: SagaState,
    history: Sequence[HistoryEvent],
    effects: EffectCounter | None,
    definitions: Mapping[tuple[str, int], Saga[Any]],
) -> list[str]:
    problems: list[str] = []
    status = str(state.status)
    if status not in SETTLED:
        problems.append(f"not settled: {status}")
    if status == "needs_review" and not state.error:
        problems.append("needs_review without a reason")
    if state.lease_owner is not None:
        problems.append(f"lease still held by {state.lease_owner}")

    ceilings = {(op.step, str(op.kind)): op.max_attempts for op in state.operations}
    replayed = replay_history(history, ceilings=ceilings)
    if replayed.status != status:
        problems.append(f"history replays to status {replayed.status}, stored {status}")
    if status == "needs_review" and replayed.error != state.error:
        problems.append(f"history replays to reason {replayed.error!r}, stored {state.error!r}")
    for op in state.operations:
        key = (op.step, str(op.kind))
        stored = (str(op.status), op.attempts)
        if replayed.operations.get(key, ("pending", 0)) != stored:
            problems.append(
                f"{op.kind} {op.step!r}: history replays to {replayed.operations.get(key)}, "
                f"stored {stored}"
            )
    for key in replayed.operations.keys() - ceilings.keys():
        problems.append(f"history names an operation that does not exist: {key}")

    problems.extend(_compensation_problems(state, history, definitions))

    if effects is not None:
        count = effects if callable(effects) else effects.get
        for op in state.operations:
            performed = count(op.idempotency_key) or 0
            if performed > 1:
                problems.append(f"effect performed {performed} times for key {op.idempotency_key}")
    return problems


def _compensation_problems(
    state: SagaState,
    history: Sequence[HistoryEvent],
    definitions: Mapping[tuple[str, int], Saga[Any]],
) -> list[str]:
    problems: list[str] = []
    actions = {op.step: op for op in state.operations if op.kind == "action"}
    position = {step: i for i, step in enumerate(actions)}  # operations come in step order
    comps = {op.step: op for op in state.operations if op.kind == "compensation"}
    names = [e.event for e in history]
    started = "compensation_started" in names or "compensation_requested" in names
    include_unknown = any(
        e.event == "compensation_requested" and e.detail.get("include_unknown") for e in history
    )
    if comps and not started:
        problems.append("compensations exist but the saga never started compensating")
    for step, comp in comps.items():
        action = actions.get(step)
        action_status = str(action.status) if action is not None else "missing"
        expected = action_status == "succeeded" or (include_unknown and action_status == "unknown")
        if not expected and comp.attempts > 0:
            problems.append(f"compensation of {step!r} ran although the step is {action_status}")
        successes = [
            e
            for e in history
            if e.step == step
            and e.kind == "compensation"
            and (
                e.event in _SUCCESS_EVENTS
                or (e.event == "operation_resolved" and e.detail.get("outcome") == "succeeded")
            )
        ]
        if len(successes) > 1:
            problems.append(f"compensation of {step!r} succeeded {len(successes)} times")
    # Reverse order: a compensation may start only once every later step's has succeeded.
    succeeded_at: dict[str, int] = {}
    for index, e in enumerate(history):
        if e.kind != "compensation" or e.step is None:
            continue
        resolved = e.event == "operation_resolved" and e.detail.get("outcome") == "succeeded"
        if (e.event in _SUCCESS_EVENTS or resolved) and e.step not in succeeded_at:
            succeeded_at[e.step] = index
        if e.event == "attempt_started":
            for later in comps:
                after = position.get(later, -1) > position.get(e.step, -1)
                if after and succeeded_at.get(later, len(history)) > index:
                    problems.append(
                        f"compensation of {e.step!r} started before the compensation of "
                        f"later step {later!r} succeeded"
                    )
    if str(state.status) == "completed" and any(c.attempts for c in comps.values()):
        problems.append("completed, yet compensations ran")
    if str(state.status) == "compensated":
        for step, comp in comps.items():
            if str(comp.status) != "succeeded":
                problems.append(f"compensated, yet the compensation of {step!r} is {comp.status}")
        definition = definitions.get((state.saga, state.version))
        if definition is not None:
            for s in definition.steps:
                action = actions.get(s.name)
                needs = s.compensation_op is not None and action is not None
                if needs and str(action.status) == "succeeded" and s.name not in comps:  # type: ignore[union-attr]
                    problems.append(f"compensated, yet step {s.name!r} was never compensated")
    return problems


# ----- killing a saga at each fault point ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class CrashRun:
    """One run of `crash_test`: where it was killed, and how the saga ended after resuming."""

    fault: str | None
    saga_id: str
    killed: bool
    status: str
    error: str | None


@dataclass
class CrashReport:
    """Every run of `crash_test` and the invariants checked on them."""

    baseline: CrashRun
    runs: list[CrashRun]
    invariants: InvariantReport

    @property
    def killed(self) -> list[CrashRun]:
        """The runs whose child process was killed at its fault point."""
        return [r for r in self.runs if r.killed]

    @property
    def parked(self) -> dict[str, str]:
        """fault -> reason, for the runs that ended in `needs_review`."""
        return {r.fault or "": r.error or "" for r in self.runs if r.status == "needs_review"}

    def summary(self) -> str:
        """One line per run: the fault point, killed or not reached, and the final status."""
        lines = [f"baseline: {self.baseline.status}"]
        for r in self.runs:
            how = "killed" if r.killed else "not reached"
            reason = f" ({r.error})" if r.status == "needs_review" else ""
            lines.append(f"{r.fault}: {how} -> {r.status}{reason}")
        return "\n".join(lines)


InputFactory = Callable[[str], BaseModel | Mapping[str, Any]]
# A session function's arguments for a run, from the run's name: a mapping (keyword
# arguments), a tuple or list (positional ones), or the one argument.
SessionArguments = Callable[[str], Any]


def crash_test(
    app: str,
    saga: str | Saga[Any] | None = None,
    input: InputFactory | SessionArguments | BaseModel | Mapping[str, Any] | None = None,
    *,
    session: str | Callable[..., Any] | None = None,
    database_url: str | None = None,
    points: Sequence[str] = FAULT_POINTS,
    kinds: Sequence[str] = ("action", "compensation"),
    lease_seconds: float = 1.0,
    parallel: int = 2,
    timeout: float = 120.0,
    effects: EffectCounter | None = None,
    allow_review: bool = True,
) -> CrashReport:
    """Kill a saga, or a session of durable steps, at each fault point in turn, resume it,
    and check the invariants.

    Args:
        app: `MODULE[:ATTR]` of the module that registers your sagas and the name of its
            `Orchestrator` or `AsyncOrchestrator` (found by itself when the module has
            only one), as for `saga worker --app`. It is imported in child processes
            only, with `SAGA_DATABASE_URL` set to `database_url`. With an
            `AsyncOrchestrator` the children drive the saga through the async door
            (`await orch.run(...)` on an event loop).
        saga: The saga to run: its name (`"renewal"` or `"renewal:2"`) or the `Saga`.
        input: For a saga: a function of the run's name (`"baseline"`,
            `"before_call:action:charge"`, ...) returning that run's input, whose key must
            differ from run to run; or a fixed input when only one run is made. For a
            session: a function of the run's name returning the session function's
            arguments, as JSON (a mapping: keyword arguments; a tuple or list: positional
            ones; anything else: its one argument), which must open a session of its own
            per run; by default the function is called with one argument, a run id made
            for that run.
        session: Instead of `saga`: the function that runs a session of durable steps
            (`with orch.session(run_id): ...`, or an `async def` with
            `async with aorch.session(run_id): ...`), as `"MODULE:FUNCTION"` or the
            function itself, defined at the top level of an importable module (the
            children import it). See "Sessions" below.
        database_url: The database (else `SAGA_DATABASE_URL`).
        points: The fault points to try (all of `FAULT_POINTS` by default).
        kinds: Try the points of `action`s, of `compensation`s, or both.
        lease_seconds: Lease of the child processes, so a killed run is resumed quickly.
        parallel: How many armed children run at once.
        timeout: Longest time (seconds) any child process may take.
        effects: Your provider's count of performed effects per idempotency key (a
            request it deduplicated is no effect); no key may have more than one.
        allow_review: Accept `needs_review` as a run's outcome (an unknown outcome of a
            step with neither a reconcile hook nor idempotency must wait for a human).

    The baseline run goes through without faults; the fault points tried are those it
    reached (`POINT:KIND:STEP` for every operation it attempted). Every other run must
    end as the baseline did (or in `needs_review`, with `allow_review`), and every saga
    must satisfy `check_invariants`; an `InvariantViolation` says which did not.

    Sessions: the function runs once without faults in a child process, then once per
    fault point that run went through, `POINT:KIND:CALL` (CALL is the durable step's
    name, `#2`, `#3`... added for its later calls in the session: `email#2`), in a fresh
    child armed to SIGKILL itself there. A killed run is resumed as you would resume it:
    the function is called again with the same arguments, in another fresh child
    (`SessionBusy` is waited out while the killed holder's lease lasts). Each run's
    session must end as the baseline's did, with the same calls ending alike (none lost,
    none added) or in `needs_review` with a reason (with `allow_review`); it must satisfy
    `check_invariants`; with `effects`, a call whose baseline counterpart had an effect
    must have one too. The function must open one session per run, under a run id taken
    from its arguments, and do nothing outside it that must not happen twice; a
    `PermanentError` (or `SessionParked`) it lets out ends a run as usual. In the
    children, the `app`'s orchestrator's lease is set to `lease_seconds`.
    """
    url = database_url or os.environ.get("SAGA_DATABASE_URL")
    if not url:
        raise ValueError("crash_test needs database_url (or SAGA_DATABASE_URL)")
    if (saga is None) == (session is None):
        raise TypeError(
            "crash_test needs either saga= (a declared saga, by name or as the Saga) or "
            "session= (the function that runs a session of durable steps), "
            + ("not both" if saga is not None else "and got neither")
        )
    options = _Options(app, url, points, kinds, lease_seconds, parallel, timeout, allow_review)
    if session is not None:
        if input is not None and not callable(input):
            raise ValueError(
                "input must be a function of the run's name returning the session "
                "function's arguments: each run needs a session of its own"
            )
        return _crash_test_session(options, session, input, effects)
    assert saga is not None
    if input is None:
        raise TypeError(
            "crash_test needs input= for a saga: a function of the run's name returning "
            "that run's input"
        )
    return _crash_test_saga(options, saga, input, effects)


@dataclass(frozen=True, slots=True)
class _Options:
    """What every run of one `crash_test` shares."""

    app: str
    url: str
    points: Sequence[str]
    kinds: Sequence[str]
    lease_seconds: float
    parallel: int
    timeout: float
    allow_review: bool


def _crash_test_saga(
    options: _Options,
    saga: str | Saga[Any],
    input: InputFactory | SessionArguments | BaseModel | Mapping[str, Any],
    effects: EffectCounter | None,
) -> CrashReport:
    app, url, timeout = options.app, options.url, options.timeout
    lease_seconds = options.lease_seconds
    saga_name = saga if isinstance(saga, str) else f"{saga.name}:{saga.version}"

    def input_of(run: str) -> Any:
        value = input(run) if callable(input) else input
        return value.model_dump(mode="json") if isinstance(value, BaseModel) else dict(value)

    env = _child_env(url)
    base = _child(
        env,
        {
            "op": "run",
            "app": app,
            "saga": saga_name,
            "input": input_of("baseline"),
            "lease_seconds": lease_seconds,
        },
        timeout=timeout,
    )
    if base["code"] != 0 or "finished" not in base:
        raise RuntimeError(f"the baseline run failed (exit {base['code']}):\n{base['output']}")
    with Orchestrator(url, auto_migrate=False, pool_size=2) as orch:
        base_state = orch.get(base["started"])
        attempted: list[tuple[str, str]] = []
        for e in orch.history(base_state.id):
            fresh = e.step and e.kind and (e.step, e.kind) not in attempted
            if e.event == "attempt_started" and fresh:
                attempted.append((e.step, e.kind))  # type: ignore[arg-type]
    baseline = CrashRun(None, base_state.id, False, str(base_state.status), base_state.error)
    faults_to_try = [
        f"{point}:{kind}:{step}"
        for step, kind in attempted
        if kind in options.kinds
        for point in options.points
    ]
    inputs = {fault: input_of(fault) for fault in faults_to_try}
    if not callable(input) and faults_to_try:
        raise ValueError("input must be a function of the run's name: each run needs its own key")

    def armed(fault: str) -> dict[str, Any]:
        request = {
            "op": "run",
            "app": app,
            "saga": saga_name,
            "input": inputs[fault],
            "lease_seconds": lease_seconds,
        }
        return _child({**env, faults.ENV_FAULT: fault}, request, timeout=timeout)

    with ThreadPoolExecutor(max_workers=max(1, options.parallel)) as pool:
        outcomes = dict(zip(faults_to_try, pool.map(armed, faults_to_try), strict=True))
    problems: list[str] = []
    for fault, out in outcomes.items():
        if "started" not in out:
            problems.append(f"{fault}: the child did not start the saga:\n{out['output']}")
        elif out["code"] not in (0, -9):
            problems.append(f"{fault}: the child exited with {out['code']}:\n{out['output']}")
    if problems:
        raise RuntimeError("\n".join(problems))
    to_resume = [out["started"] for out in outcomes.values() if "finished" not in out]
    if to_resume:
        resumed = _child(
            env,
            {
                "op": "resume",
                "app": app,
                "ids": to_resume,
                "lease_seconds": lease_seconds,
                "deadline_seconds": timeout / 2,
            },
            timeout=timeout,
        )
        if resumed["code"] != 0:
            raise RuntimeError(f"resuming failed (exit {resumed['code']}):\n{resumed['output']}")
    runs: list[CrashRun] = []
    with Orchestrator(url, auto_migrate=False, pool_size=2) as orch:
        for fault, out in outcomes.items():
            state = orch.get(out["started"])
            runs.append(
                CrashRun(fault, state.id, "finished" not in out, str(state.status), state.error)
            )
    ids = [baseline.saga_id, *(r.saga_id for r in runs)]
    invariants = check_invariants(url, ids, effects=effects, raise_on_violation=False)
    _check_outcomes(invariants, baseline, runs, options.allow_review)
    report = CrashReport(baseline, runs, invariants)
    invariants.raise_if_violated()
    return report


def _check_outcomes(
    invariants: InvariantReport, baseline: CrashRun, runs: Sequence[CrashRun], allow_review: bool
) -> None:
    """Every run must end as the baseline did (or in `needs_review`, with `allow_review`)."""
    expected = {baseline.status, "needs_review"} if allow_review else {baseline.status}
    for r in runs:
        if r.status not in expected:
            invariants.violations.append(
                f"{r.fault}: ended {r.status}, the run without faults ended {baseline.status}"
            )


# ----- killing a session at each fault point of each call -----------------------------------

# How often a child entering a session that a killed run still holds tries again (seconds).
_BUSY_RETRY_SECONDS = 0.1


class _CallLabels:
    """Names the calls of one session as a report shows them: the durable step's name, and
    `#2`, `#3`... for its later calls (calls are told apart by order, so that a run whose
    calls have other keys than the baseline's, made from its own arguments, still has the
    same fault points). Operations are named `<step>.<digest of the call's key>`."""

    def __init__(self) -> None:
        self._seen: dict[str, list[str]] = {}

    def label(self, operation: str) -> str:
        """The label of `operation`, numbered in the order operations are first seen."""
        step = operation.rsplit(".", 1)[0]
        seen = self._seen.setdefault(step, [])
        if operation not in seen:
            seen.append(operation)
        number = seen.index(operation) + 1
        return step if number == 1 else f"{step}#{number}"


class _CallFault:
    """A fault handler that SIGKILLs this process at `POINT:KIND:CALL` of a session."""

    def __init__(self, spec: str) -> None:
        self.point, self.kind, self.call = spec.split(":", 2)
        self.labels = _CallLabels()

    def __call__(self, reached: str, context: Mapping[str, Any]) -> None:
        step = context.get("step")
        if not isinstance(step, str):
            return
        label = self.labels.label(step)  # every point: calls are numbered as first seen
        if (reached, context.get("kind"), label) == (self.point, self.kind, self.call):
            os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True, slots=True)
class _SessionChild:
    """What one child running a session function reported."""

    code: int
    output: str
    # Ids of the sessions it entered, in order, each once.
    sessions: list[str]
    # The function returned or raised (it was not killed, and did not give up waiting).
    ended: bool
    # What it raised ("Type: message"), if it did.
    raised: str | None
    # Why it gave up waiting for the session (SessionBusy until its deadline), if it did.
    stuck: str | None

    @property
    def killed(self) -> bool:
        """It was killed with SIGKILL (at its fault point)."""
        return self.code == -signal.SIGKILL


def _crash_test_session(
    options: _Options,
    session: str | Callable[..., Any],
    input: SessionArguments | None,
    effects: EffectCounter | None,
) -> CrashReport:
    function = _function_spec(session)
    _check_fault_filters(options.points, options.kinds)
    made = f"crash-{secrets.token_hex(3)}"

    def arguments_of(run: str) -> dict[str, Any]:
        return _call_arguments(input(run) if input is not None else f"{made}-{run}", run)

    env = _child_env(options.url)

    def child(run: str, arguments: Mapping[str, Any], fault: str | None) -> _SessionChild:
        request = {
            "op": "session",
            "app": options.app,
            "function": function,
            **arguments,
            "fault": fault,
            "lease_seconds": options.lease_seconds,
            "deadline_seconds": options.timeout / 2,
        }
        return _session_child(env, request, timeout=options.timeout)

    base = child("baseline", arguments_of("baseline"), None)
    base_id = _session_of("baseline", base)
    with Orchestrator(options.url, auto_migrate=False, pool_size=2) as orch:
        base_state = orch.get(base_id)
        base_history = orch.history(base_id)
    if str(base_state.status) not in SETTLED:
        raise RuntimeError(
            f"the run without faults left its session {base_id} {base_state.status}"
            + (f" (the function raised {base.raised})" if base.raised else "")
            + ": a session ends completed, compensated (a PermanentError leaving its block, "
            "or run.fail) or parked; any other exception leaves it open. Fix the function "
            f"before crash-testing it:\n{base.output}"
        )
    baseline = CrashRun(None, base_id, False, str(base_state.status), base_state.error)
    faults_to_try = [
        f"{point}:{kind}:{call}"
        for call, kind in _attempted_calls(base_history)
        if kind in options.kinds
        for point in options.points
    ]
    inputs = {fault: arguments_of(fault) for fault in faults_to_try}

    def armed_then_resumed(fault: str) -> tuple[_SessionChild, _SessionChild | None]:
        armed = child(fault, inputs[fault], fault)
        if not armed.killed or not armed.sessions:
            return armed, None
        return armed, child(fault, inputs[fault], None)

    with ThreadPoolExecutor(max_workers=max(1, options.parallel)) as pool:
        outcomes = dict(
            zip(faults_to_try, pool.map(armed_then_resumed, faults_to_try), strict=True)
        )
    _raise_on_broken_children(outcomes)
    runs: list[CrashRun] = []
    raised: dict[str, str | None] = {"baseline": base.raised}
    with Orchestrator(options.url, auto_migrate=False, pool_size=2) as orch:
        for fault, (armed, resumed) in outcomes.items():
            state = orch.get(armed.sessions[0])
            runs.append(CrashRun(fault, state.id, armed.killed, str(state.status), state.error))
            raised[fault] = (resumed or armed).raised
    invariants = _session_invariants(options.url, baseline, runs, raised, effects)
    _check_outcomes(invariants, baseline, runs, options.allow_review)
    report = CrashReport(baseline, runs, invariants)
    invariants.raise_if_violated()
    return report


def _function_spec(session: str | Callable[..., Any]) -> str:
    """`MODULE:FUNCTION` of the session function, which the children import."""
    if isinstance(session, str):
        module, sep, attr = session.partition(":")
        if not (module and sep and attr):
            raise ValueError(
                f"session={session!r}: expected 'MODULE:FUNCTION', the function that runs "
                "the session"
            )
        return session
    if not callable(session):
        raise TypeError(
            f"session= must be the function that runs the session (or 'MODULE:FUNCTION'), "
            f"got {type(session).__name__} {session!r}"
        )
    module_name = getattr(session, "__module__", None)
    qualname = getattr(session, "__qualname__", None)
    found: Any = sys.modules.get(module_name) if isinstance(module_name, str) else None
    for part in qualname.split(".") if isinstance(qualname, str) else ["<none>"]:
        found = getattr(found, part, None)
    if found is not session or module_name == "__main__":
        raise ValueError(
            f"session={session!r}: the child processes import the session function by "
            "name, so it must be defined at the top level of an importable module (not in "
            "a function, a lambda or __main__); or pass 'MODULE:FUNCTION'"
        )
    return f"{module_name}:{qualname}"


def _check_fault_filters(points: Sequence[str], kinds: Sequence[str]) -> None:
    unknown = [p for p in points if p not in FAULT_POINTS]
    if unknown:
        raise ValueError(
            f"unknown fault point(s) {unknown}; known points: {', '.join(FAULT_POINTS)}"
        )
    odd = [k for k in kinds if k not in ("action", "compensation")]
    if odd:
        raise ValueError(f"kinds are 'action' and 'compensation', got {odd}")


def _call_arguments(value: Any, run: str) -> dict[str, Any]:
    """The session function's arguments for a run, as its child receives them."""
    if isinstance(value, Mapping):
        arguments: dict[str, Any] = {"args": [], "kwargs": dict(value)}
    elif isinstance(value, tuple | list):
        arguments = {"args": list(value), "kwargs": {}}
    else:
        arguments = {"args": [value], "kwargs": {}}
    try:
        json.dumps(arguments, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"the session function's arguments for run {run!r} must be JSON (a child "
            f"process receives them): {exc}"
        ) from None
    return arguments


def _session_of(run: str, out: _SessionChild) -> str:
    """The one session a child entered; RuntimeError when it did not enter exactly one."""
    if len(out.sessions) == 1:
        return out.sessions[0]
    if not out.sessions:
        why = f"raised {out.raised}" if out.raised else f"exited with {out.code}"
        raise RuntimeError(
            f"{run}: the session function entered no session ({why}); it must open "
            f"`orch.session(...)` (or `async with aorch.session(...)`):\n{out.output}"
        )
    raise RuntimeError(
        f"{run}: the session function entered {len(out.sessions)} sessions "
        f"({', '.join(out.sessions)}); crash_test follows one session per run"
    )


def _attempted_calls(history: Sequence[HistoryEvent]) -> list[tuple[str, str]]:
    """(call label, kind) of every operation a session attempted, in the order attempted."""
    labels = _CallLabels()
    attempted: list[tuple[str, str]] = []
    for e in history:
        if e.step is None or e.kind is None:
            continue
        call = (labels.label(e.step), str(e.kind))
        if e.event == "attempt_started" and call not in attempted:
            attempted.append(call)
    return attempted


def _raise_on_broken_children(
    outcomes: Mapping[str, tuple[_SessionChild, _SessionChild | None]],
) -> None:
    problems: list[str] = []
    for fault, (armed, resumed) in outcomes.items():
        if armed.code not in (0, -signal.SIGKILL):
            problems.append(f"{fault}: the child exited with {armed.code}:\n{armed.output}")
            continue
        try:
            session_id = _session_of(fault, armed)
        except RuntimeError as exc:
            problems.append(str(exc))
            continue
        if resumed is None:
            continue
        if resumed.code != 0 or resumed.stuck:
            why = f" ({resumed.stuck})" if resumed.stuck else ""
            problems.append(
                f"{fault}: running the function again failed (exit {resumed.code}){why}:\n"
                f"{resumed.output}"
            )
        elif resumed.sessions and resumed.sessions != [session_id]:
            problems.append(
                f"{fault}: run again with the same arguments, the function entered session "
                f"{', '.join(resumed.sessions)}, not {session_id}: take the session's run id "
                "from the function's arguments, so that running it again resumes it"
            )
    if problems:
        raise RuntimeError("\n".join(problems))


def _calls(
    state: SagaState, history: Sequence[HistoryEvent]
) -> dict[tuple[str, str], OperationState]:
    """A session's operations by (call label, kind)."""
    labels = _CallLabels()
    for e in history:
        if e.step is not None and e.kind is not None:
            labels.label(e.step)
    return {(labels.label(op.step), str(op.kind)): op for op in state.operations}


def _session_invariants(
    url: str,
    baseline: CrashRun,
    runs: Sequence[CrashRun],
    raised: Mapping[str, str | None],
    effects: EffectCounter | None,
) -> InvariantReport:
    """`check_invariants` on every run's session, and each run's calls against the
    baseline's; every violation is named by its run."""
    report = InvariantReport()
    count = None if effects is None else effects if callable(effects) else effects.get
    with Orchestrator(url, auto_migrate=False, pool_size=2) as orch:
        base_calls = _calls(orch.get(baseline.saga_id), orch.history(baseline.saga_id))
        for run in [baseline, *runs]:
            name = run.fault or "baseline"
            state = orch.get(run.saga_id)
            history = orch.history(state.id)
            report.sagas += 1
            report.statuses[str(state.status)] += 1
            if str(state.status) == "needs_review":
                report.parked[state.id] = state.error or ""
            problems = _saga_problems(state, history, effects, {})
            if str(state.status) not in SETTLED and raised.get(name):
                problems.append(
                    f"the session function raised {raised[name]}, which leaves a session "
                    "open: only a PermanentError (or run.fail) leaving the block ends it"
                )
            if run is not baseline and str(state.status) == baseline.status:
                problems.extend(_call_problems(base_calls, _calls(state, history), count))
            report.violations.extend(f"{name}: session {state.id}: {p}" for p in problems)
    return report


def _call_problems(
    base: Mapping[tuple[str, str], OperationState],
    calls: Mapping[tuple[str, str], OperationState],
    count: Callable[[str], int | None] | None,
) -> list[str]:
    """What a run that ended as the baseline did lost or added, call by call."""
    problems: list[str] = []
    for (label, kind), expected in base.items():
        what = f"call {label!r}" if kind == "action" else f"the compensation of call {label!r}"
        op = calls.get((label, kind))
        if op is None:
            problems.append(f"{what} is missing, though the run without faults made it")
            continue
        if op.status != expected.status:
            problems.append(
                f"{what} ended {op.status}, in the run without faults {expected.status}"
            )
        had_effect = count is not None and (count(expected.idempotency_key) or 0) > 0
        if had_effect and str(op.status) == "succeeded":
            assert count is not None
            if not (count(op.idempotency_key) or 0):
                problems.append(
                    f"{what} succeeded, but no effect was performed under its key "
                    f"{op.idempotency_key} (the run without faults had one): it was lost"
                )
    for label, kind in calls.keys() - base.keys():
        what = f"call {label!r}" if kind == "action" else f"the compensation of call {label!r}"
        problems.append(
            f"{what} was not made by the run without faults: did a call's arguments change "
            "when the function ran again (a fresh id, a timestamp), so that it ran under "
            "another key?"
        )
    return problems


def _session_child(
    env: Mapping[str, str], request: Mapping[str, Any], *, timeout: float
) -> _SessionChild:
    out = _child(env, request, timeout=timeout, collect=("entered",))
    sessions: list[str] = []
    for session_id in out.get("entered", []):
        if session_id not in sessions:
            sessions.append(session_id)
    raised = out.get("raised")
    return _SessionChild(
        code=out["code"],
        output=out["output"],
        sessions=sessions,
        ended="returned" in out or raised is not None,
        raised=scrub(raised, env.get("SAGA_DATABASE_URL")) if raised else None,
        stuck=out.get("stuck"),
    )


def _child_env(url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != faults.ENV_FAULT}
    env["SAGA_DATABASE_URL"] = url
    # The child imports the app from wherever this process could.
    paths = [p for p in sys.path if p and Path(p).is_dir()]
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _child(
    env: Mapping[str, str],
    request: Mapping[str, Any],
    *,
    timeout: float,
    collect: Sequence[str] = (),
) -> dict[str, Any]:
    """Run `python -m saga.testing REQUEST` and gather what it said: its exit code, its
    output, and the fields of its messages (the last value of each, or every value, in
    order, of a field named in `collect`)."""
    proc = subprocess.run(
        [sys.executable, "-m", "saga.testing", json.dumps(request)],
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    output = scrub(proc.stdout + proc.stderr, env.get("SAGA_DATABASE_URL"))
    out: dict[str, Any] = {"code": proc.returncode, "output": output}
    for line in proc.stdout.splitlines():
        if line.startswith(_MARK):
            message = json.loads(line[len(_MARK) :])
            for name, value in message.items():
                if name in collect:
                    out.setdefault(name, []).append(value)
                else:
                    out[name] = value
    return out


# ----- the child process --------------------------------------------------------------------


def _say(**message: Any) -> None:
    print(_MARK + json.dumps(message), flush=True)


def _definition(app: Orchestrator | AsyncOrchestrator, spec: str) -> Saga[Any]:
    name, _, version = spec.partition(":")
    candidates = [s for s in app.registered() if s.name == name]
    if version:
        candidates = [s for s in candidates if s.version == int(version)]
    if not candidates:
        raise LookupError(f"the app registers no saga {spec!r}")
    return max(candidates, key=lambda s: s.version)


def _child_main(request: Mapping[str, Any]) -> int:
    if request["op"] == "session":
        return _session_child_main(request)
    app = load_app(request["app"], None)  # as `saga worker --app` finds it
    url = os.environ["SAGA_DATABASE_URL"]
    lease_seconds = float(request["lease_seconds"])
    if isinstance(app, AsyncOrchestrator):
        # The async door: the saga is driven by an AsyncOrchestrator on an event loop.
        return asyncio.run(_async_child_main(app, request, url, lease_seconds))
    with Orchestrator(url, sagas=app.registered(), lease_seconds=lease_seconds) as orch:
        if request["op"] == "run":
            definition = _definition(app, request["saga"])
            handle = orch.start(definition, request["input"])
            _say(started=handle.id)
            state = orch.run(handle.id)
            _say(finished=str(state.status))
            return 0
        deadline = time.monotonic() + float(request["deadline_seconds"])
        for saga_id in request["ids"]:
            while True:
                state = orch.run(saga_id)
                if not state.status.is_runnable:
                    break
                if time.monotonic() > deadline:
                    _say(stuck=saga_id, status=str(state.status))
                    return 1
                time.sleep(_lease_wait(state))
        _say(resumed=len(request["ids"]))
    return 0


async def _async_child_main(
    app: AsyncOrchestrator, request: Mapping[str, Any], url: str, lease_seconds: float
) -> int:
    async with AsyncOrchestrator(url, sagas=app.registered(), lease_seconds=lease_seconds) as orch:
        if request["op"] == "run":
            definition = _definition(app, request["saga"])
            handle = await orch.start(definition, request["input"])
            _say(started=handle.id)
            state = await orch.run(handle.id)
            _say(finished=str(state.status))
            return 0
        deadline = time.monotonic() + float(request["deadline_seconds"])
        for saga_id in request["ids"]:
            while True:
                state = await orch.run(saga_id)
                if not state.status.is_runnable:
                    break
                if time.monotonic() > deadline:
                    _say(stuck=saga_id, status=str(state.status))
                    return 1
                await asyncio.sleep(_lease_wait(state))
        _say(resumed=len(request["ids"]))
    return 0


def _session_child_main(request: Mapping[str, Any]) -> int:
    """Call the session function once (armed with `request["fault"]`, if any); waits out
    `SessionBusy` while a killed run's lease lasts. Says which sessions it entered, and
    whether the function returned or what it raised."""
    app = load_app(request["app"], None)
    lease_seconds = float(request["lease_seconds"])
    # Leases as short as those of saga runs, so that a killed run is resumed quickly.
    app.lease_seconds, app.heartbeat_seconds = lease_seconds, lease_seconds / 3.0
    fn = _import_function(request["function"])
    _report_session_entries()
    if request["fault"]:
        faults.arm(_CallFault(request["fault"]))
    args, kwargs = list(request["args"]), dict(request["kwargs"])
    deadline = time.monotonic() + float(request["deadline_seconds"])
    if is_async(fn):
        return asyncio.run(_call_async_session(app, fn, args, kwargs, deadline))
    try:
        while (code := _ended(_raised_by(fn, args, kwargs), deadline)) is None:
            time.sleep(_BUSY_RETRY_SECONDS)
        return code
    finally:
        if isinstance(app, Orchestrator):
            app.close()


async def _call_async_session(
    app: Orchestrator | AsyncOrchestrator,
    fn: Callable[..., Any],
    args: list[Any],
    kwargs: dict[str, Any],
    deadline: float,
) -> int:
    try:
        while (code := _ended(await _araised_by(fn, args, kwargs), deadline)) is None:
            await asyncio.sleep(_BUSY_RETRY_SECONDS)
        return code
    finally:
        if isinstance(app, AsyncOrchestrator):
            await app.close()


def _raised_by(fn: Callable[..., Any], args: list[Any], kwargs: dict[str, Any]) -> Exception | None:
    """What `fn(*args, **kwargs)` raised; None when it returned."""
    try:
        fn(*args, **kwargs)
    except Exception as exc:
        return exc
    return None


async def _araised_by(
    fn: Callable[..., Any], args: list[Any], kwargs: dict[str, Any]
) -> Exception | None:
    """What `await fn(*args, **kwargs)` raised; None when it returned."""
    try:
        await fn(*args, **kwargs)
    except Exception as exc:
        return exc
    return None


def _ended(raised: Exception | None, deadline: float) -> int | None:
    """The child's exit code after one call of the session function, which returned
    (`raised` is None) or raised, said on its output; None while the session is busy (a
    killed run's lease lasts) and the deadline has not passed: call it again."""
    if isinstance(raised, SessionBusy):
        if time.monotonic() > deadline:
            _say(stuck=str(raised))
            return 1
        return None
    if raised is None:
        _say(returned=True)
    else:
        _say_raised(raised)
    return 0


def _say_raised(exc: Exception) -> None:
    _say(raised=f"{type(exc).__name__}: {exc}")
    if not isinstance(exc, PermanentError | SessionParked):
        # Not how a session ends: the traceback goes with the child's output.
        traceback.print_exception(exc, file=sys.stderr)


def _import_function(spec: str) -> Callable[..., Any]:
    """The function `MODULE:FUNCTION` names (its module imported from the working
    directory or PYTHONPATH, as the app is)."""
    module_name, _, attr = spec.partition(":")
    found: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        if not hasattr(found, part):
            raise LookupError(f"session {spec!r}: module {module_name!r} has no {attr!r}")
        found = getattr(found, part)
    if not callable(found):
        raise TypeError(f"session {spec!r} is a {type(found).__name__}, not a function")
    return cast("Callable[..., Any]", found)


def _report_session_entries() -> None:
    """Say the id of each session this process enters, as soon as it has entered it
    (before any call: a kill loses nothing of it)."""
    enter, aenter = Session.__enter__, AsyncSession.__aenter__

    def entered(self: Session) -> Session:
        opened = enter(self)
        _say(entered=opened.id)
        return opened

    async def aentered(self: AsyncSession) -> AsyncSession:
        opened = await aenter(self)
        _say(entered=opened.id)
        return opened

    Session.__enter__ = entered  # type: ignore[method-assign]
    AsyncSession.__aenter__ = aentered  # type: ignore[method-assign]


def _lease_wait(state: SagaState) -> float:
    """How long to wait before driving a saga again that is leased, most likely by a
    killed child until its lease expires (by the database clock)."""
    expires = state.lease_expires_at
    wait = 0.05
    if expires is not None:
        wait = max(wait, min(1.0, (expires - datetime.now(expires.tzinfo)).total_seconds()))
    return wait


def _child_entry(argv: Sequence[str]) -> int:
    import logging

    # Keep the library's logs quiet in the children (errors only, on stderr); failures
    # show in the exit code.
    logging.getLogger("saga").setLevel(logging.ERROR)
    return _child_main(json.loads(argv[0]))


if __name__ == "__main__":
    sys.exit(_child_entry(sys.argv[1:]))
