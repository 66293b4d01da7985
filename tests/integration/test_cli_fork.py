"""`saga fork ID --from STEP`: a parked saga continued as a new saga from one of its steps,
from the command line, with a sync and an async app; a session, from one of its calls."""

from __future__ import annotations

import json
import os
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import cli_app
import pytest
import session_fork_app
from cli_app import Job
from support import OrchestratorFactory
from test_cli import _one_line_error, _park_unknown, _rows, saga_cmd

from saga import Orchestrator, SagaState, SessionParked

# The order session's app: durable steps, and an Orchestrator for `--app`.
APP = "session_fork_app"


def _park_at_notify(orch: Orchestrator, order_id: str) -> str:
    """A shop saga parked at `notify`, after reserve, charge and ship succeeded."""
    saga_id = orch.start(cli_app.shop, Job(order_id=order_id, plan="broken_notify")).id
    state = orch.run(saga_id)
    assert state.status == "needs_review"
    assert [op.status for op in state.operations if op.kind == "action"] == [
        "succeeded",
        "succeeded",
        "succeeded",
        "failed",
    ]
    return saga_id


def _fork(database_url: str, *args: str, app: str = "cli_app") -> list[str]:
    """The arguments of `saga fork` on the test database with `app`, then `args`."""
    return ["fork", "--app", app, "--database-url", database_url, *args]


def _header(out: str) -> dict[str, str]:
    """The `key  value` lines of `saga show` before its OPERATIONS table."""
    head = out.split("\nOPERATIONS", 1)[0]
    rows = {}
    for line in head.splitlines():
        key, _, value = line.partition("  ")
        rows[key.strip()] = value.strip()
    return rows


def test_fork_continues_a_parked_saga_as_a_new_one(
    make_orch: OrchestratorFactory, database_url: str, app_dir: Path
) -> None:
    """A saga parked at `notify` is forked from `notify` (its id given as a prefix): the
    command prints the new saga's id and says it is pending; the new saga inherits the
    results of reserve, charge and ship without calling them, and completes when run;
    `show` prints each side's link to the other and `list --status forked` finds the
    source."""
    orch = make_orch(*cli_app.SAGAS)
    source = _park_at_notify(orch, "o-f")
    calls_before = cli_app.calls()

    forked = saga_cmd(
        *_fork(database_url, source[:8], "--from", "notify", "--actor", "alice"),
        app_dir=app_dir,
    )
    assert forked.returncode == 0, forked.stdout + forked.stderr
    first, second = forked.stdout.strip().splitlines()
    fork_id = str(uuid.UUID(first))
    assert second == (
        f"saga {fork_id} was forked from {source} at step 'notify', by alice: "
        "it is pending, a worker will drive it"
    )
    assert cli_app.calls() == calls_before  # forking calls no step

    state = orch.get(fork_id)
    assert (state.status, state.key, state.forked_from) == ("pending", "o-f:fork:notify", source)
    assert [(op.step, op.status) for op in state.operations if op.kind == "action"] == [
        ("reserve", "succeeded"),
        ("charge", "succeeded"),
        ("ship", "succeeded"),
        ("notify", "pending"),
    ]
    assert state.operation("charge").result == {"charge_id": "ch_o-f"}
    old = orch.get(source)
    assert (old.status, old.forked_to) == ("forked", fork_id)
    event = next(e for e in orch.history(source) if e.event == "saga_forked")
    assert event.detail["actor"] == "alice"

    (app_dir / "fixed").touch()
    assert orch.run(fork_id).status == "completed"
    assert cli_app.calls()[len(calls_before) :] == [("notify", "o-f", os.getpid())]

    shown_source = saga_cmd("show", "--database-url", database_url, source)
    assert shown_source.returncode == 0, shown_source.stderr
    head = _header(shown_source.stdout)
    assert head["status"] == "forked"
    assert head["forked to"] == fork_id
    assert "forked from" not in head

    shown_fork = saga_cmd("show", "--database-url", database_url, fork_id[:8])
    assert shown_fork.returncode == 0, shown_fork.stderr
    head = _header(shown_fork.stdout)
    assert head["status"] == "completed"
    assert head["forked from"] == source
    assert "forked to" not in head
    assert "saga_forked_from" in shown_fork.stdout

    as_json = saga_cmd("show", "--database-url", database_url, fork_id, "--json")
    assert as_json.returncode == 0, as_json.stderr
    data = json.loads(as_json.stdout)
    assert (data["forked_from"], data["forked_to"]) == (source, None)
    data = json.loads(saga_cmd("show", "--database-url", database_url, source, "--json").stdout)
    assert (data["forked_from"], data["forked_to"]) == (None, fork_id)

    listed = saga_cmd("list", "--database-url", database_url, "--status", "forked", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [(r["id"], r["status"], r["forked_to"]) for r in rows] == [(source, "forked", fork_id)]
    table = saga_cmd("list", "--database-url", database_url, "--status", "forked")
    assert table.returncode == 0, table.stderr
    _, *lines = table.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(source), table.stdout
    assert lines[0].split()[5] == "forked"  # ID, SAGA (shop v1), TENANT, KEY, STATUS


def test_asking_for_the_same_fork_again_changes_nothing(
    make_orch: OrchestratorFactory, database_url: str, app_dir: Path
) -> None:
    """The same fork asked for again prints the same id and says it already existed, in
    text and in JSON (`created` false); nothing is written. The verbs on the source then
    point to the fork."""
    orch = make_orch(*cli_app.SAGAS)
    source = _park_at_notify(orch, "o-a")
    first = saga_cmd(*_fork(database_url, source, "--from", "notify"), app_dir=app_dir)
    assert first.returncode == 0, first.stdout + first.stderr
    fork_id = first.stdout.splitlines()[0]
    before = _rows(database_url)

    again = saga_cmd(*_fork(database_url, source, "--from", "notify"), app_dir=app_dir)
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.splitlines() == [
        fork_id,
        f"saga {source} was already forked to {fork_id} at step 'notify' "
        "(key o-a:fork:notify); nothing changed, the fork is pending",
    ]
    as_json = saga_cmd(*_fork(database_url, source, "--from", "notify", "--json"), app_dir=app_dir)
    assert as_json.returncode == 0, as_json.stdout + as_json.stderr
    assert json.loads(as_json.stdout) == {
        "id": fork_id,
        "key": "o-a:fork:notify",
        "created": False,
        "forked_from": source,
        "from_step": "notify",
    }
    assert _rows(database_url) == before

    retried = saga_cmd(
        "retry", "--app", "cli_app", "--database-url", database_url, source, app_dir=app_dir
    )
    assert retried.returncode == 1
    line = _one_line_error(retried)
    assert line.startswith(f"saga: refused: saga {source} was forked to {fork_id}"), line
    assert line.endswith(f"retry saga {fork_id} instead"), line
    assert _rows(database_url) == before


def test_fork_json_with_a_key(
    make_orch: OrchestratorFactory, database_url: str, app_dir: Path
) -> None:
    """`--json` prints one JSON object about the new saga; `--key` names its key."""
    orch = make_orch(*cli_app.SAGAS)
    source = _park_at_notify(orch, "o-j")

    result = saga_cmd(
        *_fork(database_url, source, "--from", "notify", "--key", "o-j-again", "--json"),
        app_dir=app_dir,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(result.stdout.splitlines()) == 1
    data = json.loads(result.stdout)
    assert data == {
        "id": data["id"],
        "key": "o-j-again",
        "created": True,
        "forked_from": source,
        "from_step": "notify",
    }
    state = orch.get(data["id"])
    assert (state.status, state.key, state.forked_from) == ("pending", "o-j-again", source)


@pytest.mark.parametrize(
    ("plan", "step", "error"),  # error: how the one line starts
    [
        (
            "broken_notify",
            "ship",
            "saga: refused: step 'ship' succeeded:",
        ),
        (
            "broken_notify",
            "deliver",
            "saga: refused: saga 'shop' has no step 'deliver'; its steps: reserve, charge, "
            "ship, notify",
        ),
        (
            "unknown",
            "notify",
            "saga: refused: step 'charge' before 'notify' has an unknown outcome:",
        ),
    ],
    ids=["step-succeeded", "no-such-step", "unknown-before"],
)
def test_a_refused_fork_changes_nothing(
    make_orch: OrchestratorFactory,
    database_url: str,
    app_dir: Path,
    plan: str,
    step: str,
    error: str,
) -> None:
    """A fork the library refuses exits 1 with one line on stderr, prints nothing on
    stdout, and writes nothing: the saga stays parked."""
    orch = make_orch(*cli_app.SAGAS)
    park = _park_unknown if plan == "unknown" else _park_at_notify
    source = park(orch, "o-r")
    before = _rows(database_url)

    refused = saga_cmd(*_fork(database_url, source, "--from", step), app_dir=app_dir)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert _one_line_error(refused).startswith(error), refused.stderr
    assert refused.stdout == ""
    assert _rows(database_url) == before
    state = orch.get(source)
    assert (state.status, state.forked_to) == ("needs_review", None)


def test_a_completed_saga_is_not_forked(
    make_orch: OrchestratorFactory, database_url: str, app_dir: Path
) -> None:
    """A completed saga whose step from the fork point on took an effect: refused,
    naming the step, nothing written."""
    orch = make_orch(*cli_app.SAGAS)
    done = orch.execute(cli_app.shop, Job(order_id="o-c")).id
    before = _rows(database_url)
    refused = saga_cmd(*_fork(database_url, done, "--from", "notify"), app_dir=app_dir)
    assert refused.returncode == 1
    line = _one_line_error(refused)
    assert line.startswith("saga: refused: step 'notify' succeeded: a fork from 'notify'"), line
    assert _rows(database_url) == before


@pytest.mark.parametrize(
    "args",
    [
        ["fork", "--app", "cli_app", "00000000-0000-0000-0000-000000000000"],
        ["fork", "--app", "cli_app", "--from", "notify"],
        ["fork", "00000000-0000-0000-0000-000000000000", "--from", "notify"],
        [
            "fork",
            "--app",
            "cli_app",
            "00000000-0000-0000-0000-000000000000",
            "--from",
            "notify",
            "--actor",
            " ",
        ],
    ],
    ids=["no-from", "no-id", "no-app", "blank-actor"],
)
def test_fork_usage_errors_exit_2(args: list[str], app_dir: Path) -> None:
    """A missing --from or ID, no --app, a blank actor: exit 2 with one line on stderr."""
    result = saga_cmd(*args, app_dir=app_dir)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.count("\n") <= 2, result.stderr
    assert "Traceback" not in result.stderr


def test_fork_of_an_unknown_saga_exits_1(database_url: str, app_dir: Path) -> None:
    """No such saga: exit 1, one line."""
    missing = "00000000-0000-0000-0000-000000000000"
    result = saga_cmd(*_fork(database_url, missing, "--from", "notify"), app_dir=app_dir)
    assert result.returncode == 1
    assert _one_line_error(result) == f"saga: no saga with id '{missing}'"


def test_fork_with_an_async_app(
    make_orch: OrchestratorFactory, database_url: str, app_dir: Path
) -> None:
    """With an AsyncOrchestrator app the command forks the same way."""
    orch = make_orch(*cli_app.SAGAS)
    source = _park_at_notify(orch, "o-async")

    forked = saga_cmd(
        *_fork(database_url, source, "--from", "notify", app="cli_app_async:orch"),
        app_dir=app_dir,
    )
    assert forked.returncode == 0, forked.stdout + forked.stderr
    fork_id = forked.stdout.splitlines()[0]
    assert f"was forked from {source} at step 'notify'" in forked.stdout
    assert orch.get(source).forked_to == fork_id

    refused = saga_cmd(
        *_fork(database_url, source, "--from", "ship", app="cli_app_async:orch"),
        app_dir=app_dir,
    )
    assert refused.returncode == 1
    assert _one_line_error(refused).startswith(f"saga: refused: saga {source} was already forked")

    (app_dir / "fixed").touch()
    assert orch.run(fork_id).status == "completed"


# ----- sessions ---------------------------------------------------------------------------


def _parked_session(orch: Orchestrator, order: str, amounts: tuple[int, ...] = (4990,)) -> str:
    """The id of an order session (`session_fork_app`) whose ship call lost its outcome,
    which an operator then settled as failed: it is runnable, and nobody holds it."""
    run_id = f"order-{order}"
    with pytest.raises(SessionParked):
        session_fork_app.place_order(orch, run_id, order, amounts)
    (state,) = [s for s in orch.list() if s.key == run_id]
    ship = next(op.step for op in state.operations if op.step.startswith("fork_ship."))
    orch.resolve(state.id, ship, outcome="failed", actor="ops")
    return state.id


def _calls(state: SagaState) -> list[tuple[str, str]]:
    return [(op.step.split(".")[0], op.status) for op in state.operations]


@pytest.fixture
def order_app() -> Iterator[None]:
    """The session app's call log, empty, and its ship step losing its outcome."""
    session_fork_app.CALLS.clear()
    session_fork_app.PLAN["ship"] = "unknown"
    yield
    session_fork_app.CALLS.clear()


def test_fork_continues_a_session_from_one_of_its_calls(
    make_orch: OrchestratorFactory, database_url: str, order_app: None
) -> None:
    """A session is forked from a call named by its durable step (its id given as a
    prefix): the command prints the fork's id and the run id to run the code under; the
    fork holds the calls before that one, `show` links both sides, and the code run again
    under the fork's run id replays them and makes the rest. Asked again, the same fork."""
    orch = make_orch()
    source = _parked_session(orch, "o-s")
    ship = next(op.step for op in orch.get(source).operations if op.step.startswith("fork_ship."))
    session_fork_app.CALLS.clear()

    forked = saga_cmd(
        *_fork(database_url, source[:8], "--from", "fork_ship", "--actor", "alice", app=APP)
    )
    assert forked.returncode == 0, forked.stdout + forked.stderr
    first, second = forked.stdout.strip().splitlines()
    fork_id = str(uuid.UUID(first))
    fork_key = f"order-o-s:fork:{ship}"
    assert second == (
        f"session {fork_id} was forked from {source} at call 'fork_ship', by alice: it is "
        f"pending; run the session's code with run id {fork_key!r} to continue it"
    )
    state = orch.get(fork_id)
    assert (state.saga, state.tenant_id, state.key) == ("session/orders", "acme", fork_key)
    assert (state.status, state.forked_from) == ("pending", source)
    assert _calls(state) == [("fork_reserve", "succeeded"), ("fork_charge", "succeeded")]
    assert (orch.get(source).status, orch.get(source).forked_to) == ("forked", fork_id)

    shown = saga_cmd("show", "--database-url", database_url, source)
    assert shown.returncode == 0, shown.stderr
    head = _header(shown.stdout)
    assert (head["status"], head["forked to"]) == ("closed (forked)", fork_id)
    shown = saga_cmd("show", "--database-url", database_url, fork_id)
    assert shown.returncode == 0, shown.stderr
    assert _header(shown.stdout)["forked from"] == source

    session_fork_app.PLAN["ship"] = "ok"
    assert session_fork_app.place_order(orch, fork_key, "o-s") == (1, 2)
    assert session_fork_app.CALLS == ["ship o-s"]  # reserve and charge were not called again
    assert orch.get(fork_id).status == "completed"

    before = _rows(database_url)
    again = saga_cmd(*_fork(database_url, source, "--from", ship, "--json", app=APP))
    assert again.returncode == 0, again.stdout + again.stderr
    assert json.loads(again.stdout) == {
        "id": fork_id,
        "key": fork_key,
        "created": False,
        "forked_from": source,
        "from_step": ship,
    }
    assert _rows(database_url) == before


@pytest.mark.parametrize(
    ("case", "step", "error"),  # error: a regex of the one line
    [
        (
            "succeeded",
            "fork_charge",
            r"saga: refused: call 'fork_charge\.[0-9a-f]{12}' succeeded: a fork from "
            r"'fork_charge\.[0-9a-f]{12}' would run it again under a new key",
        ),
        (
            "ambiguous",
            "fork_charge",
            r"saga: refused: session \S+ called durable step 'fork_charge' 2 times "
            r"\(fork_charge\.[0-9a-f]{12}, fork_charge\.[0-9a-f]{12}\)",
        ),
        (
            "no_such_call",
            "fork_pack",
            r"saga: refused: session \S+ has no call 'fork_pack'; its calls: fork_reserve\.",
        ),
    ],
)
def test_a_refused_session_fork_changes_nothing(
    make_orch: OrchestratorFactory,
    database_url: str,
    order_app: None,
    case: str,
    step: str,
    error: str,
) -> None:
    """A session fork the library refuses exits 1 with one line, and writes nothing."""
    orch = make_orch()
    source = _parked_session(orch, "o-r", (20_000, 4990) if case == "ambiguous" else (4990,))
    before = _rows(database_url)
    refused = saga_cmd(*_fork(database_url, source, "--from", step, app=APP))
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert re.match(error, _one_line_error(refused)), refused.stderr
    assert refused.stdout == ""
    assert _rows(database_url) == before
