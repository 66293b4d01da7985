"""Stable identities: canonical JSON, request fingerprints and idempotency keys."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

import rfc8785

JsonValue = Any  # None | bool | int | float | str | list[JsonValue] | dict[str, JsonValue]

# Deeper nesting is refused: it is almost always a cycle, and PostgreSQL's jsonb and
# Python's json module both have nesting limits of their own.
MAX_JSON_DEPTH = 256


# From 2**53 on, a float's printed digits (all jsonb keeps) no longer name its exact value.
MAX_EXACT_FLOAT = 2.0**53


def _inexact(item: float, path: str) -> str:
    return (
        f"the float {item!r} at {path or '<root>'} is too large to store exactly (PostgreSQL "
        "jsonb keeps its printed digits only); send an int or a string"
    )


def check_json(value: object, *, where: str) -> None:
    """Raise `TypeError` unless `value` is plain JSON that round-trips unchanged.

    Plain JSON means None, bool, int, finite float, str, list and dict with str keys.
    Tuples, sets, non-str keys, NaN and Infinity are refused because a replay from
    storage would not see the same value as the first run; so are cyclic values and
    nesting deeper than `MAX_JSON_DEPTH`, and strings or keys that PostgreSQL's jsonb
    refuses (a NUL character, a lone surrogate).
    """
    stack: list[tuple[object, str, int]] = [(value, "", 0)]
    while stack:
        item, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise TypeError(
                f"{where}: nested more than {MAX_JSON_DEPTH} levels deep at {path[:80]}... "
                "(is the value cyclic?)"
            )
        if isinstance(item, str):
            problem = _bad_text(item)
            if problem:
                raise TypeError(f"{where}: the string at {path or '<root>'} {problem}")
            continue
        if item is None or isinstance(item, bool | int):
            continue
        if isinstance(item, float):
            if not math.isfinite(item):
                raise TypeError(f"{where}: {item!r} at {path or '<root>'} is not valid JSON")
            if abs(item) >= MAX_EXACT_FLOAT:
                raise TypeError(f"{where}: {_inexact(item, path)}")
            continue
        if isinstance(item, list):
            stack.extend((child, f"{path}[{i}]", depth + 1) for i, child in enumerate(item))
            continue
        if isinstance(item, dict):
            for k, child in item.items():
                if not isinstance(k, str):
                    raise TypeError(
                        f"{where}: key {k!r} at {path or '<root>'} is not a string; "
                        "JSON objects only have string keys"
                    )
                problem = _bad_text(k)
                if problem:
                    raise TypeError(f"{where}: the key {k[:80]!r} at {path or '<root>'} {problem}")
                stack.append((child, f"{path}.{k}", depth + 1))
            continue
        raise TypeError(
            f"{where}: {type(item).__name__} at {path or '<root>'} is not JSON "
            "(return JSON values or a pydantic model)"
        )


# Largest saga input accepted, in bytes of its canonical JSON (UTF-8): 1 MiB. The input is
# stored with the saga, hashed into every operation's request hash and read at every
# step; a bigger payload belongs in object storage, referenced from the input.
MAX_INPUT_BYTES = 1024 * 1024


def check_saga_input(
    saga: str, value: object, stored: JsonValue, *, identity: tuple[str, str]
) -> None:
    """Raise `ValueError` unless a saga input can be stored and replayed exactly.

    `value` is the validated input as Python values and `stored` its JSON form. Refused:
    NaN and Infinity anywhere (JSON has neither; serializers turn some into null), NUL
    characters and lone surrogates in any string, tenant or key (PostgreSQL text and
    jsonb cannot hold them), nesting deeper than `MAX_JSON_DEPTH`, and a canonical JSON
    form larger than `MAX_INPUT_BYTES`.
    """
    where = f"input of saga {saga!r}"
    for name, part in zip(("tenant", "key"), identity, strict=True):
        problem = _bad_text(part)
        if problem:
            raise ValueError(f"{where}: the {name} {part[:80]!r} {problem}")
    stack: list[tuple[object, str, int]] = [(value, "", 0)]
    while stack:
        item, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"{where}: nested more than {MAX_JSON_DEPTH} levels deep")
        if isinstance(item, float) and not math.isfinite(item):
            raise ValueError(
                f"{where}: {item!r} at {path or '<root>'} is not valid JSON "
                "(NaN and Infinity are refused)"
            )
        if isinstance(item, float) and abs(item) >= MAX_EXACT_FLOAT:
            raise ValueError(f"{where}: {_inexact(item, path)}")
        if isinstance(item, str):
            problem = _bad_text(item)
            if problem:
                raise ValueError(f"{where}: the string at {path or '<root>'} {problem}")
        elif isinstance(item, Mapping):
            for k, child in item.items():
                if isinstance(k, str) and _bad_text(k):
                    raise ValueError(
                        f"{where}: the key {k[:80]!r} at {path or '<root>'} {_bad_text(k)}"
                    )
                stack.append((child, f"{path}.{k}", depth + 1))
        elif isinstance(item, list | tuple | set | frozenset):
            stack.extend((child, f"{path}[{i}]", depth + 1) for i, child in enumerate(item))
    try:
        size = len(canonical_json(stored).encode("utf-8"))
    except TypeError as exc:
        raise ValueError(f"{where}: {exc}") from None
    if size > MAX_INPUT_BYTES:
        raise ValueError(
            f"{where} is {size:,} bytes of JSON, above the limit of {MAX_INPUT_BYTES:,} bytes "
            "(saga.keys.MAX_INPUT_BYTES); store large payloads elsewhere and pass a reference"
        )


def _bad_text(text: str) -> str | None:
    if text.isascii():
        # No surrogate is ASCII: only a NUL can be wrong (and the check allocates nothing).
        return "contains a NUL character, which PostgreSQL cannot store" if "\x00" in text else None
    if "\x00" in text:
        return "contains a NUL character, which PostgreSQL cannot store"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "is not valid Unicode (a lone surrogate?)"
    return None


def canonical_json(value: JsonValue) -> str:
    """Serialize JSON with sorted keys and no insignificant whitespace.

    The readable form used in keys and messages (and hash version 1); request hashes
    use `canonical_form`.
    """
    check_json(value, where="canonical JSON")
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


# Request hash versions. 1: SHA-256 of `canonical_json` (Python's json with sorted keys),
# which writes 4200.0 and 4200 differently. 2: SHA-256 of RFC 8785 (JSON Canonicalization
# Scheme), where JSON numbers that are equal are written alike, so a tool in any language
# with a JCS implementation computes the same hash. Every stored operation records the
# version its hash was computed under (column `hash_version`, migration 0023).
HASH_VERSION = 2
HASH_VERSIONS = (1, 2)


def canonical_form(value: JsonValue, *, version: int = HASH_VERSION) -> bytes:
    """The UTF-8 bytes a request hash of `version` is computed over.

    Version 2 is RFC 8785 (JSON Canonicalization Scheme): object keys sorted by their
    UTF-16 code units, no whitespace, minimal string escapes, numbers written as
    ECMAScript writes them (`4200.0` and `4200` are both `4200`, `1e-07` is `1e-7`). An
    integer outside RFC 8785's exact domain, beyond +/-(2**53 - 1), is written with all
    its digits instead of being refused, so that two different large integers (ids) stay
    two requests.
    """
    if version == 1:
        return canonical_json(value).encode()
    if version != 2:
        raise ValueError(f"unknown request hash version {version!r}; known: {HASH_VERSIONS}")
    check_json(value, where="canonical JSON")
    try:
        return rfc8785.dumps(value)
    except rfc8785.IntegerDomainError:
        return _jcs_exact_integers(value)


def _jcs_exact_integers(value: JsonValue) -> bytes:
    """RFC 8785 of `value`, with integers beyond its domain written with all their digits."""
    if isinstance(value, dict):
        items = sorted(value.items(), key=lambda kv: kv[0].encode("utf-16be"))
        inner = b",".join(rfc8785.dumps(k) + b":" + _jcs_exact_integers(v) for k, v in items)
        return b"{" + inner + b"}"
    if isinstance(value, list):
        return b"[" + b",".join(_jcs_exact_integers(v) for v in value) + b"]"
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value).encode("ascii")
    return rfc8785.dumps(value)


def hash_of_form(form: bytes) -> str:
    """The request hash of a canonical form already made (`canonical_form`): its hex
    SHA-256. Every request and input hash is computed here."""
    return hashlib.sha256(form).hexdigest()


def request_hash(fields: Mapping[str, JsonValue], *, version: int = HASH_VERSION) -> str:
    """Hex SHA-256 of the canonical form (`canonical_form`) of a request's business fields."""
    return hash_of_form(canonical_form(dict(fields), version=version))


def action_request_hashes(
    steps: Sequence[str],
    business: Mapping[str, JsonValue],
    *,
    version: int = HASH_VERSION,
    canonical: bytes | None = None,
) -> list[str]:
    """The request hash of each action step of a saga with this business input:
    `request_hash({"kind": "action", "step": step, "input": business})` for each step.

    Under version 2 the business input's canonical form is made once for all the steps
    (or passed in as `canonical`, `canonical_form(business)` under that version) and the
    envelope is written around it: RFC 8785 writes an object's members in the order of
    their keys, which "input", "kind" and "step" already are. Any other version hashes
    each request whole.
    """
    if version != 2:
        return [
            request_hash({"kind": "action", "step": step, "input": dict(business)}, version=version)
            for step in steps
        ]
    if canonical is None:
        canonical = canonical_form(dict(business))
    head = b'{"input":' + canonical + b',"kind":"action","step":'
    return [hash_of_form(head + _step_form(step) + b"}") for step in steps]


@lru_cache(maxsize=1024)
def _step_form(step: str) -> bytes:
    """The version 2 canonical form of a step's name: the same few names at every start."""
    return canonical_form(step, version=2)


def same_request(
    stored_hash: str, fields: Mapping[str, JsonValue], *, version: int | None = None
) -> bool:
    """Whether `fields` are the request a stored hash was computed over.

    Compared under the stored row's `version` first (None: the current one), then under
    the other known versions: each version's canonical form is a faithful JSON text, so a
    hash that matches under any of them names the same JSON value. A row written before
    an upgrade keeps verifying under its own version.
    """
    first = HASH_VERSION if version is None else version
    order = (first, *(v for v in HASH_VERSIONS if v != first))
    return any(request_hash(fields, version=v) == stored_hash for v in order)


def _escape(part: str) -> str:
    # ':' separates the key's parts; escaping it (and the escape character) keeps
    # tenant "a:b" + key "c" distinct from tenant "a" + key "b:c".
    return part.replace("%", "%25").replace(":", "%3A")


def saga_key_prefix(saga: str, version: int, tenant: str, key: str) -> str:
    """`{saga}:v{version}:{tenant}:{key}`, the prefix shared by a saga's operation keys."""
    return ":".join((_escape(saga), f"v{version}", _escape(tenant), _escape(key)))


def call_operation_name(step: str, key: str) -> str:
    """The operation name of a code-first call (a session's durable step, a ledger's
    tool): its step's name and a short digest of its key (48 bits), so that a step called
    under several keys has an operation per key.

    The short name is for people (`saga show`, `saga resolve`); it is not the call's
    identity. Two keys whose short names collide are two calls: the second one is named
    by `call_operation_long_name`."""
    return f"{step}.{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def call_operation_long_name(step: str, key: str) -> str:
    """The operation name of a code-first call whose short name (`call_operation_name`)
    another key's call has: its step's name and the whole SHA-256 of its key."""
    return f"{step}.{hashlib.sha256(key.encode()).hexdigest()}"


def operation_key(saga: str, version: int, tenant: str, key: str, step: str, kind: str) -> str:
    """Idempotency key of one operation; compensations end in `:compensate`."""
    base = f"{saga_key_prefix(saga, version, tenant, key)}:{_escape(step)}"
    return f"{base}:compensate" if kind == "compensation" else base
