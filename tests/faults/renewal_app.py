"""The renewal example as an app for `saga.testing.crash_test` (`faults.renewal_app:orch`).

Like an app given to `saga worker --app`, it registers the saga and wires its providers
at import: the database comes from `SAGA_DATABASE_URL`, which `crash_test` sets.
"""

from __future__ import annotations

import sys
from pathlib import Path

from saga import Orchestrator

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import renewal_saga

orch = Orchestrator(sagas=[renewal_saga.renewal])
renewal_saga.provider.connect(orch.database_url)
