"""Turn operation results into stored JSON and back, identically on first run and replay."""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic_core import PydanticSerializationError

from saga.errors import SagaDefinitionError
from saga.keys import check_json
from saga.signatures import annotated_function

# Return annotations that mean "plain JSON, store and replay as is".
_PLAIN = {None, type(None), Any, dict, list, str, int, float, bool, inspect.Signature.empty}


class ResultCodec:
    """Encodes one operation's result to JSON and rebuilds it from its return annotation."""

    def __init__(self, fn: Callable[..., Any], *, where: str) -> None:
        self.where = where
        self._adapter: TypeAdapter[Any] | None = None
        annotation = _return_annotation(fn, where)
        self._annotation_name = getattr(annotation, "__name__", repr(annotation))
        if annotation not in _PLAIN:
            self._adapter = TypeAdapter(annotation)

    def encode(self, value: object) -> Any:
        """JSON to store for `value`.

        Raises `TypeError` naming the operation when the value is not JSON, or does not
        fit the return annotation, so that what is stored can always be replayed.
        """
        if self._adapter is None:
            stored = value.model_dump(mode="json") if isinstance(value, BaseModel) else value
            check_json(stored, where=f"result of {self.where}")
            return stored
        try:
            fitted = self._adapter.validate_python(value)
            stored = self._adapter.dump_python(fitted, mode="json", warnings="error")
        except (ValidationError, PydanticSerializationError) as exc:
            raise TypeError(
                f"result of {self.where} does not fit its return annotation "
                f"{self._annotation_name}: {_first_line(exc)}"
            ) from None
        check_json(stored, where=f"result of {self.where}")
        return stored

    def decode(self, stored: Any) -> Any:
        """The value step code sees, rebuilt from stored JSON (a model when annotated so)."""
        if stored is None or self._adapter is None:
            return stored
        return self._adapter.validate_python(stored)


def _first_line(exc: Exception) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return " ".join(lines[:3])


def _return_annotation(fn: Callable[..., Any], where: str) -> Any:
    try:
        hints = typing.get_type_hints(annotated_function(fn))
    except Exception as exc:
        # Guessing "plain JSON" would hand step code a dict where it expects a model.
        raise SagaDefinitionError(
            f"the return annotation of {where} cannot be resolved ({exc}); define the types "
            "it names at module level"
        ) from None
    return hints.get("return")
