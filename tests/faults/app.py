"""The fault harness's app: a fake provider in PostgreSQL and sagas of 3 to 6 steps.

The provider keeps one row per request in `fault_provider.requests`: which key, which
attempt and fence, whether it was a duplicate of an earlier request and whether the
effect was performed. It has three kinds of endpoints, as real providers do:

- `dedupe`: honours idempotency keys; a repeated key is answered with the first result
  and recorded as a duplicate, not performed again;
- `fenced`: performs every request, but lets the caller look a key up (for `reconcile`
  hooks) and refuses requests whose fencing token is lower than one already seen for
  that key, so a stalled worker's late call cannot land after its successor's;
- `plain`: performs every request; the orchestrator must never repeat one.

So an effect performed twice for one key is always the orchestrator's fault.

Run as `python -m faults.app` (with `tests/` on the path) it is a worker process:
`SAGA_DATABASE_URL`, `FAULT_PROVIDER_URL`, and optionally `SAGA_FAULT`,
`FAULT_LEASE_SECONDS`, `FAULT_CONCURRENCY`, `FAULT_UNTIL_IDLE`, `FAULT_OWNER`,
`FAULT_STEP_DELAY` (seconds each step sleeps before calling the provider) and
`FAULT_ASYNC=1` (an `AsyncOrchestrator`'s `AsyncWorker` on an event loop instead of the
sync `Worker`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import structlog
from psycopg_pool import ConnectionPool
from pydantic import BaseModel

from saga import (
    Absent,
    AsyncOrchestrator,
    Found,
    Orchestrator,
    PermanentError,
    RetryPolicy,
    Saga,
    StepContext,
    TransientError,
)

ENV_PROVIDER_URL = "FAULT_PROVIDER_URL"
ENV_ASYNC = "FAULT_ASYNC"  # "1": the worker process runs an AsyncWorker
PROVIDER_APP_NAME = "fault_provider"  # application_name of provider connections

PROVIDER_SCHEMA = """
CREATE SCHEMA IF NOT EXISTS fault_provider;
CREATE TABLE IF NOT EXISTS fault_provider.requests (
    id              bigserial PRIMARY KEY,
    request_id      uuid NOT NULL UNIQUE,
    idempotency_key text NOT NULL,
    saga_key        text NOT NULL,
    step            text NOT NULL,
    kind            text NOT NULL,
    position        integer NOT NULL,
    attempt         integer NOT NULL,
    fence           bigint NOT NULL,
    pid             integer NOT NULL,
    endpoint        text NOT NULL,
    duplicate       boolean NOT NULL,
    stale           boolean NOT NULL,
    performed       boolean NOT NULL,
    effect_id       text NOT NULL,
    at              timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS requests_key ON fault_provider.requests (idempotency_key);
CREATE TABLE IF NOT EXISTS fault_provider.fences (
    idempotency_key text PRIMARY KEY,
    fence           bigint NOT NULL
);
"""

STEP_RETRY = RetryPolicy(max_attempts=4, initial_delay=0.01, max_delay=0.05)
COMPENSATION_RETRY = RetryPolicy(max_attempts=6, initial_delay=0.01, max_delay=0.05)


def create_provider(url: str) -> None:
    """Create the provider's tables (idempotent)."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(PROVIDER_SCHEMA)


class Provider:
    """Client of the fake provider: one connection per thread, exact about its outcomes.

    When the connection fails mid-request, the client looks its request up by id once
    the provider answers again, so it never reports a performed effect as failed (a real
    client cannot always know; the harness must not blame the orchestrator for that).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: ConnectionPool[Any] | None = None
        self._pool_url = ""

    @property
    def url(self) -> str:
        return os.environ[ENV_PROVIDER_URL]

    @contextmanager
    def _conn(self) -> Iterator[psycopg.Connection[Any]]:
        with self._lock:
            if self._pool is None or self._pool_url != self.url:
                if self._pool is not None:
                    self._pool.close()
                self._pool = ConnectionPool(
                    self.url,
                    min_size=0,
                    max_size=16,
                    kwargs={"autocommit": True, "application_name": PROVIDER_APP_NAME},
                    open=True,
                    name="fault-provider",
                )
                self._pool_url = self.url
            pool = self._pool
        with pool.connection() as conn:
            yield conn

    def close(self) -> None:
        """Close the provider's connections (the next call opens new ones)."""
        with self._lock:
            if self._pool is not None:
                self._pool.close()
            self._pool = None

    def perform(
        self, ctx: StepContext, *, saga_key: str, position: int, endpoint: str
    ) -> dict[str, Any]:
        """Perform (or deduplicate, or refuse) the effect of one call."""
        request_id = uuid.uuid4()
        try:
            return self._perform(ctx, request_id, saga_key, position, endpoint)
        except psycopg.OperationalError:
            found = self._lookup_request(request_id)
            if found is None:
                raise TransientError("provider unreachable; nothing was performed") from None
            return found

    def _perform(
        self, ctx: StepContext, request_id: uuid.UUID, saga_key: str, position: int, endpoint: str
    ) -> dict[str, Any]:
        key = ctx.idempotency_key
        with self._conn() as conn, conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (key,))
            first = conn.execute(
                "SELECT effect_id FROM fault_provider.requests"
                " WHERE idempotency_key = %s AND performed ORDER BY id LIMIT 1",
                (key,),
            ).fetchone()
            stale = False
            if endpoint == "fenced":
                seen = conn.execute(
                    "SELECT fence FROM fault_provider.fences WHERE idempotency_key = %s", (key,)
                ).fetchone()
                stale = seen is not None and seen[0] > ctx.fence
                if not stale:
                    self._see_fence(conn, key, ctx.fence)
            duplicate = first is not None
            performed = not stale and not (duplicate and endpoint == "dedupe")
            effect_id = f"fx_{request_id.hex[:12]}" if performed or first is None else first[0]
            conn.execute(
                "INSERT INTO fault_provider.requests (request_id, idempotency_key, saga_key, step,"
                " kind, position, attempt, fence, pid, endpoint, duplicate, stale, performed,"
                " effect_id) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
                (
                    request_id,
                    key,
                    saga_key,
                    ctx.step,
                    ctx.kind,
                    position,
                    ctx.attempt,
                    ctx.fence,
                    os.getpid(),
                    endpoint,
                    duplicate,
                    stale,
                    performed,
                    effect_id,
                ),
            )
        if stale:
            raise PermanentError(f"stale fencing token {ctx.fence} for {key}")
        return {"effect_id": effect_id, "step": ctx.step}

    @staticmethod
    def _see_fence(conn: psycopg.Connection[Any], key: str, fence: int) -> None:
        conn.execute(
            "INSERT INTO fault_provider.fences (idempotency_key, fence) VALUES (%s, %s)"
            " ON CONFLICT (idempotency_key) DO UPDATE"
            " SET fence = GREATEST(fault_provider.fences.fence, EXCLUDED.fence)",
            (key, fence),
        )

    def _lookup_request(self, request_id: uuid.UUID) -> dict[str, Any] | None:
        deadline = time.monotonic() + 60.0
        while True:
            try:
                with self._conn() as conn:
                    row = conn.execute(
                        "SELECT effect_id, step, stale FROM fault_provider.requests"
                        " WHERE request_id = %s",
                        (request_id,),
                    ).fetchone()
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
                continue
            if row is None:
                return None
            if row[2]:
                raise PermanentError("stale fencing token")
            return {"effect_id": row[0], "step": row[1]}

    def find(self, ctx: StepContext) -> dict[str, Any] | None:
        """A fenced endpoint's lookup by key; it raises the key's fence to the caller's."""
        key = ctx.idempotency_key
        with self._conn() as conn, conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (key,))
            self._see_fence(conn, key, ctx.fence)
            row = conn.execute(
                "SELECT effect_id, step FROM fault_provider.requests"
                " WHERE idempotency_key = %s AND performed ORDER BY id LIMIT 1",
                (key,),
            ).fetchone()
        return None if row is None else {"effect_id": row[0], "step": row[1]}


provider = Provider()


class FaultInput(BaseModel):
    """A saga's input: its key and its plan, drawn from a seed.

    `plan` maps a step name to `ok`, `transient:N` (its first N attempts fail) or
    `permanent`, and `undo:STEP` to `ok` or `transient:N` for its compensation.
    """

    key: str
    plan: dict[str, str] = {}


# name, endpoint of the step, endpoint of its compensation (None: no compensation)
Layout = list[tuple[str, str, str | None]]
LAYOUTS: dict[str, Layout] = {
    "fault3": [("a", "dedupe", "dedupe"), ("b", "fenced", "fenced"), ("c", "dedupe", None)],
    "fault4": [
        ("a", "fenced", "dedupe"),
        ("b", "dedupe", "fenced"),
        ("c", "plain", "dedupe"),
        ("d", "dedupe", "dedupe"),
    ],
    "fault5": [
        ("a", "dedupe", "dedupe"),
        ("b", "dedupe", "fenced"),
        ("c", "fenced", "dedupe"),
        ("d", "dedupe", None),
        ("e", "fenced", "dedupe"),
    ],
    "fault6": [
        ("a", "dedupe", "dedupe"),
        ("b", "fenced", "dedupe"),
        ("c", "dedupe", "dedupe"),
        ("d", "dedupe", "fenced"),
        ("e", "plain", "dedupe"),
        ("f", "dedupe", "dedupe"),
    ],
}


def _behave(plan: dict[str, str], name: str, attempt: int) -> None:
    behaviour = plan.get(name, "ok")
    if behaviour == "permanent":
        raise PermanentError(f"{name}: the plan says it fails")
    if behaviour.startswith("transient:") and attempt <= int(behaviour.split(":")[1]):
        raise TransientError(f"{name}: attempt {attempt} fails, the plan says")
    delay = float(os.environ.get("FAULT_STEP_DELAY", "0") or 0)
    if delay:
        time.sleep(delay)


def _build(name: str, layout: Layout) -> Saga[FaultInput]:
    saga: Saga[FaultInput] = Saga(name, version=1, input=FaultInput, key=lambda i: i.key)
    for position, (step_name, endpoint, undo) in enumerate(layout):
        _add_step(saga, step_name, position, endpoint, undo)
    return saga


def _add_step(
    saga: Saga[FaultInput], name: str, position: int, endpoint: str, undo: str | None
) -> None:
    def action(ctx: StepContext, data: FaultInput) -> dict[str, Any]:
        _behave(data.plan, name, ctx.attempt)
        return provider.perform(ctx, saga_key=data.key, position=position, endpoint=endpoint)

    step = saga.step(name=name, retry=STEP_RETRY, idempotent=endpoint == "dedupe")(action)
    if endpoint == "fenced":

        def find(ctx: StepContext, data: FaultInput) -> Found | Absent:
            found = provider.find(ctx)
            return (
                Absent() if found is None else Found(found, provider_reference=found["effect_id"])
            )

        step.reconcile(find)
    if undo is None:
        return

    def compensate(ctx: StepContext, data: FaultInput, result: dict[str, Any]) -> dict[str, Any]:
        _behave(data.plan, f"undo:{name}", ctx.attempt)
        return provider.perform(ctx, saga_key=data.key, position=position, endpoint=undo)

    comp = step.compensation(retry=COMPENSATION_RETRY, idempotent=undo == "dedupe")(compensate)
    if undo == "fenced":

        def find_undo(ctx: StepContext, data: FaultInput, result: dict[str, Any]) -> Found | Absent:
            found = provider.find(ctx)
            return (
                Absent() if found is None else Found(found, provider_reference=found["effect_id"])
            )

        comp.reconcile(find_undo)


SAGAS = {name: _build(name, layout) for name, layout in LAYOUTS.items()}
ALL_SAGAS = tuple(SAGAS.values())


def make_input(
    seed: int | str, index: int, *, prefix: str = "s"
) -> tuple[Saga[FaultInput], FaultInput]:
    """The saga and input of saga number `index` of a run with this seed (deterministic)."""
    rng = random.Random(f"{seed}:{index}")
    name = rng.choice(sorted(LAYOUTS))
    plan: dict[str, str] = {}
    failing = False
    for step_name, _endpoint, undo in LAYOUTS[name]:
        roll = rng.random()
        if roll < 0.08 and not failing:
            plan[step_name] = "permanent"
            failing = True
        elif roll < 0.25:
            plan[step_name] = f"transient:{rng.randint(1, 2)}"
        if undo is not None and rng.random() < 0.2:
            plan[f"undo:{step_name}"] = "transient:1"
    return SAGAS[name], FaultInput(key=f"{prefix}-{seed}-{index}", plan=plan)


def _settings() -> dict[str, Any]:
    """The orchestrator's arguments of a worker process, from its environment."""
    return {
        "sagas": ALL_SAGAS,
        "lease_seconds": float(os.environ.get("FAULT_LEASE_SECONDS", "1.0")),
        "owner": os.environ.get("FAULT_OWNER") or None,
    }


def _worker_settings() -> dict[str, Any]:
    return {
        "concurrency": int(os.environ.get("FAULT_CONCURRENCY", "4")),
        "poll_seconds": 0.2,
        "grace_seconds": 2.0,
        "short_wait_seconds": 0.5,
    }


def main() -> int:
    """A worker process of the harness (see the module docstring)."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    until_idle = os.environ.get("FAULT_UNTIL_IDLE") == "1"
    if os.environ.get(ENV_ASYNC) == "1":
        asyncio.run(_async_main(until_idle))
    else:
        with Orchestrator(os.environ["SAGA_DATABASE_URL"], **_settings()) as orch:
            worker = orch.worker(**_worker_settings())
            print(f"FAULT_WORKER ready {orch.owner}", flush=True)
            worker.run(until_idle=until_idle, handle_signals=True)
    provider.close()
    print("FAULT_WORKER stopped", flush=True)
    return 0


async def _async_main(until_idle: bool) -> None:
    """The worker process as an AsyncWorker: the same sagas (their sync steps run in
    threads of the worker), the same settings."""
    async with AsyncOrchestrator(os.environ["SAGA_DATABASE_URL"], **_settings()) as orch:
        worker = orch.worker(**_worker_settings())
        print(f"FAULT_WORKER ready {orch.owner} (asyncio)", flush=True)
        await worker.run(until_idle=until_idle, handle_signals=True)


if __name__ == "__main__":
    sys.exit(main())
