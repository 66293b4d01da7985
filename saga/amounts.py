"""Amounts of money as the guardrails accept them: declared costs and reported spend."""

from __future__ import annotations

import math


def finite_amount(value: object) -> float | None:
    """`value` as a float when it is a finite, non-negative real number, else None.

    A bool is not an amount (it is an int to Python), nor is a string, NaN, an infinity,
    a negative number or an int too large for a float.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        amount = float(value)
    except OverflowError:
        return None
    return amount if math.isfinite(amount) and amount >= 0 else None
