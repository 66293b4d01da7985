"""The store reads the server's JSON with orjson where that gives what the json module
gives, value for value and type for type: big integers, floats, unicode, nesting, and
the texts orjson refuses."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from saga._db import jsonloads
from saga._db.jsonloads import loads


def same(a: Any, b: Any) -> bool:
    """`a` and `b` are equal and of the same types all the way down (a float's sign and
    bits too, NaN included); dict keys in the same order."""
    pending = [(a, b)]
    while pending:
        x, y = pending.pop()
        if type(x) is not type(y):
            return False
        if isinstance(x, float):
            if not (x.hex() == y.hex() or (math.isnan(x) and math.isnan(y))):
                return False
        elif isinstance(x, list):
            if len(x) != len(y):
                return False
            pending.extend(zip(x, y, strict=True))
        elif isinstance(x, dict):
            if list(x) != list(y):
                return False
            pending.extend((x[k], y[k]) for k in x)
        elif x != y:
            return False
    return True


def outcome(text: bytes) -> tuple[str, Any]:
    """What `json.loads` gives for `text`, or the type of its error."""
    try:
        return "value", json.loads(text)
    except (ValueError, RecursionError) as exc:
        return "error", type(exc)


def check(text: bytes) -> None:
    kind, expected = outcome(text)
    if kind == "error":
        with pytest.raises(expected):
            loads(text)
    else:
        assert same(loads(text), expected), text


@pytest.mark.parametrize(
    "text",
    [
        # Integers at and beyond 64 bits (orjson alone makes floats of those beyond).
        "9223372036854775807",
        "-9223372036854775808",
        "-9223372036854775809",
        "18446744073709551615",
        "18446744073709551616",
        "123456789012345678901234567890",
        "-123456789012345678901234567890",
        "1" + "0" * 400,
        '{"amount": 100000000000000000000, "n": [1, -99999999999999999999]}',
        '["12345678901234567890123", 12345678901234567890123]',
        '{"h": "ab12345678901234567890123cd", "n": 12345678901234567890123}',
        "[-12345678901234567890, 1, 2]",
        '{"a":12345678901234567890}',
        "[1,12345678901234567890]",
        "\n\t 12345678901234567890",
        '{"h": "ab12345678901234567890123cd", "id": "x-12345678901234567890"}',
        # Floats: PostgreSQL's plain digits, exponents, the extremes, long mantissas.
        "0.1",
        "0.30000000000000004",
        "1.0",
        "-0.0",
        "-0",
        "1e20",
        "1E+2",
        "2.5e-3",
        "1.7976931348623157e308",
        "5e-324",
        "2.4703282292062328e-324",
        "1e400",
        "-1e400",
        "1e-400",
        "100000000000000000000.0",
        "0.1000000000000000055511151231257827021181583404541015625",
        "9007199254740993",
        "9007199254740993.0",
        "3.141592653589793238462643383279",
        # Unicode: escapes, surrogate pairs, text beyond the BMP, a lone surrogate.
        '"caf\\u00e9"',
        '"caf\u00e9 \u4e2d\u6587 \U0001f600"',
        '"\\ud83d\\ude00"',
        '"\\ud800"',
        '"\\udc00x"',
        '"\\u0000 nul"',
        '{"\u00e9": "\\n\\t\\"\\\\/"}',
        # Structures: nested, empty, duplicate keys (the last wins), order kept.
        '{"b": 1, "a": {"c": [1, [2, [3, {"d": null}]]], "e": true, "f": false}}',
        "[]",
        "{}",
        '{"a": 1, "a": 2}',
        "[" * 500 + "]" * 500,
        "[" * 1100 + "]" * 1100,
        # What json reads and orjson refuses, and what both refuse.
        "NaN",
        "[Infinity, -Infinity]",
        " [1] ",
        "",
        "[1,]",
        "{'a': 1}",
        "01",
        '"unterminated',
    ],
)
def test_reads_as_json_does(text: str) -> None:
    check(text.encode("utf-8"))


@pytest.mark.parametrize(
    "text",
    [
        '{"a": "\u00e9"}'.encode("utf-16"),
        '{"a": "\u00e9"}'.encode("utf-32-le"),
        b'\xef\xbb\xbf{"bom": 1}',
        b'"\xff\xfe invalid"',
        b'"\xed\xa0\x80"',  # a surrogate encoded in UTF-8, as json's surrogatepass reads it
    ],
)
def test_reads_other_encodings_as_json_does(text: bytes) -> None:
    check(text)


def test_str_reads_as_json_does() -> None:
    assert same(loads('{"a": [1, 2.5, "\u00e9"]}'), {"a": [1, 2.5, "\u00e9"]})


scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
)
documents = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(), inner, max_size=5),
    max_leaves=30,
)


@settings(max_examples=400, deadline=None)
@given(documents, st.booleans())
def test_documents_read_as_json_does(value: Any, ascii_only: bool) -> None:
    check(json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass"))


# Numbers as any JSON text may write them: PostgreSQL's plain digits and others'.
numbers = st.from_regex(
    r"-?(0|[1-9][0-9]{0,40})(\.[0-9]{1,40})?([eE][+-]?[0-9]{1,3})?", fullmatch=True
)


@settings(max_examples=1000, deadline=None)
@given(numbers)
def test_numbers_read_as_json_does(number: str) -> None:
    check(number.encode())
    check(f'{{"n": [{number}]}}'.encode())


def test_digits_of_a_hex_digest_stay_with_orjson(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run of 19 digits inside a hex digest or a string of digits (one hash in a few
    hundred has one) does not send a whole reply to the slower json module."""
    digest = "5d73e62175c40dc4933606207947850462077a69de637f10e124bb0"
    text = json.dumps({"request_hash": digest, "key": "12345678901234567890", "n": 1}).encode()

    def refuse(data: bytes | str) -> Any:
        raise AssertionError("read by json")

    monkeypatch.setattr(jsonloads.json, "loads", refuse)
    assert loads(text) == {"request_hash": digest, "key": "12345678901234567890", "n": 1}
