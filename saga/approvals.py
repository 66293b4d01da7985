"""Approval tokens: HMAC-signed, bound to saga, step, request hash, actor and expiry.

An approval is the only way to confirm a step that waits in `awaiting_confirmation`.
It is signed with a key the orchestrator is configured with, so nothing a step
returns and nothing in a saga's input can confirm anything: a `"confirmed": true`
in a payload is just data.

The request hash an approval is bound to is `preview_hash` of the preview the approver
was shown: everything the attempt reads (the whole saga input, volatile fields included,
the prepared request, the results of earlier steps), the attempt's number and figures.
One approval releases one attempt: the attempt it releases uses it up.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from saga.errors import SagaError
from saga.keys import request_hash as _hash_of


class ApprovalRejected(SagaError, PermissionError):
    """The approval token is not valid for this confirmation."""


@dataclass(frozen=True, slots=True)
class Approval:
    """What a valid token says: who approved, and until when (Unix seconds)."""

    actor: str
    expires_at: float


def preview_hash(preview: Mapping[str, Any]) -> str:
    """The request hash of a confirmation: hex SHA-256 over everything its preview shows
    (every key but `request_hash`, which holds this hash)."""
    shown = {k: v for k, v in preview.items() if k != "request_hash"}
    return _hash_of({"kind": "confirmation", "preview": shown})


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


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
    """A token approving exactly this saga, step and request, by `actor`, for a while."""
    if not actor:
        raise ValueError("an approval needs an actor")
    if not ttl_seconds > 0:
        raise ValueError(f"ttl_seconds must be positive, got {ttl_seconds!r}")
    claims = {
        "saga_id": saga_id,
        "step": step,
        "request_hash": request_hash,
        "actor": actor,
        "expires_at": round((now if now is not None else time.time()) + ttl_seconds, 3),
    }
    body = json.dumps(claims, sort_keys=True, separators=(",", ":")).encode("utf-8")
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
    """The approval in `token`; `ApprovalRejected` unless it is signed with `key`, is
    bound to this saga, step and request hash, and has not expired."""
    try:
        body_text, mac_text = token.split(".")
        body, mac = _unb64(body_text), _unb64(mac_text)
    except (ValueError, AttributeError) as exc:
        raise ApprovalRejected("the approval token is malformed") from exc
    expected = hmac.new(key, body, hashlib.sha256).digest()
    if not hmac.compare_digest(mac, expected):
        raise ApprovalRejected(
            "the approval token's signature does not match this orchestrator's key"
        )
    claims = json.loads(body)
    for name, wanted in (("saga_id", saga_id), ("step", step), ("request_hash", request_hash)):
        if claims.get(name) != wanted:
            raise ApprovalRejected(
                f"the approval token is for {name} {claims.get(name)!r}, not {wanted!r}"
            )
    if float(claims["expires_at"]) <= (now if now is not None else time.time()):
        raise ApprovalRejected("the approval token has expired")
    return Approval(actor=str(claims["actor"]), expires_at=float(claims["expires_at"]))
