"""Who may talk to the service: the Host names it serves, and a bearer token.

Every event names a process, the file it ran and its exit code, for every process on the
machine: a page on another site must not read them. Two checks, as ASGI middleware:

- **Host** (Starlette's ``TrustedHostMiddleware``): a request whose ``Host`` header is not one
  the service serves is refused with 400. That defeats DNS rebinding, where a page of
  ``evil.example`` makes its own name resolve to 127.0.0.1 and then reads the service as if it
  were its own origin: the browser still sends ``Host: evil.example``.
- **Token** (``TokenMiddleware``, with ``--token-file``): every route but the page's static
  files wants the token, as ``Authorization: Bearer <token>`` (curl, Prometheus) or as the
  cookie that ``/?token=<token>`` sets once (a browser, whose ``EventSource`` cannot send
  headers). Compared in constant time.
"""

from __future__ import annotations

import hmac
import ipaddress
import re
import socket
from collections.abc import Iterable
from pathlib import Path

from starlette.datastructures import Headers, QueryParams
from starlette.requests import cookie_parser
from starlette.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

COOKIE = "aperf_service_token"
PUBLIC_PREFIX = "/static/"  # the page's script and stylesheet: no data in them
MIN_TOKEN_LENGTH = 16
# Safe as it is in a header, a cookie and a query string (URI "unreserved" characters);
# secrets.token_urlsafe() makes such tokens.
TOKEN_TEXT = re.compile(r"[A-Za-z0-9._~-]+", re.ASCII)
HOST_NAME = re.compile(r"(\*\.)?[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]*"
                       r"[A-Za-z0-9])?)*\.?", re.ASCII)


class TokenFileError(ValueError):
    """A ``--token-file`` that cannot be read or holds no usable token."""


def read_token(path: Path) -> str:
    """The token in ``path`` (surrounding whitespace ignored)."""
    try:
        text = path.read_bytes().strip()
    except OSError as exc:
        raise TokenFileError(f"cannot read token file {path}: {exc.strerror or exc}") from None
    token = text.decode("ascii", "replace")
    if len(token) < MIN_TOKEN_LENGTH or TOKEN_TEXT.fullmatch(token) is None:
        raise TokenFileError(
            f"token file {path} must hold one token of at least {MIN_TOKEN_LENGTH} characters "
            "among A-Z a-z 0-9 . _ ~ - (make one with: python3 -c "
            "'import secrets; print(secrets.token_urlsafe(32))')"
        )
    return token


def host_pattern(text: str) -> str:
    """An ``--allowed-host`` as TrustedHostMiddleware matches it; ValueError if it is not one.

    A name (``dash.example``), ``*.example`` for its subdomains, an IPv4 address, or an IPv6
    address (brackets optional). Never ``*`` alone: that would turn the check off.
    """
    try:
        address = ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        if HOST_NAME.fullmatch(text) is None or len(text) > 253:
            raise ValueError(f"{text!r} is not a host name, *.domain or an IP address") from None
        return text.lower()
    return f"[{address.compressed}]" if address.version == 6 else address.compressed


def served_hosts(bind: str, extra: Iterable[str] = ()) -> list[str]:
    """The Host values to accept: the bind address, ``localhost``, and the extra ones."""
    hosts = [host_pattern(bind), "localhost", *(host_pattern(h) for h in extra)]
    return list(dict.fromkeys(hosts))


def is_loopback(host: str) -> bool:
    """True if every address ``host`` stands for is a loopback address."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False  # the bind fails later, saying why
    return all(ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos)


class TokenMiddleware:
    """Lets through requests that carry the token; the page's static files need none."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self._token = token.encode()

    def _matches(self, given: str | None) -> bool:
        if not given:
            return False
        return hmac.compare_digest(given.encode("utf-8", "replace"), self._token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan" or scope["path"].startswith(PUBLIC_PREFIX):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        scheme, _, credentials = headers.get("authorization", "").partition(" ")
        cookie = cookie_parser(headers.get("cookie", "")).get(COOKIE)
        if (scheme.lower() == "bearer" and self._matches(credentials.strip())) or \
                self._matches(cookie):
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":  # a WebSocket (the service has none): refused, 403
            await send({"type": "websocket.close", "code": 1008})
            return
        response: Response
        query = QueryParams(scope["query_string"])
        if scope["path"] == "/" and self._matches(query.get("token")):
            # Once: the cookie holds the token from now on, and the address bar (and
            # the browser's history) no longer does.
            response = RedirectResponse("/", status_code=303)
            response.set_cookie(COOKIE, self._token.decode(), httponly=True, samesite="strict")
        elif scope["path"] == "/":
            response = PlainTextResponse(
                "This service wants its token: open /?token=<the token in its --token-file> "
                "once (a cookie keeps it), or send Authorization: Bearer <token>.\n",
                status_code=401, headers={"WWW-Authenticate": "Bearer"},
            )
        else:
            response = JSONResponse(
                {"error": "this service wants a token: Authorization: Bearer <token>"},
                status_code=401, headers={"WWW-Authenticate": "Bearer"},
            )
        await response(scope, receive, send)
