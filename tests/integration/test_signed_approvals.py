"""Signed approvals against a real PostgreSQL: a process with full database access cannot
approve a step, a real approval releases it exactly once.

Workers hold only the approvers' Ed25519 public key. The approval `confirm()` is given is
stored with the confirmation, and the worker verifies it before every attempt the
confirmation releases; a confirmation row written by hand (by step code, an agent with a
SQL tool, anything holding the database credentials) releases nothing, whatever columns
it forges: the saga stays awaiting confirmation, and the audit trail says why.
"""

from __future__ import annotations

import asyncio
import base64
import json
import stat
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cli_app
import psycopg
import pytest
from cli_app import Job
from support import FAST, Order, order_saga
from test_cli import saga_cmd

from saga import (
    ApprovalRejected,
    AsyncOrchestrator,
    Orchestrator,
    Saga,
    SagaState,
    StepContext,
    TransientError,
)
from saga.approvals import ApprovalSigner, sign
from saga.state import Confirmation

ACTOR = "lead@example"


@pytest.fixture(scope="module")
def approvers() -> ApprovalSigner:
    """The approvers' key pair: the private key stays here, workers get `public_key`."""
    return ApprovalSigner.generate()


def _refund_saga(name: str, effects: list[int]) -> Saga[Order]:
    """A refund that always needs confirming; `effects` counts the refunds made."""
    saga = order_saga(name)

    @saga.step(confirm=True, retry=FAST)
    def refund(ctx: StepContext, order: Order) -> dict[str, Any]:
        effects.append(ctx.attempt)
        if order.amount_cents == 13 and ctx.attempt == 1:
            raise TransientError("the gateway is busy")
        return {"refunded_cents": order.amount_cents}

    return saga


def _pending(orch: Orchestrator, saga_id: str) -> Confirmation:
    pending = orch.preview(saga_id)
    assert pending is not None, f"saga {saga_id} waits for no confirmation"
    return pending


def _forge(url: str, saga_id: str, approval: str | None) -> None:
    """What a process holding the database credentials can do, with one connection of
    its own: mark the pending confirmation approved (by whom it likes, with whatever
    token it likes) and make the saga runnable, as `confirm()` would have."""
    with psycopg.connect(url, autocommit=True) as conn, conn.transaction():
        updated = conn.execute(
            "UPDATE saga.confirmations SET approved_by = 'agent', approved_at = now(), "
            "approval = %s WHERE saga_id = %s AND approved_at IS NULL",
            (approval, saga_id),
        ).rowcount
        assert updated == 1
        conn.execute(
            "UPDATE saga.sagas SET status = 'running', error = NULL, run_after = now() "
            "WHERE id = %s",
            (saga_id,),
        )


def _altered(token: str, **changed: Any) -> str:
    """A genuine signed approval with its claims changed and its signature kept."""
    prefix, body, signature = token.split(".")
    claims = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    claims.update(changed)
    raw = json.dumps(claims, sort_keys=True, separators=(",", ":")).encode()
    return f"{prefix}.{base64.urlsafe_b64encode(raw).rstrip(b'=').decode()}.{signature}"


def _refusals(orch: Orchestrator, saga_id: str) -> list[dict[str, Any]]:
    return [e.detail for e in orch.history(saga_id) if e.event == "approval_refused"]


def _stored_approval(url: str, saga_id: str, request_hash: str) -> str | None:
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT approval FROM saga.confirmations WHERE saga_id = %s AND request_hash = %s",
            (saga_id, request_hash),
        ).fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


# What the forger writes into the approval column, given the approvers' signer, the saga
# and the request hash it waits for.
Forgery = Callable[[ApprovalSigner, str, str], str | None]

FORGERIES: dict[str, tuple[Forgery, str]] = {
    "approved_at alone, no approval": (lambda s, saga, h: None, "missing"),
    "signed with another key": (
        lambda s, saga, h: ApprovalSigner.generate().approval(saga, "refund", h, actor=ACTOR),
        "not trusted here",
    ),
    "another key posing as the approvers'": (
        lambda s, saga, h: _altered(
            ApprovalSigner.generate().approval(saga, "refund", h, actor=ACTOR), key=s.key_id
        ),
        "does not verify",
    ),
    "a real approval of another request hash": (
        lambda s, saga, h: s.approval(saga, "refund", "0" * 64, actor=ACTOR),
        "request_hash",
    ),
    "a real approval of another saga": (
        lambda s, saga, h: s.approval(str(uuid.uuid4()), "refund", h, actor=ACTOR),
        "saga_id",
    ),
    "a real approval, altered": (
        lambda s, saga, h: _altered(s.approval(saga, "refund", h, actor="intern"), actor=ACTOR),
        "does not verify",
    ),
    "a real approval, expired": (
        lambda s, saga, h: s.approval(saga, "refund", h, actor=ACTOR, ttl_seconds=60, now=0.0),
        "expired",
    ),
    "an HMAC token": (
        lambda s, saga, h: sign(
            b"hmac-key", saga_id=saga, step="refund", request_hash=h, actor=ACTOR, ttl_seconds=60
        ),
        "HMAC",
    ),
}


@pytest.mark.parametrize("forgery", list(FORGERIES))
def test_an_approval_written_by_hand_runs_nothing_and_a_real_one_runs_once(
    forgery: str, database_url: str, approvers: ApprovalSigner
) -> None:
    effects: list[int] = []
    saga = _refund_saga("signed_refund", effects)
    forge, refusal = FORGERIES[forgery]
    with Orchestrator(
        database_url, sagas=[saga], approval_public_key=approvers.public_key
    ) as worker:
        state = worker.execute(saga, Order(order_id="o-1", amount_cents=90_000))
        assert state.status == "awaiting_confirmation"
        pending = _pending(worker, state.id)

        _forge(database_url, state.id, forge(approvers, state.id, pending.request_hash))
        after = worker.run(state.id)
        assert effects == []
        assert after.status == "awaiting_confirmation", after.error
        assert after.error is not None and "the stored approval was refused" in after.error
        [refused] = _refusals(worker, state.id)
        assert refusal in refused["reason"], refused
        assert refused["claimed_by"] == "agent"
        assert refused["request_hash"] == pending.request_hash
        # Asked again: the forged approval is withdrawn, and the preview is the same.
        again = _pending(worker, state.id)
        assert again.request_hash == pending.request_hash and again.approved_at is None

        # The approvers' tooling holds the private key; it needs neither the saga's code
        # nor anything but the public key to confirm.
        token = approvers.approval(state.id, "refund", again.request_hash, actor=ACTOR)
        with Orchestrator(database_url, approval_public_key=approvers.public_key) as tooling:
            assert tooling.confirm(state.id, "refund", again.request_hash, token).status == (
                "running"
            )
        assert _stored_approval(database_url, state.id, again.request_hash) == token
        done = worker.run(state.id)
        assert done.status == "completed", done.error
        assert worker.run(state.id).status == "completed"
        assert effects == [1]
        [used] = [e for e in worker.history(state.id) if e.event == "approval_used"]
        assert used.detail == {
            "request_hash": again.request_hash,
            "approved_by": ACTOR,
            "signed": True,
        }


def test_a_used_approval_copied_onto_the_retrys_confirmation_runs_nothing(
    database_url: str, approvers: ApprovalSigner
) -> None:
    """One approval, one attempt, also against the database's writers: the first attempt
    fails transiently; the approval it used is genuine, but bound to attempt 1's preview,
    so copied onto attempt 2's confirmation it releases nothing."""
    effects: list[int] = []
    saga = _refund_saga("signed_retry", effects)
    with Orchestrator(
        database_url, sagas=[saga], approval_public_key=approvers.public_key
    ) as worker:
        state = worker.execute(saga, Order(order_id="o-1", amount_cents=13))
        first = _pending(worker, state.id)
        token = approvers.approval(state.id, "refund", first.request_hash, actor=ACTOR)
        worker.confirm(state.id, "refund", first.request_hash, token)
        assert worker.run(state.id).status == "awaiting_confirmation"
        assert effects == [1]
        second = _pending(worker, state.id)
        assert second.request_hash != first.request_hash

        _forge(database_url, state.id, token)
        assert worker.run(state.id).status == "awaiting_confirmation"
        assert effects == [1]
        [refused] = _refusals(worker, state.id)
        assert (
            f"the approval token is for request_hash {first.request_hash!r}" in (refused["reason"])
        )

        renewed = approvers.approval(state.id, "refund", second.request_hash, actor=ACTOR)
        worker.confirm(state.id, "refund", second.request_hash, renewed)
        assert worker.run(state.id).status == "completed"
        assert effects == [1, 2]


def test_a_worker_refuses_a_forged_approval_too(
    database_url: str, approvers: ApprovalSigner
) -> None:
    """The worker's claim plans the attempt with the same verification as `run`."""
    effects: list[int] = []
    saga = _refund_saga("signed_worker", effects)
    with Orchestrator(database_url, sagas=[saga], approval_public_key=approvers.public_key) as orch:
        saga_id = orch.start(saga, Order(order_id="o-1", amount_cents=90_000)).id
        orch.worker(concurrency=1).run(until_idle=True)
        pending = _pending(orch, saga_id)
        _forge(database_url, saga_id, None)
        orch.worker(concurrency=1).run(until_idle=True)
        assert orch.get(saga_id).status == "awaiting_confirmation"
        assert effects == [] and len(_refusals(orch, saga_id)) == 1

        token = approvers.approval(saga_id, "refund", pending.request_hash, actor=ACTOR)
        orch.confirm(saga_id, "refund", pending.request_hash, token)
        orch.worker(concurrency=1).run(until_idle=True)
        assert orch.get(saga_id).status == "completed"
        assert effects == [1]


def test_the_async_door_verifies_the_same_way(database_url: str, approvers: ApprovalSigner) -> None:
    effects: list[int] = []
    saga = _refund_saga("signed_async", effects)

    async def main() -> tuple[SagaState, SagaState, SagaState]:
        async with AsyncOrchestrator(
            database_url, sagas=[saga], approval_public_key=approvers.public_key
        ) as orch:
            state = await orch.execute(saga, Order(order_id="o-1", amount_cents=90_000))
            pending = await orch.preview(state.id)
            assert pending is not None
            await asyncio.to_thread(
                _forge,
                database_url,
                state.id,
                ApprovalSigner.generate().approval(
                    state.id, "refund", pending.request_hash, actor=ACTOR
                ),
            )
            forged = await orch.run(state.id)
            token = approvers.approval(state.id, "refund", pending.request_hash, actor=ACTOR)
            with pytest.raises(ApprovalRejected):
                await orch.confirm(state.id, "refund", pending.request_hash, token[:-4] + "AAAA")
            confirmed = await orch.confirm(state.id, "refund", pending.request_hash, token)
            return forged, confirmed, await orch.run(state.id)

    forged, confirmed, done = asyncio.run(main())
    assert forged.status == "awaiting_confirmation"
    assert confirmed.status == "running"
    assert done.status == "completed", done.error
    assert effects == [1]


def test_confirm_refuses_what_workers_would_refuse_and_writes_nothing(
    database_url: str, approvers: ApprovalSigner
) -> None:
    """An orchestrator with the public key takes only approvals its workers will accept;
    a refused one changes nothing."""
    effects: list[int] = []
    saga = _refund_saga("signed_confirm", effects)
    with Orchestrator(
        database_url,
        sagas=[saga],
        approval_public_key=approvers.public_key,
        confirmation_key="hmac-key",
    ) as orch:
        state = orch.execute(saga, Order(order_id="o-1", amount_cents=90_000))
        digest = _pending(orch, state.id).request_hash
        hmac_token = sign(
            b"hmac-key",
            saga_id=state.id,
            step="refund",
            request_hash=digest,
            actor=ACTOR,
            ttl_seconds=60,
        )
        for token, refusal in (
            (hmac_token, "HMAC"),
            (ApprovalSigner.generate().approval(state.id, "refund", digest, actor=ACTOR), "key"),
            (approvers.approval(state.id, "refund", "0" * 64, actor=ACTOR), "request_hash"),
        ):
            with pytest.raises(ApprovalRejected, match=refusal):
                orch.confirm(state.id, "refund", digest, token)
        assert orch.get(state.id).status == "awaiting_confirmation"
        assert _pending(orch, state.id).approved_at is None
        assert _stored_approval(database_url, state.id, digest) is None
        assert effects == []


def test_a_rotation_accepts_approvals_of_either_key(
    database_url: str, approvers: ApprovalSigner
) -> None:
    effects: list[int] = []
    saga = _refund_saga("signed_rotation", effects)
    new = ApprovalSigner.generate()
    with Orchestrator(
        database_url, sagas=[saga], approval_public_key=[approvers.public_key, new.public_key]
    ) as orch:
        for order_id, signer in (("o-old", approvers), ("o-new", new)):
            state = orch.execute(saga, Order(order_id=order_id, amount_cents=90_000))
            digest = _pending(orch, state.id).request_hash
            orch.confirm(
                state.id, "refund", digest, signer.approval(state.id, "refund", digest, actor=ACTOR)
            )
            assert orch.run(state.id).status == "completed"
    assert effects == [1, 1]


def test_hmac_mode_trusts_the_confirmation_row_as_before(database_url: str) -> None:
    """The weaker mode, documented as such: without a public key, `confirm()` checks the
    HMAC token once and the worker trusts the approved row, so a process that can write
    that row can approve. This pins the difference signed approvals make."""
    effects: list[int] = []
    saga = _refund_saga("hmac_weaker", effects)
    with Orchestrator(database_url, sagas=[saga], confirmation_key="hmac-key") as orch:
        state = orch.execute(saga, Order(order_id="o-1", amount_cents=90_000))
        _forge(database_url, state.id, None)
        assert orch.run(state.id).status == "completed"
    assert effects == [1]


# ----- the command line --------------------------------------------------------------------


def test_keygen_then_confirm_with_the_private_key(
    database_url: str, app_dir: Path, tmp_path: Path
) -> None:
    """`saga keygen` writes the private key (owner-only) and prints the public key;
    `saga confirm --private-key` signs with it, and the app, given only the public key,
    runs the step once. Without the private key, the HMAC path is refused."""
    key_file = tmp_path / "approver.pem"
    made = saga_cmd("keygen", "--private-key", str(key_file))
    assert made.returncode == 0, made.stderr
    public_key = made.stdout.strip()
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert "PRIVATE KEY" in key_file.read_text() and "PRIVATE" not in made.stdout
    assert "SAGA_APPROVAL_PUBLIC_KEY" in made.stderr
    again = saga_cmd("keygen", "--private-key", str(key_file))
    assert again.returncode == 2 and "--overwrite" in again.stderr
    signer = ApprovalSigner.from_private_key(key_file)
    assert signer.public_key == public_key

    with Orchestrator(database_url, sagas=cli_app.SAGAS) as orch:
        saga_id = orch.execute(cli_app.refund_saga, Job(order_id="r-1", plan="large")).id
        digest = _pending(orch, saga_id).request_hash
    common = ("--database-url", database_url, "--app", "cli_app", "--actor", ACTOR)

    def confirm(*options: str) -> subprocess.CompletedProcess[str]:
        return saga_cmd(
            "confirm",
            *common,
            *options,
            saga_id,
            "pay_back",
            digest,
            app_dir=app_dir,
            SAGA_APPROVAL_PUBLIC_KEY=public_key,
            SAGA_CONFIRMATION_KEY="hmac-key",
        )

    hmac = confirm()
    assert hmac.returncode == 1 and "ApprovalSigner" in hmac.stderr, hmac.stderr
    bad_key = confirm("--private-key", str(tmp_path / "missing.pem"))
    assert bad_key.returncode == 2 and "missing.pem" in bad_key.stderr
    assert cli_app.calls() == []

    confirmed = confirm("--run", "--private-key", str(key_file))
    # pay_back runs; receipt would be the second operation: the saga's ceiling of 1 parks it.
    assert f"approved by {ACTOR}, signed with key {signer.key_id}" in confirmed.stdout
    assert "max_operations" in confirmed.stdout, confirmed.stderr
    assert [c[0] for c in cli_app.calls()] == ["pay_back"]
