"""The ledger: calls claimed, completed, failed or left unknown by callers that own their
control flow, each an operation of its channel's saga row, fenced, with replays,
conflicts, unknown outcomes reclaimed and reconciled, and writes whose replies were lost
recognised when sent again."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from faults.proxy import LostReplyProxy

from saga import (
    AsyncOrchestrator,
    Claim,
    DatabaseUnavailable,
    IdempotencyConflict,
    LeaseLost,
    Ledger,
    OperationStatus,
    Orchestrator,
    PermanentError,
    SagaStatus,
    SessionParked,
    StepStateError,
    durable_step,
)
from saga.durable import isolated_steps
from saga.ledger import CHANNEL_SAGA

HERE = Path(__file__).resolve().parent


@pytest.fixture
def url(database_url: str) -> str:
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE provider_charges (id serial PRIMARY KEY, idempotency_key text, "
            "order_id text, amount_cents int)"
        )
    return database_url


@pytest.fixture
def orch(url: str) -> Any:
    made = Orchestrator(url)
    yield made
    made.close()


def _charges(url: str, order_id: str) -> list[tuple[int, str]]:
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT id, idempotency_key FROM provider_charges WHERE order_id = %s ORDER BY id",
            (order_id,),
        ).fetchall()
    return [(int(r[0]), str(r[1])) for r in rows]


def _charge(url: str, claim: Claim, amount_cents: int) -> dict[str, Any]:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "INSERT INTO provider_charges (idempotency_key, order_id, amount_cents) "
            "VALUES (%s, %s, %s) RETURNING id",
            (claim.idempotency_key, claim.key.removeprefix("charge:"), amount_cents),
        ).fetchone()
    assert row is not None
    return {"charge_id": int(row[0]), "amount_cents": amount_cents}


def _params(order_id: str, amount_cents: int = 4200) -> dict[str, Any]:
    # requested_at is volatile: it differs at every claim and is not deduplicated on.
    return {"order_id": order_id, "amount_cents": amount_cents, "requested_at": time.time()}


def _claim(orch: Orchestrator, order_id: str, amount_cents: int = 4200, **kw: Any) -> Claim:
    return orch.ledger.claim(
        "run-7f2a",
        f"charge:{order_id}",
        "charge_customer",
        _params(order_id, amount_cents),
        dedup_fields=("order_id", "amount_cents"),
        **kw,
    )


def _events(orch: Orchestrator, saga_id: str, step: str) -> list[str]:
    return [e.event for e in orch.history(saga_id) if e.step == step]


# ----- the ledger flow -------------------------------------------------------------------


def test_claim_effect_complete_then_replayed_without_calling(url: str, orch: Orchestrator) -> None:
    claim = _claim(orch, "order-4471")
    assert (claim.status, claim.attempt, claim.fence) == ("claimed", 1, 1)
    assert claim.held and not claim.outcome_unknown
    result = _charge(url, claim, 4200)
    orch.ledger.complete(claim, result, provider_reference=f"ch_{result['charge_id']}")

    again = _claim(orch, "order-4471")  # a retry of the same call: other requested_at
    assert again.status == "replayed"
    assert again.result == result
    assert again.provider_reference == f"ch_{result['charge_id']}"
    assert not again.held
    assert len(_charges(url, "order-4471")) == 1

    # The call is an operation of the channel's saga row, seen like any other.
    state = orch.get(claim.saga_id)
    assert state.saga == CHANNEL_SAGA and state.key == "run-7f2a"
    op = state.operation(claim.step)
    assert op.status == OperationStatus.SUCCEEDED
    assert op.idempotency_key == claim.idempotency_key and op.attempts == 1
    assert _events(orch, claim.saga_id, claim.step) == ["attempt_started", "attempt_succeeded"]


def test_a_different_amount_under_the_same_key_is_refused(url: str, orch: Orchestrator) -> None:
    claim = _claim(orch, "order-4471", 4200)
    orch.ledger.complete(claim, _charge(url, claim, 4200))
    with pytest.raises(IdempotencyConflict, match="other deduplicated fields"):
        _claim(orch, "order-4471", 9900)
    # Refused while in flight too, and nothing changed either time.
    other = _claim(orch, "order-9", 100)
    with pytest.raises(IdempotencyConflict):
        _claim(orch, "order-9", 101)
    assert orch.get(other.saga_id).operation(other.step).attempts == 1
    assert len(_charges(url, "order-4471")) == 1


def test_the_same_key_under_another_tool_is_a_conflict(orch: Orchestrator) -> None:
    orch.ledger.claim("run-1", "k-1", "send_email", {"to": "a@example.com"})
    with pytest.raises(IdempotencyConflict):
        orch.ledger.claim("run-1", "k-1", "charge_customer", {"to": "a@example.com"})


def test_a_live_holder_makes_other_claims_in_progress(orch: Orchestrator) -> None:
    claim = _claim(orch, "order-1", lease_seconds=30)
    other = _claim(orch, "order-1")
    assert other.status == "in_progress"
    assert other.owner == claim.owner and other.expires_at == claim.expires_at
    with pytest.raises(StepStateError, match="holds nothing"):
        orch.ledger.complete(other, {"charge_id": 1})
    orch.ledger.complete(claim, {"charge_id": 1})
    assert _claim(orch, "order-1").status == "replayed"


def _race(o: Orchestrator, barrier: threading.Barrier, order_id: str, out: list[str]) -> None:
    o.store  # noqa: B018  (connected before the start line)
    barrier.wait()
    out.append(_claim(o, order_id).status)


def test_racing_claimers_hold_the_call_once(url: str) -> None:
    """Eight threads, each with a connection of its own, claim one call at the same
    moment: one holds it, the others see it in progress; eight trials."""
    orchs = [Orchestrator(url) for _ in range(8)]
    try:
        for trial in range(8):
            barrier = threading.Barrier(len(orchs))
            statuses: list[str] = []
            threads = [
                threading.Thread(target=_race, args=(o, barrier, f"order-race-{trial}", statuses))
                for o in orchs
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
            assert sorted(statuses) == ["claimed"] + ["in_progress"] * 7, statuses
    finally:
        for o in orchs:
            o.close()


def test_dedup_fields_and_params_are_checked_before_anything_is_written(
    url: str, orch: Orchestrator
) -> None:
    with pytest.raises(ValueError, match=r"dedup_fields \['amount'\] are not in params"):
        orch.ledger.claim("run-1", "k", "charge", {"amount_cents": 1}, dedup_fields=("amount",))
    with pytest.raises(TypeError, match="params"):
        orch.ledger.claim("run-1", "k", "charge", {"at": object()})
    with pytest.raises(TypeError, match="sequence of field names"):
        orch.ledger.claim("run-1", "k", "charge", {"a": 1}, dedup_fields="a")
    with pytest.raises(ValueError, match="key must be a non-empty string"):
        orch.ledger.claim("run-1", "", "charge", {})
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT count(*) FROM saga.sagas").fetchone()
    assert row is not None and row[0] == 0


# ----- fences -------------------------------------------------------------------------------


def test_a_stale_holder_is_refused_and_changes_nothing(url: str, orch: Orchestrator) -> None:
    stale = _claim(orch, "order-2", lease_seconds=0.2)
    time.sleep(0.4)
    fresh = _claim(orch, "order-2")
    assert fresh.status == "reclaimed" and fresh.outcome_unknown
    assert fresh.fence == stale.fence + 1 and fresh.attempt == 2
    assert "expired" in (fresh.previous_error or "")
    for write in (
        lambda: orch.ledger.complete(stale, {"charge_id": 99}),
        lambda: orch.ledger.fail(stale, "declined"),
        lambda: orch.ledger.unknown(stale, "timeout"),
        lambda: orch.ledger.heartbeat(stale),
    ):
        with pytest.raises(LeaseLost, match="taken over"):
            write()
    op = orch.get(fresh.saga_id).operation(fresh.step)
    assert op.status == OperationStatus.RUNNING and op.result is None
    orch.ledger.complete(fresh, {"charge_id": 1})
    assert _claim(orch, "order-2").result == {"charge_id": 1}


def test_heartbeat_keeps_the_claim_and_a_late_complete_still_counts(orch: Orchestrator) -> None:
    claim = _claim(orch, "order-3", lease_seconds=0.5)
    for _ in range(4):
        time.sleep(0.2)
        claim = orch.ledger.heartbeat(claim, lease_seconds=0.5)
        assert _claim(orch, "order-3").status == "in_progress"
    time.sleep(0.7)  # expired, but nobody took it over: the fence is still this claim's
    orch.ledger.complete(claim, {"charge_id": 3})
    assert _claim(orch, "order-3").status == "replayed"


# ----- failures, unknown outcomes and ceilings -----------------------------------------------


def test_a_transient_failure_is_retried_up_to_the_ceiling(orch: Orchestrator) -> None:
    claim = _claim(orch, "order-4", max_attempts=2)
    orch.ledger.fail(claim, TimeoutError("gateway 504 before the charge"), permanent=False)
    second = _claim(orch, "order-4", max_attempts=2)
    assert (second.status, second.attempt, second.outcome_unknown) == ("claimed", 2, False)
    assert second.previous_error == "TimeoutError: gateway 504 before the charge"
    orch.ledger.fail(second, "gateway 504 again", permanent=False)
    with pytest.raises(PermanentError, match="gave up after 2 attempts: gateway 504 again"):
        _claim(orch, "order-4", max_attempts=2)


def test_a_permanent_failure_is_final(orch: Orchestrator) -> None:
    claim = _claim(orch, "order-5")
    orch.ledger.fail(claim, "card declined")
    with pytest.raises(PermanentError, match="failed for good before: card declined"):
        _claim(orch, "order-5")
    assert orch.get(claim.saga_id).operation(claim.step).status == OperationStatus.FAILED


def test_unknown_parks_the_channel_until_the_call_is_reclaimed(orch: Orchestrator) -> None:
    claim = _claim(orch, "order-6")
    orch.ledger.unknown(claim, "read timeout after the request was sent")
    state = orch.get(claim.saga_id)
    assert state.status == SagaStatus.NEEDS_REVIEW
    assert "read timeout" in (state.error or "") and claim.step in (state.error or "")
    with pytest.raises(SessionParked, match="needs a human") as parked:
        _claim(orch, "order-other")  # nothing new runs in a parked channel
    # The advice is a command `saga resolve` takes: ID, then the call's name.
    assert f"`saga resolve {claim.saga_id} CALL --succeeded --result JSON`" in str(parked.value)

    again = _claim(orch, "order-6")
    assert (again.status, again.outcome_unknown) == ("reclaimed", True)
    assert again.previous_error == "read timeout after the request was sent"
    assert orch.get(claim.saga_id).status == SagaStatus.RUNNING  # the reclaimer settles it
    orch.ledger.complete(again, {"charge_id": 6, "found_by": "reconcile"})
    assert _claim(orch, "order-other").status == "claimed"


def test_unknown_outcomes_past_the_ceiling_park_for_a_human(orch: Orchestrator) -> None:
    first = _claim(orch, "order-7", max_attempts=2, lease_seconds=0.1)
    time.sleep(0.3)
    second = _claim(orch, "order-7", max_attempts=2, lease_seconds=0.1)
    assert second.status == "reclaimed"
    time.sleep(0.3)
    with pytest.raises(SessionParked, match=r"2 attempts of 2 ended without an outcome") as out:
        _claim(orch, "order-7", max_attempts=2)
    assert f"`saga resolve {first.saga_id} {first.step} --failed --reason TEXT`" in str(out.value)
    state = orch.get(first.saga_id)
    assert state.status == SagaStatus.NEEDS_REVIEW
    assert state.operation(first.step).status == OperationStatus.UNKNOWN
    # An operator checked the provider: the charge happened. The call now replays.
    orch.resolve(
        first.saga_id,
        first.step,
        outcome="succeeded",
        result={"charge_id": 7},
        actor="ops@acme",
        reason="seen in the provider's dashboard",
    )
    replay = _claim(orch, "order-7", max_attempts=2)
    assert (replay.status, replay.result) == ("replayed", {"charge_id": 7})
    assert _claim(orch, "order-8").status == "claimed"


def test_a_result_that_is_not_json_parks_and_names_the_call(orch: Orchestrator) -> None:
    claim = _claim(orch, "order-10")
    with pytest.raises(TypeError, match=r"'charge_customer' under key 'charge:order-10'"):
        orch.ledger.complete(claim, {"at": object()})
    state = orch.get(claim.saga_id)
    assert state.status == SagaStatus.NEEDS_REVIEW
    assert state.operation(claim.step).status == OperationStatus.UNKNOWN


# ----- the charge whose reply was lost ------------------------------------------------------


def _child(
    url: str, order_id: str
) -> tuple[subprocess.Popen[str], queue.Queue[str], threading.Thread]:
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "ledger_app.py"), url, "run-7f2a", order_id, "4200"],
        env={**os.environ, "PYTHONPATH": str(HERE.parent.parent)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.strip())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return proc, lines, reader


def _expect(lines: queue.Queue[str], prefix: str) -> str:
    deadline = time.monotonic() + 60
    seen = []
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            continue
        seen.append(line)
        if line.startswith(prefix):
            return line
    raise AssertionError(f"no {prefix!r} from the child: {seen}")


def test_a_charge_whose_process_died_before_complete_is_reclaimed_and_reconciled(
    url: str, orch: Orchestrator
) -> None:
    proc, lines, reader = _child(url, "order-4471")
    try:
        assert _expect(lines, "LEDGER_APP ").split()[1:] == ["claimed", "1"]
        _expect(lines, "LEDGER_APP CHARGED")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        reader.join(timeout=30)
        assert proc.stdout is not None
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    # While the dead holder's lease lasts, the call is in progress: nobody charges again.
    assert _claim(orch, "order-4471").status == "in_progress"
    time.sleep(1.2)

    claim = _claim(orch, "order-4471")
    assert (claim.status, claim.outcome_unknown, claim.attempt) == ("reclaimed", True, 2)
    # Reconcile: ask the provider by the operation's key before charging again.
    found = [c for c in _charges(url, "order-4471") if c[1] == claim.idempotency_key]
    assert len(found) == 1
    orch.ledger.complete(claim, {"charge_id": found[0][0]}, provider_reference="reconciled")
    assert len(_charges(url, "order-4471")) == 1
    assert _claim(orch, "order-4471").result == {"charge_id": found[0][0]}
    events = _events(orch, claim.saga_id, claim.step)
    assert events == ["attempt_started", "outcome_unknown", "attempt_started", "attempt_succeeded"]


# ----- the database out of reach, and replies lost after the commit -----------------------------


def test_replies_lost_after_the_commit_are_recognised(url: str) -> None:
    with LostReplyProxy(url) as proxy:
        orch = Orchestrator(proxy.url)
        try:
            orch.store  # noqa: B018  (migrated before the rules are armed)
            proxy.lose_reply("ledger_claim")
            claim = _claim(orch, "order-20")
            assert (claim.status, claim.fence, claim.attempt) == ("claimed", 1, 1)
            proxy.lose_reply("ledger_settle")
            orch.ledger.complete(claim, {"charge_id": 20})
            assert len(proxy.lost_replies("ledger_claim")) == 1
            assert len(proxy.lost_replies("ledger_settle")) == 1
            assert _events(orch, claim.saga_id, claim.step) == [
                "attempt_started",
                "attempt_succeeded",
            ]
        finally:
            orch.close()


def test_a_complete_that_cannot_reach_the_database_never_records_a_failure(url: str) -> None:
    proxy = LostReplyProxy(url)
    orch = Orchestrator(proxy.url)
    direct = Orchestrator(url)
    try:
        claim = _claim(orch, "order-21", lease_seconds=1.0)
        orch.store.pool.timeout = 1.0  # a connection is waited for 1 s (30 by default)
        proxy.close()  # the network is gone after the effect
        with pytest.raises(DatabaseUnavailable):
            Ledger(orch, retry_seconds=1.0).complete(claim, {"charge_id": 21})
        op = direct.get(claim.saga_id).operation(claim.step)
        assert op.status == OperationStatus.RUNNING  # not failed: the effect may have happened
        time.sleep(1.2)
        again = _claim(direct, "order-21")
        assert (again.status, again.outcome_unknown) == ("reclaimed", True)
    finally:
        orch.close()
        direct.close()


# ----- the CLI, the audit trail and compensation see ledger calls ----------------------------


def test_saga_compensate_undoes_a_channels_calls_in_reverse(url: str) -> None:
    undone: list[str] = []
    with isolated_steps():

        @durable_step(name="reserve_stock")
        def reserve_stock(sku: str, quantity: int) -> dict[str, Any]:  # pragma: no cover
            raise AssertionError("ledger calls are made by their callers")

        @reserve_stock.compensation
        def release_stock(ctx: Any, result: dict[str, Any], sku: str, quantity: int) -> None:
            undone.append(f"{sku}x{quantity}:{result['reservation']}")

        orch = Orchestrator(url)
        try:
            ids = []
            for n, sku in enumerate(("sku-1", "sku-2", "sku-3")):
                claim = orch.ledger.claim(
                    "run-9", f"reserve:{sku}", "reserve_stock", {"sku": sku, "quantity": n + 1}
                )
                orch.ledger.complete(claim, {"reservation": f"r{n}"})
                ids.append(claim.saga_id)
            state = orch.compensate(ids[0], actor="ops@acme")
        finally:
            orch.close()
    assert state.status == SagaStatus.COMPENSATED
    assert undone == ["sku-3x3:r2", "sku-2x2:r1", "sku-1x1:r0"]
    with Orchestrator(url) as again, pytest.raises(StepStateError, match="compensated"):
        again.ledger.claim("run-9", "reserve:4", "reserve_stock", {"sku": "sku-4", "quantity": 1})


def test_saga_show_lists_a_channels_calls(url: str, orch: Orchestrator) -> None:
    first = _claim(orch, "order-30")
    orch.ledger.complete(first, {"charge_id": 30})
    second = orch.ledger.claim("run-7f2a", "email:ops", "send_email", {"to": "ops@acme.com"})
    shown = subprocess.run(
        [sys.executable, "-m", "saga", "show", first.saga_id, "--database-url", url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    assert CHANNEL_SAGA in shown.stdout and "run-7f2a" in shown.stdout
    assert first.step in shown.stdout and second.step in shown.stdout
    assert shown.stdout.index(first.step) < shown.stdout.index(second.step)


# ----- the async door -------------------------------------------------------------------------


def test_the_async_ledger_claims_completes_replays_and_fences(url: str) -> None:
    async def main() -> None:
        async with AsyncOrchestrator(url) as aorch:
            ledger = aorch.ledger
            params = {"order_id": "a-1", "amount_cents": 5}
            claim = await ledger.claim("run-a", "charge:a-1", "charge", params, lease_seconds=0.2)
            assert claim.status == "claimed"
            await asyncio.sleep(0.4)
            fresh = await ledger.claim("run-a", "charge:a-1", "charge", params)
            assert fresh.status == "reclaimed"
            with pytest.raises(LeaseLost):
                await ledger.complete(claim, {"ok": True})
            fresh = await ledger.heartbeat(fresh)
            await ledger.complete(fresh, {"ok": True})
            replay = await ledger.claim("run-a", "charge:a-1", "charge", params)
            assert (replay.status, replay.result) == ("replayed", {"ok": True})
            with pytest.raises(IdempotencyConflict):
                await ledger.claim("run-a", "charge:a-1", "charge", {**params, "amount_cents": 6})
            other = await ledger.claim("run-a", "email:x", "email", {"to": "x"})
            await ledger.fail(other, "bounced", permanent=True)
            with pytest.raises(PermanentError):
                await ledger.claim("run-a", "email:x", "email", {"to": "x"})
            third = await ledger.claim("run-a", "sms:x", "sms", {"to": "x"})
            await ledger.unknown(third, "timeout")
            with pytest.raises(SessionParked):
                await ledger.claim("run-a", "sms:y", "sms", {"to": "y"})

    asyncio.run(main())


def test_channels_are_per_tenant(orch: Orchestrator) -> None:
    a = orch.ledger.claim("run-1", "k", "t", {"x": 1}, tenant="acme")
    b = orch.ledger.claim("run-1", "k", "t", {"x": 1}, tenant="globex")
    assert a.status == b.status == "claimed" and a.saga_id != b.saga_id
    assert a.idempotency_key != b.idempotency_key
    assert uuid.UUID(a.saga_id) and orch.get(a.saga_id).tenant_id == "acme"


def _saga(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "saga", *args, "--database-url", url],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != "SAGA_APP"},
    )


def test_saga_resolve_settles_a_ledger_call_without_an_app(url: str, orch: Orchestrator) -> None:
    claim = orch.ledger.claim("run-11", "refund:1", "refund", {"order": "1"})
    orch.ledger.unknown(claim, "gateway timeout")
    listed = _saga(url, "list")
    assert "parked" in listed.stdout
    assert f"{claim.step}: outcome unknown: gateway timeout" in listed.stdout

    done = _saga(
        url, "resolve", claim.saga_id, claim.step, "--succeeded", "--result",
        '{"refund_id": "r1"}', "--actor", "ops@acme", "--reason", "seen at the gateway",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "an open ledger channel: its callers claim its calls" in done.stdout
    assert "worker" not in done.stdout
    replay = orch.ledger.claim("run-11", "refund:1", "refund", {"order": "1"})
    assert (replay.status, replay.result) == ("replayed", {"refund_id": "r1"})
    listed = _saga(url, "list")
    assert "an open ledger channel: its callers claim its calls" in listed.stdout


def _listed_status(url: str, saga_id: str) -> str:
    """The STATUS column of `saga list` for one saga."""
    listed = _saga(url, "list")
    assert listed.returncode == 0, listed.stderr
    header, *rows = listed.stdout.splitlines()
    (row,) = [r for r in rows if r.startswith(saga_id)]
    column = header.index("STATUS")
    return row[column:].split()[0]


def test_saga_list_and_show_tell_open_idle_parked_and_closed_channels(
    url: str, orch: Orchestrator
) -> None:
    """A channel is stored `running` until it is closed; `saga list` and `saga show` say
    whether a call is in flight (open), none is (idle), one needs a human (parked), or
    the channel ended (closed), keeping the stored status for `show`."""
    claim = orch.ledger.claim("run-st", "refund:1", "refund", {"order": "1"})
    assert _listed_status(url, claim.saga_id) == "open"
    orch.ledger.fail(claim, "card declined for good")
    assert _listed_status(url, claim.saga_id) == "idle"
    shown = _saga(url, "show", claim.saga_id, "--json")
    assert json.loads(shown.stdout)["display_status"] == "idle", shown.stdout
    shown = _saga(url, "show", claim.saga_id)
    assert re.search(r"^status +idle \(running\)$", shown.stdout, re.M), shown.stdout
    orch.ledger.close("run-st")
    assert _listed_status(url, claim.saga_id) == "closed"

    parked = orch.ledger.claim("run-pk", "refund:2", "refund", {"order": "2"})
    orch.ledger.unknown(parked, "gateway timeout")
    assert _listed_status(url, parked.saga_id) == "parked"


def test_saga_list_tells_an_open_session_from_an_idle_and_a_closed_one(
    url: str, orch: Orchestrator
) -> None:
    """A session is open while its block runs, idle once an error other than a
    `PermanentError` left the block (its next entry resumes it), closed once the block
    exited."""
    with isolated_steps():

        @durable_step(key=lambda n: n)
        def note(n: str) -> str:
            return n

        with pytest.raises(RuntimeError), orch.session("ticket-st") as run:
            note("a")
            assert _listed_status(url, run.id) == "open"
            raise RuntimeError("the agent's model timed out")
        assert _listed_status(url, run.id) == "idle"
        with orch.session("ticket-st") as run:
            note("a")
        assert _listed_status(url, run.id) == "closed"


def test_saga_list_into_a_closed_pipe_is_not_an_error(url: str, orch: Orchestrator) -> None:
    for n in range(40):
        orch.ledger.claim(f"run-{n}", "k", "t", {})
    piped = subprocess.run(
        f"'{sys.executable}' -m saga list --database-url '{url}' | head -1",
        shell=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert piped.stdout.startswith("ID ")
    assert "error" not in piped.stderr, piped.stderr


def test_a_settled_channel_closes_and_refuses_later_claims(orch: Orchestrator) -> None:
    claim = orch.ledger.claim("run-c", "k-1", "t", {"x": 1})
    with pytest.raises(StepStateError, match=rf"has call {claim.step} running: settle it first"):
        orch.ledger.close("run-c")
    orch.ledger.complete(claim, {"ok": 1})
    saga_id = orch.ledger.close("run-c", actor="ops")
    assert saga_id == claim.saga_id
    state = orch.get(saga_id)
    assert state.status == SagaStatus.COMPLETED
    assert orch.ledger.close("run-c") == saga_id  # again: nothing more to do
    with pytest.raises(StepStateError, match="is completed: no call runs in it now"):
        orch.ledger.claim("run-c", "k-2", "t", {"x": 2})
    assert orch.ledger.claim("run-c", "k-1", "t", {"x": 1}).status == "replayed"
    with pytest.raises(StepStateError, match="there is no ledger channel 'run-none'"):
        orch.ledger.close("run-none")


def test_compensating_a_call_whose_step_is_not_imported_parks_instead_of_skipping_it(
    orch: Orchestrator,
) -> None:
    claim = orch.ledger.claim("run-u", "k-1", "mystery_tool", {"a": 1})
    orch.ledger.complete(claim, {"ok": True})
    state = orch.compensate(claim.saga_id, actor="ops")
    assert state.status == SagaStatus.NEEDS_REVIEW
    assert f"call {claim.step!r} cannot be undone here" in (state.error or "")
    assert "--kind compensation" in (state.error or "")
