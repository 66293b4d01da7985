"""Operator requests behind `saga` decided on in-memory snapshots, and the command's parsing."""

from __future__ import annotations

import sys
import textwrap
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from saga import RetryPolicy, Saga, StepStateError
from saga._app import UsageError, load_app
from saga._core import requests as interventions
from saga._core.planner import Invoke, OpRow, Planner, SagaRow, new_action_rows
from saga.cli.admin import parse_duration
from saga.cli.parser import build_parser
from saga.state import OperationStatus, SagaStatus


class Order(BaseModel):
    order_id: str


def _noop(*args: Any) -> None:
    return None


def _planner(*, pivot: bool = False, idempotent: bool = False, notify_attempts: int = 1) -> Planner:
    """reserve (compensated) -> charge (compensated) -> notify, optionally charge a pivot."""
    saga: Saga[Order] = Saga("shop", version=1, input=Order, key=lambda o: o.order_id)
    reserve = saga.step(name="reserve")(_noop)
    reserve.compensation(_noop)
    charge = saga.step(name="charge", pivot=pivot, idempotent=idempotent)(_noop)
    charge.compensation(_noop)
    saga.step(name="notify", retry=RetryPolicy(max_attempts=notify_attempts))(_noop)
    row = SagaRow(
        id="saga-1",
        name="shop",
        version=1,
        tenant_id="",
        key="o-1",
        input={"order_id": "o-1"},
        input_hash="h",
        status=SagaStatus.PENDING,
        error=None,
        direction="forward",
        fence=1,
        run_after=None,
    )
    ops = new_action_rows(saga, "", "o-1", {"order_id": "o-1"})
    return Planner(saga, row, ops, now=datetime.now().astimezone())


def _start(planner: Planner) -> OpRow:
    nxt = planner.advance()
    assert isinstance(nxt, Invoke), nxt
    return nxt.op


def _succeed(planner: Planner, times: int) -> None:
    for _ in range(times):
        planner.record_success(_start(planner), {"ok": True})


# ----- retry ---------------------------------------------------------------------------


def test_retry_needs_extra_attempts_at_the_ceiling_and_keeps_the_count() -> None:
    """A step failed after a pivot: retry refuses to reset the ceiling, extra attempts raise it."""
    planner = _planner(pivot=True)
    _succeed(planner, 2)
    notify = _start(planner)
    planner.record_failure(notify, "PermanentError: relay down", retryable=False, delay=0)
    planner.advance()
    assert planner.saga.status == SagaStatus.NEEDS_REVIEW
    planner.take_events()

    with pytest.raises(StepStateError, match="1 of its 1 attempts"):
        interventions.request_retry(planner, extra_attempts=0, actor="bob", now=planner.now)
    assert (notify.status, notify.attempts, notify.max_attempts) == ("failed", 1, 1)

    op = interventions.request_retry(planner, extra_attempts=2, actor="bob", now=planner.now)
    assert op is notify
    assert (notify.status, notify.attempts, notify.max_attempts) == ("pending", 1, 3)
    assert planner.saga.status == SagaStatus.RUNNING and planner.saga.error is None
    [event] = planner.take_events()
    assert event.event == "retry_requested" and event.step == "notify"
    assert event.detail["actor"] == "bob"
    assert (event.detail["previous_max_attempts"], event.detail["max_attempts"]) == (1, 3)
    retried = _start(planner)
    assert retried is notify and notify.attempts == 2


def test_retry_refuses_an_unknown_outcome_that_could_repeat_its_effect() -> None:
    """An unknown, non-idempotent step without reconcile must be resolved, not retried."""
    planner = _planner()
    _succeed(planner, 1)
    charge = _start(planner)
    planner.record_unknown(charge, "TypeError: not JSON", park=True)
    with pytest.raises(StepStateError, match="resolve it"):
        interventions.request_retry(planner, extra_attempts=5, actor="bob", now=planner.now)
    assert charge.status == OperationStatus.UNKNOWN


def test_retry_settles_an_idempotent_unknown_again() -> None:
    """An idempotent unknown step stays unknown; the next advance retries it with its key."""
    planner = _planner(idempotent=True)
    _succeed(planner, 1)
    charge = _start(planner)
    planner.record_unknown(charge, "crashed", park=True)
    interventions.request_retry(planner, extra_attempts=0, actor=None, now=planner.now)
    assert charge.status == OperationStatus.UNKNOWN
    assert _start(planner) is charge and charge.attempts == 2


def test_retry_refuses_a_saga_that_is_not_parked() -> None:
    """Only a needs_review saga can be retried."""
    planner = _planner()
    _start(planner)
    with pytest.raises(StepStateError, match="not needs_review"):
        interventions.request_retry(planner, extra_attempts=1, actor="bob", now=planner.now)


# ----- cancel --------------------------------------------------------------------------


def test_cancel_records_the_reason_and_turns_backward() -> None:
    """cancel: cancel_requested and compensation_requested, reason kept as the saga's error."""
    planner = _planner()
    _succeed(planner, 1)
    planner.take_events()
    assert interventions.request_cancel(
        planner, reason="customer asked", actor="carol", include_unknown=False, now=planner.now
    )
    assert planner.saga.direction == "backward"
    assert planner.saga.status == SagaStatus.COMPENSATING
    assert planner.saga.error == "cancelled by carol: customer asked"
    names = [e.event for e in planner.take_events()]
    assert names == ["cancel_requested", "compensation_requested"]
    assert not interventions.request_cancel(
        planner, reason="again", actor="carol", include_unknown=False, now=planner.now
    )


def test_cancel_refuses_past_a_pivot_and_a_completed_saga() -> None:
    """After a succeeded pivot the saga only goes forward; a completed one has no progress."""
    pivoted = _planner(pivot=True)
    _succeed(pivoted, 2)
    with pytest.raises(StepStateError, match="pivot step 'charge'"):
        interventions.request_cancel(
            pivoted, reason="x", actor="carol", include_unknown=False, now=pivoted.now
        )
    done = _planner()
    _succeed(done, 3)
    done.advance()
    assert done.saga.status == SagaStatus.COMPLETED
    with pytest.raises(StepStateError, match="completed"):
        interventions.request_cancel(
            done, reason="x", actor="carol", include_unknown=False, now=done.now
        )


def test_cancel_with_include_unknown_compensates_an_unknown_step_of_a_cancelled_saga() -> None:
    """Cancelled, then parked at an unknown charge: a cancel without include_unknown is
    refused naming the step and the flag; with it, charge gets its compensation."""
    planner = _planner()
    _succeed(planner, 1)
    charge = _start(planner)
    planner.record_unknown(charge, "crashed", park=True)
    interventions.request_cancel(
        planner, reason="asked", actor="carol", include_unknown=False, now=planner.now
    )
    planner.advance()  # compensation stops at charge: parked
    assert planner.saga.status == SagaStatus.NEEDS_REVIEW
    with pytest.raises(StepStateError, match=r"'charge'.*cancel again with include_unknown=True"):
        interventions.request_cancel(
            planner, reason="asked", actor="carol", include_unknown=False, now=planner.now
        )
    planner.take_events()
    assert interventions.request_cancel(
        planner, reason="again", actor="carol", include_unknown=True, now=planner.now
    )
    assert planner.saga.status == SagaStatus.COMPENSATING
    assert planner.find("charge", "compensation") is not None
    names = [e.event for e in planner.take_events()]
    assert names[:2] == ["cancel_requested", "compensation_requested"]


def test_resolve_amends_an_operator_result_until_its_compensation_starts() -> None:
    """A result an operator gave is amended (result_amended, old and new); a provider's
    result, or one whose compensation started, is refused."""
    planner = _planner()
    _succeed(planner, 1)
    charge = _start(planner)
    planner.record_unknown(charge, "crashed", park=True)
    kw: dict[str, Any] = {"kind": None, "actor": "dana", "reason": None, "now": planner.now}
    interventions.resolve(planner, "charge", outcome="succeeded", result=None, **kw)
    planner.take_events()
    amended = interventions.resolve(
        planner, "charge", outcome="succeeded", result={"c": 1},
        operator_resolved={"charge"}, **kw,
    )  # fmt: skip
    assert amended.result == {"c": 1}
    (event,) = planner.take_events()
    assert event.event == "result_amended"
    assert event.detail == {"actor": "dana", "reason": None, "previous_result": None,
                            "result": {"c": 1}}  # fmt: skip
    with pytest.raises(StepStateError, match="what the provider call returned"):
        interventions.resolve(planner, "reserve", outcome="succeeded", result={}, **kw)
    interventions.request_compensation(planner, include_unknown=False, actor="x", now=planner.now)
    comp = _start(planner)  # the compensation of charge, first
    assert (comp.step, comp.kind) == ("charge", "compensation")
    comp.attempts = max(comp.attempts, 1)
    with pytest.raises(StepStateError, match="its compensation has started"):
        interventions.resolve(
            planner, "charge", outcome="succeeded", result={}, operator_resolved={"charge"}, **kw
        )


# ----- compensation plan -----------------------------------------------------------------


def test_compensation_plan_lists_keys_in_reverse_and_changes_nothing() -> None:
    """The dry run's plan: compensations of succeeded steps, last first, with their keys."""
    planner = _planner()
    _succeed(planner, 2)
    planner.take_events()
    before = [(o.step, o.kind, o.status, o.attempts) for o in planner.ops]
    runs, stop = interventions.compensation_plan(planner, include_unknown=False)
    assert runs == [
        ("charge", "shop:v1::o-1:charge:compensate"),
        ("reserve", "shop:v1::o-1:reserve:compensate"),
    ]
    assert stop is None
    assert [(o.step, o.kind, o.status, o.attempts) for o in planner.ops] == before
    assert not planner.take_events()


def test_compensation_plan_stops_at_an_unknown_step_unless_included() -> None:
    """An unknown step stops the plan there; include_unknown compensates it too."""
    planner = _planner()
    _succeed(planner, 1)
    charge = _start(planner)
    planner.record_unknown(charge, "crashed", park=True)
    runs, stop = interventions.compensation_plan(planner, include_unknown=False)
    assert runs == [] and stop is not None and "'charge'" in stop
    runs, stop = interventions.compensation_plan(planner, include_unknown=True)
    assert [step for step, _ in runs] == ["charge", "reserve"] and stop is None


# ----- parsing -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90", 90), ("90s", 90), ("15m", 900), ("1h", 3600), ("2d", 172800), ("1h30m", 5400)],
)
def test_parse_duration(text: str, seconds: float) -> None:
    """Durations: plain seconds or number+unit groups."""
    assert parse_duration(text) == timedelta(seconds=seconds)


@pytest.mark.parametrize("text", ["", "h", "1x", "1h 2", "-5m", "soon"])
def test_parse_duration_rejects_garbage(text: str) -> None:
    """Anything else is a ValueError naming the accepted forms."""
    with pytest.raises(ValueError, match="invalid duration"):
        parse_duration(text)


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["list", "--limit", "0"],
        ["list", "--status", "asleep"],
        ["resolve", "ID", "STEP"],
        ["resolve", "ID", "STEP", "--succeeded", "--failed"],
        ["cancel", "ID"],
        ["retry", "ID", "--extra-attempts", "many"],
    ],
)
def test_bad_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """argparse errors exit 2 with one line on stderr."""
    with pytest.raises(SystemExit) as excinfo:
        build_parser().parse_args(argv)
    assert excinfo.value.code == 2
    assert capsys.readouterr().err.strip().count("\n") == 0


def test_load_app_finds_the_single_orchestrator_or_explains(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--app MODULE finds the only Orchestrator; none, several or a wrong ATTR are usage errors."""
    body = """
        from saga import Orchestrator, Saga
        from pydantic import BaseModel

        class In(BaseModel):
            k: str

        s = Saga("s", version=1, input=In, key=lambda i: i.k)
        s.step(name="one")(lambda ctx, i: None)
        {extra}
    """
    files = {
        "app_one": "orch = Orchestrator(sagas=[s])",
        "app_two": "a = Orchestrator(sagas=[s])\n        b = Orchestrator(sagas=[s])",
        "app_none": "x = 1",
    }
    for name, extra in files.items():
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(body.format(extra=extra)))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("SAGA_DATABASE_URL", raising=False)
    try:
        assert load_app("app_one", None).registered()[0].name == "s"
        assert load_app("app_two:b", None) is sys.modules["app_two"].b
        for spec, message in [
            ("app_two", "several Orchestrators (a, b)"),
            ("app_none", "has no Orchestrator"),
            ("app_one:nope", "has no 'nope'"),
            ("app_none:x", "is a int, not an Orchestrator"),
            ("app_missing_here", "no module named 'app_missing_here'"),
            (None, "pass --app"),
        ]:
            with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
                load_app(spec, None)
    finally:
        for name in files:
            sys.modules.pop(name, None)


def test_cli_wording_names_flags_and_never_suggests_one_already_passed() -> None:
    """Library messages become the command's words; a flag the user passed is not
    suggested again as if it had not been."""
    from saga.cli.format import cli_wording

    parked = "resolve it first, or compensate with include_unknown=True"
    assert cli_wording(parked) == "resolve it first, or compensate with --include-unknown"
    assert cli_wording(parked, {"--include-unknown": True}) == "resolve it first"
    used = (
        "step 'x' has used 3 of its 2 attempts; raise its ceiling with extra attempts to retry it"
    )
    assert cli_wording(used).endswith("raise its ceiling with --extra-attempts N to retry it")
    assert cli_wording(used, {"--extra-attempts": 1}).endswith(
        "--extra-attempts 1 does not raise its ceiling far enough; it needs at least 2"
    )
    assert cli_wording("wait for the lease to expire, or force it").endswith("or pass --force")
