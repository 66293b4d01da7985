"""A child process frozen while a claim plans its saga: a cost function that blocks.

Run as `python frozen_app.py ORDER_ID` with `FROZEN_APP_DATABASE_URL` set: it starts the
`frozen_costly` saga and runs it with a 1-second lease. With `FROZEN_APP_BLOCK=1` the
step's cost function, called while the claim's transaction holds the saga row locked,
prints `FROZEN_APP IN_COST` and blocks, so the parent can freeze the process there
(SIGSTOP). The parent imports the module for the same definition; there the cost
function returns at once.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from pydantic import BaseModel

from saga import Orchestrator, Saga, StepContext

ENV_URL = "FROZEN_APP_DATABASE_URL"
ENV_BLOCK = "FROZEN_APP_BLOCK"


class FrozenOrder(BaseModel):
    """Input of the saga."""

    order_id: str


def _cost(order: FrozenOrder) -> float:
    if os.environ.get(ENV_BLOCK) == "1":
        print("FROZEN_APP IN_COST", flush=True)
        while True:
            time.sleep(60)
    return 1.0


SAGA: Saga[FrozenOrder] = Saga(
    "frozen_costly", version=1, input=FrozenOrder, key=lambda o: o.order_id
)


@SAGA.step(cost=_cost)
def charge(ctx: StepContext, order: FrozenOrder) -> dict[str, Any]:
    return {"charged": order.order_id}


def main(argv: list[str]) -> int:
    (order_id,) = argv
    # Started by one orchestrator and run by another, as a request handler and a driver
    # elsewhere: run() plans the first move inside its claim transaction, which holds
    # the saga row locked while the cost function runs. (run() of a saga the same
    # orchestrator has just started plans it before any statement, holding nothing.)
    with Orchestrator(os.environ[ENV_URL], sagas=[SAGA]) as starter:
        handle = starter.start(SAGA, FrozenOrder(order_id=order_id))
    with Orchestrator(os.environ[ENV_URL], sagas=[SAGA], lease_seconds=1.0) as orch:
        print(f"FROZEN_APP STARTED {handle.id}", flush=True)
        state = orch.run(handle.id)
        print(f"FROZEN_APP FINISHED {state.status}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
