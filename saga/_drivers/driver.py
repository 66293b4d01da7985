"""The sync driver: carries out the flows of `saga._flows.drive` with blocking I/O.

It runs user code in the calling thread (a plain function; a timed one in a thread of its
own; an async one in an event loop of its own), waits with `threading.Event`, keeps
leases alive with the orchestrator's heartbeat thread, and talks to PostgreSQL through the
blocking `Store`. Every decision is the flow's and the core's.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Any, TypeVar

from saga._core.planner import Next, OpRow, Planner, SagaRow
from saga._db.dbretry import retrying
from saga._db.store import Conn, Store
from saga._drivers import abandoned
from saga._drivers.leases import LeaseKeeper
from saga._flows.claim import Flows
from saga._flows.drive import RunnerOptions, describe_error, log_event, log_events
from saga._flows.effects import (
    AttemptTimedOut,
    AwaitAbandoned,
    Begin,
    Call,
    Commit,
    Db,
    Effect,
    Fetch,
    Flow,
    MachineryFailedError,
    NotCalledError,
    Pause,
    Stopping,
    Wait,
    step_exited,
)
from saga.context import StepContext
from saga.definition import Saga
from saga.logs import get_logger
from saga.signatures import is_async
from saga.state import SagaState

__all__ = ["Runner", "RunnerOptions", "carry_out", "log_event", "log_events"]

_log = get_logger("saga")

T = TypeVar("T")


class Runner:
    """Drives claimed sagas under a lease, blocking; every write is fenced."""

    def __init__(
        self,
        store: Store,
        options: RunnerOptions,
        *,
        keeper: LeaseKeeper,
        stopping: threading.Event | None = None,
    ) -> None:
        self.store = store
        self.keeper = keeper
        self.options = options
        self.owner = options.owner
        self.lease_seconds = options.lease_seconds
        self.stopping = stopping or threading.Event()
        self.flows = Flows(options, reporter=self._spend_reporter)

    def claim_and_drive(self, definition: Saga[Any], saga_id: str) -> SagaState | None:
        """Claim one saga and drive it until it stops; None when it could not be claimed."""
        return self.run(self.flows.claim_and_drive(definition, saga_id))

    def claim_next(
        self, kinds: Sequence[str], lookup: Callable[[str, int], Saga[Any]]
    ) -> tuple[Planner, Next] | None:
        """Claim the longest-waiting runnable saga of these kinds and plan its first move."""
        return self.run(self.flows.claim_next(kinds, lookup))

    def claim_batch(
        self, kinds: Sequence[str], lookup: Callable[[str, int], Saga[Any]], limit: int
    ) -> list[tuple[Planner, Next]]:
        """Claim up to `limit` runnable sagas of these kinds in one statement and one commit,
        each with its first move planned and recorded; in run_after order."""
        return self.run(self.flows.claim_batch(kinds, lookup, limit))

    def drive(self, planner: Planner, nxt: Next) -> SagaState | None:
        """Carry out `nxt` and every move after it until the saga stops or is handed back."""
        return self.run(self.flows.drive(planner, nxt))

    def run(self, flow: Flow[T]) -> T:
        """Carry out every effect `flow` yields, and return what it returns."""
        return carry_out(flow, self._effect, self._open)

    # ----- effects -------------------------------------------------------------------------

    def _open(self, pipelined: bool) -> AbstractContextManager[Conn]:
        return self.store.pipelined() if pipelined else self.store.transaction()

    def _effect(self, effect: Effect, conn: Conn | None) -> Any:
        if isinstance(effect, Db):
            method = getattr(self.store, effect.method)
            if effect.method.endswith("_txn"):
                assert conn is not None, f"{effect.method} outside a transaction"
                return method(conn, *effect.args, **effect.kwargs)
            return method(*effect.args, **effect.kwargs)
        if isinstance(effect, Call):
            hold = self.keeper.holding(*effect.hold) if effect.hold is not None else nullcontext()
            with hold:
                try:
                    if effect.timeout_seconds is None and effect.hold is None:
                        return _call(effect.fn, *effect.args)
                    return _call_with_timeout(effect.fn, effect.args, effect.timeout_seconds)
                except Exception:
                    raise
                except BaseException as exc:
                    outcome = _from_step(exc)
                    if outcome is exc:
                        raise
                    raise outcome from exc
        if isinstance(effect, Fetch):
            return effect.read()
        if isinstance(effect, Stopping):
            return self.stopping.is_set()
        if isinstance(effect, Wait):
            hold = self.keeper.holding(*effect.hold) if effect.hold is not None else nullcontext()
            with hold:
                self.stopping.wait(effect.seconds)
            return None
        if isinstance(effect, Pause):
            if effect.interruptible:
                self.stopping.wait(effect.seconds)
            else:
                time.sleep(effect.seconds)
            return None
        if isinstance(effect, AwaitAbandoned):
            if not abandoned.still_running(effect.saga_id, effect.step, effect.kind):
                return []
            with self.keeper.holding(*effect.hold):
                return abandoned.wait_for(effect.saga_id, effect.step, effect.kind)
        raise TypeError(f"not an effect of a flow: {effect!r}")  # pragma: no cover

    def _spend_reporter(self, saga: SagaRow, op: OpRow) -> Callable[[float], None]:
        """What persists the running total an attempt reports with `ctx.spend()`: retried
        on transient errors (writing the same total twice changes nothing), and never
        raised into step code, whose spend is counted from memory at its outcome if the
        write cannot be made."""
        where = {"saga_id": saga.id, "step": op.step, "kind": op.kind, "attempt": op.attempts}

        def report(total: float) -> None:
            try:
                for attempt in retrying("report_spend", until=self.stopping):
                    with attempt:
                        written = self.store.report_spend(
                            saga.id,
                            step=op.step,
                            kind=op.kind,
                            attempt=op.attempts,
                            total=total,
                            owner=self.owner,
                            fence=saga.fence,
                        )
                        if not written:
                            _log.warning("spend_not_persisted", **where, total=total)
            except Exception as exc:
                _log.warning("spend_not_persisted", **where, total=total, error=describe_error(exc))

        return report


def carry_out(
    flow: Flow[T],
    effect: Callable[[Effect, Conn | None], Any],
    open_transaction: Callable[[bool], AbstractContextManager[Conn]],
) -> T:
    """Run `flow` to its end: each effect it yields is carried out by `effect` and its
    result sent back, or its error raised inside the flow. `Begin` opens a transaction
    (`open_transaction`) that `Commit` commits; an error inside it, raised by an effect
    or by the flow, rolls it back first."""
    txn: ExitStack | None = None
    conn: Conn | None = None
    value: Any = None
    error: BaseException | None = None
    while True:
        try:
            step = flow.throw(error) if error is not None else flow.send(value)
        except StopIteration as stop:
            assert txn is None, "a flow ended inside a transaction"
            return stop.value  # type: ignore[no-any-return]
        except BaseException as exc:
            if txn is not None:
                txn.__exit__(type(exc), exc, exc.__traceback__)
            raise
        value, error = None, None
        try:
            if isinstance(step, Begin):
                assert txn is None, "transactions do not nest"
                txn = ExitStack()
                conn = txn.enter_context(open_transaction(step.pipelined))
            elif isinstance(step, Commit):
                assert txn is not None, "Commit without Begin"
                done, txn, conn = txn, None, None
                done.close()
            else:
                value = effect(step, conn)
        except BaseException as exc:
            if txn is not None:
                # The transaction is rolled back before the flow hears of the error.
                failed, txn, conn = txn, None, None
                try:
                    failed.__exit__(type(exc), exc, exc.__traceback__)
                except BaseException as raised:
                    exc = raised
            error = exc


def _from_step(exc: BaseException) -> BaseException:
    """What a `BaseException` raised by user code in this thread becomes in the flow: the
    attempt's unknown outcome (`StepExited`), so that one step's `sys.exit()` or
    `KeyboardInterrupt` ends its attempt and not the worker. A `KeyboardInterrupt` in the
    main thread may be a real Ctrl-C: it goes on as it is (the attempt is then unknown to
    whoever takes the saga over)."""
    if isinstance(exc, KeyboardInterrupt) and threading.current_thread() is threading.main_thread():
        return exc
    return step_exited(exc)


def _call_with_timeout(
    fn: Callable[..., Any], args: tuple[Any, ...], timeout_seconds: float | None
) -> Any:
    """Call `fn`, giving up after `timeout_seconds`: the call may still take effect, so
    the caller records the outcome as unknown.

    A coroutine is cancelled (`asyncio.wait_for` returns once the task has ended). A plain
    function cannot be stopped: it runs on in its thread, tracked in `saga._drivers.abandoned`, and
    is waited for up to `abandoned.wait_bound(timeout_seconds)` more before the unknown
    outcome is settled (reconcile, retry), so that no second attempt and no reconcile
    answer races it; if it is still running then, the saga parks (`still_running`).
    `args[0]` is the attempt's StepContext, which names the operation; an earlier attempt
    of it still running here is waited for the same way before this one is called.
    """
    ctx = args[0] if args and isinstance(args[0], StepContext) else None
    if ctx is not None and abandoned.still_running(ctx.saga_id, ctx.step, ctx.kind):
        late = abandoned.wait_for(ctx.saga_id, ctx.step, ctx.kind)
        if late:
            raise AttemptTimedOut(
                f"attempt {ctx.attempt} was not called: {late[0].describe()}; resolve the "
                "outcome once it has ended",
                still_running=True,
            )
    if timeout_seconds is None:
        return _call(fn, *args)
    what = f"attempt exceeded its timeout of {timeout_seconds:g}s; its outcome is unknown"
    if is_async(fn):
        return _run_async(lambda: fn(*args), began=False, timeout=timeout_seconds, timed_out=what)
    outcome: list[Any] = []
    failure: list[BaseException] = []
    tracked: list[abandoned.Abandoned] = []

    def target() -> None:
        try:
            outcome.append(_call(fn, *args))
        except BaseException as exc:
            # Raised in this thread, never by a signal: the attempt's outcome.
            failure.append(step_exited(exc))
        finally:
            for entry in tracked:
                abandoned.discard(entry)

    # The step sees the caller's context variables (the attempt's span among them), as a
    # call without a timeout does.
    context = contextvars.copy_context()
    thread = threading.Thread(target=context.run, args=(target,), name="saga-attempt", daemon=True)
    thread.start()
    thread.join(timeout_seconds)
    if thread.is_alive():
        if ctx is None:
            raise AttemptTimedOut(what)
        entry = abandoned.Abandoned(
            ctx.saga_id, ctx.step, ctx.kind, ctx.attempt, timeout_seconds, thread
        )
        tracked.append(entry)
        abandoned.add(entry)
        if not thread.is_alive():  # ended before it was tracked: target() missed it
            abandoned.discard(entry)
        if abandoned.wait_for(ctx.saga_id, ctx.step, ctx.kind):
            waited = abandoned.wait_bound(timeout_seconds)
            raise AttemptTimedOut(
                f"{what}: {entry.describe()} after {waited:g}s more; resolve it once it has ended",
                still_running=True,
            )
        raise AttemptTimedOut(f"{what} (it ended late; settled as any unknown outcome)")
    if failure:
        raise failure[0]
    return outcome[0]


def _call(fn: Callable[..., Any], *args: Any) -> Any:
    """Call a user function; an async one (or one that returns an awaitable) is awaited in
    an event loop of its own. `NotCalledError` or `MachineryFailedError` when that loop fails."""
    if is_async(fn):
        # Nothing of an async function runs before its coroutine is awaited, in the loop.
        return _run_async(lambda: fn(*args), began=False)
    result = fn(*args)
    if inspect.isawaitable(result):
        return _run_async(lambda: result, began=True)
    return result


def _run_async(
    make: Callable[[], Any],
    *,
    began: bool,
    timeout: float | None = None,
    timed_out: str = "",
) -> Any:
    """Await `make()` in a new event loop (bounded by `timeout`, past which
    `AttemptTimedOut(timed_out)`), telling the machinery's failures from the function's.

    `began`: user code already ran to produce the awaitable. If the loop fails before our
    coroutine starts, that is `NotCalledError` (nothing of the function ran) or, when `began`,
    `MachineryFailedError`; if it fails as it closes after the function returned, the result
    stands. An exception of the function itself is raised as it is.
    """
    entered = False
    returned: list[Any] = []

    async def main() -> Any:
        nonlocal entered
        entered = True
        # A TimeoutError is ours only when our deadline expired: the function's own is its
        # outcome, classified by its policy.
        scope = asyncio.timeout(timeout)
        try:
            async with scope:
                value = await make()
        except TimeoutError:
            if not scope.expired():
                raise
            raise AttemptTimedOut(timed_out) from None
        returned.append(value)
        return value

    coro = main()
    try:
        return asyncio.run(coro)
    except Exception as exc:
        if not entered:
            coro.close()
            if began:
                pending = make()
                if inspect.iscoroutine(pending):
                    pending.close()  # never to be awaited: no "never awaited" warning
                raise MachineryFailedError(exc) from exc
            raise NotCalledError(exc) from exc
        if returned:
            _log.warning("event_loop_close_failed", error=describe_error(exc))
            return returned[0]
        raise
