"""``python -m aperf.fleet create-stream --nats URL``: make the JetStream stream a fleet uses.
``python -m aperf.fleet keygen --host NAME --key PATH``: a host's signing key.

Exit status, as every aperf command's: 0 done, 1 it cannot run (no server answers, no
JetStream, no quorum, the server refused the change), 2 bad options (also credentials or
files the server refused). An error is one line naming the option that fixes it.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from typing import Any

from .._tools.nats_options import (
    add_arguments,
    check,
    connection,
    failure,
    nats_urls,
    one_line_warnings,
    quiet_tls_eof,
)
from ._connect import DEFAULT_JETSTREAM, DEFAULT_PREFIX, KEEP, create_stream
from ._errors import FleetConfigError


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aperf.fleet")
    commands = parser.add_subparsers(dest="command", required=True)
    create = commands.add_parser(
        "create-stream", help="create (or update) the JetStream stream aperf sinks publish to",
        description="Create the stream, or update it: an option left out keeps the existing "
        "stream's value (a new stream gets the defaults shown).",
    )
    create.add_argument(
        "--nats", required=True, type=nats_urls, metavar="URL[,URL...]",
        help="the NATS server (several, comma-separated: nodes of a cluster)",
    )
    create.add_argument("--jetstream", default=DEFAULT_JETSTREAM, metavar="NAME")
    create.add_argument(
        "--subject-prefix", metavar="PREFIX", help=f"the stream takes PREFIX.> ({DEFAULT_PREFIX})"
    )
    create.add_argument(
        "--max-bytes", type=int, metavar="N",
        help="the most bytes the stream keeps (new stream: 1 GiB; -1: no limit)",
    )
    create.add_argument("--max-age", type=float, metavar="SECONDS", help="the oldest it keeps")
    create.add_argument(
        "--discard", choices=("old", "new"),
        help="at a limit: drop the oldest messages (readers see Gaps), or refuse new ones "
        "(sinks wait, kernels count the drops); new stream: old",
    )
    create.add_argument(
        "--memory", action="store_true", default=None, help="memory storage, not files"
    )
    create.add_argument(
        "--replicas", type=int, metavar="N",
        help="servers of a JetStream cluster that store every message: 3 on a cluster "
        "(new stream: 1)",
    )
    add_arguments(create)
    keygen = commands.add_parser(
        "keygen", help="make a host's Ed25519 signing key (JetStreamSink(signing_key=...))",
        description="Write a new Ed25519 private key to --key (PEM, mode 0600; an existing "
        "file is never overwritten) and print the line readers add to their hosts file "
        "(FleetReader(host_keys=PATH), fleet_view --nats-host-keys PATH).",
    )
    keygen.add_argument("--host", required=True, metavar="NAME",
                        help="the host name the sink publishes as (its --host)")
    keygen.add_argument("--key", required=True, metavar="PATH", help="where to write the key")
    args = parser.parse_args(argv)
    if args.command == "keygen":
        return _keygen(args.host, args.key)
    check(create, args)
    quiet_tls_eof()
    one_line_warnings("aperf.fleet")
    given = {
        "subject_prefix": args.subject_prefix, "max_bytes": args.max_bytes,
        "max_age": args.max_age, "discard": args.discard, "memory": args.memory,
        "replicas": args.replicas,
    }
    changes: dict[str, Any] = {k: KEEP if v is None else v for k, v in given.items()}
    if args.max_bytes == -1:
        changes["max_bytes"] = None  # no limit
    try:
        info = asyncio.run(
            create_stream(connection(args), jetstream=args.jetstream, **changes)
        )
    except (FleetConfigError, ValueError, TypeError) as exc:  # also options that do not fit
        line, status = failure(exc)
        print(f"aperf.fleet: {line}", file=sys.stderr)
        return status
    config = info.config
    limit = f"{config.max_bytes} bytes" if config.max_bytes and config.max_bytes > 0 else "no"
    print(
        f"stream {config.name} takes {', '.join(config.subjects or [])}: "
        f"{config.num_replicas} replica(s), {limit} limit", file=sys.stderr,
    )
    return 0


def _keygen(host: str, path: str) -> int:
    from ._args import name_problem
    from ._signing import new_key, public_line, write_key

    problem = name_problem(host)
    if problem:
        print(f"aperf.fleet: --host: the host name {problem}", file=sys.stderr)
        return 2
    key = new_key()
    try:
        write_key(key, path)
    except OSError as exc:
        print(f"aperf.fleet: --key: cannot create {path}: {exc.strerror}", file=sys.stderr)
        return 2
    print(public_line(host, key))
    return 0


if __name__ == "__main__":
    sys.exit(main())
