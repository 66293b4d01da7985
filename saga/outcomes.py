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
    """The provider confirms nothing happened under this key: retrying with it is safe."""


@dataclass(frozen=True, slots=True)
class Inconclusive:
    """The provider cannot tell yet; the saga parks in `needs_review`."""

    reason: str | None = None


ReconcileOutcome = Found | Absent | Inconclusive
