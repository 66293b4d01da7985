"""Helpers shared by the integration tests: a saga input model, quick retries, raw SQL reads."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import psycopg
from psycopg import sql
from pydantic import BaseModel

from saga import Orchestrator, RetryPolicy, Saga, SagaState, StepContext

T = TypeVar("T")

# make_orch(*sagas, lease_seconds=10.0, owner=None) -> Orchestrator (fixture in conftest.py)
OrchestratorFactory = Callable[..., Orchestrator]

# Tiny backoffs keep retry tests fast: seconds.
FAST = RetryPolicy(max_attempts=3, initial_delay=0.01, max_delay=0.02)


class Order(BaseModel):
    """The input of most test sagas."""

    tenant_id: str = "acme"
    order_id: str
    amount_cents: int = 100
    requested_at: str | None = None  # volatile


class Receipt(BaseModel):
    """A pydantic result, stored as JSON and rebuilt from the return annotation."""

    receipt_id: str
    amount_cents: int


def order_saga(name: str, *, version: int = 1) -> Saga[Order]:
    """A saga over `Order`, keyed by order id, per tenant, `requested_at` volatile."""
    return Saga(
        name,
        version=version,
        input=Order,
        key=lambda o: o.order_id,
        tenant=lambda o: o.tenant_id,
        volatile=("requested_at",),
    )


def scalar(url: str, query: str, params: tuple[Any, ...] | dict[str, Any] = ()) -> Any:
    """First column of the first row of `query`, read with a fresh connection."""
    with psycopg.connect(url) as conn:
        row = conn.execute(query.encode(), params).fetchone()
    assert row is not None
    return row[0]


def count_rows(url: str, table: str, saga_id: str | None = None) -> int:
    """Rows of `saga.<table>`, optionally of one saga only (read directly, not via the API)."""
    query = sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier("saga", table))
    with psycopg.connect(url) as conn:
        if saga_id is None:
            row = conn.execute(query).fetchone()
        else:
            query = query + sql.SQL(" WHERE {} = %s::uuid").format(
                sql.Identifier("id" if table == "sagas" else "saga_id")
            )
            row = conn.execute(query, (saga_id,)).fetchone()
    assert row is not None
    return int(row[0])


def events(state_history: list[Any]) -> list[str]:
    """Event names of a history, in order."""
    return [e.event for e in state_history]


def is_subsequence(wanted: list[str], seen: list[str]) -> bool:
    """True when `wanted` appears in `seen` in this order (other items may sit between)."""
    it = iter(seen)
    return all(any(w == s for s in it) for w in wanted)


def wait_until(predicate: Callable[[], T], *, timeout: float = 20.0, interval: float = 0.05) -> T:
    """Poll `predicate` until it returns a truthy value; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)


def lease_expired(url: str, saga_id: str) -> bool:
    """True when nobody holds a live lease on the saga (by the database clock)."""
    return bool(
        scalar(
            url,
            "SELECT lease_expires_at IS NULL OR lease_expires_at < now()"
            " FROM saga.sagas WHERE id = %s::uuid",
            (saga_id,),
        )
    )


def actions(state: SagaState) -> list[tuple[str, str, int]]:
    """(step, status, attempts) of the saga's forward operations, in step order."""
    return [
        (op.step, str(op.status), op.attempts) for op in state.operations if op.kind == "action"
    ]


def compensations(state: SagaState) -> dict[str, tuple[str, int]]:
    """step -> (status, attempts) of the saga's compensation operations."""
    return {
        op.step: (str(op.status), op.attempts)
        for op in state.operations
        if op.kind == "compensation"
    }


class ChildApp:
    """A `crash_app.py` child process whose `CRASH_APP ...` lines are read with deadlines."""

    def __init__(self, url: str, saga: str, order_id: str, **env: str) -> None:
        import os
        import queue
        import subprocess
        import sys
        import threading
        from pathlib import Path

        self.lines: queue.Queue[str | None] = queue.Queue()
        self.output: list[str] = []
        script = Path(__file__).resolve().parent / "crash_app.py"
        child_env = {**os.environ, "CRASH_APP_DATABASE_URL": url, **env}
        self.proc = subprocess.Popen(
            [sys.executable, str(script), saga, order_id],
            env=child_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)
            if line.startswith("CRASH_APP "):
                self.lines.put(line[len("CRASH_APP ") :].strip())
        self.lines.put(None)

    def expect(self, prefix: str, *, timeout: float = 30.0) -> str:
        """The next signal line, which must start with `prefix`; fails after `timeout` seconds."""
        import queue

        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(
                f"child sent no {prefix!r} within {timeout}s:\n{''.join(self.output)}"
            ) from None
        assert line is not None, f"child exited before {prefix!r}:\n{''.join(self.output)}"
        assert line.startswith(prefix), f"expected {prefix!r}, got {line!r}"
        return line

    def signal(self, signum: int) -> None:
        import os

        os.kill(self.proc.pid, signum)

    def wait(self, *, timeout: float = 30.0) -> int:
        """Exit code of the child (negative: killed by that signal)."""
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=timeout)
        return code

    def kill(self) -> None:
        """SIGKILL the child if it still runs (safety net after a failed assertion)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        if self.proc.stdout is not None:
            self._reader.join(timeout=30)
            self.proc.stdout.close()


def record_step_call(url: str, ctx: StepContext) -> None:
    """Record a step call (its step and attempt) for the `calls` fixture."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO step_log (step, attempt) VALUES (%s, %s)", (ctx.step, ctx.attempt)
        )


@contextlib.contextmanager
def starts_held(database_url: str) -> Iterator[None]:
    """Starts block on the wire while the block runs (a transaction holds a lock on the
    sagas table that their INSERT waits for), and go on when it ends: the starts made
    meanwhile queue behind the first (group commit), as they would behind a slow one.
    The transaction is rolled back: it commits nothing."""
    with psycopg.connect(database_url) as conn:
        conn.execute("LOCK TABLE saga.sagas IN SHARE MODE")
        try:
            yield
        finally:
            conn.rollback()
