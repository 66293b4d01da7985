"""The dashboard's Starlette application: the list (`/`), one saga's page
(`/sagas/{id}`), and the server-sent events that keep each page up to date."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from datetime import UTC, datetime
from typing import Any, TypeVar

from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape
from markupsafe import Markup
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Route

from saga._db._store_base import parse_id
from saga._db.database import describe_url
from saga.cli import format as fmt
from saga.errors import SagaError, SagaNotFound
from saga.orchestrator import Orchestrator
from saga.state import SagaStatus
from saga.web import timeline
from saga.web.live import ChangeFeed
from saga.web.views import FilterError, Filters, ListPage, PageError, Pages, Reader

# Host names a dashboard bound to a loopback address answers to: a page of another site
# cannot read it through a DNS name it points at 127.0.0.1 (DNS rebinding).
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")
# How often an open page is re-rendered with nothing changed (ages, running attempts).
REFRESH_SECONDS = 10.0
# Longest a stream stays silent: a comment line keeps proxies from closing it.
_KEEPALIVE_SECONDS = 15.0
# Connections the dashboard's orchestrator holds at most.
_POOL_SIZE = 4

T = TypeVar("T")


def create_app(
    database_url: str | None = None,
    *,
    poll_seconds: float = 1.0,
    refresh_seconds: float = REFRESH_SECONDS,
    allowed_hosts: Sequence[str] | None = LOOPBACK_HOSTS,
) -> Starlette:
    """The read-only dashboard of the sagas in `database_url` (else `SAGA_DATABASE_URL`,
    else the embedded PostgreSQL), as a Starlette application.

    It reads through an `Orchestrator(database_url, auto_migrate=False)` in Starlette's
    thread pool, never writes, and never migrates. Open pages are updated by server-sent
    events when PostgreSQL NOTIFYs that a saga became runnable, when the poll (every
    `poll_seconds`) sees a new audit event, and every `refresh_seconds` regardless.
    `allowed_hosts` are the `Host` names it answers to (None: any); the default suits a
    dashboard bound to a loopback address.
    """
    orch = Orchestrator(database_url, auto_migrate=False, pool_size=_POOL_SIZE)
    dashboard = _Dashboard(orch, poll_seconds=poll_seconds, refresh_seconds=refresh_seconds)
    middleware = []
    if allowed_hosts is not None:
        middleware.append(Middleware(TrustedHostMiddleware, allowed_hosts=list(allowed_hosts)))
    return Starlette(
        routes=[
            Route("/", dashboard.list_page, methods=["GET", "HEAD"]),
            Route("/stream", dashboard.list_stream, methods=["GET"]),
            Route("/sagas/{saga_id}", dashboard.saga_page, methods=["GET", "HEAD"]),
            Route("/sagas/{saga_id}/stream", dashboard.saga_stream, methods=["GET"]),
            Route("/sagas/{saga_id}/mermaid", dashboard.saga_mermaid, methods=["GET"]),
        ],
        middleware=middleware,
        lifespan=dashboard.lifespan,
    )


def _environment() -> Environment:
    env = Environment(
        loader=PackageLoader("saga.web", "templates"),
        autoescape=select_autoescape(["html"]),
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["utc"] = _utc
    env.filters["ago"] = _ago
    env.filters["duration"] = timeline.duration
    env.filters["key"] = _key
    env.globals["statuses"] = [s.value for s in SagaStatus]
    return env


def _utc(at: datetime | None) -> str:
    if at is None:
        return "-"
    return at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC"


def _ago(at: datetime | None, now: datetime) -> str:
    return fmt.age(at, now)


def _key(key: str) -> Markup:
    """A key (a saga's, an idempotency key) as HTML that never breaks at a hyphen
    (`crashB-013`): each part between colons is kept on one line; a key too long for its
    column breaks only after a colon. What is copied is the key as it is."""
    return Markup(":<wbr>").join(
        Markup('<span class="seg">{}</span>').format(part) for part in key.split(":")
    )


class _Dashboard:
    """The pages and streams, over one reader and one change feed."""

    def __init__(self, orch: Orchestrator, *, poll_seconds: float, refresh_seconds: float) -> None:
        if not refresh_seconds > 0:
            raise ValueError(f"refresh_seconds must be positive, got {refresh_seconds!r}")
        self.orch = orch
        self.reader = Reader(orch)
        self.env = _environment()
        self.poll_seconds = poll_seconds
        self.refresh_seconds = refresh_seconds
        self.feed: ChangeFeed | None = None
        self.where = "database not resolved yet"

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        """Resolve the database, start the change feed; stop it and close the pool."""
        url = await run_in_threadpool(lambda: self.orch.database_url)
        self.where = describe_url(url)
        self.feed = ChangeFeed(url, poll_seconds=self.poll_seconds)
        task = asyncio.create_task(self.feed.run(), name="saga-dashboard-feed")
        try:
            yield
        finally:
            await self.feed.close()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await run_in_threadpool(self.orch.close)

    # ----- pages -----------------------------------------------------------------------

    async def list_page(self, request: Request) -> Response:
        """`/`: the sagas the query's filters select, and the needs-review queue."""
        try:
            filters = Filters.parse(request.query_params)
        except FilterError as exc:
            return self._error(request, 400, "Bad filter", str(exc))
        try:
            page = await run_in_threadpool(self.reader.list_page, filters)
        except SagaError as exc:
            return self._error(request, 503, "The database cannot be read", str(exc))
        return self._html(request, "list.html", page=page, stream=_stream_url("/stream", page))

    async def saga_page(self, request: Request) -> Response:
        """`/sagas/{id}`: one saga (also a session or a ledger channel); an unambiguous
        prefix of its id redirects to its full address."""
        try:
            number = Pages.parse(request.query_params.get("page"))
        except PageError as exc:
            return self._error(request, 400, "Bad page", str(exc))
        found = await self._saga(request, lambda saga_id: self.reader.saga_page(saga_id, number))
        if isinstance(found, Response):
            return found
        shown = f"page={number}&" if number > 1 else ""
        stream = f"/sagas/{found.state.id}/stream?{shown}v={found.fingerprint}"
        return self._html(request, "saga.html", page=found, stream=stream)

    async def saga_mermaid(self, request: Request) -> Response:
        """`/sagas/{id}/mermaid`: the saga as a Mermaid Gantt diagram, as plain text."""
        found = await self._saga(request, self.reader.mermaid)
        if isinstance(found, Response):
            return found
        return Response(found + "\n", media_type="text/plain; charset=utf-8")

    async def _saga(self, request: Request, load: Callable[[str], T]) -> T | Response:
        """What `load` reads of the saga the path names; an error page when there is no
        such saga, or a redirect to the full address for a prefix of its id."""
        given = str(request.path_params["saga_id"])
        if parse_id(given) is None:
            try:
                full = await run_in_threadpool(self.reader.expand, given)
            except (SagaError, ValueError) as exc:
                return self._error(request, 404, "No such saga", str(exc))
            suffix = request.url.path[len("/sagas/") + len(given) :]
            query = f"?{request.url.query}" if request.url.query else ""
            return RedirectResponse(f"/sagas/{full}{suffix}{query}", status_code=307)
        try:
            return await run_in_threadpool(load, given)
        except SagaNotFound as exc:
            return self._error(request, 404, "No such saga", str(exc))
        except PageError as exc:
            return self._error(request, 404, "No such page", str(exc))
        except SagaError as exc:
            return self._error(request, 503, "The database cannot be read", str(exc))

    def _html(
        self, request: Request, template: str, *, status: int = 200, **context: Any
    ) -> Response:
        nonce = secrets.token_urlsafe(16)
        html = self.env.get_template(template).render(
            request=request,
            nonce=nonce,
            where=self.where,
            refresh_seconds=self.refresh_seconds,
            **context,
        )
        return HTMLResponse(html, status_code=status, headers=_headers(nonce))

    def _error(self, request: Request, status: int, title: str, message: str) -> Response:
        return self._html(request, "error.html", status=status, title=title, message=message)

    # ----- live updates ----------------------------------------------------------------

    async def list_stream(self, request: Request) -> Response:
        """Server-sent events for `/`: the page's live part, re-rendered when it changes."""
        try:
            filters = Filters.parse(request.query_params)
        except FilterError as exc:
            return Response(str(exc), status_code=400, media_type="text/plain")

        def probe() -> tuple[str, ListPage]:
            page = self.reader.list_page(filters)
            return page.fingerprint, page

        def render(page: ListPage) -> str:
            return self._fragment("_list_live.html", page=page)

        return self._events(request, probe, render)

    async def saga_stream(self, request: Request) -> Response:
        """Server-sent events for `/sagas/{id}`: the saga's live part, re-rendered when
        the saga changes (one cheap read per change of the database to find out)."""
        saga_id = str(request.path_params["saga_id"])
        if parse_id(saga_id) is None:
            return Response("give the saga's full id", status_code=404, media_type="text/plain")
        try:
            number = Pages.parse(request.query_params.get("page"))
        except PageError as exc:
            return Response(str(exc), status_code=400, media_type="text/plain")

        def probe() -> tuple[str, str]:
            return self.reader.fingerprint(saga_id, number), saga_id

        def render(found: str) -> str:
            page = self.reader.saga_page(found, number)
            return self._fragment("_saga_live.html", page=page)

        return self._events(request, probe, render)

    def _fragment(self, template: str, **context: Any) -> str:
        return self.env.get_template(template).render(
            where=self.where, refresh_seconds=self.refresh_seconds, **context
        )

    def _events(
        self,
        request: Request,
        probe: Callable[[], tuple[str, Any]],
        render: Callable[[Any], str],
    ) -> Response:
        shown = request.query_params.get("v", "")
        feed = self.feed
        if feed is None:
            return Response("the dashboard is not running", status_code=503)
        refresh = self.refresh_seconds

        async def events() -> AsyncIterator[str]:
            nonlocal shown
            yield "retry: 2000\n\n"
            seen = feed.generation
            rendered_at = time.monotonic()
            check = True  # at once: the page may be older than the stream
            while not feed.closed:
                if check:
                    try:
                        fingerprint, data = await run_in_threadpool(probe)
                        stale = time.monotonic() - rendered_at >= refresh
                        if fingerprint != shown or stale:
                            html = await run_in_threadpool(render, data)
                            shown, rendered_at = fingerprint, time.monotonic()
                            yield _sse("update", html)
                        yield _sse("status", "listening" if feed.listening else "polling")
                    except SagaNotFound as exc:
                        yield _sse("problem", f"{exc}: it was deleted (purged?)")
                    except PageError as exc:
                        yield _sse("problem", str(exc))
                    except SagaError as exc:
                        yield _sse("problem", f"the database cannot be read: {exc}")
                wait = min(
                    _KEEPALIVE_SECONDS, max(refresh - (time.monotonic() - rendered_at), 0.05)
                )
                latest = await feed.wait(seen, wait)
                check = latest != seen or time.monotonic() - rendered_at >= refresh
                seen = latest
                if not check:
                    yield ": keepalive\n\n"

        return StreamingResponse(
            events(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )


def _stream_url(path: str, page: ListPage) -> str:
    query = page.filters.query
    return f"{path}?{query + '&' if query else ''}v={page.fingerprint}"


def _sse(event: str, data: str) -> str:
    lines = data.splitlines() or [""]
    return f"event: {event}\n" + "".join(f"data: {line}\n" for line in lines) + "\n"


def _headers(nonce: str) -> dict[str, str]:
    """Headers of every page: only its own inline script runs, no other site frames it."""
    return {
        "Content-Security-Policy": (
            f"default-src 'self'; script-src 'nonce-{nonce}'; style-src 'self' 'unsafe-inline'; "
            "img-src 'self' data:; frame-ancestors 'none'; form-action 'self'; base-uri 'none'"
        ),
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "same-origin",
        "Cache-Control": "no-store",
    }
