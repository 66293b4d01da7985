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

import asyncio
import contextvars
import inspect
import threading
from collections.abc import Callable, Sequence
from contextlib import (
    AbstractAsyncContextManager,
    AbstractContextManager,
    nullcontext,
)
from typing import Any, TypeVar

from saga._acompat import AEvent, AThreadResult, arun_blocking, asleep, await_set
from saga._core.planner import OpRow, Planner, SagaRow
from saga._db.store_async import AConn, AsyncStore
from saga._drivers import abandoned
from saga._drivers.boundary_async import acarry_out
from saga._drivers.leases_async import AsyncLeaseKeeper
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


class AsyncRunner:
    """Drives claimed sagas under a lease; every write is fenced."""

    def __init__(
        self,
        store: AsyncStore,
        options: RunnerOptions,
        *,
        keeper: AsyncLeaseKeeper,
        stopping: AEvent | None = None,
    ) -> None:
        self.store = store
        self.keeper = keeper
        self.options = options
        self.owner = options.owner
        self.lease_seconds = options.lease_seconds
        self.stopping = stopping or AEvent()
        self.flows = Flows(options, reporter=self._spend_reporter)

    async def claim_and_drive(self, definition: Saga[Any], saga_id: str) -> SagaState | None:
        """Claim one saga and drive it until it stops; None when it could not be claimed."""
        return await self.run(self.flows.claim_and_drive(definition, saga_id))

    async def claim_next(
        self, kinds: Sequence[str], lookup: Callable[[str, int], Saga[Any]]
    ) -> Claimed | None:
        """Claim the longest-waiting runnable saga of these kinds and plan its first move."""
        return await self.run(self.flows.claim_next(kinds, lookup))

    async def claim_batch(
        self, kinds: Sequence[str], lookup: Callable[[str, int], Saga[Any]], limit: int
    ) -> list[Claimed]:
        """Claim up to `limit` runnable sagas of these kinds in one statement and one commit,
        each with its first move planned and recorded; in run_after order."""
        return await self.run(self.flows.claim_batch(kinds, lookup, limit))

    async def drive(self, planner: Planner, nxt: Move) -> SagaState | None:
        """Carry out `nxt` and every move after it until the saga stops or is handed back."""
        return await self.run(self.flows.drive(planner, nxt))

    async def run(self, flow: Flow[T]) -> T:
        """Carry out every effect `flow` yields, and return what it returns."""
        return await acarry_out(flow, self._effect, self._open, keys=self.options.telemetry_keys)

    # ----- effects -------------------------------------------------------------------------

    def _open(self, pipelined: bool) -> AbstractAsyncContextManager[AConn]:
        return self.store.pipelined() if pipelined else self.store.transaction()

    async def _effect(self, effect: Effect, conn: AConn | None) -> Any:
        if isinstance(effect, Db):
            return await _store_call(self.store, effect, conn)
        if isinstance(effect, Call):
            return await self._call(effect)
        if isinstance(effect, Fetch):
            return await effect.read()
        if isinstance(effect, Stopping):
            return self.stopping.is_set()
        if isinstance(effect, Wait):
            with self._holding(effect.hold):
                await await_set(self.stopping, effect.seconds)
            return None
        if isinstance(effect, Pause):
            if effect.interruptible:
                await await_set(self.stopping, effect.seconds)
            else:
                await asleep(effect.seconds)
            return None
        if isinstance(effect, AwaitAbandoned):
            if not abandoned.running or not abandoned.still_running(
                effect.saga_id, effect.step, effect.kind
            ):
                return []
            with self.keeper.holding(*effect.hold):
                return await arun_blocking(
                    abandoned.wait_for, effect.saga_id, effect.step, effect.kind
                )
        raise TypeError(f"not an effect of a flow: {effect!r}")  # pragma: no cover

    def _holding(self, hold: Hold | None) -> AbstractContextManager[None]:
        """Keep the lease `hold` names alive for the block (no lease: nothing to keep)."""
        return self.keeper.holding(*hold) if hold is not None else nullcontext()

    async def _call(self, effect: Call) -> Any:
        """Call user code: a hook as it is; a step's attempt under its lease, its spend
        reports written before its outcome is recorded."""
        coroutine = is_async(effect.fn) if effect.is_async is None else effect.is_async
        if effect.hold is None:
            return await _call_user(effect.fn, effect.args, effect.timeout_seconds, None, coroutine)
        ctx = effect.args[0] if effect.args and isinstance(effect.args[0], StepContext) else None
        with self.keeper.holding(*effect.hold):
            try:
                return await _call_user(
                    effect.fn, effect.args, effect.timeout_seconds, ctx, coroutine
                )
            finally:
                if ctx is not None and isinstance(ctx._report, _SpendReporter):
                    await ctx._report.drain()

    def _spend_reporter(self, saga: SagaRow, op: OpRow) -> Callable[[float], None]:
        return _SpendReporter(self, saga, op)


async def _store_call(store: AsyncStore, effect: Db, conn: AConn | None) -> Any:
    """Make the store call a `Db` effect names; a `_txn` method receives the open
    transaction's connection first."""
    method = getattr(store, effect.method)
    if effect.method.endswith("_txn"):
        assert conn is not None, f"{effect.method} outside a transaction"
        return await method(conn, *effect.args, **effect.kwargs)
    return await method(*effect.args, **effect.kwargs)


class _SpendReporter:
    """Persists the running total an attempt reports with `ctx.spend()`: retried on
    transient errors (writing the same total twice changes nothing), and never raised into
    step code, whose spend is counted from memory at its outcome if the write cannot be
    made. The blocking driver writes it in the reporting thread. With asyncio, a report
    made on the loop's thread is written by a task, awaited before the attempt's outcome is
    recorded (`drain`); one made in a step's thread is written on the loop, waited for in
    that thread."""

    def __init__(self, runner: AsyncRunner, saga: SagaRow, op: OpRow) -> None:
        self.runner = runner
        self.saga = saga
        self.op = op
        if True:  # ASYNC
            self.loop = asyncio.get_running_loop()
            self.pending: list[asyncio.Future[None]] = []

    def __call__(self, total: float) -> None:
        if True:  # ASYNC
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is self.loop:
                self.pending.append(self.loop.create_task(self._write(total)))
                return
            try:
                asyncio.run_coroutine_threadsafe(self._write(total), self.loop).result()
            except Exception as exc:
                self._not_persisted(total, exc)
        else:
            self._write(total)

    async def drain(self) -> None:
        """Wait for the writes of the reports made on the loop's thread (none in the
        blocking driver, whose writes are made as they are reported)."""
        if True:  # ASYNC
            pending, self.pending = self.pending, []
            for task in pending:
                await task

    async def _write(self, total: float) -> None:
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
            written = await self.runner.run(retried("report_spend", write, interruptible=True))
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


async def _call_user(
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
        late = await arun_blocking(abandoned.wait_for, ctx.saga_id, ctx.step, ctx.kind)
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
    if True:  # ASYNC
        # Async user code is awaited on this loop (a timeout cancels it); sync user code
        # never runs on the loop: it runs in a thread, timed or not.
        if coroutine:
            return await _awaited(lambda: fn(*args), timeout_seconds, what)
        value = await _in_thread(lambda: fn(*args), timeout_seconds, ctx, what)
        if inspect.isawaitable(value):
            return await _awaited(lambda: value, None, what)
        return value
    else:
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


async def _in_thread(
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
    outcome: AThreadResult[Any] = AThreadResult()
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
    if await outcome.wait(timeout_seconds):
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
    if await arun_blocking(abandoned.wait_for, ctx.saga_id, ctx.step, ctx.kind):
        waited = abandoned.wait_bound(timeout_seconds)
        raise AttemptTimedOut(
            f"{what}: {entry.describe()} after {waited:g}s more; resolve it once it has ended",
            still_running=True,
        )
    raise AttemptTimedOut(f"{what} (it ended late; settled as any unknown outcome)")


if True:  # ASYNC

    async def _awaited(make: Callable[[], Any], timeout: float | None, timed_out: str) -> Any:
        """Await the awaitable `make()` returns, from user code, on this loop, for at most
        `timeout` seconds: past it the task is cancelled and `AttemptTimedOut(timed_out)`
        raised. A `TimeoutError` is ours only when our deadline expired: the function's
        own (a read timeout of its client) is its outcome, classified by its policy.

        A `BaseException` it raises that is neither an `Exception` nor the cancellation of
        its task (`SystemExit`, `KeyboardInterrupt`) becomes the attempt's outcome
        (`StepExited`): out of a task, it would stop the event loop and every saga on it."""
        # Untimed (the common case), no timeout scope is entered: it costs more than the call
        # of a no-op step, and never expires.
        scope = asyncio.timeout(timeout) if timeout is not None else None
        try:
            if scope is None:
                return await make()
            async with scope:
                return await make()
        except TimeoutError:
            if scope is None or not scope.expired():
                raise
            raise AttemptTimedOut(timed_out) from None
        except (Exception, asyncio.CancelledError):
            raise
        except BaseException as exc:
            outcome = step_exited(exc)
            if outcome is exc:
                raise
            raise outcome from exc

else:

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
        if (
            isinstance(exc, KeyboardInterrupt)
            and threading.current_thread() is threading.main_thread()
        ):
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
