"""What a flow asks its driver to do: the only I/O of driving a saga, as values.

Flows (`saga._flows.drive`) are generators that yield these and receive what came of them;
a sync driver (`saga._drivers.driver`) and an asyncio driver (`saga._drivers.driver_async`)
carry them out, the way psycopg runs one generator per protocol exchange with a blocking or
an async waiter.
An effect that fails raises its error inside the flow, at the `yield`.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from saga._core.inputs import StepExited

if TYPE_CHECKING:
    from saga._core.planner import Event, OpRow, Planner, SagaRow
    from saga._flows.store_ops import StoreOps
    from saga.state import SagaStatus

T = TypeVar("T")
P = ParamSpec("P")

# The lease kept alive (saga id, fence) while an effect waits or user code runs.
Hold = tuple[str, int]


# A fault point reached at an effect: its name (`saga._drivers.faults`), and the operation
# (step, kind) it is reached for.
Point = tuple[str, str, str]


@dataclass(slots=True)
class Watch:
    """What the driver observes around an effect, at its boundary (`saga._drivers.boundary`):
    the flows say what an effect is; the boundary fires the fault points (`saga.testing`),
    times and traces the calls of user code, and logs and counts the audit events once they
    are committed.

    Attributes:
        planner: The saga the effect serves, as the flow holds it: the events are its, and
            after a write that records a call, the call's outcome is read from it.
        before: The fault point reached just before the effect.
        after: The fault point reached once it is done (a call that raised is done).
        events: Audit events the effect commits, logged and counted once it has.
        span: On a `Call`: the attempt (`"attempt"`) or the reconcile (`"reconcile"`) of
            `op` is timed and traced; its span ends with the outcome that the next write
            with `records` leaves, or how the flow ends without one.
        op: The operation a span is of.
        records: On a write: it records the outcome of the call traced before it.
    """

    planner: Planner
    before: Point | None = None
    after: Point | None = None
    events: Sequence[Event] = ()
    span: str | None = None
    op: OpRow | None = None
    records: bool = False
    # Not frozen: one is made for every write, and a frozen dataclass's __init__ costs
    # about twice as much. Nothing changes a Watch once made.


@dataclass(frozen=True, slots=True)
class Reached:
    """A fault point between effects (`before_call`: the attempt is recorded as running,
    its lease is yet to be confirmed for the call)."""

    point: Point


@dataclass(frozen=True, slots=True)
class Observed:
    """Nothing to do but observe each of `watches` as done: events a write committed that
    the flow found had landed, a fault point between effects."""

    watches: tuple[Watch, ...]


@dataclass(frozen=True, slots=True)
class Drive:
    """A drive of a saga begins (`ended` False) or ends, leaving the saga in `status`
    (None: the lease was lost); the driver traces it as one `saga.run` span."""

    saga: SagaRow
    ended: bool = False
    status: SagaStatus | None = None


@dataclass(frozen=True, slots=True)
class Begin:
    """Open a transaction (sent as a pipeline unless `pipelined` is False); `Db` effects
    of `_txn` methods run in it until `Commit`. A failed effect inside rolls it back
    before its error is raised."""

    pipelined: bool = True


@dataclass(frozen=True, slots=True)
class Commit:
    """Commit the open transaction (a lost fence raises `LeaseLost` here); `watch`, what
    the driver observes around the commit."""

    watch: Watch | None = None


@dataclass(frozen=True, slots=True)
class Db:
    """Call the store's method named `method` (its async twin in the async driver); a
    `_txn` method receives the open transaction's connection first. Answers its result.
    Flows build it with `db` or `db_txn` from a typed reference to a `StoreOps` method."""

    method: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    watch: Watch | None = None


@dataclass(frozen=True, slots=True)
class Fetch:
    """Call a read that a `_txn` method deferred until its transaction committed (a
    coroutine function in the async driver). Answers its result."""

    read: Callable[[], Any]


@dataclass(frozen=True, slots=True)
class Call:
    """Call user code: `fn(*args)`, awaited when it is async; `timeout_seconds` bounds
    it, `hold` keeps that lease alive meanwhile. Answers its return value; raises what
    it raised, or the driver's `AttemptTimedOut`, `NotCalledError`, `MachineryFailedError`.
    `is_async` says whether `fn` is a coroutine function, when its declaration knows (None:
    the driver looks); `watch`, what the driver observes around the call."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    timeout_seconds: float | None = None
    hold: Hold | None = None
    is_async: bool | None = None
    watch: Watch | None = None


@dataclass(frozen=True, slots=True)
class Wait:
    """Wait `seconds` (a retry backoff kept under the lease, renewed meanwhile), or less
    when the driver is stopping."""

    seconds: float
    hold: Hold | None = None


@dataclass(frozen=True, slots=True)
class Pause:
    """Sleep `seconds` before retrying database work (less when stopping and `interruptible`)."""

    seconds: float
    interruptible: bool = False


@dataclass(frozen=True, slots=True)
class Stopping:
    """Answers whether the driver is shutting down (no new call may start)."""


@dataclass(frozen=True, slots=True)
class Armed:
    """Answers whether fault points are armed (`saga.testing`, `SAGA_FAULT`): a flow whose
    transaction records attempts it learns of only from the transaction's own answer reads
    that answer before the commit when they are, to reach their `before_record` points
    there (answered by the boundary)."""


@dataclass(frozen=True, slots=True)
class AwaitAbandoned:
    """Wait, under the lease `hold`, for attempts of an operation abandoned at their
    timeout that still run in this process; answers those still running after the wait."""

    saga_id: str
    step: str
    kind: str
    hold: Hold


Effect = (
    Begin
    | Commit
    | Db
    | Fetch
    | Call
    | Wait
    | Pause
    | Stopping
    | Armed
    | AwaitAbandoned
    | Reached
    | Observed
    | Drive
)
Flow = Generator[Effect, Any, T]


def db(method: Callable[Concatenate[StoreOps, P], T], *args: P.args, **kwargs: P.kwargs) -> Flow[T]:
    """Yield the `Db` effect of `store.method(*args, **kwargs)` and return its answer,
    typed as `method` answers: `state = yield from db(StoreOps.get_state, saga_id)`."""
    answer: T = yield Db(method.__name__, args, kwargs)
    return answer


def watched(
    watch: Watch | None,
    method: Callable[Concatenate[StoreOps, P], T],
    *args: P.args,
    **kwargs: P.kwargs,
) -> Flow[T]:
    """As `db`, with what the driver observes around the call (`Watch`; None: nothing)."""
    answer: T = yield Db(method.__name__, args, kwargs, watch)
    return answer


def db_txn(
    method: Callable[Concatenate[StoreOps, Any, P], T], *args: P.args, **kwargs: P.kwargs
) -> Flow[T]:
    """As `db`, for a `_txn` method, which runs in the open transaction (its connection,
    the first parameter, comes from the driver)."""
    answer: T = yield Db(method.__name__, args, kwargs)
    return answer


class AttemptTimedOut(Exception):
    """The attempt ran past its timeout; its outcome is unknown."""

    def __init__(self, reason: str, *, still_running: bool = False) -> None:
        super().__init__(reason)
        # The abandoned call still runs in this process: park rather than settle.
        self.still_running = still_running


class MachineryError(Exception):
    """The orchestrator's own machinery failed around a user function's call; `cause` is
    its error, which says nothing about the function."""

    def __init__(self, cause: Exception) -> None:
        text = str(cause)
        super().__init__(f"{type(cause).__name__}: {text}" if text else type(cause).__name__)
        self.cause = cause


class NotCalledError(MachineryError):
    """The machinery failed before any of the user function ran: the call was never made."""


class MachineryFailedError(MachineryError):
    """The machinery failed after the user function may have started: its outcome is
    unknown."""


def step_exited(exc: BaseException) -> BaseException:
    """What a driver raises into the flow for `exc`, raised by user code: `exc` itself
    when it is an `Exception` (or `GeneratorExit`, a generator being closed), else
    `StepExited(exc)`. A driver leaves out what may be a real signal (`KeyboardInterrupt`
    in the main thread of the sync door) and asyncio's cancellation."""
    if isinstance(exc, Exception | GeneratorExit):
        return exc
    exited = StepExited(exc)
    exited.__cause__ = exc
    return exited
