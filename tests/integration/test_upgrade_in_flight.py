"""Upgrading sagas in flight (`orch.upgrade`), through both doors, on PostgreSQL.

A `signup` saga of version 1 has created the account and parked with its `mail` step's
outcome unknown; version 2 renames `account` to `create_account`, declares `mail`
idempotent and adds `trial` after it (upgrade_app). The upgrade moves the saga onto
version 2 in one transaction: the account is never created again, `mail` is retried by
version 2's code under the key the mail server saw, `trial` runs under a key of version 2.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import upgrade_app
from cli_app import Job, calls
from support import OrchestratorFactory, scalar
from test_cli import _rows
from upgrade_app import signup_v1, signup_v2

from saga import (
    AsyncOrchestrator,
    Orchestrator,
    Saga,
    StepContext,
    UpgradeRefused,
)

RENAME = {"account": "create_account"}


def stuck_signup(orch: Orchestrator, order_id: str) -> str:
    """A v1 signup whose account was created and that parked with mail unknown."""
    saga_id = orch.start(signup_v1, Job(order_id=order_id, plan="broken")).id
    state = orch.run(saga_id)
    assert state.status == "needs_review"
    assert [(op.step, op.status, op.attempts) for op in state.operations] == [
        ("account", "succeeded", 1),
        ("mail", "unknown", 1),
    ]
    return saga_id


def names(order_id: str) -> list[str]:
    return [name for name, order, _ in calls() if order == order_id]


def test_an_upgraded_saga_finishes_under_v2_without_repeating_a_step(
    make_orch: OrchestratorFactory, app_dir: Path
) -> None:
    """The upgrade keeps the account's and mail's rows and keys as stored (renamed where
    the step was), creates `trial` under a v2 key, records who did it, and a worker then
    finishes the saga with v2's code: the account is not created again, mail is retried
    under its v1 key."""
    orch = make_orch(signup_v1, signup_v2)
    saga_id = stuck_signup(orch, "u-1")

    state = orch.upgrade(saga_id, 2, step_map=RENAME, actor="alice")

    assert (state.version, state.status, state.lease_owner) == (2, "needs_review", None)
    assert [(op.step, op.status, op.attempts, op.idempotency_key) for op in state.operations] == [
        ("create_account", "succeeded", 1, "signup:v1:acme:u-1:account"),
        ("mail", "unknown", 1, "signup:v1:acme:u-1:mail"),
        ("trial", "pending", 0, "signup:v2:acme:u-1:trial"),
    ]
    event = orch.history(saga_id)[-1]
    assert event.event == "saga_upgraded"
    assert event.detail["actor"] == "alice"
    assert (event.detail["from_version"], event.detail["to_version"]) == (1, 2)
    assert event.detail["renamed_steps"] == RENAME

    orch.retry(saga_id, actor="alice")  # v2's mail is idempotent: retried, not refused
    orch.worker().run(until_idle=True)

    done = orch.get(saga_id)
    assert done.status == "completed"
    assert names("u-1") == [
        "v1:account",
        "v1:mail",
        "v2:mail:signup:v1:acme:u-1:mail",
        "v2:trial",
    ]


def test_a_refused_upgrade_writes_nothing(
    make_orch: OrchestratorFactory, database_url: str, app_dir: Path
) -> None:
    """Without the map, the account that was created has no step in v2: refused with
    that reason, and not one row changes; the plan says the same without writing."""
    orch = make_orch(signup_v1, signup_v2)
    saga_id = stuck_signup(orch, "u-2")
    before = _rows(database_url)

    with pytest.raises(UpgradeRefused) as refused:
        orch.upgrade(saga_id, 2, actor="alice")

    assert refused.value.plan.reasons == (
        "step 'account' succeeded and version 2 has no step 'account': map it onto the "
        "step that carries its effect (step_map account=NEW)",
    )
    assert _rows(database_url) == before
    assert orch.upgrade_plan(saga_id, 2) == refused.value.plan
    allowed = orch.upgrade_plan(saga_id, 2, step_map=RENAME)
    assert allowed.allowed
    assert [(m.move, m.step, m.to) for m in allowed.moves] == [
        ("kept", "account", "create_account"),
        ("kept", "mail", "mail"),
        ("added", None, "trial"),
    ]
    assert _rows(database_url) == before


def test_a_live_lease_is_refused_naming_its_holder(
    make_orch: OrchestratorFactory, database_url: str, app_dir: Path
) -> None:
    """A saga a worker holds is never taken over: refused, naming the holder."""
    orch = make_orch(signup_v1, signup_v2)
    saga_id = stuck_signup(orch, "u-3")
    scalar(
        database_url,
        "UPDATE saga.sagas SET lease_owner = 'worker-7', lease_expires_at = now() + "
        "interval '1 minute' WHERE id = %s RETURNING 1",
        (saga_id,),
    )
    before = _rows(database_url)
    with pytest.raises(UpgradeRefused, match="worker-7 holds its lease"):
        orch.upgrade(saga_id, 2, step_map=RENAME, actor="alice")
    assert _rows(database_url) == before


def test_an_expired_lease_is_fenced_off(
    make_orch: OrchestratorFactory, database_url: str, app_dir: Path
) -> None:
    """The holder of an expired lease cannot write after the upgrade: the fence grew."""
    orch = make_orch(signup_v1, signup_v2)
    saga_id = stuck_signup(orch, "u-4")
    fence = scalar(
        database_url,
        "UPDATE saga.sagas SET lease_owner = 'worker-8', lease_expires_at = now() - "
        "interval '1 second' WHERE id = %s RETURNING fence",
        (saga_id,),
    )
    state = orch.upgrade(saga_id, 2, step_map=RENAME, actor="alice")
    assert state.lease_owner is None
    assert scalar(database_url, "SELECT fence FROM saga.sagas WHERE id = %s", (saga_id,)) == (
        fence + 1
    )


def _three(version: int, compensated: bool) -> Saga[Job]:
    saga = Saga("pay", version=version, input=Job, key=lambda j: j.order_id)

    @saga.step
    def charge(ctx: StepContext, job: Job) -> dict[str, str]:
        return {"charged": job.order_id}

    if compensated:

        @charge.compensation
        def refund(ctx: StepContext, job: Job, result: object) -> None:
            return None

    @saga.step
    def ship(ctx: StepContext, job: Job) -> Any:
        return {"not", "json"}  # the outcome is lost: the saga parks

    return saga


def test_a_step_that_took_effect_keeps_its_compensation_contract(
    make_orch: OrchestratorFactory, database_url: str
) -> None:
    """A charge that succeeded with a refund cannot move onto a v2 `charge` without one,
    nor can a step of v2 be placed before it (it would run out of order)."""
    v1 = _three(1, compensated=True)
    v2 = _three(2, compensated=False)
    v3 = Saga("pay", version=3, input=Job, key=lambda j: j.order_id)
    v3.step(name="check")(lambda ctx, job: None)
    v3.step(name="charge")(lambda ctx, job: None).compensation(lambda ctx, job, r: None)
    v3.step(name="ship")(lambda ctx, job: None)
    orch = make_orch(v1, v2, v3)
    saga_id = orch.start(v1, Job(order_id="p-1")).id
    assert orch.run(saga_id).operation("charge").status == "succeeded"
    before = _rows(database_url)

    with pytest.raises(UpgradeRefused, match="it could no longer be undone"):
        orch.upgrade(saga_id, 2, actor="alice")
    with pytest.raises(UpgradeRefused, match="'check' of version 3 comes before 'ship'"):
        orch.upgrade(saga_id, 3, actor="alice")
    assert _rows(database_url) == before


def test_the_async_door_upgrades_the_same_way(
    make_orch: OrchestratorFactory, database_url: str, app_dir: Path
) -> None:
    """AsyncOrchestrator.upgrade and upgrade_plan: the same rows, the same refusal."""
    saga_id = stuck_signup(make_orch(signup_v1, signup_v2), "u-5")
    before = _rows(database_url)

    async def main() -> None:
        async with AsyncOrchestrator(database_url, sagas=[signup_v1, signup_v2]) as orch:
            with pytest.raises(UpgradeRefused, match="has no step 'account'"):
                await orch.upgrade(saga_id, 2, actor="bob")
            assert _rows(database_url) == before
            assert (await orch.upgrade_plan(saga_id, 2, step_map=RENAME)).allowed
            state = await orch.upgrade(saga_id, 2, step_map=RENAME, actor="bob")
            assert state.version == 2
            assert [op.step for op in state.operations] == ["create_account", "mail", "trial"]
            history = await orch.history(saga_id)
            assert history[-1].event == "saga_upgraded" and history[-1].detail["actor"] == "bob"

    asyncio.run(main())
    assert upgrade_app.signup_v2.step_named("trial") is not None


def test_two_steps_may_swap_names(make_orch: OrchestratorFactory) -> None:
    """step_map swaps the names of two steps that succeeded: each row is kept under the
    other's name with its own key, and neither runs again."""
    ran: list[str] = []

    def step(version: int, name: str, **options: Any) -> Any:
        def fn(ctx: StepContext, job: Job) -> Any:
            ran.append(f"v{version}:{name}")
            return {"not", "json"} if (version, name) == (1, "c") else {"step": name}

        return fn

    v1 = Saga("swap", version=1, input=Job, key=lambda j: j.order_id)
    v2 = Saga("swap", version=2, input=Job, key=lambda j: j.order_id)
    for name in ("a", "b", "c"):
        v1.step(name=name)(step(1, name))
    v2.step(name="b")(step(2, "b"))
    v2.step(name="a")(step(2, "a"))
    v2.step(name="c", idempotent=True)(step(2, "c"))
    orch = make_orch(v1, v2)
    saga_id = orch.start(v1, Job(order_id="s-1")).id
    assert orch.run(saga_id).status == "needs_review"

    state = orch.upgrade(saga_id, 2, step_map={"a": "b", "b": "a"}, actor="alice")

    assert [(op.step, op.idempotency_key) for op in state.operations] == [
        ("b", "swap:v1::s-1:a"),
        ("a", "swap:v1::s-1:b"),
        ("c", "swap:v1::s-1:c"),
    ]
    orch.retry(saga_id, actor="alice")
    assert orch.run(saga_id).status == "completed"
    assert ran == ["v1:a", "v1:b", "v1:c", "v2:c"]


def test_a_saga_started_here_and_upgraded_runs_its_new_steps(
    make_orch: OrchestratorFactory, app_dir: Path
) -> None:
    """Nothing of a pending saga ran: every step is created again under v2 (its keys name
    v2), and `run` by the orchestrator that started it drives v2's steps, not the rows it
    started it with."""
    orch = make_orch(signup_v1, signup_v2)
    saga_id = orch.start(signup_v1, Job(order_id="u-6")).id

    state = orch.upgrade(saga_id, 2, step_map=RENAME, actor="alice")

    assert [(op.step, op.idempotency_key) for op in state.operations] == [
        ("create_account", "signup:v2:acme:u-6:create_account"),
        ("mail", "signup:v2:acme:u-6:mail"),
        ("trial", "signup:v2:acme:u-6:trial"),
    ]
    assert orch.run(saga_id).status == "completed"
    assert names("u-6") == ["v2:create_account", "v2:mail:signup:v2:acme:u-6:mail", "v2:trial"]
