"""The effect boundary: runs a flow, carrying out each effect it yields, and observes them.

A flow (`saga._flows`) is a generator of effects; `acarry_out` sends each effect's result
back into it, or raises its error there, until the flow returns. Around every effect it
tells the flow's `Observer` (`saga._drivers.observe`) what happened, so fault points,
spans and the log of committed events stand here once, not in every flow; and it hands the
flow a transient database failure as `DatabaseInterrupted` whatever raised it, so the flows
know one error type and never the database driver's.

`acarry_out` (this file, the source) serves the asyncio driver; `carry_out`
(`boundary.py`, generated from it by `tools/async_to_sync.py`) the blocking one.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from typing import Any, TypeVar

from saga._db.dbretry import is_transient
from saga._db.store_async import AConn
from saga._drivers import faults
from saga._drivers.observe import Observer
from saga._flows.effects import (
    Armed,
    Begin,
    Call,
    Commit,
    Db,
    Drive,
    Effect,
    Flow,
    Observed,
    Reached,
)
from saga.errors import DatabaseInterrupted

T = TypeVar("T")

# The effects that may carry a `Watch`, and those the boundary carries out itself.
_WATCHED = (Db, Commit, Call)
_OWN = frozenset({Begin, Commit, Reached, Observed, Drive, Armed})


async def acarry_out(
    flow: Flow[T],
    effect: Callable[[Effect, AConn | None], Any],
    open_transaction: Callable[[bool], AbstractAsyncContextManager[AConn]],
    *,
    keys: bool = False,
) -> T:
    """Run `flow` to its end: each effect it yields is carried out by `effect` and its
    result sent back, or its error raised inside the flow. `Begin` opens a transaction
    (`open_transaction`) that `Commit` commits; an error inside it, raised by an effect
    or by the flow, rolls it back first. `keys`: spans carry keys and request hashes."""
    txn: AsyncExitStack | None = None
    conn: AConn | None = None
    value: Any = None
    error: BaseException | None = None
    seen = Observer(keys=keys)
    while True:
        try:
            step = flow.throw(error) if error is not None else flow.send(value)
        except StopIteration as stop:
            assert txn is None, "a flow ended inside a transaction"
            seen.ended(None)
            return stop.value  # type: ignore[no-any-return]
        except BaseException as exc:
            if txn is not None:
                await txn.__aexit__(type(exc), exc, exc.__traceback__)
            seen.ended(exc)
            raise
        value, error = None, None
        watch = step.watch if isinstance(step, _WATCHED) else None
        try:
            if watch is not None:
                seen.before(step, watch)
            if type(step) not in _OWN:  # the common case: the driver's to carry out
                value = await effect(step, conn)
            elif isinstance(step, Begin):
                assert txn is None, "transactions do not nest"
                txn = AsyncExitStack()
                conn = await txn.enter_async_context(open_transaction(step.pipelined))
            elif isinstance(step, Commit):
                assert txn is not None, "Commit without Begin"
                done, txn, conn = txn, None, None
                await done.aclose()
            elif isinstance(step, Reached):
                seen.reached(step.point)
            elif isinstance(step, Observed):
                for each in step.watches:
                    seen.before(step, each)
                    seen.done(step, each)
            elif isinstance(step, Drive):
                seen.drive(step)
            elif isinstance(step, Armed):
                value = faults.armed is not None
        except BaseException as exc:
            if txn is not None:
                # The transaction is rolled back before the flow hears of the error.
                failed, txn, conn = txn, None, None
                try:
                    await failed.__aexit__(type(exc), exc, exc.__traceback__)
                except BaseException as raised:
                    exc = raised
            seen.failed(step, watch, exc)
            error = exc if type(step) is Call else _interrupted(exc)
        else:
            if watch is not None:
                seen.done(step, watch)


def _interrupted(exc: BaseException) -> BaseException:
    """What the flow hears of `exc`, raised by database work: a transient failure as
    `DatabaseInterrupted` (its cause kept), anything else as it is."""
    if isinstance(exc, DatabaseInterrupted) or not is_transient(exc):
        return exc
    interrupted = DatabaseInterrupted(f"{type(exc).__name__}: {exc}".strip())
    interrupted.__cause__ = exc
    return interrupted
