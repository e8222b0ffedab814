"""``python -m aperf record OBJ --map NAME --decoder STRUCT --out DIR``: any map of any
BPF object recorded to Parquet files (docs/recording.md).

The object is opened, its globals set (``--set NAME=VALUE``), loaded and attached, as
the tracer loads its own; the map (a perf event array or a BPF ring buffer) is read by a
``PerfStream`` and written by ``stream.record()`` until SIGINT or SIGTERM, ``--seconds``
or ``--samples``. Exit status: 0 when stopped, 1 when it cannot run or a write failed
(one line says why), 2 for bad options.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path

import aperf

from .nats_options import positive_seconds
from .trace.cli import (
    WAKEUPS,
    configure_logging,
    first_line,
    positive,
    positive_power_of_two,
)
from .trace.preflight import missing_privileges
from .trace.session import StopSignals, warn

PROG = "python -m aperf record"


def global_value(text: str) -> tuple[str, int | bytes]:
    """``--set NAME=VALUE``: an integer (``0x`` hex too, ``true``/``false``) or, quoted
    or not, a string (as bytes)."""
    name, sep, value = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE")
    if value.lower() in ("true", "false"):
        return name, int(value.lower() == "true")
    try:
        return name, int(value, 0)
    except ValueError:
        return name, value.encode()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Record a map of a BPF object (a perf event array or a BPF ring buffer) "
        "to Parquet files, with its losses, until SIGINT or SIGTERM.",
    )
    parser.add_argument("object", type=Path, metavar="OBJ", help="the compiled BPF object")
    parser.add_argument("--map", required=True, metavar="NAME", help="the map to record")
    parser.add_argument(
        "--decoder", metavar="STRUCT", default=None,
        help="the struct (or typedef) of the samples, in the object's BTF: its fields become "
        "columns (without it only the samples' bytes are kept)")
    parser.add_argument("--out", required=True, type=Path, metavar="DIR",
                        help="a new or empty directory, for the recording")
    parser.add_argument(
        "--set", dest="globals", action="append", type=global_value, default=[],
        metavar="NAME=VALUE", help="set a global of the object before it loads (repeatable)")
    parser.add_argument("--no-attach", action="store_true",
                        help="load the object but attach none of its programs")
    parser.add_argument("--pages", type=positive_power_of_two, default=None, metavar="N",
                        help="ring size in 4 KiB pages per CPU (a perf event array)")
    parser.add_argument("--wakeup", choices=WAKEUPS, default="balanced",
                        help="when the kernel wakes the reader (default balanced)")
    parser.add_argument("--seconds", type=positive_seconds, default=None, metavar="S",
                        help="stop after S seconds")
    parser.add_argument("--samples", type=positive, default=None, metavar="N",
                        help="stop once at least N samples were written")
    parser.add_argument("--max-file-bytes", type=positive, default=64 << 20, metavar="BYTES",
                        help="close a file and begin the next one at this size (default 64 MiB)")
    parser.add_argument("--max-file-seconds", type=positive_seconds, default=60.0,
                        metavar="S", help="... or after S seconds (default 60)")
    parser.add_argument("--on-write-error", choices=("raise", "count"), default="raise",
                        help="stop at a file that cannot be written (raise, the default), or "
                        "count what it held and go on")
    parser.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="print libbpf's debug output and aperf's logs to stderr")
    return parser.parse_args(argv)


async def record(args: argparse.Namespace) -> aperf.RecorderStatistics:
    with StopSignals() as stop, aperf.BPFObject(args.object) as obj:
        for name, value in args.globals:
            obj.set_global(name, value)
        obj.load()
        if not args.no_attach:
            obj.attach()
        events = obj.maps[args.map]  # UnknownNameError names the maps there are
        decoder = aperf.decoders.from_btf(obj, args.decoder) if args.decoder else None
        stream = aperf.PerfStream(events, decoder=decoder, wakeup=args.wakeup,
                                  pages=args.pages)
        async with stream:
            stop.on_stop(stream.close)
            print(f"recording map {args.map} of {args.object} into {args.out} (SIGINT or "
                  "SIGTERM stops)", file=sys.stderr, flush=True)
            return await stream.record(
                args.out, seconds=args.seconds, samples=args.samples,
                max_file_bytes=args.max_file_bytes, max_file_seconds=args.max_file_seconds,
                on_write_error=args.on_write_error)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args.verbose)
    reason = missing_privileges()
    if reason is not None:
        warn(f"{PROG}: {reason}")
        return 1
    if args.verbose:
        aperf.set_libbpf_verbose(True)
    try:
        if args.loop == "uvloop":
            import uvloop

            stats = uvloop.run(record(args))
        else:
            stats = asyncio.run(record(args))
    except (aperf.AperfError, OSError, ImportError) as exc:
        warn(f"{PROG}: {first_line(str(exc))}")
        return 1
    except KeyboardInterrupt:
        return 0
    print(f"recorded {stats.rows} samples and {stats.lost} lost in {stats.files} files "
          f"({stats.bytes} bytes) to {args.out}", file=sys.stderr)
    if stats.unwritten:
        warn(f"{PROG}: {stats.unwritten} samples could not be written (noted as lost, cause "
             f"'recorder'): {stats.last_error}")
        return 1
    return 0
