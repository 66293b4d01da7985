"""The approval request of a durable tool call, as an adapter's deferral metadata."""

from __future__ import annotations

import pytest

from saga.integrations._tool_calls import ApprovalRequest


def _request(refused: str | None = None) -> ApprovalRequest:
    return ApprovalRequest(
        saga_id="s-1",
        step="refund.0a1b2c3d4e5f",
        request_hash="ab" * 32,
        tool="refund",
        key="refund:order-7",
        arguments={"order_id": "order-7", "lines": [1, {"sku": "x"}]},
        refused=refused,
    )


def test_metadata_holds_the_kind_then_every_field_in_order() -> None:
    assert _request("expired").as_metadata() == {
        "kind": "saga.tool_call_approval",
        "saga_id": "s-1",
        "step": "refund.0a1b2c3d4e5f",
        "request_hash": "ab" * 32,
        "tool": "refund",
        "key": "refund:order-7",
        "arguments": {"order_id": "order-7", "lines": [1, {"sku": "x"}]},
        "refused": "expired",
    }
    assert list(_request().as_metadata()) == [
        "kind",
        "saga_id",
        "step",
        "request_hash",
        "tool",
        "key",
        "arguments",
        "refused",
    ]


@pytest.mark.parametrize("refused", [None, "the approval token has expired"])
def test_metadata_reads_back_as_the_same_request(refused: str | None) -> None:
    request = _request(refused)
    assert ApprovalRequest.from_metadata(request.as_metadata()) == request


def test_metadata_of_another_kind_is_refused() -> None:
    metadata = {**_request().as_metadata(), "kind": "something.else"}
    with pytest.raises(ValueError, match="not the approval request"):
        ApprovalRequest.from_metadata(metadata)
