"""cli_app's sagas behind an app whose import is slow (`--app cli_app_slow_start:orch`, or
`:aorch` for an AsyncOrchestrator): it creates the file `importing` in `CLI_APP_DIR`, then
waits for the file `go` there, as a large application's imports take their time."""

from __future__ import annotations

import time

from cli_app import LEASE_SECONDS, SAGAS, state_dir

from saga import AsyncOrchestrator, Orchestrator

(state_dir() / "importing").touch()
_deadline = time.monotonic() + 30
while not (state_dir() / "go").exists() and time.monotonic() < _deadline:
    time.sleep(0.01)

orch = Orchestrator(sagas=SAGAS, lease_seconds=LEASE_SECONDS)
aorch = AsyncOrchestrator(sagas=SAGAS, lease_seconds=LEASE_SECONDS)
