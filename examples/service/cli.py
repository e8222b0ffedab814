"""``python -m examples.service``: options, logging, start-up checks, and uvicorn."""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
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
from .app import DEFAULT_REPLAY, HEARTBEAT_SECONDS, SHUTDOWN_SECONDS, Settings, create_app
from .hub import Hub

PROG = "python -m examples.service"
T = TypeVar("T", int, float)


class Server(uvicorn.Server):
    """uvicorn's server, ending the event streams as soon as a stop is requested.

    uvicorn shuts down by waiting for open responses to finish before it runs
    the lifespan's shutdown; event streams never finish on their own.
    """

    def __init__(self, config: uvicorn.Config, hub: Hub) -> None:
        super().__init__(config)
        self.hub = hub

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.hub.close_threadsafe()
        super().handle_exit(sig, frame)


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


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = Parser(
        prog=PROG,
        description="Serve exec/exit events (SSE), a live page, Prometheus metrics and health "
        "over HTTP.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=port_number, default=8000)
    parser.add_argument("-d", "--duration", type=non_negative, default=0, metavar="MS",
                        help="report only exits of processes that ran at least MS milliseconds")
    parser.add_argument("--pages", type=positive_power_of_two, default=DEFAULT_PAGES, metavar="N",
                        help=f"ring size per CPU in 4 KiB pages (default {DEFAULT_PAGES})")
    parser.add_argument("--wakeup", choices=WAKEUPS, default=DEFAULT_WAKEUP)
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


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)

    def fail(message: str) -> int:
        print(f"service: {message}", file=sys.stderr, flush=True)
        return 1

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

    settings = Settings(
        object_path=args.object, min_duration_ms=args.duration, pages=args.pages,
        wakeup=args.wakeup, replay=args.replay, heartbeat=args.heartbeat,
        shutdown_timeout=args.shutdown_timeout,
    )
    app = create_app(settings)
    config = uvicorn.Config(
        app, host=args.host, port=args.port, loop=args.loop, lifespan="on",
        log_config=None, log_level=args.log_level,
        # sse-starlette ends the streams of clients that stopped reading after
        # --shutdown-timeout (create_app); their sockets, which cannot drain, are
        # dropped a second later, when uvicorn stops waiting for connections. Were
        # uvicorn first, it would cancel those responses, and log tracebacks.
        timeout_graceful_shutdown=args.shutdown_timeout + 1,
    )
    server = Server(config, app.state.hub)
    # Once it has shut down, uvicorn raises again the signal that stopped it, with
    # the handlers that were in place before it started: make those ignore it, so
    # that a requested stop ends with status 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: None)
    # uvicorn exits (status 3) when the startup fails: said below, in one line, status 1.
    with listener, contextlib.suppress(SystemExit):
        server.run(sockets=[listener])
    if server.started:
        return 0
    error = app.state.source.error
    if error is not None:
        return fail(load_failure(error))
    return fail("the server did not start (the log on stdout says why)")
