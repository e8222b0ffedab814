"""Trace process exec and exit through a BPF perf event array.

The Python counterpart of libbpf-bootstrap's ``bootstrap_legacy``: the BPF
programs in ``bpf/bootstrap_legacy.bpf.c`` report every exec and every exit of
a process (with its exit code and how long it ran) through a
``BPF_MAP_TYPE_PERF_EVENT_ARRAY``; this program reads the per-CPU rings with
``aperf.PerfStream`` and prints one line per event::

    $ .venv/bin/python -m examples.bootstrap_legacy      # as root
    TIME     EVENT COMM             PID     PPID    FILENAME/EXIT CODE
    17:26:53 EXEC  sh               24694   22237   /bin/sh
    17:26:53 EXIT  ls               24695   24694   [2] (5ms)

This file is the teaching version of ``aperf-trace`` (``python -m aperf
trace``), which aperf installs: the same options, output and exit codes, built
from the same pieces in ``aperf/_tools/trace/`` (privilege and tracefs checks,
escaping, stdout that never blocks the loop, one-line errors). What is written
out here is the part about aperf: the object, the stream, the loop.
docs/tutorial.md walks through it. With ``--nats URL`` (and ``--host NAME``) the
events are also published to NATS JetStream: that part is the tool's own
(``aperf._tools.trace.cli.trace``), which then runs instead of the loop below.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import aperf
from aperf._tools.trace import cli, session
from aperf._tools.trace.cli import (
    DEFAULT_PAGES,
    DEFAULT_WAKEUP,
    WAKEUPS,
    non_negative,
    positive_power_of_two,
)
from aperf._tools.trace.output import LineOutput
from aperf._tools.trace.preflight import SetupError, ensure_tracefs, missing_privileges
from aperf._tools.trace.render import HEADER, event_decoder, json_record, table_line
from aperf._tools.trace.session import StopSignals, tracer_object, warn

# Names the service example (examples/service.py) takes from here.
__all__ = [
    "DEFAULT_OBJECT",
    "DEFAULT_PAGES",
    "DEFAULT_WAKEUP",
    "WAKEUPS",
    "SetupError",
    "ensure_tracefs",
    "json_record",
    "main",
    "missing_privileges",
    "non_negative",
    "positive_power_of_two",
    "trace",
    "tracer_object",
]

PROG = "bootstrap_legacy"
REPO = Path(__file__).resolve().parent.parent
DEFAULT_OBJECT = REPO / "bpf" / "bootstrap_legacy.bpf.o"  # built by: make -C bpf


async def trace(args: argparse.Namespace) -> int:
    if args.nats:  # publishing too (aperf.fleet): the tool's loop, with its sink
        return await cli.trace(args)
    out = await LineOutput.open()  # a full stdout pipe must not block the loop
    try:
        # SIGINT/SIGTERM close the stream: the ``async for`` then ends.
        with StopSignals() as stop, aperf.BPFObject(args.object) as obj:
            stop.on_stop(out.stop)
            # A ``const volatile`` global: set before load, a constant to the verifier.
            obj.set_global("min_duration_ns", args.duration * 1_000_000)
            if args.ringbuf:  # the twin, bootstrap.bpf.c: a ring buffer is sized at load
                obj.maps["rb"].set_max_entries(args.pages * 4096)
            obj.load()
            obj.attach()
            # The perf event array (a ring per CPU, sized here), or the ring buffer with
            # the programs' own count of dropped events (the kernel keeps none).
            source = cli.event_source(obj)
            async with aperf.PerfStream(
                source, wakeup=args.wakeup,
                pages=None if isinstance(source, aperf.RingBufferSource) else args.pages,
                decoder=event_decoder(obj),  # struct event from the object's BTF
                # In time order across CPUs (an EXIT never before its EXEC), by the
                # event's kernel timestamp; --unordered: ring order (docs/ordering.md).
                order_by=session.order_by(args),
            ) as stream:
                stop.on_stop(stream.close)
                if not args.json:
                    await out.write(HEADER)
                async for item in stream:
                    match item:
                        case aperf.Sample(value=event):
                            now = datetime.datetime.now().astimezone()
                            line = json.dumps(json_record(item, now)) if args.json else (
                                table_line(event, now)
                            )
                            await out.write(line)
                            if out.broken:  # the reader went away (... | head)
                                stream.close()
                        case aperf.Lost():
                            warn(session.lost_message(item))
                        case aperf.BadSample(cpu=cpu, error=error):
                            warn(f"Bad sample on CPU #{cpu}: {error}")
    finally:
        await out.aclose()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return cli.main(
        argv, name=PROG, command=f"python -m examples.{PROG}", default_object=DEFAULT_OBJECT,
        trace=trace,  # every option of aperf-trace: scripts/tracer.sh passes them on
    )


if __name__ == "__main__":
    sys.exit(main())
