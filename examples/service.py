"""A web service that embeds aperf: live exec/exit events, Prometheus metrics, health.

It loads the tracer of ``examples/bootstrap_legacy.py`` when the application
starts and reads its perf stream in the background for the application's whole
lifetime (a Starlette lifespan holding an anyio task group)::

    $ sudo python -m examples.service --host 127.0.0.1 --port 8000
    $ curl -N http://127.0.0.1:8000/events    # Server-Sent Events, one JSON event each
    $ curl http://127.0.0.1:8000/metrics      # Prometheus text format
    $ curl http://127.0.0.1:8000/health

Every ``/events`` client has its own bounded queue. The reader never waits for
a client: when a client's queue is full its events are dropped and counted, and
the client is told how many it missed (an ``event: dropped`` message) as soon
as it catches up. A slow client therefore never slows the others, nor the BPF
stream, whose own bounded queue and the kernel's lost counters are the next
lines of defence (docs/service.md).

SIGTERM or Ctrl-C ends every event stream, stops the server, closes the perf
stream (the rings are freed) and the BPF object (the programs are detached),
and exits with status 0. Logs are JSON lines on stdout, written by structlog,
for aperf's and uvicorn's loggers alike.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import itertools
import json
import logging
import signal
import socket
import sys
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import anyio
import structlog
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

import aperf

from .bootstrap_legacy import (
    DEFAULT_OBJECT,
    DEFAULT_PAGES,
    DEFAULT_WAKEUP,
    WAKEUPS,
    SetupError,
    ensure_tracefs,
    json_record,
    missing_privileges,
    non_negative,
    positive_power_of_two,
    tracer_object,
)

log = structlog.get_logger("examples.service")

DEFAULT_CLIENT_QUEUE = 1024
MAX_PUBLISH_BATCH = 256  # events handed to the clients between two yields to the loop
MAX_WRITE_BATCH = 256  # SSE messages written to a socket at once
HEARTBEAT_SECONDS = 15.0
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class Settings:
    object_path: Path = DEFAULT_OBJECT
    min_duration_ms: int = 0
    pages: int = DEFAULT_PAGES
    wakeup: str = DEFAULT_WAKEUP
    client_queue: int = DEFAULT_CLIENT_QUEUE
    heartbeat: float = HEARTBEAT_SECONDS


def sse_message(data: str, event: str | None = None) -> str:
    """One Server-Sent Events message (``data`` must be a single line, as JSON is)."""
    return (f"event: {event}\n" if event else "") + f"data: {data}\n\n"


# --- fan-out to the clients ----------------------------------------------------------------

_CLOSE = object()  # the last item a client's queue ever holds


class Client:
    """One ``/events`` connection: a bounded queue of SSE messages, and what it missed."""

    def __init__(self, client_id: int, peer: str, queue_size: int, heartbeat: float) -> None:
        self.id = client_id
        self.peer = peer
        self.queue: asyncio.Queue[Any] = asyncio.Queue(queue_size)
        self.heartbeat = heartbeat
        self.dropped = 0  # events never queued for this client, in total
        self.missed = 0  # of which the client has not been told yet
        self.closing = False

    def offer(self, message: str) -> None:
        """Queue a message without ever waiting: when the queue is full, drop and count it."""
        queue = self.queue
        if self.missed and not queue.full():
            # The notice goes in order: after what was queued before the drops.
            queue.put_nowait(self._missed_notice())
        if queue.full():
            self.dropped += 1
            self.missed += 1
        else:
            queue.put_nowait(message)

    def _missed_notice(self) -> str:
        missed, self.missed = self.missed, 0
        return sse_message(json.dumps({"missed": missed, "dropped": self.dropped}), "dropped")

    def close(self) -> None:
        """End this client's stream once it has written what its queue holds."""
        self.closing = True
        if not self.queue.full():
            self.queue.put_nowait(_CLOSE)  # wakes the writer if it waits for messages

    async def _next_chunk(self) -> str | None:
        """What to write next: queued messages, a notice or a heartbeat; None at the end."""
        queue = self.queue
        while True:
            if queue.empty():
                if self.missed:
                    return self._missed_notice()
                if self.closing:
                    return None
                with anyio.move_on_after(self.heartbeat) as idle:
                    messages = [await queue.get()]
                if idle.cancelled_caught:
                    return ": keep-alive\n\n"  # also how a vanished peer gets noticed
            else:
                messages = []
            while len(messages) < MAX_WRITE_BATCH and not queue.empty():
                messages.append(queue.get_nowait())
            if messages[-1] is _CLOSE:
                messages.pop()
                self.closing = True
            if messages:
                return "".join(messages)

    async def chunks(self) -> AsyncIterator[str]:
        yield "retry: 2000\n: connected\n\n"
        while (chunk := await self._next_chunk()) is not None:
            yield chunk


class Hub:
    """Hands every event to every connected client; never waits for any of them."""

    def __init__(self, queue_size: int, heartbeat: float) -> None:
        self.queue_size = queue_size
        self.heartbeat = heartbeat
        self.clients: dict[int, Client] = {}
        self.closed = False
        self.published = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count(1)
        self._dropped_by_gone = 0  # drops counted by clients that have disconnected

    def connect(self, peer: str) -> Client:
        client = Client(next(self._ids), peer, self.queue_size, self.heartbeat)
        self.clients[client.id] = client
        log.info("client connected", client=client.id, peer=peer, clients=len(self.clients))
        return client

    def disconnect(self, client: Client) -> None:
        if self.clients.pop(client.id, None) is not None:
            self._dropped_by_gone += client.dropped
            log.info("client disconnected", client=client.id, peer=client.peer,
                     dropped=client.dropped, clients=len(self.clients))

    def publish(self, message: str) -> None:
        if self.closed:
            return
        self.published += 1
        for client in self.clients.values():
            client.offer(message)

    @property
    def dropped(self) -> int:
        return self._dropped_by_gone + sum(c.dropped for c in self.clients.values())

    def close(self) -> None:
        """End every event stream once it has written what is queued (at shutdown).

        Idempotent; call it in the loop's thread (see close_threadsafe).
        """
        if not self.closed:
            self.closed = True
            for client in self.clients.values():
                client.close()

    def close_threadsafe(self) -> None:
        """close() from a signal handler or another thread."""
        loop = self.loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self.close)


class EventStreamResponse(Response):
    """``text/event-stream`` of one client, for as long as the client and the hub last.

    The client is registered only once the response runs, and always removed,
    however the response ends (the peer left, the hub closed, cancellation).
    """

    media_type = "text/event-stream"

    def __init__(self, hub: Hub, peer: str) -> None:
        # Not Response.__init__: it would render an empty body and a Content-Length: 0.
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.hub = hub
        self.peer = peer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        client = self.hub.connect(self.peer)
        try:
            async with anyio.create_task_group() as tg:

                async def until_disconnect() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(until_disconnect)
                await send({"type": "http.response.start", "status": 200,
                            "headers": self.raw_headers})
                async for chunk in client.chunks():
                    await send({"type": "http.response.body", "body": chunk.encode(),
                                "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                tg.cancel_scope.cancel()
        except anyio.get_cancelled_exc_class():
            if not self.hub.closed:
                raise
            # Shutting down, and this client stopped reading: its writes wait for
            # room in a full socket that never comes, so uvicorn cancelled us at its
            # graceful shutdown timeout. Say so once, rather than as a traceback.
            log.warning("client cut off at shutdown: it stopped reading", client=client.id,
                        peer=client.peer, queued=client.queue.qsize(), dropped=client.dropped)
        finally:
            self.hub.disconnect(client)


# --- the BPF side ----------------------------------------------------------------------------


class TraceSource:
    """The tracer's BPF object and perf stream, published to the hub while the app runs."""

    def __init__(self, settings: Settings, hub: Hub) -> None:
        self.settings = settings
        self.hub = hub
        self.stream: aperf.PerfStream | None = None
        self.state = "starting"  # -> running -> stopping -> stopped, or failed

    @property
    def stream_open(self) -> bool:
        return self.state == "running" and self.stream is not None and not self.stream.closed

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[TraceSource]:
        """Load and attach, open the stream, read it in a background task; undo it all."""
        s = self.settings
        try:
            with tracer_object(s.object_path, s.min_duration_ms * 1_000_000) as obj:
                async with aperf.PerfStream(
                    obj.maps["perf_buffer"], pages=s.pages, decoder="event", wakeup=s.wakeup
                ) as stream, anyio.create_task_group() as tg:
                    self.stream = stream
                    tg.start_soon(self._pump, stream)
                    self.state = "running"
                    try:
                        yield self
                    finally:
                        self.state = "stopping"
                        # Closing frees the rings; _pump gets what was already read,
                        # then its loop ends and the task group can exit.
                        await stream.aclose()
        except BaseException:
            self.state = "failed"
            raise
        self.state = "stopped"

    async def _pump(self, stream: aperf.PerfStream) -> None:
        """Publish every event until the stream closes. Never raises into the task group."""
        # At most half a client queue per batch: a client that keeps up always has room.
        batch_size = min(MAX_PUBLISH_BATCH, max(1, self.hub.queue_size // 2))
        while True:
            try:
                async for batch in stream.batches(batch_size):
                    self._publish(batch)
                    # Let the clients' writers take what was just queued before the
                    # next batch: the loop runs every task made ready meanwhile.
                    await anyio.sleep(0)
                return  # the stream was closed
            except aperf.BrokenRingError as exc:
                # One CPU's ring is corrupt and was stopped; the others go on.
                # /health reports it (503), /metrics has aperf_ring_broken.
                log.error("perf ring broken", cpu=exc.cpu, error=str(exc))
            except Exception:
                # The service stays up (the metrics tell what happened) but is unhealthy.
                self.state = "failed"
                log.exception("perf stream failed")
                return

    def _publish(self, batch: list[Any]) -> None:
        hub = self.hub
        now = datetime.datetime.now().astimezone()
        for item in batch:
            match item:
                case aperf.Sample():
                    hub.publish(sse_message(json.dumps(json_record(item, now))))
                case aperf.Lost(cpu=cpu, count=count):
                    log.warning("events lost", cpu=cpu, count=count)
                    hub.publish(sse_message(json.dumps({"cpu": cpu, "count": count}), "lost"))
                case aperf.BadSample(cpu=cpu, error=error):
                    log.warning("bad sample", cpu=cpu, error=str(error))

    def healthy(self) -> bool:
        if not self.stream_open:
            return False
        assert self.stream is not None
        return not any(c.broken for c in self.stream.statistics().cpus)


# --- the application ---------------------------------------------------------------------------


def _label_value(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict[str, object]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_label_value(v)}"' for k, v in labels.items()) + "}"


def render_metrics(source: TraceSource, hub: Hub) -> str:
    """The Prometheus text exposition format (version 0.0.4)."""
    lines: list[str] = []

    def family(
        name: str, kind: str, text: str, samples: Iterable[tuple[dict[str, object], float]]
    ) -> None:
        lines.append(f"# HELP {name} {text}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(f"{name}{_labels(labels)} {value}" for labels, value in samples)

    family("aperf_stream_open", "gauge", "1 while the perf stream is open and read.",
           [({}, int(source.stream_open))])
    if source.stream is not None:
        stats = source.stream.statistics()
        per_cpu = [
            ("aperf_samples_total", "samples", "Samples read from each CPU's perf ring."),
            ("aperf_lost_total", "lost", "Samples the kernel dropped because a ring was full."),
            ("aperf_bytes_total", "bytes", "Bytes read from each CPU's perf ring."),
            ("aperf_wakeups_total", "wakeups", "Kernel wakeups of the reader per CPU."),
            ("aperf_decode_errors_total", "decode_errors", "Samples that did not decode."),
        ]
        for name, field, text in per_cpu:
            family(name, "counter", text,
                   [({"cpu": c.cpu}, getattr(c, field)) for c in stats.cpus])
        family("aperf_stream_pending", "gauge", "Events read from the rings, not yet taken.",
               [({}, stats.pending)])
        family("aperf_stream_max_pending", "gauge", "Bound of the stream's queue.",
               [({}, stats.max_pending)])
        family("aperf_ring_bytes", "gauge", "Data bytes of each CPU's ring.",
               [({}, stats.ring_bytes)])
        family("aperf_ring_broken", "gauge", "1 if the CPU's ring was stopped as corrupt.",
               [({"cpu": c.cpu}, int(c.broken)) for c in stats.cpus])
    clients = list(hub.clients.values())
    family("aperf_sse_clients", "gauge", "Connected /events clients.", [({}, len(clients))])
    family("aperf_sse_events_published_total", "counter",
           "Messages handed to the /events clients.", [({}, hub.published)])
    family("aperf_sse_dropped_total", "counter",
           "Messages dropped for slow /events clients, past clients included.",
           [({}, hub.dropped)])
    family("aperf_sse_client_dropped_total", "counter",
           "Messages dropped for each connected /events client (its queue was full).",
           [({"client": c.id, "peer": c.peer}, c.dropped) for c in clients])
    family("aperf_sse_client_queue_depth", "gauge",
           "Messages waiting in each connected client's queue.",
           [({"client": c.id, "peer": c.peer}, c.queue.qsize()) for c in clients])
    return "\n".join(lines) + "\n"


def create_app(settings: Settings) -> Starlette:
    hub = Hub(settings.client_queue, settings.heartbeat)
    source = TraceSource(settings, hub)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        hub.loop = asyncio.get_running_loop()
        async with source.running():
            assert source.stream is not None
            log.info("tracer running", cpus=source.stream.cpus, pages=settings.pages,
                     wakeup=settings.wakeup, min_duration_ms=settings.min_duration_ms)
            try:
                yield
            finally:
                hub.close()  # usually done already, at the signal
        stats = source.stream.statistics()
        log.info("tracer stopped", samples=stats.samples, lost=stats.lost,
                 published=hub.published, dropped=hub.dropped)

    async def events(request: Request) -> Response:
        if hub.closed or not source.stream_open:
            return JSONResponse({"error": "the event stream is not available"}, status_code=503)
        peer = f"{request.client.host}:{request.client.port}" if request.client else "unknown"
        return EventStreamResponse(hub, peer)

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(render_metrics(source, hub), media_type=PROMETHEUS_TEXT)

    async def health(request: Request) -> Response:
        ok = source.healthy()
        body: dict[str, Any] = {
            "status": "ok" if ok else "degraded" if source.stream_open else source.state,
            "stream_open": source.stream_open,
            "clients": len(hub.clients),
        }
        if source.stream is not None:
            stats = source.stream.statistics()
            body.update(samples=stats.samples, lost=stats.lost,
                        broken_cpus=[c.cpu for c in stats.cpus if c.broken])
        return JSONResponse(body, status_code=200 if ok else 503)

    app = Starlette(
        routes=[Route("/events", events), Route("/metrics", metrics), Route("/health", health)],
        lifespan=lifespan,
    )
    app.state.hub = hub
    app.state.source = source
    return app


# --- running it ------------------------------------------------------------------------------


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


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m examples.service",
        description="Serve exec/exit events (SSE), Prometheus metrics and health over HTTP.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("-d", "--duration", type=non_negative, default=0, metavar="MS",
                        help="report only exits of processes that ran at least MS milliseconds")
    parser.add_argument("--pages", type=positive_power_of_two, default=DEFAULT_PAGES, metavar="N",
                        help=f"ring size per CPU in 4 KiB pages (default {DEFAULT_PAGES})")
    parser.add_argument("--wakeup", choices=WAKEUPS, default=DEFAULT_WAKEUP)
    parser.add_argument("--client-queue", type=int, default=DEFAULT_CLIENT_QUEUE, metavar="N",
                        help="messages buffered per /events client before dropping "
                        f"(default {DEFAULT_CLIENT_QUEUE})")
    parser.add_argument("--heartbeat", type=float, default=HEARTBEAT_SECONDS, metavar="S",
                        help="seconds between keep-alive comments on idle event streams")
    parser.add_argument("--shutdown-timeout", type=float, default=2.0, metavar="S",
                        help="seconds clients get at shutdown to take what is queued for them; "
                        "those that stopped reading are then cut off (default 2)")
    parser.add_argument("--send-buffer", type=int, default=0, metavar="BYTES",
                        help="kernel send buffer of each connection (default: autotuned, up "
                        "to megabytes); smaller makes stalled clients reach their queue bound, "
                        "and drop, sooner and hold less memory")
    parser.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto")
    parser.add_argument("--log-level", default="info",
                        choices=("debug", "info", "warning", "error"))
    parser.add_argument("--object", type=Path, default=DEFAULT_OBJECT, metavar="PATH")
    args = parser.parse_args(argv)
    if args.client_queue < 2:
        parser.error("--client-queue must be at least 2")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)

    def fail(message: str) -> int:
        print(f"service: {message}", file=sys.stderr, flush=True)
        return 1

    # What usually goes wrong is said in one line, before the server starts.
    reason = missing_privileges()
    if reason is not None:
        return fail(reason)
    if not args.object.exists():
        return fail(f"BPF object {args.object} does not exist; build it with: make -C bpf")
    configure_logging(args.log_level)
    try:
        ensure_tracefs()
    except SetupError as exc:
        return fail(str(exc))

    settings = Settings(
        object_path=args.object, min_duration_ms=args.duration, pages=args.pages,
        wakeup=args.wakeup, client_queue=args.client_queue, heartbeat=args.heartbeat,
    )
    app = create_app(settings)
    config = uvicorn.Config(
        app, host=args.host, port=args.port, loop=args.loop, lifespan="on",
        log_config=None, log_level=args.log_level,
        timeout_graceful_shutdown=args.shutdown_timeout,
    )
    server = Server(config, app.state.hub)
    listener = config.bind_socket()
    if args.send_buffer:
        # Accepted connections inherit the listener's (fixed) buffer size.
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, args.send_buffer)
    # Once it has shut down, uvicorn raises again the signal that stopped it, with
    # the handlers that were in place before it started: make those ignore it, so
    # that a requested stop ends with status 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: None)
    server.run(sockets=[listener])
    # Not started: the lifespan failed (uvicorn logged why) or the port was taken.
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
