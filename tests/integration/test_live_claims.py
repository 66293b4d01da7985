"""Ledger claims keep their leases the way a declared saga's lease is kept: a heartbeat
extends a claim by its own lease and never shortens it, and an operator's compensate,
cancel or resolve never takes over or undoes a call another process holds under a live
claim: it is refused, naming the call, its holder and when its lease ends, unless forced."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from saga import (
    AsyncOrchestrator,
    OperationStatus,
    Orchestrator,
    SagaStatus,
    StepStateError,
    durable_step,
)
from saga.durable import isolated_steps

HERE = Path(__file__).resolve().parent


@pytest.fixture
def orch(database_url: str) -> Iterator[Orchestrator]:
    with isolated_steps():

        @durable_step(name="charge_customer")
        def charge_customer(key: str) -> dict[str, Any]:  # pragma: no cover
            raise AssertionError("ledger calls are made by their callers")

        @charge_customer.compensation
        def refund(ctx: Any, result: Any, key: str) -> None:
            pass

        with Orchestrator(database_url) as made:
            yield made


class Holder:
    """A second process holding one claim of the channel `run-1`."""

    def __init__(self, url: str, key: str, lease_seconds: float) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "claim_holder_app.py"), url, "run-1", key,
             str(lease_seconds)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        words = self.line().split()
        assert words[1] == "claimed", words
        self.owner, self.step, self.saga_id = words[2], words[3], words[4]

    def line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith("HOLDER "), line
        return line.strip()

    def do(self, verb: str) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(verb + "\n")
        self.proc.stdin.flush()
        return self.line()

    def close(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        self.proc.stdout.close()


@pytest.fixture
def holders(database_url: str) -> Iterator[list[Holder]]:
    made: list[Holder] = []
    yield made
    for holder in made:
        holder.close()


def _hold(url: str, holders: list[Holder], key: str, lease_seconds: float) -> Holder:
    holder = Holder(url, key, lease_seconds)
    holders.append(holder)
    return holder


def _settled_call(orch: Orchestrator) -> None:
    claim = orch.ledger.claim("run-1", "order-1", "charge_customer", {"key": "order-1"})
    orch.ledger.complete(claim, {"charged": "order-1"})


# The operators' app: it lends the calls of the tool `charge_customer` their compensation.
APP = """
from saga import Orchestrator, durable_step


@durable_step(name="charge_customer")
def charge_customer(key):
    raise AssertionError("ledger calls are made by their callers")


@charge_customer.compensation
def refund(ctx, result, key):
    pass


orch = Orchestrator()
"""


def _saga(url: str, *args: str, app_dir: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "SAGA_APP"}
    if app_dir is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(app_dir), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "saga", *args, "--database-url", url],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_a_heartbeat_extends_a_claim_by_its_own_lease_and_never_shortens_it(
    orch: Orchestrator,
) -> None:
    claim = orch.ledger.claim(
        "run-1", "order-9", "charge_customer", {"key": "order-9"}, lease_seconds=120
    )
    assert orch.ledger.lease_seconds < 120  # the orchestrator's default is shorter
    before = datetime.now().astimezone()
    beaten = orch.ledger.heartbeat(claim)
    assert beaten.expires_at is not None
    assert beaten.expires_at >= before + timedelta(seconds=119)
    # A heartbeat asking for less leaves the lease where it is: it never shortens it.
    again = orch.ledger.heartbeat(beaten, lease_seconds=1)
    assert again.expires_at is not None and again.expires_at >= beaten.expires_at
    state = orch.get(claim.saga_id)
    assert state.status == SagaStatus.RUNNING
    orch.ledger.complete(again, {"charged": "order-9"})


def test_operator_verbs_refuse_a_call_another_process_holds_under_a_live_claim(
    database_url: str, orch: Orchestrator, holders: list[Holder], tmp_path: Path
) -> None:
    _settled_call(orch)
    holder = _hold(database_url, holders, "order-2", 60.0)
    attempts: dict[str, Any] = {
        "compensate": lambda: orch.compensate(holder.saga_id, actor="ops@acme"),
        "compensate include_unknown": lambda: orch.compensate(
            holder.saga_id, include_unknown=True, actor="ops@acme"
        ),
        "cancel": lambda: orch.cancel(holder.saga_id, reason="stop", actor="ops@acme"),
        "resolve": lambda: orch.resolve(
            holder.saga_id, holder.step, outcome="failed", actor="ops@acme"
        ),
    }
    for verb, attempt in attempts.items():
        with pytest.raises(StepStateError) as refused:
            attempt()
        text = str(refused.value)
        assert f"call {holder.step} is leased by {holder.owner} until" in text, (verb, text)
        assert "or force it" in text, (verb, text)
    # The command says the same, and exits 1 (refused).
    shown = _saga(
        database_url, "resolve", holder.saga_id, holder.step, "--failed", "--reason", "checked",
        "--actor", "ops",
    )  # fmt: skip
    assert shown.returncode == 1, (shown.stdout, shown.stderr)
    assert f"call {holder.step} is leased by {holder.owner}" in shown.stdout + shown.stderr
    (tmp_path / "ops_app.py").write_text(APP)
    compensate = ("compensate", holder.saga_id, "--app", "ops_app:orch", "--include-unknown")
    shown = _saga(database_url, *compensate, app_dir=tmp_path)
    assert shown.returncode == 1, (shown.stdout, shown.stderr)
    assert f"call {holder.step} is leased by {holder.owner}" in shown.stdout, shown.stdout
    planned = _saga(database_url, *compensate, "--dry-run", app_dir=tmp_path)
    assert planned.returncode == 0, (planned.stdout, planned.stderr)
    assert "skipped" in planned.stdout and f"call {holder.step}" in planned.stdout
    # Nothing was taken over: the holder records its result, and the channel goes on.
    assert holder.do("complete") == "HOLDER done complete"
    state = orch.get(holder.saga_id)
    assert state.status == SagaStatus.RUNNING
    call = next(o for o in state.operations if o.step == holder.step)
    assert (call.status, call.result) == (OperationStatus.SUCCEEDED, {"charged": "order-2"})
    # Once the call is settled, a compensation undoes both calls.
    assert orch.compensate(holder.saga_id, actor="ops@acme").status == SagaStatus.COMPENSATED


def test_a_forced_compensation_breaks_the_claim_and_the_holder_is_refused(
    database_url: str, orch: Orchestrator, holders: list[Holder]
) -> None:
    holder = _hold(database_url, holders, "order-3", 60.0)
    state = orch.compensate(holder.saga_id, include_unknown=True, actor="ops", force=True)
    assert state.status == SagaStatus.COMPENSATED
    broken = [e for e in orch.history(holder.saga_id) if e.event == "lease_broken"]
    assert [(e.step, e.detail["previous_owner"]) for e in broken] == [(holder.step, holder.owner)]
    assert holder.do("complete").startswith("HOLDER LeaseLost")
    assert holder.do("heartbeat").startswith("HOLDER LeaseLost")


def test_once_the_claim_expired_the_operator_verbs_proceed(
    database_url: str, orch: Orchestrator, holders: list[Holder]
) -> None:
    holder = _hold(database_url, holders, "order-4", 0.5)
    time.sleep(0.7)  # the lease's own end: nothing to wait on but the clock
    state = orch.resolve(
        holder.saga_id, holder.step, outcome="succeeded", result={"charged": "x"}, actor="ops"
    )
    call = next(o for o in state.operations if o.step == holder.step)
    assert call.status == OperationStatus.SUCCEEDED
    assert holder.do("complete").startswith("HOLDER LeaseLost")


def test_a_live_sessions_running_call_is_named_when_a_verb_is_refused(
    database_url: str,
) -> None:
    from test_sessions import Child

    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE effects (kind text, key text, UNIQUE (kind, key))")
    child = Child(
        database_url, "charge", "ticket-1", SESSION_APP_HANG_IN="charge", SESSION_APP_LEASE="30"
    )
    try:
        child.expect("READY")
        child.expect("IN_CALL")
        with Orchestrator(database_url) as orch:
            (session,) = orch.list()
            (call,) = [o.step for o in orch.get(session.id).operations]
            for verb, attempt in {
                "compensate": lambda: orch.compensate(session.id, include_unknown=True),
                "cancel": lambda: orch.cancel(session.id, reason="stop"),
                "resolve": lambda: orch.resolve(session.id, call, outcome="failed", actor="ops"),
            }.items():
                with pytest.raises(StepStateError) as refused:
                    attempt()
                text = str(refused.value)
                assert f"is leased by {session.lease_owner} until" in text, (verb, text)
                assert f"(call {call} running under it)" in text, (verb, text)
            assert orch.get(session.id).status == SagaStatus.RUNNING
    finally:
        child.kill()


def test_the_asyncio_door_keeps_leases_and_refuses_alike(
    database_url: str, orch: Orchestrator, holders: list[Holder]
) -> None:
    holder = _hold(database_url, holders, "order-5", 60.0)

    async def main() -> None:
        async with AsyncOrchestrator(database_url) as aorch:
            claim = await aorch.ledger.claim(
                "run-1", "order-6", "charge_customer", {"key": "order-6"}, lease_seconds=120
            )
            before = datetime.now().astimezone()
            beaten = await aorch.ledger.heartbeat(claim)
            assert beaten.expires_at is not None
            assert beaten.expires_at >= before + timedelta(seconds=119)
            with pytest.raises(StepStateError, match=f"call {holder.step} is leased by"):
                await aorch.compensate(holder.saga_id, include_unknown=True, actor="ops")
            await aorch.ledger.complete(beaten, {"charged": "order-6"})

    asyncio.run(main())
    assert holder.do("complete") == "HOLDER done complete"
