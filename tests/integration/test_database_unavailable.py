"""An unreachable database: a clear DatabaseUnavailable at first use, never the password."""

from __future__ import annotations

import uuid

import pytest
from support import Order, order_saga

from saga import DatabaseUnavailable, Orchestrator, StepContext

PASSWORD = "s3cret"
UNREACHABLE = f"postgresql://user:{PASSWORD}@127.0.0.1:1/nodb"


def _chain(exc: BaseException) -> list[BaseException]:
    """The exception and the causes a traceback would show."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or (
            None if current.__suppress_context__ else current.__context__
        )
    return chain


def test_unreachable_database_raises_at_first_use() -> None:
    """Constructing does not connect; the first call raises naming host and port, not password."""
    saga = order_saga("offline")

    @saga.step
    def work(ctx: StepContext, o: Order) -> dict:
        return {}

    orch = Orchestrator(UNREACHABLE, sagas=[saga])
    try:
        with pytest.raises(DatabaseUnavailable) as excinfo:
            orch.get(str(uuid.uuid4()))
        with pytest.raises(DatabaseUnavailable) as start_excinfo:
            orch.start(saga, Order(order_id="o-1"))
    finally:
        orch.close()

    for exc in (excinfo.value, start_excinfo.value):
        message = str(exc)
        assert "127.0.0.1" in message
        assert "1" in message.replace("127.0.0.1", "")
        for link in _chain(exc):
            assert PASSWORD not in str(link)
            assert PASSWORD not in repr(link)
    assert isinstance(excinfo.value, ConnectionError)
