"""Trace process exec and exit through a BPF perf event array.

The Python counterpart of libbpf-bootstrap's ``bootstrap_legacy``: the BPF
programs in ``bpf/bootstrap_legacy.bpf.c`` report every exec and every exit of
a process (with its exit code and how long it ran) through a
``BPF_MAP_TYPE_PERF_EVENT_ARRAY``; this program reads the per-CPU rings with
:class:`aperf.PerfStream` and prints one line per event::

    $ sudo python -m examples.bootstrap_legacy
    TIME     EVENT COMM             PID     PPID    FILENAME/EXIT CODE
    17:26:53 EXEC  sh               24694   22237   /bin/sh
    17:26:53 EXIT  ls               24695   24694   [2] (5ms)

Options: ``-d MS`` reports only exits of processes that lived at least MS
milliseconds (and no execs, as in the original), ``--json`` prints one JSON
object per line instead of the table, ``-v`` shows libbpf's debug output,
``--nats URL`` also publishes every event to NATS JetStream (see docs/fleet.md).
Ctrl-C or SIGTERM stops it (exit status 0). Diagnostics go to stderr, so
stdout holds nothing but the table (or the JSON lines). docs/tutorial.md walks
through this file.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import structlog

import aperf

PROG = "bootstrap_legacy"
REPO = Path(__file__).resolve().parent.parent
DEFAULT_OBJECT = REPO / "bpf" / "bootstrap_legacy.bpf.o"
DEFAULT_PAGES = 8  # per CPU, as the C original: 8 x 4 KiB = 32 KiB
# Execs and exits are rare (tens to thousands a second): a kernel wakeup per event,
# as libbpf's default in the C original, costs little, and leaves no drain timer
# ticking while the machine is idle. "balanced" suits high event rates.
DEFAULT_WAKEUP = "lowest-latency"
WAKEUPS = ("lowest-latency", "balanced", "throughput")
TRACEFS = Path("/sys/kernel/tracing")
# libbpf reads tracepoint ids under debugfs when it is mounted, else under tracefs.
TRACING_DIRS = (Path("/sys/kernel/debug/tracing"), TRACEFS)

# The printf formats of libbpf-bootstrap's bootstrap_legacy.c, kept as printf formats.
HEADER_FORMAT = "%-8s %-5s %-16s %-7s %-7s %s"
LINE = "%-8s %-5s %-16s %-7d %-7d %s"
HEADER = HEADER_FORMAT % ("TIME", "EVENT", "COMM", "PID", "PPID", "FILENAME/EXIT CODE")

# Capability bits (linux/capability.h).
CAP_SYS_ADMIN = 21
CAP_PERFMON = 38
CAP_BPF = 39

log = structlog.get_logger(PROG)


class SetupError(Exception):
    """Something the tracer needs is missing. The message says what; it is printed as one line."""


# --- preconditions ---------------------------------------------------------------------


def effective_capabilities() -> int | None:
    """The CapEff bit mask of this process, or None if /proc cannot tell."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except (OSError, ValueError, IndexError):
        pass
    return None


def missing_privileges() -> str | None:
    """Why this process cannot load and attach the tracer, or None if it can.

    Loading tracing programs needs CAP_BPF and CAP_PERFMON (or CAP_SYS_ADMIN,
    which root has). Checked before anything is opened, so that the usual
    mistake (forgetting sudo) gets a plain sentence, not an errno.
    """
    caps = effective_capabilities()
    if caps is None:
        if os.geteuid() == 0:
            return None
    elif caps >> CAP_SYS_ADMIN & 1 or (caps >> CAP_BPF & 1 and caps >> CAP_PERFMON & 1):
        return None
    euid = os.geteuid()
    who = "root without capabilities" if euid == 0 else f"uid {euid}"
    return (
        "loading BPF programs needs root (CAP_BPF and CAP_PERFMON, or CAP_SYS_ADMIN), "
        f"and this process runs as {who}; run it with sudo"
    )


def ensure_tracefs() -> None:
    """Mount tracefs at /sys/kernel/tracing if no tracing directory is there.

    libbpf attaches ``tp/...`` programs by reading the tracepoint's id from
    ``<tracefs>/events/<category>/<name>/id``; minimal systems (containers, VMs
    booted without systemd) often have tracefs unmounted.
    """
    if any((d / "events").is_dir() for d in TRACING_DIRS):
        return
    try:
        result = subprocess.run(
            ["mount", "-t", "tracefs", "tracefs", str(TRACEFS)],
            capture_output=True, text=True, check=False,
        )
    except OSError as exc:
        raise SetupError(f"tracefs is not mounted and running mount failed: {exc}") from None
    if result.returncode != 0 or not (TRACEFS / "events").is_dir():
        why = result.stderr.strip() or f"mount exited with status {result.returncode}"
        raise SetupError(
            f"tracefs is not mounted at {TRACEFS} and mounting it failed ({why}); "
            f"mount it with: mount -t tracefs tracefs {TRACEFS}"
        )
    log.info("mounted tracefs", path=str(TRACEFS))


@contextlib.contextmanager
def tracer_object(
    path: str | os.PathLike[str], min_duration_ns: int = 0
) -> Iterator[aperf.BPFObject]:
    """Open the BPF object, set its ``min_duration_ns`` global, load it and attach it.

    Closing the object (leaving the ``with`` block) detaches both programs and
    frees the maps.
    """
    with aperf.BPFObject(path) as obj:
        # A ``const volatile`` global lives in .rodata: it can only be set before
        # load, and the verifier then treats it as a constant (dead branches vanish).
        obj.set_global("min_duration_ns", min_duration_ns)
        obj.load()
        obj.attach()
        yield obj


# --- rendering ---------------------------------------------------------------------------


def event_kind(value: Any) -> str:
    return "EXIT" if value.exit_event else "EXEC"


def table_line(value: Any, now: datetime.datetime) -> str:
    """One line of the table, formatted as libbpf-bootstrap's printf does."""
    if value.exit_event:
        detail = f"[{value.exit_code}]"
        if value.duration_ns:
            detail += f" ({value.duration_ns // 1_000_000}ms)"
    else:
        detail = value.filename
    return LINE % (
        now.strftime("%H:%M:%S"), event_kind(value), value.comm, value.pid, value.ppid, detail
    )


def json_record(sample: aperf.Sample, now: datetime.datetime) -> dict[str, Any]:
    """Every field of ``struct event``, plus when it was read, its type and its CPU."""
    return {
        "time": now.isoformat(timespec="microseconds"),
        "event": event_kind(sample.value),
        "cpu": sample.cpu,
        **sample.value._asdict(),
    }


# --- the tracer --------------------------------------------------------------------------


class Output:
    """stdout, flushed per line so that pipes see each event at once."""

    def __init__(self) -> None:
        self.broken = False

    def write(self, line: str) -> None:
        if self.broken:
            return
        try:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()
        except BrokenPipeError:
            # The reader went away (``... | head``): stop quietly. Point fd 1 at
            # /dev/null so that the interpreter's final flush does not fail again.
            self.broken = True
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)


def first_line(text: str) -> str:
    return text.strip().split("\n", 1)[0]


def warn(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


async def trace(args: argparse.Namespace) -> int:
    loop = asyncio.get_running_loop()
    stream: aperf.PerfStream | None = None
    stop_requested = False

    def request_stop() -> None:
        # Closing the stream frees the rings at once; the ``async for`` below then
        # hands out what was already read and ends.
        nonlocal stop_requested
        stop_requested = True
        if stream is not None:
            stream.close()
        if sink is not None:  # a send() waiting for JetStream gives up (counted as dropped)
            closing.append(asyncio.ensure_future(sink.aclose(timeout=1.0)))

    # Installed before loading: a signal during the (synchronous) load is only
    # delivered to request_stop once the loop runs again, and then closes the stream.
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, request_stop)
    out = Output()
    sink: Any = None
    closing: list[asyncio.Future[None]] = []
    try:
        sink = await open_sink(args)
        with tracer_object(args.object, args.duration * 1_000_000) as obj:
            async with aperf.PerfStream(
                obj.maps["perf_buffer"], pages=args.pages, decoder="event", wakeup=args.wakeup
            ) as stream:
                if stop_requested:
                    stream.close()
                if not args.json:
                    out.write(HEADER)
                async for batch in stream.batches():
                    for item in batch:
                        match item:
                            case aperf.Sample(value=event):
                                now = datetime.datetime.now().astimezone()
                                if args.json:
                                    out.write(json.dumps(json_record(item, now)))
                                else:
                                    out.write(table_line(event, now))
                                if out.broken:
                                    stream.close()
                            case aperf.Lost(cpu=cpu, count=count):
                                warn(f"Lost {count} events on CPU #{cpu}!")
                            case aperf.BadSample(cpu=cpu, error=error):
                                warn(f"Bad sample on CPU #{cpu}: {error}")
                    if sink is not None and not stop_requested:
                        try:
                            await sink.send(batch)  # waits (backpressure) if JetStream is slow
                        except aperf.AperfError:
                            if not stop_requested:  # else: Ctrl-C closed the sink meanwhile
                                raise
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        if sink is not None:
            await sink.aclose()
    return 0


async def open_sink(args: argparse.Namespace) -> Any:
    """With ``--nats URL``: an open aperf.fleet sink that publishes every event too."""
    if not args.nats:
        return None
    try:
        from aperf.fleet import FleetConfigError, JetStreamSink
    except ImportError as exc:
        raise SetupError(str(exc)) from None
    sink = JetStreamSink(args.nats, host=args.host, name=PROG)
    try:
        await sink.open()
    except FleetConfigError as exc:
        raise SetupError(f"--nats: {exc}") from None
    return sink


# --- command line ------------------------------------------------------------------------


def positive_power_of_two(text: str) -> int:
    value = int(text)
    if value < 1 or value & (value - 1):
        raise argparse.ArgumentTypeError(f"{text} is not a power of two (1, 2, 4, 8, ...)")
    return value


def non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is negative")
    return value


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=f"python -m examples.{PROG}",
        description="Trace process exec and exit events (BPF perf event array, read by aperf).",
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
        "--loop", choices=("asyncio", "uvloop"), default="asyncio", help="event loop to run on"
    )
    parser.add_argument(
        "--pages", type=positive_power_of_two, default=DEFAULT_PAGES, metavar="N",
        help=f"ring size per CPU in 4 KiB pages, a power of two (default {DEFAULT_PAGES})",
    )
    parser.add_argument(
        "--wakeup", choices=WAKEUPS, default=DEFAULT_WAKEUP,
        help=f"when the kernel wakes the reader (default {DEFAULT_WAKEUP}: at every event)",
    )
    parser.add_argument(
        "--nats", metavar="URL",
        help="also publish every event to NATS JetStream at URL (needs aperf[nats]; the stream "
        "must exist: python -m aperf.fleet create-stream --nats URL); "
        "python -m examples.fleet_view shows a fleet",
    )
    parser.add_argument(
        "--host", default=socket.gethostname(), metavar="NAME",
        help="the host name published with --nats (default: this machine's)",
    )
    parser.add_argument(
        "--object", type=Path, default=DEFAULT_OBJECT, metavar="PATH",
        help="the compiled BPF object (default: bpf/bootstrap_legacy.bpf.o; build it with "
        "'make -C bpf')",
    )
    return parser.parse_args(argv)


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


def run(args: argparse.Namespace) -> int:
    if args.loop == "uvloop":
        import uvloop

        return uvloop.run(trace(args))
    return asyncio.run(trace(args))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args.verbose)

    def fail(message: str) -> int:
        warn(f"{PROG}: {message}")
        return 1

    reason = missing_privileges()
    if reason is not None:
        return fail(reason)
    if args.verbose:
        aperf.set_libbpf_verbose(True)
    try:
        ensure_tracefs()
        return run(args)
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
    except (aperf.MissingPrivilegesError, PermissionError) as exc:
        call = f"{exc.function}(): " if isinstance(exc, aperf.LibbpfError) else ""
        return fail(
            f"the kernel refused ({call}{exc.strerror}); loading BPF programs needs root "
            "(CAP_BPF and CAP_PERFMON, or CAP_SYS_ADMIN)"
        )
    except aperf.AperfError as exc:
        # Also a kernel without BPF (ENOSYS) or without these tracepoints (ENOENT).
        # libbpf's log lines follow the first line; -v shows all of them.
        return fail(first_line(str(exc)) + ("" if args.verbose else " (-v shows libbpf's log)"))
    except KeyboardInterrupt:  # Ctrl-C before the loop's handler was installed
        return 0


if __name__ == "__main__":
    sys.exit(main())
