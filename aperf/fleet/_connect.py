"""Connecting to NATS and checking the JetStream stream, with one typed error per mistake.

nats-py either retries a failed first connection for ever (``max_reconnect_attempts=-1``)
or gives up on later outages too. aperf wants both: reconnect for ever once
connected, yet fail fast and clearly when the first connection cannot be made.
So the first connection runs with unlimited attempts under a deadline, and an
authorization violation or a certificate that does not verify (which no retry
cures) ends it at once.

JetStream in a cluster may be there and not serving: while there is no quorum or a
leader is being elected its API does not answer (or answers 503). ``ready()``
retries such requests up to a bound; only a server whose INFO says JetStream is off
gets "start nats-server with -js".

nats-py upgrades to TLS only when the server's INFO says ``tls_required``, and sends
the password or token in its CONNECT whatever the transport. So a man in the middle
(or a server) that answers ``"tls_required": false`` would get the credentials in
clear even from a client given ``tls://`` and a CA. ``_GuardedClient`` checks, between
the INFO and the CONNECT: when TLS was asked for it makes nats-py upgrade (or refuses
a server that offers no TLS), and it never lets a password or token out in clear to a
peer that is not loopback unless ``allow_insecure``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import ipaddress
import json
import os
import ssl
import types
import warnings
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Literal, TypeVar

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, StorageType, StreamConfig, StreamInfo

from .._log import log
from ._args import check_seconds, url_problem
from ._errors import (
    FleetAuthError,
    FleetConfigError,
    FleetInsecureError,
    FleetInsecureWarning,
    FleetUnavailableError,
)

Servers = str | Sequence[str]
Callback = Callable[[], Awaitable[None]]
Path = str | os.PathLike[str]
T = TypeVar("T")

DEFAULT_JETSTREAM = "APERF"
DEFAULT_PREFIX = "aperf"
RECONNECT_WAIT = 0.25  # seconds between reconnection attempts: a restart is seen within this
READY_PAUSE = 0.25  # seconds between JetStream requests while it is not serving
REQUEST_TIMEOUT = 2.0  # the most one JetStream API request may take while opening
PERMISSIONS = "permissions violation"  # nats-py lowercases the server's -ERR


def server_list(servers: object) -> list[str]:
    if isinstance(servers, str):
        servers = [servers]
    if (
        not isinstance(servers, Sequence)
        or not servers
        or not all(isinstance(s, str) and s for s in servers)
    ):
        raise TypeError(f"servers must be a NATS URL or a list of them, not {servers!r}")
    for url in servers:
        problem = url_problem(url)
        if problem:
            shown = _without_password(url)
            raise FleetConfigError("servers", f"{shown!r} is not a NATS URL: {problem}")
    return list(servers)


@dataclasses.dataclass(frozen=True)
class Credentials:
    """Who the client is to the server, and how it checks the server: checked once,
    where the user gives them (``credentials()``), used at every (re)connection."""

    options: Mapping[str, Any]
    argument: str  # the argument to fix when the server refuses them
    allow_insecure: bool = False  # a password or token may go in clear to any host

    @property
    def tls(self) -> bool:
        return "tls" in self.options or bool(self.options.get("tls_handshake_first"))


CONNECT_TIMEOUT = 5.0  # seconds: the first connection (a server that does not answer)
READY_TIMEOUT = 10.0  # seconds: JetStream serving (a cluster electing a leader)


@dataclasses.dataclass(frozen=True, repr=False)
class NatsOptions:
    """How to reach the NATS servers: one checked, immutable value for
    [`JetStreamSink`][aperf.fleet.JetStreamSink],
    [`FleetReader`][aperf.fleet.FleetReader] and
    [`create_stream()`][aperf.fleet.create_stream], given where they take ``servers``
    (as nats.go's ``nats.Options`` holds a connection's settings).

    ``servers`` is a NATS URL or a list of them (any node of a cluster will do). Who the
    client is: ``user`` and ``password``, or ``token``, or ``creds`` (a credentials
    file: user JWT and nkey seed); or ``user:password@`` in a URL. TLS: ``tls_ca`` (the
    CA that signed the server's certificate), ``tls_cert`` and ``tls_key`` (a client
    certificate); given, or a ``tls://`` URL, TLS is required, and
    ``tls_handshake_first`` starts it before the server's INFO. A password or token goes
    in clear (no TLS) only to a server on this host, unless ``allow_insecure``.
    ``connect_timeout`` bounds the first connection (then it reconnects for ever),
    ``ready_timeout`` the wait for JetStream to serve (a cluster electing a leader).
    ``connect_options`` are more keywords for nats-py's ``nats.connect()``.

    Everything is checked here, once (a typed error naming the argument; the files are
    read now, as the sink and the reader read them); the value is used at every
    (re)connection. Its ``repr()`` shows no password or token. The same keywords given
    to the sink, the reader or ``create_stream()`` themselves still work, as before;
    ``dataclasses.replace(options, ...)`` makes a changed copy.
    """

    servers: Servers
    user: str | None = None
    password: str | None = None
    token: str | None = None
    creds: Path | None = None
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_handshake_first: bool = False
    allow_insecure: bool = False
    connect_timeout: float = CONNECT_TIMEOUT
    ready_timeout: float = READY_TIMEOUT
    connect_options: Mapping[str, Any] | None = dataclasses.field(default=None, hash=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # (frozen: the checked forms, set once here)
        set_(self, "servers", tuple(server_list(self.servers)))
        set_(self, "connect_timeout", check_seconds("connect_timeout", self.connect_timeout))
        set_(self, "ready_timeout", check_seconds("ready_timeout", self.ready_timeout))
        extra = self.connect_options
        if extra is not None:
            if not isinstance(extra, Mapping):
                raise TypeError(f"connect_options must be a mapping of nats.connect() "
                                f"keywords or None, not {type(extra).__name__}")
            set_(self, "connect_options", types.MappingProxyType(dict(extra)))
        # Not a field: what nats-py is given (an SSL context among them), kept out of
        # ==, repr() and dataclasses.asdict().
        set_(self, "_credentials", credentials(
            user=self.user, password=self.password, token=self.token, creds=self.creds,
            tls_ca=self.tls_ca, tls_cert=self.tls_cert, tls_key=self.tls_key,
            tls_handshake_first=self.tls_handshake_first, allow_insecure=self.allow_insecure,
        ))

    def __repr__(self) -> str:
        shown = [f"servers={[_without_password(u) for u in self.servers]!r}"]
        for field in dataclasses.fields(self)[1:]:
            value = getattr(self, field.name)
            if value != field.default:
                secret = field.name in ("password", "token")
                shown.append(f"{field.name}={'***' if secret else repr(value)}")
        return f"NatsOptions({', '.join(shown)})"


def auth(options: NatsOptions) -> Credentials:
    """nats-py's connection options for ``options``' credentials and TLS (checked)."""
    return options._credentials  # type: ignore[attr-defined,no-any-return]


def resolve_options(
    servers: Servers | NatsOptions, *, connect_options: Mapping[str, Any] | None,
    **keywords: Any,
) -> NatsOptions:
    """The options a sink, a reader or ``create_stream()`` was given: a ``NatsOptions``
    in ``servers``, or one made of the connection keywords (the older way). Both at once
    is a mistake (which would win?): a TypeError naming the keyword."""
    if isinstance(servers, NatsOptions):
        defaults = {f.name: f.default for f in dataclasses.fields(NatsOptions)}
        given = [name for name, value in keywords.items() if value != defaults[name]]
        if connect_options is not None:
            given.append("connect_options")
        if given:
            raise TypeError(
                f"{given[0]}= goes in the NatsOptions given as servers, not beside it "
                f"(dataclasses.replace(options, {given[0]}=...) makes a copy with it)"
            )
        return servers
    return NatsOptions(servers, connect_options=connect_options, **keywords)


def credentials(
    *,
    user: str | None = None,
    password: str | None = None,
    token: str | None = None,
    creds: Path | None = None,
    tls_ca: Path | None = None,
    tls_cert: Path | None = None,
    tls_key: Path | None = None,
    tls_handshake_first: bool = False,
    allow_insecure: bool = False,
) -> Credentials:
    """nats-py's connection options for these; one typed error per mistake."""
    for argument, flag in (
        ("tls_handshake_first", tls_handshake_first), ("allow_insecure", allow_insecure)
    ):
        if not isinstance(flag, bool):
            raise TypeError(f"{argument} must be a bool, not {flag!r}")
    for argument, value in (("user", user), ("password", password), ("token", token)):
        if value is not None and (not isinstance(value, str) or not value):
            raise TypeError(f"{argument} must be a non-empty str or None, not {value!r}")
    if password is not None and user is None:
        raise ValueError("password needs user= too")
    given = [a for a, v in (("user", user), ("token", token), ("creds", creds)) if v is not None]
    if len(given) > 1:
        raise ValueError(f"give one of user/password, token or creds, not {' and '.join(given)}")
    options: dict[str, Any] = {}
    argument = "servers"  # user:password@ in the URL, or no credentials
    if user is not None:
        options |= {"user": user, "password": password or ""}
        argument = "password"
    if token is not None:
        options["token"] = token
        argument = "token"
    if creds is not None:
        options["user_credentials"] = _readable("creds", creds)
        argument = "creds"
    if tls_key is not None and tls_cert is None:
        raise ValueError("tls_key needs tls_cert= too")
    if tls_ca is not None or tls_cert is not None:
        options["tls"] = _tls_context(tls_ca, tls_cert, tls_key)
    if tls_handshake_first:  # the server must be told to expect it (nats-server >= 2.10.4)
        options["tls_handshake_first"] = True
    return Credentials(options, argument, allow_insecure)


def _readable(argument: str, path: Path) -> str:
    name = os.fspath(path)
    try:
        with open(name, "rb"):
            pass
    except OSError as exc:
        raise FleetConfigError(argument, f"cannot read {name}: {exc.strerror}") from None
    return name


def _tls_context(ca: Path | None, cert: Path | None, key: Path | None) -> ssl.SSLContext:
    """A client context that verifies the server against ``ca`` (else the system's CAs),
    and presents ``cert``/``key`` if given (servers with ``verify: true``)."""
    cafile = _readable("tls_ca", ca) if ca is not None else None
    try:
        context = ssl.create_default_context(cafile=cafile)
    except ssl.SSLError as exc:
        raise FleetConfigError("tls_ca", f"{cafile} holds no usable certificate: {exc}") from None
    if cert is not None:
        certfile = _readable("tls_cert", cert)
        keyfile = _readable("tls_key", key) if key is not None else None
        try:
            context.load_cert_chain(certfile, keyfile)
        except ssl.SSLError as exc:
            raise FleetConfigError(
                "tls_cert", f"cannot use the certificate {certfile} (and key): {exc}"
            ) from None
    return context


class Refusals:
    """Permission violations the server reported: nats-py hands them to ``error_cb``
    only (the connection stays up, the request or message just goes nowhere)."""

    def __init__(self) -> None:
        self.last: str | None = None

    def note(self, exc: Exception) -> str | None:
        text = str(exc)
        if PERMISSIONS not in text.lower():
            return None
        self.last = text.removeprefix("nats: ")
        return self.last

    def check(self, argument: str) -> None:
        if self.last is not None:
            raise FleetAuthError(
                argument, f"the NATS server refused what this user asked: {self.last} "
                "(see the permissions in docs/fleet.md)"
            )


class _Refused(nats.errors.Error):
    """Raised inside nats-py's connection steps (whose loops take nats.errors.Error as
    a failed attempt: the socket is closed, the next server tried), carrying the
    error aperf raises."""

    def __init__(self, error: FleetInsecureError) -> None:
        super().__init__(str(error))
        self.error = error


class _GuardedClient(Client):
    """nats-py's client, with aperf's rules applied between the server's INFO and the
    client's CONNECT (the message that carries the password or token), at every
    (re)connection and to every server, also those a cluster's INFO adds to the pool:

    - TLS asked for (``tls_wanted``): TLS or nothing; nats-py is made to upgrade
      even when the INFO does not ask for it, and a server that offers no TLS is
      refused before anything is sent;
    - no TLS: a password or token goes in clear only to a loopback peer (noted in
      ``plain``, for a warning), or anywhere with ``allow_insecure``.

    These override two private methods of nats-py (2.x), the only places where the
    INFO is known and the CONNECT not yet written; tests/test_fleet_credentials.py
    checks them against a real nats-server and a fake one.
    """

    def __init__(self, *, tls_wanted: bool, allow_insecure: bool) -> None:
        for method in ("_process_info", "_connect_command"):  # fail closed, not open,
            if not callable(getattr(Client, method, None)):  # on a nats-py that changed
                raise RuntimeError(f"nats-py's Client has no {method}: aperf cannot check "
                                   "its connections; use nats-py 2.16 to 2.x")
        super().__init__()
        self.checked = 0  # CONNECTs this class saw: 0 once connected means it was bypassed
        self.tls_wanted = tls_wanted
        self.allow_insecure = allow_insecure
        self.plain: dict[str, str] = {}  # server -> the secret it got in clear (loopback)
        self.warned: set[str] = set()  # of those, the ones said (a warning, or logged)
        self.opened = False  # connect() returned it: later plain sends are logged

    def _refuse(self, error: FleetInsecureError) -> _Refused:
        """Hang up (nats-py, reconnecting, would leave the socket to the collector)."""
        if self._transport is not None:
            self._transport.close()  # type: ignore[no-untyped-call]
        return _Refused(error)

    def _where(self) -> str:
        server = self._current_server
        return _without_password(server.uri.geturl()) if server is not None else "?"

    def _writer(self) -> Any:
        return getattr(self._transport, "_io_writer", None)  # TcpTransport's

    def _secure(self) -> bool:
        server = self._current_server
        if server is not None and server.uri.scheme == "wss":
            return True
        writer = self._writer()
        return writer is not None and writer.get_extra_info("ssl_object") is not None

    def _loopback(self) -> bool:
        """Whether the peer is this host, from the socket's address (not the URL's name)."""
        writer = self._writer()
        peer = writer.get_extra_info("peername") if writer is not None else None
        if peer is None:  # a WebSocket: the URL's host, when it is a loopback address
            server = self._current_server
            host = server.uri.hostname if server is not None else None
            return host == "localhost" or _is_loopback(host)
        return _is_loopback(peer[0])

    async def _process_info(
        self, info: dict[str, Any], initial_connection: bool = False
    ) -> None:
        if initial_connection and self.tls_wanted and not self._secure():
            if not (info.get("tls_required") or info.get("tls_available")):
                raise self._refuse(FleetInsecureError(
                    "servers", f"TLS was asked for, and the NATS server at {self._where()} "
                    "offers none (its INFO says neither tls_required nor tls_available): "
                    "nothing was sent; a server without TLS, or someone in between"
                ))
            info["tls_required"] = True  # nats-py upgrades only when the server asks
        await super()._process_info(info, initial_connection)

    def _connect_command(self) -> bytes:
        command: bytes = super()._connect_command()
        self.checked += 1
        if self._secure():
            return command
        where = self._where()
        if self.tls_wanted:  # _process_info made nats-py upgrade; a transport it did not
            raise self._refuse(FleetInsecureError(  # upgrade (ws://) ends here
                "servers", f"TLS was asked for, and the connection to {where} is not TLS "
                "(a ws:// URL?): nothing was sent"
            ))
        fields = json.loads(command.partition(b" ")[2])
        secret = "password" if "pass" in fields else "token" if "auth_token" in fields else ""
        if not secret or self.allow_insecure:
            return command
        if not self._loopback():
            raise self._refuse(FleetInsecureError(
                "allow_insecure", f"refusing to send the {secret} in clear to the NATS "
                f"server at {where}, which is not on this host: use TLS (a tls:// URL, "
                "tls_ca=), or a creds file, or allow it with allow_insecure=True "
                "(--nats-insecure)"
            ))
        self.plain[where] = secret
        if self.opened and where not in self.warned:  # a reconnection, to another server
            self.warned.add(where)
            log.warning(f"NATS {secret} sent in clear to a server on this host", server=where)
        return command


def _is_loopback(host: str | None) -> bool:
    try:
        address = ipaddress.ip_address((host or "").partition("%")[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def _tls_wanted(urls: Sequence[str], settings: Mapping[str, Any]) -> bool:
    """Whether TLS was asked for in any way: a tls:// or wss:// URL, a TLS context
    (tls_ca, tls_cert, connect_options' tls) or TLS first."""
    return (
        any(url.startswith(("tls://", "wss://")) for url in urls)
        or settings.get("tls") is not None
        or bool(settings.get("tls_handshake_first"))
    )


async def connect(
    servers: Servers,
    *,
    timeout: float,
    name: str,
    on_error: Callable[[Exception], None] | None = None,
    disconnected: Callback | None = None,
    reconnected: Callback | None = None,
    options: Mapping[str, Any] | None = None,
    auth: Credentials | None = None,
    refusals: Refusals | None = None,
    inbox_prefix: str | None = None,
) -> Client:
    """A connected client that reconnects for ever, or FleetConfigError within ``timeout``
    (FleetAuthError when the server refuses the credentials or its certificate does
    not verify; FleetInsecureError when TLS was asked for and the server offers none,
    or a password or token would go in clear to a server not on this host)."""
    urls = server_list(servers)
    if timeout <= 0:
        raise ValueError(f"connect_timeout must be positive seconds, not {timeout!r}")
    auth = auth or Credentials({}, "servers")
    errors: list[Exception] = []
    refused: list[FleetConfigError] = []
    gave_up_event = asyncio.Event()
    connected = False
    said: list[str] = []  # a refusal once connected, said

    def refuse(error: FleetConfigError) -> None:
        if not connected:
            refused.append(error)
            gave_up_event.set()
        elif not said:  # a reconnection refused: nats-py tries again for ever; say it once
            said.append(str(error))
            log.warning("a NATS reconnection was refused; retrying", error=str(error))

    async def error_cb(exc: Exception) -> None:
        errors.append(exc)
        del errors[:-3]
        if isinstance(exc, _Refused):
            refuse(exc.error)
        elif isinstance(exc, nats.errors.AuthorizationError) or "Authorization Violation" in str(
            exc
        ):
            refuse(FleetAuthError(
                auth.argument, f"the NATS server at {shown} refused the credentials "
                "(Authorization Violation): check the user and password, token or creds"
            ))
        elif isinstance(exc, ssl.SSLCertVerificationError):
            refuse(FleetAuthError("tls_ca", f"the TLS certificate of the NATS server at {shown} "
                                  f"does not verify: {exc.verify_message}"))
        elif isinstance(exc, ssl.SSLError):
            refuse(FleetAuthError("tls_ca", f"TLS with the NATS server at {shown} failed: {exc}"))
        if refusals is not None:
            refusals.note(exc)
        if on_error is not None:
            on_error(exc)

    settings: dict[str, Any] = {
        "name": name,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": RECONNECT_WAIT,
        "connect_timeout": min(timeout, 2.0),
        "error_cb": error_cb,
    }
    if disconnected is not None:
        settings["disconnected_cb"] = disconnected
    if reconnected is not None:
        settings["reconnected_cb"] = reconnected
    if inbox_prefix is not None:
        settings["inbox_prefix"] = inbox_prefix
    settings.update(auth.options)
    settings.update(options or {})
    shown = ", ".join(_without_password(u) for u in urls)
    client = _GuardedClient(
        tls_wanted=_tls_wanted(urls, settings), allow_insecure=auth.allow_insecure
    )
    attempt = asyncio.ensure_future(client.connect(urls, **settings))
    gave_up = asyncio.ensure_future(gave_up_event.wait())
    try:
        await asyncio.wait({attempt, gave_up}, timeout=timeout, return_when="FIRST_COMPLETED")
    finally:
        gave_up.cancel()
    if attempt.done() and attempt.exception() is None and client.is_connected:
        log.debug("connected to NATS", servers=urls, url=str(client.connected_url))
        connected = True
        try:
            if not client.checked:
                raise RuntimeError("nats-py connected without aperf's check of the CONNECT "
                                   "(a nats-py aperf does not know); use nats-py 2.16 to 2.x")
            _warn_plain(client)
        except BaseException:  # that, or warnings turned into errors (-W error)
            await client.close()
            raise
        return client
    attempt.cancel()
    await asyncio.gather(attempt, return_exceptions=True)
    await client.close()
    if refused:
        raise refused[0]
    last = errors[-1] if errors else (attempt.exception() if attempt.done() else None)
    why = f": {type(last).__name__}: {last}" if last is not None else ""
    raise FleetConfigError(
        "servers", f"no NATS server answered at {shown} within {timeout:g} s{why}"
    )


def _warn_plain(client: _GuardedClient) -> None:
    """Say once per server (Python's warning filter) that a secret went in clear."""
    client.opened = True
    for where, secret in client.plain.items():
        client.warned.add(where)
        warnings.warn(FleetInsecureWarning(
            f"the NATS {secret} went in clear (no TLS) to {where}, on this host: a local "
            "user who holds that port first would get it; use TLS or a creds file, or "
            "allow_insecure=True (--nats-insecure) to say this is meant"
        ), stacklevel=2)


def _without_password(url: str) -> str:
    scheme, sep, rest = url.rpartition("://")
    if "@" in rest:
        rest = "***@" + rest.rsplit("@", 1)[1]
    return f"{scheme}{sep}{rest}"


# What JetStream answers while it is there but not serving (no quorum, no leader,
# a node still catching up): retried by ready(), up to its bound.
_NOT_SERVING = (
    nats.errors.NoRespondersError,
    nats.errors.TimeoutError,
    nats.js.errors.ServiceUnavailableError,
    asyncio.TimeoutError,
)


def _no_jetstream() -> FleetConfigError:
    return FleetConfigError(
        "servers", "the NATS server has no JetStream; start nats-server with -js"
    )


def _said(exc: BaseException) -> str:
    """What the server answered, in words."""
    if isinstance(exc, nats.js.errors.APIError) and exc.description:
        return f"it answered {exc.code}: {exc.description}"
    if isinstance(exc, (nats.errors.NoRespondersError, nats.js.errors.ServiceUnavailableError)):
        return "no responders: its JetStream API did not take the request"
    return "its JetStream API did not answer"


async def ready(
    nc: Client,
    request: Callable[[], Awaitable[T]],
    *,
    timeout: float,
    refusals: Refusals | None = None,
    argument: str = "servers",
) -> T:
    """``await request()``, asked again while JetStream is not serving (a cluster
    without quorum, electing a leader), for up to ``timeout`` seconds.

    FleetConfigError at once when the server's INFO says JetStream is off,
    FleetAuthError when the server reported a permission violation meanwhile,
    FleetUnavailableError, saying what the server answered, after ``timeout``.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        # The INFO the server sent at (re)connection says whether it runs JetStream
        # (nats-py keeps it in _server_info only).
        if nc.is_connected and not nc._server_info.get("jetstream", False):
            raise _no_jetstream()
        try:
            return await asyncio.wait_for(
                request(), max(0.05, min(REQUEST_TIMEOUT, deadline - loop.time()))
            )
        except _NOT_SERVING as exc:
            last: BaseException = exc
        if refusals is not None:
            refusals.check(argument)
        if loop.time() + READY_PAUSE >= deadline:
            raise FleetUnavailableError(
                "servers", f"JetStream did not serve within {timeout:g} s ({_said(last)}); "
                "a cluster without a quorum of its nodes, or electing a leader, does that"
            ) from None
        log.debug("JetStream not serving yet, asking again", error=repr(last))
        await asyncio.sleep(READY_PAUSE)


async def stream_info(
    nc: Client,
    js: JetStreamContext,
    jetstream: str,
    *,
    timeout: float,
    refusals: Refusals | None = None,
) -> StreamInfo:
    """The stream's info, or FleetConfigError if JetStream is off or the stream is missing."""
    try:
        return await ready(
            nc, lambda: js.stream_info(jetstream), timeout=timeout, refusals=refusals
        )
    except nats.js.errors.NotFoundError:
        raise FleetConfigError(
            "jetstream", f"the JetStream stream {jetstream!r} does not exist; create it "
            "(aperf.fleet.create_stream, or python -m aperf.fleet create-stream)"
        ) from None


async def check_stream(
    nc: Client,
    js: JetStreamContext,
    jetstream: str,
    subject: str,
    *,
    timeout: float,
    refusals: Refusals | None = None,
) -> StreamInfo:
    """The info of stream ``jetstream``; FleetConfigError unless JetStream is on and that
    stream takes ``subject``."""

    async def find() -> str | None:
        try:
            return await js.find_stream_name_by_subject(subject)
        except nats.js.errors.NotFoundError:
            return None

    found = await ready(nc, find, timeout=timeout, refusals=refusals)
    info = await stream_info(nc, js, jetstream, timeout=timeout, refusals=refusals)
    if found == jetstream:
        return info
    subjects = ", ".join(info.config.subjects or []) or "none"
    raise FleetConfigError(
        "jetstream", f"the JetStream stream {jetstream!r} does not take subject {subject!r} "
        f"(its subjects: {subjects}"
        + (f"; stream {found!r} takes it" if found else "") + ")"
    )


class _Keep(enum.Enum):
    KEEP = "keep"


KEEP: Literal[_Keep.KEEP] = _Keep.KEEP  # an argument of create_stream not given


async def create_stream(
    servers: Servers | NatsOptions,
    *,
    jetstream: str = DEFAULT_JETSTREAM,
    subject_prefix: str | _Keep = KEEP,
    max_bytes: int | _Keep | None = KEEP,
    max_age: float | _Keep | None = KEEP,
    max_msgs: int | _Keep | None = KEEP,
    discard: str | _Keep = KEEP,
    memory: bool | _Keep = KEEP,
    connect_timeout: float = 5.0,
    connect_options: Mapping[str, Any] | None = None,
    replicas: int | _Keep = KEEP,
    user: str | None = None,
    password: str | None = None,
    token: str | None = None,
    creds: Path | None = None,
    tls_ca: Path | None = None,
    tls_cert: Path | None = None,
    tls_key: Path | None = None,
    ready_timeout: float = 10.0,
    tls_handshake_first: bool = False,
    allow_insecure: bool = False,
) -> StreamInfo:
    """Create (or update) the JetStream stream that takes ``<subject_prefix>.>``; return
    its info as JetStream now has it.

    Its limits bound what the fleet keeps: with ``discard="old"`` the oldest
    messages go when a limit is hit (readers then see a [`Gap`][aperf.fleet.Gap]), with
    ``discard="new"`` publishing stops instead (sinks stop taking from their
    streams, and the kernels count the drops). File storage unless ``memory``.
    ``replicas`` is how many servers of a JetStream cluster store every message
    (give 3 on a cluster: an R1 stream dies with its node). ``None`` for a limit
    means no limit.

    Updating an existing stream changes only what is given: an argument left out
    keeps the stream's value (re-running it with only ``max_bytes`` does not turn an
    R3 stream into R1, nor drop its ``max_age``). A new stream gets
    ``subject_prefix="aperf"``, ``max_bytes`` 1 GiB, no age or message limit,
    ``discard="old"``, file storage and 1 replica. ``user``, ``password``,
    ``token``, ``creds``, the ``tls_*`` files, ``tls_handshake_first`` and
    ``allow_insecure`` are as for
    [`JetStreamSink`][aperf.fleet.JetStreamSink]; ``ready_timeout`` bounds how long
    it waits for a cluster that is not serving. ``servers`` may be a
    [`NatsOptions`][aperf.fleet.NatsOptions] holding all of those instead.
    """
    if discard not in ("old", "new", KEEP):
        raise ValueError(f"discard must be 'old' or 'new', not {discard!r}")
    if replicas is not KEEP and (
        isinstance(replicas, bool) or not isinstance(replicas, int) or not 1 <= replicas <= 5
    ):
        raise ValueError(f"replicas must be an int in 1..5, not {replicas!r}")
    nats_ = resolve_options(
        servers, connect_options=connect_options, user=user, password=password,
        token=token, creds=creds, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key,
        tls_handshake_first=tls_handshake_first, allow_insecure=allow_insecure,
        connect_timeout=connect_timeout, ready_timeout=ready_timeout,
    )
    ready_timeout = nats_.ready_timeout
    refusals = Refusals()
    client = await connect(
        nats_.servers, timeout=nats_.connect_timeout, name="aperf-create-stream",
        options=nats_.connect_options, auth=auth(nats_), refusals=refusals,
    )
    try:
        js = client.jetstream()

        async def current() -> StreamConfig | None:
            try:
                return (await js.stream_info(jetstream)).config
            except nats.js.errors.NotFoundError:
                return None

        old = await ready(client, current, timeout=ready_timeout, refusals=refusals)
        changes: dict[str, Any] = {}
        if subject_prefix is not KEEP:
            changes["subjects"] = [f"{subject_prefix}.>"]
        if max_bytes is not KEEP:
            changes["max_bytes"] = max_bytes if max_bytes is not None else -1
        if max_age is not KEEP:
            changes["max_age"] = max_age
        if max_msgs is not KEEP:
            changes["max_msgs"] = max_msgs if max_msgs is not None else -1
        if discard is not KEEP:
            changes["discard"] = DiscardPolicy.OLD if discard == "old" else DiscardPolicy.NEW
        if memory is not KEEP:
            changes["storage"] = StorageType.MEMORY if memory else StorageType.FILE
        if replicas is not KEEP:
            changes["num_replicas"] = replicas
        if old is None:
            config = StreamConfig(
                name=jetstream, subjects=[f"{DEFAULT_PREFIX}.>"], max_bytes=1 << 30,
                max_msgs=-1, discard=DiscardPolicy.OLD, storage=StorageType.FILE,
                num_replicas=1, duplicate_window=120.0,
            )
            config = dataclasses.replace(config, **changes)
            apply = js.add_stream
        else:
            config = dataclasses.replace(old, **changes)
            apply = js.update_stream
        try:
            info = await ready(client, lambda: apply(config), timeout=ready_timeout,
                               refusals=refusals)
        except nats.js.errors.APIError as exc:  # 400 bad config, 500 e.g. storage change
            raise FleetConfigError(
                "jetstream", f"JetStream refused to {'create' if old is None else 'update'} "
                f"stream {jetstream!r}: {exc.description}"
            ) from None
        log.info("JetStream stream ready", stream=jetstream, created=old is None,
                 replicas=info.config.num_replicas, subjects=info.config.subjects)
        return info
    finally:
        await client.close()
