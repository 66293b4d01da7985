"""The ledger: claim, complete, fail, unknown, for callers that own their control flow.

An agent loop, or another engine's activity, decides its calls itself; the ledger gives
each call what a saga's step has: a row in `saga.operations` with a stable idempotency
key, a request hash, a status committed before and after the effect, attempts and a
ceiling, a lease with a fencing token, an explicit unknown outcome, and the audit trail.

The calls of one *channel* (an agent's run, a conversation) are the operations of one
saga row, named `ledger/channel` and keyed by the channel, so `saga list`, `saga show`,
`saga resolve` and `saga compensate` see them like any other. Each call has a lease of
its own (several calls of a channel may be in flight at once): its fence lives on its
operation row, and every write names it (migration 0016).

The rules both doors share (what a claim asks, what a verdict means) are here once;
`Ledger` and `AsyncLedger` only carry them out.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict

from saga._actors import actor_or_os_user
from saga._db.dbretry import DEFAULT_RETRY_SECONDS, aretrying, retrying
from saga.errors import (
    IdempotencyConflict,
    LeaseLost,
    PermanentError,
    SessionParked,
    StepStateError,
)
from saga.keys import (
    JsonValue,
    call_operation_long_name,
    call_operation_name,
    check_json,
    operation_key,
    request_hash,
    same_request,
)
from saga.remedies import LEDGER_PREFIX, resolve_commands

if TYPE_CHECKING:
    from saga._db.store import Store
    from saga._db.store_async import AsyncStore

# The saga row of every channel is named so (its key is the channel).
CHANNEL_SAGA = LEDGER_PREFIX + "channel"

ClaimStatus = Literal["claimed", "reclaimed", "replayed", "in_progress"]
_Outcome = Literal["succeeded", "failed", "retry", "unknown", "heartbeat"]

# Attempts of one call (first claim, retries after transient failures, reclaims) before
# the call fails for good (transient failures) or parks for a human (unknown outcomes).
DEFAULT_MAX_ATTEMPTS = 3


class Claim(BaseModel):
    """What `claim` found or took for one call.

    Attributes:
        status: `claimed` (call it), `reclaimed` (the previous holder's lease expired or
            it said the outcome was unknown: the call may have happened; reconcile with
            the provider by key, or retry with the same key where that is safe),
            `replayed` (it succeeded before: `result` is what it returned; do not call)
            or `in_progress` (a live holder has it until `expires_at`; nothing is held).
        channel: The channel the call belongs to.
        tenant: The channel's tenant.
        key: The call's key, as given to `claim`.
        tool: The tool the call is of.
        saga_id: The channel's saga id (`saga show` it).
        step: The call's operation name, for `saga resolve`: `<tool>.<48 bits of the key's
            SHA-256>`, or the whole digest when another key's call has that name (the
            call's identity is its whole key, in `idempotency_key`).
        idempotency_key: The operation's stable key: pass it to the provider.
        request_hash: The fingerprint of the call's deduplicated fields.
        attempt: The attempt this claim holds (from 1).
        max_attempts: The call's ceiling of attempts.
        fence: The claim's fencing token: every write of this claim names it.
        owner: Who holds the claim (this claim's own token; for `in_progress`, the live
            holder).
        expires_at: When the claim's lease ends unless `heartbeat` extends it.
        lease_seconds: The claim's own lease: what each `heartbeat` extends it by (for a
            claim that holds nothing, None).
        result: A replayed call's stored result.
        provider_reference: A replayed call's provider reference.
        outcome_unknown: True when the previous attempt may have taken effect (`reclaimed`).
        previous_error: Why the previous attempt has no outcome, or how it failed.
    """

    model_config = ConfigDict(frozen=True)

    status: ClaimStatus
    channel: str
    tenant: str
    key: str
    tool: str
    saga_id: str
    step: str
    idempotency_key: str
    request_hash: str
    attempt: int
    max_attempts: int
    fence: int
    owner: str | None
    expires_at: datetime | None
    lease_seconds: float | None = None
    result: Any = None
    provider_reference: str | None = None
    outcome_unknown: bool = False
    previous_error: str | None = None

    @property
    def held(self) -> bool:
        """Whether this claim holds the call (`claimed` or `reclaimed`)."""
        return self.status in ("claimed", "reclaimed")


class _Asked(BaseModel):
    """One claim as asked: everything the statement needs, computed before any I/O."""

    model_config = ConfigDict(frozen=True)

    channel: str
    tenant: str
    key: str
    tool: str
    step: str
    long_step: str
    idempotency_key: str
    request_hash: str
    fingerprint: dict[str, Any]
    request: dict[str, Any]
    owner: str
    lease_seconds: float
    max_attempts: int


def _claim_params(asked: _Asked) -> dict[str, Any]:
    return {
        "tenant": asked.tenant,
        "name": CHANNEL_SAGA,
        "channel": asked.channel,
        "new_id": str(uuid.uuid4()),
        "input_hash": request_hash({}),
        "step": asked.step,
        "long_step": asked.long_step,
        "idempotency_key": asked.idempotency_key,
        "request_hash": asked.request_hash,
        "request": asked.request,
        "owner": asked.owner,
        "lease_seconds": asked.lease_seconds,
        "max_attempts": asked.max_attempts,
    }


def _as_stored(asked: _Asked, row: Mapping[str, Any]) -> _Asked | None:
    """On a `conflict` verdict, `asked` under the stored request hash when that hash is of
    the same request under another hash version (a call claimed before an upgrade of the
    hash): the claim is then asked again under it. None when the request differs."""
    if row["verdict"] != "conflict" or row["request_hash"] == asked.request_hash:
        return None
    if not same_request(row["request_hash"], asked.fingerprint):
        return None
    return asked.model_copy(update={"request_hash": row["request_hash"]})


def _verdict(asked: _Asked, row: Mapping[str, Any]) -> Claim:
    """The claim a verdict row of saga.ledger_claim stands for, or the error it means."""
    verdict = row["verdict"]
    saga_id = str(row["saga_id"])
    step = row["step"] or asked.step  # the call's name: short unless another key has it
    where = f"call {asked.tool!r} under key {asked.key!r} in channel {asked.channel!r}"
    if verdict == "conflict":
        raise IdempotencyConflict(
            f"{where} was claimed before with other deduplicated fields (request hash "
            f"{row['request_hash'][:12]}..., this one {asked.request_hash[:12]}...); nothing "
            "was claimed: use another key for another call",
            saga=CHANNEL_SAGA,
            key=asked.key,
        )
    if verdict == "closed":
        raise StepStateError(
            f"channel {asked.channel!r} ({saga_id}) is {row['saga_status']}: no call runs in "
            f"it now, so {where} was not claimed"
        )
    if verdict == "exhausted":
        happened, did_not = resolve_commands(saga_id, step)
        raise SessionParked(
            f"channel {asked.channel!r} ({saga_id}) needs a human: {row['error']}; settle the "
            f"call with `{happened}` or `{did_not}` (nothing was claimed)"
        )
    if verdict == "parked":
        happened, did_not = resolve_commands(saga_id, "CALL")
        raise SessionParked(
            f"channel {asked.channel!r} ({saga_id}) needs a human: {row['error']}; settle the "
            f"call it names (`saga show {saga_id}` lists them) with `{happened}` or "
            f"`{did_not}` (nothing was claimed)"
        )
    if verdict == "failed":
        raise PermanentError(
            f"{where} failed for good before: {row['error']}; nothing was claimed (use another "
            "key to try another call)"
        )
    status: ClaimStatus = verdict
    held = status in ("claimed", "reclaimed")
    return Claim(
        status=status,
        channel=asked.channel,
        tenant=asked.tenant,
        key=asked.key,
        tool=asked.tool,
        saga_id=saga_id,
        step=step,
        idempotency_key=asked.idempotency_key,
        request_hash=asked.request_hash,
        attempt=int(row["attempt"]),
        max_attempts=int(row["max_attempts"]),
        fence=int(row["fence"]),
        owner=asked.owner if held else row["holder"],
        expires_at=row["expires_at"],
        lease_seconds=asked.lease_seconds if held else None,
        result=row["result"],
        provider_reference=row["provider_reference"],
        outcome_unknown=status == "reclaimed",
        previous_error=row["error"] if held else None,
    )


def _settle_params(
    claim: Claim,
    outcome: _Outcome,
    *,
    result: Any = None,
    provider_reference: str | None = None,
    error: str | None = None,
    lease_seconds: float = 0.0,
) -> dict[str, Any]:
    """The parameters of one write of a held claim; refuses a claim that holds nothing."""
    if not isinstance(claim, Claim):
        raise TypeError(f"expected the Claim that claim() returned, got {type(claim).__name__}")
    if not claim.held:
        raise StepStateError(
            f"the claim of {claim.tool!r} under key {claim.key!r} is {claim.status}: it holds "
            f"nothing, so it cannot {'extend' if outcome == 'heartbeat' else 'record'} anything"
        )
    return {
        "saga_id": claim.saga_id,
        "step": claim.step,
        "owner": claim.owner,
        "fence": claim.fence,
        "outcome": outcome,
        "result": result,
        "provider_reference": provider_reference,
        "error": error,
        "lease_seconds": lease_seconds,
    }


def _checked_result(claim: Claim, result: Any) -> None:
    """`TypeError` naming the call unless `result` is JSON the ledger can replay."""
    check_json(result, where=f"the result of {claim.tool!r} under key {claim.key!r}")


def _close_params(channel: str, tenant: str, actor: str) -> dict[str, Any]:
    """The parameters of saga.ledger_close; `ValueError` for a malformed channel."""
    if not isinstance(channel, str) or not channel.strip():
        raise ValueError(f"ledger close: channel must be a non-empty string, got {channel!r}")
    return {"tenant": tenant, "name": CHANNEL_SAGA, "channel": channel, "actor": actor}


def _closed(channel: str, row: Mapping[str, Any]) -> str:
    """The id of the channel `row` says was closed (or had ended already), or the error
    it means."""
    verdict = row["verdict"]
    if verdict == "missing":
        raise StepStateError(f"there is no ledger channel {channel!r}: nothing was closed")
    saga_id = str(row["saga_id"])
    if verdict == "unsettled":
        raise StepStateError(
            f"channel {channel!r} ({saga_id}) has call {row['step']} {row['status']}: settle "
            "it first (complete, fail or reclaim it, or `saga resolve`); nothing was closed"
        )
    if verdict == "already" and row["saga_status"] == "compensating":
        raise StepStateError(
            f"channel {channel!r} ({saga_id}) is compensating: it ends when its compensations do"
        )
    return saga_id


def _error_text(error: BaseException | str) -> str:
    if isinstance(error, BaseException):
        return f"{type(error).__name__}: {error}"
    if not isinstance(error, str) or not error:
        raise ValueError(f"an error must be an exception or a non-empty string, got {error!r}")
    return error


def _lost(claim: Claim, exc: LeaseLost) -> LeaseLost:
    return LeaseLost(
        f"{exc} (call {claim.tool!r} under key {claim.key!r}, channel {claim.channel!r})"
    )


def _non_json(claim: Claim, exc: TypeError) -> str:
    return (
        f"the call returned a result that is not JSON, so it was not recorded ({exc}); the "
        "effect happened: settle it by hand"
    )


class LedgerEngine(Protocol):
    """What a `Ledger` needs of its orchestrator: its owner's name and the store (an
    `Orchestrator` is one)."""

    @property
    def owner(self) -> str: ...

    @property
    def store(self) -> Store: ...


class AsyncLedgerEngine(Protocol):
    """What an `AsyncLedger` needs of its orchestrator: its owner's name and the store on
    the running loop (an `AsyncOrchestrator` is one)."""

    @property
    def owner(self) -> str: ...

    async def store(self) -> AsyncStore: ...


class _LedgerDoor:
    """What both doors' ledgers share: their settings, and each write's parameters."""

    def __init__(self, *, lease_seconds: float, retry_seconds: float) -> None:
        self.lease_seconds = lease_seconds
        self.retry_seconds = retry_seconds

    def _asked(
        self,
        owner: str,
        channel: str,
        key: str,
        tool: str,
        params: Mapping[str, Any],
        *,
        dedup_fields: Sequence[str] | None,
        lease_seconds: float | None,
        tenant: str,
        max_attempts: int,
    ) -> _Asked:
        """Check a claim's arguments (`lease_seconds`: the door's own when None) and
        compute its key, fingerprint and stored request; `ValueError`/`TypeError` naming
        what is wrong, before anything is written."""
        if lease_seconds is None:
            lease_seconds = self.lease_seconds
        for name, value in (("channel", channel), ("key", key), ("tool", tool)):
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"ledger claim: {name} must be a non-empty string, got {value!r}")
        if not isinstance(tenant, str):
            raise ValueError(f"ledger claim: tenant must be a string, got {tenant!r}")
        if not isinstance(params, Mapping):
            raise TypeError(
                f"ledger claim of {tool!r}: params must be a mapping of field names to JSON "
                f"values, got {type(params).__name__}"
            )
        if not lease_seconds > 0:
            raise ValueError(f"ledger claim of {tool!r}: lease_seconds must be positive")
        if not (isinstance(max_attempts, int) and max_attempts > 0):
            raise ValueError(f"ledger claim of {tool!r}: max_attempts must be a positive int")
        request = dict(params)
        check_json(request, where=f"ledger claim of {tool!r} under key {key!r}: params")
        if dedup_fields is None:
            fields = request
        else:
            if isinstance(dedup_fields, str):
                raise TypeError(
                    f"ledger claim of {tool!r}: dedup_fields must be a sequence of field names, "
                    f"not the string {dedup_fields!r} (write ({dedup_fields!r},))"
                )
            missing = [f for f in dedup_fields if f not in request]
            if missing:
                raise ValueError(
                    f"ledger claim of {tool!r}: dedup_fields {missing} are not in params "
                    f"(which has {sorted(request)})"
                )
            fields = {f: request[f] for f in dedup_fields}
        fingerprint: dict[str, JsonValue] = {"tool": tool, "key": key, "fields": fields}
        return _Asked(
            channel=channel,
            tenant=tenant,
            key=key,
            tool=tool,
            step=call_operation_name(tool, key),
            long_step=call_operation_long_name(tool, key),
            idempotency_key=operation_key(CHANNEL_SAGA, 1, tenant, channel, key, "action"),
            request_hash=request_hash(fingerprint),
            fingerprint=fingerprint,
            request=request,
            owner=f"{owner}/{uuid.uuid4().hex[:12]}",
            lease_seconds=float(lease_seconds),
            max_attempts=max_attempts,
        )

    def _heartbeat(self, claim: Claim, lease_seconds: float | None) -> dict[str, Any]:
        """A heartbeat's write: the lease extended by `lease_seconds`, else by the claim's
        own (the database never shortens it)."""
        if lease_seconds is None:
            lease_seconds = claim.lease_seconds if isinstance(claim, Claim) else None
        seconds = self.lease_seconds if lease_seconds is None else lease_seconds
        if not seconds > 0:
            raise ValueError(f"heartbeat: lease_seconds must be positive, got {seconds!r}")
        return _settle_params(claim, "heartbeat", lease_seconds=float(seconds))

    @staticmethod
    def _completion(
        claim: Claim, result: Any, provider_reference: str | None
    ) -> tuple[dict[str, Any], TypeError | None]:
        """The write that completes `claim`: the result, or (when it is not JSON) the
        unknown outcome to record instead and the `TypeError` to raise after it."""
        try:
            _checked_result(claim, result)
        except TypeError as exc:
            why = _non_json(claim, exc)
            refused = TypeError(f"{exc}; {why} (channel {claim.channel!r} is parked)")
            return _settle_params(claim, "unknown", error=why), refused
        params = _settle_params(
            claim, "succeeded", result=result, provider_reference=provider_reference
        )
        return params, None

    @staticmethod
    def _failure(claim: Claim, error: BaseException | str, permanent: bool) -> dict[str, Any]:
        outcome: _Outcome = "failed" if permanent else "retry"
        return _settle_params(claim, outcome, error=_error_text(error))

    @staticmethod
    def _unknown(claim: Claim, reason: str) -> dict[str, Any]:
        return _settle_params(claim, "unknown", error=_error_text(reason))


class Ledger(_LedgerDoor):
    """Claims, completions and failures of calls decided as they go: `orch.ledger`.

    Each write retries transient database errors (a lost connection, a restart) for up to
    `retry_seconds`, then raises: an unreachable database never turns an effect that
    happened into a recorded failure. A write whose reply was lost is recognised when it
    is sent again.
    """

    def __init__(
        self,
        orch: LedgerEngine,
        *,
        lease_seconds: float = 60.0,
        retry_seconds: float = DEFAULT_RETRY_SECONDS,
    ) -> None:
        super().__init__(lease_seconds=lease_seconds, retry_seconds=retry_seconds)
        self._orch = orch

    def claim(
        self,
        channel: str,
        key: str,
        tool: str,
        params: Mapping[str, Any],
        *,
        dedup_fields: Sequence[str] | None = None,
        lease_seconds: float | None = None,
        tenant: str = "",
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    ) -> Claim:
        """Claim the call `key` of `channel` (created on first use).

        Args:
            channel: The calls' group (an agent's run id, a conversation).
            key: The call's key in the channel, built from its business fields (never a
                per-turn id such as a tool-call id).
            tool: What is called (the operation's name starts with it).
            params: The call's arguments, JSON; stored with the call.
            dedup_fields: The fields of `params` that make the fingerprint (others, such
                as timestamps or trace ids, may change between claims); all by default.
            lease_seconds: How long the claim holds without a `heartbeat`.
            tenant: The channel's tenant.
            max_attempts: Attempts (retries after transient failures, reclaims) before
                the call fails for good or, when its outcome is unknown, parks.

        Returns:
            The claim: `claimed` or `reclaimed` (yours to call and settle), `replayed`
            (with `result`) or `in_progress` (someone else holds it).

        Raises:
            IdempotencyConflict: The key was claimed with other deduplicated fields.
            PermanentError: The call failed for good before.
            SessionParked: The channel waits for a human (`saga resolve`).
            StepStateError: The channel was closed (compensated, cancelled).
            TypeError, ValueError: The arguments are malformed (nothing was written).
        """
        asked = self._asked(
            self._orch.owner,
            channel,
            key,
            tool,
            params,
            dedup_fields=dedup_fields,
            lease_seconds=lease_seconds,
            tenant=tenant,
            max_attempts=max_attempts,
        )
        row = self._write("ledger_claim", _claim_params(asked))
        stored = _as_stored(asked, row)
        if stored is not None:
            asked, row = stored, self._write("ledger_claim", _claim_params(stored))
        return _verdict(asked, row)

    def heartbeat(self, claim: Claim, *, lease_seconds: float | None = None) -> Claim:
        """Extend the claim's lease to `lease_seconds` from now (default: the claim's own
        `lease_seconds`, as claimed); a lease that already ends later is left as it is, so
        a heartbeat never shortens a claim. Returns the claim with its expiry. `LeaseLost`
        when another holder took the call over, or an operator settled it."""
        row = self._settle(claim, self._heartbeat(claim, lease_seconds))
        return claim.model_copy(update={"expires_at": row["expires_at"]})

    def complete(self, claim: Claim, result: Any, provider_reference: str | None = None) -> None:
        """Record the call's result (JSON); later claims of its key replay it.

        Raises:
            LeaseLost: Another holder took the call over; nothing was recorded.
            TypeError: `result` is not JSON: the call is recorded as unknown (the effect
                happened) and the channel parks for a human.
            DatabaseUnavailable: The database could not be reached: nothing is recorded
                as failed; the call becomes unknown when the claim's lease expires.
        """
        params, refused = self._completion(claim, result, provider_reference)
        self._settle(claim, params)
        if refused is not None:
            raise refused

    def fail(self, claim: Claim, error: BaseException | str, permanent: bool = True) -> None:
        """Record that the call failed: for good (`permanent`; later claims raise
        `PermanentError`), or transiently (the next claim retries it, up to its ceiling).
        Only for a call that did not take effect: when it may have, use `unknown` (as
        after a `ConnectionError` or `TimeoutError` that cut the provider's reply off)."""
        self._settle(claim, self._failure(claim, error, permanent))

    def unknown(self, claim: Claim, reason: str) -> None:
        """Record that the call may have taken effect and its outcome is not known: the
        channel parks; the next claim of the key is `reclaimed` (to reconcile with the
        provider), or an operator settles it with `saga resolve`."""
        self._settle(claim, self._unknown(claim, reason))

    def close(self, channel: str, *, tenant: str = "", actor: str | None = None) -> str:
        """End `channel` once every call in it is settled: it becomes `completed`, is
        purged after the retention period, and later claims in it are refused. Returns
        its saga id; closing a closed channel again does nothing.

        Raises:
            StepStateError: No such channel, or a call in it is still in flight, unknown
                or waiting for a retry.
        """
        who = actor_or_os_user("close", actor)
        return _closed(channel, self._write("ledger_close", _close_params(channel, tenant, who)))

    def _settle(self, claim: Claim, params: dict[str, Any]) -> dict[str, Any]:
        try:
            return self._write("ledger_settle", params)
        except LeaseLost as exc:
            raise _lost(claim, exc) from None

    def _write(self, statement: str, params: dict[str, Any]) -> dict[str, Any]:
        store = self._orch.store
        write = {
            "ledger_claim": store.ledger_claim,
            "ledger_settle": store.ledger_settle,
            "ledger_close": store.ledger_close,
        }[statement]
        for attempt in retrying(statement, seconds=self.retry_seconds):
            with attempt:
                return write(params)
        raise AssertionError("unreachable: retrying() reraises")  # pragma: no cover


class AsyncLedger(_LedgerDoor):
    """The asyncio twin of `Ledger`: `aorch.ledger`, each method awaited."""

    def __init__(
        self,
        orch: AsyncLedgerEngine,
        *,
        lease_seconds: float = 60.0,
        retry_seconds: float = DEFAULT_RETRY_SECONDS,
    ) -> None:
        super().__init__(lease_seconds=lease_seconds, retry_seconds=retry_seconds)
        self._orch = orch

    async def claim(
        self,
        channel: str,
        key: str,
        tool: str,
        params: Mapping[str, Any],
        *,
        dedup_fields: Sequence[str] | None = None,
        lease_seconds: float | None = None,
        tenant: str = "",
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    ) -> Claim:
        """Claim the call `key` of `channel`; see `Ledger.claim`."""
        asked = self._asked(
            self._orch.owner,
            channel,
            key,
            tool,
            params,
            dedup_fields=dedup_fields,
            lease_seconds=lease_seconds,
            tenant=tenant,
            max_attempts=max_attempts,
        )
        row = await self._write("ledger_claim", _claim_params(asked))
        stored = _as_stored(asked, row)
        if stored is not None:
            asked, row = stored, await self._write("ledger_claim", _claim_params(stored))
        return _verdict(asked, row)

    async def heartbeat(self, claim: Claim, *, lease_seconds: float | None = None) -> Claim:
        """Extend the claim's lease; see `Ledger.heartbeat`."""
        row = await self._settle(claim, self._heartbeat(claim, lease_seconds))
        return claim.model_copy(update={"expires_at": row["expires_at"]})

    async def complete(
        self, claim: Claim, result: Any, provider_reference: str | None = None
    ) -> None:
        """Record the call's result; see `Ledger.complete`."""
        params, refused = self._completion(claim, result, provider_reference)
        await self._settle(claim, params)
        if refused is not None:
            raise refused

    async def fail(self, claim: Claim, error: BaseException | str, permanent: bool = True) -> None:
        """Record that the call failed; see `Ledger.fail`."""
        await self._settle(claim, self._failure(claim, error, permanent))

    async def unknown(self, claim: Claim, reason: str) -> None:
        """Record that the call's outcome is unknown; see `Ledger.unknown`."""
        await self._settle(claim, self._unknown(claim, reason))

    async def close(self, channel: str, *, tenant: str = "", actor: str | None = None) -> str:
        """End `channel` once every call in it is settled; see `Ledger.close`."""
        who = actor_or_os_user("close", actor)
        params = _close_params(channel, tenant, who)
        return _closed(channel, await self._write("ledger_close", params))

    async def _settle(self, claim: Claim, params: dict[str, Any]) -> dict[str, Any]:
        try:
            return await self._write("ledger_settle", params)
        except LeaseLost as exc:
            raise _lost(claim, exc) from None

    async def _write(self, statement: str, params: dict[str, Any]) -> dict[str, Any]:
        store = await self._orch.store()
        write = {
            "ledger_claim": store.ledger_claim,
            "ledger_settle": store.ledger_settle,
            "ledger_close": store.ledger_close,
        }[statement]
        async for attempt in aretrying(statement, seconds=self.retry_seconds):
            with attempt:
                return await write(params)
        raise AssertionError("unreachable: aretrying() reraises")  # pragma: no cover
