"""OpenTelemetry traces and metrics (saga.telemetry), checked with the SDK's in-memory
exporters in this process and with real `saga worker` processes.

The SDK is configured once for this process (`otel`): spans go to an in-memory exporter
only while this module's tests run (the gate), metrics to an in-memory reader. Each test
works with saga names, ids and traces of its own, so what other tests export does not
count.
"""

from __future__ import annotations

import ast
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import textwrap
import threading
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
import telemetry_app
from opentelemetry import metrics, trace
from opentelemetry.context import Context
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel
from support import wait_until

from saga import (
    AsyncOrchestrator,
    Orchestrator,
    PermanentError,
    RetryPolicy,
    Saga,
    SagaState,
    StepContext,
    TransientError,
    telemetry,
)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PACKAGE = ROOT / "saga"
FAST = RetryPolicy(max_attempts=3, initial_delay=0.01, max_delay=0.02)
# The only attributes a metric of the orchestrator may have (no id, key or tenant).
METRIC_ATTRIBUTES = {"saga", "step", "kind", "outcome"}


class _Gate(SpanProcessor):
    """Passes ended spans on while this module's tests run, drops them after."""

    def __init__(self, inner: SpanProcessor) -> None:
        self.inner = inner
        self.open = False

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        return None

    def on_end(self, span: ReadableSpan) -> None:
        if self.open:
            self.inner.on_end(span)

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


@dataclass
class Otel:
    """The SDK of this process, as the tests read it."""

    spans: InMemorySpanExporter
    reader: InMemoryMetricReader

    def finished(self, trace_id: int) -> list[ReadableSpan]:
        return [
            s
            for s in self.spans.get_finished_spans()
            if s.context is not None and s.context.trace_id == trace_id
        ]

    def points(self, name: str, saga: str) -> list[tuple[dict[str, Any], Any]]:
        """(attributes, data point) of metric `name` whose saga attribute is `saga`."""
        data = self.reader.get_metrics_data()
        found: list[tuple[dict[str, Any], Any]] = []
        for resource in data.resource_metrics if data is not None else ():
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    if metric.name != name:
                        continue
                    for point in metric.data.data_points:
                        attributes = dict(point.attributes or {})
                        if attributes.get("saga") == saga:
                            found.append((attributes, point))
        return found

    def all_points(self) -> list[tuple[str, dict[str, Any]]]:
        data = self.reader.get_metrics_data()
        return [
            (metric.name, dict(point.attributes or {}))
            for resource in (data.resource_metrics if data is not None else ())
            for scope in resource.scope_metrics
            for metric in scope.metrics
            for point in metric.data.data_points
        ]


_SDK: Otel | None = None
_GATE: _Gate | None = None


@pytest.fixture(scope="module")
def otel() -> Iterator[Otel]:
    """The OpenTelemetry SDK, configured once per process, its spans kept in memory while
    this module runs."""
    global _SDK, _GATE
    if _SDK is None or _GATE is None:
        exporter = InMemorySpanExporter()
        gate = _Gate(SimpleSpanProcessor(exporter))
        current = trace.get_tracer_provider()
        if isinstance(current, TracerProvider):
            current.add_span_processor(gate)
        elif isinstance(current, trace.ProxyTracerProvider):
            provider = TracerProvider()
            provider.add_span_processor(gate)
            trace.set_tracer_provider(provider)
        else:
            pytest.skip(f"another TracerProvider is set in this process: {current!r}")
        reader = InMemoryMetricReader()
        if type(metrics.get_meter_provider()).__name__ != "_ProxyMeterProvider":
            pytest.skip("another MeterProvider is set in this process")
        # No collection at exit: a gauge would read a database other tests left behind.
        metrics.set_meter_provider(MeterProvider(metric_readers=[reader], shutdown_on_exit=False))
        _SDK, _GATE = Otel(exporter, reader), gate
    _GATE.open = True
    try:
        yield _SDK
    finally:
        _GATE.open = False
        _SDK.spans.clear()


def _unique(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(3)}"


# ----- one trace across a SIGKILL ----------------------------------------------------------


def _worker_env(database_url: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SAGA_", "TELEMETRY_APP"))}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(ROOT)])
    env["SAGA_DATABASE_URL"] = database_url
    env.update(extra)
    return env


class WorkerProcess:
    """`saga worker --app telemetry_app:orch` in a child process; its stderr is read as it
    comes (for the metrics address)."""

    def __init__(self, database_url: str, *args: str, **env: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "saga", "worker", "--app", "telemetry_app:orch", *args],
            env=_worker_env(database_url, **env),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.stderr: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line)

    def stop(self, signum: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signum)
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"worker did not stop:\n{''.join(self.stderr)}") from None
        self.close()
        return code

    def close(self) -> None:
        """Kill the worker if it still runs; close its pipe once it is read."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout=5.0)
        if self.proc.stderr is not None:
            self.proc.stderr.close()


@pytest.fixture
def worker_processes() -> Iterator[list[WorkerProcess]]:
    started: list[WorkerProcess] = []
    yield started
    for proc in started:
        proc.close()


def _status(orch: Orchestrator, saga_id: str) -> str:
    return str(orch.get(saga_id).status)


def test_a_saga_resumed_in_another_process_after_sigkill_is_one_trace_with_its_request(
    database_url: str, tmp_path: Path, otel: Otel, worker_processes: list[WorkerProcess]
) -> None:
    """A request starts a saga; a worker retries its first step and is SIGKILLed in the
    second; another worker reconciles, retries, fails and compensates. Every span, of both
    processes, is in the request's trace: each `saga.run` is a child of the request, each
    attempt a child of its process's `saga.run` (the killed process's never ended, so it
    was never exported), and no attribute carries a key."""
    tracer = trace.get_tracer("test")
    with Orchestrator(database_url, sagas=[telemetry_app.traced_order]) as orch:
        with tracer.start_as_current_span("POST /orders") as request:
            handle = orch.start(telemetry_app.traced_order, telemetry_app.Order(order_id="o-71"))
        origin = request.get_span_context()
        spans_file, marker = tmp_path / "spans.jsonl", tmp_path / "shipping"

        first = WorkerProcess(
            database_url,
            TELEMETRY_APP_SPANS=str(spans_file),
            TELEMETRY_APP_BLOCK=str(marker),
        )
        worker_processes.append(first)
        wait_until(marker.exists, timeout=60)
        assert first.stop(signal.SIGKILL) == -signal.SIGKILL
        second = WorkerProcess(database_url, TELEMETRY_APP_SPANS=str(spans_file))
        worker_processes.append(second)
        wait_until(lambda: _status(orch, handle.id) == "compensated", timeout=60)
        assert second.stop() == 0, "".join(second.stderr)
        history = orch.history(handle.id)
        operations = orch.get(handle.id).operations

    spans = [json.loads(line) for line in spans_file.read_text().splitlines()]
    assert {s["trace_id"] for s in spans} == {f"{origin.trace_id:032x}"}
    request_id = f"{origin.span_id:016x}"
    killed = [s for s in spans if s["pid"] == first.proc.pid]
    resumed = [s for s in spans if s["pid"] == second.proc.pid]
    assert len(killed) + len(resumed) == len(spans)

    def shape(group: list[dict[str, Any]]) -> list[tuple[str, Any, Any, Any]]:
        return [
            (
                s["name"],
                s["attributes"].get("saga.step.name"),
                s["attributes"].get("saga.attempt"),
                s["attributes"]["saga.outcome"],
            )
            for s in group
        ]

    # The killed worker: three attempts of charge, then it died inside ship, whose span and
    # the saga.run they all belong to never ended.
    assert shape(killed) == [
        ("saga.step", "charge", 1, "retry"),
        ("saga.step", "charge", 2, "retry"),
        ("saga.step", "charge", 3, "succeeded"),
    ]
    assert killed[0]["attributes"]["error.type"] == "saga.errors.TransientError"
    lost_run = {s["parent_id"] for s in killed}
    assert len(lost_run) == 1 and lost_run.isdisjoint({s["span_id"] for s in spans} | {request_id})

    # The worker that took over: the unknown ship reconciled (absent), retried (failed for
    # good), charge compensated, all in one saga.run under the request.
    assert shape(resumed) == [
        ("saga.reconcile", "ship", 1, "absent"),
        ("saga.step", "ship", 2, "failed"),
        ("saga.compensate", "charge", 1, "succeeded"),
        ("saga.run", None, None, "compensated"),
    ]
    run = resumed[-1]
    assert run["parent_id"] == request_id
    assert run["attributes"]["saga.id"] == handle.id
    assert {s["parent_id"] for s in resumed[:-1]} == {run["span_id"]}
    assert resumed[1]["attributes"]["error.type"] == "saga.errors.PermanentError"
    assert resumed[1]["status"] == "ERROR"

    # The audit trail tells the same story.
    assert [e.event for e in history].count("lease_acquired") == 2
    # Keys and request hashes were not opted in.
    keys = {"o-71", *(op.idempotency_key for op in operations)}
    for span in spans:
        assert not {"saga.key", "saga.idempotency_key", "saga.request_hash"} & set(
            span["attributes"]
        )
        assert not any(k in str(v) for v in span["attributes"].values() for k in keys)


# ----- counters equal the audit trail ---------------------------------------------------


class Item(BaseModel):
    """Input of the counted saga: `plan` says how it goes."""

    item_id: str
    plan: str = "ok"


def _counted_saga(name: str) -> Saga[Item]:
    counted: Saga[Item] = Saga(name, input=Item, key=lambda i: i.item_id)

    @counted.step(retry=FAST)
    def reserve(ctx: StepContext, item: Item) -> dict[str, int]:
        if item.plan == "retry" and ctx.attempt == 1:
            raise TransientError("stock service busy")
        return {"reserved": ctx.attempt}

    @reserve.compensation(retry=FAST)
    def release(ctx: StepContext, item: Item, result: dict[str, int]) -> None:
        if ctx.attempt == 1:
            raise TransientError("stock service busy")

    @counted.step
    def pay(ctx: StepContext, item: Item) -> None:
        if item.plan == "fail":
            raise PermanentError("card declined")
        if item.plan == "unknown":
            raise RuntimeError("the gateway's answer could not be parsed")

    return counted


def _expected_from_history(histories: list[list[Any]]) -> dict[tuple[str, str, str, str], int]:
    """(kind, step, outcome) counts of attempts' ends, as the audit trail records them."""
    outcomes = {
        "attempt_succeeded": "succeeded",
        "outcome_unknown": "unknown",
        "attempt_not_called": "not_called",
    }
    counted: Counter[tuple[str, str, str, str]] = Counter()
    for history in histories:
        for e in history:
            if e.event == "attempt_failed":
                outcome = "retry" if e.detail.get("retryable") else "failed"
            elif e.event in outcomes:
                outcome = outcomes[e.event]
            else:
                continue
            counted[(str(e.kind), str(e.step), outcome, "")] += 1
    return dict(counted)


def test_counters_after_a_scripted_run_equal_what_the_audit_trail_says(
    database_url: str, otel: Otel
) -> None:
    """Four sagas (completed, completed after a retry, compensated with a retried
    compensation, parked on an unknown outcome), driven by execute() and a worker: the
    attempts counted by step and outcome, the drives by outcome and the step durations
    equal what their audit trails record; the gauges read the database; no metric has an
    attribute but saga, step, kind and outcome."""
    name = _unique("counted")
    counted = _counted_saga(name)
    with Orchestrator(database_url, sagas=[counted]) as orch:
        ids = [orch.execute(counted, Item(item_id="i-ok")).id]
        ids += [orch.start(counted, Item(item_id=f"i-{p}", plan=p)).id for p in ("retry", "fail")]
        ids.append(orch.start(counted, Item(item_id="i-unknown", plan="unknown")).id)
        orch.worker(concurrency=2).run(until_idle=True)
        states: list[SagaState] = [orch.get(i) for i in ids]
        assert [s.status for s in states] == [
            "completed",
            "completed",
            "compensated",
            "needs_review",
        ]
        histories = [orch.history(i) for i in ids]

        unwatch = telemetry.watch_database(
            f"{database_url}#{name}", orch.store.database_gauges, [name]
        )
        try:
            # The first collection after the run: the SDK hands each exemplar out once.
            durations = otel.points("saga_step_duration_seconds", name)
            gauges = {
                metric: otel.points(metric, name)
                for metric in (
                    "saga_needs_review",
                    "saga_unknown_outcomes",
                    "saga_oldest_runnable_age_seconds",
                )
            }
        finally:
            unwatch()

    expected = _expected_from_history(histories)
    seen: dict[tuple[str, str, str, str], int] = {}
    for metric, kind in (
        ("saga_step_attempts_total", "action"),
        ("saga_compensations_total", "compensation"),
    ):
        for attributes, point in otel.points(metric, name):
            key = (kind, attributes["step"], attributes["outcome"], "")
            seen[key] = int(point.value)
    assert seen == expected
    assert expected[("action", "reserve", "retry", "")] == 1
    assert expected[("compensation", "reserve", "retry", "")] == 1
    assert expected[("action", "pay", "unknown", "")] == 1

    runs = {a["outcome"]: int(p.value) for a, p in otel.points("saga_runs_total", name)}
    ends = Counter(
        e.event
        for h in histories
        for e in h
        if e.event in ("saga_completed", "saga_compensated", "saga_parked")
    )
    assert runs == {
        "completed": ends["saga_completed"],
        "compensated": ends["saga_compensated"],
        "needs_review": ends["saga_parked"],
    }
    acquired = sum(1 for h in histories for e in h if e.event == "lease_acquired")
    assert sum(runs.values()) == acquired

    calls = Counter(
        (str(e.kind), str(e.step)) for h in histories for e in h if e.event == "attempt_started"
    )
    timed = Counter[tuple[str, str]]()
    for attributes, point in durations:
        timed[(attributes["kind"], attributes["step"])] += int(point.count)
    assert timed == calls

    # The exemplars the SDK keeps of the step durations link to the spans of the calls
    # they timed (saga.step, saga.compensate), not to the drive around them.
    calls_spans = {
        s.context.span_id: s.name
        for s in otel.spans.get_finished_spans()
        if s.context is not None
        and s.name in ("saga.step", "saga.compensate")
        and (s.attributes or {}).get("saga.name") == name
    }
    exemplars = [e for _, p in durations for e in p.exemplars]
    assert exemplars
    assert all(e.span_id in calls_spans for e in exemplars), (exemplars, calls_spans)

    assert [int(p.value) for _, p in gauges["saga_needs_review"]] == [1]
    assert [int(p.value) for _, p in gauges["saga_unknown_outcomes"]] == [1]
    assert [float(p.value) for _, p in gauges["saga_oldest_runnable_age_seconds"]] == [0.0]

    forbidden = {*ids, "i-ok", "i-retry", "i-fail", "i-unknown"}
    for metric, attributes in otel.all_points():
        if metric.startswith("saga_"):
            assert set(attributes) <= METRIC_ATTRIBUTES, (metric, attributes)
            assert not forbidden & {str(v) for v in attributes.values()}, (metric, attributes)


# ----- the metrics port of a real worker ------------------------------------------------


def _metrics_address(worker: WorkerProcess) -> str:
    def announced() -> str | None:
        for line in worker.stderr:
            found = re.search(r"metrics for Prometheus at (http://\S+/metrics)", line)
            if found:
                return found.group(1)
        assert worker.proc.poll() is None, "".join(worker.stderr)
        return None

    return wait_until(announced, timeout=60)


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        return str(response.read().decode("utf-8"))


def test_the_metrics_port_of_a_worker_serves_valid_prometheus_text(
    database_url: str, worker_processes: list[WorkerProcess]
) -> None:
    """`saga worker --metrics-port` serves the counters of the sagas it drove and the
    gauges of the database as Prometheus text that the Prometheus client's parser reads;
    no label carries a saga id or key."""
    probe_name = _unique("parked_probe")
    probe: Saga[Item] = Saga(probe_name, input=Item, key=lambda i: i.item_id)

    @probe.step
    def lookup(ctx: StepContext, item: Item) -> None:
        raise RuntimeError("parse error after the provider answered")

    with Orchestrator(database_url, sagas=[telemetry_app.traced_order, probe]) as orch:
        parked = orch.execute(probe, Item(item_id="p-1"))
        assert parked.status == "needs_review"
        driven = orch.start(telemetry_app.traced_order, telemetry_app.Order(order_id="o-9"))
        worker = WorkerProcess(database_url, "--metrics-port", "127.0.0.1:0")
        worker_processes.append(worker)
        url = _metrics_address(worker)
        wait_until(lambda: _status(orch, driven.id) == "compensated", timeout=60)

        def scraped() -> dict[tuple[str, frozenset[tuple[str, str]]], float] | None:
            samples = {
                (s.name, frozenset(s.labels.items())): s.value
                for family in text_string_to_metric_families(_scrape(url))
                for s in family.samples
            }
            done = {("saga", "traced_order"), ("outcome", "compensated")}
            counted = any(n == "saga_runs_total" and done <= ls for n, ls in samples)
            return samples if counted else None

        samples = wait_until(scraped, timeout=30)
        assert worker.stop() == 0, "".join(worker.stderr)

    def value(name: str, **labels: str) -> float:
        for (sample, got), v in samples.items():
            if sample == name and set(labels.items()) <= set(got):
                return v
        raise AssertionError(f"no sample {name} {labels} in {sorted(k[0] for k in samples)}")

    assert value("saga_runs_total", saga="traced_order", outcome="compensated") == 1
    assert (
        value("saga_step_attempts_total", saga="traced_order", step="charge", outcome="retry") == 2
    )
    assert (
        value("saga_step_attempts_total", saga="traced_order", step="ship", outcome="failed") == 1
    )
    assert (
        value("saga_compensations_total", saga="traced_order", step="charge", outcome="succeeded")
        == 1
    )
    assert (
        value("saga_step_duration_seconds_count", saga="traced_order", step="charge", kind="action")
        == 2
    )
    assert value("saga_needs_review", saga=probe_name) == 1
    assert value("saga_unknown_outcomes", saga=probe_name) == 1
    assert value("saga_oldest_runnable_age_seconds", saga="traced_order") == 0
    forbidden = {driven.id, parked.id, "o-9", "p-1"}
    for (sample, labels), _ in samples.items():
        if sample.startswith("saga_"):
            names = {k for k, _ in labels} - {
                "le",
                "otel_scope_name",
                "otel_scope_version",
                "otel_scope_schema_url",
            }
            assert names <= METRIC_ATTRIBUTES, (sample, labels)
            assert not forbidden & {v for _, v in labels}, (sample, labels)


# ----- the asyncio door, and keys when opted in -------------------------------------------


def test_the_asyncio_door_traces_execute_under_the_request_with_keys_when_opted_in(
    database_url: str, otel: Otel
) -> None:
    """`AsyncOrchestrator.execute` inside a request's span: its saga.run is a child of the
    request, each step a child of the run and current while it runs (a span the step
    makes is its child); with `telemetry_keys=True` the spans carry the key and each
    operation's idempotency key and request hash."""
    import asyncio

    name = _unique("async_traced")
    traced: Saga[Item] = Saga(name, input=Item, key=lambda i: i.item_id)
    tracer = trace.get_tracer("test")

    @traced.step
    async def quote(ctx: StepContext, item: Item) -> None:
        with tracer.start_as_current_span("GET /quote"):
            await asyncio.sleep(0)

    @traced.step
    def book(ctx: StepContext, item: Item) -> None:  # sync: run in a thread
        with tracer.start_as_current_span("POST /booking"):
            pass

    async def main() -> tuple[SagaState, trace.SpanContext]:
        async with AsyncOrchestrator(database_url, sagas=[traced], telemetry_keys=True) as orch:
            with tracer.start_as_current_span("POST /trips") as request:
                state = await orch.execute(traced, Item(item_id="trip-5"))
            return state, request.get_span_context()

    state, origin = asyncio.run(main())
    assert state.status == "completed"
    finished = otel.finished(origin.trace_id)
    assert Counter(s.name for s in finished) == {
        "POST /trips": 1,
        "saga.run": 1,
        "saga.step": 2,
        "GET /quote": 1,
        "POST /booking": 1,
    }
    spans = {s.name: s for s in finished}
    by_step = {
        s.attributes["saga.step.name"]: s
        for s in otel.finished(origin.trace_id)
        if s.name == "saga.step" and s.attributes is not None
    }
    run = spans["saga.run"]
    assert run.parent is not None and run.parent.span_id == origin.span_id
    for step, child in (("quote", "GET /quote"), ("book", "POST /booking")):
        attempt = by_step[step]
        assert attempt.parent is not None and run.context is not None
        assert attempt.parent.span_id == run.context.span_id
        assert attempt.attributes is not None
        assert attempt.attributes["saga.outcome"] == "succeeded"
        operation = state.operation(step)
        assert attempt.attributes["saga.idempotency_key"] == operation.idempotency_key
        assert attempt.attributes["saga.request_hash"] == operation.request_hash
        assert attempt.attributes["saga.key"] == "trip-5"
        inner = spans[child]
        assert inner.parent is not None and attempt.context is not None
        assert inner.parent.span_id == attempt.context.span_id
    assert run.attributes is not None and run.attributes["saga.key"] == "trip-5"


# ----- without OpenTelemetry -------------------------------------------------------------

_WITHOUT_OTEL = textwrap.dedent(
    """
    import sys
    sys.modules["opentelemetry"] = None  # as if the otel extra were not installed

    import psycopg
    from pydantic import BaseModel
    from saga import Orchestrator, Saga, StepContext, telemetry

    class Item(BaseModel):
        item_id: str

    plain = Saga("untraced", input=Item, key=lambda i: i.item_id)

    @plain.step
    def only(ctx: StepContext, item: Item) -> None:
        return None

    assert telemetry._API is False
    assert telemetry.watch_run(None, keys=True) is None  # type: ignore[arg-type]
    assert telemetry.capture_context() is None
    with Orchestrator(sys.argv[1], sagas=[plain]) as orch:
        state = orch.execute(plain, Item(item_id="u-1"))
        assert state.status == "completed", state
    with psycopg.connect(sys.argv[1]) as conn:
        row = conn.execute("SELECT trace_context FROM saga.sagas WHERE id = %s", (state.id,))
        assert row.fetchone() == (None,)
    print("NO-OP OK")
    """
)

_API_WITHOUT_SDK = textwrap.dedent(
    """
    from opentelemetry import trace
    from saga import telemetry

    assert telemetry._API is True
    assert telemetry.watch_run(None, keys=True) is None  # nothing configured
    assert telemetry.watch_call(None, None, session=False, keys=True) is None
    with trace.get_tracer("t").start_as_current_span("request"):
        assert telemetry.capture_context() is None  # a non-recording placeholder span
    telemetry.record_events("x", [])
    print("NO-OP OK")
    """
)


@pytest.mark.parametrize("script", [_WITHOUT_OTEL, _API_WITHOUT_SDK], ids=["no-api", "no-sdk"])
def test_without_opentelemetry_or_an_sdk_everything_is_a_no_op(
    database_url: str, script: str
) -> None:
    """Without the API (the extra not installed), or with it but no SDK configured, the
    flows are not wrapped, no trace context is captured, and sagas run as ever."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SAGA_", "OTEL_"))}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        [sys.executable, "-c", script, database_url],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0 and "NO-OP OK" in done.stdout, done.stdout + done.stderr


_CORE = ("rows", "protocol", "ceilings", "confirmations", "interventions", "inputs", "effects")


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            if node.module == "saga":
                found.update(f"saga.{alias.name}" for alias in node.names)
    return found


def test_the_core_never_imports_the_telemetry() -> None:
    """No module of the core reaches saga.telemetry or opentelemetry, even for typing."""
    seen: set[str] = set()
    stack = [f"saga.{name}" for name in _CORE]
    while stack:
        module = stack.pop()
        if module in seen:
            continue
        seen.add(module)
        path = PACKAGE / f"{module.removeprefix('saga.')}.py"
        if path.exists():
            stack.extend(m for m in _imports(path) if m.startswith("saga."))
    assert "saga.telemetry" not in seen
    reached = {
        m
        for module in seen
        if (PACKAGE / f"{module[5:]}.py").exists()
        for m in _imports(PACKAGE / f"{module[5:]}.py")
    }
    assert not {m for m in reached if m.split(".")[0] == "opentelemetry"}


def test_the_trace_context_column_is_nullable(database_url: str) -> None:
    """Migration 0018 adds one nullable column (old INSERTs still work)."""
    with psycopg.connect(database_url) as conn:
        row = conn.execute(
            "SELECT is_nullable, data_type FROM information_schema.columns "
            "WHERE table_schema = 'saga' AND table_name = 'sagas' AND column_name = 'trace_context'"
        ).fetchone()
    assert row == ("YES", "jsonb")
