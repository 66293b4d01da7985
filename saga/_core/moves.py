"""The moves the core answers: what to do next with a saga, once a transition is planned.

`Planner.advance` returns one of them (`Next`); the flows carry it out: call an attempt
(`Invoke`, its call built by the planner), ask a reconcile hook, prepare a request, wait,
give the lease back, or (a session) hold until its code asks for the next call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from saga._core.rows import OpRow
from saga.definition import OperationSpec
from saga.state import SagaStatus


@dataclass(frozen=True, slots=True)
class Attempt:
    """The call of an attempt, built by the planner as it starts the attempt: all the
    flow hands the driver beside the context's own fields (saga, step, key, attempt)."""

    # The step or compensation called: its function, codec, retry policy and timeout.
    spec: OperationSpec
    # What the function receives after the context: the input, and for a compensation
    # its step's result as the step returned it.
    arguments: tuple[Any, ...]
    # ctx.results: the results of the succeeded steps, as they returned them.
    results: dict[str, Any]
    # ctx.request: the prepared request, when the operation has a prepare hook.
    request: Any


@dataclass(frozen=True, slots=True)
class Invoke:
    """Call the operation's function; its attempt is already recorded as running. `call`
    is the call, or the error that kept it from being built (the attempt is then
    recorded as not called: nothing of it ran)."""

    op: OpRow
    call: Attempt | Exception = field(compare=False)


@dataclass(frozen=True, slots=True)
class AskReconcile:
    """Ask the operation's reconcile hook whether its unknown attempt happened."""

    op: OpRow


@dataclass(frozen=True, slots=True)
class Sleep:
    """Nothing can run before `until` (retry backoff)."""

    until: datetime


@dataclass(frozen=True, slots=True)
class Stop:
    """The saga is terminal or parked: give the lease back."""

    status: SagaStatus


@dataclass(frozen=True, slots=True)
class Prepare:
    """Call the operation's prepare function; its request is recorded before the attempt."""

    op: OpRow


@dataclass(frozen=True, slots=True)
class Yield:
    """Calls are not allowed now (the worker is shutting down): give the lease back."""


@dataclass(frozen=True, slots=True)
class Hold:
    """A session's call is settled, or none is asked for: its code goes on, and the
    session keeps its lease (see `saga.session`)."""


Next = Invoke | AskReconcile | Prepare | Sleep | Stop | Yield | Hold
