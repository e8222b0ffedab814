"""Who may talk to the service: the Host names it serves, a bearer token, and browser sessions.

Every event names a process, the file it ran and its exit code, for every process on the
machine: a page on another site must not read them, nor another user of this machine. Two
checks, as ASGI middleware:

- **Host** (Starlette's ``TrustedHostMiddleware``): a request whose ``Host`` header is not one
  the service serves is refused with 400. That defeats DNS rebinding, where a page of
  ``evil.example`` makes its own name resolve to 127.0.0.1 and then reads the service as if it
  were its own origin: the browser still sends ``Host: evil.example``.
- **Token** (``TokenMiddleware``): every route but the page's static files wants the token
  (``--token-file``, or one generated at start-up), as ``Authorization: Bearer <token>``
  (curl, Prometheus), or a session: a browser, whose ``EventSource`` cannot send headers,
  opens ``/?token=<token>`` once and gets a cookie holding a random session id, never the
  token. Browsers send a cookie of 127.0.0.1 to every port of it, where another local user's
  server may collect it: so an id is short-lived (``Sessions``) and the token itself never
  leaves the address bar of that first request. Compared in constant time.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import os
import re
import secrets
import stat
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import structlog
from starlette.datastructures import Headers, MutableHeaders, QueryParams
from starlette.requests import cookie_parser
from starlette.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = structlog.get_logger("examples.service")

COOKIE = "aperf_service_session"
PUBLIC_PREFIX = "/static/"  # the page's script and stylesheet: no data in them
MIN_TOKEN_LENGTH = 16
# Safe as it is in a header, a cookie and a query string (URI "unreserved" characters);
# secrets.token_urlsafe() makes such tokens.
TOKEN_TEXT = re.compile(r"[A-Za-z0-9._~-]+", re.ASCII)
HOST_NAME = re.compile(r"(\*\.)?[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]*"
                       r"[A-Za-z0-9])?)*\.?", re.ASCII)
MAX_TOKEN_FILE = 4096  # bytes read from a token file: a token is one short line

SESSION_ROTATE = 300.0  # seconds: an id older than this is replaced at its next use
SESSION_GRACE = 10.0  # seconds a replaced id is still taken (requests already under way)
SESSION_MAX_AGE = 7 * 24 * 3600.0  # then the browser needs the token again
MAX_SESSIONS = 1024  # the oldest is dropped beyond it (only token holders make sessions)
KEPT_IDS = 8  # ids known per session: the current one and the last ones it replaced


class TokenFileError(ValueError):
    """A token file that cannot be read, is not private, or holds no usable token."""


def read_token(path: Path) -> str:
    """The token in ``path`` (surrounding whitespace ignored).

    Refused, as ssh refuses a private key, when group or others have any permission on the
    file: whoever can read it can read every event.
    """
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            if not stat.S_ISREG(mode):
                raise TokenFileError(f"token file {path} is not a regular file")
            if mode & 0o077:
                raise TokenFileError(
                    f"token file {path} is open to group or others (mode "
                    f"{stat.S_IMODE(mode):04o}): anyone who reads it reads every event; "
                    f"chmod 600 {path}"
                )
            text = f.read(MAX_TOKEN_FILE + 1).strip()
    except OSError as exc:
        raise TokenFileError(f"cannot read token file {path}: {exc.strerror or exc}") from None
    token = text.decode("ascii", "replace")
    if len(token) < MIN_TOKEN_LENGTH or len(text) > MAX_TOKEN_FILE or \
            TOKEN_TEXT.fullmatch(token) is None:
        raise TokenFileError(
            f"token file {path} must hold one token of at least {MIN_TOKEN_LENGTH} characters "
            "among A-Z a-z 0-9 . _ ~ - (make one with: python3 -c "
            "'import secrets; print(secrets.token_urlsafe(32))')"
        )
    return token


def runtime_directory() -> Path:
    """Where a generated token goes: systemd's RuntimeDirectory, else /run or the user's own."""
    given = os.environ.get("RUNTIME_DIRECTORY")  # set by systemd's RuntimeDirectory=
    if given:
        return Path(given.split(":")[0])
    if os.geteuid() == 0:
        return Path("/run/aperf-service")
    user_runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(user_runtime) if user_runtime else Path.home() / ".cache"
    return base / "aperf-service"


def private_directory(path: Path) -> None:
    """Create ``path`` (mode 0700) or check that it is ours and no one else can write to it."""
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    try:
        info = path.lstat()
    except OSError as exc:
        raise TokenFileError(f"cannot use {path} for the token: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise TokenFileError(f"{path} is not a directory (a symbolic link is not taken)")
    if info.st_uid != os.geteuid() or info.st_mode & 0o022:
        raise TokenFileError(
            f"{path} must belong to this user (uid {os.geteuid()}) and be writable by no one "
            f"else (it is uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):04o})"
        )


def write_new_token(directory: Path, name: str) -> tuple[Path, str]:
    """A new random token in ``directory/name`` (mode 0600, a file of our own making)."""
    private_directory(directory)
    path = directory / name
    token = secrets.token_urlsafe(32)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # a previous run's, left by a crash: it is dead
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
    except OSError as exc:
        raise TokenFileError(f"cannot write token file {path}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return path, token


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


@dataclass(eq=False)
class _Session:
    created: float
    ids: list[str] = field(default_factory=list)  # its ids still known, oldest first


@dataclass(eq=False)
class _Id:
    session: _Session
    issued: float
    replaced: float | None = None  # when a newer id was handed out in its place


class Sessions:
    """Browser sessions: random ids for those who gave the token once, short-lived, rotated.

    An id is replaced by a new one (``Set-Cookie``) at its first use after ``rotate``
    seconds; the old one is still taken for ``grace`` seconds (requests already under way),
    then never again. An id not used before it is ``2 * rotate`` seconds old (the page was
    closed) is dead, and its session with it.
    A replaced id used after its grace means two holders (one took a copy of the cookie):
    the whole session ends, for both, as OAuth ends a refresh token family that is replayed.
    Whatever its use, a session ends ``max_age`` seconds after the token was given. So a
    copied cookie opens the service for ``rotate + grace`` seconds at most, unless its
    thief uses it at once; then the page it was taken from is signed out at its next
    request after the grace, and the thief with it.
    """

    def __init__(self, rotate: float = SESSION_ROTATE, *, grace: float | None = None,
                 max_age: float = SESSION_MAX_AGE, max_sessions: int = MAX_SESSIONS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if rotate <= 0 or max_age <= 0 or max_sessions < 1:
            raise ValueError("rotate and max_age must be positive, max_sessions at least 1")
        self.rotate = rotate
        self.grace = min(SESSION_GRACE, rotate) if grace is None else grace
        self.max_age = max_age
        self.max_sessions = max_sessions
        self._clock = clock
        self._ids: dict[str, _Id] = {}
        self._sessions: OrderedDict[_Session, None] = OrderedDict()  # oldest first
        self.ended = {"replayed": 0, "expired": 0, "dropped": 0}  # sessions ended, by why

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def lifetime(self) -> float:
        """Seconds an id lives if it is not used (and so replaced) before."""
        return 2 * self.rotate

    def open(self) -> str:
        """A new session; its first id."""
        now = self._clock()
        for old in [s for s in self._sessions if self._over(s, now)]:
            self._end(old, "expired")  # pages closed long ago: nothing would check them
        while len(self._sessions) >= self.max_sessions:
            oldest = next(iter(self._sessions))
            self._end(oldest, "dropped")
        session = _Session(created=now)
        self._sessions[session] = None
        return self._issue(session, now)

    def check(self, given: str | None) -> tuple[bool, str | None]:
        """Whether ``given`` opens the service now, and the id to hand out in its place."""
        entry = self._ids.get(given) if given else None
        if entry is None:
            return False, None
        now, session = self._clock(), entry.session
        if now - session.created >= self.max_age:
            self._end(session, "expired")
            return False, None
        if entry.replaced is not None:
            if now - entry.replaced < self.grace:
                return True, None
            self._end(session, "replayed")
            log.warning("browser session ended: a replaced session id was used again, so "
                        "two parties held it (a copy of the cookie)")
            return False, None
        if now - entry.issued >= self.lifetime:
            self._end(session, "expired")
            return False, None
        if now - entry.issued >= self.rotate:
            entry.replaced = now
            return True, self._issue(session, now)
        return True, None

    def _over(self, session: _Session, now: float) -> bool:
        newest = self._ids[session.ids[-1]]
        return now - session.created >= self.max_age or now - newest.issued >= self.lifetime

    def _issue(self, session: _Session, now: float) -> str:
        new = secrets.token_urlsafe(32)
        self._ids[new] = _Id(session, now)
        session.ids.append(new)
        # Replaced ids are kept to tell a replay (a bounded few: one is replaced per
        # `rotate` seconds of use); an older one is then merely unknown, and refused.
        while len(session.ids) > KEPT_IDS:
            del self._ids[session.ids.pop(0)]
        return new

    def _end(self, session: _Session, why: str) -> None:
        for i in session.ids:
            self._ids.pop(i, None)
        session.ids.clear()
        self._sessions.pop(session, None)
        self.ended[why] += 1


def add_headers(app: ASGIApp, headers: Iterable[tuple[str, str]]) -> ASGIApp:
    """``app`` with ``headers`` on every HTTP response it sends."""
    extra = list(headers)

    async def with_headers(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                response_headers = MutableHeaders(scope=message)
                for name, value in extra:
                    response_headers.setdefault(name, value)
            await send(message)

        await app(scope, receive, send_with_headers)

    return with_headers


# On every response: no page of the service tells another site its address (a URL may
# hold ?token= on the first request), and a browser never guesses a type.
SECURITY_HEADERS = (("Referrer-Policy", "no-referrer"), ("X-Content-Type-Options", "nosniff"))


class TokenMiddleware:
    """Lets through requests that carry the token or a session; static files need none."""

    def __init__(self, app: ASGIApp, token: str, sessions: Sessions,
                 secure_cookie: bool = False) -> None:
        self.app = app
        self._token = token.encode()
        self.sessions = sessions
        self.secure_cookie = secure_cookie

    def _matches(self, given: str | None) -> bool:
        if not given:
            return False
        return hmac.compare_digest(given.encode("utf-8", "replace"), self._token)

    def _set_cookie(self, headers: MutableHeaders, session_id: str) -> None:
        # No Max-Age: the browser keeps the cookie until it closes, and the service
        # decides how long an id is good for. A browser that dropped an old id by itself
        # would never show it again, and a copy used by someone else would go unnoticed.
        response = Response()
        response.set_cookie(COOKIE, session_id, httponly=True, samesite="strict",
                            secure=self.secure_cookie)
        headers.append("set-cookie", response.headers["set-cookie"])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan" or scope["path"].startswith(PUBLIC_PREFIX):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        query = QueryParams(scope["query_string"])
        if scope["type"] == "http" and scope["path"] == "/" and self._matches(query.get("token")):
            # Once: a session id in the cookie from now on; the token leaves the address
            # bar (and the browser's history) and is never stored by the browser. Also for
            # a browser that has a session already.
            response: Response = RedirectResponse("/", status_code=303,
                                                  headers={"Cache-Control": "no-store"})
            self._set_cookie(response.headers, self.sessions.open())
            await response(scope, receive, send)
            return
        scheme, _, credentials = headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and self._matches(credentials.strip()):
            await self.app(scope, receive, send)
            return
        allowed, renewed = self.sessions.check(cookie_parser(headers.get("cookie", "")).get(COOKIE))
        if allowed:
            if renewed is None:
                await self.app(scope, receive, send)
                return

            async def send_renewed(message: Message) -> None:
                if message["type"] == "http.response.start":
                    assert renewed is not None
                    self._set_cookie(MutableHeaders(scope=message), renewed)
                await send(message)

            await self.app(scope, receive, send_renewed)
            return
        if scope["type"] != "http":  # a WebSocket (the service has none): refused, 403
            await send({"type": "websocket.close", "code": 1008})
            return
        if scope["path"] == "/":
            response = PlainTextResponse(
                "This service wants its token: open /?token=<the token> once (a session "
                "cookie keeps you in), or send Authorization: Bearer <token>.\n",
                status_code=401, headers={"WWW-Authenticate": "Bearer"},
            )
        else:
            response = JSONResponse(
                {"error": "this service wants a token: Authorization: Bearer <token>"},
                status_code=401, headers={"WWW-Authenticate": "Bearer"},
            )
        await response(scope, receive, send)
