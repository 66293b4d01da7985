"""Where the database comes from: explicit URL, SAGA_DATABASE_URL, else an embedded PostgreSQL."""

from __future__ import annotations

import os
from pathlib import Path

import psycopg
from psycopg.conninfo import conninfo_to_dict

from saga.errors import DatabaseUnavailable

ENV_URL = "SAGA_DATABASE_URL"
ENV_EMBEDDED_DIR = "SAGA_EMBEDDED_DIR"


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

    The server is shared by every process using the same directory; the last of them
    to exit stops it, clients that were killed are not waited for (`saga.embedded`).
    """
    from saga import embedded

    directory = (data_dir or default_embedded_dir()).resolve()
    try:
        return embedded.attach(directory)
    except Exception as exc:
        raise DatabaseUnavailable(
            f"could not start the embedded PostgreSQL in {directory}: {exc}; "
            f"set {ENV_URL} to use a PostgreSQL server instead"
        ) from exc


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
