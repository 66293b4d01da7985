"""The `saga` command lines that take a parked saga, session or channel on, in one place:
the messages that name them (`SessionParked`) and the screens that show them (the
dashboard) build them here, so that they never say two different things."""

from __future__ import annotations

import shlex

from saga.state import OperationKind, OperationStatus, SagaState, SagaStatus

# What a person fills in: the app module (`--app`), a result, a reason.
APP = "--app MODULE"

# Sessions' saga rows are named so: a declared saga's name never has a '/'.
SESSION_PREFIX = "session/"
# A ledger channel's saga row (saga.ledger) is named so: its calls are claimed one by one
# by callers that own their control flow, never driven under the saga's lease.
LEDGER_PREFIX = "ledger/"


def saga_kind(name: str) -> str:
    """`session`, `channel` (a ledger channel) or `saga` (a declared one), from a saga's
    name: what `parked_commands` takes as its `kind`."""
    if name.startswith(SESSION_PREFIX):
        return "session"
    if name.startswith(LEDGER_PREFIX):
        return "channel"
    return "saga"


def resolve_commands(
    saga_id: str, step: str, kind: OperationKind = "action", *, app: bool = False
) -> tuple[str, str]:
    """The two `saga resolve` lines that settle an operation: its effect happened (with
    what it returned; a compensation returns nothing), or it did not (with why). With
    `app`, they load the app (`--app MODULE`): a declared saga's results are checked by
    its code; a session's or a channel's need none."""
    where = f"saga resolve {saga_id} {shlex.quote(step)}"
    if app:
        where += f" {APP}"
    if kind == "compensation":
        where += " --kind compensation"
        return f"{where} --succeeded", f"{where} --failed --reason TEXT"
    return f"{where} --succeeded --result JSON", f"{where} --failed --reason TEXT"


def compensate_command(saga_id: str, *, include_unknown: bool = False) -> str:
    """The `saga compensate` line that undoes what a saga did, in reverse (with
    `include_unknown`, its steps of unknown outcome too)."""
    line = f"saga compensate {saga_id} {APP}"
    return line + " --include-unknown" if include_unknown else line


def retry_command(saga_id: str) -> str:
    """The `saga retry` line that resumes a parked saga where it stopped, after a fix."""
    return f"saga retry {saga_id} {APP}"


def parked_commands(state: SagaState, kind: str | None = None) -> list[str]:
    """The command lines an operator may run on a parked saga, each complete but for what
    only a person knows (the app module, a result, a reason); empty when it is not parked.

    An operation of unknown outcome is settled by `saga resolve` (succeeded or failed), or
    the saga compensated, its steps of unknown outcome included; a compensation that
    failed is settled as undone by hand, or retried with a fresh budget by
    `saga compensate`. A saga parked on a ceiling or on a failure after its pivot resumes
    with `saga retry` (its reason says what to raise), or is compensated. `kind` is `saga`,
    `session` or `channel`: a ledger channel is settled call by call (its callers, not
    `saga compensate`, go on from there); a declared saga's lines load its app. Without
    `kind`, it is read from the saga's name (`saga_kind`).
    """
    if state.status != SagaStatus.NEEDS_REVIEW:
        return []
    sid = state.id
    unsettled = (OperationStatus.UNKNOWN, OperationStatus.RUNNING)
    lines: list[str] = []
    failed = False
    kind = kind or saga_kind(state.saga)
    app = kind == "saga"
    for op in state.operations:
        if op.status in unsettled:
            lines += resolve_commands(sid, op.step, op.kind, app=app)
    if kind == "channel":
        return lines
    for op in state.operations:
        if op.kind == "compensation" and op.status == OperationStatus.FAILED:
            lines.append(resolve_commands(sid, op.step, op.kind, app=app)[0])
            failed = True
    if any(op.kind == "action" and op.status in unsettled for op in state.operations):
        lines.append(compensate_command(sid, include_unknown=True))
    elif failed:
        lines.append(compensate_command(sid))
    elif not lines:
        lines += [retry_command(sid), compensate_command(sid)]
    return lines
