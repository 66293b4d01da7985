"""The `saga` command's verbs: one function per command, each taking the parsed arguments
and returning the exit code (`COMMANDS`); the long-running ones are in `saga.cli.serve`."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import pydantic

from saga._actors import os_user
from saga._app import ENV_APP, UsageError, blocking, load_app
from saga._core.requests import AmbiguousCall
from saga._db.database import check_connection, resolve_database_url
from saga._db.migrate import migrate_database
from saga._db.roles import grant_role, role_kind
from saga.approvals import ApprovalSigner
from saga.cli import admin
from saga.cli import format as fmt
from saga.cli.parser import DEFAULT_RETENTION_DAYS, EXIT_OK, EXIT_PARTIAL
from saga.cli.serve import run_dashboard, run_worker
from saga.errors import NotRegistered, StepStateError
from saga.orchestrator import ENV_APPROVAL_PUBLIC_KEY, Orchestrator
from saga.session import LEDGER_PREFIX, SESSION_PREFIX
from saga.state import SagaState, SagaStatus
from saga.upgrade import UpgradePlan, UpgradeRefused


def _actor(args: argparse.Namespace) -> str:
    actor = getattr(args, "actor", None)
    if actor is None:
        return os_user()
    if not actor.strip():
        raise UsageError(
            f"--actor {actor!r} names nobody: give who runs this (a person or a system), "
            "for the saga's audit trail, or leave it out to use your OS user"
        )
    return str(actor)


def _reader(database_url: str | None) -> Orchestrator:
    # Read-only commands never migrate: a missing schema is reported instead.
    return Orchestrator(database_url or None, auto_migrate=False)


def _operator(args: argparse.Namespace, *, runs_code: bool = True) -> Orchestrator:
    actor = _actor(args)  # a blank --actor is refused before the app is even loaded
    if args.app or runs_code:
        orch = blocking(load_app(args.app, args.database_url))
    else:
        # A change that runs no code of the app (settling a ledger call, say) needs none.
        orch = Orchestrator(args.database_url or None, auto_migrate=False)
    # Leases this command takes are named after who ran it, in the audit trail too.
    orch.owner = f"saga-cli:{actor}@{socket.gethostname()}:{os.getpid()}"
    return orch


def _full_id(orch: Orchestrator, args: argparse.Namespace) -> str:
    """The saga id given, expanded from a unique prefix (`saga show 6f0c`) or a business
    key (`saga show crashB-013`); see `admin.expand_id` for the precedence."""
    args.saga_id = admin.expand_id(orch.store, args.saga_id)
    return str(args.saga_id)


def _selected(
    orch: Orchestrator, args: argparse.Namespace, *, key: str | None = None
) -> list[SagaState]:
    """The sagas the selection flags pick (`--status`, `--saga`, `--tenant`, `--limit`,
    `--older-than` in seconds), newest first: what `saga list` shows and what a batch
    `saga compensate` acts on; `key` narrows it to one business key."""
    from datetime import timedelta

    return orch.list(
        status=args.status,
        saga=args.saga,
        tenant=args.tenant,
        limit=args.limit,
        older_than=None if args.older_than is None else timedelta(seconds=args.older_than),
        key=key,
    )


def given_flags(args: argparse.Namespace) -> dict[str, object]:
    """The flags of this run that messages might otherwise suggest, with their values."""
    return {
        "--include-unknown": getattr(args, "include_unknown", False),
        "--extra-attempts": getattr(args, "extra_attempts", 0),
        "--force": getattr(args, "force", False),
    }


# ----- commands ------------------------------------------------------------------------


def _migrate(args: argparse.Namespace) -> int:
    url = resolve_database_url(args.database_url)
    check_connection(url)
    applied = migrate_database(url)
    if applied:
        print(f"applied migrations: {', '.join(f'{v:04d}' for v in applied)}")
    else:
        print("schema is up to date")
    return EXIT_OK


def _grant(args: argparse.Namespace) -> int:
    url = resolve_database_url(args.database_url)
    check_connection(url)
    kind = role_kind(args.kind)
    grant_role(url, kind, args.role)
    print(f"granted {kind} privileges on the saga schema to {args.role}")
    return EXIT_OK


def _list(args: argparse.Namespace) -> int:
    with _reader(args.database_url) as orch:
        states = _selected(orch, args, key=args.key)
        known = {kind for worker in orch.workers() for kind in worker.kinds}
    if args.json:
        for state in states:
            print(fmt.to_json(state, known_kinds=known))
    elif states:
        print(fmt.saga_list(states, known))
    else:
        print("no sagas match", file=sys.stderr)
    return EXIT_OK


def _show(args: argparse.Namespace) -> int:
    if args.json and args.format not in (None, "json"):
        raise UsageError(f"--json and --format {args.format} ask for two formats; give one")
    form = "json" if args.json else args.format or "text"
    with _reader(args.database_url) as orch:
        state = orch.get(_full_id(orch, args))
        history = orch.history(state.id)
    if form == "json":
        print(fmt.to_json(state, history))
    elif form == "mermaid":
        print(fmt.mermaid(state, history))
    else:
        print(fmt.show(state, history))
    return EXIT_OK


def _history(args: argparse.Namespace) -> int:
    with _reader(args.database_url) as orch:
        state = orch.get(_full_id(orch, args))
        history = orch.history(state.id)
    print(fmt.history_json(state, history) if args.json else fmt.history(state, history))
    return EXIT_OK


def _compensate(args: argparse.Namespace) -> int:
    batch_only = [
        ("--status", args.status),
        ("--saga", args.saga),
        ("--tenant", args.tenant),
        ("--older-than", args.older_than),
    ]
    if args.saga_id and args.status:
        raise UsageError("give either a saga ID or --status for a batch, not both")
    if args.saga_id is None and args.status is None:
        raise UsageError("give a saga ID, or select a batch with --status (e.g. needs_review)")
    if args.saga_id is not None:
        extra = [flag for flag, value in batch_only if value is not None]
        if extra:
            raise UsageError(f"{', '.join(extra)} select a batch; they do not go with a saga ID")
    orch = _operator(args)
    actor = _actor(args)
    with orch:
        if args.saga_id is not None:
            states = [orch.get(_full_id(orch, args))]
        else:
            states = _selected(orch, args)
        batch = args.saga_id is None
        if args.dry_run:
            plans = admin.dry_run(
                orch, states, include_unknown=args.include_unknown, force=args.force, batch=batch
            )
            print("\n".join(fmt.plan_json(plans)) if args.json else fmt.plan(plans))
            return EXIT_OK
        if batch and not states and not args.json:
            print("compensate: no sagas match; nothing to do")
            return EXIT_OK
        progress = fmt.ProgressLine("compensating")
        show = _outcome_printer(args, progress)

        report = admin.compensate_batch(
            orch,
            states,
            include_unknown=args.include_unknown,
            actor=actor,
            force=args.force,
            batch=batch,
            progress=progress,
            on_outcome=show,
        )
        progress.clear()
    if args.json:
        print(fmt.summary_json(report, "compensate"))
    else:
        print(fmt.summary(report, "compensate"))
    return EXIT_OK if report.complete else EXIT_PARTIAL


def _outcome_printer(
    args: argparse.Namespace, progress: fmt.ProgressLine
) -> Callable[[admin.Outcome], None]:
    """How a batch job prints each saga's outcome: a text line, or a JSON line."""
    given = given_flags(args)

    def show(outcome: admin.Outcome) -> None:
        progress.clear()
        if args.json:
            print(fmt.outcome_json(outcome, given), flush=True)
        else:
            print(fmt.outcome_line(outcome, given), flush=True)

    return show


def _resolve(args: argparse.Namespace) -> int:
    if args.failed and not args.reason:
        raise UsageError("--failed needs --reason TEXT saying why")
    if args.failed and args.result is not None:
        raise UsageError("--result goes with --succeeded, not --failed")
    result: Any = None
    if args.result is not None:
        try:
            result = json.loads(args.result)
        except json.JSONDecodeError as exc:
            raise UsageError(f"--result is not valid JSON: {exc}") from None
    orch = _operator(args, runs_code=args.run)
    actor = _actor(args)
    outcome: Literal["succeeded", "failed"] = "succeeded" if args.succeeded else "failed"
    with orch:
        saga_id = _full_id(orch, args)
        try:
            state = orch.resolve(
                saga_id,
                args.step,
                outcome=outcome,
                result=result,
                actor=actor,
                reason=args.reason,
                kind=args.kind,
                force=args.force,
            )
        except pydantic.ValidationError as exc:
            raise UsageError(f"--result does not fit step {args.step!r}: {_errors(exc)}") from None
        except AmbiguousCall as exc:
            raise UsageError(str(exc)) from None
        except NotRegistered as exc:
            if args.app:
                raise
            raise UsageError(
                f"pass --app MODULE[:ATTR] (or set {ENV_APP}) naming the module that "
                f"registers saga {exc.name!r} version {exc.version}: its steps' results are "
                "checked by your code"
            ) from None
        last = orch.history(state.id)[-1]
        if last.event == "result_amended":
            print(
                f"amended the result of {last.step!r} of saga {state.id}, by {actor}: "
                f"{fmt.one_line(json.dumps(last.detail.get('previous_result'), default=str))} -> "
                f"{fmt.one_line(json.dumps(last.detail.get('result'), default=str))}"
            )
        else:
            print(f"resolved {args.step!r} of saga {state.id} as {outcome}, by {actor}")
        if args.succeeded and args.result is None:
            _warn_null_result(orch, state, args.step, args.kind)
        return _after_request(orch, state, args.run, given_flags(args))


def _warn_null_result(orch: Orchestrator, state: SagaState, step: str, kind: str | None) -> None:
    """A step resolved as succeeded without --result has the result null, which its
    compensation receives: say so when it has one."""
    try:
        op = state.operation(step, "compensation" if kind == "compensation" else "action")
    except KeyError:
        return
    if op.kind != "action" or op.result is not None:
        return  # the compensation itself was resolved, or the step has its result
    declared = orch.definition(state.saga, state.version).step_named(step)
    comp = None if declared is None else declared.compensation_op
    if comp is None:
        return
    name = getattr(comp.fn, "__name__", "compensation")
    print(
        f"saga: warning: {step!r} is resolved as succeeded without --result, so its "
        f"compensation {name!r} will receive null as the step's result if the saga is "
        "compensated; if it needs one, give what the provider returned before then: "
        f"saga resolve {state.id} {step} --succeeded --result JSON",
        file=sys.stderr,
    )


def _retry(args: argparse.Namespace) -> int:
    orch = _operator(args)
    actor = _actor(args)
    raising = {
        "max_operations": args.max_operations,
        "spend_budget": args.spend_budget,
        "max_side_effects": args.max_side_effects,
        "extend_deadline_seconds": args.extend_deadline,
    }
    if any(v is not None for v in raising.values()):
        if args.extra_attempts:
            raise UsageError("--extra-attempts and the saga ceiling options go in two runs")
        with orch:
            state = orch.raise_ceilings(
                _full_id(orch, args), actor=actor, force=args.force, **raising
            )
            given = ", ".join(f"{k}={v:g}" for k, v in raising.items() if v is not None)
            print(f"raised ceilings of saga {state.id}, by {actor}: {given}")
            return _after_request(orch, state, args.run, given_flags(args))
    with orch:
        state = orch.retry(
            _full_id(orch, args),
            extra_attempts=args.extra_attempts,
            actor=actor,
            force=args.force,
        )
        last = next(e for e in reversed(orch.history(state.id)) if e.event == "retry_requested")
        what = last.step if last.kind == "action" else f"compensation of {last.step}"
        print(
            f"retrying {what!r} of saga {state.id}, by {actor}: "
            f"ceiling {last.detail.get('previous_max_attempts')} -> "
            f"{last.detail.get('max_attempts')}, {last.attempt or 0} attempt(s) used"
        )
        return _after_request(orch, state, args.run, given_flags(args))


def _cancel(args: argparse.Namespace) -> int:
    orch = _operator(args)
    actor = _actor(args)
    with orch:
        before = orch.get(_full_id(orch, args))
        if before.status is SagaStatus.COMPENSATED:
            raise StepStateError(_nothing_to_cancel(before))
        planned = admin.cancel_plan(orch, before, include_unknown=args.include_unknown)
        preview = _cancel_preview(planned, include_unknown=args.include_unknown)
        why = admin.refusal(orch, before, force=args.force, batch=False) if preview else None
        if why is not None:  # refused anyway: no warning, and no question asked
            raise StepStateError(why)
        for line in preview:
            print(line, flush=True)
        parks = planned is not None and planned.stop is not None
        if parks and not args.yes and not _confirmed(f"cancel saga {before.id} anyway? [y/N] "):
            print(f"cancel: nothing was changed; saga {before.id} is {before.status}")
            return EXIT_PARTIAL
        state = orch.cancel(
            before.id,
            reason=args.reason,
            actor=actor,
            include_unknown=args.include_unknown,
            force=args.force,
        )
        if state.status == SagaStatus.COMPENSATED:
            # Compensated meanwhile (a cancel itself drives nothing): as above.
            raise StepStateError(_nothing_to_cancel(state))
        if before.status == state.status and before.updated_at == state.updated_at:
            print(f"saga {state.id} is already {state.status}; nothing to cancel")
        else:
            print(f"cancelled saga {state.id}, by {actor}: {args.reason}")
        return _after_request(orch, state, args.run, given_flags(args))


def _nothing_to_cancel(state: SagaState) -> str:
    """A compensated saga is refused as a completed one is: it has ended."""
    return (
        f"saga {state.id} is compensated: it has ended and what it did is undone, so there "
        "is nothing to cancel"
    )


def _confirmed(question: str) -> bool:
    """The operator's yes on a terminal; `UsageError` when there is none to ask on."""
    if not (sys.stdin.isatty() and sys.stderr.isatty()):
        raise UsageError(
            "this cancel would leave the saga parked in needs_review (see above) and there "
            "is no terminal to confirm it on: pass --yes to cancel anyway; nothing was changed"
        )
    print(question, end="", file=sys.stderr, flush=True)
    try:
        answer = sys.stdin.readline()
    except KeyboardInterrupt:
        answer = ""
    return answer.strip().lower() in ("y", "yes")


def _fork(args: argparse.Namespace) -> int:
    orch = _operator(args)
    actor = _actor(args)
    with orch:
        source = _full_id(orch, args)
        # The same fork asked for again (same step and key) is returned, not made twice.
        handle = orch.fork(source, args.from_step, key=args.key, actor=actor)
        if args.json:
            print(
                json.dumps(
                    {
                        "id": handle.id,
                        "key": handle.key,
                        "created": handle.created,
                        "forked_from": source,
                        "from_step": args.from_step,
                    },
                    separators=(",", ":"),
                )
            )
            return EXIT_OK
        print(handle.id)
        if handle.created and handle.saga.startswith(SESSION_PREFIX):
            print(
                f"session {handle.id} was forked from {source} at call {args.from_step!r}, by "
                f"{actor}: it is pending; run the session's code with run id {handle.key!r} "
                "to continue it"
            )
        elif handle.created:
            print(
                f"saga {handle.id} was forked from {source} at step {args.from_step!r}, by "
                f"{actor}: it is pending, a worker will drive it"
            )
        else:
            status = orch.get(handle.id).status
            print(
                f"saga {source} was already forked to {handle.id} at step "
                f"{args.from_step!r} (key {handle.key}); nothing changed, the fork is {status}"
            )
        return EXIT_OK


def _cancel_preview(planned: admin.PlannedSaga | None, *, include_unknown: bool) -> list[str]:
    """What a cancel will do, said before it acts: the compensations that will get None
    as a step's result, and, when its compensation will stop, what it undoes before the
    saga parks, and why. Nothing when it runs to the end with every result."""
    if planned is None:
        return []
    lines = [
        f"cancel: warning: {fmt.null_result_warning(planned.saga_id, step, name)}"
        for step, name in planned.null_results
    ]
    if planned.stop is not None:
        undo = ", ".join(repr(step) for step, _ in planned.compensations)
        runs = (
            f"it will run the compensations of {undo}, then" if undo else "it will undo nothing and"
        )
        lines.insert(
            0,
            f"cancel: {runs} the saga will park in needs_review: "
            + fmt.cli_wording(planned.stop, {"--include-unknown": include_unknown}).replace(
                "compensate with --include-unknown", "cancel with --include-unknown"
            ),
        )
    return lines


def _preview(args: argparse.Namespace) -> int:
    with _reader(args.database_url) as orch:
        state = orch.get(_full_id(orch, args))
        pending = orch.preview(state.id)
    if pending is None:
        print(f"saga {state.id} is {state.status}: it waits for no confirmation")
        return EXIT_PARTIAL
    if args.json:
        print(pending.model_dump_json())
        return EXIT_OK
    view = pending.preview
    print(f"saga {state.id} ({state.saga} v{state.version}, key {state.key})")
    print(f"  waits for confirmation of {view.get('target')} until {pending.expires_at}")
    print(f"  request hash: {pending.request_hash}")
    print(f"  attempt:      {view.get('attempt')} (an approval releases this attempt only)")
    print(f"  amount:       {view.get('amount')}")
    print(f"  payload:      {json.dumps(view.get('payload'), sort_keys=True)}")
    if "input" in view:
        print(f"  input:        {json.dumps(view['input'], sort_keys=True)}")
    if view.get("results"):
        print(f"  results:      {json.dumps(view['results'], sort_keys=True)}")
    for check in view.get("policy_checks", []):
        print(f"  check:        {json.dumps(check, sort_keys=True)}")
    print(f"approve with: saga confirm {state.id} {pending.step} {pending.request_hash}")
    return EXIT_OK


def _confirm(args: argparse.Namespace) -> int:
    # A key file that cannot be read is refused before the app is loaded.
    signer = None if args.private_key is None else _signer(args.private_key)
    orch = _operator(args)
    actor = _actor(args)
    with orch:
        saga_id = _full_id(orch, args)
        if signer is None:
            token = orch.approval(saga_id, args.step, args.request_hash, actor=actor)
        else:
            token = signer.approval(saga_id, args.step, args.request_hash, actor=actor)
        state = orch.confirm(saga_id, args.step, args.request_hash, token)
        print(f"confirmed {args.step!r} of saga {state.id}, request {args.request_hash}")
        signed = "" if signer is None else f", signed with key {signer.key_id}"
        print(f"approved by {actor}{signed}")
        return _after_request(orch, state, args.run, given_flags(args))


def _signer(path: str) -> ApprovalSigner:
    """The approvers' signer of the private key in the file `path`; `UsageError` saying
    what is wrong with it."""
    try:
        return ApprovalSigner.from_private_key(Path(path))
    except ValueError as exc:
        raise UsageError(f"--private-key {path}: {exc}") from None


def _keygen(args: argparse.Namespace) -> int:
    signer = ApprovalSigner.generate()
    path = Path(args.private_key)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if args.overwrite else os.O_EXCL)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        raise UsageError(
            f"--private-key {path} exists already: keep that key, or pass --overwrite to "
            "replace it (approvals it signed are then refused by workers given the new key)"
        ) from None
    except OSError as exc:
        raise UsageError(f"--private-key {path}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "w", encoding="ascii") as out:
        os.fchmod(out.fileno(), 0o600)  # also when an existing file is replaced
        out.write(signer.private_key_pem())
    print(signer.public_key)
    print(
        f"wrote the private key {signer.key_id} to {path}: keep it with the approvers "
        f"(saga confirm ID STEP HASH --private-key {path}). Give the public key above to "
        f"every worker and to the app: {ENV_APPROVAL_PUBLIC_KEY}=<public key> or "
        "Orchestrator(approval_public_key=...)",
        file=sys.stderr,
    )
    return EXIT_OK


def _purge(args: argparse.Namespace) -> int:
    app = blocking(load_app(args.app, args.database_url)) if args.app else None
    days, source = _purge_cutoff(args, None if app is None else app.retention_days)
    verb = "dry run: would purge" if args.dry_run else "purging"
    print(f"{verb} sagas that ended more than {days:g} days ago ({source})", file=sys.stderr)
    # The app's own Orchestrator purges with its retention; else one with the chosen one.
    retention = DEFAULT_RETENTION_DAYS if args.retention_days is None else args.retention_days
    orch = app or Orchestrator(
        args.database_url or None, auto_migrate=False, retention_days=retention
    )
    with orch:
        if args.dry_run:
            found, total = admin.purge_candidates(orch, older_than_days=days, limit=args.limit)
            if args.json:
                print("\n".join(fmt.purge_json(found, total)))
            else:
                print(fmt.purge_list(found, total))
            return EXIT_OK
        deleted = orch.purge(older_than_days=days, batch_size=args.batch_size)
    if args.json:
        summary = {"summary": True, "command": "purge", "purged": deleted, "older_than_days": days}
        print(json.dumps(summary, separators=(",", ":")))
    else:
        print(f"purged {deleted} ended saga(s)")
    return EXIT_OK


def _purge_cutoff(args: argparse.Namespace, app_retention: float | None) -> tuple[float, str]:
    """The age in days past which `purge` deletes an ended saga, and where it comes from:
    --older-than, else --retention-days, else the app's retention_days, else the default.
    Neither option may go below the app's retention (nor --older-than below the
    retention)."""
    if app_retention is None:
        retention = DEFAULT_RETENTION_DAYS
        source = "the default retention; --app applies your app's retention_days"
    else:
        retention = app_retention
        source = f"retention_days of the app's orchestrator, {args.app}"
    if args.retention_days is not None:
        if app_retention is not None and args.retention_days < app_retention:
            raise UsageError(
                f"--retention-days {args.retention_days:g} is shorter than the retention of "
                f"{app_retention:g} days of the app's orchestrator ({args.app}): purge never "
                "deletes what the app keeps"
            )
        retention, source = args.retention_days, "--retention-days"
    if args.older_than is None:
        return retention, source
    days = args.older_than / 86400.0
    if days < retention:
        raise UsageError(
            f"--older-than ({days:g} days) is shorter than the retention of {retention:g} "
            f"days ({source})"
        )
    return days, f"--older-than; the retention is {retention:g} days, {source}"


def _after_request(
    orch: Orchestrator, state: SagaState, run: bool, given: dict[str, object]
) -> int:
    if run and state.status.is_runnable:
        state = orch.run(state.id)
    if state.status == SagaStatus.NEEDS_REVIEW:
        reason = fmt.printable(fmt.cli_wording(state.error or "", given))
        print(f"saga {state.id} is needs_review: {reason}")
        return EXIT_PARTIAL
    if state.status.is_runnable:
        holder = f"; {state.lease_owner} is driving it" if state.lease_owner else ""
        drive = fmt.code_first(state.saga, state.status) or "a worker will drive it"
        print(f"saga {state.id} is {fmt.status_text(state)}: {drive}{holder}")
    else:
        print(f"saga {state.id} is {fmt.status_text(state)}")
    return EXIT_OK


def _reconcile(args: argparse.Namespace) -> int:
    orch = _operator(args)
    progress = fmt.ProgressLine("reconciling")
    show = _outcome_printer(args, progress)
    with orch:
        report = admin.reconcile(orch, limit=args.limit, progress=progress, on_outcome=show)
        progress.clear()
    if args.json:
        print(fmt.summary_json(report, "reconcile"))
    elif not report.selected:
        print("reconcile: no operation is left running under an expired lease or unknown")
    else:
        print(fmt.summary(report, "reconcile"))
    return EXIT_OK if report.complete else EXIT_PARTIAL


def _upgrade(args: argparse.Namespace) -> int:
    step_map: dict[str, str] = {}
    for old, new in args.step_map:
        if step_map.get(old, new) != new:
            raise UsageError(f"--map {old}=... is given twice: {old}={step_map[old]}, {old}={new}")
        step_map[old] = new
    batch_only = [
        ("--saga", args.saga),
        ("--version", args.from_version),
        ("--status", args.status),
    ]
    if args.saga_id is not None:
        extra = [flag for flag, value in batch_only if value is not None]
        if extra:
            raise UsageError(f"{', '.join(extra)} select a batch; they do not go with a saga ID")
    elif args.saga is None or args.from_version is None:
        raise UsageError("give a saga ID, or select a batch with --saga NAME and --version V")
    orch = _operator(args)
    actor = _actor(args)
    refused = upgraded = 0
    with orch:
        if args.saga_id is not None:
            ids = [_full_id(orch, args)]
        else:
            ids = [
                s.id
                for s in orch.list(saga=args.saga, limit=args.limit)
                if s.version == args.from_version
                and not s.status.is_terminal
                and (not args.status or s.status in args.status)
            ]
        for saga_id in ids:
            try:
                if args.dry_run:
                    plan = orch.upgrade_plan(saga_id, args.to_version, step_map=step_map)
                    if not plan.allowed:
                        raise UpgradeRefused(plan)
                    state = None
                else:
                    state = orch.upgrade(saga_id, args.to_version, step_map=step_map, actor=actor)
                    plan = _last_upgrade(orch, state)
            except UpgradeRefused as exc:
                refused += 1
                _print_upgrade(args, exc.plan, None)
                continue
            upgraded += 1
            _print_upgrade(args, plan, state, actor)
    if args.json:
        summary = {
            "summary": True,
            "command": "upgrade",
            "dry_run": args.dry_run,
            "allowed": upgraded,  # with --dry-run: would be upgraded
            "upgraded": 0 if args.dry_run else upgraded,
            "refused": refused,
        }
        print(json.dumps(summary, separators=(",", ":")))
    elif args.saga_id is None:
        verb = "can be upgraded" if args.dry_run else "upgraded"
        print(
            f"upgrade: {len(ids)} saga(s) of {args.saga} v{args.from_version} selected, "
            f"{upgraded} {verb} to v{args.to_version}, {refused} refused"
        )
    return EXIT_PARTIAL if refused else EXIT_OK


def _last_upgrade(orch: Orchestrator, state: SagaState) -> UpgradePlan:
    """The plan the upgrade that left `state` made, as its `saga_upgraded` event records it."""
    event = next(e for e in reversed(orch.history(state.id)) if e.event == "saga_upgraded")
    return UpgradePlan.recorded(state, event)


def _print_upgrade(
    args: argparse.Namespace,
    plan: UpgradePlan,
    state: SagaState | None,
    actor: str | None = None,
) -> None:
    if args.json:
        data = plan.as_dict()
        data["dry_run"] = args.dry_run
        data["upgraded"] = state is not None
        print(json.dumps(data, separators=(",", ":")), flush=True)
        return
    print(fmt.upgrade(plan, dry_run=args.dry_run, actor=actor, state=state), flush=True)


def _versions(args: argparse.Namespace) -> int:
    registered: set[tuple[str, int]] | None = None
    if args.app:
        app = blocking(load_app(args.app, args.database_url))
        registered = {(s.name, s.version) for s in app.registered()}
        app.close()
    with _reader(args.database_url) as orch:
        rows = admin.versions_in_flight(orch.store, registered)
    if args.json:
        for line in fmt.versions_json(rows):
            print(line)
    elif rows:
        print(fmt.versions(rows, args.app))
    else:
        print("no saga is in flight", file=sys.stderr)
    # A pre-deploy gate: sagas in flight of a version the app does not register would
    # wait for a worker that never comes (sessions and ledger channels have no version).
    stranded = [
        r
        for r in rows
        if r.registered is False
        and r.in_flight
        and not r.saga.startswith((SESSION_PREFIX, LEDGER_PREFIX))
    ]
    return EXIT_PARTIAL if stranded else EXIT_OK


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "migrate": _migrate,
    "grant": _grant,
    "worker": run_worker,
    "list": _list,
    "show": _show,
    "history": _history,
    "compensate": _compensate,
    "resolve": _resolve,
    "retry": _retry,
    "cancel": _cancel,
    "fork": _fork,
    "reconcile": _reconcile,
    "preview": _preview,
    "confirm": _confirm,
    "keygen": _keygen,
    "purge": _purge,
    "upgrade": _upgrade,
    "versions": _versions,
    "dashboard": run_dashboard,
}


def _errors(exc: pydantic.ValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ())) or "value"
        parts.append(f"{where}: {err.get('msg')}")
    return "; ".join(parts)
