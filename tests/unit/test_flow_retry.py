"""Database retries inside flows: tenacity's schedule, with the sleeps as effects, and the
transient errors of database work handed to the flow as `DatabaseInterrupted`."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from structlog.testing import capture_logs

from saga._drivers.boundary import carry_out
from saga._flows.claim import Flows
from saga._flows.drive import RunnerOptions, retried
from saga._flows.effects import Db, Effect, Flow, Pause, Stopping
from saga.errors import DatabaseInterrupted


def _run(flow: Flow[Any], *, stopping: bool = False, failures: int = 0) -> tuple[Any, list[Effect]]:
    """Run `flow` with a driver whose first `failures` database calls lose the connection
    (as psycopg raises it)."""
    seen: list[Effect] = []

    def effect(step: Effect, conn: Any) -> Any:
        seen.append(step)
        if isinstance(step, Db):
            failed = sum(isinstance(e, Db) for e in seen)
            if failed <= failures:
                raise psycopg.OperationalError(f"connection lost ({failed})")
            return "done"
        return stopping if isinstance(step, Stopping) else None

    def no_transaction(pipelined: bool) -> Any:
        raise AssertionError("no transaction here")

    return carry_out(flow, effect, no_transaction), seen


def _body() -> tuple[list[int], Any]:
    """A flow of one database call, and the tries it made."""
    calls: list[int] = []

    def body() -> Flow[str]:
        calls.append(len(calls) + 1)
        answer: str = yield Db("load")
        return answer

    return calls, body


def test_a_transient_error_is_retried_after_a_pause_and_logged_with_its_cause() -> None:
    """Each retry sleeps through a Pause effect (no clock in the flow), and its log line
    names the error that caused it and the attempt that failed."""
    calls, body = _body()
    with capture_logs() as logs:
        result, seen = _run(retried("record_transition", body), failures=2)
    assert result == "done"
    assert calls == [1, 2, 3]
    pauses = [e for e in seen if isinstance(e, Pause)]
    assert len(pauses) == 2 and all(p.seconds > 0 for p in pauses)
    retries = [e for e in logs if e["event"] == "database_retry"]
    assert [(e["attempt"], e["error"]) for e in retries] == [
        (1, "DatabaseInterrupted: OperationalError: connection lost (1)"),
        (2, "DatabaseInterrupted: OperationalError: connection lost (2)"),
    ]


def test_an_error_that_is_not_transient_is_raised_at_once() -> None:
    """Only transient database errors are retried."""
    calls: list[int] = []

    def body() -> Flow[None]:
        calls.append(1)
        raise ValueError("a bug")
        yield  # pragma: no cover - makes this a generator

    with pytest.raises(ValueError, match="a bug"):
        _run(retried("record_transition", body))
    assert calls == [1]


def test_an_interruptible_retry_ends_when_the_driver_is_stopping() -> None:
    """While the driver shuts down, an interruptible retry raises the last error instead
    of sleeping again."""
    calls, body = _body()
    with pytest.raises(DatabaseInterrupted, match=r"\(1\)") as raised:
        _run(retried("claim_next_saga", body, interruptible=True), stopping=True, failures=5)
    assert isinstance(raised.value.__cause__, psycopg.OperationalError)
    assert calls == [1]


def _unavailable(pipelined: bool) -> Any:
    raise psycopg.OperationalError("connection refused")


def test_a_claim_holds_nothing_when_the_driver_stops_while_the_database_is_down() -> None:
    """A claim (of one saga, or of a batch) whose database is unavailable while the
    driver is stopping answers that it holds nothing, instead of raising the error."""
    flows = Flows(
        RunnerOptions(owner="w", lease_seconds=5.0, heartbeat_seconds=1.0),
        reporter=lambda saga, op: lambda total: None,
    )

    def lookup(name: str, version: int) -> Any:
        raise AssertionError("nothing is claimed")

    def stopping(step: Effect, conn: Any) -> Any:
        return True if isinstance(step, Stopping) else None

    assert carry_out(flows.claim_next(["shop:1"], lookup), stopping, _unavailable) is None
    assert carry_out(flows.claim_batch(["shop:1"], lookup, 3), stopping, _unavailable) == []
