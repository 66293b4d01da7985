"""The long run: thousands of sagas under random kills and PostgreSQL restarts (`make soak`).

Starts `SOAK_SAGAS` sagas (default 10000) drawn from `SOAK_SEED` on a private embedded
PostgreSQL, runs `SOAK_WORKERS` worker processes on them, and every few seconds
(`SOAK_KILL_SECONDS` on average) either SIGKILLs a worker or replaces it with one armed
to kill itself at a random fault point; every `SOAK_RESTART_EVERY` kills the sagas'
server is restarted. The starts (made from several threads, so that they are grouped) and
the workers reach that server through `faults.proxy.LostReplyProxy`, which loses the reply
of one write in `SOAK_LOST_REPLY_EVERY` (default 50) after its commit landed (0 turns it
off). The fake provider lives on a second private server that
stays up. When every saga has settled, the invariants are checked and a summary printed;
its last line is
`soak: sagas=N kills=K restarts=R lost_replies=Q duplicates=D lost=L parked=P`. The exit
status is 1 when anything was duplicated, lost or violated an invariant.

`SOAK_ASYNC` picks the kind of worker process: unset or `0`, the sync `Worker` in every
process; `1`, an `AsyncWorker` (an `AsyncOrchestrator` on an event loop) in every
process; `half`, async in every other slot of the fleet (a replacement keeps its slot's
kind), so both drivers share the same sagas under the same faults.

`SOAK_PGBOUNCER=1` puts a PgBouncer in transaction mode (`faults.pgbouncer`) between the
proxy and the sagas' server: the workers then reach PostgreSQL as they do behind a
transaction pooler in production.

A worker process must never end on its own: if one does, the soak fails saying how it
ended (exit status or signal), with its whole log, and keeps every worker's log of the
run in a directory it names (`SOAK_LOG_DIR` keeps them all, in that directory, whatever
the outcome).

Run it as `make soak`, or `PYTHONPATH=tests python -m faults.soak`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import structlog

from faults import app, invariants
from faults.harness import (
    WorkerProcess,
    private_postgres,
    quiesce,
    scalar,
    start_sagas,
    terminate_worker_backends,
)
from faults.pgbouncer import PgBouncer
from faults.proxy import LostReplyProxy
from saga.testing import FAULT_POINTS

# Every write of the protocol: starts (saga.start_saga_v3, and saga.start_sagas_v1 for
# grouped ones), transitions, claims' first moves, operator changes (saga.write_saga_v4,
# and saga.write_sagas_v2 for grouped ones), batch claims that start their sagas' attempts
# (saga.claim_batch_v2), heartbeats (renew_leases) and workers announcing themselves.
LOST_REPLY_WRITES = (
    "saga.start_saga",
    "saga.write_saga",
    "saga.claim_batch_v2",
    "AS h(id, fence)",
    "saga.workers",
)
# The threads the sagas are started from, through the proxy: starts made at once share a
# statement (group commit), so grouped starts lose replies too.
START_THREADS = 8


def _env(name: str, default: str) -> str:
    return os.environ.get(name) or default


def async_slots(mode: str, workers: int) -> list[bool]:
    """Which slots of a fleet of `workers` run an AsyncWorker, by `SOAK_ASYNC`: `0`
    (none), `1` (all) or `half` (every other slot, the second first, so a fleet of one is
    sync and a fleet of two has one of each)."""
    mode = mode.strip().lower()
    if mode in ("", "0", "no", "false"):
        return [False] * workers
    if mode in ("1", "yes", "true", "all"):
        return [True] * workers
    if mode == "half":
        return [slot % 2 == 1 for slot in range(workers)]
    raise SystemExit(f"soak: SOAK_ASYNC must be 0, 1 or half, not {mode!r}")


def exit_reason(code: int) -> str:
    """How a process ended, from its exit status (negative: the signal that ended it)."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exited with {code}"


def worker_exit_report(worker: WorkerProcess, code: int, keep: Path) -> str:
    """What the soak says of a worker process that ended on its own: how it ended, what it
    was, its last line (the error, when it raised one) and its whole log; every worker's
    log of the run is copied to `keep` first, so that nothing of it is lost with the
    run's temporary directory."""
    logs = worker.log_path.parent
    if logs.resolve() != keep.resolve():
        shutil.copytree(logs, keep, dirs_exist_ok=True)
    output = worker.output()
    lines = [line for line in output.splitlines() if line.strip()]
    last = lines[-1].strip() if lines else "(no output)"
    kind = "asyncio" if worker.async_worker else "sync"
    fault = f", armed to die at {worker.fault}" if worker.fault else ""
    return (
        f"soak: worker pid {worker.pid} ({kind}{fault}) {exit_reason(code)} after "
        f"{time.monotonic() - worker.started_at:.1f}s; its last line: {last}\n"
        f"soak: its whole log ({keep / worker.log_path.name}; every worker's log of this "
        f"run is kept in {keep}):\n{output}"
    )


def main() -> int:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    sagas = int(_env("SOAK_SAGAS", "10000"))
    seed = int(_env("SOAK_SEED", "1"))
    n_workers = int(_env("SOAK_WORKERS", "3"))
    kill_seconds = float(_env("SOAK_KILL_SECONDS", "3"))
    restart_every = int(_env("SOAK_RESTART_EVERY", "10"))
    lost_reply_every = int(_env("SOAK_LOST_REPLY_EVERY", "50"))
    timeout = float(_env("SOAK_TIMEOUT_SECONDS", "7200"))
    asyncs = async_slots(_env("SOAK_ASYNC", "0"), n_workers)
    pooled = _env("SOAK_PGBOUNCER", "0") == "1"
    rng = random.Random(seed)
    started_at = time.monotonic()

    with tempfile.TemporaryDirectory(prefix="saga-soak-") as tmp:
        root = Path(tmp)
        os.chmod(root, 0o755)  # the embedded server may run as another system user
        with contextlib.ExitStack() as stack:
            pg = stack.enter_context(private_postgres(root / "sagas"))
            prov = stack.enter_context(private_postgres(root / "provider"))
            upstream = pg.url
            if pooled:
                upstream = stack.enter_context(PgBouncer(pg.url)).url_for(pg.url)
            proxy = stack.enter_context(LostReplyProxy(upstream, seed=seed))
            if lost_reply_every > 0:
                for statement in LOST_REPLY_WRITES:
                    proxy.lose_reply(statement, times=None, probability=1 / lost_reply_every)
            app.create_provider(prov.url)
            os.environ[app.ENV_PROVIDER_URL] = prov.url
            print(
                f"soak: starting {sagas} sagas (seed {seed}); workers: "
                f"{asyncs.count(False)} sync, {asyncs.count(True)} asyncio"
                + (", behind PgBouncer" if pooled else ""),
                flush=True,
            )
            keys = start_sagas(proxy.url, sagas, seed, prefix="soak", threads=START_THREADS)
            # SOAK_LOG_DIR keeps every worker's log; otherwise they are kept when a worker
            # ends on its own (in a directory named in the failure's output).
            kept = os.environ.get("SOAK_LOG_DIR")
            logs = Path(kept) if kept else root / "logs"

            def spawn(slot: int, fault: str | None = None) -> WorkerProcess:
                return WorkerProcess(
                    proxy.url,
                    prov.url,
                    logs,
                    fault=fault,
                    lease_seconds=2.0,
                    until_idle=False,
                    async_worker=asyncs[slot],
                )

            fleet = [spawn(slot) for slot in range(n_workers)]
            kills = armed_kills = terminations = 0
            next_chaos = time.monotonic() + rng.uniform(0.5, 2 * kill_seconds)
            last_report = 0.0
            try:
                while True:
                    now = time.monotonic()
                    if now - started_at > timeout:
                        raise SystemExit(f"soak: not settled within {timeout:.0f}s")
                    for i, worker in enumerate(fleet):
                        code = worker.proc.poll()
                        if code is None:
                            continue
                        if code != -signal.SIGKILL:
                            keep = (
                                logs if kept else Path(tempfile.mkdtemp(prefix="saga-soak-logs-"))
                            )
                            print(worker_exit_report(worker, code, keep), file=sys.stderr)
                            raise SystemExit(
                                f"soak: a worker exited with {code} ({exit_reason(code)}; "
                                f"its whole log is above, every worker's log is kept in {keep})"
                            )
                        if worker.fault:
                            kills += 1
                            armed_kills += 1
                        worker.kill()
                        fleet[i] = spawn(i)
                    if now >= next_chaos:
                        next_chaos = now + rng.uniform(0.5, 2 * kill_seconds)
                        victim = rng.randrange(len(fleet))
                        action = rng.random()
                        if action < 0.6:
                            fleet[victim].kill()
                            kills += 1
                            point = rng.choice(FAULT_POINTS)
                            kind = rng.choice(("action", "compensation"))
                            # Half the replacements die at a fault point of their own.
                            fault = f"{point}:{kind}" if rng.random() < 0.5 else None
                            fleet[victim] = spawn(victim, fault)
                        elif action < 0.8:
                            terminations += 1 if terminate_worker_backends(pg.url) else 0
                        while pg.restarts < kills // restart_every:
                            pg.restart()
                    open_count = int(
                        scalar(
                            pg.url,
                            "SELECT count(*) FROM saga.sagas"
                            " WHERE status IN ('pending', 'running', 'compensating')",
                        )
                    )
                    if now - last_report >= 10:
                        last_report = now
                        print(
                            f"soak: {time.monotonic() - started_at:6.0f}s open={open_count}"
                            f" kills={kills} restarts={pg.restarts} terminations={terminations}"
                            f" lost_replies={len(proxy.lost_replies())}",
                            flush=True,
                        )
                    if open_count == 0:
                        break
                    time.sleep(0.2)
            finally:
                for worker in fleet:
                    worker.signal(signal.SIGTERM)
                for worker in fleet:
                    with contextlib.suppress(AssertionError):
                        worker.wait(timeout=30)
                    worker.kill()
            lost_replies = len(proxy.lost_replies())
            # Of which, statements that carried several sagas' writes (group commit).
            grouped = len(proxy.lost_replies("write_sagas_v2"))
            # ... and batch claims that started their sagas' first attempts.
            claims = len(proxy.lost_replies("claim_batch_v2"))
            # ... and grouped starts.
            starts = len(proxy.lost_replies("start_sagas_v1"))
            quiesce(pg.url, timeout=120)
            elapsed = time.monotonic() - started_at
            print("soak: checking invariants", flush=True)
            summary = invariants.check(pg.url, prov.url, keys)
            app.provider.close()
    parked = sum(summary.parked.values())
    print()
    print(
        invariants.table(
            summary,
            workers=f"{asyncs.count(False)} sync, {asyncs.count(True)} asyncio",
            kills=f"{kills} ({armed_kills} at a fault point)",
            restarts=pg.restarts,
            terminations=terminations,
            lost_replies=(
                f"{lost_replies} ({grouped} of grouped writes, {claims} of batch claims,"
                f" {starts} of grouped starts)"
            ),
            seconds=f"{elapsed:.0f}",
        )
    )
    for violation in summary.violations[:20]:
        print(f"violation: {violation}")
    print(
        f"soak: sagas={summary.sagas} kills={kills} restarts={pg.restarts} "
        f"lost_replies={lost_replies} "
        f"duplicates={summary.duplicates} lost={summary.lost} parked={parked}"
    )
    return 1 if summary.violations or summary.duplicates or summary.lost else 0


if __name__ == "__main__":
    sys.exit(main())
