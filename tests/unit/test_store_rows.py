"""The core's rows, as the store makes them from what PostgreSQL returns."""

from __future__ import annotations

import dataclasses
import typing
from decimal import Decimal
from typing import Any

import pytest

from saga._core.rows import OpRow, SagaRow
from saga._db._store_base import NUMERIC_COLUMNS, op_row, saga_row


def _float_fields(cls: type[Any]) -> frozenset[str]:
    hints = typing.get_type_hints(cls)
    return frozenset(
        f.name
        for f in dataclasses.fields(cls)
        if float in typing.get_args(hints[f.name]) or hints[f.name] is float
    )


@pytest.mark.parametrize("cls", [SagaRow, OpRow])
def test_every_float_field_of_a_row_is_read_as_a_numeric_column(cls: type[Any]) -> None:
    """A float field of a row is a numeric column: one not named would reach the core as a
    Decimal, which does not add to a float."""
    assert NUMERIC_COLUMNS[cls] == _float_fields(cls)


def test_numeric_columns_become_floats() -> None:
    """Budgets, costs and spend come back from PostgreSQL as Decimal: the rows hold floats."""
    saga = saga_row(
        {
            "id": "0b7e6f0e-4a1f-4d0c-9a43-2f9d8f3c1e11",
            "name": "order",
            "version": 1,
            "tenant_id": "t",
            "key": "k",
            "input": {},
            "input_hash": "h",
            "status": "running",
            "error": None,
            "direction": "forward",
            "fence": 1,
            "run_after": None,
            "spend_budget": Decimal("12.5"),
            "spent": Decimal("2.25"),
        }
    )
    assert (saga.spend_budget, saga.spent) == (12.5, 2.25)
    assert all(type(v) is float for v in (saga.spend_budget, saga.spent))
    op = op_row(
        {
            "step": "charge",
            "kind": "action",
            "position": 0,
            "idempotency_key": "k",
            "request_hash": "h",
            "status": "running",
            "attempts": 1,
            "max_attempts": 3,
            "cost": Decimal("1.5"),
            "spent": Decimal("0.5"),
            "attempt_spend": Decimal("0.25"),
            "peak_spend": Decimal("0.5"),
        }
    )
    numbers = (op.cost, op.spent, op.attempt_spend, op.peak_spend)
    assert numbers == (1.5, 0.5, 0.25, 0.5)
    assert all(type(v) is float for v in numbers)
