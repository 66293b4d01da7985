"""The saga dashboard: a read-only web view of the sagas of one database (the list, the
needs-review queue, one saga's timeline and audit trail), updated live.

An optional part of the package: it needs the `web` extra
(`pip install 'saga-orchestrator[web]'`: Starlette, Jinja2 and uvicorn), and nothing
else in `saga` imports it. `saga dashboard` serves it; `create_app(database_url)` is the
Starlette application, to mount or serve otherwise.
"""

from __future__ import annotations

from saga.web.app import create_app
from saga.web.server import DashboardError, serve

__all__ = ["DashboardError", "create_app", "serve"]
