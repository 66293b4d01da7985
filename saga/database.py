"""Where the database comes from: explicit URL, SAGA_DATABASE_URL, else an embedded PostgreSQL."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote

import psycopg
from psycopg.conninfo import conninfo_to_dict

from saga.errors import DatabaseRefused, DatabaseUnavailable
from saga.redact import redact_url, scrub

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


def _malformed(url: str) -> bool:
    """Whether `url` does not parse, or parses into other pieces than its own text says (a
    `/`, `?`, `#` or `@` left unescaped in the password moves the rest into host or dbname)."""
    try:
        params = conninfo_to_dict(url)
    except Exception:
        return True
    if "://" not in url or "password=" in url:
        return False
    start = url.find("://") + 3
    end = url.rfind("@")
    if end < start or ":" not in url[start:end]:
        return False
    written = unquote(url[start:end].split(":", 1)[1])
    return str(params.get("password") or "") != written


def describe_url(url: str) -> str:
    """`host:port/dbname` of a connection URL, never its password: a URL that does not
    parse as itself is shown with everything up to its last `@` masked."""
    if _malformed(url):
        return scrub(redact_url(url), url)
    params = conninfo_to_dict(url)
    host = str(params.get("host") or "localhost")
    port = str(params.get("port") or "5432")
    dbname = str(params.get("dbname") or params.get("user") or "")
    return scrub(f"{host}:{port}/{dbname}", url)


# What PostgreSQL says when it answered and turned this client away.
_REFUSALS = (
    "password authentication failed",
    "authentication failed",
    "does not exist",
    "no pg_hba.conf entry",
    "is not permitted to log in",
    "permission denied for database",
    "no password supplied",
)


def _refusal(text: str) -> str | None:
    """The server's reason when `text` is a refusal (bad credentials, unknown role or
    database, an access rule), else None."""
    for line in text.splitlines():
        # Only what the server said (FATAL) or libpq's answer to its request for a password.
        for said in ("FATAL:", "fe_sendauth:"):
            if said in line:
                reason = line.rsplit(said, 1)[-1]
                if any(marker in reason for marker in _REFUSALS):
                    return " ".join(reason.split())
    return None


def unavailable(url: str, exc: BaseException) -> DatabaseUnavailable:
    """A `DatabaseUnavailable` naming host and port (a `DatabaseRefused` when the server
    answered and refused), with any password scrubbed out."""
    text = scrub(str(exc).strip(), url)
    reason = text.splitlines()[0] if text else type(exc).__name__
    where = describe_url(url)
    if _malformed(url):
        return DatabaseUnavailable(
            f"the database URL {where} is not a valid PostgreSQL URL ({reason}); write it as "
            "postgresql://USER:PASSWORD@HOST:PORT/DBNAME with any / ? # @ % in the password "
            "percent-encoded (/ as %2F, @ as %40), or as key=value conninfo"
        )
    refused = _refusal(text)
    if refused is not None:
        return DatabaseRefused(f"PostgreSQL at {where} refused the connection: {refused}")
    return DatabaseUnavailable(f"cannot reach PostgreSQL at {where}: {reason}")


def check_connection(url: str, *, timeout_seconds: float = 5.0) -> None:
    """Open and close one connection, turning any failure into `DatabaseUnavailable`; a
    malformed URL is refused before any connection is tried."""
    if _malformed(url):
        try:
            conninfo_to_dict(url)
        except Exception as exc:
            raise unavailable(url, exc) from None
        raise unavailable(url, ValueError("its pieces do not parse as written"))
    try:
        # Connecting is the whole check: no statement, so no transaction is counted.
        with psycopg.connect(url, connect_timeout=max(1, int(timeout_seconds))):
            pass
    except (psycopg.Error, OSError) as exc:
        raise unavailable(url, exc) from None
