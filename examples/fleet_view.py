"""The exec/exit tracer as a fleet: the merged output of every host, with a HOST column.

Each host runs the tracer with ``--nats URL`` (``aperf-trace --nats nats://nats:4222``,
or ``python -m aperf trace --nats ...``); this reads the JetStream stream they publish to and
prints one line per event, as the tracer does, plus the host it came from::

    $ python -m examples.fleet_view --nats nats://nats:4222
    HOST             TIME     EVENT COMM             PID     PPID    FILENAME/EXIT CODE
    web-1            17:26:53 EXEC  sh               24694   22237   /bin/sh
    db-2             17:26:53 EXIT  ls               24695   24694   [2] (5ms)

TIME is when the event happened, on its host's clock: its kernel timestamp
(``timestamp_ns``, CLOCK_BOOTTIME) plus that host's offset to the wall clock,
which its tracer's sink sends along (``FleetReader.boot_offset_ns``); where a
sink sent none, the time the viewer read it. Samples are decoded from the
tracer object's BTF (``--object``; opened, never loaded, so no root is needed).
Lost events, Gaps (events JetStream no longer holds) and messages the reader
refused (``Malformed``: not aperf's, or forged) go to stderr. The
durable consumer (``--durable``) remembers where the viewer stopped: a second
run continues there. Create the JetStream stream once, before the tracers start:
``python -m aperf.fleet create-stream --nats URL``. Ctrl-C or SIGTERM stops it.
The ``--nats-*`` options give credentials and TLS (docs/fleet.md, Security), and
``--nats-host-keys`` the hosts' public keys: then only signed events are shown. When it
cannot start it prints one line naming the option to check, and exits with status 1 (no
server, no stream, a cluster without quorum for ``--nats-wait`` seconds) or, as for any
bad option, 2 (credentials the server refused), as every aperf command does.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import sys
from collections.abc import Sequence
from pathlib import Path

import aperf
from aperf._tools import nats_options as _natsargs
from aperf._tools.trace.cli import FLEET_STREAM as TRACER  # the stream name tracers publish under
from aperf._tools.trace.cli import shipped_object, warn
from aperf._tools.trace.output import LineOutput
from aperf._tools.trace.render import HEADER, event_decoder, table_line
from aperf.fleet import FleetConfigError, FleetError, FleetReader, Gap, Malformed

PROG = "fleet_view"
HOST = "%-16s "


async def view(args: argparse.Namespace) -> int:
    with aperf.BPFObject(args.object) as obj:
        decoder = event_decoder(obj)  # names escaped, as the tracer shows them
    try:
        reader = FleetReader(
            _natsargs.connection(args), jetstream=args.jetstream, durable=args.durable,
            decoder=decoder, subject=f"aperf.*.{TRACER}", host_keys=args.nats_host_keys,
        )
    except FleetConfigError:  # --nats-host-keys that cannot be read: said as it is
        raise
    except (ValueError, TypeError) as exc:  # --nats-* options that do not go together
        raise FleetConfigError("--nats", str(exc)) from None
    out = await LineOutput.open()
    this = asyncio.current_task()
    assert this is not None
    # Ctrl-C and SIGTERM cancel the loop below; leaving the ``async with`` then
    # acknowledges what was shown and disconnects.
    async with reader, aperf.closing_on_signals(this.cancel):
        await out.write(HOST % "HOST" + HEADER)
        try:
            async for host, _stream, event in reader:
                match event:
                    case aperf.Sample(value=value):
                        when = event_time(value.timestamp_ns, reader.boot_offset_ns(host))
                        await out.write(HOST % host + table_line(value, when))
                        if out.broken:
                            break
                    case aperf.Lost(cpu=cpu, count=count):
                        warn(f"{host}: lost {count} events on CPU #{cpu}!")
                    case aperf.BadSample(cpu=cpu, error=error):
                        warn(f"{host}: bad sample on CPU #{cpu}: {error}")
                    case Gap(samples=samples, lost=lost):
                        warn(f"{host}: {samples} events (and {lost} lost) were removed from "
                             "JetStream before this viewer read them")
                    case Malformed(subject=subject, stream_sequence=seq, reason=reason):
                        warn(f"{subject}: message {seq} not shown: {reason}")
        except asyncio.CancelledError:
            pass
        finally:
            await out.aclose()
    return 0


def event_time(boot_ns: int, offset_ns: int | None) -> datetime.datetime:
    """When an event stamped ``boot_ns`` (its host's CLOCK_BOOTTIME) happened, in local
    time; with no offset from its host, now."""
    if offset_ns is None:
        return datetime.datetime.now().astimezone()
    micros = (boot_ns + offset_ns) // 1000
    return datetime.datetime.fromtimestamp(micros // 1_000_000).astimezone().replace(
        microsecond=micros % 1_000_000
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=f"python -m examples.{PROG}",
        description="Print the exec/exit events of every host publishing to NATS JetStream.",
    )
    parser.add_argument(
        "--nats", required=True, type=_natsargs.nats_urls, metavar="URL[,URL...]",
        help="the NATS server (several, comma-separated: nodes of a cluster)",
    )
    parser.add_argument(
        "--jetstream", default="APERF", metavar="NAME", help="the JetStream stream (APERF)"
    )
    parser.add_argument(
        "--durable", default=PROG, metavar="NAME",
        help=f"the durable consumer, which remembers where it stopped (default {PROG})",
    )
    parser.add_argument(
        "--object", type=Path, default=shipped_object(), metavar="PATH",
        help="the tracer's BPF object, for its BTF (default: the one aperf ships)",
    )
    parser.add_argument(
        "--nats-host-keys", metavar="PATH",
        help="show only events signed by their host's key: a file of '<host> ssh-ed25519 "
        "<base64>' lines (python -m aperf.fleet keygen prints them); others are refused",
    )
    _natsargs.add_arguments(parser)
    args = parser.parse_args(argv)
    _natsargs.check(parser, args)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    _natsargs.quiet_tls_eof()
    _natsargs.one_line_warnings(PROG)
    try:
        return asyncio.run(view(args))
    except FleetConfigError as exc:  # cannot start as told (FleetAuthError, ...Unavailable...)
        line, status = _natsargs.failure(exc)
        warn(f"{PROG}: {line}")
        return status
    except FleetError as exc:  # the connection closed for good while reading
        warn(f"{PROG}: {exc}")
    except aperf.ObjectFileError as exc:
        warn(f"{PROG}: cannot open {exc.path}: {exc.detail}; build it with: make -C bpf")
    except KeyboardInterrupt:
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
