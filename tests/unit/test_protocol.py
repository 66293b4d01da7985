"""The step protocol's state machine, decided on in-memory snapshots (no database)."""

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pydantic import BaseModel

from saga import RetryPolicy, Saga, StepStateError
from saga._core import inputs
from saga._core import requests as interventions
from saga._core.planner import (
    AskReconcile,
    Event,
    Invoke,
    Next,
    OpRow,
    Planner,
    SagaRow,
    Sleep,
    Stop,
    Yield,
    action_request_hash,
    compensation_request_hash,
    new_action_rows,
)
from saga.keys import operation_key
from saga.state import OperationStatus, SagaStatus

# A step call that takes this long (seconds) is visibly later than the attempt's start.
SLOW_CALL_SECONDS = 0.05


class Renewal(BaseModel):
    tenant_id: str
    renewal_event_id: str
    amount_cents: int
    requested_at: str | None = None


INPUT = Renewal(
    tenant_id="acme", renewal_event_id="evt-1", amount_cents=1299, requested_at="2024-05-01"
)


@dataclass(frozen=True)
class Spec:
    """How one step of a test saga is declared."""

    name: str
    compensate: bool = True
    idempotent: bool = False
    reconcile: bool = False
    pivot: bool = False
    max_attempts: int = 3
    comp_idempotent: bool = False
    comp_reconcile: bool = False
    comp_max_attempts: int = 3


def _noop(*args: Any) -> None:
    return None


def _saga(*specs: Spec) -> Saga[Renewal]:
    saga: Saga[Renewal] = Saga(
        "renewal",
        version=2,
        input=Renewal,
        key=lambda r: r.renewal_event_id,
        tenant=lambda r: r.tenant_id,
        volatile=("requested_at",),
    )
    for spec in specs:
        step = saga.step(
            name=spec.name,
            retry=RetryPolicy(max_attempts=spec.max_attempts),
            idempotent=spec.idempotent,
            pivot=spec.pivot,
        )(_noop)
        if spec.reconcile:
            step.reconcile(_noop)
        if spec.compensate:
            comp = step.compensation(
                retry=RetryPolicy(max_attempts=spec.comp_max_attempts),
                idempotent=spec.comp_idempotent,
            )(_noop)
            if spec.comp_reconcile:
                comp.reconcile(_noop)
    return saga


def _planner(*specs: Spec) -> Planner:
    saga = _saga(*specs)
    tenant, key = saga.identity(INPUT)
    row = SagaRow(
        id="saga-1",
        name=saga.name,
        version=saga.version,
        tenant_id=tenant,
        key=key,
        input=INPUT.model_dump(mode="json"),
        input_hash=saga.input_hash(INPUT),
        status=SagaStatus.PENDING,
        error=None,
        direction="forward",
        fence=1,
        run_after=None,
    )
    ops = new_action_rows(saga, tenant, key, saga.business_fields(INPUT))
    return Planner(saga, row, ops, now=datetime.now().astimezone())


def _invoke(planner: Planner, now: datetime | None = None) -> OpRow:
    nxt = planner.advance(now)
    assert isinstance(nxt, Invoke), nxt
    return nxt.op


def _succeed(planner: Planner, result: Any = None) -> OpRow:
    op = _invoke(planner)
    planner.record_success(op, result)
    return op


def _names(planner: Planner) -> list[str]:
    return [e.event for e in planner.take_events()]


def _park_unknown(planner: Planner) -> OpRow:
    """Start the next operation and leave it `running`, as a crashed worker would."""
    return _invoke(planner)


def _ops(planner: Planner, kind: str) -> list[OpRow]:
    return [o for o in planner.ops if o.kind == kind]


BUSINESS = {"tenant_id": "acme", "renewal_event_id": "evt-1", "amount_cents": 1299}


# ----- snapshots ------------------------------------------------------------------------


def test_new_action_rows_are_pending_with_stable_keys_and_hashes() -> None:
    """Each step gets one pending row: key, request hash and ceiling fixed at creation."""
    saga = _saga(Spec("reserve", max_attempts=4), Spec("charge", max_attempts=1))
    rows = new_action_rows(saga, "acme", "evt-1", BUSINESS)
    assert [(r.step, r.kind, r.position) for r in rows] == [
        ("reserve", "action", 0),
        ("charge", "action", 1),
    ]
    assert all(r.status == OperationStatus.PENDING and r.attempts == 0 for r in rows)
    assert [r.max_attempts for r in rows] == [4, 1]
    assert [r.idempotency_key for r in rows] == [
        "renewal:v2:acme:evt-1:reserve",
        "renewal:v2:acme:evt-1:charge",
    ]
    assert rows[0].request_hash == action_request_hash("reserve", BUSINESS)
    assert rows[0].request_hash != rows[1].request_hash
    assert len(rows[0].request_hash) == 64


def test_action_hash_ignores_volatile_input() -> None:
    """Rows built from inputs differing only in a volatile field have the same hashes."""
    saga = _saga(Spec("reserve"))
    later = INPUT.model_copy(update={"requested_at": "2030-01-01"})
    first = new_action_rows(saga, "acme", "evt-1", saga.business_fields(INPUT))
    again = new_action_rows(saga, "acme", "evt-1", saga.business_fields(later))
    assert [r.request_hash for r in first] == [r.request_hash for r in again]


# ----- the happy path -------------------------------------------------------------------


def test_fresh_saga_invokes_its_first_step() -> None:
    """advance() on a new saga: status running, first step running with attempt 1."""
    planner = _planner(Spec("reserve"), Spec("charge"))
    op = _invoke(planner)
    assert op.step == "reserve"
    assert op.kind == "action"
    assert op.attempts == 1
    assert op.status == OperationStatus.RUNNING
    assert op.started_at is not None
    assert planner.saga.status == SagaStatus.RUNNING
    write = planner.write(None, owner=None)
    assert write.new_ops == () and write.changed_ops == (op,)  # its rows are as stored
    assert list(write.events) == [Event("attempt_started", "reserve", "action", 1, {})]


def test_success_moves_to_the_next_step() -> None:
    """After a success the next advance() starts the following step."""
    planner = _planner(Spec("reserve"), Spec("charge"))
    first = _succeed(planner, {"reservation": "r-1"})
    assert first.status == OperationStatus.SUCCEEDED
    assert first.result == {"reservation": "r-1"}
    second = _invoke(planner)
    assert second.step == "charge"
    assert second.attempts == 1
    assert _names(planner) == ["attempt_started", "attempt_succeeded", "attempt_started"]
    assert planner.results() == {"reserve": {"reservation": "r-1"}}


def test_all_steps_succeeded_completes_the_saga() -> None:
    """When every step succeeded, advance() returns Stop(completed)."""
    planner = _planner(Spec("reserve"), Spec("charge"))
    _succeed(planner, 1)
    _succeed(planner, 2)
    planner.take_events()
    assert planner.advance() == Stop(SagaStatus.COMPLETED)
    assert planner.saga.status == SagaStatus.COMPLETED
    assert planner.saga.error is None
    assert _names(planner) == ["saga_completed"]


@pytest.mark.parametrize(
    "status", [SagaStatus.COMPLETED, SagaStatus.COMPENSATED, SagaStatus.NEEDS_REVIEW]
)
def test_terminal_or_parked_saga_does_nothing(status: SagaStatus) -> None:
    """advance() on a completed, compensated or parked saga stops and records nothing."""
    planner = _planner(Spec("reserve"))
    planner.saga.status = status
    assert planner.advance() == Stop(status)
    assert planner.take_events() == []
    assert planner.ops[0].status == OperationStatus.PENDING


def test_take_events_returns_each_event_once() -> None:
    """take_events() hands over what happened since the last call, then starts empty."""
    planner = _planner(Spec("reserve"))
    _invoke(planner)
    assert len(planner.take_events()) == 1
    assert planner.take_events() == []


# ----- retries --------------------------------------------------------------------------


def test_transient_failure_below_ceiling_waits_then_retries_with_the_same_key() -> None:
    """A retryable failure: pending until now+delay (Sleep), then attempt 2 with the same key."""
    planner = _planner(Spec("charge", max_attempts=3))
    start = datetime.now().astimezone()
    op = _invoke(planner, start)
    key = op.idempotency_key
    planner.take_events()
    planner.record_failure(op, "TransientError: gateway busy", retryable=True, delay=5.0)
    assert op.status == OperationStatus.PENDING
    assert op.error == "TransientError: gateway busy"
    assert op.next_attempt_at is not None
    assert op.next_attempt_at >= start + timedelta(seconds=5)
    events = planner.take_events()
    assert [e.event for e in events] == ["attempt_failed"]
    assert events[0].detail == {
        "error": "TransientError: gateway busy",
        "retryable": True,
        "retry_in_seconds": 5.0,
    }
    assert events[0].attempt == 1

    nxt = planner.advance(start + timedelta(seconds=1))
    assert nxt == Sleep(op.next_attempt_at)
    assert planner.take_events() == []
    assert planner.saga.status == SagaStatus.RUNNING

    again = _invoke(planner, op.next_attempt_at + timedelta(seconds=1))
    assert again is op
    assert again.attempts == 2
    assert again.idempotency_key == key
    assert again.next_attempt_at is None


def test_transient_failure_at_ceiling_fails_and_compensates() -> None:
    """The last allowed attempt failing transiently fails the operation; compensation starts."""
    planner = _planner(Spec("reserve"), Spec("charge", max_attempts=2))
    _succeed(planner, {"r": 1})
    now = datetime.now().astimezone()
    op = _invoke(planner, now)
    planner.record_failure(op, "TimeoutError: slow", retryable=True, delay=0.0)
    op = _invoke(planner, now + timedelta(seconds=1))
    assert op.attempts == 2
    planner.take_events()
    planner.record_failure(op, "TimeoutError: slow", retryable=True, delay=0.0)
    assert op.status == OperationStatus.FAILED
    assert op.error is not None
    assert "ceiling of 2 attempts" in op.error
    assert "TimeoutError: slow" in op.error
    comp = _invoke(planner)
    assert (comp.step, comp.kind) == ("reserve", "compensation")
    assert planner.saga.status == SagaStatus.COMPENSATING
    assert planner.saga.error is not None and "charge" in planner.saga.error
    events = planner.take_events()
    assert [e.event for e in events] == [
        "attempt_failed",
        "compensation_started",
        "attempt_started",
    ]
    assert events[0].detail["retry_in_seconds"] is None


def test_permanent_failure_fails_at_once() -> None:
    """A non-retryable failure on attempt 1 of 3 fails the operation without a retry."""
    planner = _planner(Spec("reserve"), Spec("charge", max_attempts=3))
    _succeed(planner)
    op = _invoke(planner)
    planner.record_failure(op, "PermanentError: card declined", retryable=False, delay=0.0)
    assert op.status == OperationStatus.FAILED
    assert op.attempts == 1
    assert op.error == "PermanentError: card declined"
    events = planner.take_events()
    assert events[-1].event == "attempt_failed"
    assert events[-1].detail["retryable"] is False
    nxt = planner.advance()
    assert isinstance(nxt, Invoke)
    assert nxt.op.kind == "compensation"


def test_finished_at_is_when_the_outcome_was_recorded() -> None:
    """An attempt's finished_at is the time its outcome came in, not when it started:
    time is an input, so the timestamps are exact and no test sleeps."""
    planner = _planner(Spec("reserve"))
    started_at = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
    op = _invoke(planner, started_at)
    returned_at = started_at + timedelta(seconds=SLOW_CALL_SECONDS)
    inputs.apply(planner, inputs.Returned(op.step, op.kind, {"ok": True}), returned_at)
    assert op.started_at == started_at
    assert op.finished_at == returned_at


def test_retry_delay_counts_from_the_failure() -> None:
    """The backoff starts when the failure is recorded, not when the attempt started."""
    planner = _planner(Spec("charge", max_attempts=3))
    started_at = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
    op = _invoke(planner, started_at)
    failed_at = started_at + timedelta(seconds=SLOW_CALL_SECONDS)
    delay = SLOW_CALL_SECONDS / 2
    failure = inputs.Raised(op.step, op.kind, "TransientError: busy", "retry", delay)
    inputs.apply(planner, failure, failed_at)
    assert op.next_attempt_at == failed_at + timedelta(seconds=delay)
    assert planner.advance(failed_at) == Sleep(failed_at + timedelta(seconds=delay))


# ----- compensation ---------------------------------------------------------------------


def test_compensations_run_in_reverse_for_succeeded_steps_that_have_one() -> None:
    """On failure, compensations of succeeded steps run last-first; others are skipped."""
    planner = _planner(
        Spec("reserve", comp_max_attempts=7),
        Spec("notify", compensate=False),
        Spec("charge"),
        Spec("ship"),  # fails: its own compensation must never run
    )
    _succeed(planner, {"reservation": "r-1"})
    _succeed(planner, None)
    _succeed(planner, {"charge": "ch_1"})
    ship = _invoke(planner)
    planner.record_failure(ship, "PermanentError: no carrier", retryable=False, delay=0.0)

    ran: list[OpRow] = []
    while True:
        nxt = planner.advance()
        if isinstance(nxt, Stop):
            break
        assert isinstance(nxt, Invoke)
        ran.append(nxt.op)
        planner.record_success(nxt.op, None)
    assert nxt == Stop(SagaStatus.COMPENSATED)
    assert [(o.step, o.kind) for o in ran] == [
        ("charge", "compensation"),
        ("reserve", "compensation"),
    ]
    assert [o.step for o in _ops(planner, "compensation")] == ["charge", "reserve"]
    charge_comp, reserve_comp = ran
    assert charge_comp.idempotency_key == "renewal:v2:acme:evt-1:charge:compensate"
    assert charge_comp.request_hash == compensation_request_hash(
        "charge", BUSINESS, {"charge": "ch_1"}
    )
    assert reserve_comp.max_attempts == 7
    assert planner.saga.status == SagaStatus.COMPENSATED
    names = _names(planner)
    assert names.count("compensation_started") == 1
    assert names[-1] == "saga_compensated"


def test_compensation_events_name_the_compensated_step() -> None:
    """Compensation attempt events carry kind='compensation' and the step's name."""
    planner = _planner(Spec("reserve"), Spec("charge"))
    _succeed(planner)
    op = _invoke(planner)
    planner.record_failure(op, "boom", retryable=False, delay=0.0)
    planner.take_events()
    comp = _invoke(planner)
    planner.record_success(comp, None)
    events = planner.take_events()
    assert [(e.event, e.step, e.kind, e.attempt) for e in events] == [
        ("compensation_started", None, None, None),
        ("attempt_started", "reserve", "compensation", 1),
        ("attempt_succeeded", "reserve", "compensation", 1),
    ]
    assert events[0].detail["reason"].startswith("step 'charge' failed")


def test_failure_of_the_first_step_compensates_nothing() -> None:
    """If nothing succeeded, the saga is compensated at once with no compensation rows."""
    planner = _planner(Spec("reserve"), Spec("charge"))
    op = _invoke(planner)
    planner.record_failure(op, "boom", retryable=False, delay=0.0)
    planner.take_events()
    assert planner.advance() == Stop(SagaStatus.COMPENSATED)
    assert _ops(planner, "compensation") == []
    assert _names(planner) == ["compensation_started", "saga_compensated"]


def test_failed_compensation_parks_with_the_reason() -> None:
    """A compensation failing permanently parks the saga in needs_review, saying why."""
    planner = _planner(Spec("reserve"), Spec("charge"))
    _succeed(planner)
    op = _invoke(planner)
    planner.record_failure(op, "card declined", retryable=False, delay=0.0)
    comp = _invoke(planner)
    planner.take_events()
    planner.record_failure(comp, "ValueError: warehouse gone", retryable=False, delay=0.0)
    assert planner.advance() == Stop(SagaStatus.NEEDS_REVIEW)
    assert comp.status == OperationStatus.FAILED
    error = planner.saga.error
    assert error is not None
    assert "compensation of step 'reserve'" in error
    assert "warehouse gone" in error
    assert _names(planner) == ["attempt_failed", "saga_parked"]


def test_compensation_exhausting_its_ceiling_parks() -> None:
    """Compensations have their own ceiling; exhausting it parks the saga, nothing dropped."""
    planner = _planner(Spec("reserve", comp_max_attempts=2), Spec("charge"))
    _succeed(planner)
    op = _invoke(planner)
    planner.record_failure(op, "declined", retryable=False, delay=0.0)
    now = datetime.now().astimezone()
    comp = _invoke(planner, now)
    planner.record_failure(comp, "TransientError: busy", retryable=True, delay=10.0)
    assert isinstance(planner.advance(now), Sleep)
    comp = _invoke(planner, now + timedelta(seconds=60))
    assert comp.attempts == 2
    planner.record_failure(comp, "TransientError: busy", retryable=True, delay=10.0)
    assert planner.advance() == Stop(SagaStatus.NEEDS_REVIEW)
    assert comp.status == OperationStatus.FAILED
    assert planner.saga.error is not None and "ceiling of 2 attempts" in planner.saga.error


def _parked_at_compensation(*, retryable: bool) -> tuple[Planner, OpRow]:
    """reserve and charge succeeded, ship failed; charge's compensation failed (at its
    ceiling of 2 when `retryable`, else permanently at its first attempt)."""
    planner = _planner(
        Spec("reserve"), Spec("charge", comp_max_attempts=2, comp_idempotent=True), Spec("ship")
    )
    _succeed(planner)
    _succeed(planner)
    planner.record_failure(_invoke(planner), "no carrier", retryable=False, delay=0.0)
    for _ in range(2 if retryable else 1):
        comp = _invoke(planner, datetime.now().astimezone() + timedelta(hours=1))
        planner.record_failure(comp, "TransientError: down", retryable=retryable, delay=0.0)
    assert planner.advance() == Stop(SagaStatus.NEEDS_REVIEW)
    planner.take_events()
    return planner, comp


def test_compensation_request_gives_a_compensation_failed_at_its_ceiling_a_fresh_budget() -> None:
    """An explicit request raises the ceiling by the policy's max_attempts (attempts kept),
    records ceiling_raised with the actor, and the plan lists exactly what then runs."""
    planner, comp = _parked_at_compensation(retryable=True)
    assert planner.advance() == Stop(SagaStatus.NEEDS_REVIEW)  # the runtime never raises it
    plan, stop = interventions.compensation_plan(planner, include_unknown=False)
    assert stop is None
    assert [step for step, _ in plan] == ["charge", "reserve"]

    interventions.request_compensation(
        planner, include_unknown=False, actor="ops@acme", now=planner.now
    )

    assert (comp.status, comp.attempts, comp.max_attempts) == (OperationStatus.PENDING, 2, 4)
    raised = [e for e in planner.take_events() if e.event == "ceiling_raised"]
    assert [(e.step, e.kind, e.detail["actor"]) for e in raised] == [
        ("charge", "compensation", "ops@acme")
    ]
    ran: list[tuple[str, str]] = []
    while not isinstance(nxt := planner.advance(), Stop):
        assert isinstance(nxt, Invoke)
        ran.append((nxt.op.step, nxt.op.idempotency_key))
        planner.record_success(nxt.op, None)
    assert nxt == Stop(SagaStatus.COMPENSATED)
    assert ran == plan


def test_compensation_request_leaves_a_permanently_failed_compensation_to_a_human() -> None:
    """A compensation that failed below its ceiling failed permanently: no fresh budget,
    and the plan says it would stop there and what to do instead."""
    planner, comp = _parked_at_compensation(retryable=False)
    plan, stop = interventions.compensation_plan(planner, include_unknown=False)
    assert plan == [] and stop is not None
    assert "failed permanently" in stop and "resolve" in stop
    interventions.request_compensation(planner, include_unknown=False, actor="ops", now=planner.now)
    assert "ceiling_raised" not in _names(planner)
    assert planner.advance() == Stop(SagaStatus.NEEDS_REVIEW)
    assert (comp.status, comp.max_attempts) == (OperationStatus.FAILED, 2)


# ----- pivot ----------------------------------------------------------------------------


def test_failure_after_a_succeeded_pivot_parks_without_compensating() -> None:
    """After the point of no return a permanent failure parks; no compensation row appears."""
    planner = _planner(Spec("reserve"), Spec("charge", pivot=True), Spec("ship"))
    _succeed(planner)
    _succeed(planner)
    op = _invoke(planner)
    planner.take_events()
    planner.record_failure(op, "PermanentError: no carrier", retryable=False, delay=0.0)
    assert planner.advance() == Stop(SagaStatus.NEEDS_REVIEW)
    assert _ops(planner, "compensation") == []
    error = planner.saga.error
    assert error is not None and "pivot" in error and "'charge'" in error and "'ship'" in error
    assert planner.saga.direction == "forward"
    assert _names(planner) == ["attempt_failed", "saga_parked"]


def test_failure_of_the_pivot_itself_compensates() -> None:
    """If the pivot step fails, the point of no return was not passed: compensate."""
    planner = _planner(Spec("reserve"), Spec("charge", pivot=True))
    _succeed(planner)
    op = _invoke(planner)
    planner.record_failure(op, "declined", retryable=False, delay=0.0)
    comp = _invoke(planner)
    assert (comp.step, comp.kind) == ("reserve", "compensation")
    assert planner.saga.status == SagaStatus.COMPENSATING


# ----- unknown outcomes -----------------------------------------------------------------


def test_running_operation_becomes_unknown_at_advance() -> None:
    """An attempt still running when a new owner decides is unknown; the attempt counts."""
    planner = _planner(Spec("charge", reconcile=True))
    op = _park_unknown(planner)
    planner.take_events()
    nxt = planner.advance()
    assert op.status == OperationStatus.UNKNOWN
    assert op.attempts == 1
    assert op.error is not None and "attempt 1" in op.error
    assert nxt == AskReconcile(op)
    events = planner.take_events()
    assert [e.event for e in events] == ["outcome_unknown"]
    assert events[0].detail["reason"] == op.error


def test_unknown_idempotent_operation_is_retried_with_the_same_key() -> None:
    """Without a reconcile hook, an idempotent unknown is retried: attempt+1, same key."""
    planner = _planner(Spec("charge", idempotent=True))
    op = _park_unknown(planner)
    key = op.idempotency_key
    planner.take_events()
    again = _invoke(planner)
    assert again is op
    assert again.attempts == 2
    assert again.idempotency_key == key
    assert again.status == OperationStatus.RUNNING
    assert _names(planner) == ["outcome_unknown", "unknown_retried", "attempt_started"]


def test_unknown_without_reconcile_or_idempotence_parks() -> None:
    """A non-idempotent unknown without a reconcile hook parks; it is never retried."""
    planner = _planner(Spec("charge"))
    op = _park_unknown(planner)
    planner.take_events()
    assert planner.advance() == Stop(SagaStatus.NEEDS_REVIEW)
    assert op.status == OperationStatus.UNKNOWN
    assert op.attempts == 1
    assert planner.saga.error is not None and "'charge'" in planner.saga.error
    assert _names(planner) == ["outcome_unknown", "saga_parked"]


def test_reconcile_takes_precedence_over_idempotence() -> None:
    """With both a reconcile hook and idempotent=True, the provider is asked first."""
    planner = _planner(Spec("charge", idempotent=True, reconcile=True))
    op = _park_unknown(planner)
    assert planner.advance() == AskReconcile(op)
    assert op.attempts == 1


def test_unknown_at_ceiling_parks_and_never_fails() -> None:
    """An idempotent unknown at its ceiling parks in needs_review; it never turns failed."""
    planner = _planner(Spec("reserve"), Spec("charge", idempotent=True, max_attempts=1))
    _succeed(planner)
    op = _park_unknown(planner)
    planner.take_events()
    assert planner.advance() == Stop(SagaStatus.NEEDS_REVIEW)
    assert op.status == OperationStatus.UNKNOWN
    assert _ops(planner, "compensation") == []
    assert planner.saga.error is not None and "ceiling" in planner.saga.error
    assert _names(planner) == ["outcome_unknown", "saga_parked"]


def _unknown_idempotent_charge(max_attempts: int = 3) -> tuple[Planner, OpRow]:
    """reserve succeeded; the idempotent charge's first attempt was left running (killed)."""
    planner = _planner(Spec("reserve"), Spec("charge", idempotent=True, max_attempts=max_attempts))
    _succeed(planner, {"reservation": "r-1"})
    op = _park_unknown(planner)
    planner.take_events()
    return planner, op


def _compensate_all(planner: Planner) -> tuple[Next, list[tuple[str, str]]]:
    ran: list[tuple[str, str]] = []
    while not isinstance(nxt := planner.advance(), Stop):
        assert isinstance(nxt, Invoke), nxt
        ran.append((nxt.op.step, nxt.op.kind))
        planner.record_success(nxt.op, None)
    return nxt, ran


def test_unknown_stays_unknown_while_its_retry_is_blocked_by_a_shutdown() -> None:
    """A worker that may not call yields with the idempotent unknown still unknown (not
    pending), and no retry is announced before one starts."""
    planner, op = _unknown_idempotent_charge()
    assert planner.advance(may_call=False) == Yield()
    assert op.status == OperationStatus.UNKNOWN
    assert op.attempts == 1
    assert op.retrying_unknown
    assert _names(planner) == ["outcome_unknown"]
    assert interventions.compensation_plan(planner, include_unknown=False)[1] is not None
    assert _invoke(planner) is op and op.attempts == 2
    assert _names(planner) == ["unknown_retried", "attempt_started"]


def test_unknown_blocked_by_a_saga_ceiling_is_compensated_as_unknown() -> None:
    """The retry blocked by max_operations parks with the step unknown: compensate stops
    there, and with include_unknown compensates it before the earlier step."""
    planner, op = _unknown_idempotent_charge()
    planner.saga.max_operations = 2
    assert planner.advance() == Stop(SagaStatus.NEEDS_REVIEW)
    assert op.status == OperationStatus.UNKNOWN and op.attempts == 1
    assert planner.blocking_operation() is op
    runs, stop = interventions.compensation_plan(planner, include_unknown=False)
    assert runs == [] and stop is not None and "'charge'" in stop
    runs, stop = interventions.compensation_plan(planner, include_unknown=True)
    assert [step for step, _ in runs] == ["charge", "reserve"] and stop is None

    interventions.request_compensation(planner, include_unknown=False, actor="ops", now=planner.now)
    assert planner.advance() == Stop(SagaStatus.NEEDS_REVIEW)
    assert _ops(planner, "compensation") == []

    planner.saga.max_operations = None
    interventions.request_compensation(planner, include_unknown=True, actor="ops", now=planner.now)
    nxt, ran = _compensate_all(planner)
    assert nxt == Stop(SagaStatus.COMPENSATED)
    assert ran == [("charge", "compensation"), ("reserve", "compensation")]


def test_cancel_with_include_unknown_undoes_a_blocked_unknown_retry() -> None:
    """cancel() of a saga parked before an unknown step's retry compensates that step too."""
    planner, _op = _unknown_idempotent_charge()
    planner.saga.max_operations = 2
    assert planner.advance() == Stop(SagaStatus.NEEDS_REVIEW)
    planner.saga.max_operations = None
    assert interventions.request_cancel(
        planner, reason="customer left", actor="ops", include_unknown=True, now=planner.now
    )
    nxt, ran = _compensate_all(planner)
    assert nxt == Stop(SagaStatus.COMPENSATED)
    assert ran == [("charge", "compensation"), ("reserve", "compensation")]


def test_a_pending_row_left_retrying_unknown_is_read_as_unknown() -> None:
    """A row an earlier release reset to pending before its retry started is unknown."""
    planner, op = _unknown_idempotent_charge()
    op.status, op.retrying_unknown = OperationStatus.PENDING, True
    again = Planner(planner.definition, planner.saga, planner.ops, now=planner.now)
    assert op.status == OperationStatus.UNKNOWN
    assert [e.event for e in again.take_events()] == ["outcome_unknown"]


def test_a_retry_failing_transiently_after_an_unknown_attempt_stays_unknown() -> None:
    """Below the ceiling the operation stays unknown while it waits out the backoff; the
    retry at the ceiling failing too parks it, still unknown, without compensating."""
    planner, op = _unknown_idempotent_charge(max_attempts=3)
    assert _invoke(planner) is op
    planner.record_failure(op, "TransientError: down", retryable=True, delay=5.0)
    assert op.status == OperationStatus.UNKNOWN
    assert isinstance(planner.advance(), Sleep)
    assert interventions.compensation_plan(planner, include_unknown=False)[1] is not None
    later = planner.now + timedelta(seconds=10)
    assert _invoke(planner, later) is op and op.attempts == 3
    planner.record_failure(op, "TransientError: down", retryable=True, delay=5.0)
    assert op.status == OperationStatus.UNKNOWN
    assert planner.saga.status == SagaStatus.NEEDS_REVIEW
    error = planner.saga.error or ""
    assert "attempt 3 failed at its ceiling" in error and "earlier attempt" in error
    assert planner.advance() == Stop(SagaStatus.NEEDS_REVIEW)
    assert _ops(planner, "compensation") == []


def test_a_permanent_failure_after_an_unknown_attempt_parks() -> None:
    """Even a PermanentError from the retry does not settle an earlier unknown attempt."""
    planner, op = _unknown_idempotent_charge()
    assert _invoke(planner) is op
    planner.record_failure(op, "PermanentError: declined", retryable=False, delay=0.0)
    assert op.status == OperationStatus.UNKNOWN
    assert planner.advance() == Stop(SagaStatus.NEEDS_REVIEW)
    assert planner.saga.direction == "forward"


def test_a_deadline_after_an_unknown_attempt_parks() -> None:
    """The step's deadline passing while its unknown outcome is retried parks it unknown."""
    planner, op = _unknown_idempotent_charge()
    op.deadline_at = planner.now - timedelta(seconds=1)
    assert planner.advance() == Stop(SagaStatus.NEEDS_REVIEW)
    assert op.status == OperationStatus.UNKNOWN
    assert "deadline" in (planner.saga.error or "")


def test_an_absent_answer_settles_the_unknown_attempt() -> None:
    """After a settled Absent the provider confirmed nothing happened: the retry failing at
    the ceiling fails the step as usual."""
    planner = _planner(Spec("reserve"), Spec("charge", reconcile=True, max_attempts=2))
    _succeed(planner)
    op = _park_unknown(planner)
    assert planner.advance() == AskReconcile(op)
    planner.record_absent(op)
    assert not op.retrying_unknown
    assert _invoke(planner) is op
    planner.record_failure(op, "TransientError: down", retryable=True, delay=0.0)
    assert op.status == OperationStatus.FAILED


def test_an_unclassified_prepare_failure_parks_with_the_step_pending() -> None:
    """prepare raising a bug counts an attempt with no effect and parks; nothing fails."""
    planner = _planner(Spec("reserve"), Spec("charge"))
    _succeed(planner)
    op = planner.find("charge", "action")
    assert op is not None
    planner.record_prepare_failure(op, "KeyError: 'x'", retryable=False, delay=0.0, park=True)
    assert (op.status, op.attempts) == (OperationStatus.PENDING, 1)
    assert planner.advance() == Stop(SagaStatus.NEEDS_REVIEW)
    assert _ops(planner, "compensation") == []


def test_record_unknown_keeps_the_traceback_in_the_event() -> None:
    """An unclassified exception's traceback is recorded with the outcome_unknown event."""
    planner = _planner(Spec("charge"))
    op = _invoke(planner)
    planner.take_events()
    planner.record_unknown(op, "attempt 1 raised KeyError", park=False, traceback="Traceback...")
    (event,) = planner.take_events()
    assert event.event == "outcome_unknown"
    assert event.detail == {"reason": "attempt 1 raised KeyError", "traceback": "Traceback..."}


def test_reconcile_found_settles_as_succeeded() -> None:
    """Found: the operation succeeded with the provider's result and reference."""
    planner = _planner(Spec("charge", reconcile=True), Spec("ship"))
    op = _park_unknown(planner)
    assert isinstance(planner.advance(), AskReconcile)
    planner.take_events()
    planner.record_found(op, {"charge": "ch_1"}, "prov-77")
    assert op.status == OperationStatus.SUCCEEDED
    assert op.result == {"charge": "ch_1"}
    assert op.provider_reference == "prov-77"
    assert op.error is None
    nxt = _invoke(planner)
    assert nxt.step == "ship"
    events = planner.take_events()
    assert [e.event for e in events] == ["reconcile_found", "attempt_started"]
    assert events[0].detail == {"provider_reference": "prov-77"}


def test_reconcile_absent_below_ceiling_retries_with_the_same_key() -> None:
    """Absent: nothing happened under the key, so it is retried with it (attempt+1)."""
    planner = _planner(Spec("charge", reconcile=True, max_attempts=3))
    op = _park_unknown(planner)
    key = op.idempotency_key
    planner.advance()
    planner.take_events()
    planner.record_absent(op)
    again = _invoke(planner)
    assert again is op
    assert again.attempts == 2
    assert again.idempotency_key == key
    assert _names(planner) == ["reconcile_absent", "attempt_started"]


def test_reconcile_absent_at_ceiling_fails_and_compensates() -> None:
    """Absent at the ceiling: the provider confirmed no effect, so failing is safe."""
    planner = _planner(Spec("reserve"), Spec("charge", reconcile=True, max_attempts=1))
    _succeed(planner)
    op = _park_unknown(planner)
    planner.advance()
    planner.record_absent(op)
    assert op.status == OperationStatus.FAILED
    comp = _invoke(planner)
    assert (comp.step, comp.kind) == ("reserve", "compensation")


def test_reconcile_inconclusive_parks_with_the_reason() -> None:
    """Inconclusive: a human decides; the saga parks and the reason is recorded."""
    planner = _planner(Spec("charge", reconcile=True, idempotent=True))
    op = _park_unknown(planner)
    planner.advance()
    planner.take_events()
    planner.record_inconclusive(op, "provider timed out")
    assert planner.saga.status == SagaStatus.NEEDS_REVIEW
    assert op.status == OperationStatus.UNKNOWN
    assert planner.saga.error is not None and "provider timed out" in planner.saga.error
    assert planner.advance() == Stop(SagaStatus.NEEDS_REVIEW)
    events = planner.take_events()
    assert [e.event for e in events] == ["reconcile_inconclusive", "saga_parked"]
    assert events[0].detail == {"reason": "provider timed out", "settled": False, "ask": 1}


def test_record_unknown_with_park_parks() -> None:
    """record_unknown(park=True) (e.g. a non-JSON result) parks with the reason; nothing runs."""
    planner = _planner(Spec("charge", idempotent=True), Spec("ship"))
    op = _invoke(planner)
    planner.take_events()
    planner.record_unknown(op, "TypeError: result of step 'charge' is not JSON", park=True)
    assert op.status == OperationStatus.UNKNOWN
    assert op.error == "TypeError: result of step 'charge' is not JSON"
    assert planner.saga.status == SagaStatus.NEEDS_REVIEW
    assert planner.saga.error == "TypeError: result of step 'charge' is not JSON"
    assert planner.advance() == Stop(SagaStatus.NEEDS_REVIEW)
    assert _names(planner) == ["outcome_unknown", "saga_parked"]


def test_record_unknown_without_park_is_settled_by_advance() -> None:
    """record_unknown(park=False) leaves the settling to the unknown rules (here: retry)."""
    planner = _planner(Spec("charge", idempotent=True))
    op = _invoke(planner)
    planner.record_unknown(op, "lost connection after send", park=False)
    assert planner.saga.status == SagaStatus.RUNNING
    again = _invoke(planner)
    assert again.attempts == 2


def test_unknown_compensation_follows_the_same_rules() -> None:
    """A compensation left running is unknown: retried when idempotent, else parked."""
    for idempotent, expected in ((True, Invoke), (False, Stop)):
        planner = _planner(Spec("reserve", comp_idempotent=idempotent), Spec("charge"))
        _succeed(planner)
        op = _invoke(planner)
        planner.record_failure(op, "declined", retryable=False, delay=0.0)
        comp = _invoke(planner)  # left running: the worker died
        nxt = planner.advance()
        assert isinstance(nxt, expected)
        if isinstance(nxt, Invoke):
            assert nxt.op is comp and comp.attempts == 2
        else:
            assert nxt == Stop(SagaStatus.NEEDS_REVIEW)
            assert comp.status == OperationStatus.UNKNOWN


def test_unknown_compensation_with_reconcile_asks_the_provider() -> None:
    """A compensation's reconcile hook is asked when its outcome is unknown."""
    planner = _planner(Spec("reserve", comp_reconcile=True), Spec("charge"))
    _succeed(planner)
    op = _invoke(planner)
    planner.record_failure(op, "declined", retryable=False, delay=0.0)
    comp = _invoke(planner)
    assert planner.advance() == AskReconcile(comp)


# ----- operator requests ----------------------------------------------------------------


def _parked_with_unknown(*, comp_idempotent: bool = True) -> Planner:
    """reserve succeeded, charge unknown (not idempotent, no reconcile): parked."""
    planner = _planner(Spec("reserve"), Spec("charge", comp_idempotent=comp_idempotent))
    _succeed(planner, {"reservation": "r-1"})
    _park_unknown(planner)
    assert planner.advance() == Stop(SagaStatus.NEEDS_REVIEW)
    planner.take_events()
    return planner


def test_compensate_stops_at_an_unknown_step() -> None:
    """request_compensation without include_unknown stops at the unknown step: nothing runs."""
    planner = _parked_with_unknown()
    interventions.request_compensation(
        planner, include_unknown=False, actor="ops@acme", now=planner.now
    )
    assert planner.saga.status == SagaStatus.COMPENSATING
    assert planner.advance() == Stop(SagaStatus.NEEDS_REVIEW)
    assert _ops(planner, "compensation") == []
    error = planner.saga.error
    assert error is not None and "'charge'" in error and "include_unknown" in error
    events = planner.take_events()
    assert [e.event for e in events] == ["compensation_requested", "saga_parked"]
    assert events[0].detail == {"actor": "ops@acme", "include_unknown": False}


def test_compensate_with_include_unknown_compensates_the_unknown_step_too() -> None:
    """include_unknown=True compensates the unknown step, then the earlier ones, in reverse."""
    planner = _parked_with_unknown()
    interventions.request_compensation(
        planner, include_unknown=True, actor="ops@acme", now=planner.now
    )
    ran: list[tuple[str, str]] = []
    while not isinstance(nxt := planner.advance(), Stop):
        assert isinstance(nxt, Invoke)
        ran.append((nxt.op.step, nxt.op.kind))
        planner.record_success(nxt.op, None)
    assert nxt == Stop(SagaStatus.COMPENSATED)
    assert ran == [("charge", "compensation"), ("reserve", "compensation")]
    assert planner.find("charge", "action").status == OperationStatus.UNKNOWN  # type: ignore[union-attr]


def test_compensate_a_running_saga_runs_no_further_step() -> None:
    """An operator's compensation request undoes what succeeded and never runs later steps."""
    planner = _planner(Spec("reserve"), Spec("charge"), Spec("ship"))
    _succeed(planner)
    interventions.request_compensation(planner, include_unknown=False, actor=None, now=planner.now)
    comp = _invoke(planner)
    assert (comp.step, comp.kind) == ("reserve", "compensation")
    planner.record_success(comp, None)
    assert planner.advance() == Stop(SagaStatus.COMPENSATED)
    assert planner.find("charge", "action").attempts == 0  # type: ignore[union-attr]
    assert planner.find("ship", "action").attempts == 0  # type: ignore[union-attr]


def test_compensating_a_compensated_saga_is_a_no_op() -> None:
    """request_compensation on a compensated saga changes nothing and records nothing."""
    planner = _planner(Spec("reserve"))
    op = _invoke(planner)
    planner.record_failure(op, "boom", retryable=False, delay=0.0)
    assert planner.advance() == Stop(SagaStatus.COMPENSATED)
    planner.take_events()
    interventions.request_compensation(planner, include_unknown=True, actor="ops", now=planner.now)
    assert planner.saga.status == SagaStatus.COMPENSATED
    assert planner.take_events() == []


def test_resolve_succeeded_settles_the_step_and_makes_the_saga_runnable() -> None:
    """resolve(outcome='succeeded') stores the result; the saga runs on from the next step."""
    planner = _parked_with_unknown()
    op = interventions.resolve(
        planner,
        "charge",
        kind=None,
        outcome="succeeded",
        result={"charge": "ch_9"},
        actor="ops@acme",
        reason="seen in dashboard",
        now=planner.now,
    )
    assert op.kind == "action"
    assert op.status == OperationStatus.SUCCEEDED
    assert op.result == {"charge": "ch_9"}
    assert op.error is None
    assert planner.saga.status == SagaStatus.RUNNING
    assert planner.saga.error is None
    assert planner.saga.run_after is not None
    events = planner.take_events()
    assert [e.event for e in events] == ["operation_resolved"]
    assert events[0].detail == {
        "outcome": "succeeded",
        "actor": "ops@acme",
        "reason": "seen in dashboard",
    }
    assert planner.advance() == Stop(SagaStatus.COMPLETED)


def test_resolve_failed_starts_compensation() -> None:
    """resolve(outcome='failed') fails the step; advancing then compensates earlier steps."""
    planner = _parked_with_unknown()
    op = interventions.resolve(
        planner,
        "charge",
        kind=None,
        outcome="failed",
        result=None,
        actor="ops@acme",
        reason="no charge",
        now=planner.now,
    )
    assert op.status == OperationStatus.FAILED
    assert op.error == "resolved as failed by ops@acme: no charge"
    comp = _invoke(planner)
    assert (comp.step, comp.kind) == ("reserve", "compensation")
    assert planner.saga.status == SagaStatus.COMPENSATING
    names = _names(planner)
    assert names == ["operation_resolved", "compensation_started", "attempt_started"]


def test_resolve_refuses_a_compensated_or_completed_saga() -> None:
    """A final saga never runs again: resolving any of its steps is refused, saying what
    is left to do, and changes nothing."""
    compensated = _planner(Spec("reserve"), Spec("charge"))
    _succeed(compensated)
    compensated.record_failure(_invoke(compensated), "declined", retryable=False, delay=0.0)
    compensated.record_success(_invoke(compensated), None)
    assert compensated.advance() == Stop(SagaStatus.COMPENSATED)
    compensated.take_events()
    with pytest.raises(StepStateError, match="compensated: it is final"):
        interventions.resolve(
            compensated,
            "charge",
            kind=None,
            outcome="succeeded",
            result={},
            actor="ops",
            reason=None,
            now=compensated.now,
        )
    assert compensated.find("charge", "action").status == OperationStatus.FAILED  # type: ignore[union-attr]
    assert compensated.take_events() == []

    completed = _planner(Spec("reserve"))
    _succeed(completed)
    assert completed.advance() == Stop(SagaStatus.COMPLETED)
    with pytest.raises(StepStateError, match=r"completed: .*compensate it"):
        interventions.resolve(
            completed,
            "reserve",
            kind=None,
            outcome="failed",
            result=None,
            actor="o",
            reason="x",
            now=completed.now,
        )
    with pytest.raises(StepStateError, match="completed"):
        interventions.raise_ceilings(completed, actor="ops", max_operations=10, now=completed.now)


def test_resolve_refuses_success_of_a_step_compensation_has_gone_past() -> None:
    """Compensation undid charge (before ship) and parked at reserve: ship resolved as
    succeeded would be compensated after charge, out of reverse order. Refused."""
    planner = _planner(Spec("reserve"), Spec("charge"), Spec("ship"))
    _succeed(planner)
    _succeed(planner)
    planner.record_failure(_invoke(planner), "no carrier", retryable=False, delay=0.0)
    planner.record_success(_invoke(planner), None)  # charge's compensation
    planner.record_failure(_invoke(planner), "warehouse gone", retryable=False, delay=0.0)
    assert planner.advance() == Stop(SagaStatus.NEEDS_REVIEW)
    with pytest.raises(StepStateError, match="already gone past step 'ship'"):
        interventions.resolve(
            planner,
            "ship",
            kind="action",
            outcome="succeeded",
            result={},
            actor="ops",
            reason=None,
            now=planner.now,
        )
    assert planner.find("ship", "action").status == OperationStatus.FAILED  # type: ignore[union-attr]


def test_resolve_a_failed_compensation_continues_compensating() -> None:
    """Resolving a parked compensation (kind defaults to it) resumes the compensation."""
    planner = _planner(Spec("reserve"), Spec("charge"), Spec("ship"))
    _succeed(planner)
    _succeed(planner)
    op = _invoke(planner)
    planner.record_failure(op, "no carrier", retryable=False, delay=0.0)
    comp = _invoke(planner)
    assert comp.step == "charge"
    planner.record_failure(comp, "refund API down", retryable=False, delay=0.0)
    assert planner.advance() == Stop(SagaStatus.NEEDS_REVIEW)
    resolved = interventions.resolve(
        planner,
        "charge",
        kind=None,
        outcome="succeeded",
        result=None,
        actor="ops",
        reason=None,
        now=planner.now,
    )
    assert resolved is comp
    assert planner.saga.status == SagaStatus.COMPENSATING
    nxt = _invoke(planner)
    assert (nxt.step, nxt.kind) == ("reserve", "compensation")


def test_resolve_refuses_a_succeeded_step() -> None:
    """Resolving a step that already succeeded raises StepStateError and changes nothing."""
    planner = _planner(Spec("reserve"), Spec("charge"))
    op = _succeed(planner, {"r": 1})
    planner.take_events()
    with pytest.raises(StepStateError):
        interventions.resolve(
            planner,
            "reserve",
            kind=None,
            outcome="failed",
            result=None,
            actor="ops",
            reason=None,
            now=planner.now,
        )
    assert op.status == OperationStatus.SUCCEEDED
    assert op.result == {"r": 1}
    assert planner.take_events() == []


def test_resolve_refuses_a_step_never_attempted() -> None:
    """Resolving a step that has not been attempted raises StepStateError."""
    planner = _planner(Spec("reserve"), Spec("charge"))
    with pytest.raises(StepStateError):
        interventions.resolve(
            planner,
            "charge",
            kind=None,
            outcome="succeeded",
            result=None,
            actor="ops",
            reason=None,
            now=planner.now,
        )
    assert planner.find("charge", "action").status == OperationStatus.PENDING  # type: ignore[union-attr]


def test_resolve_refuses_unknown_step_or_missing_compensation() -> None:
    """An undeclared step name, or a compensation not created yet, raises StepStateError."""
    planner = _parked_with_unknown()
    with pytest.raises(StepStateError):
        interventions.resolve(
            planner,
            "refund",
            kind=None,
            outcome="failed",
            result=None,
            actor="o",
            reason=None,
            now=planner.now,
        )
    with pytest.raises(StepStateError):
        interventions.resolve(
            planner,
            "charge",
            kind="compensation",
            outcome="failed",
            result=None,
            actor="o",
            reason=None,
            now=planner.now,
        )


def test_stale_definition_is_reported() -> None:
    """An operation whose step is no longer declared raises StepStateError naming the version."""
    planner = _planner(Spec("reserve"))
    op = planner.ops[0]
    planner.definition.steps.clear()
    with pytest.raises(StepStateError, match="version"):
        planner.step_of(op)


# ----- a whole run, as a runner would drive it ------------------------------------------


def _drive(planner: Planner, call: Callable[[OpRow], Any]) -> tuple[Next, list[str]]:
    """Drive the planner like the runner, with `call` deciding each attempt's outcome."""
    events: list[str] = []
    nxt = planner.advance()
    while isinstance(nxt, Invoke):
        outcome = call(nxt.op)
        if isinstance(outcome, Exception):
            planner.record_failure(
                nxt.op, repr(outcome), retryable=isinstance(outcome, TimeoutError), delay=0.0
            )
        else:
            planner.record_success(nxt.op, outcome)
        nxt = planner.advance(datetime.now().astimezone() + timedelta(hours=1))
    events.extend(e.event for e in planner.take_events())
    return nxt, events


def test_a_whole_run_with_one_retry_records_the_full_audit_trail() -> None:
    """A run with one transient failure completes and its events tell the whole story."""
    planner = _planner(Spec("reserve"), Spec("charge"))
    failures = {"charge": 1}

    def call(op: OpRow) -> Any:
        if failures.get(op.step, 0) >= op.attempts:
            return TimeoutError("slow")
        return {"step": op.step}

    nxt, events = _drive(planner, call)
    assert nxt == Stop(SagaStatus.COMPLETED)
    assert events == [
        "attempt_started",
        "attempt_succeeded",
        "attempt_started",
        "attempt_failed",
        "attempt_started",
        "attempt_succeeded",
        "saga_completed",
    ]
    assert operation_key("renewal", 2, "acme", "evt-1", "charge", "action") == (
        planner.find("charge", "action").idempotency_key  # type: ignore[union-attr]
    )
