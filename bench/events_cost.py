"""What the audit events cost as rows: a 3-step saga on the production path, with its
events written as they are, not written at all, or written one row per transition.

    SAGA_DATABASE_URL=postgresql://postgres@127.0.0.1:5432/postgres \\
        python bench/events_cost.py [--sagas 1000] [--warmup 300] [--pairs 4] \\
        [--variants rows,none,sets]

Run it with the benchmark's environment (bench/.venv/bin/python, `make bench` makes it) or
any with the project installed. The server must run on this machine (its backends' CPU is
read from /proc) and the URL's role must be able to create databases and replication slots
(a superuser); reading the WAL back also needs read access to the server's data
directory. Each variant gets a template database, migrated and then changed as the
variant says; each run gets a fresh copy of its variant's template and drops it
afterwards. The variants:

    rows   the database as migrated: every event an INSERT of its own row into
           saga.events (the functions insert each transition's events in one statement).
    none   the upper bound: the write path's functions (saga.write_saga, called by
           saga.start_saga_v3; saga.write_saga_v4; saga.write_sagas_v2;
           saga.claim_batch_v2) redefined from their own text with the INSERT INTO
           saga.events statement removed. Nothing replaces it, so the change costs nothing
           itself; the events are still sent by the client and parsed with the rest of the
           write's JSON argument.
    sets   one row per transition instead of one per event: a table saga.event_sets
           (saga_id, id, at, events jsonb; primary key (saga_id, id), as saga.events) and
           the same functions inserting the transition's events array as the client sent
           it (the claim's two events built as a jsonb array).

A run, in a process of its own: an AsyncOrchestrator starts WARMUP sagas of 3 no-op async
steps from 8 tasks and one AsyncWorker at concurrency 64 drives them until none is open
(the warm-up, not measured); then it starts SAGAS more the same way (measured: the start
phase) and drives them (measured: the drive phase). Measured are the client process's CPU
(time.process_time) and the CPU of the server backends connected to the run's database
(/proc/PID/schedstat, sampled every 0.1 s so that a backend which exits is counted up to
its last sample), the event rows and the growth of their table and index, and the WAL:
pg_current_wal_lsn() before and after (the whole server's, so other databases' writes are
in it), and, when pg_waldump and the server's pg_wal directory can be read, the WAL records
of the run's database by relation, without full-page images and with them (a temporary
physical replication slot of the measuring session keeps the run's WAL until it is read;
it goes with the session). After the run, in the same database, one transition's event
write alone: the variant's statement in a PL/pgSQL loop, its backend's CPU less that of
the empty loop (for `rows` also with three events, for `sets` also with the events in a
compact encoding, positional arrays without keys).

The variants are interleaved, the order rotating from one pair to the next. It prints one
line per run (on stderr) and then a table: per variant, the median and the range over its
runs of each figure per saga (CPU in ms, bytes, µs for the loops), the events per saga by
kind, and each variant's difference from `rows` pair by pair (median and range). With
--json FILE every run's figures are written there too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg import sql
from workloads import async_noop_saga, quiet_logs, start_from_tasks

PREFIX = "evcost_"
START_TASKS = 8
CONCURRENCY = 64
# The functions of the production path that append events, and for `sets` what replaces
# each one's INSERT INTO saga.events statement.
PATH_FUNCTIONS = ("write_saga", "write_saga_v4", "write_sagas_v2", "claim_batch_v2")
SETS_INSERT = {
    "write_saga": "INSERT INTO saga.event_sets (saga_id, events) VALUES (v_id, p->'events');",
    "write_saga_v4": "INSERT INTO saga.event_sets (saga_id, events) VALUES (v_id, p->'events');",
    "write_sagas_v2": (
        "INSERT INTO saga.event_sets (saga_id, events)"
        " SELECT u.id, u.rows FROM unnest(v_ev_ids, v_events) WITH ORDINALITY AS u(id, rows, k)"
        " ORDER BY u.k;"
    ),
    "claim_batch_v2": (
        "INSERT INTO saga.event_sets (saga_id, events)"
        " SELECT m.id, jsonb_build_array("
        "jsonb_build_object('event', 'lease_acquired',"
        " 'detail', jsonb_build_object('owner', p_owner, 'fence', m.fence)),"
        " jsonb_build_object('event', 'attempt_started', 'step', m.step, 'kind', 'action',"
        " 'attempt', m.attempt))"
        " FROM unnest(v_moved, v_steps, v_n, v_fence, v_att) AS m(id, step, n, fence, attempt)"
        " ORDER BY m.n;"
    ),
}
EVENT_SETS_TABLE = """
CREATE TABLE saga.event_sets (
    id      bigserial,
    saga_id uuid NOT NULL,
    at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    events  jsonb NOT NULL,
    PRIMARY KEY (saga_id, id)
)"""
INSERT_EVENTS = re.compile(r"INSERT INTO saga\.events\b[^;]*;", re.IGNORECASE)
VARIANTS = ("rows", "none", "sets")
LOOP_N = 20000


def log(message: str) -> None:
    print(f"[events {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def with_database(url: str, dbname: str) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + dbname, parts.query, parts.fragment))


# ----- the variants ----------------------------------------------------------------------


def prepare(url: str, variant: str) -> str:
    """A template database for the variant: migrated, then changed; returns its name."""
    from saga import Orchestrator

    name = f"{PREFIX}tmpl_{variant}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    turl = with_database(url, name)
    with Orchestrator(turl) as orch:
        orch.store  # connecting applies the migrations  # noqa: B018
    if variant != "rows":
        with psycopg.connect(turl, autocommit=True) as conn:
            if variant == "sets":
                conn.execute(EVENT_SETS_TABLE)
            for fname in PATH_FUNCTIONS:
                rows = conn.execute(
                    """SELECT pg_get_functiondef(p.oid) FROM pg_proc p
                       JOIN pg_namespace n ON n.oid = p.pronamespace
                       WHERE n.nspname = 'saga' AND p.proname = %s""",
                    (fname,),
                ).fetchall()
                assert len(rows) == 1, (fname, len(rows))
                text = str(rows[0][0])
                new = "NULL;" if variant == "none" else SETS_INSERT[fname]
                changed, count = INSERT_EVENTS.subn(new, text)  # no backslash in new
                assert count == 1, (fname, count)
                conn.execute(changed.encode())
    return name


# ----- a run: the client process ---------------------------------------------------------


def child(url: str, sagas: int, warmup: int) -> None:
    """The measured process: warm-up, READY, GO, starts, STARTED, GO, drive, DONE."""
    from saga import AsyncOrchestrator

    quiet_logs()
    saga = async_noop_saga()

    async def start_all(orch: Any, tag: str, n: int) -> None:
        await start_from_tasks(orch, saga, [f"{tag}-{i}" for i in range(n)], START_TASKS)

    async def drive(orch: Any) -> None:
        await orch.worker(concurrency=CONCURRENCY).run(until_idle=True)

    async def wait_go() -> None:
        line = await asyncio.to_thread(sys.stdin.readline)
        if line.strip() != "GO":
            raise SystemExit(1)

    async def main() -> None:
        async with AsyncOrchestrator(url, sagas=[saga], auto_migrate=False) as orch:
            await orch.store()
            await start_all(orch, "warm", warmup)
            await drive(orch)
            print("READY", flush=True)
            await wait_go()
            t0, c0 = time.perf_counter(), time.process_time()
            await start_all(orch, "run", sagas)
            start_s, start_cpu = time.perf_counter() - t0, time.process_time() - c0
            print(f"STARTED {json.dumps({'s': start_s, 'cpu': start_cpu})}", flush=True)
            await wait_go()
            t0, c0 = time.perf_counter(), time.process_time()
            await drive(orch)
            drive_s, drive_cpu = time.perf_counter() - t0, time.process_time() - c0
            print(f"DONE {json.dumps({'s': drive_s, 'cpu': drive_cpu})}", flush=True)

    asyncio.run(main())


# ----- a run: the measuring side ---------------------------------------------------------


class Backends:
    """CPU of the server processes connected to one database, from /proc."""

    def __init__(self, postmaster: int, dbname: str, exclude: int) -> None:
        self._postmaster = str(postmaster)
        self._tag = f" {dbname} "
        self._exclude = str(exclude)
        self._ours: dict[str, bool] = {}
        self._last: dict[str, int] = {}  # pid -> its CPU ns when last read
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _is_ours(self, pid: str) -> bool:
        known = self._ours.get(pid)
        if known is None:
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
                ppid = stat[stat.rindex(")") + 2 :].split()[1]
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except (OSError, ValueError, IndexError):
                return False
            known = ppid == self._postmaster and self._tag in cmd and pid != self._exclude
            self._ours[pid] = known
        return known

    def scan(self) -> int:
        """Read every backend of the database; the sum of each one's CPU when last read."""
        with self._lock:
            for entry in os.scandir("/proc"):
                pid = entry.name
                if not pid.isdigit() or not self._is_ours(pid):
                    continue
                try:
                    ns = int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])
                except (OSError, ValueError, IndexError):
                    continue
                self._last[pid] = ns
            return sum(self._last.values())

    def _loop(self) -> None:
        while not self._stop.wait(0.1):
            self.scan()

    def __enter__(self) -> Backends:
        self.scan()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def seen(self) -> int:
        return len(self._last)


def lsn(conn: psycopg.Connection[Any]) -> str:
    row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
    assert row is not None
    return str(row[0])


def sizes(conn: psycopg.Connection[Any], table: str) -> dict[str, int]:
    row = conn.execute(
        """SELECT pg_relation_size(c.oid), pg_indexes_size(c.oid),
                  COALESCE(pg_total_relation_size(NULLIF(c.reltoastrelid, 0)), 0),
                  pg_database_size(current_database())
           FROM pg_class c WHERE c.oid = %s::regclass""",
        (table,),
    ).fetchone()
    assert row is not None
    return {"heap": int(row[0]), "index": int(row[1]), "toast": int(row[2]), "db": int(row[3])}


def waldump(
    conn: psycopg.Connection[Any], start: str, end: str, table: str
) -> dict[str, int] | None:
    """WAL bytes of the run's database between two LSNs (records that name a relation),
    and of the events table and its index, from pg_waldump; None when it cannot run."""
    bindir = conn.execute("SELECT setting FROM pg_config WHERE name = 'BINDIR'").fetchone()
    datadir = conn.execute("SHOW data_directory").fetchone()
    if bindir is None or datadir is None:
        return None
    exe = Path(str(bindir[0])) / "pg_waldump"
    if not exe.exists():
        found = shutil.which("pg_waldump")
        if found is None:
            return None
        exe = Path(found)
    row = conn.execute(
        """SELECT (SELECT oid FROM pg_database WHERE datname = current_database()),
                  pg_relation_filenode(%s::regclass),
                  (SELECT array_agg(pg_relation_filenode(indexrelid)) FROM pg_index
                   WHERE indrelid = %s::regclass)""",
        (table, table),
    ).fetchone()
    assert row is not None
    dboid, heap, indexes = str(row[0]), str(row[1]), {str(i) for i in row[2]}
    try:
        done = subprocess.run(
            [str(exe), "-p", str(Path(str(datadir[0])) / "pg_wal"), "-s", start, "-e", end],
            capture_output=True,
            text=True,
            check=False,
        )
    except OSError:
        return None
    out = done.stdout
    if not out:
        log(f"pg_waldump printed nothing: {done.stderr.strip()[-300:]}")
        return None
    found_rel = re.compile(r"rel \d+/(\d+)/(\d+)")
    found_len = re.compile(r"len \(rec/tot\):\s*(\d+)/\s*(\d+)")
    totals = dict.fromkeys(("db_rec", "db_tot", "ev_rec", "ev_tot", "ev_records"), 0)
    for line in out.splitlines():
        rel, length = found_rel.search(line), found_len.search(line)
        if rel is None or length is None or rel.group(1) != dboid:
            continue
        rec, tot = int(length.group(1)), int(length.group(2))
        totals["db_rec"] += rec
        totals["db_tot"] += tot
        if rel.group(2) == heap or rel.group(2) in indexes:
            totals["ev_rec"] += rec
            totals["ev_tot"] += tot
            totals["ev_records"] += 1
    return totals


# One transition's events as the drive's middle transitions write them (a step's attempt
# succeeded, the next one's started), as the client sends them.
LOOP_EVENTS = json.dumps(
    [
        {"kind": "action", "step": "s1", "event": "attempt_succeeded", "attempt": 1},
        {"kind": "action", "step": "s2", "event": "attempt_started", "attempt": 1},
    ]
)
# The same two events in a compact encoding: positional arrays, no keys.
LOOP_COMPACT = json.dumps(
    [["attempt_succeeded", "s1", "action", 1], ["attempt_started", "s2", "action", 1]]
)
# A third event, for the cost of one more row in the same statement.
LOOP_THREE = json.dumps([*json.loads(LOOP_EVENTS), {"event": "saga_completed"}])
LOOP_BODY = {
    "rows": (
        "INSERT INTO saga.events (saga_id, event, step, kind, attempt, detail)"
        " SELECT v_id, x.event, x.step, x.kind, x.attempt, COALESCE(x.detail, '{}'::jsonb)"
        " FROM jsonb_populate_recordset(NULL::saga.events, v_ev) WITH ORDINALITY AS x"
        " ORDER BY x.ordinality;"
    ),
    "none": "NULL;",
    "sets": "INSERT INTO saga.event_sets (saga_id, events) VALUES (v_id, v_ev);",
}


def loop_cost(conn: psycopg.Connection[Any], variant: str, n: int) -> dict[str, float]:
    """The backend CPU, in µs, of one transition's event write alone: the variant's
    statement run n times in a PL/pgSQL loop in one transaction (rolled back), less the
    same loop with nothing in it (`loop_us`); for `rows` also with three events instead of
    two (`loop_three_us`), for `sets` also with the compact encoding (`loop_compact_us`)."""

    def timed(body: str, events: str = LOOP_EVENTS) -> int:
        block = sql.SQL(
            "DO $loop$ DECLARE v_id uuid; v_ev jsonb := {}::jsonb; BEGIN"
            " FOR i IN 1..{} LOOP v_id := gen_random_uuid(); {} END LOOP; END $loop$"
        ).format(sql.Literal(events), sql.Literal(n), sql.SQL(body))
        pid = conn.info.backend_pid
        with conn.transaction(force_rollback=True):
            before = int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])
            conn.execute(block)
            return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0]) - before

    empty = timed("NULL;")
    figures = {"loop_us": (timed(LOOP_BODY[variant]) - empty) / n / 1000.0}
    if variant == "rows":
        figures["loop_three_us"] = (timed(LOOP_BODY[variant], LOOP_THREE) - empty) / n / 1000.0
    if variant == "sets":
        figures["loop_compact_us"] = (timed(LOOP_BODY[variant], LOOP_COMPACT) - empty) / n / 1000.0
    return figures


def read_line(proc: subprocess.Popen[str], word: str) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if not line.startswith(word):
        proc.kill()
        raise RuntimeError(f"the run said {line!r}, not {word}")
    return line[len(word) :].strip()


def say_go(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.write("GO\n")
    proc.stdin.flush()


def one_run(
    url: str, variant: str, template: str, n: int, sagas: int, warmup: int
) -> dict[str, Any]:
    name = f"{PREFIX}{variant}_{n}"
    table = "saga.event_sets" if variant == "sets" else "saga.events"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )
        conn.execute(
            sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(template)
            )
        )
    rurl = with_database(url, name)
    try:
        with psycopg.connect(rurl, autocommit=True) as conn:
            row = conn.execute("SELECT pg_backend_pid()").fetchone()
            assert row is not None
            own = int(row[0])
            # WAL from here on is kept for pg_waldump until this session ends (dropped DATABASEs
            # force checkpoints, which would otherwise remove the segments of the run).
            try:
                conn.execute(
                    "SELECT pg_create_physical_replication_slot(%s, true, true)", (name + "_wal",)
                )
            except psycopg.Error as exc:
                log(f"no replication slot ({exc}): the run's WAL may be gone before it is read")
            postmaster = int(Path(f"/proc/{own}/stat").read_text().split(") ")[1].split()[1])
            proc = subprocess.Popen(
                [sys.executable, __file__, "--child", rurl, str(sagas), str(warmup)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            with Backends(postmaster, name, own) as backends:
                read_line(proc, "READY")
                size0, lsn0, cpu0 = sizes(conn, table), lsn(conn), backends.scan()
                say_go(proc)
                started = json.loads(read_line(proc, "STARTED"))
                lsn1, cpu1 = lsn(conn), backends.scan()
                say_go(proc)
                done = json.loads(read_line(proc, "DONE"))
                size2, lsn2, cpu2 = sizes(conn, table), lsn(conn), backends.scan()
                seen = backends.seen
            if proc.wait() != 0:
                raise RuntimeError(f"the run exited with {proc.returncode}")
            counts = conn.execute(
                "SELECT status, count(*) FROM saga.sagas GROUP BY status"
            ).fetchall()
            if variant == "sets":
                kinds = conn.execute(
                    """SELECT e->>'event', count(*) FROM saga.event_sets,
                              jsonb_array_elements(events) AS e GROUP BY 1 ORDER BY 1"""
                ).fetchall()
            else:
                kinds = conn.execute(
                    "SELECT event, count(*) FROM saga.events GROUP BY 1 ORDER BY 1"
                ).fetchall()
            ev_rows = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.SQL(table)))
            ev_row = ev_rows.fetchone()
            assert ev_row is not None
            wal = waldump(conn, lsn0, lsn2, table)
            tuple_row = conn.execute(
                sql.SQL("SELECT COALESCE(sum(pg_column_size(t.*) + 4), 0) FROM {} AS t").format(
                    sql.SQL(table)
                )
            ).fetchone()
            assert tuple_row is not None
            total_size = sizes(conn, table)
            loops = loop_cost(conn, variant, LOOP_N)
            lsn_bytes = conn.execute(
                "SELECT pg_wal_lsn_diff(%s, %s), pg_wal_lsn_diff(%s, %s)",
                (lsn1, lsn0, lsn2, lsn1),
            ).fetchone()
            assert lsn_bytes is not None
    finally:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )
    total = sagas + warmup
    status = {str(s): int(c) for s, c in counts}
    if status.get("completed") != total:
        raise RuntimeError(f"sagas not all completed: {status}")
    result: dict[str, Any] = {
        "variant": variant,
        "backends": seen,
        "rate": sagas / (started["s"] + done["s"]),
        "client_start_ms": started["cpu"] * 1000 / sagas,
        "client_drive_ms": done["cpu"] * 1000 / sagas,
        "server_start_ms": (cpu1 - cpu0) / 1e6 / sagas,
        "server_drive_ms": (cpu2 - cpu1) / 1e6 / sagas,
        "event_rows": int(ev_row[0]) / total,
        "events": {str(k): int(c) / total for k, c in kinds},
        "heap_b": (size2["heap"] - size0["heap"]) / sagas,
        "index_b": (size2["index"] - size0["index"]) / sagas,
        "toast_b": (size2["toast"] - size0["toast"]) / sagas,
        "db_b": (size2["db"] - size0["db"]) / sagas,
        "lsn_b": (float(lsn_bytes[0]) + float(lsn_bytes[1])) / sagas,
        "tuple_b": int(tuple_row[0]) / total,
        "table_b": (total_size["heap"] + total_size["toast"]) / total,
        "all_index_b": total_size["index"] / total,
        **loops,
    }
    result["server_ms"] = result["server_start_ms"] + result["server_drive_ms"]
    result["client_ms"] = result["client_start_ms"] + result["client_drive_ms"]
    result["total_ms"] = result["server_ms"] + result["client_ms"]
    if wal is not None:
        result.update({f"wal_{k}": v / sagas for k, v in wal.items()})
    return result


FIGURES = (
    ("total_ms", "CPU ms/saga, client + server", 3),
    ("server_ms", "server CPU ms/saga", 3),
    ("server_start_ms", "  of it the starts", 3),
    ("server_drive_ms", "  of it the drive", 3),
    ("client_ms", "client CPU ms/saga", 3),
    ("rate", "sagas/s (start + drive)", 0),
    ("event_rows", "event rows/saga", 2),
    ("tuple_b", "events tuple bytes/saga (+4 a line pointer)", 0),
    ("table_b", "events table bytes/saga, all sagas", 0),
    ("all_index_b", "events index bytes/saga, all sagas", 0),
    ("heap_b", "events table growth/saga, measured sagas", 0),
    ("index_b", "events index growth/saga, measured sagas", 0),
    ("loop_us", "one transition's event write alone, µs", 1),
    ("loop_three_us", "  the same with three events, µs", 1),
    ("loop_compact_us", "  the same, compact encoding, µs", 1),
    ("wal_ev_rec", "events WAL bytes/saga, no FPI", 0),
    ("wal_ev_tot", "events WAL bytes/saga, with FPI", 0),
    ("wal_ev_records", "events WAL records/saga", 2),
    ("wal_db_rec", "database WAL bytes/saga, no FPI", 0),
    ("wal_db_tot", "database WAL bytes/saga, with FPI", 0),
    ("lsn_b", "server WAL bytes/saga (all dbs)", 0),
)


def summary(runs: list[dict[str, Any]], variants: list[str]) -> None:
    print()
    print("| figure | " + " | ".join(variants) + " |")
    print("|---|" + "---|" * len(variants))
    medians: dict[str, dict[str, float]] = {}
    for key, label, digits in FIGURES:
        cells = []
        for v in variants:
            values = [float(r[key]) for r in runs if r["variant"] == v and key in r]
            if not values:
                cells.append("-")
                continue
            med = statistics.median(values)
            medians.setdefault(v, {})[key] = med
            cells.append(f"{med:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})")
        print(f"| {label} | " + " | ".join(cells) + " |")
    for v in variants:
        kinds: dict[str, float] = {}
        for r in runs:
            if r["variant"] == v:
                kinds = r["events"]
        print(f"{v} events per saga: " + ", ".join(f"{k} {c:g}" for k, c in kinds.items()))
    if "rows" not in variants:
        return
    for v in variants:
        if v == "rows":
            continue
        parts = []
        for key in ("total_ms", "server_ms", "server_start_ms", "server_drive_ms", "client_ms"):
            deltas = [
                float(r[key]) - float(b[key])
                for r in runs
                for b in runs
                if r["variant"] == v and b["variant"] == "rows" and r["pair"] == b["pair"]
            ]
            if deltas:
                parts.append(
                    f"{key} {statistics.median(deltas):+.3f}"
                    f" ({min(deltas):+.3f} to {max(deltas):+.3f})"
                )
        print(f"{v} - rows, pair by pair, median (range): " + ", ".join(parts))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--sagas", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--json", help="also write every run's figures to this file")
    args = parser.parse_args()
    url = os.environ.get("SAGA_DATABASE_URL")
    if not url:
        raise SystemExit("SAGA_DATABASE_URL must name a PostgreSQL server on this machine")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"unknown variant {v!r}: one of {', '.join(VARIANTS)}")
    quiet_logs()
    templates = {v: prepare(url, v) for v in variants}
    runs: list[dict[str, Any]] = []
    try:
        for pair in range(args.pairs):
            shift = pair % len(variants)
            for v in variants[shift:] + variants[:shift]:
                r = one_run(url, v, templates[v], pair, args.sagas, args.warmup)
                r["pair"] = pair
                r["load"] = os.getloadavg()[0]
                runs.append(r)
                log(
                    f"pair {pair} {v}: total {r['total_ms']:.3f} server {r['server_ms']:.3f}"
                    f" (start {r['server_start_ms']:.3f} drive {r['server_drive_ms']:.3f})"
                    f" client {r['client_ms']:.3f} ms/saga, {r['rate']:.0f} sagas/s,"
                    f" load {r['load']:.1f}"
                )
                if args.json:
                    Path(args.json).write_text(json.dumps(runs, indent=1))
    finally:
        with psycopg.connect(url, autocommit=True) as conn:
            for name in templates.values():
                conn.execute(
                    sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
                )
    summary(runs, variants)


if __name__ == "__main__":
    main()
