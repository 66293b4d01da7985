"""Answers of a reconcile hook when an attempt's outcome is unknown."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Found:
    """The provider performed the effect; `result` becomes the step's result."""

    result: Any = None
    provider_reference: str | None = None


@dataclass(frozen=True, slots=True)
class Absent:
    """The provider confirms nothing happened under this key: retrying with it is safe.

    `settled=False` says the answer cannot be trusted yet (a provider's reads may lag
    right after a timeout): it is treated as inconclusive and asked again within the
    reconcile window.
    """

    settled: bool = True


@dataclass(frozen=True, slots=True)
class Inconclusive:
    """The provider cannot tell yet; the saga parks in `needs_review`."""

    reason: str | None = None


ReconcileOutcome = Found | Absent | Inconclusive
