"""Carries out the protocol's decisions for one saga: transactions, calls, heartbeats."""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

import structlog

from saga.context import StepContext
from saga.definition import Saga
from saga.errors import LeaseLost
from saga.outcomes import Absent, Found, Inconclusive
from saga.protocol import AskReconcile, Event, Invoke, Next, OpRow, Planner, SagaRow, Sleep, Stop
from saga.store import Conn, Store

_log: structlog.typing.FilteringBoundLogger = structlog.get_logger("saga")


class Runner:
    """Drives claimed sagas under a lease; every write is fenced."""

    def __init__(self, store: Store, *, owner: str, lease_seconds: float) -> None:
        self.store = store
        self.owner = owner
        self.lease_seconds = lease_seconds

    # ----- entry points ------------------------------------------------------------------

    def claim_and_drive(self, definition: Saga[Any], saga_id: str) -> bool:
        """Claim one saga and drive it until it stops; False when it could not be claimed."""
        with self.store.transaction() as conn:
            row = self.store.claim_txn(
                conn, saga_id, owner=self.owner, lease_seconds=self.lease_seconds
            )
            if row is None:
                return False
            planner, nxt = self._begin_txn(conn, definition, row)
        self._drive(planner, nxt)
        return True

    def claim_next(
        self, kinds: Sequence[str], lookup: Callable[[str, int], Saga[Any]]
    ) -> tuple[Planner, Next] | None:
        """Claim the longest-waiting runnable saga of these name:version kinds and plan its
        first move in the same transaction; None when there is nothing to claim."""
        with self.store.transaction() as conn:
            row = self.store.claim_next_txn(
                conn, kinds=kinds, owner=self.owner, lease_seconds=self.lease_seconds
            )
            if row is None:
                return None
            return self._begin_txn(conn, lookup(row.name, row.version), row)

    def drive(self, planner: Planner, nxt: Next) -> None:
        """Carry out `nxt` and every move after it until the saga stops."""
        self._drive(planner, nxt)

    # ----- the loop ----------------------------------------------------------------------

    def _begin_txn(self, conn: Conn, definition: Saga[Any], row: SagaRow) -> tuple[Planner, Next]:
        ops = self.store.operations_txn(conn, row.id)
        planner = Planner(definition, row, ops)
        planner.events.append(
            Event("lease_acquired", detail={"owner": self.owner, "fence": row.fence})
        )
        nxt = planner.advance()
        self._persist_txn(conn, planner, nxt)
        return planner, nxt

    def _drive(self, planner: Planner, nxt: Next) -> None:
        saga = planner.saga
        try:
            while not isinstance(nxt, Stop):
                if isinstance(nxt, Sleep):
                    delay = (nxt.until - datetime.now().astimezone()).total_seconds()
                    if delay > 0:
                        time.sleep(delay)
                    nxt = self._transact(planner, lambda p: None)
                elif isinstance(nxt, Invoke):
                    nxt = self._invoke(planner, nxt.op)
                elif isinstance(nxt, AskReconcile):
                    nxt = self._reconcile(planner, nxt.op)
        except LeaseLost as exc:
            _log.warning("lease_lost", saga_id=saga.id, fence=saga.fence, error=str(exc))
        except BaseException:
            # Leave the saga to the next owner right away rather than after lease expiry.
            try:
                self.store.release_lease(saga.id, owner=self.owner, fence=saga.fence)
            except Exception:
                _log.exception("lease_release_failed", saga_id=saga.id)
            raise

    def _transact(self, planner: Planner, mutate: Callable[[Planner], None]) -> Next:
        saga = planner.saga
        with self.store.transaction() as conn:
            self.store.check_fence_txn(
                conn, saga.id, owner=self.owner, fence=saga.fence, lease_seconds=self.lease_seconds
            )
            mutate(planner)
            nxt = planner.advance()
            self._persist_txn(conn, planner, nxt)
        return nxt

    def _persist_txn(self, conn: Conn, planner: Planner, nxt: Next) -> None:
        saga = planner.saga
        lease_until: datetime | None = None
        if isinstance(nxt, Sleep):
            saga.run_after = nxt.until
            # Keep the lease through the backoff, so no other worker starts the retry early.
            lease_until = nxt.until + timedelta(seconds=self.lease_seconds)
        if isinstance(nxt, Stop):
            planner.events.append(Event("lease_released", detail={"owner": self.owner}))
        events = planner.take_events()
        self.store.save_txn(
            conn, saga, planner.ops, events, release=isinstance(nxt, Stop), lease_until=lease_until
        )
        # Logged once the transaction is about to commit; a rollback raises past this point.
        for event in events:
            log_event(saga, planner, event)

    # ----- calling user code -------------------------------------------------------------

    def _context(self, planner: Planner, op: OpRow) -> StepContext:
        saga = planner.saga
        results = {
            name: planner.definition.step_named(name).codec.decode(value)  # type: ignore[union-attr]
            for name, value in planner.results().items()
        }
        return StepContext(
            saga_id=saga.id,
            tenant_id=saga.tenant_id,
            step=op.step,
            kind=op.kind,
            idempotency_key=op.idempotency_key,
            attempt=op.attempts,
            fence=saga.fence,
            results=results,
            log=_log.bind(
                saga_id=saga.id,
                step=op.step,
                kind=op.kind,
                attempt=op.attempts,
                idempotency_key=op.idempotency_key,
            ),
        )

    def _arguments(self, planner: Planner, op: OpRow) -> tuple[Any, ...]:
        data = planner.definition.validate_input(planner.saga.input)
        if op.kind == "action":
            return (data,)
        step = planner.step_of(op)
        action = planner.find(op.step, "action")
        stored = action.result if action is not None and action.status == "succeeded" else None
        return (data, step.codec.decode(stored))

    def _invoke(self, planner: Planner, op: OpRow) -> Next:
        step = planner.step_of(op)
        if op.kind == "action":
            fn, codec, policy = step.fn, step.codec, step.retry
        else:
            comp = step.compensation_op
            assert comp is not None
            fn, codec, policy = comp.fn, comp.codec, comp.retry
        ctx = self._context(planner, op)
        try:
            with _Heartbeat(self, planner.saga):
                value = _call(fn, ctx, *self._arguments(planner, op))
        except Exception as exc:
            error = _describe_error(exc)
            retryable = policy.is_retryable(exc)
            delay = policy.delay_after(op.attempts) if retryable else 0.0
            if not retryable:
                ctx.log.warning("attempt_raised", error=error, traceback=traceback.format_exc())
            return self._transact(
                planner, lambda p: p.record_failure(op, error, retryable=retryable, delay=delay)
            )
        try:
            stored = codec.encode(value)
        except TypeError as exc:
            reason = f"TypeError: {exc}; the effect may have happened, so a human decides"
            return self._transact(planner, lambda p: p.record_unknown(op, reason, park=True))
        return self._transact(planner, lambda p: p.record_success(op, stored))

    def _reconcile(self, planner: Planner, op: OpRow) -> Next:
        fn = planner.reconcile_fn(op)
        ctx = self._context(planner, op)
        step = planner.step_of(op)
        codec = step.codec if op.kind == "action" else step.compensation_op.codec  # type: ignore[union-attr]
        try:
            answer = _call(fn, ctx, *self._arguments(planner, op))
            if isinstance(answer, Found):
                stored = codec.encode(answer.result)
                ref = answer.provider_reference
                return self._transact(planner, lambda p: p.record_found(op, stored, ref))
            if isinstance(answer, Absent):
                return self._transact(planner, lambda p: p.record_absent(op))
            if isinstance(answer, Inconclusive):
                reason = answer.reason or "the provider's answer was inconclusive"
            else:
                reason = (
                    f"reconcile returned {type(answer).__name__}; expected Found, Absent or "
                    "Inconclusive"
                )
        except Exception as exc:
            reason = f"reconcile raised {_describe_error(exc)}"
        return self._transact(planner, lambda p: p.record_inconclusive(op, reason))


class _Heartbeat:
    """Renews the lease while user code runs, so a long step is not taken for a dead one."""

    def __init__(self, runner: Runner, saga: SagaRow) -> None:
        self.runner = runner
        self.saga = saga
        self.stopped = threading.Event()
        self.thread = threading.Thread(
            target=self._beat, name=f"saga-heartbeat-{saga.id}", daemon=True
        )

    def __enter__(self) -> _Heartbeat:
        self.thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stopped.set()
        self.thread.join()

    def _beat(self) -> None:
        interval = max(self.runner.lease_seconds / 3.0, 0.05)
        while not self.stopped.wait(interval):
            try:
                alive = self.runner.store.renew_lease(
                    self.saga.id,
                    owner=self.runner.owner,
                    fence=self.saga.fence,
                    lease_seconds=self.runner.lease_seconds,
                )
            except Exception as exc:  # the outcome write will find out; keep trying meanwhile
                _log.warning("heartbeat_failed", saga_id=self.saga.id, error=str(exc))
                continue
            if not alive:
                _log.warning("heartbeat_lease_lost", saga_id=self.saga.id, fence=self.saga.fence)
                return


def _call(fn: Callable[..., Any], *args: Any) -> Any:
    result = fn(*args)
    if inspect.isawaitable(result):
        return asyncio.run(_await(result))
    return result


async def _await(awaitable: Any) -> Any:
    return await awaitable


def _describe_error(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def log_event(saga: SagaRow, planner: Planner, event: Event) -> None:
    """Log an audit event with structlog, bound with saga id, step, attempt and key."""
    fields: Mapping[str, Any] = {
        "saga_id": saga.id,
        "saga": saga.name,
        "tenant_id": saga.tenant_id,
    }
    extra: dict[str, Any] = {}
    if event.step is not None:
        op = planner.find(event.step, event.kind or "action")
        extra = {
            "step": event.step,
            "kind": event.kind,
            "attempt": event.attempt,
            "idempotency_key": op.idempotency_key if op is not None else None,
        }
    _log.info(event.event, **fields, **extra, **event.detail)
