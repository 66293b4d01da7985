"""What the drivers observe at the boundary of each effect: fault points, spans and metrics,
and the log of committed audit events.

The flows (`saga._flows`) say what an effect is and attach a `Watch` to the ones worth
observing; `saga._drivers.boundary` carries every effect out and tells an `Observer` (one
per flow it runs) what happened. Nothing here decides anything about a saga: a fault point
does nothing unless `saga.testing` armed it, a span nothing unless telemetry is configured,
and an event is logged only once its transaction has committed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from saga import telemetry
from saga._core.planner import Event, Planner, SagaRow
from saga._drivers import faults
from saga._flows.effects import Call, Drive, NotCalledError, Point, Watch
from saga.logs import events_logger

__all__ = ["Observer", "log_event", "log_events"]

_events = events_logger()


class Observer:
    """Observes the effects of one flow as its driver carries them out: at most one drive
    and one call of user code are traced at a time, and a call's span stays open from the
    call's end until the write that records its outcome (or the end of the flow)."""

    __slots__ = ("_call", "_failure", "_keys", "_run")

    def __init__(self, *, keys: bool) -> None:
        self._keys = keys
        self._run: telemetry.RunWatch | None = None
        self._call: telemetry.CallWatch | None = None
        # The last error an effect raised into the flow since the call being traced.
        self._failure: BaseException | None = None

    def before(self, effect: Any, watch: Watch) -> None:
        """`effect` is about to be carried out."""
        if watch.before is not None and faults.armed is not None:
            _point(watch.before)
        if watch.span is not None and type(effect) is Call and watch.op is not None:
            if self._call is not None:
                self._settle(None)  # a call never recorded: closed as an error
            planner = watch.planner
            self._call = telemetry.watch_call(
                planner.saga,
                watch.op,
                session=planner.definition.is_session,
                keys=self._keys,
                reconcile=watch.span == "reconcile",
            )
            self._failure = None

    def done(self, effect: Any, watch: Watch) -> None:
        """`effect` succeeded (a call returned); for a write, it has committed."""
        if type(effect) is Call:
            if self._call is not None and watch.span is not None:
                telemetry.call_returned(self._call)
        elif watch.events:
            log_events(watch.planner, watch.events)
        if watch.after is not None and faults.armed is not None:
            _point(watch.after)
        if watch.records and self._call is not None:
            call, self._call = self._call, None
            telemetry.settle_call(call, watch.planner, None)

    def failed(self, effect: Any, watch: Watch | None, exc: BaseException) -> None:
        """`effect` raised `exc` into the flow."""
        self._failure = exc
        if watch is None or type(effect) is not Call:
            return
        if self._call is not None and watch.span is not None:
            telemetry.call_returned(self._call, exc, not_called=isinstance(exc, NotCalledError))
        if watch.after is not None and faults.armed is not None and isinstance(exc, Exception):
            _point(watch.after)  # the call is done: what it raised is its outcome

    def reached(self, point: Point) -> None:
        """A fault point between effects."""
        if faults.armed is not None:
            _point(point)

    def drive(self, effect: Drive) -> None:
        """A drive begins or ends."""
        if not effect.ended:
            self._run = telemetry.watch_run(effect.saga, keys=self._keys)
        elif self._run is not None:
            run, self._run = self._run, None
            telemetry.end_run(run, effect.status)

    def ended(self, failure: BaseException | None) -> None:
        """The flow returned (`failure` None) or raised `failure`: close what is open."""
        if self._call is not None:
            self._settle(failure or self._failure)
        if self._run is not None:
            run, self._run = self._run, None
            telemetry.end_run(run, None, failure or RuntimeError("the drive ended unfinished"))

    def _settle(self, failure: BaseException | None) -> None:
        """End the span of a call the flow did not record, by how it ended."""
        if self._call is not None:
            call, self._call = self._call, None
            telemetry.settle_call(call, None, failure)


def _point(point: Point) -> None:
    name, step, kind = point
    faults.point(name, step=step, kind=kind)


def log_events(planner: Planner, events: Sequence[Event]) -> None:
    """Log audit events once their transaction has committed (skipped, unbuilt, when the
    configured logger drops info events), and count their outcomes (`saga.telemetry`)."""
    if not events:
        return
    telemetry.record_events(planner.saga.name, events, session=planner.definition.is_session)
    if _events.is_enabled_for(logging.INFO):
        for event in events:
            log_event(planner.saga, planner, event)


def log_event(saga: SagaRow, planner: Planner, event: Event) -> None:
    """Log an audit event with structlog, bound with saga id, step, attempt and key (never
    raises: a failure to log changes nothing)."""
    try:
        extra: dict[str, Any] = {}
        if event.step is not None:
            op = planner.find(event.step, event.kind or "action")
            extra = {
                "step": event.step,
                "kind": event.kind,
                "attempt": event.attempt,
                "idempotency_key": op.idempotency_key if op is not None else None,
            }
        _events.info(
            event.event,
            saga_id=saga.id,
            saga=saga.name,
            tenant_id=saga.tenant_id,
            **extra,
            **event.detail,
        )
    except Exception:
        pass  # an event the logger cannot take is still in saga.events
