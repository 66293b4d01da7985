"""Approvals: the proof that a human approved exactly one attempt of a step.

An approval is the only way to confirm a step that waits in `awaiting_confirmation`. It
is bound to saga, step, request hash, actor and expiry, and comes in two kinds:

- **Signed** (Ed25519): approvers sign with a private key (`ApprovalSigner`); workers
  hold only the public key (`ApprovalVerifier`, configured as
  `Orchestrator(approval_public_key=...)` or `SAGA_APPROVAL_PUBLIC_KEY`). The signed
  approval is stored with the confirmation, and the planner verifies it again before
  every attempt it releases: a row written into `saga.confirmations` by anything that
  holds the database credentials (step code, an agent with a SQL tool) releases nothing,
  because it cannot produce a signature.
- **HMAC** (`sign`, `verify`, with `confirmation_key`): the weaker mode. The token is
  checked once, by `confirm()`, and workers then trust the confirmation row; whoever
  holds the key, or can write that row, can approve.

Nothing a step returns and nothing in a saga's input can confirm anything: a
`"confirmed": true` in a payload is just data.

The request hash an approval is bound to is `preview_hash` of the preview the approver
was shown: everything the attempt reads (the whole saga input, volatile fields included,
the prepared request, the results of earlier steps), the attempt's number and figures.
One approval releases one attempt: the attempt it releases uses it up.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import math
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from saga.errors import SagaError
from saga.keys import HASH_VERSION
from saga.keys import request_hash as _hash_of


class ApprovalRejected(SagaError, PermissionError):
    """The approval token is not valid for this confirmation."""


@dataclass(frozen=True, slots=True)
class Approval:
    """What a valid token says: who approved, and until when (Unix seconds)."""

    actor: str
    expires_at: float


def preview_hash(preview: Mapping[str, Any], *, version: int = HASH_VERSION) -> str:
    """The request hash of a confirmation: hex SHA-256 over everything its preview shows
    (every key but `request_hash`, which holds this hash).

    Under hash version 2 (the current one) that is the SHA-256 of the RFC 8785 canonical
    form of `{"kind": "confirmation", "preview": <the preview without request_hash>}`,
    which an approver's tool in any language with a JCS implementation recomputes."""
    shown = {k: v for k, v in preview.items() if k != "request_hash"}
    return _hash_of({"kind": "confirmation", "preview": shown}, version=version)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _claims_body(
    *, saga_id: str, step: str, request_hash: str, actor: str, ttl_seconds: float, now: float | None
) -> dict[str, Any]:
    """The claims an approval token carries; `ValueError` for a blank actor or a TTL
    that is not a positive number of seconds."""
    if not isinstance(actor, str) or not actor.strip():
        raise ValueError(
            f"an approval needs an actor: who approves (a person or a system), recorded in "
            f"the saga's audit trail; got {actor!r}"
        )
    if not (
        isinstance(ttl_seconds, int | float) and ttl_seconds > 0 and math.isfinite(ttl_seconds)
    ):
        raise ValueError(f"ttl_seconds must be a positive number of seconds, got {ttl_seconds!r}")
    return {
        "saga_id": saga_id,
        "step": step,
        "request_hash": request_hash,
        "actor": actor,
        "expires_at": round((now if now is not None else time.time()) + ttl_seconds, 3),
    }


def _encode_claims(claims: Mapping[str, Any]) -> bytes:
    return json.dumps(claims, sort_keys=True, separators=(",", ":")).encode("utf-8")


def _bound_approval(
    claims: Any, *, saga_id: str, step: str, request_hash: str, now: float | None
) -> Approval:
    """The approval `claims` (verified) make; `ApprovalRejected` unless they are bound
    to this saga, step and request hash and have not expired."""
    if not isinstance(claims, dict):
        raise ApprovalRejected("the approval token is malformed: its claims are not an object")
    for name, wanted in (("saga_id", saga_id), ("step", step), ("request_hash", request_hash)):
        if claims.get(name) != wanted:
            raise ApprovalRejected(
                f"the approval token is for {name} {claims.get(name)!r}, not {wanted!r}"
            )
    try:
        expires_at = float(claims["expires_at"])
        actor = claims["actor"]
    except (KeyError, TypeError, ValueError) as exc:
        raise ApprovalRejected(
            "the approval token is malformed: it names no actor or expiry"
        ) from exc
    if not isinstance(actor, str) or not actor.strip():
        raise ApprovalRejected("the approval token is malformed: it names no actor")
    if not expires_at > (now if now is not None else time.time()):
        raise ApprovalRejected("the approval token has expired")
    return Approval(actor=actor, expires_at=expires_at)


def sign(
    key: bytes,
    *,
    saga_id: str,
    step: str,
    request_hash: str,
    actor: str,
    ttl_seconds: float,
    now: float | None = None,
) -> str:
    """An HMAC token approving exactly this saga, step and request, by `actor`, for a
    while (the weaker mode: see the module's docstring)."""
    claims = _claims_body(
        saga_id=saga_id,
        step=step,
        request_hash=request_hash,
        actor=actor,
        ttl_seconds=ttl_seconds,
        now=now,
    )
    body = _encode_claims(claims)
    mac = hmac.new(key, body, hashlib.sha256).digest()
    return f"{_b64(body)}.{_b64(mac)}"


def verify(
    key: bytes,
    token: str,
    *,
    saga_id: str,
    step: str,
    request_hash: str,
    now: float | None = None,
) -> Approval:
    """The approval in the HMAC `token`; `ApprovalRejected` unless it is signed with
    `key`, is bound to this saga, step and request hash, and has not expired."""
    if is_signed(token):
        raise ApprovalRejected(
            "the approval is signed with an Ed25519 private key, and this orchestrator has no "
            "public key to verify it: pass Orchestrator(approval_public_key=...) or set "
            f"{ENV_APPROVAL_PUBLIC_KEY}"
        )
    try:
        body_text, mac_text = token.split(".")
        body, mac = _unb64(body_text), _unb64(mac_text)
    except (ValueError, AttributeError, binascii.Error) as exc:
        raise ApprovalRejected("the approval token is malformed") from exc
    expected = hmac.new(key, body, hashlib.sha256).digest()
    if not hmac.compare_digest(mac, expected):
        raise ApprovalRejected(
            "the approval token's signature does not match this orchestrator's key"
        )
    return _bound_approval(
        _json_or_none(body), saga_id=saga_id, step=step, request_hash=request_hash, now=now
    )


def _json_or_none(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None


# ----- signed approvals (Ed25519) ---------------------------------------------------------

# Where workers (and `confirm`) find the approvers' public key when it is not passed.
ENV_APPROVAL_PUBLIC_KEY = "SAGA_APPROVAL_PUBLIC_KEY"
# A signed approval is `ed25519.<claims>.<signature>`, each part unpadded base64url.
SIGNED_PREFIX = "ed25519"
# What is signed is this context, then the claims: a signature made for an approval is
# valid for nothing else the same key might sign.
_SIGNED_CONTEXT = b"saga-orchestrator approval v1\n"
_RAW_KEY_BYTES = 32

# A public key as configured: the key, its PEM, an OpenSSH `ssh-ed25519` line, or the raw
# 32-byte key (bytes, or base64 as `saga keygen` prints it); a path names a file holding one.
PublicKeyLike = Ed25519PublicKey | str | bytes | os.PathLike[str]
# A private key: the key, its PEM (PKCS#8 or OpenSSH), or the raw 32-byte seed (bytes or
# base64); a path names a file holding one.
PrivateKeyLike = Ed25519PrivateKey | str | bytes | os.PathLike[str]


def is_signed(token: str | None) -> bool:
    """Whether `token` has the form of a signed (Ed25519) approval rather than an HMAC one."""
    return isinstance(token, str) and token.startswith(SIGNED_PREFIX + ".")


def key_id(public_key: Ed25519PublicKey) -> str:
    """A short name of a public key, for messages and tokens: the first 16 hex digits of
    the SHA-256 of its raw bytes."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def _key_text(key: str | bytes | os.PathLike[str], what: str) -> bytes:
    """The bytes of a key given as text, bytes or a file path."""
    if isinstance(key, os.PathLike):
        path = Path(key)
        try:
            return path.read_bytes()
        except OSError as exc:
            raise ValueError(f"cannot read the {what} from {path}: {exc.strerror or exc}") from None
    return key.encode("utf-8") if isinstance(key, str) else bytes(key)


def _raw_from_base64(
    key: str | bytes | os.PathLike[str], data: bytes, what: str, form: str
) -> bytes:
    """The 32 raw bytes of a key given in base64 (standard or URL-safe, padded or not);
    `ValueError` naming the forms expected, and saying so when `key` is a file path
    given as text."""
    text = b"".join(data.split())
    try:
        decoded = base64.b64decode(
            text.replace(b"-", b"+").replace(b"_", b"/") + b"=" * (-len(text) % 4), validate=True
        )
    except (binascii.Error, ValueError):
        decoded = b""
    if len(decoded) == _RAW_KEY_BYTES:
        return decoded
    if isinstance(key, str) and Path(key.strip()).is_file():
        raise ValueError(
            f"the {what} given is the path of a file, not a key: pass "
            f"pathlib.Path({key.strip()!r}), or the file's contents"
        )
    raise ValueError(f"the {what} is not an Ed25519 key: expected PEM or {form}")


def load_public_key(key: PublicKeyLike) -> Ed25519PublicKey:
    """An Ed25519 public key from its PEM, an OpenSSH `ssh-ed25519` line, the raw
    32-byte key in base64, or a file holding one of them; `ValueError` saying what is
    wrong otherwise (a private key, for one, belongs to the approvers, not here)."""
    if isinstance(key, Ed25519PublicKey):
        return key
    if isinstance(key, bytes) and len(key) == _RAW_KEY_BYTES:
        return Ed25519PublicKey.from_public_bytes(key)  # the raw key, as bytes
    data = _key_text(key, "approval public key").strip()
    if b"PRIVATE KEY" in data:
        raise ValueError(
            "the approval public key given is a private key: workers and `confirm` hold only "
            "the public key (`saga keygen` prints it; ApprovalSigner.public_key derives it); "
            "keep the private key with the approvers"
        )
    if not data.startswith((b"-----BEGIN", b"ssh-")):
        return Ed25519PublicKey.from_public_bytes(
            _raw_from_base64(
                key,
                data,
                "approval public key",
                "the raw 32-byte key in base64, as `saga keygen` prints it",
            )
        )
    loaded: object
    try:
        if data.startswith(b"-----BEGIN"):
            loaded = serialization.load_pem_public_key(data)
        else:
            loaded = serialization.load_ssh_public_key(data)
    except (ValueError, UnsupportedAlgorithm) as exc:
        # cryptography's message says what it could not parse; it never quotes the key.
        raise ValueError(f"the approval public key cannot be read: {exc}") from None
    if not isinstance(loaded, Ed25519PublicKey):
        raise ValueError(
            f"the approval public key is a {type(loaded).__name__}, not an Ed25519 key: "
            "generate a key pair with `saga keygen`"
        )
    return loaded


def load_private_key(key: PrivateKeyLike, *, password: bytes | None = None) -> Ed25519PrivateKey:
    """An Ed25519 private key from its PEM (PKCS#8 or OpenSSH), the raw 32-byte seed in
    base64, or a file holding one of them (`password` for an encrypted PEM); `ValueError`
    saying what is wrong otherwise."""
    if isinstance(key, Ed25519PrivateKey):
        return key
    if isinstance(key, bytes) and len(key) == _RAW_KEY_BYTES:
        return Ed25519PrivateKey.from_private_bytes(key)  # the raw seed, as bytes
    data = _key_text(key, "approval private key").strip()
    if not data.startswith(b"-----BEGIN"):
        return Ed25519PrivateKey.from_private_bytes(
            _raw_from_base64(key, data, "approval private key", "the raw 32-byte seed in base64")
        )
    loaded: object
    try:
        if data.startswith(b"-----BEGIN OPENSSH PRIVATE KEY"):
            loaded = serialization.load_ssh_private_key(data, password=password)
        else:
            loaded = serialization.load_pem_private_key(data, password=password)
    except (TypeError, ValueError, UnsupportedAlgorithm) as exc:
        # cryptography's message says what it could not do (a missing or wrong password,
        # a malformed PEM); it never quotes the key.
        raise ValueError(f"the approval private key cannot be read: {exc}") from None
    if not isinstance(loaded, Ed25519PrivateKey):
        raise ValueError(
            f"the approval private key is a {type(loaded).__name__}, not an Ed25519 key: "
            "generate a key pair with `saga keygen`"
        )
    return loaded


class ApprovalSigner:
    """Signs approvals with the approvers' Ed25519 private key (their tooling only).

    ```python
    signer = ApprovalSigner.from_private_key(Path("approver.pem"))
    token = signer.approval(saga_id, "pay_refund", pending.request_hash, actor="lead@acme")
    orch.confirm(saga_id, "pay_refund", pending.request_hash, token)
    ```

    Workers verify with `public_key`, and never need the private key.
    """

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        if not isinstance(private_key, Ed25519PrivateKey):
            raise TypeError(
                "ApprovalSigner takes an Ed25519PrivateKey; use "
                "ApprovalSigner.from_private_key(...) for a PEM, a base64 seed or a file"
            )
        self._key = private_key
        self.key_id = key_id(private_key.public_key())

    @classmethod
    def generate(cls) -> ApprovalSigner:
        """A signer with a new, random key pair (`saga keygen` writes one to a file)."""
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_private_key(
        cls, key: PrivateKeyLike, *, password: bytes | str | None = None
    ) -> ApprovalSigner:
        """A signer with the private key given as PEM (PKCS#8, as `saga keygen` writes it,
        or OpenSSH), as the raw 32-byte seed in base64, or as the path of a file holding
        one (`pathlib.Path`); `password` decrypts an encrypted PEM."""
        secret = password.encode("utf-8") if isinstance(password, str) else password
        return cls(load_private_key(key, password=secret))

    @property
    def public_key(self) -> str:
        """The public key, raw and base64-encoded on one line: what workers are given
        (`approval_public_key=`, `SAGA_APPROVAL_PUBLIC_KEY`)."""
        raw = self._key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        return base64.b64encode(raw).decode("ascii")

    def public_key_pem(self) -> str:
        """The public key as PEM (SubjectPublicKeyInfo), for tools that want a file."""
        return (
            self._key.public_key()
            .public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
            .decode("ascii")
        )

    def private_key_pem(self, *, password: bytes | str | None = None) -> str:
        """The private key as PKCS#8 PEM, encrypted when `password` is given: for the
        approvers' key file, never for workers."""
        secret = password.encode("utf-8") if isinstance(password, str) else password
        encryption: serialization.KeySerializationEncryption = (
            serialization.BestAvailableEncryption(secret)
            if secret
            else serialization.NoEncryption()
        )
        return self._key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption
        ).decode("ascii")

    def verifier(self) -> ApprovalVerifier:
        """The verifier of this signer's approvals (what a worker with its public key has)."""
        return ApprovalVerifier([self._key.public_key()])

    def approval(
        self,
        saga_id: str,
        step: str,
        request_hash: str,
        *,
        actor: str,
        ttl_seconds: float = 600.0,
        now: float | None = None,
    ) -> str:
        """A signed approval of exactly this saga, step and request hash (the
        `request_hash` of the preview approved: `Orchestrator.preview`), by `actor`,
        valid for `ttl_seconds` (`now`: Unix seconds, default the clock). Pass it to
        `Orchestrator.confirm`; it is stored with the confirmation and verified again
        before the attempt it releases. `ValueError` for a blank actor."""
        claims = _claims_body(
            saga_id=saga_id,
            step=step,
            request_hash=request_hash,
            actor=actor,
            ttl_seconds=ttl_seconds,
            now=now,
        )
        claims["key"] = self.key_id
        body = _encode_claims(claims)
        signature = self._key.sign(_SIGNED_CONTEXT + body)
        return f"{SIGNED_PREFIX}.{_b64(body)}.{_b64(signature)}"

    def __repr__(self) -> str:
        return f"<ApprovalSigner key {self.key_id}>"


class ApprovalVerifier:
    """Verifies signed approvals with the approvers' public key(s): what workers hold.

    Several keys are accepted during a rotation (an approval names the key that signed
    it). Verifying is pure computation: the planner does it before every attempt a
    confirmation releases, with the time it is given.
    """

    def __init__(self, public_keys: Iterable[Ed25519PublicKey]) -> None:
        self._keys: dict[str, Ed25519PublicKey] = {}
        for key in public_keys:
            if not isinstance(key, Ed25519PublicKey):
                raise TypeError(
                    "ApprovalVerifier takes Ed25519PublicKeys; use "
                    "ApprovalVerifier.from_public_key(...) for a PEM, base64 or a file"
                )
            self._keys[key_id(key)] = key
        if not self._keys:
            raise ValueError("an ApprovalVerifier needs at least one public key")

    @classmethod
    def from_public_key(cls, key: PublicKeyLike | Iterable[PublicKeyLike]) -> ApprovalVerifier:
        """A verifier of the public key given as PEM, an OpenSSH `ssh-ed25519` line, the
        raw 32-byte key in base64 (as `saga keygen` prints it), a file path, or several of
        them in a list (a rotation); `ValueError` saying what is wrong otherwise."""
        if isinstance(key, Ed25519PublicKey | str | bytes | os.PathLike):
            return cls([load_public_key(key)])
        return cls([load_public_key(k) for k in key])

    @classmethod
    def from_environment(cls, text: str) -> ApprovalVerifier:
        """A verifier of `SAGA_APPROVAL_PUBLIC_KEY`'s value: one key (PEM or base64), or
        several separated by commas during a rotation."""
        parts = [p for p in text.split(",") if p.strip()]
        if not parts:
            raise ValueError(f"{ENV_APPROVAL_PUBLIC_KEY} is set but empty")
        return cls([load_public_key(p) for p in parts])

    @property
    def key_ids(self) -> tuple[str, ...]:
        """The names (`key_id`) of the keys this verifier trusts."""
        return tuple(self._keys)

    def verify(
        self,
        token: str | None,
        *,
        saga_id: str,
        step: str,
        request_hash: str,
        now: float | None = None,
    ) -> Approval:
        """The approval in `token`; `ApprovalRejected` saying why unless it is present,
        signed by one of this verifier's keys, unaltered, bound to this saga, step and
        request hash, and unexpired at `now` (Unix seconds, default the clock)."""
        if not token:
            raise ApprovalRejected(
                "the signed approval is missing: none is stored with the confirmation"
            )
        if not is_signed(token):
            raise ApprovalRejected(
                "the approval is not signed with the approvers' Ed25519 key (an HMAC token "
                "of a confirmation_key, or something else): sign approvals with "
                "ApprovalSigner or `saga confirm --private-key FILE`"
            )
        try:
            _, body_text, signature_text = token.split(".")
            body, signature = _unb64(body_text), _unb64(signature_text)
        except (ValueError, binascii.Error) as exc:
            raise ApprovalRejected("the signed approval is malformed") from exc
        claims = _json_or_none(body)
        if not isinstance(claims, dict):
            raise ApprovalRejected("the signed approval is malformed: its claims are not JSON")
        signer = claims.get("key")
        key = self._keys.get(signer) if isinstance(signer, str) else None
        if key is None:
            raise ApprovalRejected(
                f"the approval is signed with key {signer!r}, which is not trusted here "
                f"(trusted: {', '.join(self._keys)})"
            )
        try:
            key.verify(signature, _SIGNED_CONTEXT + body)
        except InvalidSignature:
            raise ApprovalRejected(
                f"the approval's signature does not verify with key {signer}: it was altered "
                "or signed with another key"
            ) from None
        return _bound_approval(
            claims, saga_id=saga_id, step=step, request_hash=request_hash, now=now
        )

    def __repr__(self) -> str:
        return f"<ApprovalVerifier keys {', '.join(self._keys)}>"
