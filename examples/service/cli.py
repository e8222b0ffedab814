"""``python -m examples.service``: options, logging, start-up checks, and uvicorn."""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import signal
import socket
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn, TypeVar

import structlog
import uvicorn

import aperf

from ..bootstrap_legacy import (
    DEFAULT_OBJECT,
    DEFAULT_PAGES,
    DEFAULT_WAKEUP,
    WAKEUPS,
    SetupError,
    ensure_tracefs,
    missing_privileges,
    non_negative,
    positive_power_of_two,
)
from .access import (
    SESSION_ROTATE,
    TokenFileError,
    host_pattern,
    read_token,
    runtime_directory,
    served_hosts,
    write_new_token,
)
from .app import (
    DEFAULT_REPLAY,
    HEARTBEAT_SECONDS,
    MAX_CLIENTS,
    SHUTDOWN_SECONDS,
    Settings,
    create_app,
    with_security_headers,
)
from .connections import (
    BACKLOG,
    HEADER_TIMEOUT,
    MAX_CONNECTIONS,
    DescriptorLimitError,
    reserve_descriptors,
)
from .source import TraceSource

PROG = "python -m examples.service"
T = TypeVar("T", int, float)

log = structlog.get_logger("examples.service")

WHO_SEES_WHAT = """\
who can see what:
  Every event names a process of this machine, any user's: its name, pid and parent, the
  file it ran, its exit code and how long it ran. Whoever can read /events (the page at /
  reads it) sees all of that; /health and /metrics tell counts (events, lost, clients).
  - By default, only those who hold a token that the service makes at each start and
    writes (mode 0600) to $RUNTIME_DIRECTORY/token-HOST-PORT (/run/aperf-service/ as
    root); on a terminal it prints the URL with the token once. With --token-file PATH,
    the token is PATH's content (a file no group or others may access). Send
    "Authorization: Bearer TOKEN", or open /?token=TOKEN once in a browser: a cookie
    then holds a session id (never the token) that changes every --session-rotate
    seconds. Only /static/ (the page's script and stylesheet, no data) is served to
    anyone.
  - With --no-token, every program and every user that can reach the port: on the
    default 127.0.0.1, everybody on this machine (other users and containers that share
    its network included), whatever hidepid= hides in /proc.
  - Whatever the token, a request whose Host header is not the --host address,
    localhost or an --allowed-host gets 400: a web page elsewhere cannot read the
    service through DNS rebinding.
"""


class Server(uvicorn.Server):
    """uvicorn's server, ending the event streams as soon as a stop is requested.

    uvicorn shuts down by waiting for open responses to finish before it runs
    the lifespan's shutdown; event streams never finish on their own. The source
    stops reading, publishes what it read, then closes the hub, which ends them.
    """

    def __init__(self, config: uvicorn.Config, source: TraceSource, url: str,
                 token: GeneratedToken | None = None) -> None:
        super().__init__(config)
        self.source = source
        self.url = url
        self.token = token

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)  # uvicorn says nothing of given sockets
        if self.started:
            log.info("listening", url=self.url)
            if self.token is not None:
                self.token.announce(self.url)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.source.stop_threadsafe()
        super().handle_exit(sig, frame)


class GeneratedToken:
    """The token made at start-up: in a private file while the service runs, said once."""

    def __init__(self, host: str, port: int) -> None:
        self.path, self.value = write_new_token(runtime_directory(), f"token-{host}-{port}")

    def announce(self, url: str) -> None:
        """The URL with the token on a terminal (stderr); elsewhere only where the token is.

        Never in the log: stdout (and stderr, under systemd) goes to the journal, which
        more people read than the token file.
        """
        log.info("token made", token_file=str(self.path))
        if sys.stderr.isatty():
            print(f"\n    Open {url}?token={self.value}\n    (the token is also in "
                  f"{self.path}, for curl: -H \"Authorization: Bearer $(cat {self.path})\")\n",
                  file=sys.stderr, flush=True)

    def remove(self) -> None:
        """Delete the file (the token dies with the service)."""
        with contextlib.suppress(FileNotFoundError):
            if read_text_if_ours(self.path) == self.value:
                self.path.unlink()


def read_text_if_ours(path: Path) -> str | None:
    """The token in ``path`` if it is still a file of this user's, else None."""
    try:
        if path.lstat().st_uid != os.geteuid():
            return None
        return read_token(path)
    except (OSError, TokenFileError):
        return None


class NoQueryStrings(logging.Filter):
    """Cuts the query string off every path in uvicorn's access lines: ``?token=`` stays out.

    Every string argument of the record loses what follows a ``?``; the line keeps the
    method, the path, the status and the client's address.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "uvicorn.access" and isinstance(record.args, tuple):
            record.args = tuple(a.partition("?")[0] if isinstance(a, str) else a
                                for a in record.args)
        return True


def configure_logging(level: str) -> None:
    """JSON lines on stdout, for structlog loggers (aperf's too) and the standard library's."""
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_logger_name,
        structlog.stdlib.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *shared,
            structlog.stdlib.PositionalArgumentsFormatter(),
            structlog.processors.StackInfoRenderer(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stdout)
    handler.addFilter(NoQueryStrings())
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(default=repr),
        ],
    ))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


# --- options -----------------------------------------------------------------------------------


class Parser(argparse.ArgumentParser):
    """Usage errors in one line on stderr and exit status 1, like every start-up failure."""

    def error(self, message: str) -> NoReturn:
        self.exit(1, f"service: {message} (--help lists the options)\n")


def checked(
    convert: Callable[[str], T], ok: Callable[[T], bool], what: str, name: str
) -> Callable[[str], T]:
    """An argparse ``type``: ``convert`` the text, and refuse values that are not ``ok``."""

    def parse(text: str) -> T:
        value = convert(text)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{text} is not {what}")
        return value

    parse.__name__ = name  # argparse says "invalid <name> value" when convert fails
    return parse


port_number = checked(int, lambda v: 1 <= v <= 65535, "a TCP port (1 to 65535)", "port")
positive_seconds = checked(float, lambda v: v > 0 and math.isfinite(v),
                           "a positive number of seconds", "seconds")
seconds = checked(float, lambda v: v >= 0 and math.isfinite(v),
                  "a number of seconds (0 or more)", "seconds")
replay_window = checked(int, lambda v: v >= 2, "a number of events, 2 or more", "count")
positive_count = checked(int, lambda v: v >= 1, "a positive number", "count")


def allowed_host(text: str) -> str:
    try:
        return host_pattern(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# Options of sessions and connections (access.py, connections.py): flag, default, meaning.
LIMITS: tuple[tuple[str, float, str], ...] = (
    ("--session-rotate", SESSION_ROTATE, "seconds after which a browser's session id is "
     "replaced by a new one"),
    ("--max-connections", MAX_CONNECTIONS, "connections held at once; one more pushes out the "
     "oldest one yet to send a request"),
    ("--max-clients", MAX_CLIENTS, "event streams at once, fewer than --max-connections; one "
     "more gets 503"),
    ("--header-timeout", HEADER_TIMEOUT, "seconds a connection has to send a request head"),
)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = Parser(
        prog=PROG,
        description="Serve exec/exit events (SSE), a live page, Prometheus metrics and health "
        "over HTTP.",
        epilog=WHO_SEES_WHAT, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1: this machine only)")
    parser.add_argument("--allowed-host", action="append", type=allowed_host, default=[],
                        metavar="NAME", help="also serve requests for this Host (a name the "
                        "service is reached by, *.domain, or an address); repeatable")
    access = parser.add_mutually_exclusive_group()
    access.add_argument("--token-file", type=Path, metavar="PATH",
                        help="the token is PATH's content, not one made at start-up (see "
                        "below)")
    access.add_argument("--no-token", action="store_true",
                        help="serve without a token, to anyone who reaches the port")
    parser.add_argument("--secure-cookie", action="store_true",
                        help="mark the session cookie Secure: browsers send it over HTTPS only "
                        "(behind a TLS proxy)")
    for flag, default, what in LIMITS:
        parser.add_argument(flag, type=positive_seconds if isinstance(default, float) else
                            positive_count, default=default,
                            metavar="S" if isinstance(default, float) else "N",
                            help=f"{what} (default {default:g})")
    parser.add_argument("--port", type=port_number, default=8000)
    parser.add_argument("-d", "--duration", type=non_negative, default=0, metavar="MS",
                        help="report only exits of processes that ran at least MS milliseconds")
    parser.add_argument("--pages", type=positive_power_of_two, default=DEFAULT_PAGES, metavar="N",
                        help=f"ring size per CPU in 4 KiB pages (default {DEFAULT_PAGES})")
    parser.add_argument("--wakeup", choices=WAKEUPS, default=DEFAULT_WAKEUP)
    parser.add_argument("--unordered", action="store_true",
                        help="publish events in ring order instead of in time order across "
                        "CPUs (which holds an event up to 0.1 s)")
    parser.add_argument("--replay", type=replay_window, default=DEFAULT_REPLAY, metavar="N",
                        help="events kept for clients that reconnect (Last-Event-ID) or read "
                        f"slowly (default {DEFAULT_REPLAY})")
    parser.add_argument("--heartbeat", type=positive_seconds, default=HEARTBEAT_SECONDS,
                        metavar="S", help="seconds between keep-alive comments on event streams "
                        f"(default {HEARTBEAT_SECONDS:g})")
    parser.add_argument("--shutdown-timeout", type=seconds, default=SHUTDOWN_SECONDS, metavar="S",
                        help="seconds clients get at shutdown to take what is left for them; "
                        "those that stopped reading are then cut off "
                        f"(default {SHUTDOWN_SECONDS:g})")
    parser.add_argument("--send-buffer", type=non_negative, default=0, metavar="BYTES",
                        help="kernel send buffer of each connection (default: autotuned, up "
                        "to megabytes); smaller makes a stalled client fall out of the replay "
                        "window sooner")
    parser.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto")
    parser.add_argument("--log-level", default="info",
                        choices=("debug", "info", "warning", "error"))
    parser.add_argument("--object", type=Path, default=DEFAULT_OBJECT, metavar="PATH")
    return parser.parse_args(argv)


# --- start-up failures, each said in one line ---------------------------------------------------


def first_line(text: str) -> str:
    return text.strip().split("\n", 1)[0]


def load_failure(exc: BaseException) -> str:
    """Why the tracer did not load, in one line (the JSON log has the rest)."""
    if isinstance(exc, aperf.ObjectFileError):
        return f"cannot open BPF object {exc.path}: {first_line(exc.detail)}"
    if isinstance(exc, aperf.VerifierError):
        return f"the verifier rejected {exc.program or 'a program'} of {exc.path} (see the log)"
    if isinstance(exc, aperf.MissingPrivilegesError):
        return f"the kernel refused ({exc.function}(): {exc.strerror}); {exc.hint}"
    if isinstance(exc, PermissionError):
        return f"{exc.strerror}: {exc.filename}" if exc.filename else str(exc)
    return f"the tracer did not start: {first_line(str(exc)) or type(exc).__name__}"


def listen(host: str, port: int, send_buffer: int) -> socket.socket:
    """The listening socket, bound here so that a taken port is said in one line."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if send_buffer:
            # Accepted connections inherit the listener's (fixed) buffer size.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        why = exc.strerror or str(exc)
        raise SetupError(f"cannot listen on {host}:{port}: {why}") from None
    return sock


def listen_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}/" if sock.family == socket.AF_INET6 else \
        f"http://{host}:{port}/"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)

    def fail(message: str, status: int = 1) -> int:
        print(f"service: {message}", file=sys.stderr, flush=True)
        return status

    try:
        hosts = served_hosts(args.host, args.allowed_host)
    except ValueError as exc:
        return fail(f"argument --host: {exc}")
    if args.max_clients >= args.max_connections:
        return fail(f"--max-clients {args.max_clients} must be less than --max-connections "
                    f"{args.max_connections}: event streams would leave no connection for "
                    "the other routes")
    token = None
    if args.token_file is not None:
        try:
            token = read_token(args.token_file)
        except TokenFileError as exc:
            return fail(str(exc))
    try:
        reserve_descriptors(args.max_connections)
    except DescriptorLimitError as exc:
        return fail(str(exc))

    # What usually goes wrong is said in one line, before the server starts.
    reason = missing_privileges()
    if reason is not None:
        return fail(reason)
    if not args.object.is_file():
        return fail(f"BPF object {args.object} does not exist; build it with: make -C bpf")
    try:
        listener = listen(args.host, args.port, args.send_buffer)
    except SetupError as exc:
        return fail(str(exc))
    configure_logging(args.log_level)
    try:
        ensure_tracefs()
    except SetupError as exc:
        listener.close()
        return fail(str(exc))
    generated = None
    if token is None and not args.no_token:
        try:
            generated = GeneratedToken(args.host, args.port)
        except TokenFileError as exc:
            listener.close()
            return fail(str(exc))
        token = generated.value
    elif args.no_token:
        log.warning("serving without a token: whoever reaches the port reads every event",
                    host=args.host, port=args.port)

    settings = Settings(
        object_path=args.object, min_duration_ms=args.duration, pages=args.pages,
        wakeup=args.wakeup, ordered=not args.unordered, replay=args.replay,
        heartbeat=args.heartbeat,
        shutdown_timeout=args.shutdown_timeout, allowed_hosts=tuple(hosts), token=token,
        session_rotate=args.session_rotate, secure_cookie=args.secure_cookie,
        max_clients=args.max_clients, max_connections=args.max_connections,
        header_timeout=args.header_timeout,
    )
    app = create_app(settings)
    config = uvicorn.Config(
        with_security_headers(app), host=args.host, port=args.port, loop=args.loop,
        lifespan="on", log_config=None, log_level=args.log_level,
        # h11 under the guard: a deadline for request heads, a cap on connections
        # (connections.py); heads of at most h11's 16 KiB.
        http=app.state.guard.protocol(), backlog=BACKLOG,
        # sse-starlette ends the streams of clients that stopped reading after
        # --shutdown-timeout (create_app); their sockets, which cannot drain, are
        # dropped a second later, when uvicorn stops waiting for connections. Were
        # uvicorn first, it would cancel those responses, and log tracebacks.
        timeout_graceful_shutdown=args.shutdown_timeout + 1,
    )
    server = Server(config, app.state.source, listen_url(listener), generated)
    # Once it has shut down, uvicorn raises again the signal that stopped it, with
    # the handlers that were in place before it started: make those ignore it, so
    # that a requested stop ends with status 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: None)
    # uvicorn exits (status 3) when the startup fails: said below, in one line, status 1.
    try:
        with listener, contextlib.suppress(SystemExit):
            server.run(sockets=[listener])
    finally:
        if generated is not None:
            generated.remove()
    if server.started:
        return 0
    error = app.state.source.error
    if error is not None:
        return fail(load_failure(error))
    return fail("the server did not start (the log on stdout says why)")
