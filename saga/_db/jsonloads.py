"""How the store's connections read the JSON the server sends: orjson, where it reads it
exactly as the json module does, else the json module.

Every claim, start and write answers in JSON (the SQL functions' replies, the sagas'
input and the steps' results in their rows), and reading it with `json.loads` was 6 to
8% of a worker's instructions. orjson reads the same text with less than half of them,
the check below included, and to the same values (its floats are rounded as Python's
float() rounds them), except:

- an integer beyond 64 bits (below -2**63 or above 2**64 - 1) comes back as a float, its
  digits lost, where json gives the int;
- what json reads and orjson refuses: NaN and Infinity, a lone surrogate escape, text
  that is not UTF-8 (json also reads UTF-16 and UTF-32, and a BOM), a number beyond the
  float range (json: inf), deeper nesting.

So a text that may hold such an integer goes to json, and so does a text orjson
refuses, where json reads it or raises as before. An integer beyond 64 bits has 19
digits or more, and the run of its digits starts after a sign, a blank, `[`, `,` or `:`,
never after a letter or a quote: that tells it from the digits of a hex digest or a
string of digits, which stay with orjson. (A run that looks like it inside a string, as
in "id-1234567890123456789", only sends that text to json.)
"""

from __future__ import annotations

import json
from typing import Any

import orjson
import psycopg
from psycopg.pq import Format
from psycopg.types.json import (
    JsonbBinaryLoader,
    JsonBinaryLoader,
    JsonbLoader,
    JsonLoader,
    set_json_loads,
)

# Each byte of a text as what it may be around a number: a digit (1), an ASCII letter or
# a quote (a), anything else (0: a sign, a blank, punctuation, a byte of a multibyte
# character).
_CLASSES = bytes(
    ord("1") if 0x30 <= i <= 0x39 else ord("a") if bytes([i]).isalpha() or i == 0x22 else ord("0")
    for i in range(256)
)
# 19 digits after a byte that may precede a number: the shortest integer beyond 64 bits,
# -9223372036854775809, has 19.
_LONG_INTEGER = b"0" + b"1" * 19


def _may_hold_long_integer(data: bytes) -> bool:
    """Whether the JSON text `data` may hold an integer of 19 digits or more (the
    digits run after a byte that may precede a number, or start the text)."""
    classes = data.translate(_CLASSES)
    return _LONG_INTEGER in classes or classes.startswith(_LONG_INTEGER[1:])


def loads(data: bytes | str) -> Any:
    """The value of the JSON text `data`, equal to `json.loads(data)` (and of the same
    types), or its error."""
    if isinstance(data, str):  # psycopg hands over bytes
        return json.loads(data)
    if not _may_hold_long_integer(data):
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            pass
    return json.loads(data)


def use_on(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> None:
    """Read json and jsonb with `loads` on `conn`, when it reads them as psycopg does by
    default; a loads function or a loader the application registered stays."""
    adapters = conn.adapters
    for oid, fmt, default in _DEFAULTS:
        loader = adapters.get_loader(oid, fmt)
        if loader is not default or getattr(default, "_loads", None) is not json.loads:
            return
    set_json_loads(loads, conn)


_JSON_OID, _JSONB_OID = 114, 3802
# psycopg's loaders of json and jsonb, by type and format.
_DEFAULTS = (
    (_JSON_OID, Format.TEXT, JsonLoader),
    (_JSON_OID, Format.BINARY, JsonBinaryLoader),
    (_JSONB_OID, Format.TEXT, JsonbLoader),
    (_JSONB_OID, Format.BINARY, JsonbBinaryLoader),
)
