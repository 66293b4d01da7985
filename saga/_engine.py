"""What both doors share: settings, the registry, and the flows of their verbs.

`Orchestrator` (blocking) and `AsyncOrchestrator` (asyncio) are two drivers of one
`Engine`: the same settings and registry, and the same flows (`saga._flows.verbs`, and
the upgrade's here) for starting, driving and changing sagas, carried out with blocking or
async I/O.
"""

from __future__ import annotations

import math
import os
import socket
import uuid
from collections.abc import Iterable
from datetime import timedelta
from typing import Any, Literal

from pydantic import BaseModel

from saga import approvals, telemetry
from saga._codefirst import code_first_definition
from saga._core import inputs
from saga._core import requests as interventions
from saga._core.planner import Event, Next, Planner
from saga._core.requests import check_actor
from saga._core.rows import OpRow, Write
from saga._db.database import Route, describe_url, prepared_statements_setting, resolve_database_url
from saga._drivers import faults
from saga._flows import verbs
from saga._flows.claim import Flows
from saga._flows.drive import RunnerOptions
from saga._flows.effects import Commit, Fetch, Flow, db, db_txn
from saga._flows.started import StartedSagas
from saga._flows.store_ops import StoreOps
from saga.definition import Saga
from saga.errors import NotRegistered, SagaDefinitionError, StepStateError
from saga.logs import get_logger
from saga.state import SagaHandle, SagaState, SagaStatus
from saga.upgrade import UpgradePlan, UpgradeRefused, plan_upgrade

_log = get_logger("saga")

ENV_CONFIRMATION_KEY = "SAGA_CONFIRMATION_KEY"
ENV_APPROVAL_PUBLIC_KEY = approvals.ENV_APPROVAL_PUBLIC_KEY
# Most connections of an orchestrator's pool when `pool_size` is not given and no worker
# has sized it for its concurrency.
DEFAULT_POOL_SIZE = 10


def resolve_arguments(outcome: str, actor: str) -> None:
    """`ValueError` for an outcome of `resolve` other than succeeded or failed, or a blank
    actor, before anything is read or written."""
    if outcome not in ("succeeded", "failed"):
        raise ValueError(f"outcome must be 'succeeded' or 'failed', got {outcome!r}")
    check_actor("resolve", actor)


def list_filters(
    status: str | None, limit: int, older_than: timedelta | None
) -> tuple[str | None, float | None]:
    """The status and age (seconds) `list` filters by, checked: `ValueError` for an
    unknown status, a limit below 1 or a negative age."""
    if status is not None:
        status = SagaStatus(status).value
    if limit < 1:
        raise ValueError(f"limit must be positive, got {limit}")
    if older_than is None:
        return status, None
    seconds = older_than.total_seconds()
    if seconds < 0:
        raise ValueError(f"older_than must not be negative, got {older_than}")
    return status, seconds


def list_key(key: object) -> str | None:
    """The business key `list` filters by, checked: `ValueError` for one not a string."""
    if key is None or isinstance(key, str):
        return key
    raise ValueError(f"key must be a string (a saga's business key), got {key!r}")


class Engine:
    """Settings and registry of an orchestrator, and the flows of its verbs (see
    `Orchestrator` for the arguments)."""

    def __init__(
        self,
        database_url: str | None = None,
        *,
        sagas: Iterable[Saga[Any]] = (),
        lease_seconds: float = 10.0,
        heartbeat_seconds: float | None = None,
        auto_migrate: bool = True,
        owner: str | None = None,
        pool_size: int | None = None,
        confirmation_key: str | bytes | None = None,
        retention_days: float = 30.0,
        approval_public_key: approvals.PublicKeyLike
        | Iterable[approvals.PublicKeyLike]
        | None = None,
        telemetry_keys: bool | None = None,
        prepared_statements: bool | None = None,
    ) -> None:
        if not lease_seconds > 0:
            raise ValueError(f"lease_seconds must be positive, got {lease_seconds!r}")
        if heartbeat_seconds is None:
            heartbeat_seconds = lease_seconds / 3.0
        if not 0 < heartbeat_seconds < lease_seconds:
            raise ValueError(
                f"heartbeat_seconds must be positive and below lease_seconds "
                f"({lease_seconds!r}), got {heartbeat_seconds!r}"
            )
        if pool_size is not None and pool_size < 2:
            raise ValueError(f"pool_size must be at least 2, got {pool_size!r}")
        self._explicit_url = database_url
        self._url: str | None = None
        self.lease_seconds = float(lease_seconds)
        self.heartbeat_seconds = float(heartbeat_seconds)
        self.auto_migrate = auto_migrate
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        # Not given: DEFAULT_POOL_SIZE until a worker sizes the pool for its concurrency.
        self._pool_size = DEFAULT_POOL_SIZE if pool_size is None else pool_size
        self._pool_size_given = pool_size is not None
        self.prepared_statements = prepared_statements_setting(prepared_statements)
        # What the first connection told of the way to the server (None until connected).
        self.route: Route | None = None
        if not retention_days >= 0:
            raise ValueError(f"retention_days must not be negative, got {retention_days!r}")
        self.retention_days = float(retention_days)
        key = confirmation_key or os.environ.get(ENV_CONFIRMATION_KEY)
        self._confirmation_key = key.encode("utf-8") if isinstance(key, str) else key
        self.approval_verifier = _approval_verifier(approval_public_key)
        self.telemetry_keys = telemetry.include_keys(telemetry_keys)
        self._registry: dict[tuple[str, int], Saga[Any]] = {}
        # Sagas started here and not yet run here, as their start wrote them: run() claims
        # one and records its first move in one statement (`saga._flows.started`).
        self._started = StartedSagas()
        for saga in sagas:
            self.register(saga)
        self._unconnected()
        # Crash tests arm a fault point in a child process through SAGA_FAULT.
        faults.arm_from_environment()

    def pool_size_for(self, connections: int, current: int) -> int:
        """The pool's new `max_size` when a worker needs `connections`: exactly that when
        `pool_size` was not given (the pool follows the worker's concurrency), else the
        larger of the given size and the need (and never below `current` there)."""
        if not self._pool_size_given:
            return max(2, connections)
        return max(current, self._pool_size, connections)

    def _unconnected(self) -> None:
        """Set the driver's connection state to "not connected yet" (each door has its own)."""

    # ----- set-up ------------------------------------------------------------------------

    @property
    def database_url(self) -> str:
        """The resolved database URL (starts the embedded server when that is the source)."""
        if self._url is None:
            self._url = resolve_database_url(self._explicit_url)
        return self._url

    def __repr__(self) -> str:
        url = self._url or self._explicit_url
        where = describe_url(url) if url else "database not resolved yet"
        return f"<{type(self).__name__} {where} owner={self.owner!r}>"

    def register(self, saga: Saga[Any]) -> None:
        """Make `saga` runnable by this orchestrator and its workers."""
        if not isinstance(saga, Saga):
            raise SagaDefinitionError(f"register() takes a Saga, got {saga!r}")
        if not saga.steps:
            raise SagaDefinitionError(f"saga {saga.name!r} has no steps")
        ident = (saga.name, saga.version)
        existing = self._registry.get(ident)
        if existing is not None and existing is not saga:
            raise SagaDefinitionError(
                f"another saga named {saga.name!r} version {saga.version} is already registered"
            )
        self._registry[ident] = saga

    def registered(self) -> list[Saga[Any]]:
        """The sagas registered with this orchestrator."""
        return list(self._registry.values())

    def definition(self, name: str, version: int) -> Saga[Any]:
        """The registered saga (name, version), or a session's definition (its calls'
        steps are those of the durable steps registered in this process); `NotRegistered`
        otherwise."""
        saga = self._definition_or_none(name, version)
        if saga is None:
            raise NotRegistered(name, version)
        return saga

    def _definition_or_none(self, name: str, version: int) -> Saga[Any] | None:
        code_first = code_first_definition(name)
        if code_first is not None:
            return code_first
        return self._registry.get((name, version))

    def runner_options(
        self, *, max_inline_sleep: float = math.inf, answers: bool = True
    ) -> RunnerOptions:
        """Lease settings of this orchestrator, for runners (`answers`: see
        `RunnerOptions`)."""
        return RunnerOptions(
            owner=self.owner,
            lease_seconds=self.lease_seconds,
            heartbeat_seconds=self.heartbeat_seconds,
            max_inline_sleep=max_inline_sleep,
            approval_verifier=self.approval_verifier,
            telemetry_keys=self.telemetry_keys,
            answers=answers,
        )

    def purge_cutoff_days(self, older_than_days: float | None = None) -> float:
        """How long ago (days) a saga must have ended for `purge` to delete it: the
        retention, or `older_than_days`; `ValueError` when that is shorter."""
        days = self.retention_days if older_than_days is None else older_than_days
        if not days >= self.retention_days:
            raise ValueError(
                f"older_than_days ({days}) is shorter than the retention of "
                f"{self.retention_days} days"
            )
        return days

    def _require_key(self) -> bytes:
        if not self._confirmation_key:
            raise StepStateError(
                "no confirmation key: pass Orchestrator(confirmation_key=...) or set "
                f"{ENV_CONFIRMATION_KEY}; or sign approvals with the approvers' private key "
                "(saga.approvals.ApprovalSigner, `saga confirm --private-key FILE`) and give "
                f"orchestrators the public key ({ENV_APPROVAL_PUBLIC_KEY})"
            )
        return self._confirmation_key

    def _verify_approval(
        self, saga_id: str, step: str, request_hash: str, approval: str
    ) -> approvals.Approval:
        """The approval `confirm` is given, verified: against the approvers' public key
        when this orchestrator has one (an HMAC token is then refused, as its workers
        would refuse it), else against the HMAC confirmation key. `ApprovalRejected` when
        it does not verify; `StepStateError` when there is nothing to verify it with."""
        if self.approval_verifier is not None:
            return self.approval_verifier.verify(
                approval, saga_id=saga_id, step=step, request_hash=request_hash
            )
        if approvals.is_signed(approval):
            raise StepStateError(
                "the approval is signed with an Ed25519 private key, and this orchestrator "
                "has no public key to verify it: pass Orchestrator(approval_public_key=...) "
                f"or set {ENV_APPROVAL_PUBLIC_KEY}"
            )
        return approvals.verify(
            self._require_key(), approval, saga_id=saga_id, step=step, request_hash=request_hash
        )

    def _resolution(
        self,
        state: SagaState,
        step: str,
        *,
        outcome: Literal["succeeded", "failed"],
        result: Any,
        actor: str,
        reason: str | None,
        kind: Literal["action", "compensation"] | None,
    ) -> inputs.Resolve:
        """The request of `resolve` for `state`: `result` validated like the step's (or
        its compensation's) return value; `StepStateError` when the saga has no `step`."""
        definition = self.definition(state.saga, state.version)
        definition.adopt(state.operations)  # a session's calls are its steps
        if definition.is_session:
            # A durable step's name stands for its one unsettled call.
            step = interventions.unsettled_call(state.id, state.operations, step, kind)
        target = definition.step_named(step)
        if target is None:
            raise StepStateError(f"saga {state.saga!r} has no step {step!r}")
        stored = None
        if outcome == "succeeded":
            codec = target.codec
            if kind == "compensation" and target.compensation_op is not None:
                codec = target.compensation_op.codec
            stored = codec.encode(codec.decode(result))
        return inputs.Resolve(step, kind, outcome, stored, actor=actor, reason=reason)

    def _sign_approval(
        self, saga_id: str, step: str, request_hash: str, *, actor: str, ttl_seconds: float
    ) -> str:
        if self.approval_verifier is not None:
            raise StepStateError(
                "this orchestrator requires approvals signed with the approvers' Ed25519 "
                "private key (it has an approval public key), so an HMAC token would be "
                "refused: sign with saga.approvals.ApprovalSigner.from_private_key(...)"
                ".approval(...) or `saga confirm ... --private-key FILE`"
            )
        return approvals.sign(
            self._require_key(),
            saga_id=saga_id,
            step=step,
            request_hash=request_hash,
            actor=actor,
            ttl_seconds=ttl_seconds,
        )

    # ----- flows of the verbs --------------------------------------------------------------

    def _adopt(self, saga: Saga[Any]) -> None:
        """Register `saga` unless a saga of its name and version is registered already
        (`start` of a saga not given to the orchestrator)."""
        if (saga.name, saga.version) not in self._registry:
            self.register(saga)

    def _start_flow(
        self, flows: Flows, saga: Saga[Any], data: BaseModel | dict[str, Any], *, claim: bool
    ) -> Flow[tuple[SagaHandle, tuple[Planner, Next] | None]]:
        """`verbs.start`: whoever drives the saga continues the trace of the code starting
        it."""
        return verbs.start(
            self, flows, saga, data, claim=claim, trace_context=telemetry.capture_context()
        )

    def _upgrade_flow(
        self,
        saga_id: str,
        to_version: int,
        *,
        step_map: dict[str, str],
        actor: str,
        write: bool,
    ) -> Flow[tuple[UpgradePlan, SagaState]]:
        """Plan moving a saga to `to_version` (see `saga.upgrade`) under its row lock and,
        when `write` and the plan allows it, make the move in the same transaction: the
        version, the operations, a `saga_upgraded` event, and a new fence (a holder of an
        expired lease can no longer write). A refused plan writes nothing."""
        verbs.check_id(saga_id)
        made: list[UpgradePlan] = []

        def landed() -> Flow[tuple[UpgradePlan, SagaState]]:
            state: SagaState | None = yield from db(StoreOps.get_state, saga_id)
            assert state is not None
            return made[-1], state

        def attempt(token: str) -> Flow[tuple[UpgradePlan, SagaState]]:
            return self._upgrade_txn(saga_id, to_version, step_map, actor, write, token, made)

        return (yield from verbs.changed_once("upgrade_saga", saga_id, attempt, landed))

    def _upgrade_txn(
        self,
        saga_id: str,
        to_version: int,
        step_map: dict[str, str],
        actor: str,
        write: bool,
        token: str,
        made: list[UpgradePlan],
    ) -> Flow[tuple[UpgradePlan, SagaState]]:
        row, live = yield from verbs.locked(saga_id)
        ops: list[OpRow] = yield from db_txn(StoreOps.operations_txn, saga_id)
        upgrade = plan_upgrade(
            row,
            ops,
            to_version=to_version,
            source=self._registry.get((row.name, row.version)),
            target=self._registry.get((row.name, to_version)),
            step_map=step_map,
            live=live,
        )
        plan = upgrade.plan
        if not write or not plan.allowed:
            state = yield from db_txn(StoreOps.get_state_txn, saga_id)
            yield Commit()
            assert state is not None  # the row is locked in this transaction
            return plan, state
        from_version = row.version
        row.fence = yield from db_txn(
            StoreOps.upgrade_saga_txn, saga_id, to_version, upgrade.drop, upgrade.renames
        )
        row.version, row.lease_owner, row.lease_expires_at = to_version, None, None
        event = Event(
            "saga_upgraded",
            detail={
                "actor": actor,
                "from_version": from_version,
                "to_version": to_version,
                # jsonb orders keys by length: `saga show` gives the actor and versions first.
                "renamed_steps": plan.renamed,
                "upgrade_moves": [m.as_dict() for m in plan.moves],
                "fence": row.fence,
            },
        )
        changes = Write(
            saga=row,
            new_ops=upgrade.new_ops,
            changed_ops=(),
            confirmations=(),
            events=(event,),
            release=True,
            notify=row.status.is_runnable,
            return_state=True,
        )
        made.append(plan)
        read = yield from db_txn(StoreOps.save_txn, changes, owner=None, token=token)
        state = yield Fetch(read)
        yield Commit()
        _log.info(
            "saga_upgraded",
            saga_id=saga_id,
            saga=row.name,
            from_version=from_version,
            to_version=to_version,
            actor=actor,
        )
        assert state is not None  # the row is locked in this transaction
        return plan, state


def upgraded(plan: UpgradePlan, state: SagaState) -> SagaState:
    """The state `upgrade` returns: `state` when `plan` was made; `UpgradeRefused`
    otherwise."""
    if not plan.allowed:
        raise UpgradeRefused(plan)
    return state


def _approval_verifier(
    configured: approvals.PublicKeyLike | Iterable[approvals.PublicKeyLike] | None,
) -> approvals.ApprovalVerifier | None:
    """The verifier of signed approvals: of `approval_public_key`, else of
    `SAGA_APPROVAL_PUBLIC_KEY`, else None (HMAC approvals). A key that cannot be read is
    a `ValueError` naming where it came from, at construction rather than at the first
    confirmation."""
    if configured is not None:
        try:
            return approvals.ApprovalVerifier.from_public_key(configured)
        except ValueError as exc:
            raise ValueError(f"approval_public_key: {exc}") from None
    text = os.environ.get(ENV_APPROVAL_PUBLIC_KEY)
    if text is None:
        return None
    try:
        return approvals.ApprovalVerifier.from_environment(text)
    except ValueError as exc:
        raise ValueError(f"{ENV_APPROVAL_PUBLIC_KEY}: {exc}") from None
