# WARNING: generated from saga/_drivers/driver_async.py by tools/async_to_sync.py:
# edit the source, then run `python tools/async_to_sync.py`. CI fails on any difference.
"""The driver: carries out the flows of `saga._flows.drive`, every decision of which is the
flow's and the core's.

Two drivers share this text. `AsyncRunner` (`driver_async.py`, the source) runs on the
caller's event loop: async user code is awaited on the loop (a timeout cancels it) and sync
user code runs in a thread, never on the loop. `Runner` (`driver.py`, generated from it by
`tools/async_to_sync.py`) blocks: it runs user code in the calling thread, a timed plain
function in a thread of its own, an async function in an event loop of its own. Both keep
leases alive with the orchestrator's lease keeper, wait on their `stopping` event, and
reach PostgreSQL through their store. What differs is in the `if True:  # ASYNC` blocks
of the source and in the primitives of `saga._acompat`.
"""

from __future__ import annotations

import contextvars
import inspect
import threading
from collections.abc import Callable, Sequence
from contextlib import (
    AbstractContextManager,
    nullcontext,
)
from typing import Any, TypeVar

from saga._acompat import Event, ThreadResult, run_blocking, sleep, wait_set
from saga._core.planner import OpRow, Planner, SagaRow
from saga._db.store import Conn, Store
from saga._drivers import abandoned
from saga._drivers.boundary import carry_out
from saga._drivers.leases import LeaseKeeper
from saga._drivers.ownloop import run_in_own_loop
from saga._flows.claim import Flows
from saga._flows.drive import Claimed, Move, describe_error, retried
from saga._flows.drive import RunnerOptions as RunnerOptions
from saga._flows.effects import (
    AttemptTimedOut,
    AwaitAbandoned,
    Call,
    Db,
    Effect,
    Fetch,
    Flow,
    Hold,
    NotCalledError,
    Pause,
    Stopping,
    Wait,
    db,
    step_exited,
)
from saga._flows.store_ops import StoreOps
from saga.context import StepContext
from saga.definition import Saga
from saga.logs import get_logger
from saga.signatures import is_async
from saga.state import SagaState

_log = get_logger("saga")

T = TypeVar("T")


class Runner:
    """Drives claimed sagas under a lease; every write is fenced."""

    def __init__(
        self,
        store: Store,
        options: RunnerOptions,
        *,
        keeper: LeaseKeeper,
        stopping: Event | None = None,
    ) -> None:
        self.store = store
        self.keeper = keeper
        self.options = options
        self.owner = options.owner
        self.lease_seconds = options.lease_seconds
        self.stopping = stopping or Event()
        self.flows = Flows(options, reporter=self._spend_reporter)

    def claim_and_drive(self, definition: Saga[Any], saga_id: str) -> SagaState | None:
        """Claim one saga and drive it until it stops; None when it could not be claimed."""
        return self.run(self.flows.claim_and_drive(definition, saga_id))

    def claim_next(
        self, kinds: Sequence[str], lookup: Callable[[str, int], Saga[Any]]
    ) -> Claimed | None:
        """Claim the longest-waiting runnable saga of these kinds and plan its first move."""
        return self.run(self.flows.claim_next(kinds, lookup))

    def claim_batch(
        self, kinds: Sequence[str], lookup: Callable[[str, int], Saga[Any]], limit: int
    ) -> list[Claimed]:
        """Claim up to `limit` runnable sagas of these kinds in one statement and one commit,
        each with its first move planned and recorded; in run_after order."""
        return self.run(self.flows.claim_batch(kinds, lookup, limit))

    def drive(self, planner: Planner, nxt: Move) -> SagaState | None:
        """Carry out `nxt` and every move after it until the saga stops or is handed back."""
        return self.run(self.flows.drive(planner, nxt))

    def run(self, flow: Flow[T]) -> T:
        """Carry out every effect `flow` yields, and return what it returns."""
        return carry_out(flow, self._effect, self._open, keys=self.options.telemetry_keys)

    # ----- effects -------------------------------------------------------------------------

    def _open(self, pipelined: bool) -> AbstractContextManager[Conn]:
        return self.store.pipelined() if pipelined else self.store.transaction()

    def _effect(self, effect: Effect, conn: Conn | None) -> Any:
        if isinstance(effect, Db):
            return _store_call(self.store, effect, conn)
        if isinstance(effect, Call):
            return self._call(effect)
        if isinstance(effect, Fetch):
            return effect.read()
        if isinstance(effect, Stopping):
            return self.stopping.is_set()
        if isinstance(effect, Wait):
            with self._holding(effect.hold):
                wait_set(self.stopping, effect.seconds)
            return None
        if isinstance(effect, Pause):
            if effect.interruptible:
                wait_set(self.stopping, effect.seconds)
            else:
                sleep(effect.seconds)
            return None
        if isinstance(effect, AwaitAbandoned):
            if not abandoned.running or not abandoned.still_running(
                effect.saga_id, effect.step, effect.kind
            ):
                return []
            with self.keeper.holding(*effect.hold):
                return run_blocking(abandoned.wait_for, effect.saga_id, effect.step, effect.kind)
        raise TypeError(f"not an effect of a flow: {effect!r}")  # pragma: no cover

    def _holding(self, hold: Hold | None) -> AbstractContextManager[None]:
        """Keep the lease `hold` names alive for the block (no lease: nothing to keep)."""
        return self.keeper.holding(*hold) if hold is not None else nullcontext()

    def _call(self, effect: Call) -> Any:
        """Call user code: a hook as it is; a step's attempt under its lease, its spend
        reports written before its outcome is recorded."""
        coroutine = is_async(effect.fn) if effect.is_async is None else effect.is_async
        if effect.hold is None:
            return _call_user(effect.fn, effect.args, effect.timeout_seconds, None, coroutine)
        ctx = effect.args[0] if effect.args and isinstance(effect.args[0], StepContext) else None
        with self.keeper.holding(*effect.hold):
            try:
                return _call_user(effect.fn, effect.args, effect.timeout_seconds, ctx, coroutine)
            finally:
                if ctx is not None and isinstance(ctx._report, _SpendReporter):
                    ctx._report.drain()

    def _spend_reporter(self, saga: SagaRow, op: OpRow) -> Callable[[float], None]:
        return _SpendReporter(self, saga, op)


def _store_call(store: Store, effect: Db, conn: Conn | None) -> Any:
    """Make the store call a `Db` effect names; a `_txn` method receives the open
    transaction's connection first."""
    method = getattr(store, effect.method)
    if effect.method.endswith("_txn"):
        assert conn is not None, f"{effect.method} outside a transaction"
        return method(conn, *effect.args, **effect.kwargs)
    return method(*effect.args, **effect.kwargs)


class _SpendReporter:
    """Persists the running total an attempt reports with `ctx.spend()`: retried on
    transient errors (writing the same total twice changes nothing), and never raised into
    step code, whose spend is counted from memory at its outcome if the write cannot be
    made. The blocking driver writes it in the reporting thread. With asyncio, a report
    made on the loop's thread is written by a task, awaited before the attempt's outcome is
    recorded (`drain`); one made in a step's thread is written on the loop, waited for in
    that thread."""

    def __init__(self, runner: Runner, saga: SagaRow, op: OpRow) -> None:
        self.runner = runner
        self.saga = saga
        self.op = op

    def __call__(self, total: float) -> None:
        self._write(total)

    def drain(self) -> None:
        """Wait for the writes of the reports made on the loop's thread (none in the
        blocking driver, whose writes are made as they are reported)."""

    def _write(self, total: float) -> None:
        saga, op = self.saga, self.op

        def write() -> Flow[bool]:
            return (
                yield from db(
                    StoreOps.report_spend,
                    saga.id,
                    step=op.step,
                    kind=op.kind,
                    attempt=op.attempts,
                    total=total,
                    owner=self.runner.owner,
                    fence=saga.fence,
                )
            )

        try:
            written = self.runner.run(retried("report_spend", write, interruptible=True))
        except Exception as exc:
            self._not_persisted(total, exc)
            return
        if not written:
            _log.warning("spend_not_persisted", **self._where(), total=total)

    def _where(self) -> dict[str, Any]:
        op = self.op
        return {"saga_id": self.saga.id, "step": op.step, "kind": op.kind, "attempt": op.attempts}

    def _not_persisted(self, total: float, exc: Exception) -> None:
        _log.warning("spend_not_persisted", **self._where(), total=total, error=describe_error(exc))


# ----- calling user code ---------------------------------------------------------------------


def _call_user(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    timeout_seconds: float | None,
    ctx: StepContext | None,
    coroutine: bool,
) -> Any:
    """Call `fn(*args)`, user code (`coroutine`: a coroutine function), giving up after
    `timeout_seconds` with `AttemptTimedOut`: the call may still take effect, so the
    caller records the outcome as unknown.

    `ctx`, the attempt's StepContext, names the operation: an earlier attempt of it
    abandoned at its timeout and still running here is waited for (`_in_thread`) before
    this one is called. `NotCalledError` or `MachineryFailedError` when the machinery fails
    to run the call.
    """
    if (
        ctx is not None
        and abandoned.running
        and abandoned.still_running(ctx.saga_id, ctx.step, ctx.kind)
    ):
        late = run_blocking(abandoned.wait_for, ctx.saga_id, ctx.step, ctx.kind)
        if late:
            raise AttemptTimedOut(
                f"attempt {ctx.attempt} was not called: {late[0].describe()}; resolve the "
                "outcome once it has ended",
                still_running=True,
            )
    what = (
        f"attempt exceeded its timeout of {timeout_seconds:g}s; its outcome is unknown"
        if timeout_seconds is not None
        else ""
    )
    # User code runs in the calling thread, unless it is timed: a timed plain function
    # runs in a thread of its own, a timed async one in an event loop of its own (its
    # coroutine is cancelled at the timeout).
    if timeout_seconds is None:
        return _in_this_thread(lambda: _call_here(fn, coroutine, *args))
    if coroutine:
        return _in_this_thread(
            lambda: run_in_own_loop(
                lambda: fn(*args), began=False, timeout=timeout_seconds, timed_out=what
            )
        )
    return _in_thread(lambda: _call_here(fn, coroutine, *args), timeout_seconds, ctx, what)


def _in_thread(
    call: Callable[[], Any],
    timeout_seconds: float | None,
    ctx: StepContext | None,
    what: str,
) -> Any:
    """Run `call()` in a thread of its own and wait for it, up to `timeout_seconds`.

    A thread cannot be stopped: past the timeout it runs on, tracked in
    `saga._drivers.abandoned`, and is waited for up to `abandoned.wait_bound(timeout_seconds)`
    more before the unknown outcome is settled (reconcile, retry), so that no second
    attempt and no reconcile answer races it; if it is still running then, the saga parks
    (`AttemptTimedOut(still_running=True)`). `what` says what timed out.
    """
    outcome: ThreadResult[Any] = ThreadResult()
    tracked: list[abandoned.Abandoned] = []

    def target() -> None:
        try:
            value = call()
        except BaseException as exc:
            # Raised in this thread, never by a signal: the attempt's outcome.
            outcome.set_exception(step_exited(exc))
        else:
            outcome.set_result(value)
        finally:
            for entry in tracked:
                abandoned.discard(entry)

    # The step sees the caller's context variables (the attempt's span among them), as a
    # call in the caller's thread would.
    context = contextvars.copy_context()
    thread = threading.Thread(target=context.run, args=(target,), name="saga-attempt", daemon=True)
    try:
        thread.start()
    except RuntimeError as exc:  # no thread could be started: nothing of the step ran
        raise NotCalledError(exc) from exc
    if outcome.wait(timeout_seconds):
        return outcome.result()
    if ctx is None:
        raise AttemptTimedOut(what)
    assert timeout_seconds is not None
    entry = abandoned.Abandoned(
        ctx.saga_id, ctx.step, ctx.kind, ctx.attempt, timeout_seconds, thread
    )
    tracked.append(entry)
    abandoned.add(entry)
    if not thread.is_alive():  # ended before it was tracked: target() missed it
        abandoned.discard(entry)
    if run_blocking(abandoned.wait_for, ctx.saga_id, ctx.step, ctx.kind):
        waited = abandoned.wait_bound(timeout_seconds)
        raise AttemptTimedOut(
            f"{what}: {entry.describe()} after {waited:g}s more; resolve it once it has ended",
            still_running=True,
        )
    raise AttemptTimedOut(f"{what} (it ended late; settled as any unknown outcome)")


def _in_this_thread(call: Callable[[], Any]) -> Any:
    """Run `call()`, user code, in this thread: a `BaseException` it raises becomes
    what `_from_step` makes of it."""
    try:
        return call()
    except Exception:
        raise
    except BaseException as exc:
        outcome = _from_step(exc)
        if outcome is exc:
            raise
        raise outcome from exc


def _from_step(exc: BaseException) -> BaseException:
    """What a `BaseException` raised by user code in this thread becomes in the flow:
    the attempt's unknown outcome (`StepExited`), so that one step's `sys.exit()` or
    `KeyboardInterrupt` ends its attempt and not the worker. A `KeyboardInterrupt` in
    the main thread may be a real Ctrl-C: it goes on as it is (the attempt is then
    unknown to whoever takes the saga over)."""
    if isinstance(exc, KeyboardInterrupt) and threading.current_thread() is threading.main_thread():
        return exc
    return step_exited(exc)


def _call_here(fn: Callable[..., Any], coroutine: bool, *args: Any) -> Any:
    """Call a user function; an async one (`coroutine`, or one that returns an
    awaitable) is awaited in an event loop of its own. `NotCalledError` or
    `MachineryFailedError` when that loop fails."""
    if coroutine:
        # Nothing of an async function runs before its coroutine is awaited, in the loop.
        return run_in_own_loop(lambda: fn(*args), began=False)
    result = fn(*args)
    if inspect.isawaitable(result):
        return run_in_own_loop(lambda: result, began=True)
    return result
