"""The CLI test app (`cli_app`'s sagas) with an Orchestrator that keeps ended sagas for
90 days: `saga purge --app cli_app_retention` must honour that retention."""

from __future__ import annotations

from cli_app import LEASE_SECONDS, SAGAS

from saga import Orchestrator

RETENTION_DAYS = 90.0

orch = Orchestrator(sagas=SAGAS, lease_seconds=LEASE_SECONDS, retention_days=RETENTION_DAYS)
