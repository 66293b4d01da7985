"""A caller of the ledger in a process of its own that holds one claim while the test
acts as an operator: it claims, says so, then does what each line of its stdin says.

Usage: python claim_holder_app.py URL CHANNEL KEY LEASE_SECONDS
Prints `HOLDER <status> <owner> <step> <saga_id>` after the claim, then for each line
`complete` (record a result) or `heartbeat`, `HOLDER <done|LeaseLost> ...`.
"""

from __future__ import annotations

import sys

from saga import LeaseLost, Orchestrator


def main(url: str, channel: str, key: str, lease_seconds: float) -> None:
    with Orchestrator(url) as orch:
        claim = orch.ledger.claim(
            channel, key, "charge_customer", {"key": key}, lease_seconds=lease_seconds
        )
        print(f"HOLDER {claim.status} {claim.owner} {claim.step} {claim.saga_id}", flush=True)
        for line in sys.stdin:
            verb = line.strip()
            try:
                if verb == "complete":
                    orch.ledger.complete(claim, {"charged": key})
                elif verb == "heartbeat":
                    claim = orch.ledger.heartbeat(claim)
            except LeaseLost as exc:
                print(f"HOLDER LeaseLost {exc}", flush=True)
            else:
                print(f"HOLDER done {verb}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]))
