"""Claiming a saga: by id, the next runnable one, a batch, one just started, and a claim
whose reply was lost found again by its token. `Flows` are the loop of `saga._flows.drive`
with these entry points: what the drivers run."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from saga._core.inputs import describe_error
from saga._core.planner import (
    Event,
    Next,
    OpRow,
    Planner,
    SagaRow,
    StartInSql,
    Write,
    starts_in_sql,
)
from saga._core.rows import Loaded, lease_acquired, operation_event
from saga._flows.call import SpendReporter
from saga._flows.common import input_time, new_token, retried
from saga._flows.drive import Claimed, Loop, Released, RunnerOptions, before_record
from saga._flows.effects import (
    Armed,
    Begin,
    Commit,
    Fetch,
    Flow,
    Observed,
    Reached,
    Stopping,
    Watch,
    db,
    db_txn,
    watched,
)
from saga._flows.started import Started
from saga._flows.store_ops import StoreOps
from saga.definition import Saga
from saga.errors import DatabaseInterrupted, LeaseLost
from saga.logs import get_logger
from saga.state import OperationStatus, SagaState

_log = get_logger("saga")

Lookup = Callable[[str, int], Saga[Any]]

T = TypeVar("T")


class Flows(Loop):
    """The flows a driver runs: claim sagas, then drive them (`Loop`)."""

    def __init__(self, options: RunnerOptions, *, reporter: SpendReporter) -> None:
        super().__init__(options, reporter=reporter)
        # The steps a batch claim may start in the database (`_starts`), for the last set
        # of definitions claimed: (kind, definition id) pairs.
        self._starts_of: dict[tuple[tuple[str, int], ...], list[tuple[str, StartInSql]]] = {}

    # ----- entry points ------------------------------------------------------------------

    def claim_and_drive(
        self, definition: Saga[Any] | Lookup, saga_id: str
    ) -> Flow[SagaState | None]:
        """Claim one saga and drive it until it stops; None when it could not be claimed
        (or was lost to another owner on the way)."""
        claimed = yield from self.claim(definition, saga_id)
        if claimed is None:
            return None
        return (yield from self.drive(*claimed))

    def claim_started_and_drive(self, lookup: Lookup, started: Started) -> Flow[SagaState | None]:
        """`claim_started`, then drive the saga until it stops; None when it was not as
        started (nothing was written) or was lost to another owner on the way."""
        claimed = yield from self.claim_started(lookup, started)
        if claimed is None:
            return None
        return (yield from self.drive(*claimed))

    def claim_started(self, lookup: Lookup, started: Started) -> Flow[Claimed | None]:
        """Claim a saga this orchestrator has just started, with its first move planned
        from the rows its start wrote, and record both in one statement: nothing is read
        before the claim. None when the saga is no longer as started (claimed by another
        owner, changed by an operator): nothing is written then, and the caller claims it
        the usual way.

        A claim whose reply was lost is recognised by the token of its write, as in
        `claim`: the retry carries on with the saga it holds."""
        row = started.row
        row.fence, row.lease_owner = 1, self.owner
        planner = self._new_planner(lookup(row.name, row.version), row, started.ops, [])
        nxt, write = yield from self._plan(planner)
        token = new_token()
        tried = [False]

        def once() -> Flow[Claimed | None]:
            if tried[0]:
                reclaimed = yield from self._reclaim(lookup, row.id, token)
                if reclaimed is not None:
                    return reclaimed
            tried[0] = True
            sent = time.monotonic()
            claimed, state = yield from watched(
                Watch(planner, before=before_record(nxt)),
                StoreOps.claim_started,
                write,
                start_token=started.start_token,
                owner=self.owner,
                lease_seconds=self.lease_seconds,
                token=token,
            )
            if not claimed:
                return None
            planner.lease_confirmed_at = sent
            yield Observed((Watch(planner, events=write.events),))
            return planner, Released(nxt, state) if write.release else nxt

        return (yield from retried("claim_saga", once))

    def claim(self, definition: Saga[Any] | Lookup, saga_id: str) -> Flow[Claimed | None]:
        """Claim one saga and plan (and record) its first move; None when it is not
        runnable or another owner's lease is live.

        `definition` is the saga's definition, or a lookup by the claimed row's name and
        version (for a caller that has not read the saga before claiming it); an error
        the lookup raises (`NotRegistered`) rolls the claim back.

        A claim whose reply was lost is recognised by the token of its first write: the
        retry then carries on with the saga it holds instead of finding it leased (to
        itself) and giving up."""
        lookup = _lookup_of(definition)
        token = new_token()
        tried = [False]

        def once() -> Flow[Claimed | None]:
            claimed = (yield from self._reclaim(lookup, saga_id, token)) if tried[0] else None
            tried[0] = True
            if claimed is None:
                claimed = yield from self._claim_by_id(lookup, saga_id, token)
            return claimed

        return (yield from retried("claim_saga", once))

    def _claim_by_id(self, lookup: Lookup, saga_id: str, token: str) -> Flow[Claimed | None]:
        sent = time.monotonic()
        yield Begin()
        loaded = yield from db_txn(
            StoreOps.claim_txn, saga_id, owner=self.owner, lease_seconds=self.lease_seconds
        )
        return (yield from self._claimed(loaded, lookup, token, sent))

    def claim_next(self, kinds: Sequence[str], lookup: Lookup) -> Flow[Claimed | None]:
        """Claim the longest-waiting runnable saga of these name:version kinds and plan its
        first move in the same transaction; None when there is nothing to claim.

        A transient database error is retried; a claim that had landed although its reply
        was lost is found again by its token and carried on."""
        token = new_token()
        tried = [False]

        def once() -> Flow[Claimed | None]:
            if tried[0]:
                own = yield from db(StoreOps.own_claim, owner=self.owner, token=token)
                if own is not None:
                    saga_id, _name, _version = own
                    reclaimed = yield from self._reclaim(lookup, saga_id, token)
                    if reclaimed is not None:
                        return reclaimed
            tried[0] = True
            return (yield from self._claim_next_once(kinds, lookup, token))

        return (yield from _retried_unless_stopping("claim_next_saga", once, lambda: None))

    def _claim_next_once(
        self, kinds: Sequence[str], lookup: Lookup, token: str
    ) -> Flow[Claimed | None]:
        sent = time.monotonic()
        yield Begin()
        loaded = yield from db_txn(
            StoreOps.claim_next_txn, kinds=kinds, owner=self.owner, lease_seconds=self.lease_seconds
        )
        return (yield from self._claimed(loaded, lookup, token, sent))

    def _claimed(
        self, loaded: Loaded | None, lookup: Lookup, token: str, sent: float
    ) -> Flow[Claimed | None]:
        """Inside a claim's transaction: plan the first move of the saga it took (if any),
        commit, and log the events the claim recorded."""
        if loaded is None:
            yield Commit()
            return None
        row = loaded[0]
        planner, nxt, watch, read = yield from self._begin_txn(
            lookup(row.name, row.version), loaded, token
        )
        yield Commit(watch)
        planner.lease_confirmed_at = sent
        if read is not None:
            return planner, Released(nxt, (yield Fetch(read)))
        return planner, nxt

    def claim_batch(self, kinds: Sequence[str], lookup: Lookup, limit: int) -> Flow[list[Claimed]]:
        """Claim up to `limit` of the longest-waiting runnable sagas of these name:version
        kinds, each with its own lease, fence and first write; the sagas claimed, in
        run_after order, to be driven each by a driver of its own (none when there was
        nothing to claim).

        One statement claims them and, for each saga whose first move is only to start the
        attempt of its next pending step (`starts_in_sql`: the hot path), records that
        attempt as running with the claim, in one commit: the attempt is called right
        after it. Every other saga is claimed only, and its first move is planned here and
        written in one more statement for all of them, each answered on its own (a saga
        whose first write alone is refused is parked with the reason).

        A transient database error is retried. A claim that had landed although its reply
        was lost is found again by the tokens the claim and the first writes store (two per
        saga it could take): every saga it holds is carried on, none is left to its
        lease's expiry."""
        tokens = [new_token() for _ in range(max(limit, 1))]
        claim_tokens = [new_token() for _ in tokens]
        only_claimed = frozenset(claim_tokens)
        tried = [False]
        # Sagas of a landed claim carried on so far, by id: a retry after an error in the
        # middle of carrying them on does not look for them again.
        carried: dict[str, Claimed | None] = {}

        def once() -> Flow[list[Claimed]]:
            if tried[0]:
                owned: dict[str, str] = yield from db(
                    StoreOps.own_claims, owner=self.owner, tokens=tokens + claim_tokens
                )
                order = {token: i for i, token in enumerate(tokens + claim_tokens)}
                for saga_id, token in sorted(owned.items(), key=lambda item: order[item[1]]):
                    if saga_id not in carried:
                        carried[saga_id] = yield from self._reclaim_one(
                            lookup, saga_id, token, claimed_only=token in only_claimed
                        )
                reclaimed = [c for c in carried.values() if c is not None]
                if carried:
                    return reclaimed
            tried[0] = True
            return (yield from self._claim_batch_once(kinds, lookup, tokens, claim_tokens))

        return (
            yield from _retried_unless_stopping(
                "claim_saga_batch", once, lambda: [c for c in carried.values() if c is not None]
            )
        )

    def _reclaim_one(
        self, lookup: Lookup, saga_id: str, token: str, *, claimed_only: bool = False
    ) -> Flow[Claimed | None]:
        """`_reclaim` of one saga of a batch claim: what it raises (other than a transient
        error, retried) is that saga's alone, which is then left to the next owner once
        its lease expires; the other sagas of the claim are carried on."""
        try:
            return (yield from self._reclaim(lookup, saga_id, token, claimed_only=claimed_only))
        except Exception as exc:
            if isinstance(exc, DatabaseInterrupted):
                raise
            _log.error("reclaim_failed", saga_id=saga_id, error=describe_error(exc))
            return None

    def _starts(self, kinds: Sequence[str], lookup: Lookup) -> list[tuple[str, StartInSql]]:
        """The steps, by kind, whose attempts the claim may start in the database (the
        core's `starts_in_sql` of each kind's definition), once per set of definitions."""
        definitions: list[tuple[str, Saga[Any]]] = []
        for kind in kinds:
            name, _, version = kind.rpartition(":")
            try:
                definitions.append((kind, lookup(name, int(version))))
            except Exception as exc:
                if isinstance(exc, DatabaseInterrupted):
                    raise
                continue  # not registered (any more): its sagas are planned here
        key = tuple((kind, id(definition)) for kind, definition in definitions)
        known = self._starts_of.get(key)
        if known is None:
            known = [
                (kind, start)
                for kind, definition in definitions
                for start in starts_in_sql(definition)
            ]
            self._starts_of = {key: known}
        return known

    def _claim_batch_once(
        self,
        kinds: Sequence[str],
        lookup: Lookup,
        tokens: Sequence[str],
        claim_tokens: Sequence[str],
    ) -> Flow[list[Claimed]]:
        # Nothing new starts while the driver stops: every saga is claimed only, and its
        # first move planned here gives it back.
        starts = [] if (yield Stopping()) else self._starts(kinds, lookup)
        armed = yield Armed()
        sent = time.monotonic()
        yield Begin()
        read = yield from db_txn(
            StoreOps.claim_batch_started_txn,
            kinds=kinds,
            owner=self.owner,
            lease_seconds=self.lease_seconds,
            now=input_time(),
            tokens=tokens,
            claim_tokens=claim_tokens,
            starts=starts,
        )
        if armed:
            # Which attempts the claim started is known from its answer alone: read before
            # the commit, so that their `before_record` points come before it (crash
            # tests; otherwise the answer is read after the commit, in the same round trip).
            batch: list[tuple[Loaded, bool]] = yield Fetch(read)
            for loaded, started in batch:
                for op in loaded[1] if started else ():
                    if op.status == OperationStatus.RUNNING:
                        yield Reached(("before_record", op.step, op.kind))
            yield Commit()
        else:
            yield Commit()
            batch = yield Fetch(read)
        claimed: list[Claimed] = []
        committed: list[Watch] = []
        planned: list[tuple[Planner, Next, Write, str]] = []
        for (loaded, started), token in zip(batch, tokens, strict=False):
            row = loaded[0]
            try:
                definition = lookup(row.name, row.version)
            except Exception as exc:
                if isinstance(exc, DatabaseInterrupted):
                    raise
                # The claim reads only registered kinds: a registry changed meanwhile. An
                # attempt the claim started is left running, its outcome unknown to the
                # next owner, as after any lost lease.
                _log.error("saga_not_plannable", saga_id=row.id, error=describe_error(exc))
                yield from self.release_after_error(row)
                continue
            if started:
                planner = self._planner(definition, loaded)
                op = next(o for o in planner.ops if o.status == OperationStatus.RUNNING)
                planner.lease_confirmed_at = sent
                committed.append(Watch(planner, events=_started_events(self.owner, row, op)))
                claimed.append((planner, planner.invoke(op)))
            else:
                planner = self._new_planner(definition, *loaded)
                nxt, write = yield from self._plan(planner)
                planned.append((planner, nxt, write, token))
        yield Observed(tuple(committed))
        if planned:
            claimed.extend((yield from self._first_moves(planned, sent)))
        return claimed

    def _first_moves(
        self, planned: list[tuple[Planner, Next, Write, str]], sent: float
    ) -> Flow[list[Claimed]]:
        """Write the first moves planned for sagas a batch claim took, each (planner, move,
        write, token), in one statement and one commit (saga.write_sagas_v2); the sagas
        whose write landed, with their moves. One whose write alone is refused is parked
        with the reason; the others are driven."""
        yield Begin()
        read = yield from db_txn(
            StoreOps.save_batch_txn,
            [(write, token) for _, _, write, token in planned],
            owner=self.owner,
            lease_seconds=self.lease_seconds,
        )
        yield Observed(
            tuple(Watch(planner, before=before_record(nxt)) for planner, nxt, _, _ in planned)
        )
        yield Commit()
        answers: list[SagaState | Exception | None] = yield Fetch(read)
        claimed: list[Claimed] = []
        committed: list[Watch] = []
        for (planner, nxt, write, _), answer in zip(planned, answers, strict=True):
            if isinstance(answer, Exception):
                # One bad saga never stops the others: it alone is parked, with the reason.
                try:
                    yield from self._park_broken(planner, answer)
                except Exception:
                    _log.exception("saga_park_failed", saga_id=planner.saga.id)
                    yield from self.release_after_error(planner.saga)
                continue
            planner.lease_confirmed_at = sent
            committed.append(Watch(planner, events=write.events))
            claimed.append((planner, Released(nxt, answer) if write.release else nxt))
        yield Observed(tuple(committed))
        return claimed

    def _reclaim(
        self, lookup: Lookup, saga_id: str, token: str, *, claimed_only: bool = False
    ) -> Flow[Claimed | None]:
        """The saga our claim took, when that claim landed although its reply was lost
        (its first write carries `token` and the lease is still ours); None otherwise.

        The claim's first move was committed with it: an attempt it started is ours to
        call now; any other move is planned again from what was committed. With
        `claimed_only`, `token` is the claim's alone (saga.claim_batch_v2 stores it on a
        saga it takes without its first move): nothing running is ours, and the first
        move is planned from the rows, as after any claim."""
        written = yield from db(StoreOps.write_token, saga_id)
        if written is None or written[0] != token or written[1] != self.owner:
            return None
        loaded = yield from self._load(saga_id)
        if loaded is None:
            return None
        # Still our claim's, as read? Every write (another owner's claim, its reconcile,
        # the attempt it starts) changes the token: a read that came after one would hand
        # us the new owner's attempt, under its fence, to call a second time.
        again = yield from db(StoreOps.write_token, saga_id)
        if again != written:
            _log.info("claim_taken_over", saga_id=saga_id, fence=loaded[0].fence)
            return None
        definition = lookup(loaded[0].name, loaded[0].version)
        if claimed_only:
            planner = self._new_planner(definition, *loaded)
        else:
            planner = self._planner(definition, loaded)
        _log.info("claim_landed", saga_id=saga_id, fence=planner.saga.fence)
        started = [o for o in planner.ops if o.status == OperationStatus.RUNNING]
        if started and not claimed_only:
            # Every attempt running before the claim was marked unknown by its first move:
            # a running one now is the attempt that move started.
            return planner, planner.invoke(started[0])
        try:
            return (yield from self._transact(planner, None))
        except LeaseLost:
            # The lease ran out while the lost reply was being recovered (a slow reconnect,
            # a pooler waiting for its server) and another owner holds the saga now: it is
            # theirs to drive, and this claim has nothing.
            _log.info("claim_taken_over", saga_id=saga_id, fence=planner.saga.fence)
            return None

    def _load(self, saga_id: str) -> Flow[Loaded | None]:
        yield Begin()
        loaded: Loaded | None = yield from db_txn(StoreOps.load_txn, saga_id)
        yield Commit()
        return loaded

    def plan_new(
        self, definition: Saga[Any], row: SagaRow, ops: list[OpRow], *, may_call: bool = True
    ) -> tuple[Planner, Next, Write]:
        """Plan the first move of a saga about to be created under our lease (nothing is
        written here); returns the planner, its move, and the write that records it (its
        fault point, `before_record(move)`, is the caller's to watch)."""
        # Nothing is stored yet: a definition that cannot plan it raises to the caller.
        planner = self._new_planner(definition, row, ops, [])
        nxt = planner.advance(input_time(), may_call=may_call)
        write = self._write(planner, nxt)
        return planner, nxt, write


def _started_events(owner: str, row: SagaRow, op: OpRow) -> tuple[Event, ...]:
    """The audit events saga.claim_batch_v2 records for a saga whose attempt it started,
    as the planner records them (logged once committed)."""
    return (lease_acquired(owner, row.fence), operation_event("attempt_started", op))


def _lookup_of(definition: Saga[Any] | Lookup) -> Lookup:
    """A lookup of definitions by (name, version): `definition` itself, or one that gives
    the definition whatever the claimed saga's name."""
    if isinstance(definition, Saga):
        fixed = definition
        return lambda name, version: fixed
    return definition


def _retried_unless_stopping(
    what: str, body: Callable[[], Flow[T]], stopped: Callable[[], T]
) -> Flow[T]:
    """`retried(what, body, interruptible=True)` of a claim; when the database stays
    unavailable while the driver is stopping, `stopped()` (what the claim holds so far)
    instead of the error."""
    try:
        return (yield from retried(what, body, interruptible=True))
    except DatabaseInterrupted:
        if (yield Stopping()):
            return stopped()
        raise
