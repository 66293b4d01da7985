"""The library's logs belong to the application: stdlib `logging` by default, never stdout,
and a failure to log never fails, strands or changes a saga."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import log_app
import pytest
import structlog
import structlog.testing
from support import Order, events, order_saga, scalar

from saga import StepContext

_APP = Path(log_app.__file__).resolve()


def _spawn(database_url: str, mode: str, result: Path) -> subprocess.Popen[str]:
    env = {**os.environ, log_app.ENV_URL: database_url}
    return subprocess.Popen(
        [sys.executable, str(_APP), mode, str(result)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _left_running(database_url: str) -> int:
    return int(
        scalar(
            database_url,
            "SELECT (SELECT count(*) FROM saga.sagas WHERE status <> 'completed')"
            " + (SELECT count(*) FROM saga.operations WHERE status = 'running')",
        )
    )


@pytest.mark.parametrize("mode", ["default", "structlog_stdout", "logging_stdout"])
def test_stdout_closed_early_does_not_strand_the_saga(
    database_url: str, tmp_path: Path, mode: str
) -> None:
    """`python app.py | head -1`: the reader of stdout is gone; the saga still completes."""
    result = tmp_path / "status"
    proc = _spawn(database_url, mode, result)
    assert proc.stdout is not None and proc.stdin is not None and proc.stderr is not None
    try:
        assert proc.stdout.readline().strip() == "LOG_APP READY"
        proc.stdout.close()  # like `head -1` exiting after its line
        proc.stdin.write("go\n")
        proc.stdin.close()
        stderr = proc.stderr.read()
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
    assert result.exists(), f"the app did not finish its saga (exit {code}):\n{stderr}"
    assert result.read_text() == "completed"
    assert _left_running(database_url) == 0


def _run_app(database_url: str, mode: str, tmp_path: Path) -> tuple[str, str]:
    result = tmp_path / "status"
    proc = _spawn(database_url, mode, result)
    out, err = proc.communicate("go\n", timeout=60)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{out}\n{err}"
    assert result.read_text() == "completed"
    return out, err


def test_nothing_of_the_library_goes_to_stdout_by_default(
    database_url: str, tmp_path: Path
) -> None:
    """An app that configures nothing: stdout is its own, and info events are not shown."""
    out, err = _run_app(database_url, "default", tmp_path)
    assert out.splitlines() == ["LOG_APP READY"]
    assert "saga_started" not in err
    assert "attempt_succeeded" not in err


def test_an_app_configuring_logging_sees_the_events_at_info(
    database_url: str, tmp_path: Path
) -> None:
    """`logging.basicConfig(level=INFO)`: the events arrive on the "saga" logger, with fields."""
    out, err = _run_app(database_url, "logging_info", tmp_path)
    assert out.splitlines() == ["LOG_APP READY"]
    lines = err.splitlines()
    started = [line for line in lines if "saga_started" in line]
    assert started, err
    assert started[0].startswith("INFO:saga:saga_started")
    assert "saga_id=" in started[0]
    succeeded = [line for line in lines if "attempt_succeeded" in line and "step='ship'" in line]
    assert succeeded, err
    assert "idempotency_key='logged_job:v1::j-1:ship'" in succeeded[0], succeeded[0]


@pytest.fixture
def structlog_defaults() -> Iterator[None]:
    """structlog as an application that never configured it (the suite's autouse
    `_structlog_as_found` restores the configuration afterwards)."""
    structlog.reset_defaults()
    yield


class _Exploding(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.seen += 1
        raise RuntimeError("the log sink is down")


def _explode(logger: Any, method: str, event_dict: Any) -> Any:
    raise RuntimeError("the log processor is broken")


@pytest.mark.parametrize("how", ["logging_handler", "structlog_processor"])
def test_a_raising_log_handler_does_not_change_the_outcome(
    make_orch: Any, structlog_defaults: None, how: str
) -> None:
    """A handler (or a structlog processor) that raises: the saga ends as it would have,
    every event is still attempted, and the step's own `ctx.log` is the step's business."""
    saga = order_saga("log_sink_down")
    calls: list[str] = []

    @saga.step
    def reserve(ctx: StepContext, o: Order) -> dict:
        calls.append("reserve")
        return {}

    @saga.step
    def charge(ctx: StepContext, o: Order) -> dict:
        calls.append("charge")
        return {}

    handler = _Exploding()
    library = logging.getLogger("saga")
    previous_level = library.level
    if how == "logging_handler":
        library.addHandler(handler)
        library.setLevel(logging.INFO)
    else:
        structlog.configure(processors=[_explode])
    try:
        orch = make_orch(saga)
        state = orch.execute(saga, Order(order_id="o-1"))
    finally:
        library.removeHandler(handler)
        library.setLevel(previous_level)
    assert str(state.status) == "completed"
    assert calls == ["reserve", "charge"]
    assert "attempt_succeeded" in events(orch.history(state.id))
    if how == "logging_handler":
        # Every event after each step was still handed to the handler.
        assert handler.seen >= 4


def test_capture_logs_still_sees_the_library_events(make_orch: Any) -> None:
    """structlog's `capture_logs()` (the application's structlog) sees the bound events."""
    saga = order_saga("captured")

    @saga.step
    def only(ctx: StepContext, o: Order) -> dict:
        return {}

    orch = make_orch(saga)
    with structlog.testing.capture_logs() as logs:
        state = orch.execute(saga, Order(order_id="o-1"))
    names = [e["event"] for e in logs]
    assert "attempt_succeeded" in names
    entry = next(e for e in logs if e["event"] == "attempt_succeeded")
    assert entry["saga_id"] == state.id and entry["step"] == "only"


class _Keep(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_stdlib_records_carry_the_event_and_its_fields(
    make_orch: Any, structlog_defaults: None
) -> None:
    """A structured handler finds the event name and its bound fields on each record."""
    saga = order_saga("structured")

    @saga.step
    def only(ctx: StepContext, o: Order) -> dict:
        ctx.log.info("from_the_step", extra_field=1)
        return {}

    keep = _Keep()
    library = logging.getLogger("saga")
    previous_level = library.level
    library.addHandler(keep)
    library.setLevel(logging.INFO)
    try:
        state = make_orch(saga).execute(saga, Order(order_id="o-1"))
    finally:
        library.removeHandler(keep)
        library.setLevel(previous_level)
    by_event = {getattr(r, "saga_event", None): r for r in keep.records}
    done = by_event["attempt_succeeded"]
    assert done.name == "saga" and done.levelno == logging.INFO
    fields = getattr(done, "saga_fields", {})
    assert fields["saga_id"] == state.id and fields["step"] == "only"
    assert fields["idempotency_key"] == "structured:v1:acme:o-1:only"
    step_fields = getattr(by_event["from_the_step"], "saga_fields", {})
    assert step_fields["extra_field"] == 1 and step_fields["attempt"] == 1
