"""The saga app of the telemetry tests, run by `saga worker --app telemetry_app:orch` in
child processes, and imported by the tests to start its sagas.

`traced_order` charges (a transient error on the first two attempts, then success, with a
refund as compensation) and ships. Shipping is where the tests steer it:

- `TELEMETRY_APP_BLOCK` names a file: `ship` writes the file, then blocks for good (the
  parent SIGKILLs the process there, leaving the attempt's outcome unknown);
- otherwise `ship` raises `PermanentError`, so the saga compensates; its reconcile hook
  answers `Absent` (nothing was shipped), so an unknown attempt is tried again.

With `TELEMETRY_APP_SPANS` naming a file, the process configures the OpenTelemetry SDK
and writes each span, as it ends, as one JSON line to that file (flushed at once, so a
SIGKILL loses only the spans still open). The lease is 1 second, so a second worker takes
a killed worker's saga over quickly.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel

from saga import (
    Absent,
    Orchestrator,
    PermanentError,
    RetryPolicy,
    Saga,
    StepContext,
    TransientError,
)

ENV_BLOCK = "TELEMETRY_APP_BLOCK"
ENV_SPANS = "TELEMETRY_APP_SPANS"
LEASE_SECONDS = 1.0


class Order(BaseModel):
    """Input of `traced_order`."""

    order_id: str
    amount_cents: int = 700


traced_order = Saga("traced_order", input=Order, key=lambda o: o.order_id)


@traced_order.step(retry=RetryPolicy(max_attempts=3, initial_delay=0.01, max_delay=0.02))
def charge(ctx: StepContext, order: Order) -> dict[str, str]:
    """Fails twice with a transient error, then charges."""
    if ctx.attempt < 3:
        raise TransientError(f"gateway busy (attempt {ctx.attempt})")
    return {"charge_id": f"ch-{order.order_id}"}


@charge.compensation(retry=RetryPolicy(max_attempts=3, initial_delay=0.01, max_delay=0.02))
def refund(ctx: StepContext, order: Order, result: dict[str, str]) -> None:
    """Refunds the charge."""


@traced_order.step
def ship(ctx: StepContext, order: Order) -> dict[str, str]:
    """Blocks for good when told to (the parent kills the process here), else fails for
    good, which compensates the saga."""
    marker = os.environ.get(ENV_BLOCK)
    if marker:
        Path(marker).write_text(ctx.saga_id)
        while True:
            time.sleep(1.0)
    raise PermanentError("no carrier serves this address")


@ship.reconcile
def find_shipment(ctx: StepContext, order: Order) -> Absent:
    """The carrier has no shipment under the key: nothing happened."""
    return Absent()


def _configure_tracing(path: str) -> None:
    """The OpenTelemetry SDK, exporting every span to `path` as a JSON line as it ends."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import (
        SimpleSpanProcessor,
        SpanExporter,
        SpanExportResult,
    )

    class JsonLinesExporter(SpanExporter):
        """Appends each span to a file, one JSON object a line, flushed at once."""

        def __init__(self, target: str) -> None:
            self._lock = threading.Lock()
            self._file = open(target, "a", encoding="utf-8")  # noqa: SIM115 - lives with the process

        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            with self._lock:
                for span in spans:
                    self._file.write(json.dumps(span_record(span)) + "\n")
                self._file.flush()
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            self._file.close()

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(path)))
    trace.set_tracer_provider(provider)


def span_record(span: object) -> dict[str, object]:
    """A finished span as JSON: name, ids (hex), parent, links, attributes, process."""
    from opentelemetry.sdk.trace import ReadableSpan

    assert isinstance(span, ReadableSpan) and span.context is not None
    return {
        "name": span.name,
        "trace_id": f"{span.context.trace_id:032x}",
        "span_id": f"{span.context.span_id:016x}",
        "parent_id": f"{span.parent.span_id:016x}" if span.parent is not None else None,
        "links": [f"{link.context.span_id:016x}" for link in span.links],
        "attributes": dict(span.attributes or {}),
        "status": span.status.status_code.name,
        "pid": os.getpid(),
    }


if os.environ.get(ENV_SPANS):
    _configure_tracing(os.environ[ENV_SPANS])

orch = Orchestrator(sagas=[traced_order], lease_seconds=LEASE_SECONDS)
