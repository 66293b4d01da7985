"""No error, log line or repr ever shows a database password, whatever the URL's shape;
a server that answers and refuses says so."""

from __future__ import annotations

import os
import string
import subprocess
import sys
import uuid
from pathlib import Path
from urllib.parse import quote

import psycopg
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from saga import DatabaseRefused, DatabaseUnavailable, Orchestrator
from saga._db.database import check_connection, describe_url, unavailable
from saga.redact import redact, redact_url, scrub

REPO_ROOT = Path(__file__).resolve().parents[2]
# Every generated password holds this, so "the password shows" is "the marker shows":
# a driver may quote any piece of a malformed URL, and the marker is in one piece.
MARK = "Zq7Kx"

_printable = st.text(alphabet=string.printable.strip() + " ", max_size=6)
_word = st.text(alphabet=string.ascii_lowercase + string.digits + "_", min_size=1, max_size=8)


@st.composite
def secret_urls(draw: st.DrawFn) -> tuple[str, str]:
    """(url, password): every shape a user may write, right or wrong."""
    password = draw(_printable) + MARK + draw(st.text(string.ascii_letters, max_size=3))
    password += draw(_printable)
    user = "u_" + draw(_word)
    host = draw(st.sampled_from(["127.0.0.1", "localhost"]))
    port = draw(st.sampled_from(["", ":1", ":5432"]))
    db = draw(st.sampled_from(["", "/db", "/" + draw(_word)]))
    query = draw(st.sampled_from(["", "?sslmode=disable", "?connect_timeout=1&application_name=t"]))
    shape = draw(
        st.sampled_from(["url", "encoded", "no_scheme", "query", "kv", "kv_quoted", "no_user"])
    )
    scheme = draw(st.sampled_from(["postgresql://", "postgres://"]))
    if shape == "url":
        url = f"{scheme}{user}:{password}@{host}{port}{db}{query}"
    elif shape == "encoded":
        url = f"{scheme}{user}:{quote(password, safe='')}@{host}{port}{db}{query}"
    elif shape == "no_scheme":
        url = f"{user}:{password}@{host}{port}{db}"
    elif shape == "query":
        sep = "&" if query else "?"
        url = f"{scheme}{user}@{host}{port}{db}{query}{sep}password={quote(password, safe='')}"
    elif shape == "no_user":
        # Without a user the OS user's role is used, which may exist (with trust auth):
        # nothing listens on port 1, so the connection fails, as every case here must.
        url = f"{scheme}:{password}@{host}:1{db}{query}"
    else:
        value = password
        if shape == "kv_quoted":
            value = "'" + password.replace("\\", "\\\\").replace("'", "\\'") + "'"
        url = f"host={host} port={port.lstrip(':') or 5432} user={user} password={value}"
        url += " dbname=" + (db.lstrip("/") or "db")
    return url, password


def _assert_hidden(password: str, *texts: str) -> None:
    for text in texts:
        assert MARK not in text, text
        assert password not in text, text


@settings(
    max_examples=120,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(secret_urls())
@example((f"postgresql://u_0:{MARK}%80@127.0.0.1", f"{MARK}%80"))
def test_no_password_in_errors_or_reprs(case: tuple[str, str]) -> None:
    """Whatever the URL's shape, the exception (str and repr), the orchestrator's repr and
    every helper's output hide the password."""
    url, password = case
    shown: list[str] = [describe_url(url), redact_url(url), scrub(f"bad {url!r}: {url}", url)]
    try:
        check_connection(url, timeout_seconds=1)
    except DatabaseUnavailable as exc:
        shown += [str(exc), repr(exc)]
    orch = Orchestrator(url, auto_migrate=False)
    try:
        shown.append(repr(orch))
        with pytest.raises(DatabaseUnavailable) as excinfo:
            orch.get(str(uuid.uuid4()))
        shown += [str(excinfo.value), repr(excinfo.value), repr(orch)]
    finally:
        orch.close()
    # What the driver itself says of the URL, wrapped as the orchestrator does; a
    # percent-encoded byte that is not UTF-8 (`%80`) fails its decoding, not its parser.
    try:
        psycopg.conninfo.conninfo_to_dict(url)
    except (psycopg.Error, UnicodeDecodeError) as exc:
        wrapped = unavailable(url, exc)
        shown += [str(wrapped), repr(wrapped)]
    wrapped = unavailable(url, OSError(f'invalid connection string "{url}"'))
    shown += [str(wrapped), repr(wrapped)]
    _assert_hidden(password, *shown)


@pytest.mark.parametrize(
    "url",
    [
        f"alice:se{MARK}cret@127.0.0.1/db",
        f"postgresql://alice:se/{MARK}cret@127.0.0.1/db",
        f"postgresql://alice:p@{MARK}@127.0.0.1:5432/postgres",
        f"postgresql://alice:{MARK}%zz@127.0.0.1:5432/postgres",
        f"host=127.0.0.1 port=5432 user=nobody password='{MARK} x dbname=postgres",
    ],
)
def test_malformed_url_is_refused_without_its_password(url: str) -> None:
    """A URL that does not parse as written is refused before connecting: it says how to
    write one, and shows no piece of the password."""
    with pytest.raises(DatabaseUnavailable) as excinfo:
        check_connection(url)
    message = str(excinfo.value)
    assert "not a valid PostgreSQL URL" in message
    assert "percent-encoded" in message
    _assert_hidden(MARK, message, repr(excinfo.value))


def test_a_refusal_says_the_server_answered() -> None:
    """An unknown role: the server answered and refused, it was not unreachable."""
    url = f"postgresql://nobody_here:{MARK}@127.0.0.1:5432/postgres"
    server = os.environ.get("SAGA_TEST_DATABASE_URL", "")
    if server and "127.0.0.1:5432" not in server:
        pytest.skip("needs the PostgreSQL server on 127.0.0.1:5432")
    with pytest.raises(DatabaseRefused) as excinfo:
        check_connection(url)
    assert isinstance(excinfo.value, DatabaseUnavailable)
    assert str(excinfo.value) == (
        "PostgreSQL at 127.0.0.1:5432/postgres refused the connection: "
        'role "nobody_here" does not exist'
    )


def test_password_authentication_failed_is_a_refusal() -> None:
    """libpq's "password authentication failed" reads as a refusal, naming the user."""
    url = f"postgresql://alice:{MARK}@db.example.com:6543/orders"
    error = psycopg.OperationalError(
        'connection failed: connection to server at "10.0.0.5", port 6543 failed: '
        'FATAL:  password authentication failed for user "alice"'
    )
    refused = unavailable(url, error)
    assert isinstance(refused, DatabaseRefused)
    assert str(refused) == (
        "PostgreSQL at db.example.com:6543/orders refused the connection: "
        'password authentication failed for user "alice"'
    )


def test_redact_masks_userinfo_and_password_values_in_any_text() -> None:
    """Without knowing the URL: `scheme://...@` and `password=` values are masked."""
    text = f"failed for postgresql://a:b/{MARK}@h/db and host=h password={MARK} user=u"
    assert redact(text) == "failed for postgresql://***@h/db and host=h password=*** user=u"


_CLI_URLS = [
    f"alice:se{MARK}cret@127.0.0.1/db",
    f"postgresql://alice:se/{MARK}cret@127.0.0.1/db",
    f"postgresql://alice:p@{MARK}@127.0.0.1:5432/postgres",
    f"host=127.0.0.1 port=5432 user=nobody password={MARK} dbname=postgres",
    f"postgresql://nobody:{MARK}@127.0.0.1:5432/postgres",
]


@pytest.mark.parametrize("url", _CLI_URLS)
@pytest.mark.parametrize("how", ["flag", "env_traceback"])
def test_cli_stderr_never_shows_the_password(url: str, how: str) -> None:
    """`saga migrate` and `saga list` with a bad URL: one line on stderr (or a traceback
    with SAGA_TRACEBACK=1), exit 1, and no password."""
    env = {k: v for k, v in os.environ.items() if k != "SAGA_DATABASE_URL"}
    for command in (["migrate"], ["list"]):
        argv = [sys.executable, "-m", "saga", *command]
        if how == "flag":
            argv += ["--database-url", url]
        else:
            env["SAGA_DATABASE_URL"] = url
            env["SAGA_TRACEBACK"] = "1"
        proc = subprocess.run(
            argv, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=False
        )
        assert proc.returncode == 1, proc.stderr
        assert proc.stderr.strip(), "no error printed"
        _assert_hidden(MARK, proc.stderr, proc.stdout)
        if "nobody:" in url:
            assert "refused the connection" in proc.stderr


def test_log_lines_mask_urls_and_passwords_in_their_fields() -> None:
    """An error quoted into a log field (a retry, a lost listener) shows no password."""
    import structlog.testing

    from saga._db.dbretry import log_retry

    error = OSError(f"cannot use postgresql://app:{MARK}@db/x (host=db password={MARK})")
    with structlog.testing.capture_logs() as logs:
        log_retry("listen", error)
    assert [e["event"] for e in logs] == ["database_retry"]
    assert MARK not in str(logs[0])
    assert "postgresql://***@db/x" in logs[0]["error"]


# What a worker's listener logs of a failure: a retry, a lost or a stopped listener.
_LISTENER_EVENTS = {"database_retry", "listener_reconnecting", "listener_stopped"}


def _listener_logs(url: str) -> list[str]:
    """What the listeners of both doors log when their `listen_url` is `url` (none of
    these URLs connects): each runs until it has logged its first failure."""
    import asyncio
    import threading
    import time

    import structlog.testing

    from saga import AsyncOrchestrator
    from saga.worker import Worker
    from saga.worker_async import AsyncWorker

    def failed(logs: list[dict[str, object]]) -> bool:
        return any(e["event"] in _LISTENER_EVENTS for e in logs)

    with structlog.testing.capture_logs() as sync_logs:
        orch = Orchestrator(url, auto_migrate=False)
        worker = Worker(orch, listen_url=url)
        listener = threading.Thread(target=worker._listen, args=(url, "listen_url"))
        listener.start()
        deadline = time.monotonic() + 10
        while not failed(sync_logs) and listener.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        worker.stop()
        listener.join(10)
        orch.close()
    assert failed(sync_logs), sync_logs

    async def listen_async() -> None:
        aorch = AsyncOrchestrator(url, auto_migrate=False)
        aworker = AsyncWorker(aorch, listen_url=url)
        aworker._stopping, aworker._wake = asyncio.Event(), asyncio.Event()
        task = asyncio.create_task(aworker._listen(url, "listen_url"))
        deadline = time.monotonic() + 10
        while not failed(async_logs) and not task.done() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        aworker._stopping.set()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await aorch.close()

    with structlog.testing.capture_logs() as async_logs:
        asyncio.run(listen_async())
    assert failed(async_logs), async_logs
    return [str(e) for e in (*sync_logs, *async_logs)]


@settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(secret_urls())
# Shapes the driver quotes back when it cannot parse them: always tried.
@example((f"u_0:{MARK}@127.0.0.1", MARK))
@example((f"postgresql://u_a:se%ZZ{MARK}@127.0.0.1:5432/db", f"se%ZZ{MARK}"))
@example((f"postgresql://u_a:se cret{MARK}@localhost/db", f"se cret{MARK}"))
@example((f"host=127.0.0.1 user=u_a password=se cret{MARK} dbname=db", f"se cret{MARK}"))
def test_no_password_in_the_listeners_logs(case: tuple[str, str]) -> None:
    """A worker's `listen_url` of any shape: what the listener logs of its failures, in
    both doors, hides the password."""
    url, password = case
    _assert_hidden(password, *_listener_logs(url))


@pytest.mark.parametrize(
    "password", [f"se%ZZ{MARK}", f"se cret{MARK}", f"se%{MARK}", f"a b%zz{MARK}"]
)
def test_a_listen_url_that_does_not_parse_is_said_once_without_its_password(
    password: str,
) -> None:
    """A stray `%` or a space in the password: the listener stops, saying why once (in
    both doors), and never shows the password."""
    url = f"postgresql://postgres:{password}@127.0.0.1:5432/postgres"
    logs = _listener_logs(url)
    _assert_hidden(password, *logs)
    _assert_hidden(MARK, *logs)
    assert sum("listener_stopped" in line for line in logs) == 2, logs
    assert not any("listener_reconnecting" in line for line in logs), logs
