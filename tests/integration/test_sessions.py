"""Sessions of durable steps: each call is an operation of the session's saga row, run
once under its key and replayed after, from this process or any later one; a session
is leased, so racing processes never run a call twice; a call cut off by a crash is
settled like any unknown outcome; a failing session compensates its calls in reverse."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest

from saga import (
    AsyncOrchestrator,
    IdempotencyConflict,
    Orchestrator,
    PermanentError,
    SagaDefinitionError,
    SessionBusy,
    SessionParked,
    StepContext,
    current_context,
    durable_step,
)

HERE = Path(__file__).resolve().parent


class Child:
    """A `session_app.py` process whose `SESSION_APP ...` lines are read with deadlines."""

    def __init__(self, url: str, mode: str, run_id: str, **env: str) -> None:
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.output: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "session_app.py"), mode, run_id],
            env={**os.environ, "SESSION_APP_URL": url, **env},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)
            if line.startswith("SESSION_APP "):
                self.lines.put(line[len("SESSION_APP ") :].strip())
        self.proc.stdout.close()
        self.lines.put(None)

    def expect(self, prefix: str = "", timeout: float = 60.0) -> str:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            output = "".join(self.output)
            raise AssertionError(f"no {prefix!r} within {timeout}s:\n{output}") from None
        assert line is not None, f"exited before {prefix!r}:\n{''.join(self.output)}"
        assert line.startswith(prefix), f"expected {prefix!r}, got {line!r}"
        return line

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("GO\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._close()

    def finish(self) -> None:
        code = self.proc.wait(timeout=60)
        self._close()
        assert code == 0, "".join(self.output)

    def _close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        while self.lines.get(timeout=30) is not None:  # the reader is done with stdout
            pass


@pytest.fixture
def url(database_url: str) -> str:
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE effects (kind text, key text, UNIQUE (kind, key))")
    return database_url


def _effects(url: str, kind: str) -> int:
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT count(*) FROM effects WHERE kind = %s", (kind,)).fetchone()
    assert row is not None
    return int(row[0])


sys.path.insert(0, str(HERE))
import session_app  # noqa: E402  (the same durable steps as the child processes)


def _orch(url: str) -> Orchestrator:
    session_app.URL = url
    return Orchestrator(url, lease_seconds=session_app.LEASE_SECONDS)


# ----- the quickstart -------------------------------------------------------------------------


def test_the_same_call_twice_executes_once_and_replays_once(url: str) -> None:
    run_id = f"ticket-{uuid.uuid4()}"
    with _orch(url) as orch:
        with orch.session(run_id, tenant="acme") as run:
            first = session_app.send_email("ops@acme.com", "Refund approved")
            again = session_app.send_email("ops@acme.com", "Refund approved")
            assert (run.executed, run.replayed) == (1, 1)
            assert first == again == {"to": "ops@acme.com", "attempt": 1}
        state = orch.get(run.id)
        assert state.status == "completed" and state.key == run_id and state.tenant_id == "acme"
        assert [(op.kind, op.status, op.attempts) for op in state.operations] == [
            ("action", "succeeded", 1)
        ]
        # A later entry replays from the ledger; the provider saw one email.
        with orch.session(run_id, tenant="acme") as later:
            assert session_app.send_email("ops@acme.com", "Refund approved") == first
            assert (later.executed, later.replayed) == (0, 1)
    assert _effects(url, "email") == 1


def test_a_new_process_after_a_sigkill_between_the_calls_replays_the_first(url: str) -> None:
    run_id = f"ticket-{uuid.uuid4()}"
    child = Child(url, "email", run_id, SESSION_APP_HANG_AFTER="1")
    child.expect("READY")
    child.expect("SENT")
    child.kill()
    with _orch(url) as orch, orch.session(run_id, wait_seconds=10) as run:
        # The killed holder's lease expires; the first call is replayed, never re-sent.
        session_app.send_email("ops@acme.com", "Refund approved")
        session_app.send_email("ops@acme.com", "Refund approved")
        assert (run.executed, run.replayed) == (0, 2)
    assert _effects(url, "email") == 1


# ----- keys ---------------------------------------------------------------------------------------


def test_keys_come_from_the_bound_arguments_and_a_new_request_under_a_key_is_refused(
    url: str,
) -> None:
    calls: list[tuple[int, int]] = []

    @durable_step(name="add_item")
    def add_item(sku: int, qty: int = 1) -> int:
        calls.append((sku, qty))
        return sku * qty

    @durable_step(name="pay", key=lambda order, client: order)
    def pay(order: str, client: object) -> str:
        return f"paid {order}"

    with _orch(url) as orch, orch.session(f"keys-{uuid.uuid4()}") as run:
        assert add_item(7) == add_item(sku=7) == add_item(7, qty=1) == 7
        assert calls == [(7, 1)] and (run.executed, run.replayed) == (1, 2)
        add_item(7, 2)  # another call: other arguments, another key
        assert calls == [(7, 1), (7, 2)]
        # A client object is no key: key= names the call, and it runs.
        assert pay("o-1", object()) == "paid o-1"
        with pytest.raises(TypeError, match="durable step 'add_item'"):
            add_item(object())  # type: ignore[arg-type]
        assert len(orch.get(run.id).operations) == 3  # the refused call stored nothing

    @durable_step(name="pay_amount", key=lambda order, amount: order)
    def pay_amount(order: str, amount: int) -> int:
        return amount

    with _orch(url) as orch, orch.session(f"conflict-{uuid.uuid4()}"):
        pay_amount("o-1", 100)
        with pytest.raises(IdempotencyConflict, match="under key 'o-1' with other arguments"):
            pay_amount("o-1", 200)


def test_outside_a_session_a_durable_step_is_a_plain_call(url: str) -> None:
    assert current_context() is None
    with _orch(url):
        assert session_app.send_email.fn is not None
        # Nothing is stored, and the step sees no context.
        calls: list[Any] = []

        @durable_step(name="plain")
        def plain(x: int) -> int:
            calls.append(current_context())
            return x + 1

        assert plain(1) == 2 and calls == [None]


# ----- leases: one holder at a time ------------------------------------------------------------


def test_a_second_entry_while_the_first_is_alive_waits_then_raises_session_busy(
    url: str,
) -> None:
    run_id = f"busy-{uuid.uuid4()}"
    child = Child(url, "charge", run_id, SESSION_APP_HANG_IN="charge", SESSION_APP_LEASE="3")
    child.expect("READY")
    child.expect("IN_CALL")
    try:
        with _orch(url) as orch:
            started = time.monotonic()
            busy = pytest.raises(SessionBusy, match=f"session {run_id!r}")
            with busy, orch.session(run_id, wait_seconds=1.5):
                session_app.charge("o-1", 100)
            assert time.monotonic() - started >= 1.5  # it waited, and the holder held on
    finally:
        child.kill()
    assert _effects(url, "charge") == 1


@pytest.mark.parametrize("trial", range(8))
def test_racing_processes_never_run_a_call_twice(url: str, trial: int) -> None:
    """Two processes enter one session at the same moment and make the same
    non-idempotent call: one runs it, the other waits for the lease and replays it."""
    run_id = f"race-{uuid.uuid4()}"
    children = [
        Child(
            url,
            "charge",
            run_id,
            SESSION_APP_GO="1",
            SESSION_APP_WAIT="30",
            # A holder starved past its lease on a loaded machine would let the other in
            # while its call runs: that is the unknown-outcome test's subject, not this one.
            SESSION_APP_LEASE="5",
        )
        for _ in range(2)
    ]
    for child in children:
        child.expect("READY")
    for child in children:
        child.go()
    results = [json.loads(child.expect("{")) for child in children]
    for child in children:
        child.finish()
    assert sorted((r["executed"], r["replayed"]) for r in results) == [(0, 1), (1, 0)]
    assert _effects(url, "charge") == 1


# ----- calls cut off by a crash ----------------------------------------------------------------


def _killed_in(url: str, mode: str, step: str) -> str:
    """A session whose process was SIGKILLed inside the call of `step`."""
    run_id = f"crash-{uuid.uuid4()}"
    child = Child(url, mode, run_id, SESSION_APP_HANG_IN=step)
    child.expect("READY")
    child.expect("IN_CALL")
    child.kill()
    return run_id


def test_an_idempotent_call_cut_off_is_retried_under_its_key(url: str) -> None:
    run_id = _killed_in(url, "email", "send_email")
    with _orch(url) as orch, orch.session(run_id, wait_seconds=10) as run:
        assert session_app.send_email("ops@acme.com", "Refund approved")["attempt"] == 2
        assert run.executed == 1
        events = [e.event for e in run.history()]
    assert "outcome_unknown" in events
    assert _effects(url, "email") == 1  # the provider deduped the retry on the key


def test_a_call_cut_off_is_settled_by_its_reconcile_hook(url: str) -> None:
    run_id = _killed_in(url, "ship", "ship")
    with _orch(url) as orch, orch.session(run_id, wait_seconds=10) as run:
        assert session_app.ship("o-1") == {"tracking": "t-o-1"}
        # Settled by its hook: neither run again nor replayed.
        assert (run.executed, run.replayed, run.reconciled) == (0, 0, 1)
        assert "reconcile_found" in [e.event for e in run.history()]
    assert _effects(url, "ship") == 1


def test_a_call_that_cannot_be_settled_parks_the_session_and_says_which(url: str) -> None:
    run_id = _killed_in(url, "charge", "charge")
    with _orch(url) as orch:
        parked = pytest.raises(SessionParked, match=r"charge\.[0-9a-f]{12}.*resolve it")
        with parked, orch.session(run_id, wait_seconds=10):
            session_app.charge("o-1", 100)
        with pytest.raises(SessionParked, match="needs a human"), orch.session(run_id):
            pass
        (state,) = [s for s in orch.list() if s.key == run_id]
        assert state.status == "needs_review"
    assert _effects(url, "charge") == 1  # never charged a second time


# ----- failing sessions compensate -----------------------------------------------------------


def _refunding_steps(log: list[str]) -> tuple[Any, Any]:
    @durable_step(name="reserve_room")
    def reserve(room: str) -> dict[str, str]:
        log.append(f"reserve {room}")
        return {"room": room}

    @reserve.compensation
    def release(ctx: StepContext, result: dict[str, str], room: str) -> None:
        log.append(f"release {result['room']}")

    @durable_step(name="charge_card")
    def charge(amount: int) -> dict[str, int]:
        log.append(f"charge {amount}")
        return {"amount": amount}

    @charge.compensation
    def refund(ctx: StepContext, result: dict[str, int], amount: int) -> None:
        log.append(f"refund {result['amount']}")

    return reserve, charge


def test_a_permanent_error_leaving_the_block_compensates_in_reverse_then_propagates(
    url: str,
) -> None:
    log: list[str] = []
    reserve, charge = _refunding_steps(log)
    with _orch(url) as orch:
        cancelled = pytest.raises(PermanentError, match="guest cancelled")
        with cancelled, orch.session(f"trip-{uuid.uuid4()}") as run:
            reserve("r-1")
            charge(300)
            raise PermanentError("guest cancelled")
        assert log == ["reserve r-1", "charge 300", "refund 300", "release r-1"]
        state = orch.get(run.id)
        assert state.status == "compensated"
        assert [(op.kind, op.status) for op in state.operations if op.kind == "compensation"] == [
            ("compensation", "succeeded"),
            ("compensation", "succeeded"),
        ]


def test_fail_compensates_without_an_exception_and_no_call_runs_after(url: str) -> None:
    log: list[str] = []
    reserve, charge = _refunding_steps(log)
    with _orch(url) as orch, orch.session(f"trip-{uuid.uuid4()}") as run:
        reserve("r-2")
        run.fail("no payment method")
        with pytest.raises(Exception, match="was failed"):
            charge(100)
    assert log == ["reserve r-2", "release r-2"]
    with _orch(url) as orch:
        assert orch.get(run.id).status == "compensated"


def _not_json_steps(effects: list[str]) -> tuple[Any, Any]:
    """A step whose result is not JSON (after its effect), and an async twin of it."""

    @durable_step(name="make_token", key=lambda kind: kind)
    def make_token(kind: str) -> Any:
        effects.append(f"made {kind}")
        return object()

    @durable_step(name="make_token_async", key=lambda kind: kind)
    async def make_token_async(kind: str) -> Any:
        await asyncio.sleep(0)
        effects.append(f"made {kind}")
        return {"kinds": {kind}}  # a set inside

    return make_token, make_token_async


# What the caller of a step whose result is not JSON is told: the step and the key, that the
# effect happened, that the session is parked for a human, and the command that settles it.
NOT_STORED = (
    r"durable step '{step}' under key 'k-1' in session [0-9a-f-]+: its effect happened, but "
    r"its result cannot be stored \(result of durable step '{step}': .* is not JSON.*\)\. "
    r"The call is never run again: .*parked for a human; settle call '{step}\.[0-9a-f]{{12}}' "
    r"with `saga resolve [0-9a-f-]+ {step}\.[0-9a-f]{{12}} --succeeded"
)


def _parked_not_json(state: Any, step: str) -> str:
    """The call of `step` a non-JSON result parked the session at: recorded, unknown."""
    assert state.status == "needs_review"
    assert f"result of durable step {step!r}" in (state.error or "")
    (op,) = state.operations
    assert (op.step.split(".")[0], op.status, op.attempts) == (step, "unknown", 1)
    assert "TypeError" in (op.error or "")
    return str(op.step)


def test_a_result_that_is_not_json_is_a_type_error_and_parks_the_session(url: str) -> None:
    """The call's code gets a TypeError naming the step and the key; the call is recorded
    (unknown), the session parks, and the next entry raises SessionParked naming the call
    until a human resolves it; the effect is never run again."""
    effects: list[str] = []
    make_token, _ = _not_json_steps(effects)
    run_id = f"json-{uuid.uuid4()}"
    with _orch(url) as orch:
        # The session stays parked for the rest of the block: no call runs in it, and the
        # block's end says so.
        with pytest.raises(SessionParked, match="needs a human"), orch.session(run_id) as run:
            with pytest.raises(TypeError, match=NOT_STORED.format(step="make_token")) as raised:
                make_token("k-1")
            assert isinstance(raised.value.__cause__, TypeError)  # the codec's own error
            with pytest.raises(SessionParked, match=r"make_token\.[0-9a-f]{12}"):
                make_token("k-2")
        call = _parked_not_json(orch.get(run.id), "make_token")
        assert "outcome_unknown" in [e.event for e in orch.history(run.id)]
        entry = pytest.raises(SessionParked, match=rf"needs a human.*saga resolve \S+ {call}")
        with entry, orch.session(run_id):
            make_token("k-1")
        orch.resolve(
            run.id, call, outcome="succeeded", result={"token": "t"}, actor="ops", reason="seen"
        )
        with orch.session(run_id) as again:
            assert make_token("k-1") == {"token": "t"}
            assert (again.executed, again.replayed) == (0, 1)
    assert effects == ["made k-1"]  # the effect happened once, and is not run again


def test_a_result_that_is_not_json_is_a_type_error_through_the_asyncio_door(url: str) -> None:
    effects: list[str] = []
    _, make_token = _not_json_steps(effects)
    run_id = f"json-{uuid.uuid4()}"

    async def main() -> None:
        async with AsyncOrchestrator(url) as orch:
            with pytest.raises(TypeError, match=NOT_STORED.format(step="make_token_async")):
                async with orch.session(run_id) as run:
                    await make_token("k-1")
            call = _parked_not_json(await orch.get(run.id), "make_token_async")
            with pytest.raises(SessionParked, match=rf"saga resolve \S+ {call}"):
                async with orch.session(run_id):
                    await make_token("k-1")

    asyncio.run(main())
    assert effects == ["made k-1"]


# ----- the asyncio door ------------------------------------------------------------------------


def test_the_asyncio_door_runs_each_call_once_and_replays_it(url: str) -> None:
    sent: list[str] = []

    @durable_step(name="notify", key=lambda to: to, idempotent=True)
    async def notify(to: str) -> dict[str, Any]:
        ctx = current_context()
        assert ctx is not None
        await asyncio.sleep(0.01)
        sent.append(to)
        return {"to": to, "key": ctx.idempotency_key}

    run_id = f"agent-{uuid.uuid4()}"

    async def main() -> tuple[int, int, str]:
        async with AsyncOrchestrator(url) as orch:
            async with orch.session(run_id) as run:
                first = await notify("a@x")
                assert await notify("a@x") == first
                # Calls from gathered tasks of one session run one at a time, once each.
                await asyncio.gather(*(notify(f"u{n}@x") for n in range(5)))
                await asyncio.gather(*(notify(f"u{n}@x") for n in range(5)))
                executed, replayed = run.executed, run.replayed
            return executed, replayed, (await orch.get(run.id)).status

    assert asyncio.run(main()) == (6, 6, "completed")
    assert sorted(sent) == sorted(["a@x"] + [f"u{n}@x" for n in range(5)])


# ----- the operator verbs on sessions ----------------------------------------------------------


def test_an_operator_resolves_a_parked_call_and_the_next_entry_replays_it(url: str) -> None:
    run_id = _killed_in(url, "charge", "charge")
    with _orch(url) as orch:
        with pytest.raises(SessionParked), orch.session(run_id, wait_seconds=10) as run:
            session_app.charge("o-1", 100)
        (call,) = [op.step for op in orch.get(run.id).operations]
        assert call.startswith("charge.")
        orch.resolve(
            run.id,
            call,
            outcome="succeeded",
            result={"charge_id": "ch-o-1"},
            actor="ops@acme",
            reason="the provider shows one charge",
        )
        with orch.session(run_id) as again:
            assert session_app.charge("o-1", 100) == {"charge_id": "ch-o-1"}
            assert (again.executed, again.replayed) == (0, 1)
        assert orch.get(run.id).status == "completed"
    assert _effects(url, "charge") == 1


def test_compensate_undoes_a_finished_sessions_calls_from_another_process(url: str) -> None:
    """The calls' arguments are stored with them: a later `compensate` (as `saga
    compensate ID` runs it) calls each compensation with them, in reverse."""
    log: list[str] = []
    reserve, charge = _refunding_steps(log)
    with _orch(url) as orch:
        with orch.session(f"trip-{uuid.uuid4()}") as run:
            reserve("r-3")
            charge(450)
        assert orch.get(run.id).status == "completed"
        log.clear()
    with _orch(url) as other:  # a new orchestrator: nothing of the session in memory
        state = other.compensate(run.id, actor="ops")
        assert state.status == "compensated"
    assert log == ["refund 450", "release r-3"]


def test_a_step_with_a_prepare_hook_is_refused_in_a_session_before_anything_runs(
    url: str,
) -> None:
    ran: list[str] = []

    @durable_step(name="quote_and_pay")
    def pay(order: str) -> str:
        ran.append(order)
        return order

    @pay.prepare
    def quote(ctx: StepContext, order: str) -> dict[str, str]:
        return {"order": order}

    with _orch(url) as orch, orch.session(f"prep-{uuid.uuid4()}") as run:
        with pytest.raises(SagaDefinitionError, match="'quote_and_pay' has a prepare hook"):
            pay("o-1")
        assert orch.get(run.id).operations == []
    assert ran == []


TRIP_APP = """
from saga import Orchestrator, StepContext, durable_step

@durable_step(name="book_room")
def book(room: str) -> dict:
    return {"room": room}

@book.compensation
def unbook(ctx: StepContext, result: dict, room: str) -> None:
    print("unbooked", result["room"], flush=True)

orch = Orchestrator()
"""


def test_the_saga_command_shows_and_compensates_a_session(url: str, tmp_path: Path) -> None:
    """`saga show` lists a session's calls in order; `saga compensate --app` with a module
    that defines the durable steps (and registers no saga) undoes them."""
    (tmp_path / "trip_app.py").write_text(TRIP_APP, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "SAGA_DATABASE_URL": url}
    script = (
        "import trip_app\n"
        "with trip_app.orch.session('trip-cli') as run:\n"
        "    trip_app.book('r-1')\n"
        "    trip_app.book('r-2')\n"
        "print(run.id)\n"
    )
    made = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    assert made.returncode == 0, made.stderr
    session_id = made.stdout.strip()

    def saga(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "saga", *args],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )

    shown = saga("show", session_id)
    assert shown.returncode == 0, shown.stderr
    calls = [line.split()[0] for line in shown.stdout.splitlines() if line.startswith("book_room.")]
    assert len(calls) == 2 and calls[0] != calls[1]
    undone = saga("compensate", "--app", "trip_app", session_id)
    assert undone.returncode == 0, undone.stderr
    assert [line for line in undone.stdout.splitlines() if line.startswith("unbooked")] == [
        "unbooked r-2",
        "unbooked r-1",
    ]
    assert "status   closed (compensated)" in saga("show", session_id).stdout


# ----- SIGKILL at each fault point of a durable step ----------------------------------------

# What resuming a session killed at each point of a non-idempotent call without a reconcile
# hook ends as: run (never recorded), parked (recorded running: it may have happened, though
# it did not yet), parked (it happened; its outcome was not recorded), replayed.
CHARGE_AFTER_KILL = {
    "before_record": ("completed", 1),
    "before_call": ("parked", 0),
    "after_call": ("parked", 1),
    "after_record": ("completed", 1),
}


@pytest.mark.parametrize("point", list(CHARGE_AFTER_KILL))
@pytest.mark.parametrize(
    ("mode", "kind"), [("email", "email"), ("ship", "ship"), ("charge", "charge")]
)
def test_a_session_killed_at_each_fault_point_resumes_without_a_second_effect(
    url: str, point: str, mode: str, kind: str
) -> None:
    run_id = f"fault-{uuid.uuid4()}"
    child = Child(url, mode, run_id, SAGA_FAULT=f"{point}:action")
    child.expect("READY")
    assert child.proc.wait(timeout=60) == -signal.SIGKILL, "".join(child.output)
    child._close()
    outcome = "completed"
    with _orch(url) as orch:
        try:
            with orch.session(run_id, wait_seconds=10):
                if mode == "email":
                    session_app.send_email("ops@acme.com", "Refund approved")
                    session_app.send_email("ops@acme.com", "Refund approved")
                elif mode == "ship":
                    session_app.ship("o-1")
                else:
                    session_app.charge("o-1", 100)
        except SessionParked:
            outcome = "parked"
    if mode == "charge":
        assert (outcome, _effects(url, kind)) == CHARGE_AFTER_KILL[point]
    else:
        # An idempotent call is retried under its key, a reconciled one asked: once.
        assert (outcome, _effects(url, kind)) == ("completed", 1)


def test_the_heartbeat_keeps_a_session_held_while_its_code_works_between_calls(
    url: str,
) -> None:
    """Code that works longer than the lease between two calls still holds the session:
    the heartbeat renews it, so nobody else takes it over and the next call runs."""
    with Orchestrator(url, lease_seconds=2.0) as orch, orch.session(f"slow-{uuid.uuid4()}") as run:
        session_app.URL = url
        session_app.send_email("ops@acme.com", "first")
        time.sleep(5.0)  # thinking, well past the 2 s lease
        state = orch.get(run.id)
        assert state.lease_owner == orch.owner
        assert state.lease_expires_at is not None
        assert state.lease_expires_at > datetime.now(UTC)  # renewed, not run out
        session_app.charge("o-9", 100)
        assert run.executed == 2
