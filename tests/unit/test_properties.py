"""Property-based tests of the pure parts, and of hostile input on its way into PostgreSQL.

Canonical JSON and request hashes are stable across key orders and processes and tell
distinct business fields apart; inputs with odd unicode, deep nesting and SQL
metacharacters are stored and replayed exactly, while NaN, Infinity, NUL characters and
inputs above `MAX_INPUT_BYTES` are refused with a clear error before anything is
written. No query in `saga/` is built by formatting values into SQL text.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from saga import Orchestrator, Saga, SagaDefinitionError, StepContext
from saga.keys import (
    MAX_INPUT_BYTES,
    MAX_JSON_DEPTH,
    canonical_json,
    check_saga_input,
    request_hash,
)

SAGA_DIR = Path(__file__).resolve().parents[2] / "saga"

# JSON as PostgreSQL's jsonb and Python's json agree on it: no NUL, and finite floats
# below 2**53 (larger ones are refused: jsonb keeps only their printed digits).
SAFE_NUMBER = 2**53
json_text = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"))
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**53), max_value=2**53)
    | st.floats(
        min_value=-SAFE_NUMBER,
        max_value=SAFE_NUMBER,
        allow_nan=False,
        exclude_min=True,
        exclude_max=True,
    )
    | json_text
)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(json_text, children, max_size=5)
    ),
    max_leaves=25,
)
json_objects = st.dictionaries(json_text, json_values, max_size=6)
# Where hostile strings come from: quotes, comments, placeholders, escapes, odd unicode.
SQL_META = ["'", '"', ";", "--", "/*", "*/", "%s", "%(x)s", "\\", "$1", "$$", "{}", "\u202e"]
hostile_text = st.lists(st.sampled_from(SQL_META) | json_text, min_size=1, max_size=6).map("".join)


def _reordered(value: Any) -> Any:
    """The same JSON with every object's keys in reverse insertion order."""
    if isinstance(value, dict):
        return {k: _reordered(value[k]) for k in reversed(list(value))}
    if isinstance(value, list):
        return [_reordered(v) for v in value]
    return value


# ----- canonical JSON and request hashes ---------------------------------------------------


@given(json_objects)
def test_canonical_json_ignores_key_order(value: dict[str, Any]) -> None:
    """Key order never changes the canonical form, nor the hash; the form parses back."""
    assert canonical_json(_reordered(value)) == canonical_json(value)
    assert request_hash(_reordered(value)) == request_hash(value)
    assert json.loads(canonical_json(value)) == value


@given(json_objects, json_text, json_values, json_values)
def test_distinct_business_fields_hash_apart(
    base: dict[str, Any], field: str, one: Any, other: Any
) -> None:
    """Two requests that differ in one business field have different hashes."""
    assume(canonical_json(one) != canonical_json(other))
    assert request_hash({**base, field: one}) != request_hash({**base, field: other})


def test_hashes_are_the_same_in_another_process() -> None:
    """A fresh interpreter (another hash seed) computes the same canonical JSON and hashes."""
    values: list[dict[str, Any]] = []

    @settings(max_examples=80, database=None)
    @given(json_objects)
    def collect(value: dict[str, Any]) -> None:
        values.append(value)

    collect()
    here = [[canonical_json(v), request_hash(v)] for v in values]
    script = (
        "import json, sys\n"
        "from saga.keys import canonical_json, request_hash\n"
        "values = json.load(sys.stdin)\n"
        "print(json.dumps([[canonical_json(v), request_hash(v)] for v in values]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        input=json.dumps([_reordered(v) for v in values]),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "12345"},
    )
    assert json.loads(proc.stdout) == here


class Request(BaseModel):
    tenant_id: str
    key: str
    amount: int
    note: str = ""
    payload: Any = None
    requested_at: str | None = None  # volatile


HASHED: Saga[Request] = Saga(
    "hashed",
    input=Request,
    key=lambda r: r.key,
    tenant=lambda r: r.tenant_id,
    volatile=("requested_at",),
)


@given(hostile_text, hostile_text, st.integers(), json_text, json_text)
def test_the_input_hash_covers_business_fields_only(
    tenant: str, key: str, amount: int, at_one: str, at_other: str
) -> None:
    """Volatile fields never change a saga's input hash; a business field always does."""
    one = Request(tenant_id=tenant, key=key, amount=amount, requested_at=at_one)
    same = Request(tenant_id=tenant, key=key, amount=amount, requested_at=at_other)
    other = Request(tenant_id=tenant, key=key, amount=amount + 1, requested_at=at_one)
    assert HASHED.input_hash(one) == HASHED.input_hash(same)
    assert HASHED.input_hash(one) != HASHED.input_hash(other)


# ----- refused input -----------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_and_infinity_are_refused_clearly(bad: float) -> None:
    """NaN and Infinity are refused by name, in canonical JSON and anywhere in an input
    (even in an `Any` field, which JSON serialization would quietly turn into null)."""
    with pytest.raises(TypeError, match="is not valid JSON"):
        canonical_json({"amount": bad})
    model = Request(tenant_id="t", key="k", amount=1, payload={"x": [bad]})
    with pytest.raises(ValueError, match=r"at \.payload\.x\[0\] is not valid JSON"):
        check_saga_input(
            "hashed", model.model_dump(), model.model_dump(mode="json"), identity=("t", "k")
        )


@given(json_text, st.sampled_from(["tenant", "key", "note"]))
def test_nul_characters_are_refused_clearly(text: str, where: str) -> None:
    """PostgreSQL cannot store NUL: a NUL in the tenant, the key or any string is refused."""
    values = {"tenant_id": "t", "key": "k", "note": ""}
    values[{"tenant": "tenant_id", "key": "key", "note": "note"}[where]] = text + "\x00"
    model = Request(amount=1, **values)
    with pytest.raises(ValueError, match="NUL character"):
        check_saga_input(
            "hashed",
            model.model_dump(),
            model.model_dump(mode="json"),
            identity=(model.tenant_id, model.key),
        )


def test_inputs_above_the_size_limit_are_refused_clearly() -> None:
    """An input of MAX_INPUT_BYTES of canonical JSON passes; one byte more is refused."""
    overhead = len(canonical_json({"note": ""}).encode())
    fits = {"note": "é" * ((MAX_INPUT_BYTES - overhead) // 2)}
    assert len(canonical_json(fits).encode()) <= MAX_INPUT_BYTES
    check_saga_input("hashed", fits, fits, identity=("t", "k"))
    too_big = {"note": "x" * (MAX_INPUT_BYTES - overhead + 1)}
    with pytest.raises(ValueError, match=r"above the limit of 1,048,576 bytes"):
        check_saga_input("hashed", too_big, too_big, identity=("t", "k"))


def _nested(depth: int) -> Any:
    value: Any = "bottom"
    for i in range(depth):
        value = [value] if i % 2 else {"d": value}
    return value


def test_nesting_deeper_than_the_limit_is_refused_clearly() -> None:
    """Nesting up to MAX_JSON_DEPTH is accepted; deeper is refused, not a RecursionError."""
    deep = {"payload": _nested(MAX_JSON_DEPTH - 2)}
    check_saga_input("hashed", deep, deep, identity=("t", "k"))
    deeper = {"payload": _nested(MAX_JSON_DEPTH + 5)}
    with pytest.raises(ValueError, match=f"nested more than {MAX_JSON_DEPTH} levels"):
        check_saga_input("hashed", deeper, deeper, identity=("t", "k"))
    with pytest.raises(TypeError, match="nested more than"):
        canonical_json(_nested(10_000))


@given(st.text(min_size=1, max_size=30))
def test_names_outside_the_safe_alphabet_are_refused(name: str) -> None:
    """Saga and step names are letters, digits, '_', '-' and '.'; anything else (quotes,
    semicolons, spaces, unicode) is refused when the saga is declared."""
    assume(not re.fullmatch(r"[A-Za-z0-9_.\-]{1,100}", name))
    with pytest.raises(SagaDefinitionError, match="is invalid"):
        Saga(name, input=Request, key=lambda r: r.key)
    saga: Saga[Request] = Saga("fine", input=Request, key=lambda r: r.key)
    with pytest.raises(SagaDefinitionError, match="is invalid"):
        saga.step(name=name)(lambda ctx, r: None)


# ----- hostile input against the real database ---------------------------------------------

ECHO: Saga[Request] = Saga("echo", input=Request, key=lambda r: r.key, tenant=lambda r: r.tenant_id)


@ECHO.step
def echo(ctx: StepContext, r: Request) -> dict[str, Any]:
    return {"note": r.note, "payload": r.payload, "key": ctx.idempotency_key}


@pytest.mark.integration
def test_hostile_input_is_stored_and_replayed_exactly(database_url: str) -> None:
    """Tenants, keys and fields full of SQL metacharacters and odd unicode are stored,
    read back and handed to steps exactly as given; starting again finds the same saga."""
    with Orchestrator(database_url, sagas=[ECHO], pool_size=2) as orch:

        @settings(max_examples=20, deadline=None, database=None)
        @given(hostile_text, hostile_text, hostile_text, json_values)
        def roundtrip(tenant: str, key: str, note: str, payload: Any) -> None:
            key = f"{key}/{uuid.uuid4().hex[:8]}"  # every example its own saga
            data = Request(tenant_id=tenant, key=key, amount=7, note=note, payload=payload)
            state = orch.execute(ECHO, data)
            assert state.status == "completed"
            stored = orch.get(state.id)
            assert (stored.tenant_id, stored.key) == (tenant, key)
            assert Request.model_validate(stored.input) == data
            result = stored.operation("echo").result
            assert result["note"] == note and result["payload"] == payload
            assert orch.start(ECHO, data).id == state.id
            assert next(e.event for e in orch.history(state.id)) == "saga_started"

        roundtrip()


@pytest.mark.integration
def test_refused_inputs_write_nothing(database_url: str) -> None:
    """NaN, NUL, a huge payload and nesting beyond the limit are refused by start() with a
    ValueError naming the problem, and leave no row behind; deep nesting within the limit
    is stored and replayed exactly."""
    refused = {
        "is not valid JSON": Request(tenant_id="t", key="nan", amount=1, payload=float("nan")),
        "NUL character": Request(tenant_id="t\x00", key="nul", amount=1),
        "above the limit": Request(tenant_id="t", key="big", amount=1, note="x" * MAX_INPUT_BYTES),
        "nested more than|serialization depth": Request(
            tenant_id="t", key="deep", amount=1, payload=_nested(MAX_JSON_DEPTH + 5)
        ),
    }
    with Orchestrator(database_url, sagas=[ECHO], pool_size=2) as orch:
        for message, data in refused.items():
            with pytest.raises(ValueError, match=message):
                orch.start(ECHO, data)
        assert orch.list() == []
        deep = Request(tenant_id="t", key="deep-ok", amount=1, payload=_nested(MAX_JSON_DEPTH - 2))
        state = orch.execute(ECHO, deep)
        assert state.status == "completed"
        assert Request.model_validate(orch.get(state.id).input) == deep


# ----- no SQL built by formatting values ---------------------------------------------------

_SQL_WORDS = re.compile(
    r"\b(SELECT|INSERT\s+INTO|UPDATE|DELETE\s+FROM|LISTEN|NOTIFY|CREATE|DROP|ALTER|TRUNCATE)\b"
)
_EXECUTORS = {"execute", "executemany", "copy", "stream"}


def _formatted(node: ast.AST) -> bool:
    """An f-string, `%` formatting, `+` concatenation or `str.format` of text."""
    if isinstance(node, ast.JoinedStr):
        return True
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod | ast.Add):
        return any(
            (isinstance(side, ast.Constant) and isinstance(side.value, str)) or _formatted(side)
            for side in (node.left, node.right)
        )
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "format"
        and isinstance(node.func.value, ast.Constant)
    )


def _sql_text(node: ast.AST) -> str:
    return " ".join(
        n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    )


def test_no_query_is_built_by_string_formatting() -> None:
    """Every statement in saga/ is a constant, a named query from queries.sql, or composed
    with psycopg.sql; no f-string, %-formatting, concatenation or str.format makes SQL."""
    offences: list[str] = []
    for path in sorted(SAGA_DIR.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            where = f"{path.relative_to(SAGA_DIR.parent)}:{getattr(node, 'lineno', '?')}"
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in _EXECUTORS
                and node.args
                and _formatted(node.args[0])
            ):
                offences.append(f"{where}: {node.func.attr}() of a formatted string")
            elif _formatted(node) and _SQL_WORDS.search(_sql_text(node)):
                offences.append(f"{where}: SQL text built by formatting")
    assert offences == []
