"""Where the database comes from: explicit URL, SAGA_DATABASE_URL, else an embedded PostgreSQL."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import psycopg
from psycopg.conninfo import conninfo_to_dict

from saga.errors import DatabaseRefused, DatabaseUnavailable
from saga.keys import HASH_VERSION
from saga.redact import redact_url, scrub

ENV_URL = "SAGA_DATABASE_URL"
ENV_EMBEDDED_DIR = "SAGA_EMBEDDED_DIR"
ENV_PREPARED_STATEMENTS = "SAGA_PREPARED_STATEMENTS"
# psycopg's own default: a statement is prepared on the server at its sixth execution.
_PREPARE_THRESHOLD = 5
_ON = ("on", "1", "true", "yes")
_OFF = ("off", "0", "false", "no")
_AUTO = ("auto", "")


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
    to exit stops it, clients that were killed are not waited for (`saga._db.embedded`).
    """
    from saga._db import embedded

    directory = (data_dir or default_embedded_dir()).resolve()
    try:
        return embedded.attach(directory)
    except Exception as exc:
        raise DatabaseUnavailable(
            f"could not start the embedded PostgreSQL in {directory}: {exc}; "
            f"set {ENV_URL} to use a PostgreSQL server instead"
        ) from exc


def is_malformed_url(url: str) -> bool:
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
    if is_malformed_url(url):
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
    if is_malformed_url(url):
        return DatabaseUnavailable(
            f"the database URL {where} is not a valid PostgreSQL URL ({reason}); write it as "
            "postgresql://USER:PASSWORD@HOST:PORT/DBNAME with any / ? # @ % in the password "
            "percent-encoded (/ as %2F, @ as %40), or as key=value conninfo"
        )
    refused = _refusal(text)
    if refused is not None:
        return DatabaseRefused(f"PostgreSQL at {where} refused the connection: {refused}")
    return DatabaseUnavailable(f"cannot reach PostgreSQL at {where}: {reason}")


def check_connection(
    url: str, *, timeout_seconds: float = 5.0, restart_seconds: float = 20.0
) -> Route:
    """Open and close one connection, turning any failure into `DatabaseUnavailable`; a
    malformed URL is refused before any connection is tried. Returns what the connection
    told of the way to the server (`Route`), at the cost of one statement.

    A server that answers it is restarting (or a pooler that says its server is) is asked
    again for up to `restart_seconds`; a server that does not answer, or refuses, is
    reported at once."""
    if is_malformed_url(url):
        try:
            conninfo_to_dict(url)
        except Exception as exc:
            raise unavailable(url, exc) from None
        raise unavailable(url, ValueError("its pieces do not parse as written"))
    deadline = time.monotonic() + restart_seconds
    delay = 0.05
    while True:
        try:
            with psycopg.connect(
                url,
                connect_timeout=max(1, int(timeout_seconds)),
                autocommit=True,
                prepare_threshold=None,
            ) as conn:
                return Route(pooled=behind_pooler(conn))
        except (psycopg.Error, OSError) as exc:
            if not restarting(exc) or time.monotonic() + delay > deadline:
                raise unavailable(url, exc) from None
        time.sleep(delay)
        delay = min(delay * 2, 1.0)


# What a server that is restarting says at login, and what PgBouncer says for it while it
# waits out `server_login_retry` after a failed login to the server (15 s by default).
_RESTARTING = (
    "the database system is starting up",
    "the database system is shutting down",
    "the database system is not yet accepting connections",
    "server login has been failing",
)


def restarting(exc: BaseException) -> bool:
    """Whether a failed connection was turned away by a server that is restarting, or by
    a pooler in front of one: it answered, and will take the connection shortly."""
    text = str(exc)
    return any(marker in text for marker in _RESTARTING)


@dataclass(frozen=True, slots=True)
class Route:
    """What a first connection tells about the way from this client to PostgreSQL.

    `pooled`: a connection pooler (PgBouncer, or a managed service's pooler) answers on the
    URL rather than PostgreSQL itself. Through a pooler in transaction mode, consecutive
    transactions of one client connection may run on different server sessions: nothing
    may rely on session state (server-side prepared statements, session settings, LISTEN,
    session advisory locks)."""

    pooled: bool


def behind_pooler(conn: psycopg.Connection[Any]) -> bool:
    """Whether a pooler stands between `conn` and the server that answers it.

    A pooler serves one client connection with whichever server session is free, so the
    backend key it hands the client at login is its own: the process id in it is not that
    of the backend running the statement (`pg_backend_pid()`). A TCP proxy that only
    forwards bytes (an SSH tunnel, HAProxy, a container's port mapping) keeps the server's
    key, and keeps the session too, so it is rightly taken for a direct connection. A
    pooler that forwards the real backend key of a session it then shares is not
    detected: give such a URL `prepared_statements=False` (`SAGA_PREPARED_STATEMENTS=off`)
    and a direct `listen_url` (docs/production.md, "Running in production")."""
    row = conn.execute("SELECT pg_backend_pid()").fetchone()
    return row is None or int(row[0]) != conn.info.backend_pid


async def behind_pooler_async(conn: psycopg.AsyncConnection[Any]) -> bool:
    """`behind_pooler` on an async connection."""
    cur = await conn.execute("SELECT pg_backend_pid()")
    row = await cur.fetchone()
    return row is None or int(row[0]) != conn.info.backend_pid


def prepared_statements_setting(explicit: bool | None = None) -> bool | None:
    """Whether the orchestrator's connections use server-side prepared statements: the
    explicit choice, else `SAGA_PREPARED_STATEMENTS` (`on`, `off` or `auto`), else None
    (auto: on when the connection is direct, off through a pooler)."""
    if explicit is not None:
        return explicit
    value = os.environ.get(ENV_PREPARED_STATEMENTS, "").strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    if value in _AUTO:
        return None
    raise ValueError(f"{ENV_PREPARED_STATEMENTS} must be on, off or auto, got {value!r}")


def prepare_threshold(setting: bool | None, route: Route) -> int | None:
    """psycopg's `prepare_threshold` for connections on `route` (None: never prepare).

    Through a pooler in transaction mode, a statement psycopg prepared on one server
    session is missing from the next (`InvalidSqlStatementName`), or a name it prepares
    is taken there already (`DuplicatePreparedStatement`): auto leaves them off. A pooler
    that keeps prepared statements across its sessions (PgBouncer 1.21 and later with
    `max_prepared_statements`, with psycopg 3.2 and libpq 17) may be given `True`."""
    use = (not route.pooled) if setting is None else setting
    return _PREPARE_THRESHOLD if use else None


def garbled_reply(exc: BaseException) -> bool:
    """Whether `exc` is a reply the client could not make sense of (psycopg's own
    InternalError, with no SQLSTATE: "received 2 results from command 'COMMIT'" when a
    server restarts behind a pooler mid-reply): the connection is broken, not the request
    refused."""
    return isinstance(exc, psycopg.InternalError) and exc.sqlstate is None


def session_options(url: str, lease_seconds: float) -> str:
    """Server settings of the orchestrator's connections (libpq `options`, added to any the
    URL or PGOPTIONS give): no transaction of ours holds its locks, or waits for another's,
    longer than a lease; and the request hash version of the rows they write
    (`saga.hash_version`, migration 0023).

    A claim plans the saga's first move (cost functions, confirm rules, input models: user
    code) while the saga row is locked; a holder frozen there (SIGSTOP, a GC pause, a slow
    cost function) would block `run()` and every operator verb on that saga for as long as
    it is frozen. With `idle_in_transaction_session_timeout` the server ends such a
    transaction once it has waited a lease for its client, and rolls it back (its lease
    would have expired by then anyway); with `lock_timeout` a wait for a row lock ends
    after a lease too, retried by a claim or a write and reported as busy by an operator
    verb. Set per session, as a startup parameter, they cost no statement and no commit.
    """
    existing = conninfo_to_dict(url).get("options") or os.environ.get("PGOPTIONS", "")
    milliseconds = max(1, math.ceil(lease_seconds * 1000.0))
    ours = (
        f"-c idle_in_transaction_session_timeout={milliseconds} -c lock_timeout={milliseconds}"
        f" -c saga.hash_version={HASH_VERSION}"
    )
    return f"{existing} {ours}".strip()


def connection_kwargs(
    url: str, lease_seconds: float, route: Route, prepared_statements: bool | None
) -> dict[str, Any]:
    """Arguments of the pool's connections on `route`: autocommit, psycopg's
    `prepare_threshold` (`prepare_threshold`), and, on a direct connection, the
    `session_options`. Through a pooler the timeouts are set by each transaction instead
    (`transaction_settings`): PgBouncer refuses `options` as a startup parameter, and a
    session setting there would stay on a server session other clients share."""
    kwargs: dict[str, Any] = {
        "autocommit": True,
        "prepare_threshold": prepare_threshold(prepared_statements, route),
    }
    if not route.pooled:
        kwargs["options"] = session_options(url, lease_seconds)
    return kwargs


def transaction_settings(route: Route, lease_seconds: float) -> dict[str, str] | None:
    """Through a pooler, the timeouts of `session_options` as each transaction of the
    store sets them for itself (`SET LOCAL`); None on a direct connection."""
    if not route.pooled:
        return None
    milliseconds = str(max(1, math.ceil(lease_seconds * 1000.0)))
    return {"idle_ms": milliseconds, "lock_ms": milliseconds, "hash_version": str(HASH_VERSION)}
