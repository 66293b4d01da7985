"""The measured workloads, each run in a process of its own by bench/run.py.

    python bench/workloads.py SCENARIO '{"url": ..., ...}'

Each scenario prints one line `RESULT {json}` on stdout: its timings, latencies and the
peak RSS of its process. Worker processes (`worker`) also speak a small line protocol on
stdin/stdout (READY, then GO) so their start-up is not part of what is measured.

The async scenarios (`ours_async_sequential`, `async_worker`, `ours_workers` with
`"worker": "async_worker"`, `ours_sessions` with `"tasks"` above 0) import
`AsyncOrchestrator` only when they run, so the others work without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import resource
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psycopg
import structlog
from pydantic import BaseModel

from saga import Orchestrator, Saga, StepContext, durable_step

HERE = Path(__file__).resolve().parent
Result = dict[str, Any]


def quiet_logs() -> None:
    """Both systems are measured with their logs silenced (warnings and errors still pass)."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("dbos").setLevel(logging.ERROR)


def peak_rss_mb() -> float:
    """Peak resident set size of this process, in MiB (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def vm_hwm_mb(pid: int | str = "self") -> float | None:
    """VmHWM (peak resident set) of a process from /proc, in MiB; None where unreadable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError):
        return None
    return None


def emit(result: Result) -> None:
    result.setdefault("rss_mb", peak_rss_mb())
    try:
        print("RESULT " + json.dumps(result), flush=True)
    except BrokenPipeError:  # the coordinator has gone (it failed): nobody to tell
        os._exit(1)


def percentiles(samples: Sequence[float]) -> dict[str, float]:
    """p50 and p99 of latencies in seconds, returned in milliseconds."""
    if not samples:
        return {"p50_ms": float("nan"), "p99_ms": float("nan")}
    ordered = sorted(samples)
    cuts = statistics.quantiles(ordered, n=100, method="inclusive") if len(ordered) > 1 else None
    p50 = statistics.median(ordered)
    p99 = cuts[98] if cuts else ordered[0]
    return {"p50_ms": p50 * 1000.0, "p99_ms": p99 * 1000.0}


# ----- this project's sagas ---------------------------------------------------------------


class Item(BaseModel):
    """Input of the benchmark sagas."""

    id: str


def _noop(ctx: StepContext, item: Item) -> None:
    return None


def noop_saga(name: str = "bench") -> Saga[Item]:
    """A saga of three no-op steps."""
    saga: Saga[Item] = Saga(name, version=1, input=Item, key=lambda i: i.id)
    for step in ("s1", "s2", "s3"):
        saga.step(name=step)(_noop)
    return saga


async def _anoop(ctx: StepContext, item: Item) -> None:
    return None


def async_noop_saga(name: str = "bench") -> Saga[Item]:
    """The same saga as `noop_saga` (name, version, three no-op steps), its steps async."""
    saga: Saga[Item] = Saga(name, version=1, input=Item, key=lambda i: i.id)
    for step in ("s1", "s2", "s3"):
        saga.step(name=step)(_anoop)
    return saga


def async_slow_saga(seconds: float) -> Saga[Item]:
    """`slow_saga` with async steps: the first awaits asyncio.sleep(seconds)."""
    saga: Saga[Item] = Saga("bench", version=1, input=Item, key=lambda i: i.id)

    async def sleepy(ctx: StepContext, item: Item) -> None:
        await asyncio.sleep(seconds)

    saga.step(name="s1", idempotent=True)(sleepy)
    saga.step(name="s2")(_anoop)
    saga.step(name="s3")(_anoop)
    return saga


def bench_saga(steps: str, step_seconds: float = 0.0) -> Saga[Item]:
    """The benchmark saga ("bench", version 1) with sync (`noop_saga`) or async
    (`async_noop_saga`) steps; with `step_seconds`, async steps of which the first sleeps
    that long (`async_slow_saga`)."""
    if steps not in ("sync", "async"):
        raise ValueError(f"steps must be 'sync' or 'async', got {steps!r}")
    if step_seconds > 0:
        if steps != "async":
            raise ValueError("step_seconds is for async steps here (sync: saga_named)")
        return async_slow_saga(step_seconds)
    return async_noop_saga() if steps == "async" else noop_saga()


def slow_saga(seconds: float) -> Saga[Item]:
    """Three steps, the first sleeping `seconds` (idempotent, so a lost attempt is retried)."""
    saga: Saga[Item] = Saga("slow", version=1, input=Item, key=lambda i: i.id)

    def sleepy(ctx: StepContext, item: Item) -> None:
        time.sleep(seconds)

    saga.step(name="s1", idempotent=True)(sleepy)
    saga.step(name="s2")(_noop)
    saga.step(name="s3")(_noop)
    return saga


def saga_named(name: str, step_seconds: float) -> Saga[Item]:
    return slow_saga(step_seconds) if name == "slow" else noop_saga(name)


class RoundTrips:
    """Counts the round trips psycopg makes to the server.

    Every round trip goes through `Connection.wait`; the calls of it that wait for no
    answer are left out: entering a pipeline, executemany() sending its batch inside one
    (the answers come with the pipeline's sync, counted), committing an idle connection.
    """

    def __init__(self) -> None:
        self.count = 0
        self.waits = 0
        original = psycopg.Connection.wait
        counter = self

        def wait(conn: Any, *args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1)
            name = caller.f_code.co_name
            holder = type(caller.f_locals.get("self")).__name__
            idle = conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.IDLE
            counter.waits += 1
            if not (
                (name == "__enter__" and "Pipeline" in holder)
                or (name == "executemany" and conn._pipeline is not None)
                or (name == "commit" and idle)
            ):
                counter.count += 1
            return original(conn, *args, **kwargs)

        psycopg.Connection.wait = wait  # type: ignore[method-assign, assignment]


def ours_sequential(args: Result) -> Result:
    """N sagas one after another in this process, each with execute() (start and drive).

    With `"otel": true`, the OpenTelemetry SDK is configured first, as an application
    would: spans through a BatchSpanProcessor to an in-memory exporter, metrics to an
    in-memory reader (collected at the end), and each execute() inside a request span of
    its own, whose trace context the saga stores.

    With `"start_run": true`, each saga is started with start() and then driven with
    run(id) in this process: the production door, without a worker in between.

    With `"warmup": k`, k sagas run before the clock starts (what a process pays once:
    the SDK's first spans and instruments, psycopg's preparation of each statement).
    `"prefix"` starts the sagas' keys (default `seq`): runs in one database need their
    own."""
    saga = noop_saga()
    prefix = str(args.get("prefix", "seq"))
    start_run = bool(args.get("start_run"))
    n = int(args["n"])
    latencies: list[float] = []
    trips = RoundTrips() if args.get("count_round_trips") else None
    otel = _OpenTelemetry() if args.get("otel") else None
    with Orchestrator(args["url"], sagas=[saga], auto_migrate=False) as orch:
        orch.store  # connect before the clock starts  # noqa: B018
        for i in range(int(args.get("warmup", 0))):
            with otel.request() if otel is not None else contextlib.nullcontext():
                orch.execute(saga, Item(id=f"{prefix}-warmup-{i}"))
        if trips is not None:
            trips.count = trips.waits = 0
        profiler = _profiler(args)
        started, cpu0 = time.perf_counter(), time.process_time()
        for i in range(n):
            t0 = time.perf_counter()
            with otel.request() if otel is not None else contextlib.nullcontext():
                if start_run:
                    state = orch.run(orch.start(saga, Item(id=f"{prefix}-{i}")).id)
                else:
                    state = orch.execute(saga, Item(id=f"{prefix}-{i}"))
            latencies.append(time.perf_counter() - t0)
            if state.status != "completed":
                raise RuntimeError(f"saga {state.id} ended {state.status}")
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu0
        if profiler is not None:
            _write_profile(profiler, Path(args["profile"]))
    result: Result = {"elapsed": elapsed, "completed": n, "cpu_s": cpu, **percentiles(latencies)}
    if otel is not None:
        result.update(otel.exported())
    if trips is not None:
        result["round_trips_per_saga"] = trips.count / n
        result["psycopg_waits_per_saga"] = trips.waits / n
    return result


class _OpenTelemetry:
    """The OpenTelemetry SDK as an application configures it, exporting to memory."""

    def __init__(self) -> None:
        from opentelemetry import metrics, trace
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
            InMemorySpanExporter,
        )

        self.spans = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(BatchSpanProcessor(self.spans))
        trace.set_tracer_provider(self.provider)
        self.reader = InMemoryMetricReader()
        metrics.set_meter_provider(MeterProvider(metric_readers=[self.reader]))
        self.tracer = trace.get_tracer("bench")

    def request(self) -> contextlib.AbstractContextManager[Any]:
        """The span of the request that runs one saga."""
        return self.tracer.start_as_current_span("request")

    def exported(self) -> Result:
        """How many spans were exported and metric points collected (the check that the
        SDK was at work)."""
        self.provider.force_flush()
        data = self.reader.get_metrics_data()
        points = sum(
            len(metric.data.data_points)
            for resource in (data.resource_metrics if data is not None else ())
            for scope in resource.scope_metrics
            for metric in scope.metrics
        )
        return {"spans_exported": len(self.spans.get_finished_spans()), "metric_points": points}


# ----- sessions of durable steps --------------------------------------------------------------


# The session workload's three no-op durable steps, keyed by the session's run id (the
# canonical JSON of their argument), sync for Orchestrator.session, async for the asyncio door.
@durable_step(name="bench_d1")
def _d1(run: str) -> None:
    return None


@durable_step(name="bench_d2")
def _d2(run: str) -> None:
    return None


@durable_step(name="bench_d3")
def _d3(run: str) -> None:
    return None


@durable_step(name="bench_ad1")
async def _ad1(run: str) -> None:
    return None


@durable_step(name="bench_ad2")
async def _ad2(run: str) -> None:
    return None


@durable_step(name="bench_ad3")
async def _ad3(run: str) -> None:
    return None


def ours_sessions(args: Result) -> Result:
    """N sessions of three durable-step calls: one after another with `Orchestrator.session`
    (`"tasks": 0`, the default), or from `tasks` asyncio tasks of one event loop with
    `AsyncOrchestrator.session` (async steps), each task entering one session after another
    until N have run. Latency is one session, from entering its block to leaving it. A
    session that does not complete raises as its block exits (`SessionParked`...), so every
    session counted completed."""
    tasks = int(args.get("tasks", 0))
    if tasks > 0:
        return _async_sessions(args, tasks)
    n = int(args["n"])
    latencies: list[float] = []
    with Orchestrator(args["url"], auto_migrate=False) as orch:
        orch.store  # connect before the clock starts  # noqa: B018
        started, cpu0 = time.perf_counter(), time.process_time()
        for i in range(n):
            run_id = f"sess-{i}"
            t0 = time.perf_counter()
            with orch.session(run_id) as run:
                _d1(run_id)
                _d2(run_id)
                _d3(run_id)
            latencies.append(time.perf_counter() - t0)
            if run.executed != 3:
                raise RuntimeError(f"session {run.id} ran {run.executed} calls, not 3")
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu0
    return {"elapsed": elapsed, "completed": n, "cpu_s": cpu, **percentiles(latencies)}


def _async_sessions(args: Result, tasks: int) -> Result:
    from saga import AsyncOrchestrator

    n = int(args["n"])

    async def main() -> Result:
        latencies: list[float] = []
        numbers = iter(range(n))
        async with AsyncOrchestrator(args["url"], auto_migrate=False) as orch:
            await _connect_async(orch)

            async def sessions() -> None:
                for i in numbers:  # shared: each number is taken by one task
                    run_id = f"asess-{i}"
                    t0 = time.perf_counter()
                    async with orch.session(run_id) as run:
                        await _ad1(run_id)
                        await _ad2(run_id)
                        await _ad3(run_id)
                    latencies.append(time.perf_counter() - t0)
                    if run.executed != 3:
                        raise RuntimeError(f"session {run.id} ran {run.executed} calls, not 3")

            started, cpu0 = time.perf_counter(), time.process_time()
            await asyncio.gather(*(sessions() for _ in range(tasks)))
            elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu0
        return {
            "elapsed": elapsed,
            "completed": len(latencies),
            "cpu_s": cpu,
            **percentiles(latencies),
        }

    result = asyncio.run(main())
    result["vm_hwm_mb"] = vm_hwm_mb()
    return result


def psycopg_floor(args: Result) -> Result:
    """What n + 1 commits cost from Python at best: per 'saga', 4 single-statement autocommit
    transactions (an INSERT, then three UPDATEs of that row) over one psycopg connection."""
    n = int(args["n"])
    latencies: list[float] = []
    with psycopg.connect(args["url"], autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS floor (id bigint PRIMARY KEY, step integer)")
        started = time.perf_counter()
        for i in range(n):
            t0 = time.perf_counter()
            conn.execute("INSERT INTO floor (id, step) VALUES (%s, 0)", (i,))
            for step in (1, 2, 3):
                conn.execute("UPDATE floor SET step = %s WHERE id = %s", (step, i))
            latencies.append(time.perf_counter() - t0)
        elapsed = time.perf_counter() - started
    return {"elapsed": elapsed, "completed": n, **percentiles(latencies)}


async def _connect_async(orch: Any) -> None:
    """Connect an AsyncOrchestrator's pool before the clock starts: `await orch.store()`,
    what `orch.store` does for the sync one."""
    await orch.store()


def ours_async_sequential(args: Result) -> Result:
    """N sagas one after another on one event loop, each with `await orch.execute()` of an
    AsyncOrchestrator; the saga of `ours_sequential` with async steps."""
    from saga import AsyncOrchestrator

    saga = bench_saga(args.get("steps", "async"))
    n = int(args["n"])

    async def main() -> Result:
        latencies: list[float] = []
        async with AsyncOrchestrator(args["url"], sagas=[saga], auto_migrate=False) as orch:
            await _connect_async(orch)
            started, cpu0 = time.perf_counter(), time.process_time()
            for i in range(n):
                t0 = time.perf_counter()
                state = await orch.execute(saga, Item(id=f"aseq-{i}"))
                latencies.append(time.perf_counter() - t0)
                if state.status != "completed":
                    raise RuntimeError(f"saga {state.id} ended {state.status}")
            elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu0
        return {"elapsed": elapsed, "completed": n, "cpu_s": cpu, **percentiles(latencies)}

    result = asyncio.run(main())
    result["vm_hwm_mb"] = vm_hwm_mb()
    return result


def _profiler(args: Result) -> Any:
    if not args.get("profile"):
        return None
    from pyinstrument import Profiler

    profiler = Profiler(interval=0.0005)
    profiler.start()
    return profiler


def _write_profile(profiler: Any, path: Path) -> None:
    """The call tree (text and HTML), and a table of the functions with the most self time."""
    session = profiler.stop()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        profiler.output_text(unicode=False, color=False, show_all=False, short_mode=False)
    )
    path.with_suffix(".html").write_text(profiler.output_html())
    own: dict[str, float] = {}
    stack = [session.root_frame()]
    while stack:
        frame = stack.pop()
        stack.extend(frame.children)
        if frame.is_synthetic:
            continue  # "[self]" and the like: counted as their parent's own time
        inner = sum(c.time for c in frame.children if not c.is_synthetic)
        where = f"{frame.function}  {frame.file_path_short}:{frame.line_no}"
        own[where] = own.get(where, 0.0) + frame.time - inner
    total = session.duration
    lines = [f"self time of {total:.3f} s wall (CPU {session.cpu_time:.3f} s), top 30:"]
    for where, seconds in sorted(own.items(), key=lambda kv: -kv[1])[:30]:
        lines.append(f"{seconds / total:6.1%}  {seconds:7.3f} s  {where}")
    path.with_name(path.stem + "_self.txt").write_text("\n".join(lines) + "\n")


def worker(args: Result) -> Result:
    """A worker process: connect, say READY, wait for GO, run until no saga is open."""
    if args.get("steps", "sync") != "sync":
        saga = bench_saga(args["steps"], float(args.get("step_seconds", 0.0)))
    else:
        saga = saga_named(args.get("saga", "bench"), float(args.get("step_seconds", 0.0)))
    kwargs: dict[str, Any] = {}
    if args.get("lease_seconds"):
        kwargs["lease_seconds"] = float(args["lease_seconds"])
    with Orchestrator(
        args["url"], sagas=[saga], auto_migrate=False, owner=args.get("owner"), **kwargs
    ) as orch:
        orch.store  # noqa: B018
        print("READY", flush=True)
        if sys.stdin.readline().strip() != "GO":
            return {"aborted": True}
        started, cpu0 = time.perf_counter(), time.process_time()
        orch.worker(concurrency=int(args["concurrency"])).run(until_idle=True)
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu0
    return {"elapsed": elapsed, "cpu_s": cpu, "vm_hwm_mb": vm_hwm_mb()}


def async_worker(args: Result) -> Result:
    """An AsyncWorker process: connect, say READY, wait for GO, run until no saga is open.

    Besides its peak RSS it reports the most sagas its worker held at once (`in_flight`
    sampled on the loop every 10 ms, when the worker has that property)."""
    from saga import AsyncOrchestrator

    saga = bench_saga(args.get("steps", "async"), float(args.get("step_seconds", 0.0)))
    kwargs: dict[str, Any] = {}
    if args.get("lease_seconds"):
        kwargs["lease_seconds"] = float(args["lease_seconds"])

    async def main() -> Result:
        async with AsyncOrchestrator(
            args["url"], sagas=[saga], auto_migrate=False, owner=args.get("owner"), **kwargs
        ) as orch:
            await _connect_async(orch)
            print("READY", flush=True)
            line = await asyncio.to_thread(sys.stdin.readline)
            if line.strip() != "GO":
                return {"aborted": True}
            w = orch.worker(concurrency=int(args["concurrency"]))
            peak: dict[str, int | None] = {"in_flight": None}

            async def sample() -> None:
                while True:
                    now = getattr(w, "in_flight", None)
                    if isinstance(now, int):
                        peak["in_flight"] = max(peak["in_flight"] or 0, now)
                    await asyncio.sleep(0.01)

            sampler = asyncio.create_task(sample())
            started, cpu0 = time.perf_counter(), time.process_time()
            try:
                await w.run(until_idle=True)
            finally:
                elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu0
                sampler.cancel()
        return {"elapsed": elapsed, "cpu_s": cpu, "max_in_flight": peak["in_flight"]}

    result = asyncio.run(main())
    result["vm_hwm_mb"] = vm_hwm_mb()
    return result


def spawn_worker(args: Result, scenario: str = "worker") -> subprocess.Popen[str]:
    """Start a worker process (`worker` or `async_worker`) and wait until it is connected
    (READY)."""
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "workloads.py"), scenario, json.dumps(args)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if line != "READY":
        proc.kill()
        raise RuntimeError(f"worker did not start (said {line!r})")
    return proc


def go(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.write("GO\n")
    proc.stdin.flush()


def collect(proc: subprocess.Popen[str]) -> Result:
    """Wait for a worker process and read its RESULT line."""
    assert proc.stdout is not None
    out = proc.stdout.read()
    if proc.wait() != 0:
        raise RuntimeError(f"worker exited with {proc.returncode}")
    for line in out.splitlines():
        if line.startswith("RESULT "):
            parsed: Result = json.loads(line[len("RESULT ") :])
            return parsed
    raise RuntimeError("worker printed no result")


def start_many(orch: Orchestrator, saga: Saga[Item], ids: Sequence[str], threads: int) -> None:
    """start() each id, from `threads` threads."""
    chunks = [ids[i::threads] for i in range(threads)]

    def start_chunk(chunk: Sequence[str]) -> None:
        for sid in chunk:
            orch.start(saga, Item(id=sid))

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(start_chunk, chunks))


def most_at_once(spans: Sequence[tuple[float, float]]) -> int:
    """The most intervals (start, end) open at one instant."""
    edges = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    most = now = 0
    for _, step in edges:  # at a tie an end (-1) sorts before a start
        now += step
        most = max(most, now)
    return most


async def start_from_tasks(orch: Any, saga: Saga[Item], ids: Sequence[str], tasks: int) -> None:
    """`await orch.start()` each id, from `tasks` tasks of the running loop at once (an
    AsyncOrchestrator's starts made at the same time share a statement and a commit)."""

    async def start_chunk(chunk: Sequence[str]) -> None:
        for sid in chunk:
            await orch.start(saga, Item(id=sid))

    await asyncio.gather(*(start_chunk(ids[i::tasks]) for i in range(tasks)))


def start_many_async(
    url: str, saga: Saga[Item], ids: Sequence[str], tasks: int
) -> tuple[float, float]:
    """start() each id from `tasks` tasks of one event loop, through an AsyncOrchestrator
    (`start_from_tasks`); the start phase's wall time and this process's CPU time over
    it, its pool connected before both clocks start."""
    from saga import AsyncOrchestrator

    async def main() -> tuple[float, float]:
        async with AsyncOrchestrator(url, sagas=[saga], auto_migrate=False, pool_size=8) as orch:
            await _connect_async(orch)
            t0, cpu0 = time.perf_counter(), time.process_time()
            await start_from_tasks(orch, saga, ids, tasks)
            return time.perf_counter() - t0, time.process_time() - cpu0

    return asyncio.run(main())


def ours_workers(args: Result) -> Result:
    """N sagas started first, then driven by `procs` worker processes of `concurrency`
    each; timed by the database clock from the first start to the last completion. The
    client CPU of the starts (`start_cpu_s`: this process's over the start phase) and of
    the workers (`worker_cpu_s`: each process's while it ran) are reported apart.
    `worker` picks the worker processes' scenario (`worker`, the default, or
    `async_worker`), `steps` the saga's steps (`sync`, the default, or `async`). `starter`
    picks who starts the sagas: `sync` (the default), a sync Orchestrator from 8 threads;
    `async`, an AsyncOrchestrator from `start_tasks` tasks (64 by default) of one event
    loop. With `step_seconds` (async steps only) the first step sleeps that long."""
    steps = args.get("steps", "sync")
    step_seconds = float(args.get("step_seconds", 0.0))
    saga = bench_saga(steps, step_seconds)
    n, procs, conc = int(args["n"]), int(args["procs"]), int(args["concurrency"])
    url = args["url"]
    scenario = args.get("worker", "worker")
    starter = args.get("starter", "sync")
    common = {"url": url, "concurrency": conc, "steps": steps, "step_seconds": step_seconds}
    workers = [spawn_worker(common, scenario) for _ in range(procs)]
    ids = [f"w-{i}" for i in range(n)]
    # The starts' own client CPU: this process's (every thread's) over the start phase,
    # when it does nothing else (the workers wait for GO in processes of their own, and
    # their CPU is counted apart).
    if starter == "async":
        start_phase, start_cpu = start_many_async(url, saga, ids, int(args.get("start_tasks", 64)))
    elif starter == "sync":
        with Orchestrator(url, sagas=[saga], auto_migrate=False, pool_size=8) as orch:
            orch.store  # connect before the clocks start  # noqa: B018
            t0, cpu0 = time.perf_counter(), time.process_time()
            start_many(orch, saga, ids, threads=8)
            start_phase, start_cpu = time.perf_counter() - t0, time.process_time() - cpu0
    else:
        raise ValueError(f"starter must be 'sync' or 'async', got {starter!r}")
    starter_rss = peak_rss_mb()
    for proc in workers:
        go(proc)
    results = [collect(proc) for proc in workers]
    with psycopg.connect(url) as conn:
        row = conn.execute(
            """SELECT count(*) FILTER (WHERE status = 'completed'),
                      extract(epoch FROM max(updated_at) - min(created_at))
               FROM saga.sagas"""
        ).fetchone()
        assert row is not None
        completed, db_elapsed = int(row[0]), float(row[1])
        # Per saga: from its first claim by a worker to its completion (database clock).
        lat_rows = conn.execute(
            """SELECT extract(epoch FROM max(at) FILTER (WHERE event = 'saga_completed')
                                  - min(at) FILTER (WHERE event = 'lease_acquired')),
                      extract(epoch FROM min(at) FILTER (WHERE event = 'lease_acquired')),
                      extract(epoch FROM max(at) FILTER (WHERE event = 'saga_completed'))
               FROM saga.events GROUP BY saga_id"""
        ).fetchall()
        # The last completion's own commit is later than its updated_at (transaction start):
        # take the last event's clock_timestamp() instead.
        last = conn.execute(
            "SELECT extract(epoch FROM (SELECT max(at) FROM saga.events)"
            " - (SELECT min(created_at) FROM saga.sagas))"
        ).fetchone()
        assert last is not None
        db_elapsed = max(db_elapsed, float(last[0]))
    latencies = [float(r[0]) for r in lat_rows if r[0] is not None]
    spans = [(float(r[1]), float(r[2])) for r in lat_rows if r[0] is not None]
    return {
        "elapsed": db_elapsed,
        "completed": completed,
        "start_phase": start_phase,
        # CPU time of this process while it started the sagas (process_time: every thread).
        "start_cpu_s": start_cpu,
        "rss_mb": max([starter_rss] + [float(r["rss_mb"]) for r in results]),
        "worker_rss_mb": [float(r["rss_mb"]) for r in results],
        "worker_vm_hwm_mb": [r.get("vm_hwm_mb") for r in results],
        "worker_max_in_flight": [r.get("max_in_flight") for r in results],
        # CPU time of the worker processes while they ran (process_time: every thread).
        "worker_cpu_s": [r.get("cpu_s") for r in results],
        # From the database: the most sagas between their first claim and their completion
        # at one instant, over all workers.
        "db_max_in_flight": most_at_once(spans),
        **percentiles(latencies),
    }


# ----- DBOS Transact ----------------------------------------------------------------------


def dbos_run(args: Result) -> Result:
    """The same workload as a DBOS workflow of three steps, sequential or from N threads."""
    from dbos import DBOS, DBOSConfig

    n, threads = int(args["n"]), int(args["threads"])
    config: DBOSConfig = {
        "name": "bench",
        "system_database_url": args["url"],
        "log_level": "ERROR",
    }
    DBOS(config=config)

    @DBOS.step()
    def s1() -> None:
        return None

    @DBOS.step()
    def s2() -> None:
        return None

    @DBOS.step()
    def s3() -> None:
        return None

    @DBOS.workflow()
    def wf(i: int) -> int:
        s1()
        s2()
        s3()
        return i

    DBOS.launch()
    quiet_logs()
    latencies: list[float] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        t0 = time.perf_counter()
        wf(i)
        took = time.perf_counter() - t0
        with lock:
            latencies.append(took)

    started, cpu0 = time.perf_counter(), time.process_time()
    if threads <= 1:
        for i in range(n):
            one(i)
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, range(n)))
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu0
    rss = peak_rss_mb()
    DBOS.destroy()
    with psycopg.connect(args["url"]) as conn:
        row = conn.execute(
            "SELECT count(*) FROM dbos.workflow_status WHERE status = 'SUCCESS'"
        ).fetchone()
    completed = int(row[0]) if row else 0
    return {
        "elapsed": elapsed,
        "completed": completed,
        "cpu_s": cpu,
        "rss_mb": rss,
        **percentiles(latencies),
    }


def dbos_setup(args: Result) -> Result:
    """Launch DBOS once on its database so its migrations are not in the measured run."""
    from dbos import DBOS

    DBOS(config={"name": "bench", "system_database_url": args["url"], "log_level": "ERROR"})
    DBOS.launch()
    DBOS.destroy()
    return {}


# ----- recovery -----------------------------------------------------------------------------


def recovery(args: Result) -> Result:
    """SIGKILL a worker holding `count` in-flight sagas; time until a second worker, already
    running, has reclaimed them all and completed them all."""
    url, count = args["url"], int(args["count"])
    lease = args.get("lease_seconds")
    step_seconds = float(args["step_seconds"])
    saga = slow_saga(step_seconds)
    with Orchestrator(url, sagas=[saga], auto_migrate=False) as orch:
        for i in range(count):
            orch.start(saga, Item(id=f"r-{i}"))
    common = {
        "url": url,
        "saga": "slow",
        "step_seconds": step_seconds,
        "concurrency": count,
        "lease_seconds": lease,
    }
    first = spawn_worker({**common, "owner": "first"})
    go(first)

    def counts(conn: psycopg.Connection[Any]) -> tuple[int, int, int]:
        row = conn.execute(
            """SELECT count(*) FILTER (WHERE lease_owner = 'first' AND status = 'running'),
                      count(*) FILTER (WHERE fence >= 2),
                      count(*) FILTER (WHERE status = 'completed')
               FROM saga.sagas WHERE name = 'slow'"""
        ).fetchone()
        assert row is not None
        return int(row[0]), int(row[1]), int(row[2])

    with psycopg.connect(url, autocommit=True) as conn:
        deadline = time.monotonic() + 30.0
        while counts(conn)[0] < count:
            if time.monotonic() > deadline:
                first.kill()
                raise RuntimeError("the first worker never held all sagas")
            time.sleep(0.02)
        # Every saga is now inside its first (slow) step on the first worker.
        second = spawn_worker({**common, "owner": "second"})
        go(second)
        time.sleep(0.2)  # the second worker has looked and found nothing claimable
        os.kill(first.pid, signal.SIGKILL)
        killed = time.perf_counter()
        first.wait()
        reclaimed_at = completed_at = None
        deadline = time.monotonic() + 120.0
        while completed_at is None and time.monotonic() < deadline:
            _, reclaimed, completed = counts(conn)
            now = time.perf_counter()
            if reclaimed_at is None and reclaimed >= count:
                reclaimed_at = now
            if completed >= count:
                completed_at = now
            time.sleep(0.02)
    second_result = collect(second)
    if reclaimed_at is None or completed_at is None:
        raise RuntimeError("the sagas were not all completed after the kill")
    return {
        "reclaimed_s": reclaimed_at - killed,
        "completed_s": completed_at - killed,
        "lease_seconds": lease or Orchestrator().lease_seconds,
        "rss_mb": float(second_result["rss_mb"]),
    }


# ----- claim latency --------------------------------------------------------------------------

FILL_SAGAS = """
INSERT INTO saga.sagas (id, name, version, tenant_id, key, input, input_hash, status,
                        direction, fence, run_after, created_at, updated_at)
SELECT gen_random_uuid(), 'bench', 1, '', 'done-' || g, jsonb_build_object('id', 'done-' || g),
       md5(g::text), 'completed', 'forward', 1, t, t, t + interval '5 ms'
FROM generate_series(1, %(rows)s) AS g,
     LATERAL (SELECT now() - interval '30 days' + g * interval '1 second' AS t) AS ts
"""

FILL_SAGAS_FINISHED_AT = FILL_SAGAS.replace(
    "created_at, updated_at)", "created_at, updated_at, finished_at)"
).replace("t + interval '5 ms'", "t + interval '5 ms', t + interval '5 ms'")

FILL_OPERATIONS = """
INSERT INTO saga.operations (saga_id, step, kind, position, idempotency_key, request_hash,
                             status, attempts, max_attempts, result, started_at, finished_at,
                             updated_at)
SELECT s.id, st.step, 'action', st.position, 'bench:v1::' || s.key || ':' || st.step,
       s.input_hash, 'succeeded', 1, 1, 'null'::jsonb, s.created_at, s.updated_at, s.updated_at
FROM saga.sagas AS s
CROSS JOIN (VALUES ('s1', 0), ('s2', 1), ('s3', 2)) AS st(step, position)
WHERE s.key LIKE 'done-%%'
"""


def fill_finished(url: str, rows: int) -> Result:
    """Insert `rows` completed sagas of the benchmark kind, three succeeded operations each."""
    t0 = time.perf_counter()
    with psycopg.connect(url, autocommit=True) as conn:
        has_finished_at = conn.execute(
            "SELECT 1 FROM information_schema.columns WHERE table_schema = 'saga' "
            "AND table_name = 'sagas' AND column_name = 'finished_at'"
        ).fetchone()
        # From schema 3 on, a finished saga records when it ended (retention counts from
        # it, and an index covers it).
        conn.execute(FILL_SAGAS_FINISHED_AT if has_finished_at else FILL_SAGAS, {"rows": rows})
        conn.execute(FILL_OPERATIONS)
        row = conn.execute(
            "SELECT (SELECT count(*) FROM saga.sagas), (SELECT count(*) FROM saga.operations)"
        ).fetchone()
    assert row is not None
    return {
        "fill_seconds": time.perf_counter() - t0,
        "sagas_rows": int(row[0]),
        "operations_rows": int(row[1]),
    }


def claim_latency(args: Result) -> Result:
    """Time of one claim transaction as a worker runs it (claim_next_saga and the reads of
    the claimed saga's operations, pipelined, committed) on a database holding no finished
    saga and on one holding `fill` of them, each with `samples` runnable sagas waiting.
    The two are claimed from in turn, so that outside load hits them alike."""
    samples, fill = int(args["samples"]), int(args["fill"])
    saga = noop_saga()
    kinds = ["bench:1"]
    out: Result = fill_finished(args["url_full"], fill)
    orchs = {
        "empty": Orchestrator(args["url_empty"], sagas=[saga], auto_migrate=False),
        "full": Orchestrator(args["url_full"], sagas=[saga], auto_migrate=False),
    }
    took: dict[str, list[float]] = {"empty": [], "full": []}
    try:
        for tag, orch in orchs.items():
            start_many(orch, saga, [f"{tag}-{i}" for i in range(samples)], threads=1)
            with orch.store.transaction() as conn:
                conn.execute("ANALYZE saga.sagas")
                conn.execute("ANALYZE saga.operations")

        def claim(tag: str) -> None:
            orch = orchs[tag]
            store = orch.store
            t0 = time.perf_counter()
            with store.pipelined() as conn:
                claimed = store.claim_next_txn(
                    conn, kinds=kinds, owner="bench", lease_seconds=orch.lease_seconds
                )
            took[tag].append(time.perf_counter() - t0)
            assert claimed is not None
            row = claimed[0]
            with store.transaction() as conn:  # out of the runnable set, untimed
                conn.execute(
                    "UPDATE saga.sagas SET status = 'completed', lease_owner = NULL, "
                    "lease_expires_at = NULL WHERE id = %s",
                    (row.id,),
                )

        for i in range(samples):
            for tag in ("empty", "full") if i % 2 == 0 else ("full", "empty"):
                claim(tag)
        try:
            from saga._db._store_base import QUERIES

            with orchs["full"].store.transaction() as conn:
                plan = conn.execute(
                    "EXPLAIN " + QUERIES["claim_next_saga"],
                    {"kinds": kinds, "owner": "x", "lease_seconds": 10.0},
                ).fetchall()
            out["plan"] = [str(next(iter(r.values()))) for r in plan]
        except Exception as exc:  # the query's name or parameters changed: no plan, no harm
            out["plan"] = [f"unavailable: {exc}"]
    finally:
        for orch in orchs.values():
            orch.close()
    out["before_ms"] = statistics.median(took["empty"]) * 1000.0
    out["after_ms"] = statistics.median(took["full"]) * 1000.0
    out["before_p99_ms"] = percentiles(took["empty"])["p99_ms"]
    out["after_p99_ms"] = percentiles(took["full"])["p99_ms"]
    return out


SCENARIOS: dict[str, Callable[[Result], Result]] = {
    "ours_sequential": ours_sequential,
    "ours_async_sequential": ours_async_sequential,
    "psycopg_floor": psycopg_floor,
    "ours_workers": ours_workers,
    "ours_sessions": ours_sessions,
    "worker": worker,
    "async_worker": async_worker,
    "dbos": dbos_run,
    "dbos_setup": dbos_setup,
    "recovery": recovery,
    "claim_latency": claim_latency,
}


def main() -> None:
    quiet_logs()
    name, raw = sys.argv[1], sys.argv[2]
    emit(SCENARIOS[name](json.loads(raw)))


if __name__ == "__main__":
    main()
