"""The context handed to step, compensation and reconcile functions."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import structlog

from saga.amounts import finite_amount
from saga.logs import step_logger


@dataclass(frozen=True, slots=True)
class StepContext:
    """What an operation knows about itself while it runs.

    Attributes:
        saga_id: Id of the saga instance.
        tenant_id: Tenant the saga belongs to.
        step: Name of the step (a compensation carries its step's name).
        kind: `"action"` or `"compensation"`.
        idempotency_key: Stable key of this operation; pass it to the provider.
        attempt: Attempt number, from 1; for a reconcile, the attempt being asked about.
        fence: Fencing token of the lease under which this attempt runs.
        results: Results of the saga's succeeded steps, by step name.
        log: A structlog logger bound with saga id, step, attempt and key (made from
            those fields when not given; bound lazily, on the first log call).
        request: The request prepared for this attempt (see `Step.prepare`), else None.
    """

    saga_id: str
    tenant_id: str
    step: str
    kind: str
    idempotency_key: str
    attempt: int
    fence: int
    results: Mapping[str, Any]
    log: structlog.typing.FilteringBoundLogger = field(default=cast(Any, None))
    request: Any = None
    _spent: list[float] = field(default_factory=list, repr=False)
    # Set by the runner: persists the attempt's running total as each report is made.
    _report: Callable[[float], None] | None = field(default=None, repr=False)
    _refused: list[str] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.log is None:
            logger = step_logger(
                saga_id=self.saga_id,
                step=self.step,
                kind=self.kind,
                attempt=self.attempt,
                idempotency_key=self.idempotency_key,
            )
            object.__setattr__(self, "log", logger)

    def spend(self, amount: float) -> None:
        """Report spend of this attempt; it counts against the saga's spend budget.

        The running total is written to the database at once, so what an attempt
        reported before a crash is still counted after it. An amount that is not a
        finite, non-negative number raises `ValueError` here; the refusal is recorded
        with the attempt, whose outcome is kept, and the saga then parks for a human
        to count what was spent.
        """
        value = finite_amount(amount)
        if value is None:
            reason = (
                f"spend amount must be a finite, non-negative number, got {amount!r}; "
                "nothing was counted"
            )
            self._refused.append(reason)
            raise ValueError(reason)
        self._spent.append(value)
        if self._report is not None:
            self._report(self.spent)

    @property
    def spent(self) -> float:
        """What this attempt reported with `spend()` so far."""
        return sum(self._spent)
