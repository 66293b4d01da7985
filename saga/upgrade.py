"""Upgrading a saga in flight to a newer version of its definition: the pure planning.

`plan_upgrade` decides, from one saga's stored rows and the two definitions, whether the
saga may move to the target version, and what becomes of each of its operations. It does
no I/O and reads no clock; the doors (`Orchestrator.upgrade`, `AsyncOrchestrator.upgrade`)
write what it decides in one transaction, under the saga's row lock.

The rule: every operation that took effect (succeeded, or running or unknown: it may
have) maps, in order, onto a step of the target version with the same compensation
contract (a compensation where it had one, none where it had none; a pivot where it was
one). Each operation is then:

- kept: it was attempted (it took effect, failed, or waits to be retried after a failed
  attempt) and maps onto a step of the target version. Its row is carried over as stored,
  renamed and moved when the step is: the idempotency key stays the one the provider saw
  (it names the old version, and the old name), so a reconcile or a retry of it is the
  same request. A step that succeeded is never run again.
- replaced: it was never attempted and its step is in the target version: it is created
  again as that version creates it (its key names the new version), and runs its code.
- dropped: it did not take effect and the target version has no step for it.
- added: a step of the target version the saga has no operation for: pending, keyed
  under the new version.

A step of the target version that would run before one that took effect is refused: the
saga would run it out of the order its version declares.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, Literal

import pydantic

from saga._core.planner import new_action_rows
from saga._core.rows import OpRow, SagaRow
from saga.definition import Saga, Step
from saga.errors import StepStateError
from saga.remedies import LEDGER_PREFIX, SESSION_PREFIX
from saga.state import HistoryEvent, OperationStatus, SagaState, SagaStatus

__all__ = [
    "StepMove",
    "Upgrade",
    "UpgradePlan",
    "UpgradeRefused",
    "check_upgrade_arguments",
    "plan_upgrade",
    "took_effect",
]

Move = Literal["kept", "replaced", "dropped", "added"]

# The statuses of an operation that took effect, or may have: an upgrade must carry each
# of them over to a step that can settle it and undo it as its version could.
TOOK_EFFECT = (OperationStatus.SUCCEEDED, OperationStatus.RUNNING, OperationStatus.UNKNOWN)


def took_effect(op: OpRow) -> bool:
    """Whether an operation took effect, or may have (running, or its outcome unknown;
    an unknown one an earlier release set back to pending for its retry included)."""
    return op.status in TOOK_EFFECT or op.retrying_unknown


@dataclass(frozen=True, slots=True)
class StepMove:
    """What an upgrade does with one step: `step` is the operation's name in the saga's
    version (None for a step new in the target version), `to` its step in the target
    version (None when dropped), `status` and `attempts` as stored, `key` the idempotency
    key it has after the upgrade (as stored for a kept one; the dropped one's)."""

    move: Move
    step: str | None
    to: str | None
    status: OperationStatus
    attempts: int
    key: str

    def as_dict(self) -> dict[str, Any]:
        """JSON of this move."""
        return {
            "move": self.move,
            "step": self.step,
            "to": self.to,
            "status": self.status.value,
            "attempts": self.attempts,
            "key": self.key,
        }


@dataclass(frozen=True, slots=True)
class UpgradePlan:
    """The verdict on upgrading one saga: `reasons` are why it is refused (empty when it
    is allowed), `moves` what becomes of each step (see `saga.upgrade`)."""

    saga_id: str
    saga: str
    from_version: int
    to_version: int
    status: SagaStatus
    moves: tuple[StepMove, ...] = ()
    reasons: tuple[str, ...] = ()

    @property
    def allowed(self) -> bool:
        """Whether the upgrade may be made."""
        return not self.reasons

    @property
    def renamed(self) -> dict[str, str]:
        """The kept operations that change name: old name to new."""
        return {
            m.step: m.to
            for m in self.moves
            if m.move == "kept" and m.step is not None and m.to is not None and m.step != m.to
        }

    @classmethod
    def recorded(cls, state: SagaState, event: HistoryEvent) -> UpgradePlan:
        """The plan an upgrade made, as its `saga_upgraded` event of `state` records it."""
        detail = event.detail
        return cls(
            saga_id=state.id,
            saga=state.saga,
            from_version=int(detail["from_version"]),
            to_version=int(detail["to_version"]),
            status=state.status,
            moves=tuple(
                StepMove(
                    move=m["move"],
                    step=m["step"],
                    to=m["to"],
                    status=OperationStatus(m["status"]),
                    attempts=int(m["attempts"]),
                    key=m["key"],
                )
                for m in detail.get("upgrade_moves", ())
            ),
        )

    def refusal(self) -> str:
        """The refusal as one message (empty when allowed)."""
        if self.allowed:
            return ""
        return (
            f"cannot upgrade saga {self.saga_id} ({self.saga!r}) from version "
            f"{self.from_version} to {self.to_version}: " + "; ".join(self.reasons)
        )

    def as_dict(self) -> dict[str, Any]:
        """JSON of this plan."""
        return {
            "id": self.saga_id,
            "saga": self.saga,
            "from_version": self.from_version,
            "to_version": self.to_version,
            "status": self.status.value,
            "allowed": self.allowed,
            "reasons": list(self.reasons),
            "moves": [m.as_dict() for m in self.moves],
        }


class UpgradeRefused(StepStateError):
    """An upgrade was refused, and nothing was written; `plan.reasons` say why."""

    def __init__(self, plan: UpgradePlan) -> None:
        super().__init__(plan.refusal())
        self.plan = plan


def check_upgrade_arguments(to_version: object, step_map: object) -> dict[str, str]:
    """`step_map` as a dict; `ValueError` naming what is wrong with `to_version` or
    `step_map`, before anything is read."""
    if not isinstance(to_version, int) or isinstance(to_version, bool) or to_version < 1:
        raise ValueError(f"to_version must be a positive int, got {to_version!r}")
    if step_map is None:
        return {}
    if not isinstance(step_map, Mapping):
        raise ValueError(f"step_map must map old step names to new ones, got {step_map!r}")
    for old, new in step_map.items():
        if not isinstance(old, str) or not isinstance(new, str) or not old or not new:
            raise ValueError(f"step_map must map step names to step names, got {old!r}: {new!r}")
    return dict(step_map)


@dataclass(frozen=True, slots=True)
class Upgrade:
    """A plan and, when it is allowed, the rows to write: `drop` the (kind, step) rows to
    delete, `renames` the kept rows as (kind, step, new step, new position), `new_ops`
    the rows to create."""

    plan: UpgradePlan
    drop: tuple[tuple[str, str], ...] = ()
    renames: tuple[tuple[str, str, str, int], ...] = ()
    new_ops: tuple[OpRow, ...] = ()


def plan_upgrade(
    row: SagaRow,
    ops: Sequence[OpRow],
    *,
    to_version: int,
    source: Saga[Any] | None,
    target: Saga[Any] | None,
    step_map: Mapping[str, str] | None = None,
    live: bool = False,
) -> Upgrade:
    """Whether saga `row` with operations `ops` may move to `to_version`, and how.

    `source` and `target` are the definitions registered under the saga's version and
    under `to_version` (None: not registered); `step_map` maps an operation's name onto
    the step of the target version that carries it (by default, the step of the same
    name); `live` says a live lease holds the saga. Refusals are reasons of the plan,
    never exceptions: nothing is to be written when there is one."""
    mapping = dict(step_map or {})

    def verdict(*reasons: str, moves: Sequence[StepMove] = ()) -> Upgrade:
        return Upgrade(
            UpgradePlan(
                saga_id=row.id,
                saga=row.name,
                from_version=row.version,
                to_version=to_version,
                status=row.status,
                moves=tuple(moves),
                reasons=reasons,
            )
        )

    if row.name.startswith((SESSION_PREFIX, LEDGER_PREFIX)):
        return verdict(
            "it is a session or a ledger channel: its calls are made by code, which has no "
            "version to upgrade to"
        )
    reasons: list[str] = []
    if to_version <= row.version:
        reasons.append(
            f"it is version {row.version} already"
            if to_version == row.version
            else f"version {to_version} is older than its version {row.version}"
        )
    if row.status.is_terminal:
        reasons.append(f"it is {row.status.value}: nothing of it runs again")
    if row.status == SagaStatus.AWAITING_CONFIRMATION:
        reasons.append(
            "it awaits a confirmation, bound to the request of its version: confirm it (or "
            "let it expire) first"
        )
    if live:
        reasons.append(
            f"{row.lease_owner} holds its lease until {row.lease_expires_at}: it is being "
            "driven; upgrade it once it has stopped (an upgrade never takes a lease over)"
        )
    if target is None:
        reasons.append(f"version {to_version} of {row.name!r} is not registered by this app")
    if source is None:
        reasons.append(
            f"version {row.version} of {row.name!r} is not registered by this app: register "
            f"it beside version {to_version} so that its steps can be compared"
        )
    if reasons or source is None or target is None:
        return verdict(*reasons)

    reasons.extend(_map_errors(mapping, source, target))
    try:
        target.validate_input(row.input)
    except pydantic.ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ())) or 'value'}: {e.get('msg')}"
            for e in exc.errors()
        )
        reasons.append(f"its input does not fit the input of version {to_version}: {problems}")

    actions = sorted((o for o in ops if o.kind == "action"), key=lambda o: o.position)
    moves: list[StepMove] = []
    drop: list[tuple[str, str]] = []
    renames: list[tuple[str, str, str, int]] = []
    kept: dict[str, tuple[OpRow, Step]] = {}  # by the target step's name
    replaced: dict[str, OpRow] = {}  # never attempted, by the target step's name
    unmapped = False  # an operation that took effect has no step: the map is to be fixed
    for op in (o for o in actions if _attempted(o)):
        name = mapping.get(op.step, op.step)
        step = target.step_named(name)
        if step is None:
            if took_effect(op):
                unmapped = True
                reasons.append(
                    f"step {op.step!r} {_what(op)} and version {to_version} has no step "
                    f"{name!r}: map it onto the step that carries its effect (step_map "
                    f"{op.step}=NEW)"
                )
            else:  # it failed, or its failed attempts left nothing: nothing to carry
                drop.append((op.kind, op.step))
                moves.append(_move("dropped", op, None, op.idempotency_key))
            continue
        if step.name in kept:
            reasons.append(
                f"steps {kept[step.name][0].step!r} and {op.step!r} both map onto step "
                f"{step.name!r} of version {to_version}"
            )
            continue
        if took_effect(op):
            reasons.extend(_contract_errors(op, source.step_named(op.step), step, to_version))
        kept[step.name] = (op, step)
        renames.append((op.kind, op.step, step.name, step.index))
        moves.append(_move("kept", op, step.name, op.idempotency_key))
    for op in (o for o in actions if not _attempted(o)):
        name = mapping.get(op.step, op.step)
        drop.append((op.kind, op.step))
        if target.step_named(name) is None or name in kept or name in replaced:
            moves.append(_move("dropped", op, None, op.idempotency_key))
        else:
            replaced[name] = op

    # Kept operations keep their order.
    order = list(kept.values())
    for (before, first), (after, second) in pairwise(order):
        if second.index < first.index:
            reasons.append(
                f"steps {before.step!r} and {after.step!r} would change order: version "
                f"{to_version} has {second.name!r} before {first.name!r}"
            )

    # Steps of the target version without a kept operation run from scratch: after every
    # step that took effect, as their version orders them.
    last_effect = max(
        (step for op, step in kept.values() if took_effect(op)),
        key=lambda s: s.index,
        default=None,
    )
    business = {k: v for k, v in row.input.items() if k not in target.volatile}
    new_ops: list[OpRow] = []
    for new in new_action_rows(target, row.tenant_id, row.key, business):
        if new.step in kept:
            continue
        if not unmapped and last_effect is not None and new.position < last_effect.index:
            reasons.append(
                f"step {new.step!r} of version {to_version} comes before "
                f"{last_effect.name!r}, which has run already: the saga would run it out of "
                "order"
            )
        new_ops.append(new)
        was = replaced.get(new.step)
        moves.append(
            StepMove(
                "replaced" if was is not None else "added",
                None if was is None else was.step,
                new.step,
                OperationStatus.PENDING,
                0,
                new.idempotency_key,
            )
        )

    # Compensations recorded already follow their step.
    for op in ops:
        if op.kind != "compensation":
            continue
        name = mapping.get(op.step, op.step)
        if name not in kept or kept[name][0].step != op.step:
            reasons.append(
                f"the compensation of step {op.step!r} has been recorded and version "
                f"{to_version} has no step carrying it"
            )
            continue
        renames.append(("compensation", op.step, name, kept[name][1].index))

    # In the order of the target version; the dropped ones last.
    index = {s.name: s.index for s in target.steps}
    moves.sort(key=lambda m: (0, index[m.to]) if m.to is not None else (1, 0))
    if reasons:
        return verdict(*reasons, moves=moves)
    return Upgrade(
        verdict(moves=moves).plan,
        drop=tuple(drop),
        renames=tuple(renames),
        new_ops=tuple(new_ops),
    )


def _attempted(op: OpRow) -> bool:
    """Whether an operation has been attempted: its key may have reached the provider."""
    return op.attempts > 0 or op.status != OperationStatus.PENDING


def _move(move: Move, op: OpRow, to: str | None, key: str) -> StepMove:
    return StepMove(move, op.step, to, op.status, op.attempts, key)


def _what(op: OpRow) -> str:
    if op.status == OperationStatus.SUCCEEDED:
        return "succeeded"
    if op.status == OperationStatus.UNKNOWN or op.retrying_unknown:
        return "has an unknown outcome (it may have taken effect)"
    return "is running (it may have taken effect)"


def _map_errors(mapping: Mapping[str, str], source: Saga[Any], target: Saga[Any]) -> list[str]:
    errors = []
    for old, new in mapping.items():
        if source.step_named(old) is None:
            errors.append(
                f"step_map names {old!r}, which is not a step of version {source.version}"
            )
        if target.step_named(new) is None:
            errors.append(
                f"step_map maps {old!r} onto {new!r}, which is not a step of version "
                f"{target.version}"
            )
    return errors


def _contract_errors(op: OpRow, before: Step | None, after: Step, to_version: int) -> list[str]:
    """Why the step `after` of the target version cannot carry `op`, which took effect
    under `before` (its step in the saga's version)."""
    if before is None:
        return [
            f"step {op.step!r} {_what(op)} and is no step of the saga's version: its "
            "compensation cannot be compared"
        ]
    errors = []
    had, has = before.compensation_op is not None, after.compensation_op is not None
    if had and not has:
        errors.append(
            f"step {op.step!r} {_what(op)} and has a compensation, but step {after.name!r} "
            f"of version {to_version} has none: it could no longer be undone"
        )
    if has and not had:
        errors.append(
            f"step {op.step!r} {_what(op)} without a compensation, but step {after.name!r} "
            f"of version {to_version} has one: it would undo what was never to be undone"
        )
    if before.pivot != after.pivot:
        errors.append(
            f"step {op.step!r} {_what(op)} and "
            f"{'is' if before.pivot else 'is not'} a pivot, but step {after.name!r} of "
            f"version {to_version} {'is not' if before.pivot else 'is'}"
        )
    return errors
