"""Turn operation results into stored JSON and back, identically on first run and replay."""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, TypeAdapter

from saga.keys import check_json

# Return annotations that mean "plain JSON, store and replay as is".
_PLAIN = {None, type(None), Any, dict, list, str, int, float, bool, inspect.Signature.empty}


class ResultCodec:
    """Encodes one operation's result to JSON and rebuilds it from its return annotation."""

    def __init__(self, fn: Callable[..., Any], *, where: str) -> None:
        self.where = where
        self._adapter: TypeAdapter[Any] | None = None
        annotation = _return_annotation(fn)
        if annotation not in _PLAIN:
            self._adapter = TypeAdapter(annotation)

    def encode(self, value: object) -> Any:
        """JSON to store for `value`; `TypeError` naming the operation when it is not JSON."""
        if isinstance(value, BaseModel):
            value = value.model_dump(mode="json")
        elif self._adapter is not None and not _is_plain_json(value):
            value = self._adapter.dump_python(value, mode="json")
        check_json(value, where=f"result of {self.where}")
        return value

    def decode(self, stored: Any) -> Any:
        """The value step code sees, rebuilt from stored JSON (a model when annotated so)."""
        if stored is None or self._adapter is None:
            return stored
        return self._adapter.validate_python(stored)


def _is_plain_json(value: object) -> bool:
    return value is None or isinstance(value, dict | list | str | int | float | bool)


def _return_annotation(fn: Callable[..., Any]) -> Any:
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # unresolvable forward references: treat the result as plain JSON
        return None
    return hints.get("return")
