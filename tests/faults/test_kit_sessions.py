"""saga.testing.crash_test on sessions of durable steps: each call of a function running a
session killed with SIGKILL at each fault point in a real child process, the session
resumed by running the function again in a fresh one, and the invariants checked; through
both doors, and biting on apps that are wrong."""

from __future__ import annotations

import pytest

from faults import session_kit_app as box_office
from saga import Orchestrator
from saga.testing import FAULT_POINTS, CrashReport, InvariantViolation, crash_test

pytestmark = [pytest.mark.integration, pytest.mark.crash]

APP = "faults.session_kit_app:orch"
ASYNC_APP = "faults.session_kit_app_async:aorch"
NOT_SETTLED = "is unknown and it is neither idempotent nor has a reconcile hook"


@pytest.fixture
def url(database_url: str) -> str:
    """This test's database, with the providers' table the apps write their effects to."""
    box_office.create_providers(database_url)
    return database_url


def effects_of(url: str) -> dict[str, int]:
    return box_office.effects(url)


def counted(url: str, report: CrashReport) -> dict[str, dict[tuple[str, str], int]]:
    """Per run (by fault; "baseline"): the effects performed for each operation of its
    session, by durable step name (its operation's name less the key's digest) and kind."""
    performed = effects_of(url)
    out: dict[str, dict[tuple[str, str], int]] = {}
    with Orchestrator(url, auto_migrate=False) as orch:
        for run in [report.baseline, *report.runs]:
            state = orch.get(run.saga_id)
            ops: dict[tuple[str, str], int] = {}
            for op in state.operations:
                key = (op.step.rsplit(".", 1)[0], str(op.kind))
                ops[key] = ops.get(key, 0) + performed.get(op.idempotency_key, 0)
            out[run.fault or "baseline"] = ops
    return out


def test_a_session_survives_a_kill_at_every_fault_point_of_every_call(url: str) -> None:
    """The box office's sale (five calls, one of them a second call of `email_receipt`)
    killed at each of the 4 fault points of each call, then run again: it completes, or
    parks for a human where the one call that is neither idempotent nor reconcilable (the
    printer's) was in flight; each effect happened once."""
    report = crash_test(
        APP,
        session=box_office.sell_tickets,
        database_url=url,
        kinds=("action",),
        effects=lambda key: effects_of(url).get(key, 0),
    )
    print(report.summary())
    calls = ["hold_seats", "take_payment", "email_receipt", "email_receipt#2", "print_tickets"]
    assert [r.fault for r in report.runs] == [
        f"{point}:action:{call}" for call in calls for point in FAULT_POINTS
    ]
    assert report.baseline.status == "completed"
    assert len(report.killed) == len(report.runs) == 20, report.summary()
    assert set(report.parked) == {
        "before_call:action:print_tickets",
        "after_call:action:print_tickets",
    }
    assert all(NOT_SETTLED in reason for reason in report.parked.values())
    assert all(r.status == "completed" for r in report.runs if r.fault not in report.parked)
    assert report.invariants.ok and report.invariants.sagas == 21
    once = {
        ("hold_seats", "action"): 1,
        ("take_payment", "action"): 1,
        ("email_receipt", "action"): 2,  # two calls, one effect each
        ("print_tickets", "action"): 1,
    }
    for run, ops in counted(url, report).items():
        if run == "before_call:action:print_tickets":
            assert ops == {**once, ("print_tickets", "action"): 0}, run
        else:
            assert ops == once, run


def test_a_failed_session_survives_a_kill_at_every_point_of_its_compensations(url: str) -> None:
    """The printer refuses the order: the session compensates, refund then release. Killed
    at each fault point of either compensation and run again, it still ends compensated,
    and no refund or release happened twice."""
    report = crash_test(
        APP,
        session="faults.session_kit_app:sell_tickets",
        input=lambda run: {"run_id": f"refused-{run}", "refuse": True},
        database_url=url,
        kinds=("compensation",),
        effects=lambda key: effects_of(url).get(key, 0),
    )
    print(report.summary())
    assert report.baseline.status == "compensated"
    assert [r.fault for r in report.runs] == [
        f"{point}:compensation:{call}"
        for call in ("take_payment", "hold_seats")
        for point in FAULT_POINTS
    ]
    assert len(report.killed) == len(report.runs), report.summary()
    assert all(r.status == "compensated" for r in report.runs), report.summary()
    for run, ops in counted(url, report).items():
        assert ops == {
            ("hold_seats", "action"): 1,
            ("take_payment", "action"): 1,
            ("email_receipt", "action"): 2,
            ("print_tickets", "action"): 0,
            ("take_payment", "compensation"): 1,
            ("hold_seats", "compensation"): 1,
        }, run


def test_an_async_session_survives_a_kill_at_every_fault_point_of_every_call(url: str) -> None:
    """An `async with aorch.session(...)` delivery (coroutine steps around a plain one, a
    reconcile hook on each that the courier does not dedupe) killed at each fault point of
    each call and run again completes, each effect once."""
    report = crash_test(
        ASYNC_APP,
        session="faults.session_kit_app_async:deliver",
        database_url=url,
        kinds=("action",),
        effects=lambda key: effects_of(url).get(key, 0),
    )
    print(report.summary())
    assert report.baseline.status == "completed"
    assert len(report.runs) == 4 * len(FAULT_POINTS)
    assert len(report.killed) == len(report.runs), report.summary()
    assert report.parked == {}
    assert all(r.status == "completed" for r in report.runs), report.summary()
    for run, ops in counted(url, report).items():
        assert ops == {
            ("book_courier", "action"): 1,
            ("charge_sender", "action"): 1,
            ("notify_recipient", "action"): 1,
            ("hand_over", "action"): 1,
        }, run


def test_a_failed_async_session_survives_a_kill_in_every_compensation(url: str) -> None:
    """The recipient refuses the parcel: the async session compensates (a plain refund,
    then a coroutine cancelling the courier); killed anywhere in either, it still ends
    compensated, each compensation once."""
    report = crash_test(
        ASYNC_APP,
        session="faults.session_kit_app_async:deliver",
        input=lambda run: [f"refused-{run}", True],
        database_url=url,
        kinds=("compensation",),
        effects=lambda key: effects_of(url).get(key, 0),
    )
    print(report.summary())
    assert report.baseline.status == "compensated"
    assert len(report.runs) == 2 * len(FAULT_POINTS)
    assert len(report.killed) == len(report.runs), report.summary()
    assert all(r.status == "compensated" for r in report.runs), report.summary()
    for run, ops in counted(url, report).items():
        assert ops[("charge_sender", "compensation")] == 1, run
        assert ops[("book_courier", "compensation")] == 1, run


def test_the_kit_reports_a_second_effect_of_a_step_wrongly_declared_idempotent(url: str) -> None:
    """`text_buyer` says its provider dedupes on the key; it does not. Killed after the
    text went out, the call is retried under its key, and the buyer gets a second text:
    the kit reports that run, and only that one."""
    with pytest.raises(InvariantViolation) as caught:
        crash_test(
            APP,
            session=box_office.sell_tickets_with_sms,
            database_url=url,
            points=("before_call", "after_call"),
            effects=lambda key: effects_of(url).get(key, 0),
        )
    message = str(caught.value)
    print(message)
    assert message.startswith("1 violation(s):")
    assert "after_call:action:text_buyer: session " in message
    assert "effect performed 2 times for key session/session:v1:box-office:" in message
    # One text per run (the baseline, and three runs killed at take_payment or before the
    # text), two for the run killed after it.
    assert box_office.requests(url, "sms") == 1 + 3 + 2


def test_the_kit_reports_a_second_effect_through_the_async_door(url: str) -> None:
    """The same mistake in an async session (`ping_sender`) is reported the same way."""
    with pytest.raises(InvariantViolation) as caught:
        crash_test(
            ASYNC_APP,
            session="faults.session_kit_app_async:deliver_with_ping",
            database_url=url,
            points=("after_call",),
            effects=lambda key: effects_of(url).get(key, 0),
        )
    message = str(caught.value)
    print(message)
    assert message.startswith("1 violation(s):")
    assert "after_call:action:ping_sender: session " in message
    assert "effect performed 2 times" in message


def test_the_kit_reports_a_call_made_again_under_another_key(url: str) -> None:
    """A function that keys a call on an id it makes afresh every time it runs makes the
    call again under another key when it resumes: the receipt goes out twice, one effect
    per key, which only the comparison with the run without faults shows. Killed while
    the first receipt was in flight, the session parks instead (a call its code did not
    make again), which `allow_review=False` refuses."""
    with pytest.raises(InvariantViolation) as caught:
        crash_test(
            APP,
            session=box_office.sell_tickets_with_fresh_ids,
            database_url=url,
            points=("after_call", "after_record"),
            allow_review=False,
        )
    message = str(caught.value)
    print(message)
    assert (
        "after_record:action:email_receipt: session " in message
        and "call 'email_receipt#2' was not made by the run without faults" in message
    )
    assert "after_call:action:email_receipt: ended needs_review" in message


def test_crash_test_says_what_is_wrong_with_its_arguments(url: str) -> None:
    """Mistakes are refused before any child runs, each saying what to do."""
    with pytest.raises(TypeError, match=r"either saga= .* or session="):
        crash_test(APP, database_url=url)
    with pytest.raises(TypeError, match="not both"):
        crash_test(APP, "renewal", {}, session=box_office.sell_tickets, database_url=url)

    def local(run_id: str) -> None: ...

    with pytest.raises(ValueError, match="top level of an importable module"):
        crash_test(APP, session=local, database_url=url)
    with pytest.raises(ValueError, match="expected 'MODULE:FUNCTION'"):
        crash_test(APP, session="faults.session_kit_app", database_url=url)
    with pytest.raises(ValueError, match="unknown fault point"):
        crash_test(APP, session=box_office.sell_tickets, points=("mid_call",), database_url=url)
    with pytest.raises(ValueError, match="each run needs a session of its own"):
        crash_test(APP, session=box_office.sell_tickets, input={"run_id": "one"}, database_url=url)
