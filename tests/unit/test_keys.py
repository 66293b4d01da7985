"""Idempotency keys, canonical JSON and request hashes: the identities stored forever."""

import hashlib
import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import rfc8785
from pydantic import BaseModel

import saga
from saga import Saga
from saga._db._store_base import QUERIES
from saga.keys import (
    HASH_VERSION,
    HASH_VERSIONS,
    action_request_hashes,
    call_operation_name,
    canonical_form,
    canonical_json,
    check_json,
    hash_of_form,
    operation_key,
    request_hash,
    saga_key_prefix,
    same_request,
)

# How long a child interpreter may take for one tiny computation (seconds).
CHILD_TIMEOUT_SECONDS = 20.0
# A cyclic value must be refused well within this (seconds); a hang means a busy loop.
CYCLE_TIMEOUT_SECONDS = 2.0


class Renewal(BaseModel):
    tenant_id: str
    renewal_event_id: str
    order_id: str
    amount_cents: int
    requested_at: str | None = None


def _renewal_saga() -> Saga[Renewal]:
    return Saga(
        "renewal",
        version=1,
        input=Renewal,
        key=lambda r: r.renewal_event_id,
        tenant=lambda r: r.tenant_id,
        volatile=("requested_at",),
    )


def _renewal(**overrides: Any) -> Renewal:
    data: dict[str, Any] = {
        "tenant_id": "acme",
        "renewal_event_id": "evt-1",
        "order_id": "ord-9",
        "amount_cents": 1299,
        "requested_at": "2024-05-01T10:00:00Z",
    }
    data.update(overrides)
    return Renewal(**data)


# ----- idempotency keys ---------------------------------------------------------------


def test_action_key_has_the_documented_format() -> None:
    """An action's key is `{saga}:v{version}:{tenant}:{key}:{step}`."""
    assert operation_key("renewal", 3, "acme", "evt-1", "charge", "action") == (
        "renewal:v3:acme:evt-1:charge"
    )


def test_compensation_key_appends_compensate() -> None:
    """A compensation's key is its step's key followed by `:compensate`."""
    action = operation_key("renewal", 1, "acme", "evt-1", "charge", "action")
    comp = operation_key("renewal", 1, "acme", "evt-1", "charge", "compensation")
    assert comp == f"{action}:compensate"
    assert comp == "renewal:v1:acme:evt-1:charge:compensate"


def test_saga_key_prefix_is_shared_by_every_operation_key() -> None:
    """Every operation key of an instance starts with `{saga}:v{version}:{tenant}:{key}:`."""
    prefix = saga_key_prefix("renewal", 2, "acme", "evt-1")
    assert prefix == "renewal:v2:acme:evt-1"
    for step, kind in [("a", "action"), ("b", "action"), ("a", "compensation")]:
        assert operation_key("renewal", 2, "acme", "evt-1", step, kind).startswith(prefix + ":")


def test_empty_tenant_keeps_its_slot() -> None:
    """A saga without tenant still has an (empty) tenant part, so the key layout is fixed."""
    assert operation_key("renewal", 1, "", "evt-1", "charge", "action") == (
        "renewal:v1::evt-1:charge"
    )


def test_separator_in_tenant_or_key_is_escaped() -> None:
    """':' and '%' inside a part are percent-escaped, so a part never adds a separator."""
    key = operation_key("renewal", 1, "a:b", "50%:x", "charge", "action")
    assert key == "renewal:v1:a%3Ab:50%25%3Ax:charge"
    assert key.count(":") == 4


def test_shifting_a_separator_between_tenant_and_key_changes_the_key() -> None:
    """Tenant "a:b" with key "c" and tenant "a" with key "b:c" are different operations."""
    left = operation_key("s", 1, "a:b", "c", "step", "action")
    right = operation_key("s", 1, "a", "b:c", "step", "action")
    assert left != right


def test_a_key_that_looks_like_a_compensation_does_not_collide() -> None:
    """An action whose saga key ends in ':x:compensate' never shares a compensation's key."""
    comp = operation_key("s", 1, "t", "k", "x", "compensation")
    sneaky = operation_key("s", 1, "t", "k:x", "compensate", "action")
    assert comp != sneaky


def test_escaped_text_in_a_part_does_not_collide_with_the_separator() -> None:
    """A literal "%3A" in a key stays distinct from a real ':' in another key."""
    literal = operation_key("s", 1, "t", "a%3Ab", "step", "action")
    colon = operation_key("s", 1, "t", "a:b", "step", "action")
    assert literal != colon


def test_distinct_tenant_key_pairs_never_share_an_operation_key() -> None:
    """Over every short (tenant, key) pair made of separator-like characters, keys are unique."""
    alphabet = ":%3Aa"
    parts = ["".join(chars) for n in range(4) for chars in itertools.product(alphabet, repeat=n)]
    seen: dict[str, tuple[str, str]] = {}
    for tenant, key in itertools.product(parts, parts):
        for kind in ("action", "compensation"):
            op_key = operation_key("s", 1, tenant, key, "step", kind)
            assert op_key not in seen, (op_key, seen.get(op_key), (tenant, key))
            seen[op_key] = (tenant, key)


def test_version_is_part_of_the_key() -> None:
    """Bumping the saga version gives every operation a new identity."""
    v1 = operation_key("renewal", 1, "acme", "evt-1", "charge", "action")
    v2 = operation_key("renewal", 2, "acme", "evt-1", "charge", "action")
    assert v1 != v2


# ----- canonical JSON -------------------------------------------------------------------


def test_canonical_json_sorts_keys_and_drops_whitespace() -> None:
    """Canonical JSON has sorted keys at every depth and no insignificant whitespace."""
    value = {"b": 1, "a": {"d": [1, 2], "c": None}}
    assert canonical_json(value) == '{"a":{"c":null,"d":[1,2]},"b":1}'


def test_canonical_json_keeps_unicode_unescaped() -> None:
    """Non-ASCII text is kept as is (hashed as UTF-8), not as \\u escapes."""
    assert canonical_json({"name": "Zoë"}) == '{"name":"Zoë"}'


@pytest.mark.parametrize(
    "value",
    [
        float("nan"),
        float("inf"),
        float("-inf"),
        {"amount": float("nan")},
        [1, [2, float("inf")]],
    ],
    ids=["nan", "inf", "-inf", "nested-nan", "nested-inf"],
)
def test_canonical_json_rejects_non_finite_floats(value: object) -> None:
    """NaN and Infinity are not JSON: canonical JSON raises TypeError instead of emitting them."""
    with pytest.raises(TypeError):
        canonical_json(value)


@pytest.mark.parametrize(
    "value",
    [
        {1, 2},
        (1, 2),
        {1: "a"},
        {"outer": {2: "b"}},
        b"bytes",
        object(),
        {"when": frozenset()},
        [{"k": (1,)}],
    ],
    ids=["set", "tuple", "int-key", "nested-int-key", "bytes", "object", "frozenset", "deep"],
)
def test_canonical_json_rejects_values_that_do_not_round_trip(value: object) -> None:
    """Sets, tuples, non-str keys and other objects raise TypeError (a replay would differ)."""
    with pytest.raises(TypeError):
        canonical_json(value)


def test_check_json_names_the_place_and_the_path() -> None:
    """The TypeError names the caller's `where` and the path of the offending value."""
    with pytest.raises(TypeError, match=r"result of step 'charge'.*\.items\[1\]"):
        check_json({"items": [1, {2}]}, where="result of step 'charge'")


def test_check_json_accepts_plain_json() -> None:
    """None, bool, int, finite float, str, list and str-keyed dict are accepted."""
    check_json(
        {"n": None, "b": True, "i": -3, "f": 1.5, "s": "x", "l": [1, "2"], "d": {"k": []}},
        where="test",
    )


def test_check_json_refuses_a_cyclic_value_promptly() -> None:
    """A self-referencing list is not JSON: refused at once with an error, never a hang."""
    import saga.keys

    # Load keys.py alone in a child so a busy loop can be killed by the timeout.
    program = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('k', {saga.keys.__file__!r})\n"
        "mod = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(mod)\n"
        "cycle = []\n"
        "cycle.append(cycle)\n"
        "try:\n"
        "    mod.check_json(cycle, where='test')\n"
        "except (TypeError, ValueError) as exc:\n"
        "    print('refused')\n"
        "else:\n"
        "    print('accepted')\n"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", program],
            capture_output=True,
            text=True,
            timeout=CYCLE_TIMEOUT_SECONDS,
            check=True,
        )
        answer = done.stdout.strip()
    except subprocess.TimeoutExpired:
        answer = f"no answer within {CYCLE_TIMEOUT_SECONDS}s (busy loop)"
    assert answer == "refused"


# ----- request hashes -------------------------------------------------------------------


def test_request_hash_is_hex_sha256_of_canonical_json() -> None:
    """The request hash is the hex SHA-256 of the RFC 8785 canonical form (version 2);
    version 1, of rows written before, is that of Python's json with sorted keys."""
    fields = {"order_id": "ord-9", "amount_cents": 1299, "note": "Zoë"}
    expected = hashlib.sha256(rfc8785.dumps(fields)).hexdigest()
    digest = request_hash(fields)
    assert digest == expected == request_hash(fields, version=2)
    assert len(digest) == 64
    assert all(c in "0123456789abcdef" for c in digest)
    assert (
        request_hash(fields, version=1)
        == hashlib.sha256(
            json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
        ).hexdigest()
    )
    with pytest.raises(ValueError, match="unknown request hash version 3"):
        request_hash(fields, version=3)


def test_equal_json_numbers_are_one_request() -> None:
    """4200 and 4200.0 are equal JSON numbers (and equal in jsonb): one request."""
    assert request_hash({"amount_cents": 4200}) == request_hash({"amount_cents": 4200.0})
    assert request_hash({"amount_cents": 4200}) != request_hash({"amount_cents": 4200.5})
    assert canonical_form({"a": [4200.0, -0.0, 1e-7, 2.5]}) == b'{"a":[4200,0,1e-7,2.5]}'


def test_integers_beyond_rfc_8785s_domain_keep_all_their_digits() -> None:
    """RFC 8785 refuses integers it cannot hold exactly; two large ids stay two requests."""
    big = 2**63 - 1
    assert canonical_form({"id": big, "n": 1.5}) == f'{{"id":{big},"n":1.5}}'.encode()
    assert request_hash({"id": big}) != request_hash({"id": big - 1})


def test_the_canonical_form_matches_rfc_8785s_published_examples() -> None:
    """RFC 8785, section 3.2.2 (its 1E30 left out: a float from 2**53 on is refused here,
    as jsonb would not keep it exactly) and section 3.2.3 (keys sorted by UTF-16 code
    units, where Python's sort by code points differs)."""
    value = json.loads(
        '{"numbers": [333333333.33333329, 4.50, 2e-3, 0.000000000000000000000000001],'
        '"string": "\\u20ac$\\u000F\\u000aA\'\\u0042\\u0022\\u005c\\\\\\"\\/",'
        '"literals": [null, true, false]}'
    )
    assert (
        canonical_form(value)
        == (
            '{"literals":[null,true,false],"numbers":[333333333.3333333,4.5,0.002,1e-27],'
            '"string":"€$\\u000f\\nA\'B\\"\\\\\\\\\\"/"}'
        ).encode()
    )
    keys = json.loads(
        '{"\\u20ac": "Euro Sign", "\\r": "Carriage Return", '
        '"\\ufb33": "Hebrew Letter Dalet With Dagesh", "1": "One", '
        '"\\ud83d\\ude00": "Emoji: Grinning Face", "\\u0080": "Control", '
        '"\\u00f6": "Latin Small Letter O With Diaeresis"}'
    )
    order = list(json.loads(canonical_form(keys)))
    assert order == ["\r", "1", "\u0080", "\u00f6", "\u20ac", "\U0001f600", "\ufb33"]
    # What a JCS implementation in another language hashes: the same bytes.
    assert request_hash(keys) == hashlib.sha256(canonical_form(keys)).hexdigest()
    assert request_hash(keys) != request_hash(keys, version=1)


def test_a_stored_hash_verifies_under_its_own_version() -> None:
    fields = {"amount_cents": 4200.0}
    assert same_request(request_hash(fields, version=1), fields, version=1)
    assert same_request(request_hash(fields, version=1), {"amount_cents": 4200.0})
    assert not same_request(request_hash(fields, version=1), {"amount_cents": 4200}, version=1)
    assert same_request(request_hash(fields), {"amount_cents": 4200}, version=2)
    assert not same_request(request_hash(fields), {"amount_cents": 4201}, version=2)


def test_request_hash_ignores_key_order() -> None:
    """Two requests with the same fields in a different order have the same hash."""
    a = {"x": 1, "y": {"p": [1, 2], "q": "z"}}
    b = {"y": {"q": "z", "p": [1, 2]}, "x": 1}
    assert request_hash(a) == request_hash(b)


def test_request_hash_differs_for_different_values() -> None:
    """A different business value (or list order) gives a different hash."""
    base = request_hash({"amount_cents": 1299, "items": [1, 2]})
    assert request_hash({"amount_cents": 1300, "items": [1, 2]}) != base
    assert request_hash({"amount_cents": 1299, "items": [2, 1]}) != base
    assert request_hash({"amount_cents": 1299, "items": [1, 2], "extra": None}) != base


def test_request_hash_rejects_non_json() -> None:
    """Hashing a request that is not plain JSON raises TypeError rather than guessing."""
    with pytest.raises(TypeError):
        request_hash({"when": {1, 2}})


def test_input_hash_ignores_volatile_fields() -> None:
    """Changing only a volatile field (requested_at) keeps the saga's request hash."""
    saga = _renewal_saga()
    first = saga.input_hash(_renewal(requested_at="2024-05-01T10:00:00Z"))
    retry = saga.input_hash(_renewal(requested_at="2024-05-02T11:30:00Z"))
    absent = saga.input_hash(_renewal(requested_at=None))
    assert first == retry == absent


def test_business_fields_exclude_volatile_fields() -> None:
    """business_fields is the JSON input without the volatile fields; it is what gets hashed."""
    saga = _renewal_saga()
    data = _renewal()
    fields = saga.business_fields(data)
    assert fields == {
        "tenant_id": "acme",
        "renewal_event_id": "evt-1",
        "order_id": "ord-9",
        "amount_cents": 1299,
    }
    assert saga.input_hash(data) == request_hash(fields)


@pytest.mark.parametrize(
    "change",
    [{"amount_cents": 1300}, {"order_id": "ord-10"}, {"tenant_id": "globex"}],
    ids=["amount", "order", "tenant"],
)
def test_input_hash_differs_for_a_different_business_field(change: dict[str, Any]) -> None:
    """Changing any business field changes the request hash (so a reused key conflicts)."""
    saga = _renewal_saga()
    assert saga.input_hash(_renewal(**change)) != saga.input_hash(_renewal())


def test_input_hash_is_the_same_in_another_process() -> None:
    """The hash depends only on the data: another interpreter (other hash seed) agrees."""
    saga = _renewal_saga()
    data = _renewal()
    fields = {"b": [1, 2.5, None], "a": {"z": "Zoë", "y": True}}
    program = (
        "import json, sys\n"
        "from saga.keys import request_hash, operation_key\n"
        "fields = json.loads(sys.argv[1])\n"
        "business = json.loads(sys.argv[2])\n"
        "print(request_hash(fields))\n"
        "print(request_hash(business))\n"
        "print(operation_key('renewal', 1, 'a:b', 'evt%1', 'charge', 'compensation'))\n"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            program,
            json.dumps(fields),
            json.dumps(saga.business_fields(data)),
        ],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_SECONDS,
        check=True,
        env=env,
    )
    assert done.stdout.split() == [
        request_hash(fields),
        saga.input_hash(data),
        operation_key("renewal", 1, "a:b", "evt%1", "charge", "compensation"),
    ]


@pytest.mark.parametrize("number", [2.0**53, -(2.0**60), 3.602879701896397e16, 1e300])
def test_floats_too_large_to_store_exactly_are_refused(number: float) -> None:
    """jsonb keeps a float's printed digits; from 2**53 on they are not its exact value."""
    with pytest.raises(TypeError, match="too large to store exactly"):
        check_json({"amount": number}, where="result of step 'charge'")
    check_json({"amount": 2.0**53 - 1, "big_int": 2**80}, where="result of step 'charge'")


def test_the_writing_statements_record_the_current_hash_version() -> None:
    """Each statement that writes operations or sagas says which request hash version its
    rows were hashed under (saga.hashed_under, migration 0023): the current one."""
    queries = (Path(saga.__file__).parent / "sql" / "queries.sql").read_text(encoding="utf-8")
    code = "\n".join(line for line in queries.splitlines() if not line.startswith("--"))
    marks = re.findall(r"saga\.hashed_under\((\d+),", code)
    assert len(marks) == 6
    assert set(marks) == {str(HASH_VERSION)}


def test_each_writing_statement_has_a_direct_twin_without_the_wrapper() -> None:
    """On a direct connection the session says the request hash version (a startup option),
    and the store sends `name`_direct: the same statement as `name` without
    saga.hashed_under, which cost a function call a statement (migration 0023)."""
    wrapped = {name: text for name, text in QUERIES.items() if "saga.hashed_under(" in text}
    assert sorted(wrapped) == [
        "claim_started",
        "ledger_claim",
        "start_saga",
        "start_sagas",
        "write_saga",
        "write_sagas",
    ]
    for name, text in wrapped.items():
        body = "\n".join(line for line in text.splitlines() if not line.startswith("--"))
        plain = re.sub(r"saga\.hashed_under\(\d+, (%\(\w+\)s::\w+)\)", r"\1", body)
        direct = QUERIES[f"{name}_direct"]
        code = "\n".join(line for line in direct.splitlines() if not line.startswith("--"))
        assert code == plain and "hashed_under" not in code


def test_the_documented_key_escaping_example_is_what_the_code_writes() -> None:
    """docs/sagas.md and docs/getting-started.md show how a forked session's call key is
    escaped, and how to read it back: both are what `operation_key` does."""
    root = Path(__file__).resolve().parents[2]
    run_id = "crashB-028:fork:rent_car"
    step = call_operation_name("rent_car", "car-1")
    key = operation_key("session/session", 1, "box-office", run_id, step, "action")
    for page in ("docs/sagas.md", "docs/getting-started.md"):
        raw = (root / page).read_text(encoding="utf-8")
        text = " ".join(raw.split())
        assert key in raw, page
        assert "`%` is written `%25`" in text, page
        assert f"`{run_id}`" in text, page
    # Read back as documented: split on ':', then '%3A' -> ':' and '%25' -> '%' per part.
    parts = [p.replace("%3A", ":").replace("%25", "%") for p in key.split(":")]
    assert parts == ["session/session", "v1", "box-office", run_id, step]
    assert step == "rent_car.701cec69f31b"
    # '%' is escaped first, so a literal '%3A' in a part reads back as itself.
    odd = operation_key("s", 1, "t", "50%3A:x", "y", "action")
    assert odd == "s:v1:t:50%253A%3Ax:y"
    assert [p.replace("%3A", ":").replace("%25", "%") for p in odd.split(":")][3] == "50%3A:x"


@pytest.mark.parametrize(
    "business",
    [
        {},
        {"amount": 4200.0, "to": "acct-1"},
        {"id": 2**60, "nested": {"é": [1, 2.5, None, True]}, "\U0001f600": "x", "a": "b"},
        {"ref": 'line\nbreak "quoted" \\', "big": -(2**70)},
    ],
)
@pytest.mark.parametrize("version", HASH_VERSIONS)
def test_action_request_hashes_are_each_steps_whole_request_hash(
    business: dict[str, Any], version: int
) -> None:
    """The action rows of a new saga hash the business input's canonical form once for all
    steps; under every hash version each hash is the one the whole request gives."""
    steps = ["charge", "book_hotel", "étape"]
    whole = [
        request_hash({"kind": "action", "step": step, "input": business}, version=version)
        for step in steps
    ]
    assert action_request_hashes(steps, business, version=version) == whole
    canonical = canonical_form(business, version=version)
    assert action_request_hashes(steps, business, version=version, canonical=canonical) == whole


@pytest.mark.parametrize("version", HASH_VERSIONS)
def test_a_canonical_form_made_ahead_hashes_as_its_request(version: int) -> None:
    """A start hashes the input's canonical form it made once for the steps' hashes: that
    hash is the request hash of the same fields, the hex SHA-256 of the form."""
    business = {"order_id": "o-1", "amount": 4200.0, "lines": [1, 2**60]}
    form = canonical_form(business, version=version)
    assert hash_of_form(form) == request_hash(business, version=version)
    assert hash_of_form(form) == hashlib.sha256(form).hexdigest()
