"""Signed approvals (no database): Ed25519 tokens, the keys workers are configured with,
and the planner verifying the stored approval before the attempt it releases.

A confirmation row's `approved_at` and `approved_by` are columns anything with the
database credentials can write; with an approval verifier, the planner trusts only the
approval stored with the row, and only when it verifies for exactly the attempt about to
start.
"""

from __future__ import annotations

import base64
import json
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from pydantic import BaseModel

from saga import (
    ApprovalRejected,
    Orchestrator,
    RetryPolicy,
    Saga,
    StepContext,
    StepStateError,
)
from saga._core import confirmations
from saga._core import requests as interventions
from saga._core.planner import ConfirmationRow, Invoke, Planner, SagaRow, Stop, new_action_rows
from saga.approvals import (
    ENV_APPROVAL_PUBLIC_KEY,
    ApprovalSigner,
    ApprovalVerifier,
    is_signed,
    sign,
)
from saga.state import SagaStatus

SAGA_ID = "saga-1"
HASH = "a" * 64
NOW = 1_700_000_000.0


@pytest.fixture(scope="module")
def signer() -> ApprovalSigner:
    return ApprovalSigner.generate()


def _verify(verifier: ApprovalVerifier, token: str | None, **bound: Any) -> Any:
    claims = {"saga_id": SAGA_ID, "step": "pay", "request_hash": HASH, "now": NOW, **bound}
    return verifier.verify(token, **claims)


def _token(signer: ApprovalSigner, **given: Any) -> str:
    claims: dict[str, Any] = {"actor": "lead@acme", "ttl_seconds": 600.0, "now": NOW, **given}
    return signer.approval(SAGA_ID, "pay", HASH, **claims)


def _with_claims(token: str, **changed: Any) -> str:
    """`token` with its claims changed and its signature kept: an altered approval."""
    prefix, body, signature = token.split(".")
    claims = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    claims.update(changed)
    raw = json.dumps(claims, sort_keys=True, separators=(",", ":")).encode()
    return f"{prefix}.{base64.urlsafe_b64encode(raw).rstrip(b'=').decode()}.{signature}"


# ----- tokens -------------------------------------------------------------------------------


def test_a_signed_approval_verifies_with_the_public_key_only(signer: ApprovalSigner) -> None:
    token = _token(signer)
    assert is_signed(token) and token.startswith("ed25519.")
    granted = _verify(ApprovalVerifier.from_public_key(signer.public_key), token)
    assert granted.actor == "lead@acme"
    assert granted.expires_at == NOW + 600.0


@pytest.mark.parametrize(
    ("bound", "refusal"),
    [
        ({"saga_id": "saga-2"}, "for saga_id 'saga-1', not 'saga-2'"),
        ({"step": "refund"}, "for step 'pay', not 'refund'"),
        ({"request_hash": "b" * 64}, "for request_hash"),
        ({"now": NOW + 600.0}, "expired"),
    ],
)
def test_an_approval_is_bound_to_saga_step_request_and_expiry(
    signer: ApprovalSigner, bound: dict[str, Any], refusal: str
) -> None:
    with pytest.raises(ApprovalRejected, match=refusal):
        _verify(signer.verifier(), _token(signer), **bound)


@pytest.mark.parametrize(
    ("changed", "refusal"),
    [
        ({"request_hash": "b" * 64}, "does not verify"),
        ({"expires_at": NOW + 10**9}, "does not verify"),
        ({"actor": "mallory"}, "does not verify"),
        ({"key": "0123456789abcdef"}, "not trusted here"),
    ],
)
def test_an_altered_approval_is_refused(
    signer: ApprovalSigner, changed: dict[str, Any], refusal: str
) -> None:
    altered = _with_claims(_token(signer), **changed)
    # Bound to what the altered claims say, so that only the signature can refuse it.
    bound = {k: v for k, v in changed.items() if k == "request_hash"}
    with pytest.raises(ApprovalRejected, match=refusal):
        _verify(signer.verifier(), altered, **bound)


def test_an_approval_of_another_key_is_refused_even_when_it_names_ours(
    signer: ApprovalSigner,
) -> None:
    other = ApprovalSigner.generate()
    with pytest.raises(ApprovalRejected, match="not trusted here"):
        _verify(signer.verifier(), _token(other))
    impostor = _with_claims(_token(other), key=signer.key_id)
    with pytest.raises(ApprovalRejected, match="does not verify"):
        _verify(signer.verifier(), impostor)


@pytest.mark.parametrize(
    ("token", "refusal"),
    [
        (None, "missing"),
        ("", "missing"),
        (sign(b"hmac-key", saga_id=SAGA_ID, step="pay", request_hash=HASH, actor="a",
              ttl_seconds=60, now=NOW), "HMAC"),
        ("ed25519.not-base64!.x", "malformed"),
        ("ed25519.e30.AAAA.extra", "malformed"),
        ("ed25519.bm90IGpzb24.AAAA", "not JSON"),
    ],
)  # fmt: skip
def test_a_missing_hmac_or_malformed_approval_is_refused(
    signer: ApprovalSigner, token: str | None, refusal: str
) -> None:
    with pytest.raises(ApprovalRejected, match=refusal):
        _verify(signer.verifier(), token)


def test_a_rotation_trusts_each_key_given(signer: ApprovalSigner) -> None:
    new = ApprovalSigner.generate()
    both = ApprovalVerifier.from_public_key([signer.public_key, new.public_key_pem()])
    assert set(both.key_ids) == {signer.key_id, new.key_id}
    assert _verify(both, _token(signer)).actor == _verify(both, _token(new)).actor
    env = ApprovalVerifier.from_environment(f"{signer.public_key}, {new.public_key}")
    assert env.key_ids == both.key_ids


def test_a_signer_refuses_a_blank_actor_or_a_bad_ttl(signer: ApprovalSigner) -> None:
    with pytest.raises(ValueError, match="needs an actor"):
        signer.approval(SAGA_ID, "pay", HASH, actor=" ")
    with pytest.raises(ValueError, match="ttl_seconds"):
        signer.approval(SAGA_ID, "pay", HASH, actor="a", ttl_seconds=0)


# ----- keys ---------------------------------------------------------------------------------


def test_keys_load_from_every_form_a_user_has(signer: ApprovalSigner, tmp_path: Path) -> None:
    pem = tmp_path / "approver.pub"
    pem.write_text(signer.public_key_pem())
    private = tmp_path / "approver.pem"
    private.write_text(signer.private_key_pem(password="s3cret"))
    public = serialization.load_pem_public_key(signer.public_key_pem().encode())
    ssh_line = public.public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    ).decode()
    urlsafe = signer.public_key.replace("+", "-").replace("/", "_").rstrip("=")
    raw = base64.b64decode(signer.public_key)
    for form in (signer.public_key, urlsafe, raw, signer.public_key_pem(), pem, ssh_line):
        assert ApprovalVerifier.from_public_key(form).key_ids == (signer.key_id,), form
    again = ApprovalSigner.from_private_key(private, password="s3cret")
    assert again.key_id == signer.key_id


def test_a_private_key_where_the_public_one_belongs_is_refused(signer: ApprovalSigner) -> None:
    with pytest.raises(ValueError, match="is a private key: workers") as refused:
        ApprovalVerifier.from_public_key(signer.private_key_pem())
    assert "PRIVATE" not in str(refused.value).replace("PRIVATE KEY", "")


@pytest.mark.parametrize("text", ["hello", "QUJD", "-----BEGIN PUBLIC KEY-----\nAAAA\n-----END"])
def test_a_key_that_is_not_ed25519_is_refused_saying_so(text: str) -> None:
    with pytest.raises(ValueError, match="approval public key"):
        ApprovalVerifier.from_public_key(text)


def test_an_encrypted_private_key_needs_its_password(signer: ApprovalSigner) -> None:
    with pytest.raises(ValueError, match="cannot be read"):
        ApprovalSigner.from_private_key(signer.private_key_pem(password="pw"))


def test_a_missing_key_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read the approval private key from"):
        ApprovalSigner.from_private_key(tmp_path / "nowhere.pem")


def test_a_key_file_path_given_as_text_is_named(signer: ApprovalSigner, tmp_path: Path) -> None:
    pem = tmp_path / "approver.pub"
    pem.write_text(signer.public_key_pem())
    with pytest.raises(ValueError, match=r"path of a file, not a key: pass pathlib\.Path"):
        ApprovalVerifier.from_public_key(str(pem))


# ----- configuration ------------------------------------------------------------------------


def test_the_orchestrator_takes_the_public_key_from_its_argument_or_the_environment(
    signer: ApprovalSigner, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV_APPROVAL_PUBLIC_KEY, raising=False)
    assert Orchestrator("postgresql://nowhere/db").approval_verifier is None
    given = Orchestrator("postgresql://nowhere/db", approval_public_key=signer.public_key)
    assert given.approval_verifier is not None
    assert given.approval_verifier.key_ids == (signer.key_id,)
    assert given.runner_options().approval_verifier is given.approval_verifier
    monkeypatch.setenv(ENV_APPROVAL_PUBLIC_KEY, signer.public_key_pem())
    from_env = Orchestrator("postgresql://nowhere/db").approval_verifier
    assert from_env is not None and from_env.key_ids == (signer.key_id,)


@pytest.mark.parametrize("value", ["", "not a key"])
def test_a_bad_public_key_in_the_environment_fails_at_construction(
    value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_APPROVAL_PUBLIC_KEY, value)
    with pytest.raises(ValueError, match=f"^{ENV_APPROVAL_PUBLIC_KEY}: "):
        Orchestrator("postgresql://nowhere/db")


def test_a_bad_public_key_argument_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_APPROVAL_PUBLIC_KEY, raising=False)
    with pytest.raises(ValueError, match=r"^approval_public_key: "):
        Orchestrator("postgresql://nowhere/db", approval_public_key="nope")


def test_a_signed_orchestrator_refuses_hmac_approvals_before_any_io(
    signer: ApprovalSigner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing here reaches the (unreachable) database: the refusals come first."""
    monkeypatch.delenv(ENV_APPROVAL_PUBLIC_KEY, raising=False)
    signed = Orchestrator(
        "postgresql://nowhere/db", approval_public_key=signer.public_key, confirmation_key="k"
    )
    with pytest.raises(StepStateError, match="ApprovalSigner"):
        signed.approval(SAGA_ID, "pay", HASH, actor="ops")
    hmac_token = sign(b"k", saga_id=SAGA_ID, step="pay", request_hash=HASH, actor="a",
                      ttl_seconds=60)  # fmt: skip
    with pytest.raises(ApprovalRejected, match="HMAC"):
        signed.confirm(SAGA_ID, "pay", HASH, hmac_token)
    hmac_only = Orchestrator("postgresql://nowhere/db", confirmation_key="k")
    with pytest.raises(StepStateError, match="no public key to verify it"):
        hmac_only.confirm(SAGA_ID, "pay", HASH, signer.approval(SAGA_ID, "pay", HASH, actor="a"))


# ----- the planner verifies before the attempt ----------------------------------------------


class Payout(BaseModel):
    payout_id: str
    amount_cents: int


INPUT = Payout(payout_id="p-1", amount_cents=50_000)


def _saga() -> Saga[Payout]:
    saga: Saga[Payout] = Saga("payouts", input=Payout, key=lambda p: p.payout_id)

    @saga.step(confirm=True, retry=RetryPolicy(max_attempts=3, initial_delay=0.01))
    def pay(ctx: StepContext, p: Payout) -> dict[str, Any]:
        return {}

    return saga


def _planner(verifier: ApprovalVerifier | None) -> Planner:
    saga = _saga()
    tenant, key = saga.identity(INPUT)
    row = SagaRow(
        id=SAGA_ID,
        name=saga.name,
        version=saga.version,
        tenant_id=tenant,
        key=key,
        input=INPUT.model_dump(mode="json"),
        input_hash=saga.input_hash(INPUT),
        status=SagaStatus.PENDING,
        error=None,
        direction="forward",
        fence=1,
        run_after=None,
    )
    ops = new_action_rows(saga, tenant, key, saga.business_fields(INPUT))
    return Planner(saga, row, ops, now=datetime.now().astimezone(), approval_verifier=verifier)


def _waiting(planner: Planner) -> ConfirmationRow:
    nxt = planner.advance()
    assert isinstance(nxt, Stop) and nxt.status == SagaStatus.AWAITING_CONFIRMATION, nxt
    pending = confirmations.pending_confirmation(planner.confirmations)
    assert pending is not None
    planner.take_events()
    return pending


def _forge(pending: ConfirmationRow, planner: Planner, approval: str | None) -> None:
    """What a process with the database credentials can write: the row says approved."""
    planner.write(None, owner=None)  # the confirmation asked for is written
    pending.approved_by, pending.approved_at, pending.approval = "mallory", planner.now, approval
    planner.saga.status = SagaStatus.RUNNING


def _sign_for(signer: ApprovalSigner, pending: ConfirmationRow, **given: Any) -> str:
    return signer.approval(SAGA_ID, "pay", pending.request_hash, actor="lead@acme", **given)


def test_a_verified_approval_releases_the_attempt_and_names_its_signer(
    signer: ApprovalSigner,
) -> None:
    planner = _planner(signer.verifier())
    pending = _waiting(planner)
    token = _sign_for(signer, pending)
    interventions.approve_confirmation(
        planner, "pay", pending.request_hash, actor="lead@acme", now=planner.now, approval=token
    )
    assert pending.approval == token
    nxt = planner.advance()
    assert isinstance(nxt, Invoke) and nxt.op.attempts == 1
    [used] = [e for e in planner.take_events() if e.event == "approval_used"]
    assert used.detail["approved_by"] == "lead@acme" and used.detail["signed"] is True


def _refused(planner: Planner, pending: ConfirmationRow) -> str:
    """The planner holds the attempt back: the saga awaits a fresh confirmation (the
    forged approval withdrawn), and the refusal is in the trail and the saga's error."""
    nxt = planner.advance()
    assert isinstance(nxt, Stop) and nxt.status == SagaStatus.AWAITING_CONFIRMATION, nxt
    assert planner.op("pay", "action").attempts == 0
    assert (pending.approved_at, pending.approval, pending.consumed_attempt) == (None, None, None)
    write = planner.write(None, owner=None)
    assert [(c.action, c.row) for c in write.confirmations] == [("ask", pending)]  # again
    events = list(write.events)
    names = [e.event for e in events]
    assert "attempt_started" not in names and "approval_used" not in names
    [refusal] = [e for e in events if e.event == "approval_refused"]
    assert refusal.detail["claimed_by"] == "mallory"
    assert refusal.detail["request_hash"] == pending.request_hash
    reason = str(refusal.detail["reason"])
    assert planner.saga.error is not None and reason in planner.saga.error
    return reason


def test_a_forged_row_without_an_approval_releases_nothing(signer: ApprovalSigner) -> None:
    planner = _planner(signer.verifier())
    pending = _waiting(planner)
    _forge(pending, planner, None)
    assert "missing" in _refused(planner, pending)


def test_an_approval_signed_with_another_key_releases_nothing(signer: ApprovalSigner) -> None:
    planner = _planner(signer.verifier())
    pending = _waiting(planner)
    _forge(pending, planner, _sign_for(ApprovalSigner.generate(), pending))
    assert "not trusted" in _refused(planner, pending)


def test_an_approval_of_another_request_releases_nothing(signer: ApprovalSigner) -> None:
    planner = _planner(signer.verifier())
    pending = _waiting(planner)
    _forge(pending, planner, signer.approval(SAGA_ID, "pay", "b" * 64, actor="lead@acme"))
    assert "request_hash" in _refused(planner, pending)


def test_an_approval_that_expired_by_the_planners_clock_releases_nothing(
    signer: ApprovalSigner,
) -> None:
    planner = _planner(signer.verifier())
    pending = _waiting(planner)
    issued = planner.now.timestamp() - 120
    _forge(pending, planner, _sign_for(signer, pending, ttl_seconds=60, now=issued))
    assert "expired" in _refused(planner, pending)


def test_an_altered_approval_releases_nothing(signer: ApprovalSigner) -> None:
    planner = _planner(signer.verifier())
    pending = _waiting(planner)
    _forge(pending, planner, _with_claims(_sign_for(signer, pending), actor="mallory"))
    assert "does not verify" in _refused(planner, pending)


def test_without_a_verifier_the_approved_row_is_trusted_as_before() -> None:
    """The HMAC mode: the token was checked by confirm(); the worker trusts the row."""
    planner = _planner(None)
    pending = _waiting(planner)
    _forge(pending, planner, None)
    nxt = planner.advance(planner.now + timedelta(seconds=1))
    assert isinstance(nxt, Invoke)
    [used] = [e for e in planner.take_events() if e.event == "approval_used"]
    assert used.detail == {"request_hash": pending.request_hash, "approved_by": "mallory"}
