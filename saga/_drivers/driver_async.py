"""The asyncio driver: carries out the flows of `saga._flows.drive` on the caller's event loop.

Async user code is awaited on the loop (a timeout cancels it); sync user code runs in a
thread, never on the loop. Leases are kept alive by a heartbeat task, waits are
`asyncio` waits, and PostgreSQL is reached through `AsyncStore`. The flows, and so every
decision and every write, are the ones the sync `Runner` carries out.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from typing import Any, TypeVar

from saga._core.planner import Next, OpRow, Planner, SagaRow
from saga._db.store_async import AConn, AsyncStore
from saga._drivers import abandoned
from saga._flows.claim import Flows
from saga._flows.drive import RunnerOptions, describe_error, retried
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

_log = get_logger("saga")

T = TypeVar("T")


class AsyncLeaseKeeper:
    """Renews, every `heartbeat_seconds`, the leases of the sagas whose attempts are in
    flight on this loop, in one statement for all of them (the task twin of
    `saga._drivers.leases.LeaseKeeper`; leases are held by (saga id, fence) in the same way)."""

    def __init__(
        self, store: AsyncStore, *, owner: str, lease_seconds: float, heartbeat_seconds: float
    ) -> None:
        self.store = store
        self.owner = owner
        self.lease_seconds = lease_seconds
        self.heartbeat_seconds = heartbeat_seconds
        self._held: dict[tuple[str, int], int] = {}
        self._task: asyncio.Task[None] | None = None

    @contextlib.contextmanager
    def holding(self, saga_id: str, fence: int) -> Iterator[None]:
        """Keep the lease of `saga_id` at `fence` alive for the duration of the block
        (entered on the loop's thread)."""
        key = (saga_id, fence)
        self._held[key] = self._held.get(key, 0) + 1
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(
                self._beat(), name=f"saga-heartbeat-{self.owner}"
            )
        try:
            yield
        finally:
            left = self._held.get(key, 0) - 1
            if left > 0:
                self._held[key] = left
            else:
                self._held.pop(key, None)

    async def aclose(self) -> None:
        """Stop the heartbeat task (leases then expire unless renewed by writes)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_seconds)
            held = set(self._held)
            if not held:
                continue
            try:
                alive = await self.store.renew_leases(
                    held, owner=self.owner, lease_seconds=self.lease_seconds
                )
            except Exception as exc:  # outcome writes will find out; keep trying meanwhile
                _log.warning("heartbeat_failed", error=describe_error(exc))
                continue
            for saga_id, fence in held - alive:
                if self._held.pop((saga_id, fence), None) is not None:
                    _log.warning("heartbeat_lease_lost", saga_id=saga_id, fence=fence)


class AsyncRunner:
    """Drives claimed sagas under a lease on the running loop; every write is fenced."""

    def __init__(
        self,
        store: AsyncStore,
        options: RunnerOptions,
        *,
        keeper: AsyncLeaseKeeper,
        stopping: asyncio.Event | None = None,
    ) -> None:
        self.store = store
        self.keeper = keeper
        self.options = options
        self.owner = options.owner
        self.lease_seconds = options.lease_seconds
        self.stopping = stopping or asyncio.Event()
        self.flows = Flows(options, reporter=self._spend_reporter)

    async def claim_and_drive(self, definition: Saga[Any], saga_id: str) -> SagaState | None:
        """Claim one saga and drive it until it stops; None when it could not be claimed."""
        return await self.run(self.flows.claim_and_drive(definition, saga_id))

    async def claim_next(
        self, kinds: Sequence[str], lookup: Callable[[str, int], Saga[Any]]
    ) -> tuple[Planner, Next] | None:
        """Claim the longest-waiting runnable saga of these kinds and plan its first move."""
        return await self.run(self.flows.claim_next(kinds, lookup))

    async def claim_batch(
        self, kinds: Sequence[str], lookup: Callable[[str, int], Saga[Any]], limit: int
    ) -> list[tuple[Planner, Next]]:
        """Claim up to `limit` runnable sagas of these kinds in one statement and one commit,
        each with its first move planned and recorded; in run_after order."""
        return await self.run(self.flows.claim_batch(kinds, lookup, limit))

    async def drive(self, planner: Planner, nxt: Next) -> SagaState | None:
        """Carry out `nxt` and every move after it until the saga stops or is handed back."""
        return await self.run(self.flows.drive(planner, nxt))

    async def run(self, flow: Flow[T]) -> T:
        """Carry out every effect `flow` yields, and return what it returns."""
        return await acarry_out(flow, self._effect, self._open)

    # ----- effects -------------------------------------------------------------------------

    def _open(self, pipelined: bool) -> AbstractAsyncContextManager[AConn]:
        return self.store.pipelined() if pipelined else self.store.transaction()

    async def _effect(self, effect: Effect, conn: AConn | None) -> Any:
        if isinstance(effect, Db):
            method = getattr(self.store, effect.method)
            if effect.method.endswith("_txn"):
                assert conn is not None, f"{effect.method} outside a transaction"
                return await method(conn, *effect.args, **effect.kwargs)
            return await method(*effect.args, **effect.kwargs)
        if isinstance(effect, Call):
            return await self._call(effect)
        if isinstance(effect, Fetch):
            return await effect.read()
        if isinstance(effect, Stopping):
            return self.stopping.is_set()
        if isinstance(effect, Wait):
            if effect.hold is None:
                await self._wait(effect.seconds)
            else:
                with self.keeper.holding(*effect.hold):
                    await self._wait(effect.seconds)
            return None
        if isinstance(effect, Pause):
            if effect.interruptible:
                await self._wait(effect.seconds)
            else:
                await asyncio.sleep(effect.seconds)
            return None
        if isinstance(effect, AwaitAbandoned):
            if not abandoned.still_running(effect.saga_id, effect.step, effect.kind):
                return []
            with self.keeper.holding(*effect.hold):
                return await asyncio.to_thread(
                    abandoned.wait_for, effect.saga_id, effect.step, effect.kind
                )
        raise TypeError(f"not an effect of a flow: {effect!r}")  # pragma: no cover

    async def _wait(self, seconds: float) -> None:
        """Wait `seconds`, or until the runner is stopping."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stopping.wait(), seconds)

    async def _call(self, effect: Call) -> Any:
        ctx = effect.args[0] if effect.args and isinstance(effect.args[0], StepContext) else None
        if effect.hold is None:
            return await _call_bounded(effect.fn, effect.args, effect.timeout_seconds, None)
        with self.keeper.holding(*effect.hold):
            try:
                return await _call_bounded(effect.fn, effect.args, effect.timeout_seconds, ctx)
            finally:
                if ctx is not None and isinstance(ctx._report, _SpendReporter):
                    await ctx._report.drain()

    def _spend_reporter(self, saga: SagaRow, op: OpRow) -> Callable[[float], None]:
        return _SpendReporter(self, saga, op, asyncio.get_running_loop())


class _SpendReporter:
    """Persists the running total an attempt reports with `ctx.spend()` (see the sync
    runner's reporter): from the loop's thread the write is a task, awaited before the
    attempt's outcome is recorded; from a step's thread it is waited for there."""

    def __init__(
        self, runner: AsyncRunner, saga: SagaRow, op: OpRow, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.runner = runner
        self.saga = saga
        self.op = op
        self.loop = loop
        self.pending: list[asyncio.Future[None]] = []

    def __call__(self, total: float) -> None:
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

    async def drain(self) -> None:
        pending, self.pending = self.pending, []
        for task in pending:
            await task

    async def _write(self, total: float) -> None:
        saga, op = self.saga, self.op

        def write() -> Flow[bool]:
            written: bool = yield Db(
                "report_spend",
                (saga.id,),
                {
                    "step": op.step,
                    "kind": op.kind,
                    "attempt": op.attempts,
                    "total": total,
                    "owner": self.runner.owner,
                    "fence": saga.fence,
                },
            )
            return written

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


async def acarry_out(
    flow: Flow[T],
    effect: Callable[[Effect, AConn | None], Any],
    open_transaction: Callable[[bool], AbstractAsyncContextManager[AConn]],
) -> T:
    """The asyncio twin of `saga._drivers.driver.carry_out`: run `flow` to its end, awaiting each
    effect; `Begin` opens a transaction that `Commit` commits, rolled back by an error."""
    txn: AsyncExitStack | None = None
    conn: AConn | None = None
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
                await txn.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        value, error = None, None
        try:
            if isinstance(step, Begin):
                assert txn is None, "transactions do not nest"
                txn = AsyncExitStack()
                conn = await txn.enter_async_context(open_transaction(step.pipelined))
            elif isinstance(step, Commit):
                assert txn is not None, "Commit without Begin"
                done, txn, conn = txn, None, None
                await done.aclose()
            else:
                value = await effect(step, conn)
        except BaseException as exc:
            if txn is not None:
                failed, txn, conn = txn, None, None
                try:
                    await failed.__aexit__(type(exc), exc, exc.__traceback__)
                except BaseException as raised:
                    exc = raised
            error = exc


async def _call_bounded(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    timeout_seconds: float | None,
    ctx: StepContext | None,
) -> Any:
    """Call `fn(*args)`: awaited on this loop when async (a timeout cancels it), else in a
    thread (a timeout abandons it to run on, tracked in `saga._drivers.abandoned` and waited for
    as the sync runner does). Raises `AttemptTimedOut` past the timeout."""
    if ctx is not None and abandoned.still_running(ctx.saga_id, ctx.step, ctx.kind):
        late = await asyncio.to_thread(abandoned.wait_for, ctx.saga_id, ctx.step, ctx.kind)
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
    if is_async(fn):
        if timeout_seconds is None:
            return await _awaited(lambda: fn(*args))
        # A TimeoutError is the orchestrator's only when its own deadline expired: the
        # step's own (a read timeout of its client) is the step's outcome, classified by
        # its policy, as in the sync door.
        scope = asyncio.timeout(timeout_seconds)
        try:
            async with scope:
                return await _awaited(lambda: fn(*args))
        except TimeoutError:
            if not scope.expired():
                raise
            raise AttemptTimedOut(what) from None
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()
    # An abandoned call's late outcome is nobody's to read: retrieve it, so that asyncio
    # does not report an exception "never retrieved".
    done.add_done_callback(lambda f: f.cancelled() or f.exception())
    tracked: list[abandoned.Abandoned] = []

    def settle(value: Any, exc: BaseException | None) -> None:
        if done.cancelled():
            return
        if exc is not None:
            done.set_exception(exc)
        else:
            done.set_result(value)

    def target() -> None:
        try:
            value = fn(*args)
        except BaseException as exc:
            # Raised in this thread, never by a signal: the attempt's outcome.
            loop.call_soon_threadsafe(settle, None, step_exited(exc))
        else:
            loop.call_soon_threadsafe(settle, value, None)
        finally:
            for entry in tracked:
                abandoned.discard(entry)

    # The step sees the caller's context variables, as asyncio.to_thread would show them.
    context = contextvars.copy_context()
    thread = threading.Thread(target=context.run, args=(target,), name="saga-attempt", daemon=True)
    try:
        thread.start()
    except RuntimeError as exc:  # no thread could be started: nothing of the step ran
        raise NotCalledError(exc) from exc
    scope = asyncio.timeout(timeout_seconds)
    try:
        async with scope:
            value = await asyncio.shield(done)
    except TimeoutError:
        if not scope.expired():
            raise  # the step's own TimeoutError, not our deadline
        if ctx is None:
            raise AttemptTimedOut(what) from None
        assert timeout_seconds is not None
        entry = abandoned.Abandoned(
            ctx.saga_id, ctx.step, ctx.kind, ctx.attempt, timeout_seconds, thread
        )
        tracked.append(entry)
        abandoned.add(entry)
        if not thread.is_alive():  # ended before it was tracked: target() missed it
            abandoned.discard(entry)
        if await asyncio.to_thread(abandoned.wait_for, ctx.saga_id, ctx.step, ctx.kind):
            waited = abandoned.wait_bound(timeout_seconds)
            raise AttemptTimedOut(
                f"{what}: {entry.describe()} after {waited:g}s more; resolve it once it has ended",
                still_running=True,
            ) from None
        raise AttemptTimedOut(f"{what} (it ended late; settled as any unknown outcome)") from None
    if inspect.isawaitable(value):
        return await _awaited(lambda: value)
    return value


async def _awaited(make: Callable[[], Any]) -> Any:
    """Await the awaitable `make()` returns, from user code. A `BaseException` it raises
    that is neither an `Exception` nor the cancellation of its task (`SystemExit`,
    `KeyboardInterrupt`) becomes the attempt's outcome (`StepExited`): out of a task, it
    would stop the event loop and every saga on it."""
    try:
        return await make()
    except (Exception, asyncio.CancelledError):
        raise
    except BaseException as exc:
        outcome = step_exited(exc)
        if outcome is exc:
            raise
        raise outcome from exc
