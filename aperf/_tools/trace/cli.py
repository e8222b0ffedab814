"""``aperf-trace``: options, the trace loop, and every failure as one line on stderr.

Exit status, as every aperf command's: 0 when stopped by SIGINT/SIGTERM or when the
reader of stdout went away, 1 when it cannot run (one line says why), 2 for bad options
(argparse's, ``--shards`` more than the CPUs, and ``--nats`` credentials or permissions
the NATS server refused: one line naming the option).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
import sys
from collections.abc import Callable, Coroutine, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import structlog

import aperf

from ..._native import speedups
from .. import nats_options as _natsargs
from .output import LineOutput
from .preflight import OptionError, SetupError, ensure_tracefs, missing_privileges
from .render import event_decoder
from .session import (
    RINGBUF,
    Printer,
    StopSignals,
    event_map,
    order_by,
    show_all,
    show_batch,
    tracer_object,
    warn,
)
from .shards import trace_shard, trace_sharded

PROG = "aperf-trace"
DEFAULT_PAGES = 8  # per CPU, as the C original: 8 x 4 KiB = 32 KiB
DEFAULT_RINGBUF_PAGES = 64  # the whole ring buffer, as libbpf-bootstrap's bootstrap: 256 KiB
MAX_PAGES = 8192  # 32 MiB per CPU: far more than exec/exit rates need, and still mappable
# Execs and exits are rare (tens to thousands a second): a kernel wakeup per event,
# as libbpf's default in the C original, costs little, and leaves no drain timer
# ticking while the machine is idle. "balanced" suits high event rates.
DEFAULT_WAKEUP = "lowest-latency"
WAKEUPS = ("lowest-latency", "balanced", "throughput")
FLEET_STREAM = "bootstrap_legacy"  # the stream name the tracer publishes under (--nats)

Trace = Callable[[argparse.Namespace], Coroutine[Any, Any, int]]


def shipped_object(name: str = "tracer") -> Path:
    """A tracer's BPF object, as shipped in the aperf package (``tracer``: either ring,
    the loader's choice; ``bootstrap_legacy``: perf event array; ``bootstrap``: BPF ring
    buffer)."""
    return Path(str(resources.files("aperf") / "_objects" / f"{name}.bpf.o"))


def is_ring_buffer(source: aperf.Map | aperf.RingBufferSource) -> bool:
    """Whether the events come through one BPF ring buffer (sized by the map, not pages=)."""
    return isinstance(source, aperf.RingBufferSource) or source.type == RINGBUF


def event_source(obj: aperf.BPFObject) -> aperf.Map | aperf.RingBufferSource:
    """Where the object's events arrive: its ``APERF_BUFFER`` (whichever ring it became;
    a ring buffer's drops come counted by the header), its ring buffer ``rb``
    (bootstrap.bpf.c), with the programs' own count of events that found no room, or
    its perf event array."""
    events = event_map(obj)
    if events.name != "rb":
        return events
    dropped = obj.maps["dropped"]

    def dropped_events() -> int:  # the kernel counts no ring buffer drops: the programs do
        return int.from_bytes(dropped.lookup(bytes(4)), "little")

    return aperf.RingBufferSource(obj.maps["rb"], dropped=dropped_events)


async def trace(args: argparse.Namespace) -> int:
    """Print every exec and exit until SIGINT/SIGTERM, or until stdout's reader goes away;
    with ``--nats``, publish them to JetStream too."""
    out = await LineOutput.open()
    sink = await open_sink(args)
    try:
        with StopSignals() as stop, loaded_tracer(args) as obj:
            stop.on_stop(out.stop)
            source = event_source(obj)
            stream = aperf.PerfStream(
                source, pages=perf_pages(args, source),
                decoder=event_decoder(obj), wakeup=args.wakeup, order_by=order_by(args),
            )
            async with stream:
                # Closing the stream frees the rings at once; the loop then hands
                # out what was already read, and ends.
                stop.on_stop(stream.close)
                printer = Printer(out, args.json)
                recorder = open_recorder(args, obj, stream)
                if recorder is not None:
                    printer.recorder = recorder
                await printer.header()
                try:
                    if sink is None:
                        await show_all(stream, printer)
                    else:
                        await publish(stream, printer, sink, stop)
                finally:
                    if recorder is not None:
                        await asyncio.to_thread(recorder.close)
    finally:
        try:
            await out.aclose()
        finally:
            if sink is not None:
                await sink.aclose()
    return 0


def open_recorder(args: argparse.Namespace, obj: aperf.BPFObject,
                  stream: aperf.PerfStream[Any]) -> aperf.Recorder | None:
    """With ``--record DIR``: a recorder of the tracer's events (``struct event``, from the
    object's BTF), in DIR."""
    if args.record is None:
        return None
    try:
        return aperf.Recorder(
            args.record, aperf.decoders.from_btf(obj, "event"), source="aperf-trace",
            rings=[(c.map, c.cpu) for c in stream.statistics().cpus])
    except aperf.MissingExtraError as exc:
        raise SetupError(f"--record: {exc}") from None
    except aperf.RecordingError as exc:
        raise SetupError(f"--record: {exc}") from None


async def open_sink(args: argparse.Namespace) -> Any:
    """With ``--nats URL``: an open aperf.fleet sink that publishes every event too."""
    if not args.nats:
        return None
    try:
        from aperf.fleet import FleetConfigError, JetStreamSink
    except ImportError as exc:
        raise SetupError(str(exc)) from None
    _natsargs.quiet_tls_eof()
    _natsargs.one_line_warnings(PROG)
    try:
        sink = JetStreamSink(
            _natsargs.connection(args), host=args.host, name=FLEET_STREAM,
            signing_key=args.nats_signing_key,
        )
        await sink.open()
    except (FleetConfigError, ValueError, TypeError) as exc:  # also options that do not fit
        raise fleet_failure(exc) from None
    return sink


def fleet_failure(exc: Exception) -> SetupError:
    """An error of aperf.fleet as the tracer says it: one line naming the option (the
    tracer has no --jetstream: the stream is always FLEET_STREAM's), and its status."""
    options = {k: v for k, v in _natsargs.OPTIONS.items() if k != "jetstream"}
    line, status = _natsargs.failure(exc, options=options)
    return (OptionError if status == _natsargs.BAD_ARGUMENTS else SetupError)(f"--nats: {line}")


async def publish(
    stream: aperf.PerfStream[Any], printer: Printer, sink: Any, stop: StopSignals
) -> None:
    """Print each batch, then publish it (waiting while JetStream is slow: backpressure
    then ends in the kernel's lost counters, which are published when it is back)."""

    closing: list[asyncio.Future[None]] = []

    def give_up() -> None:  # a send() waiting for JetStream gives up (counted as dropped)
        closing.append(asyncio.ensure_future(sink.aclose(timeout=1.0)))

    stop.on_stop(give_up)
    async for batch in stream.batches():
        await show_batch(stream, printer, batch)
        if stop.requested:
            continue
        try:
            await sink.send(batch)
        except aperf.AperfError as exc:
            from aperf.fleet import FleetAuthError

            if isinstance(exc, FleetAuthError):  # e.g. this user may not publish as --host
                raise fleet_failure(exc) from None
            if not stop.requested:  # else: the stop closed the sink meanwhile
                raise


# --- command line ------------------------------------------------------------------------


def positive_power_of_two(text: str) -> int:
    """``--pages``: a power of two from 1 to MAX_PAGES."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1 or value & (value - 1):
        raise argparse.ArgumentTypeError(f"{text} is not a power of two (1, 2, 4, 8, ...)")
    if value > MAX_PAGES:
        raise argparse.ArgumentTypeError(
            f"{text} pages is more than the limit, {MAX_PAGES} "
            f"({MAX_PAGES * 4 // 1024} MiB per CPU)"
        )
    return value


def positive(text: str) -> int:
    value = non_negative(text)
    if value == 0:
        raise argparse.ArgumentTypeError("0 is not positive")
    return value


def non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is negative")
    return value


def ringbuf_bytes(args: argparse.Namespace) -> int:
    """The size of the object's ring buffer, if its ring is one: ``--pages`` (default
    ``DEFAULT_RINGBUF_PAGES``) of 4 KiB."""
    return (args.pages or DEFAULT_RINGBUF_PAGES) * 4096


def perf_pages(args: argparse.Namespace, source: aperf.Map | aperf.RingBufferSource) -> int | None:
    """``pages=`` of the stream: each perf ring's (``--pages``, default ``DEFAULT_PAGES``);
    None for a ring buffer, whose size is the map's."""
    return None if is_ring_buffer(source) else args.pages or DEFAULT_PAGES


def buffer_choice(args: argparse.Namespace) -> aperf.BufferChoice:
    """The ring the loader makes of an ``APERF_BUFFER`` (tracer.bpf.c): ``--buffer``,
    ``--ringbuf``'s ring buffer, or a perf event array as the C original."""
    return args.buffer or ("ringbuf" if args.ringbuf else "perf")


def loaded_tracer(args: argparse.Namespace) -> contextlib.AbstractContextManager[aperf.BPFObject]:
    """``tracer_object`` as the options say."""
    return tracer_object(args.object, args.duration * 1_000_000, ringbuf_bytes(args),
                         buffer_choice(args), strict=args.buffer is not None)


def parse_args(
    argv: Sequence[str] | None, *, command: str = PROG, default_object: Path | None = None,
    fleet: bool = True,
) -> argparse.Namespace:
    """The options. The tracer's object (``default_object`` None) is the shipped
    tracer.bpf.o, whose ring the loader picks (``--buffer``, ``--ringbuf``); an example's
    ``default_object`` is a perf event array tracer, whose ring buffer twin
    (``--ringbuf``) is ``bootstrap.bpf.o`` beside it."""
    twin = default_object is not None
    default_object = default_object or shipped_object()
    ringbuf_object = default_object.with_name("bootstrap.bpf.o") if twin else default_object
    parser = argparse.ArgumentParser(
        prog=command,
        description="Trace process exec and exit events (a BPF perf event array or ring "
        "buffer, read by aperf).",
    )
    parser.add_argument(
        "-d", "--duration", type=non_negative, default=0, metavar="MS",
        help="report only exits of processes that ran at least MS milliseconds "
        "(execs are then not reported)",
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true",
        help="print libbpf's debug output and aperf's logs to stderr",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per event per line")
    parser.add_argument(
        "--loop", choices=("asyncio", "uvloop"), default="asyncio",
        help="event loop to run on (uvloop: pip install 'aperf-bpf[uvloop]')",
    )
    parser.add_argument(
        "--pages", type=positive_power_of_two, default=None, metavar="N",
        help=f"ring size in 4 KiB pages, a power of two up to {MAX_PAGES}: per CPU "
        f"(default {DEFAULT_PAGES}), or of the one ring buffer "
        f"(default {DEFAULT_RINGBUF_PAGES})",
    )
    parser.add_argument(
        "--buffer", choices=("perf", "ringbuf", "auto"), default=None,
        help="the ring the loader makes of the tracer's buffer before load: a perf event "
        "array (default, a ring per CPU, as the C original), one BPF ring buffer for every "
        "CPU, or auto: a ring buffer where the kernel has them (5.8+)",
    )
    parser.add_argument(
        "--ringbuf", action="store_true",
        help="one BPF ring buffer for every CPU: the same as --buffer ringbuf"
        + (" (here: the ring buffer twin, bootstrap.bpf.c, libbpf-bootstrap's 'bootstrap')"
           if twin else ""),
    )
    parser.add_argument(
        "--wakeup", choices=WAKEUPS, default=DEFAULT_WAKEUP,
        help=f"when the kernel wakes the reader (default {DEFAULT_WAKEUP}: at every event)",
    )
    parser.add_argument(
        "--unordered", action="store_true",
        help="print events in ring order (each CPU's in turn, as they are read) instead of "
        "in time order across CPUs (which holds an event up to 0.1 s)",
    )
    parser.add_argument(
        "--object", type=Path, default=None, metavar="PATH",
        help=f"the compiled BPF object (default: {default_object}, with --ringbuf "
        f"{ringbuf_object})",
    )
    parser.add_argument(
        "--shards", type=positive, default=None, metavar="N",
        help="read the CPUs' rings in N processes (at most one per online CPU), for hosts "
        "where one process cannot keep up; the tracer is loaded once",
    )
    parser.add_argument(
        "--record", metavar="DIR", default=None,
        help="also write every event, and every loss, to Parquet files in DIR (a new or "
        "empty directory; needs aperf-bpf[arrow]): aperf.Recording(DIR) and "
        "aperf.replay(DIR) read them back (docs/recording.md)",
    )
    parser.add_argument(
        "--doctor", action="store_true",
        help="check what this machine and this process have of what the tracer needs, say "
        "what to do about the rest, and exit (status 1 if something required is missing; "
        "with --json, as JSON)",
    )
    # A shard of --shards N: the pinned map and the CPUs it reads (set by the parent).
    parser.add_argument("--shard-of", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--shard-cpus", default=None, help=argparse.SUPPRESS)
    if fleet:
        parser.add_argument(
            "--nats", metavar="URL[,URL...]",
            help="also publish every event to NATS JetStream at URL (several, comma-separated: "
            "nodes of a cluster; needs aperf-bpf[nats]; the "
            "stream must exist: python -m aperf.fleet create-stream --nats URL); "
            "python -m examples.fleet_view shows a fleet",
        )
        parser.add_argument(
            "--host", default=socket.gethostname(), metavar="NAME",
            help="the host name published with --nats (default: this machine's)",
        )
        parser.add_argument(
            "--nats-signing-key", metavar="PATH",
            help="sign every event published with --nats with this host's Ed25519 key (a "
            "file only root may read; python -m aperf.fleet keygen makes one), so that "
            "readers given its public key know them for this host's (docs/fleet.md)",
        )
        _natsargs.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.ringbuf and args.buffer not in (None, "ringbuf"):
        parser.error(f"--ringbuf is --buffer ringbuf: it does not go with --buffer {args.buffer}")
    if args.buffer is not None and twin:
        parser.error("--buffer chooses the ring of the tracer's own object (aperf-trace); "
                     "this one's ring buffer twin is --ringbuf")
    if args.shards is not None and (
        args.ringbuf or args.buffer not in (None, "perf") or getattr(args, "nats", None)
        or args.record
    ):
        parser.error("--shards reads a perf event array in several processes: it does not go "
                     "with --ringbuf or --buffer ringbuf/auto (one ring for every CPU), --nats "
                     "or --record")
    if fleet and args.nats is not None:
        check_fleet_options(parser, args)
        _natsargs.check(parser, args)
    if args.pages is None and buffer_choice(args) != "auto":  # else known once loaded
        args.pages = DEFAULT_RINGBUF_PAGES if buffer_choice(args) == "ringbuf" else DEFAULT_PAGES
    if args.object is None:
        args.object = ringbuf_object if args.ringbuf else default_object
    return args


def check_fleet_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--nats`` and ``--host`` as the sink would take them; a mistake is one line and
    status 2, like any bad option (without aperf-bpf[nats], open_sink says what is missing)."""
    try:
        from aperf.fleet._args import name_problem, url_problem
    except ImportError:
        return
    for url in _natsargs.servers(args.nats):  # URL[,URL...]: each checked
        problem = url_problem(url)
        if problem:
            shown = url if len(url) <= 80 else url[:80] + "..."
            parser.exit(2, f"{parser.prog}: error: argument --nats: {shown!r} is not a NATS "
                        f"URL: {problem}\n")
    problem = name_problem(args.host)
    if problem:
        shown = args.host if len(args.host) <= 40 else args.host[:40] + "..."
        parser.exit(2, f"{parser.prog}: error: argument --host: the host name {problem}: "
                    f"{shown!r}\n")


def configure_logging(verbose: bool) -> None:
    """Human-readable logs on stderr only: stdout carries the events and nothing else."""
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="%H:%M:%S"),
            structlog.dev.ConsoleRenderer(colors=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.DEBUG if verbose else logging.WARNING
        ),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )


def run(args: argparse.Namespace, trace: Trace = trace) -> int:
    if args.loop == "uvloop":
        try:
            import uvloop
        except ImportError:
            raise SetupError(
                "--loop uvloop needs uvloop, which is not installed: "
                "pip install 'aperf-bpf[uvloop]'"
            ) from None
        return uvloop.run(trace(args))
    return asyncio.run(trace(args))


def first_line(text: str) -> str:
    return text.strip().split("\n", 1)[0]


def main(
    argv: Sequence[str] | None = None,
    *,
    name: str = PROG,
    command: str = PROG,
    default_object: Path | None = None,
    trace: Trace = trace,
    fleet: bool = True,
) -> int:
    """Run the tracer; ``name`` prefixes error lines, ``command`` is the usage's program;
    ``fleet``: whether it takes ``--nats`` and ``--host``."""
    args = parse_args(argv, command=command, default_object=default_object, fleet=fleet)
    if args.doctor:
        from ..doctor import main as doctor

        return doctor(["--json"] * args.json, prog=f"{command} --doctor", tracer=True)
    configure_logging(args.verbose)
    # Which path runs (the compiled fast path, or the pure one and why): for bug reports.
    structlog.get_logger(PROG).debug("aperf", version=aperf.__version__, path=speedups.status())

    def fail(message: str, status: int = 1) -> int:
        warn(f"{name}: {message}")
        return status

    reason = missing_privileges()
    if reason is not None:
        return fail(reason)
    if args.verbose:
        aperf.set_libbpf_verbose(True)
    try:
        ensure_tracefs()
        if args.shard_of is not None:
            trace = trace_shard
        elif args.shards is not None:
            trace = trace_sharded
        return run(args, trace)
    except OptionError as exc:
        return fail(str(exc), 2)
    except SetupError as exc:
        return fail(str(exc))
    except aperf.ObjectFileError as exc:
        if not os.path.exists(exc.path):
            return fail(f"BPF object {exc.path} does not exist; build it with: make -C bpf")
        return fail(f"cannot open BPF object {exc.path}: {first_line(exc.detail)}")
    except aperf.LibbpfUnavailableError as exc:
        return fail(f"libbpf is not available: {first_line(str(exc))}")
    except aperf.VerifierError as exc:
        # Several lines on purpose: the end of the verifier's log says why.
        return fail(str(exc))
    except aperf.MissingPrivilegesError as exc:
        return fail(f"the kernel refused ({exc.function}(): {exc.strerror}); {exc.hint}")
    except PermissionError as exc:
        return fail(f"{exc.strerror}: {exc.filename}" if exc.filename else str(exc))
    except aperf.AperfError as exc:
        # Also a kernel without BPF (ENOSYS) or without these tracepoints (ENOENT).
        # libbpf's log lines follow the first line; -v shows all of them.
        return fail(first_line(str(exc)) + ("" if args.verbose else " (-v shows libbpf's log)"))
    except KeyboardInterrupt:  # Ctrl-C before the loop's handler was installed
        return 0
