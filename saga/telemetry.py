"""OpenTelemetry traces and metrics of the drivers, optional: the one module that uses it.

With `opentelemetry-api` (the `otel` extra) and an SDK the application configured, the
drivers report:

- spans `saga.run` (one drive of a saga by a worker, `run`, `execute`...), `saga.step`
  and `saga.compensate` (one attempt's call of user code), `saga.reconcile` (one call of
  a reconcile hook), with `saga.id`, `saga.name`, `saga.step.name`, `saga.attempt`,
  `saga.outcome` and `error.type`; keys, tenant, idempotency keys and request hashes only
  when opted in (`Orchestrator(telemetry_keys=True)` or `SAGA_OTEL_INCLUDE_KEYS=1`),
  since they can carry personal data. Exception messages are never recorded.
- the W3C trace context of the code that starts a saga, stored on its row
  (`capture_context`), becomes the parent of every `saga.run` of that saga, in whichever
  process drives it: one trace shows the request and the saga it started.
- metrics (`Metric names` below), counted from the audit events the drivers commit, so
  that they agree with `orch.history()`; and gauges read from PostgreSQL by one small
  query when they are collected (`watch_database`). No saga id, key or tenant is ever an
  attribute of a metric.

Without the API installed, every function here returns at once (a traced flow is the flow
itself); with the API but no SDK configured (the global providers are still the API's
placeholders), likewise, checked at each use, so an SDK configured later is picked up.
The core (`saga._core`: the planner, its rows and inputs) never imports this module.
"""

from __future__ import annotations

import inspect
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from saga.errors import LeaseLost
from saga.logs import get_logger
from saga.state import OperationStatus, SagaStatus

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.metrics import CallbackOptions, Histogram, Observation
    from opentelemetry.trace import Link, Span, Tracer

    from saga._core.planner import OpRow, Planner, SagaRow
    from saga._core.rows import Event
    from saga.state import DatabaseGauges

try:
    from opentelemetry import context as _context
    from opentelemetry import metrics as _metrics
    from opentelemetry import trace as _trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # the `otel` extra is not installed: everything here is a no-op
    _API = False
else:
    _API = True

__all__ = [
    "ENV_INCLUDE_KEYS",
    "METRIC_NAMES",
    "MetricsUnavailable",
    "capture_context",
    "include_keys",
    "record_events",
    "serve_prometheus",
    "watch_database",
]

_log = get_logger("saga")

# Opt-in to keys, tenants, idempotency keys and request hashes as span attributes.
ENV_INCLUDE_KEYS = "SAGA_OTEL_INCLUDE_KEYS"
# The instrumentation scope of every span and metric.
SCOPE = "saga"

# Metric names (a contract: ../DESIGN.md, "Telemetry"), and their attributes.
RUNS = "saga_runs_total"  # {saga, outcome}: drives of a saga, by how they ended
STEP_ATTEMPTS = "saga_step_attempts_total"  # {saga, step, outcome}: attempts' outcomes
STEP_DURATION = "saga_step_duration_seconds"  # {saga, step, kind, outcome}: user code's call
COMPENSATIONS = "saga_compensations_total"  # {saga, step, outcome}: compensation attempts
LEASE_EXPIRATIONS = "saga_lease_expirations_total"  # {saga}: attempts cut off by a dead owner
FENCING_REJECTIONS = "saga_fencing_rejections_total"  # {saga}: drives ended by a lost lease
UNKNOWN_OUTCOMES = "saga_unknown_outcomes"  # {saga}: gauge, operations left unknown
NEEDS_REVIEW = "saga_needs_review"  # {saga}: gauge, sagas parked
OLDEST_RUNNABLE = "saga_oldest_runnable_age_seconds"  # {saga}: gauge, longest claimable wait
METRIC_NAMES = (
    RUNS,
    STEP_ATTEMPTS,
    STEP_DURATION,
    COMPENSATIONS,
    LEASE_EXPIRATIONS,
    FENCING_REJECTIONS,
    UNKNOWN_OUTCOMES,
    NEEDS_REVIEW,
    OLDEST_RUNNABLE,
)

# The audit events that say how an attempt ended, and the outcome each counts as.
_ATTEMPT_OUTCOMES = {
    "attempt_succeeded": "succeeded",
    "attempt_failed": "failed",  # "retry" when the failure is retried
    "outcome_unknown": "unknown",
    "attempt_not_called": "not_called",
}
# Step durations, in seconds: from a no-op call to a slow provider's.
_DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Span outcomes that mark the span's status as an error.
_ERROR_OUTCOMES = frozenset(
    {
        "failed",
        "retry",
        "unknown",
        "not_called",
        "inconclusive",
        "needs_review",
        "lease_lost",
        "error",
    }
)
# How long one reading of the database serves the gauges of a collection (seconds): the
# three gauges of one scrape share one query.
_READING_SECONDS = 1.0


class MetricsUnavailable(RuntimeError):
    """Metrics cannot be served: a package of the `otel` extra is missing, or the
    application configured a MeterProvider of its own."""


def include_keys(configured: bool | None) -> bool:
    """Whether spans carry keys and request hashes: `configured` when given, else
    `SAGA_OTEL_INCLUDE_KEYS` (1, true, yes or on)."""
    if configured is not None:
        return configured
    return os.environ.get(ENV_INCLUDE_KEYS, "").strip().lower() in ("1", "true", "yes", "on")


# ----- is anything configured? ------------------------------------------------------------

if _API:
    _UNSET_TRACERS: tuple[type[Any], ...] = (
        _trace.ProxyTracerProvider,
        _trace.NoOpTracerProvider,
    )
    try:  # the API's placeholder until an SDK is set (no public name for it)
        from opentelemetry.metrics._internal import _ProxyMeterProvider
    except ImportError:  # pragma: no cover - an API without it: only NoOp counts as unset
        _UNSET_METERS: tuple[type[Any], ...] = (_metrics.NoOpMeterProvider,)
    else:
        _UNSET_METERS = (_metrics.NoOpMeterProvider, _ProxyMeterProvider)
    # The module holding the API's global MeterProvider (see `_surely_unset`).
    _meters: Any = getattr(_metrics, "_internal", None)
    _PROPAGATOR = TraceContextTextMapPropagator()

_T = TypeVar("_T")


@lru_cache(maxsize=1)
def _scope_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("saga-orchestrator")
    except PackageNotFoundError:
        return None


class _PerProvider(Generic[_T]):
    """What is made from the configured provider (a tracer, the instruments): made on
    first use, under a lock so that it is made once, and made again when the application
    configures another provider."""

    def __init__(self, make: Callable[[Any], _T]) -> None:
        self._make = make
        self._made: tuple[object, _T] | None = None
        self._lock = threading.Lock()

    def of(self, provider: object, unset: tuple[type[Any], ...]) -> _T | None:
        """What `provider` makes; None when it is one of the `unset` placeholders."""
        if isinstance(provider, unset):
            return None
        made = self._made
        if made is not None and made[0] is provider:
            return made[1]
        with self._lock:
            made = self._made
            if made is not None and made[0] is provider:
                return made[1]
            thing = self._make(provider)
            self._made = (provider, thing)
        return thing


def _tracer() -> Tracer | None:
    """The tracer of the configured TracerProvider; None when none is configured."""
    if not _API or _surely_unset(_trace, "_TRACER_PROVIDER", _TRACER_ENV):
        return None
    return _tracers.of(_trace.get_tracer_provider(), _UNSET_TRACERS)


def _surely_unset(module: object, attribute: str, env: bytes | str) -> bool:
    """Whether no provider is configured, known without asking the API: its global
    (`attribute` of `module`) is still None and no environment variable names one.

    The API's `get_*_provider()` answers its placeholder then, but looks the variable up
    in `os.environ` on every call, which raises and catches a KeyError: microseconds on
    the path of every call of user code and every write, when nothing observes them. False
    whenever this cannot be told (another API layout): the API is asked as before."""
    return getattr(module, attribute, False) is None and env not in _ENVIRON


# What `os.environ` holds, keyed as it keys it (bytes on POSIX), to ask without a KeyError.
_ENVIRON: Any = getattr(os.environ, "_data", os.environ)
_ENCODE: Callable[[str], bytes | str] = getattr(os.environ, "encodekey", lambda name: name)
_TRACER_ENV = _ENCODE("OTEL_PYTHON_TRACER_PROVIDER")
_METER_ENV = _ENCODE("OTEL_PYTHON_METER_PROVIDER")


_tracers: _PerProvider[Tracer] = _PerProvider(
    lambda provider: provider.get_tracer(SCOPE, _scope_version())
)


class _Tally:
    """The counters' totals in this process, by metric and attributes: counting an event
    is a dict update under a lock, and the totals are reported by observable counters
    when metrics are collected (cumulative, as counters are). The SDK's synchronous
    counters cost tens of microseconds a measurement, on the path of every attempt."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals: dict[str, dict[tuple[tuple[str, str], ...], int]] = {
            name: {} for name in _COUNTERS
        }

    def add(self, metric: str, *attributes: tuple[str, str]) -> None:
        """Count one event of `metric` with these attributes (name, value pairs)."""
        totals = self._totals[metric]
        with self._lock:
            totals[attributes] = totals.get(attributes, 0) + 1

    def add_all(self, counted: Iterable[tuple[str, tuple[tuple[str, str], ...]]]) -> None:
        """Count one event for each (metric, attributes) pair, under one lock."""
        with self._lock:
            for metric, attributes in counted:
                totals = self._totals[metric]
                totals[attributes] = totals.get(attributes, 0) + 1

    def observer(self, metric: str) -> Callable[[CallbackOptions], Iterator[Observation]]:
        """The callback of the observable counter of `metric`."""

        def observe(options: CallbackOptions) -> Iterator[Observation]:
            with self._lock:
                totals = list(self._totals[metric].items())
            for attributes, total in totals:
                yield _metrics.Observation(total, dict(attributes))

        return observe


_COUNTERS = {
    RUNS: "Drives of a saga, by the status it was left in (outcome)",
    STEP_ATTEMPTS: "Attempts of steps, by outcome, as the audit trail says",
    COMPENSATIONS: "Attempts of compensations, by outcome, as the audit trail says",
    LEASE_EXPIRATIONS: "Attempts found running under an expired lease (their owner died)",
    FENCING_REJECTIONS: "Drives ended because another owner had taken the saga's lease over",
}
_tally = _Tally()


@dataclass(frozen=True, slots=True)
class _Instruments:
    """What the drivers record into, for one MeterProvider."""

    tally: _Tally
    duration: Histogram
    # Whether `duration.record` takes a context (API 1.27 and later): a point recorded in
    # the context of the call's span gives the SDK's exemplar that span, not `saga.run`.
    duration_in_context: bool


def _instruments() -> _Instruments | None:
    """The instruments of the configured MeterProvider (made on first use, with the
    database gauges); None when none is configured."""
    if not _API or _surely_unset(_meters, "_METER_PROVIDER", _METER_ENV):
        return None
    return _instruments_made.of(_metrics.get_meter_provider(), _UNSET_METERS)


_instruments_made: _PerProvider[_Instruments] = _PerProvider(
    lambda provider: _make_instruments(provider.get_meter(SCOPE, _scope_version()))
)


def _make_instruments(meter: Any) -> _Instruments:
    try:
        duration = meter.create_histogram(
            STEP_DURATION,
            unit="s",
            description="Time user code took in one attempt of a step or a compensation",
            explicit_bucket_boundaries_advisory=list(_DURATION_BUCKETS),
        )
    except TypeError:  # an API before 1.23 takes no bucket advice
        duration = meter.create_histogram(
            STEP_DURATION,
            unit="s",
            description="Time user code took in one attempt of a step or a compensation",
        )
    for name, description in _COUNTERS.items():
        meter.create_observable_counter(
            name, callbacks=[_tally.observer(name)], description=description
        )
    meter.create_observable_gauge(
        NEEDS_REVIEW,
        callbacks=[_gauge("needs_review")],
        description="Sagas parked in needs_review, read from the database",
    )
    meter.create_observable_gauge(
        UNKNOWN_OUTCOMES,
        callbacks=[_gauge("unknown_outcomes")],
        description="Operations of open or parked sagas whose outcome is unknown",
    )
    meter.create_observable_gauge(
        OLDEST_RUNNABLE,
        callbacks=[_gauge("oldest_runnable_seconds")],
        unit="s",
        description="How long the longest-waiting claimable saga has waited",
    )
    return _Instruments(_tally, duration, _takes_context(duration.record))


def _takes_context(record: Callable[..., None]) -> bool:
    try:
        return "context" in inspect.signature(record).parameters
    except (TypeError, ValueError):  # pragma: no cover - a record without a signature
        return False


# ----- trace context ------------------------------------------------------------------------


def capture_context() -> dict[str, str] | None:
    """The W3C trace context (`traceparent`, `tracestate`) of the current span, to store
    with a saga being started; None when there is no valid span (or no OpenTelemetry)."""
    if not _API or not _trace.get_current_span().get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier or None


def _run_parent(stored: dict[str, str] | None) -> tuple[Context | None, list[Link]]:
    """The parent of a `saga.run` span and its links.

    The trace context stored when the saga was started is the parent, so every drive of
    the saga, in any process, is in the trace of the request that started it. When the
    code driving it here has a span of another trace (an operator's request calling
    `run`), that span is linked. Without a stored context, the current one is the parent.
    """
    current = _trace.get_current_span().get_span_context()
    if stored and current.is_valid and f"{current.trace_id:032x}" in stored.get("traceparent", ""):
        return None, []  # driven by its starter (`execute`): the current span
    if stored:
        origin = _PROPAGATOR.extract(stored)
        started = _trace.get_current_span(origin).get_span_context()
        if started.is_valid:
            if current.is_valid and current.trace_id == started.trace_id:
                return None, []  # driven by its starter (`execute`): the current span
            links = [_trace.Link(current)] if current.is_valid else []
            return origin, links
    return None, []


# ----- spans of drives and calls --------------------------------------------------------------


@dataclass(slots=True)
class RunWatch:
    """A drive of one saga being traced (`saga.run`) and counted (`saga_runs_total`)."""

    saga: str
    instruments: _Instruments | None
    span: Span | None = None
    token: object = None


def watch_run(saga: SagaRow, *, keys: bool) -> RunWatch | None:
    """Begin the `saga.run` span of a drive of `saga`, made current until `end_run`; None
    when nothing is configured."""
    tracer, instruments = _tracer(), _instruments()
    if tracer is None and instruments is None:
        return None
    watch = RunWatch(saga.name, instruments)
    if tracer is not None:
        parent, links = _run_parent(saga.trace_context)
        attributes: dict[str, str | int] = {
            "saga.id": saga.id,
            "saga.name": saga.name,
            "saga.version": saga.version,
        }
        if keys:
            attributes.update({"saga.key": saga.key, "saga.tenant_id": saga.tenant_id})
        watch.span = tracer.start_span(
            "saga.run", context=parent, links=links, attributes=attributes
        )
        watch.token = _context.attach(_trace.set_span_in_context(watch.span))
    return watch


def end_run(
    watch: RunWatch, status: SagaStatus | None, failure: BaseException | None = None
) -> None:
    """End a drive's span, and count it by how it ended: the status it left the saga in
    (None: the lease was lost), or `failure`, what it raised (`abandoned` for a flow
    closed unfinished)."""
    if failure is None:
        outcome = _run_outcome(status)
    else:
        outcome = "abandoned" if isinstance(failure, GeneratorExit) else "error"
    if watch.span is not None:
        _close(watch.span, outcome, failure)
        _context.detach(watch.token)  # type: ignore[arg-type]
    if watch.instruments is not None:
        watch.instruments.tally.add(RUNS, ("saga", watch.saga), ("outcome", outcome))
        if outcome == "lease_lost":
            watch.instruments.tally.add(FENCING_REJECTIONS, ("saga", watch.saga))


def _run_outcome(status: SagaStatus | None) -> str:
    """How a drive ended: the status it left the saga in (completed, compensated,
    needs_review, awaiting_confirmation, cancelled), `handed_back` when the saga is still
    runnable (a long backoff, a shutdown), `lease_lost` when another owner took it over."""
    if status is None:
        return "lease_lost"
    if status.is_runnable:
        return "handed_back"
    return status.value


@dataclass(slots=True)
class CallWatch:
    """The one call of user code of an attempt (or of a reconcile) being timed and traced."""

    saga: SagaRow
    op: OpRow
    step: str
    reconcile: bool
    instruments: _Instruments | None
    span: Span | None = None
    token: object = None
    began: float = 0.0
    elapsed: float | None = None
    ended_ns: int | None = None
    error_type: str | None = None
    not_called: bool = False


def watch_call(
    saga: SagaRow, op: OpRow, *, session: bool, keys: bool, reconcile: bool = False
) -> CallWatch | None:
    """Begin timing the call of `op`'s attempt (or of its reconcile hook), in a span
    (`saga.step`, `saga.compensate` or `saga.reconcile`) made current while the code runs;
    None when nothing is configured. `call_returned` marks its end, `settle_call` ends the
    span with what the record of the call says."""
    tracer, instruments = _tracer(), _instruments()
    if tracer is None and instruments is None:
        return None
    step = step_label(op.step, session=session)
    return _begin_call(tracer, instruments, saga, op, step, keys, reconcile)


def call_returned(
    watch: CallWatch, failure: BaseException | None = None, *, not_called: bool = False
) -> None:
    """The call returned, or raised `failure` (`not_called`: the machinery could not make
    it): its time, and its span no longer current."""
    if failure is not None:
        watch.error_type = _error_type(failure)
        watch.not_called = not_called
    _end_call(watch)


def settle_call(watch: CallWatch, recorded: Planner | None, failure: BaseException | None) -> None:
    """End a call's span (at the time the call ended) and time it: with the outcome its
    record left in `recorded`, or, when the flow ended without recording it, by `failure`
    (`lease_lost`, `abandoned`, `error`)."""
    if watch.not_called:
        outcome = "not_called"
    elif recorded is not None:
        outcome = _call_outcome(recorded, watch.op, watch.reconcile)
    elif isinstance(failure, LeaseLost):
        outcome = "lease_lost"
    else:
        outcome = "abandoned" if isinstance(failure, GeneratorExit) else "error"
    _settle_call(watch, outcome)


def _begin_call(
    tracer: Tracer | None,
    instruments: _Instruments | None,
    saga: SagaRow,
    op: OpRow,
    step: str,
    keys: bool,
    reconcile: bool,
) -> CallWatch:
    watch = CallWatch(saga, op, step, reconcile, instruments)
    if tracer is not None:
        name = (
            "saga.reconcile"
            if reconcile
            else "saga.compensate"
            if op.kind == "compensation"
            else "saga.step"
        )
        attributes: dict[str, str | int] = {
            "saga.id": saga.id,
            "saga.name": saga.name,
            "saga.step.name": step,
            "saga.attempt": op.attempts,
        }
        if keys:
            attributes.update(
                {
                    "saga.key": saga.key,
                    "saga.tenant_id": saga.tenant_id,
                    "saga.operation": op.step,
                    "saga.idempotency_key": op.idempotency_key,
                    "saga.request_hash": op.request_hash,
                }
            )
        watch.span = tracer.start_span(name, attributes=attributes)
        watch.token = _context.attach(_trace.set_span_in_context(watch.span))
    watch.began = time.perf_counter()
    return watch


def _end_call(watch: CallWatch) -> None:
    """The call returned or raised: its time, and its span no longer current."""
    watch.elapsed = time.perf_counter() - watch.began
    watch.ended_ns = time.time_ns()
    if watch.token is not None:
        _context.detach(watch.token)  # type: ignore[arg-type]
        watch.token = None


def _settle_call(watch: CallWatch, outcome: str) -> None:
    """End the call's span (at the time the call ended) with its outcome, and time it."""
    instruments, saga, op, step = watch.instruments, watch.saga, watch.op, watch.step
    if watch.token is not None:  # the flow ended during the call itself
        _end_call(watch)
    if watch.span is not None:
        _close(watch.span, outcome, None, error_type=watch.error_type, end_ns=watch.ended_ns)
    if instruments is not None and not watch.reconcile and watch.elapsed is not None:
        attributes = _duration_attributes(saga.name, step, op.kind, outcome)
        if watch.span is not None and instruments.duration_in_context:
            # In the call's span: an exemplar of this point links to the step it timed.
            context = _trace.set_span_in_context(watch.span)
            instruments.duration.record(watch.elapsed, attributes, context=context)
        else:
            instruments.duration.record(watch.elapsed, attributes)


@lru_cache(maxsize=4096)
def _duration_attributes(saga: str, step: str, kind: str, outcome: str) -> dict[str, str]:
    # One dict per label set, made once: the SDK only reads it. Callers never change it.
    return {"saga": saga, "step": step, "kind": kind, "outcome": outcome}


def _call_outcome(after: Planner, op: OpRow, reconcile: bool) -> str:
    """The outcome of a call as its record left the operation: for an attempt succeeded,
    failed, unknown or retry (another attempt follows); for a reconcile found, absent (a
    retry with the same key follows) or inconclusive."""
    row = after.find(op.step, op.kind)
    status = row.status if row is not None else None
    if reconcile:
        if status == OperationStatus.SUCCEEDED:
            return "found"
        return "inconclusive" if status == OperationStatus.UNKNOWN else "absent"
    if status in (OperationStatus.SUCCEEDED, OperationStatus.FAILED, OperationStatus.UNKNOWN):
        return status.value
    return "retry"


def _close(
    span: Span,
    outcome: str,
    failure: BaseException | None,
    *,
    error_type: str | None = None,
    end_ns: int | None = None,
) -> None:
    """Set a span's outcome (and error type: never the message, which may carry personal
    data) and end it."""
    kind = _error_type(failure) if failure is not None else error_type
    if kind is None:
        span.set_attribute("saga.outcome", outcome)
    else:
        span.set_attributes({"saga.outcome": outcome, "error.type": kind})
    if outcome in _ERROR_OUTCOMES:
        span.set_status(_trace.Status(_trace.StatusCode.ERROR, outcome))
    span.end(end_time=end_ns)


def _error_type(exc: BaseException) -> str:
    cls = type(exc)
    return (
        cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    )


def step_label(step: str, *, session: bool) -> str:
    """The step of an operation as telemetry names it: a session call's operation name
    carries a digest of its key (`send_email.3f9a...`), left out to keep the durable
    step's name alone."""
    if session and "." in step:
        return step.rsplit(".", 1)[0]
    return step


# ----- counters from the audit events ------------------------------------------------------


def record_events(saga: str, events: Sequence[Event], *, session: bool = False) -> None:
    """Count the outcomes among audit events of saga `saga` that were just committed:
    each attempt's end in `saga_step_attempts_total` (actions) or
    `saga_compensations_total`, by outcome (succeeded, failed, retry, unknown,
    not_called); an attempt found running under an expired lease when the saga was
    claimed also in `saga_lease_expirations_total`."""
    if not events or not _API:
        return
    instruments = _instruments()
    if instruments is None:
        return
    ends = [e for e in events if e.event in _ATTEMPT_OUTCOMES and e.step is not None]
    if not ends:
        return
    claimed = any(e.event == "lease_acquired" for e in events)
    counted: list[tuple[str, tuple[tuple[str, str], ...]]] = []
    for event in ends:
        outcome = _ATTEMPT_OUTCOMES[event.event]
        if event.event == "attempt_failed" and event.detail.get("retryable"):
            outcome = "retry"
        metric = COMPENSATIONS if event.kind == "compensation" else STEP_ATTEMPTS
        step = step_label(str(event.step), session=session)
        counted.append((metric, (("saga", saga), ("step", step), ("outcome", outcome))))
        if claimed and event.event == "outcome_unknown":
            counted.append((LEASE_EXPIRATIONS, (("saga", saga),)))
    instruments.tally.add_all(counted)


# ----- gauges read from the database -------------------------------------------------------


@dataclass(slots=True)
class _Source:
    """A database the gauges read, registered by a running worker."""

    database: str
    read: Callable[[], Sequence[DatabaseGauges]]
    sagas: frozenset[str]


_sources: dict[int, _Source] = {}
_source_numbers = itertools.count()
_sources_lock = threading.Lock()
_reading: tuple[float, dict[str, dict[str, float]]] | None = None


def watch_database(
    database: str, read: Callable[[], Sequence[DatabaseGauges]], sagas: Iterable[str]
) -> Callable[[], None]:
    """Report the gauges of `database` (its URL: workers on the same one share one read)
    while a worker runs: `read` is called when metrics are collected (at most once a
    second), and the saga names `sagas` are reported at 0 when they have nothing to
    report. Returns the function that stops reporting it."""
    with _sources_lock:
        token = next(_source_numbers)
        _sources[token] = _Source(database, read, frozenset(sagas))
    _instruments()  # the gauges exist from now on, if metrics are configured

    def stop() -> None:
        with _sources_lock:
            _sources.pop(token, None)

    return stop


def _gauge(field: str) -> Callable[[CallbackOptions], Iterator[Observation]]:
    def observe(options: CallbackOptions) -> Iterator[Observation]:
        for saga, values in _read_databases().items():
            yield _metrics.Observation(values[field], {"saga": saga})

    return observe


def _read_databases() -> dict[str, dict[str, float]]:
    """The gauges' values per saga name, over every database watched (counts added, the
    longest wait kept), read at most once per `_READING_SECONDS`; a database that cannot
    be read is left out, with a warning."""
    global _reading
    with _sources_lock:
        now = time.monotonic()
        if _reading is not None and now - _reading[0] < _READING_SECONDS:
            return _reading[1]
        by_database: dict[str, list[_Source]] = {}
        for source in _sources.values():
            by_database.setdefault(source.database, []).append(source)
        values: dict[str, dict[str, float]] = {}
        for sources in by_database.values():
            for name in frozenset().union(*(s.sagas for s in sources)):
                values.setdefault(name, _zero())
            try:
                rows = sources[0].read()
            except Exception as exc:
                _log.warning("metrics_database_read_failed", error=f"{type(exc).__name__}: {exc}")
                continue
            for row in rows:
                into = values.setdefault(row.saga, _zero())
                into["needs_review"] += row.needs_review
                into["unknown_outcomes"] += row.unknown_outcomes
                into["oldest_runnable_seconds"] = max(
                    into["oldest_runnable_seconds"], row.oldest_runnable_seconds
                )
        _reading = (now, values)
        return values


def _zero() -> dict[str, float]:
    return {"needs_review": 0, "unknown_outcomes": 0, "oldest_runnable_seconds": 0.0}


# ----- serving metrics for Prometheus ----------------------------------------------------------


def serve_prometheus(port: int, host: str = "") -> int:
    """Serve this process's metrics for Prometheus at http://host:port/metrics (every
    interface when `host` is empty), through OpenTelemetry's Prometheus exporter and
    `prometheus_client`'s HTTP server, in a daemon thread; returns the port bound (`port`
    0 takes any free one). Sets the global MeterProvider: `MetricsUnavailable` when the
    application has set one already (add a `PrometheusMetricReader` to it instead), or
    when a package of the `otel` extra is missing."""
    try:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from opentelemetry.sdk.metrics import MeterProvider
        from prometheus_client import start_http_server
    except ImportError as exc:
        raise MetricsUnavailable(
            f"serving metrics needs the otel extra ({exc}): pip install 'saga-orchestrator[otel]'"
        ) from None
    if not isinstance(_metrics.get_meter_provider(), _UNSET_METERS):
        raise MetricsUnavailable(
            "the application has configured a MeterProvider of its own: give it a "
            "opentelemetry.exporter.prometheus.PrometheusMetricReader and serve it with "
            "prometheus_client.start_http_server, or leave out --metrics-port"
        )
    server, _thread = start_http_server(port, addr=host or "0.0.0.0")
    _metrics.set_meter_provider(MeterProvider(metric_readers=[PrometheusMetricReader()]))
    _instruments()
    return int(server.server_port)
