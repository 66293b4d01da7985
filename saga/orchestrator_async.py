"""The orchestrators: start, run, inspect, compensate and resolve sagas on PostgreSQL.

`AsyncOrchestrator` has every verb as a coroutine; `Orchestrator` has the same verbs, and
blocks. `saga/orchestrator_async.py` is the source of both: `saga/orchestrator.py` is
generated from it by `tools/async_to_sync.py`, which keeps the `else:` branch of each
`if True:  # ASYNC` block, where the few lines that differ sit. Their connection, the
verbs that read and the doors they make are their base's (`saga._orchestrator_base_async`);
the flows of their verbs are `saga._flows.verbs`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from saga._actors import actor_or_os_user
from saga._core import inputs
from saga._core.requests import check_actor
from saga._db.database import connection_kwargs, session_options, transaction_settings
from saga._engine import ENV_APPROVAL_PUBLIC_KEY, ENV_CONFIRMATION_KEY, resolve_arguments, upgraded
from saga._flows import verbs
from saga._orchestrator_base_async import AsyncOrchestratorBase
from saga.definition import Saga
from saga.logs import get_logger
from saga.state import SagaHandle, SagaState
from saga.upgrade import UpgradePlan, check_upgrade_arguments

if True:  # ASYNC
    from saga._acompat import sync_only
else:
    from saga._drivers.loopguard import sync_only

_log = get_logger("saga")

__all__ = [
    "ENV_APPROVAL_PUBLIC_KEY",
    "ENV_CONFIRMATION_KEY",
    "connection_kwargs",
    "session_options",
    "transaction_settings",
]
if True:  # ASYNC
    __all__ += ["AsyncOrchestrator"]
else:
    __all__ += ["Orchestrator"]


class AsyncOrchestrator(AsyncOrchestratorBase):
    """Runs registered sagas against one PostgreSQL database.

    An `Orchestrator`'s methods block while they wait for the database and run steps (an
    async step in an event loop of its own). From async code, call them in a thread
    (`await asyncio.to_thread(orch.execute, ...)`): called from a running event loop,
    every method that reads, writes or runs steps raises `SyncCallInEventLoop` before
    doing anything.

    An `AsyncOrchestrator` takes the same arguments, and has every one of those methods
    as a coroutine with the same name, arguments and results; both write the same rows
    and events for the same saga (one protocol, two drivers). Async steps, compensations
    and hooks are awaited on the caller's event loop, so they can share the application's
    clients; sync ones run in a thread and never block the loop. A step's timeout
    cancels an async step. Use it as `async with AsyncOrchestrator(...) as orch:`, or
    `await orch.close()` when done.

    Args:
        database_url: PostgreSQL URL; else `SAGA_DATABASE_URL`; else an embedded
            PostgreSQL started in a local data directory.
        sagas: Sagas to register (the registry is per orchestrator).
        lease_seconds: How long a claim on a saga lasts without renewal; a crashed
            owner's sagas are taken over after it expires (default 10 s).
        heartbeat_seconds: How often a running step's lease is renewed (default a
            third of the lease).
        auto_migrate: Apply pending migrations on first use.
        owner: Name of this lease owner in the database (defaults to host:pid:random).
        pool_size: Most database connections this orchestrator holds at once. Not given,
            10, until a worker sizes the pool for its concurrency: `2 * concurrency + 2`
            for a `Worker` (a transaction and a heartbeat per saga in flight, the claim
            loop), `concurrency + 2` for an `AsyncWorker`. Given, a worker only ever grows
            it to that need.
        confirmation_key: HMAC key that signs and verifies approval tokens
            (`approval`, `confirm`); else `SAGA_CONFIRMATION_KEY`. The weaker mode: the
            token is checked once, by `confirm`, and workers then trust the stored
            confirmation.
        retention_days: Ended sagas are kept at least this long; `purge` deletes
            only those older (default 30).
        approval_public_key: The approvers' Ed25519 public key (PEM, an `ssh-ed25519`
            line, the raw key in base64 as `saga keygen` prints it, a `pathlib.Path` of
            a file holding one, or a list of them during a rotation); else
            `SAGA_APPROVAL_PUBLIC_KEY` (several separated by commas). With it, `confirm`
            takes only approvals signed with the matching private key
            (`saga.approvals.ApprovalSigner`), and before every attempt a confirmation
            releases, the approval stored with it is verified again: a confirmation row
            written by anything else releases nothing. Give it to every worker; the
            private key stays with the approvers.
        prepared_statements: Whether connections use server-side prepared statements
            (psycopg prepares a statement at its sixth execution); else
            `SAGA_PREPARED_STATEMENTS` (`on`, `off`, `auto`). Auto (None, the default)
            uses them on a direct connection and never through a connection pooler,
            detected at the first connection (`route`): a pooler in transaction mode
            hands a prepared statement's name to another client's session. Behind a
            pooler the timeouts of each transaction are set in it (`SET LOCAL`), and
            workers wake on `LISTEN` only on a direct `listen_url` ("Running in
            production" in the manual).
        telemetry_keys: OpenTelemetry spans carry the saga's key and tenant, and each
            operation's idempotency key and request hash (they can carry personal data,
            so they are left out by default); else `SAGA_OTEL_INCLUDE_KEYS=1`. Traces
            and metrics need the `otel` extra and an SDK the application configures.
    """

    # ----- starting ----------------------------------------------------------------------

    @sync_only()
    async def start(self, saga: Saga[Any], data: BaseModel | dict[str, Any]) -> SagaHandle:
        """Create a saga instance, idempotently on (tenant, saga name, key).

        The same call twice returns the same saga. The same key with a different
        request (business fields) raises `IdempotencyConflict` and stores nothing.
        Invalid input raises pydantic's `ValidationError` before anything is written.

        Starts made at the same time on this orchestrator share one statement and one
        commit (group commit), each answered alone; a start that finds none on the wire
        goes out at once.
        """
        runner = await self.runner()
        handle, _ = await runner.run(self._start_flow(runner.flows, saga, data, claim=False))
        return handle

    @sync_only(runs_steps=True)
    async def execute(self, saga: Saga[Any], data: BaseModel | dict[str, Any]) -> SagaState:
        """Start a saga and drive it here: `start` then `run`, one commit cheaper.

        The new saga is created already leased to this orchestrator with its first
        attempt recorded, in one transaction. When the saga already exists (the
        same request again), this is `run` on it.
        """
        runner = await self.runner()
        handle, claimed = await runner.run(self._start_flow(runner.flows, saga, data, claim=True))
        if claimed is None:
            return await self.run(handle.id)
        return await runner.drive(*claimed) or await self.get(handle.id)

    # ----- driving -----------------------------------------------------------------------

    @sync_only(runs_steps=True)
    async def run(self, saga_id: str, *, wait_seconds: float = 0.0) -> SagaState:
        """Drive a saga here until it is completed, compensated or parked.

        A terminal saga is returned as is, calling nothing. A saga whose lease another
        live owner holds is waited for up to `wait_seconds` (a dead owner's lease ends
        `lease_seconds` after its last heartbeat): as soon as it can be claimed it is
        driven here; if the lease outlasts the wait, or the holder parks or finishes the
        saga meanwhile, its current state is returned (`lease_owner` and
        `lease_expires_at` say who holds it and until when).

        A saga this orchestrator has just started (one of its newest 256 starts) is
        claimed with its first attempt in one statement, planned from what the start
        wrote, while the saga is still exactly as started; any other is read as it is
        claimed.
        """
        runner = await self.runner()
        return await runner.run(verbs.run(self, runner.flows, saga_id, wait_seconds))

    @sync_only()
    async def raise_ceilings(
        self,
        saga_id: str,
        *,
        actor: str,
        max_operations: int | None = None,
        spend_budget: float | None = None,
        max_side_effects: int | None = None,
        extend_deadline_seconds: float | None = None,
        force: bool = False,
    ) -> SagaState:
        """Raise a saga's persisted ceilings (lowering is refused) and, if it was parked,
        make it runnable again; recorded as `ceilings_raised` with the before and after.
        The saga is not driven here: call `run` or leave it to a worker.

        A ceiling the saga does not have is unlimited, the highest there is: setting
        one (even `max_operations=1`) would lower it, and is refused (`StepStateError`)
        like any lowering, writing nothing. `actor` is who makes the change, recorded in
        the audit trail; an empty or blank one is refused (`ValueError`).
        """
        check_actor("raise_ceilings", actor)
        request = inputs.RaiseCeilings(
            actor=actor,
            max_operations=max_operations,
            spend_budget=spend_budget,
            max_side_effects=max_side_effects,
            extend_deadline_seconds=extend_deadline_seconds,
        )
        return await self._drive(
            verbs.operator_change(self, saga_id, request, force=force, actor=actor)
        )

    # ----- confirmations -----------------------------------------------------------------

    async def approval(
        self,
        saga_id: str,
        step: str,
        request_hash: str,
        *,
        actor: str,
        ttl_seconds: float = 600.0,
    ) -> str:
        """Sign an HMAC approval token for exactly this saga, step and request hash (the
        `request_hash` of the preview approved, see `preview`) with the confirmation key.

        Whoever holds the confirmation key can approve: give it to the approvers'
        tooling, not to the processes that run step code. `actor` is who approves,
        recorded when the approval is used; an empty or blank one is refused
        (`ValueError`). An orchestrator with an `approval_public_key` refuses HMAC
        approvals, so this raises `StepStateError` there: sign with
        `saga.approvals.ApprovalSigner` instead.
        """
        check_actor("approval", actor)
        return self._sign_approval(
            saga_id, step, request_hash, actor=actor, ttl_seconds=ttl_seconds
        )

    @sync_only()
    async def confirm(self, saga_id: str, step: str, request_hash: str, approval: str) -> SagaState:
        """Resume a saga waiting in `awaiting_confirmation` with a signed approval.

        The approval must be signed with the approvers' private key when this
        orchestrator has an `approval_public_key` (`ApprovalSigner.approval`), else with
        its HMAC confirmation key (`approval`), and bound to this saga, step and the
        exact pending request hash, and neither the token nor the confirmation may have
        expired (`ApprovalRejected` otherwise). The approval is stored with the
        confirmation; workers with the public key verify it again before the attempt it
        releases, and refuse it (the saga awaits a new confirmation) when it does not
        verify. One approval releases one attempt: the attempt it releases uses it up
        when it starts, and any retry of the step (after a failure, an unknown outcome,
        a reconcile's Absent, an operator's retry) asks for a new confirmation. On
        resume the step's request is prepared again; if anything previewed changed, or
        the confirmation expired before the attempt could start, a new confirmation is
        asked for instead. The saga is not driven here: call `run` or leave it to a
        worker.
        """
        granted = self._verify_approval(saga_id, step, request_hash, approval)
        # Approving runs no step code, so the approvers' tooling need not register the saga.
        request = inputs.Approve(step, request_hash, actor=granted.actor, approval=approval)
        return await self._drive(
            verbs.operator_change(self, saga_id, request, actor=granted.actor, registered=False)
        )

    # ----- retention ---------------------------------------------------------------------

    @sync_only()
    async def purge(self, *, older_than_days: float | None = None, batch_size: int = 1000) -> int:
        """Delete completed, compensated and forked sagas that ended longer ago than the retention
        (or `older_than_days`, which may only be longer), in batches; returns how many.

        Sagas that are pending, running, compensating, parked or awaiting confirmation
        are never deleted, and neither are their operations.
        """
        days = self.purge_cutoff_days(older_than_days)
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        store = await self._connected()
        total = 0
        while True:
            deleted = await store.purge_finished(
                retention_seconds=days * 86400.0, batch_size=batch_size
            )
            total += deleted
            if deleted < batch_size:
                break
        _log.info("sagas_purged", count=total, older_than_days=days)
        return total

    @sync_only(runs_steps=True)
    async def compensate(
        self,
        saga_id: str,
        *,
        include_unknown: bool = False,
        actor: str | None = None,
        force: bool = False,
    ) -> SagaState:
        """Compensation-only recovery: undo what succeeded, in reverse, running no further step.

        A step whose outcome is still unknown stops the compensation there (the saga
        stays in needs_review saying so) unless `include_unknown=True`, in which case
        its compensation runs with `result=None`. A saga a live worker holds is refused
        (`StepStateError`) unless `force=True`, which takes its lease over.

        `actor` is who asks, recorded in the audit trail; None records the OS user
        running the call, and an empty or blank one is refused (`ValueError`).
        """
        actor = actor_or_os_user("compensate", actor)
        request = inputs.RequestCompensation(actor=actor, include_unknown=include_unknown)
        state = await self._drive(
            verbs.operator_change(self, saga_id, request, force=force, actor=actor)
        )
        return await self.run(state.id)

    @sync_only()
    async def resolve(
        self,
        saga_id: str,
        step: str,
        *,
        outcome: Literal["succeeded", "failed"],
        result: Any = None,
        actor: str,
        reason: str | None = None,
        kind: Literal["action", "compensation"] | None = None,
        force: bool = False,
    ) -> SagaState:
        """Settle an operation a human has checked, and make the saga runnable again.

        `outcome="succeeded"` records `result` (validated like a step's return value);
        `outcome="failed"` records the failure, so the next run compensates. The saga
        is not driven here: call `run` or leave it to a worker. `force=True` takes over
        the lease of a live worker instead of refusing. `actor` is who checked and
        settled the step, recorded in the audit trail; an empty or blank one is refused
        (`ValueError`). In a session, `step` is a call's name (`saga show` lists them),
        or the durable step's name when exactly one call of it is unsettled (several:
        `StepStateError` listing them).

        `outcome="succeeded"` on a step an operator resolved as succeeded before amends
        its result, until the step's compensation starts (recorded as `result_amended`
        with the actor, the old and the new result); a result a provider call returned,
        or one a compensation has received, is refused (`StepStateError`).
        """
        resolve_arguments(outcome, actor)
        state = await self.get(saga_id)
        request = self._resolution(
            state, step, outcome=outcome, result=result, actor=actor, reason=reason, kind=kind
        )
        return await self._drive(
            verbs.operator_change(self, state.id, request, force=force, actor=actor)
        )

    @sync_only()
    async def retry(
        self,
        saga_id: str,
        *,
        extra_attempts: int = 0,
        actor: str | None = None,
        force: bool = False,
    ) -> SagaState:
        """Resume a parked saga after a fix, at the operation it stopped at.

        That operation's ceiling is raised by `extra_attempts`; the attempts it has
        made still count, so a retry past the ceiling needs extra attempts. An
        unknown outcome is settled again (reconcile hook or idempotent retry); one
        that is neither idempotent nor reconcilable is refused: resolve it instead.
        The request is recorded as `retry_requested` with `actor`, who asks (None: the
        OS user running the call; an empty or blank one is refused, `ValueError`). The
        saga is not driven here: call `run` or leave it to a worker.
        """
        if extra_attempts < 0:
            raise ValueError(f"extra_attempts must not be negative, got {extra_attempts}")
        actor = actor_or_os_user("retry", actor)
        request = inputs.RequestRetry(extra_attempts=extra_attempts, actor=actor)
        return await self._drive(
            verbs.operator_change(self, saga_id, request, force=force, actor=actor)
        )

    @sync_only()
    async def fork(
        self, saga_id: str, from_step: str, *, key: str | None = None, actor: str | None = None
    ) -> SagaHandle:
        """Continue a parked saga as a new one that runs from `from_step` on.

        The fork inherits the stored results of every step before `from_step` without
        calling them, and runs the rest under keys of its own; it is created `pending`
        (call `run`, or leave it to a worker) and records `forked_from`. The source
        becomes `forked`: final, its effects the fork's to compensate. Refused
        (`StepStateError` naming the step, nothing changed) unless the source is parked
        going forward or finished (completed or compensated), every step before
        `from_step` succeeded and was not compensated (an unknown one is reconciled or
        resolved first), and none from `from_step` on has an effect the fork would
        repeat: each took none, is declared `side_effect=False`, or was compensated.
        That is how a finished run's step N+1 is refined without paying for steps 1..N
        again. `key` defaults to `"<source key>:fork:<from_step>"`; asking again
        returns the same fork.

        A session forks from one of its calls (`from_step` is the call's name, or a
        durable step's name the session called once): the fork is a new session keyed
        `key` whose code, run under that run id, replays the calls before `from_step`
        and makes the rest. A session a live process holds is refused; a closed one
        follows the rule of finished sagas; a failed call before `from_step` is
        inherited as failed.
        """
        actor = actor_or_os_user("fork", actor)
        return await self._drive(verbs.fork(self, saga_id, from_step, key=key, actor=actor))

    @sync_only()
    async def upgrade(
        self,
        saga_id: str,
        to_version: int,
        *,
        step_map: dict[str, str] | None = None,
        actor: str,
    ) -> SagaState:
        """Move a saga in flight that no worker holds to `to_version` of its definition.

        Allowed when both versions are registered with this orchestrator and every
        operation that took effect (succeeded, or running or unknown: it may have) maps,
        in order, onto a step of `to_version` with the same compensation contract (a
        compensation where it had one, none where it had none, a pivot where it was
        one). An operation maps onto the step of the same name, or the one `step_map`
        names (`{"old_name": "new_name"}`). Operations that were attempted keep their
        rows and their idempotency keys as stored (the keys the provider saw, which name
        the old version), so a step that succeeded is never run again and a reconcile or
        retry is the same request; steps not yet attempted run the new version's code
        under its keys (see `saga.upgrade`). The saga keeps its status: a parked one is
        resumed with `retry`.

        One transaction, under the saga's row lock: the fence grows, so the holder of an
        expired lease can no longer write, and a `saga_upgraded` event records `actor`
        and both versions. Refused (`UpgradeRefused`, a `StepStateError`, with the
        reasons in its `plan`; nothing written) otherwise, and when a live lease holds
        the saga (never taken over). `upgrade_plan` gives the verdict without writing.
        """
        step_map = check_upgrade_arguments(to_version, step_map)
        actor = check_actor("upgrade", actor)
        flow = self._upgrade_flow(saga_id, to_version, step_map=step_map, actor=actor, write=True)
        plan, state = await self._drive(flow)
        return upgraded(plan, state)

    @sync_only()
    async def upgrade_plan(
        self, saga_id: str, to_version: int, *, step_map: dict[str, str] | None = None
    ) -> UpgradePlan:
        """What `upgrade` would do with the saga now, and whether it would be refused
        (`plan.reasons`); nothing is written."""
        step_map = check_upgrade_arguments(to_version, step_map)
        flow = self._upgrade_flow(saga_id, to_version, step_map=step_map, actor="", write=False)
        plan, _ = await self._drive(flow)
        return plan

    @sync_only()
    async def cancel(
        self,
        saga_id: str,
        *,
        reason: str,
        actor: str | None = None,
        include_unknown: bool = False,
        force: bool = False,
    ) -> SagaState:
        """Stop a saga's forward progress and compensate what succeeded, in reverse.

        Recorded as `cancel_requested` with the reason and actor, which also becomes
        the saga's `error`. A completed saga, or one past a succeeded pivot step, is
        refused (`StepStateError`); one already compensating (or compensated) is
        returned unchanged, unless `include_unknown=True` adds compensations for its
        steps of unknown outcome, as `compensate(include_unknown=True)` does; this also
        resumes a saga parked while compensating at such a step. A compensation run for a
        step of unknown outcome gets `result=None`.
        The saga is not driven here: call `run` or leave it to a worker. `actor` is
        who asks (None: the OS user running the call; an empty or blank one is
        refused, `ValueError`).
        """
        if not reason:
            raise ValueError("cancel() needs a reason")
        actor = actor_or_os_user("cancel", actor)
        request = inputs.RequestCancel(reason=reason, actor=actor, include_unknown=include_unknown)
        return await self._drive(
            verbs.operator_change(self, saga_id, request, force=force, actor=actor)
        )
