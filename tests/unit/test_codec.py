"""ResultCodec: results stored as JSON and rebuilt, as their step declared, on replay."""

import warnings
from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import BaseModel

from saga import StepContext
from saga.codec import ResultCodec


class Charge(BaseModel):
    charge_id: str
    amount_cents: int
    captured_at: datetime | None = None
    tags: list[str] = []


def charge(ctx: StepContext, r: object) -> Charge:
    raise NotImplementedError


def maybe_charge(ctx: StepContext, r: object) -> Charge | None:
    raise NotImplementedError


def reserve(ctx: StepContext, r: object) -> dict:  # type: ignore[type-arg]
    raise NotImplementedError


def typed_reserve(ctx: StepContext, r: object) -> dict[str, int]:
    raise NotImplementedError


def unannotated(ctx, r):  # type: ignore[no-untyped-def]
    raise NotImplementedError


def anything(ctx: StepContext, r: object) -> Any:
    raise NotImplementedError


def nothing(ctx: StepContext, r: object) -> None:
    raise NotImplementedError


def _codec(fn: Any, step: str = "charge") -> ResultCodec:
    return ResultCodec(fn, where=f"step {step!r}")


def test_model_result_round_trips_to_an_equal_model() -> None:
    """A pydantic result is stored as JSON and decoded to an equal model of the same class."""
    codec = _codec(charge)
    original = Charge(
        charge_id="ch_1",
        amount_cents=1299,
        captured_at=datetime(2024, 5, 1, 10, 0, tzinfo=UTC),
        tags=["renewal"],
    )
    stored = codec.encode(original)
    assert stored == {
        "charge_id": "ch_1",
        "amount_cents": 1299,
        "captured_at": "2024-05-01T10:00:00Z",
        "tags": ["renewal"],
    }
    replayed = codec.decode(stored)
    assert isinstance(replayed, Charge)
    assert replayed == original


def test_decoding_twice_gives_equal_values() -> None:
    """Every replay sees the same data, not only the first one."""
    codec = _codec(charge)
    stored = codec.encode(Charge(charge_id="ch_1", amount_cents=5))
    assert codec.decode(stored) == codec.decode(stored)


def test_optional_model_result_round_trips() -> None:
    """`-> Charge | None` stores None as None and a model as a model."""
    codec = _codec(maybe_charge)
    assert codec.encode(None) is None
    assert codec.decode(None) is None
    model = Charge(charge_id="ch_2", amount_cents=1)
    assert codec.decode(codec.encode(model)) == model


@pytest.mark.parametrize("fn", [reserve, unannotated, anything])
def test_plain_dict_result_stays_a_dict(fn: Any) -> None:
    """A dict result (annotated dict, Any, or not annotated) is stored and replayed as a dict."""
    codec = _codec(fn, "reserve")
    value = {"reservation": "r-1", "count": 2, "nested": {"ok": True}}
    stored = codec.encode(value)
    assert stored == value
    replayed = codec.decode(stored)
    assert type(replayed) is dict
    assert replayed == value


def test_typed_dict_result_round_trips() -> None:
    """`-> dict[str, int]` stores and replays the same dict."""
    codec = _codec(typed_reserve, "reserve")
    value = {"a": 1, "b": 2}
    stored = codec.encode(value)
    assert stored == value
    assert codec.decode(stored) == value


@pytest.mark.parametrize(
    ("fn", "value"),
    [(charge, {"charge_id": "ch_1"}), (typed_reserve, {"count": "many"})],
    ids=["dict-missing-model-field", "dict-of-wrong-values"],
)
def test_result_that_replay_cannot_rebuild_is_refused_at_encode(fn: Any, value: object) -> None:
    """What encode stores, decode rebuilds: a result that does not fit the step's return
    annotation is refused at once (TypeError naming the step), not stored to break a replay."""
    codec = _codec(fn, "settle")
    try:
        stored = codec.encode(value)
    except TypeError as exc:
        assert "settle" in str(exc)
        return
    codec.decode(stored)  # a replay must be able to rebuild what was stored


@pytest.mark.parametrize("value", [None, True, 3, 2.5, "x", [1, "a", None]])
def test_plain_json_scalars_and_lists_round_trip(value: object) -> None:
    """JSON scalars and lists are stored and replayed unchanged."""
    codec = _codec(anything, "any")
    assert codec.decode(codec.encode(value)) == value


def test_model_returned_from_an_unannotated_step_is_stored_as_json() -> None:
    """A model result is stored as its JSON even when the step has no model annotation."""
    codec = _codec(anything, "any")
    assert codec.encode(Charge(charge_id="c", amount_cents=1)) == {
        "charge_id": "c",
        "amount_cents": 1,
        "captured_at": None,
        "tags": [],
    }


def test_none_decodes_to_none() -> None:
    """decode(None) is None whatever the annotation (e.g. include_unknown compensation)."""
    for fn in (charge, reserve, unannotated, nothing):
        assert _codec(fn).decode(None) is None


@pytest.mark.parametrize(
    "value",
    [{1, 2}, object(), float("nan"), {"amount": float("inf")}, {"ids": (1, 2)}, {3: "x"}],
    ids=["set", "object", "nan", "nested-inf", "nested-tuple", "int-key"],
)
def test_non_json_result_raises_type_error_naming_the_step(value: object) -> None:
    """A plain step returning something that is not JSON raises TypeError naming the step."""
    codec = _codec(reserve, "reserve_inventory")
    with pytest.raises(TypeError, match="reserve_inventory"):
        codec.encode(value)


@pytest.mark.parametrize(
    "value",
    [{1, 2}, object()],
    ids=["set", "object"],
)
def test_non_json_result_of_a_model_step_raises_type_error_naming_the_step(
    value: object,
) -> None:
    """A step annotated with a model that returns a non-JSON value: TypeError naming the step.

    Runtime warnings are not errors in an application, so they are ignored here as they
    would be in production; the value must still be refused, not stored in another shape.
    """
    codec = _codec(charge, "charge")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(TypeError, match="charge"):
            codec.encode(value)


def test_nan_inside_a_model_result_is_refused() -> None:
    """A model whose JSON would hold NaN is refused with TypeError naming the step."""

    class Price(BaseModel):
        value: float

    def price(ctx: StepContext, r: object) -> Price:
        raise NotImplementedError

    codec = _codec(price, "price")
    with pytest.raises(TypeError, match="price"):
        codec.encode(Price(value=float("nan")))


def test_no_result_decodes_to_none_whatever_the_annotation() -> None:
    """A compensation of a step whose outcome was unknown gets `result=None`: no result
    was recorded. Decoding it never validates None against the step's model."""
    for fn in (charge, maybe_charge, typed_reserve, reserve, unannotated):
        assert ResultCodec(fn, where="step 'x'").decode(None) is None
