"""The Starlette application: routes, and the lifespan that owns the kernel resources."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from ..bootstrap_legacy import DEFAULT_OBJECT, DEFAULT_PAGES, DEFAULT_WAKEUP
from . import metrics
from .access import SECURITY_HEADERS, SESSION_ROTATE, Sessions, TokenMiddleware, add_headers
from .connections import HEADER_TIMEOUT, MAX_CONNECTIONS, ConnectionGuard
from .hub import SEP, BadEventIdError, Hub
from .source import TraceSource

log = structlog.get_logger("examples.service")

STATIC = Path(__file__).resolve().parent / "static"
DEFAULT_REPLAY = 4096
HEARTBEAT_SECONDS = 15.0
SHUTDOWN_SECONDS = 2.0
MAX_CLIENTS = 64  # event streams at once; one more gets 503
HISTORY = re.compile(r"0|[1-9][0-9]{0,8}", re.ASCII)  # /events?history=N (capped at the window)


@dataclass(frozen=True)
class Settings:
    object_path: Path = DEFAULT_OBJECT
    min_duration_ms: int = 0
    pages: int = DEFAULT_PAGES
    wakeup: str = DEFAULT_WAKEUP
    ordered: bool = True  # events in time order across CPUs (--unordered: ring order)
    replay: int = DEFAULT_REPLAY  # events kept for reconnecting and slow clients
    heartbeat: float = HEARTBEAT_SECONDS
    shutdown_timeout: float = SHUTDOWN_SECONDS
    # Host header values served (access.served_hosts); anything else gets 400.
    allowed_hosts: tuple[str, ...] = ("127.0.0.1", "localhost")
    token: str | None = None  # None: no token asked for (--no-token)
    session_rotate: float = SESSION_ROTATE  # seconds between new session ids (access.Sessions)
    secure_cookie: bool = False  # the session cookie only over HTTPS (behind a TLS proxy)
    max_clients: int = MAX_CLIENTS
    max_connections: int = MAX_CONNECTIONS  # connections.ConnectionGuard
    header_timeout: float = HEADER_TIMEOUT


class BadHistoryError(ValueError):
    """A ``history=`` query parameter that is not a number of events."""


def history_asked(request: Request, window: int) -> int | None:
    """``/events?history=N``: the last N events for a new client (at most the window)."""
    given = request.query_params.get("history")
    if given is None:
        return None
    if HISTORY.fullmatch(given) is None:
        shown = given if len(given) <= 20 else given[:20] + "..."
        raise BadHistoryError(f"history={shown!r} is not a number of events (0 to 999999999)")
    return min(int(given), window)


class ASGIEndpoint:
    """An ASGI function as a Starlette route's endpoint (a plain function would be a handler)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)


def create_app(settings: Settings) -> Starlette:
    hub = Hub(settings.replay)
    guard = ConnectionGuard(settings.max_connections, settings.header_timeout)
    source = TraceSource(hub, settings.object_path, min_duration_ms=settings.min_duration_ms,
                         pages=settings.pages, wakeup=settings.wakeup,
                         ordered=settings.ordered)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        hub.loop = asyncio.get_running_loop()
        async with source.running():
            assert source.stream is not None
            log.info("tracer running", cpus=source.stream.cpus, pages=settings.pages,
                     wakeup=settings.wakeup, min_duration_ms=settings.min_duration_ms,
                     replay=settings.replay)
            try:
                yield
            finally:
                hub.close()  # usually done already, at the signal
        stats = source.stream.statistics()
        # The accounting of the whole run: samples (read) == events + bad_samples, and
        # events + lost_notices == published + unpublished (0: the hub closed last).
        log.info("tracer stopped", samples=stats.samples, lost=stats.lost,
                 events=source.events, lost_notices=source.lost_notices,
                 bad_samples=source.bad_samples, published=hub.published,
                 unpublished=hub.unpublished, missed=dict(hub.missed))

    async def events(scope: Scope, receive: Receive, send: Send) -> None:
        """``/events``, as an ASGI app: its client counts from the request to the stream's end."""
        request = Request(scope)
        response: Response
        if hub.closed or not source.stream_open:
            response = JSONResponse({"error": "the event stream is not available"},
                                    status_code=503)
        elif hub.clients >= settings.max_clients:
            # Each stream holds a connection for as long as it is read: capped, so that
            # connections stay for the other routes (connections.py caps all of them).
            hub.refused += 1
            response = JSONResponse(
                {"error": f"too many event streams ({settings.max_clients}); try later"},
                status_code=503, headers={"Retry-After": "10"})
        else:
            peer = f"{request.client.host}:{request.client.port}" if request.client else \
                "unknown"
            try:
                cursor = hub.subscribe(request.headers.get("last-event-id"), peer,
                                       history_asked(request, hub.window))
            except (BadEventIdError, BadHistoryError) as exc:
                response = JSONResponse({"error": str(exc)}, status_code=400)
            else:
                hub.clients += 1
                try:
                    await EventSourceResponse(
                        cursor.chunks(), sep=SEP, ping=settings.heartbeat,
                        ping_message_factory=lambda: ServerSentEvent(comment="keep-alive",
                                                                     sep=SEP),
                        # At shutdown hub.close() ends every stream once it has written
                        # what is left; a client that stopped reading is cut off after
                        # this grace period.
                        shutdown_grace_period=settings.shutdown_timeout,
                    )(scope, receive, send)
                finally:
                    hub.clients -= 1
                return
        await response(scope, receive, send)

    async def health(request: Request) -> Response:
        ok = source.healthy()
        body: dict[str, Any] = {
            "status": "ok" if ok else "degraded" if source.stream_open else source.state,
            "stream_open": source.stream_open,
            "clients": len(hub.cursors),
            "published": hub.published,
        }
        if source.stream is not None:
            stats = source.stream.statistics()
            body.update(samples=stats.samples, lost=stats.lost,
                        lost_by_cpu={str(c.cpu): c.lost for c in stats.cpus},
                        broken_cpus=[c.cpu for c in stats.cpus if c.broken])
        return JSONResponse(body, status_code=200 if ok else 503)

    async def page(request: Request) -> Response:
        return FileResponse(STATIC / "index.html")

    middleware = [Middleware(TrustedHostMiddleware, allowed_hosts=list(settings.allowed_hosts),
                             www_redirect=False)]
    sessions = Sessions(settings.session_rotate)
    if settings.token is not None:
        middleware.append(Middleware(TokenMiddleware, token=settings.token, sessions=sessions,
                                     secure_cookie=settings.secure_cookie))
    app = Starlette(
        middleware=middleware,
        routes=[
            Route("/", page),
            Mount("/static", StaticFiles(directory=STATIC), name="static"),
            Route("/events", ASGIEndpoint(events), methods=["GET"]),
            Route("/metrics", metrics.endpoint(metrics.registry(source, hub, guard))),
            Route("/health", health),
        ],
        lifespan=lifespan,
    )
    app.state.hub = hub
    app.state.source = source
    app.state.sessions = sessions
    app.state.guard = guard  # its protocol() is uvicorn's http protocol (cli.py)
    return app


def with_security_headers(app: Starlette) -> ASGIApp:
    """The application as served: every response (a 400 or 401 too) with SECURITY_HEADERS."""
    return add_headers(app, SECURITY_HEADERS)
