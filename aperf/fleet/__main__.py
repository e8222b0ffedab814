"""``python -m aperf.fleet create-stream --nats URL``: make the JetStream stream a fleet uses."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from ._connect import DEFAULT_JETSTREAM, DEFAULT_PREFIX, create_stream
from ._errors import FleetConfigError


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aperf.fleet")
    commands = parser.add_subparsers(dest="command", required=True)
    create = commands.add_parser(
        "create-stream", help="create (or update) the JetStream stream aperf sinks publish to"
    )
    create.add_argument("--nats", required=True, metavar="URL", help="the NATS server")
    create.add_argument("--jetstream", default=DEFAULT_JETSTREAM, metavar="NAME")
    create.add_argument("--subject-prefix", default=DEFAULT_PREFIX, metavar="PREFIX")
    create.add_argument(
        "--max-bytes", type=int, default=1 << 30, metavar="N",
        help="the most bytes the stream keeps (default 1 GiB)",
    )
    create.add_argument("--max-age", type=float, metavar="SECONDS", help="the oldest it keeps")
    create.add_argument(
        "--discard", choices=("old", "new"), default="old",
        help="at a limit: drop the oldest messages (readers see Gaps), or refuse new ones "
        "(sinks wait, kernels count the drops)",
    )
    create.add_argument("--memory", action="store_true", help="memory storage, not files")
    args = parser.parse_args(argv)
    try:
        asyncio.run(
            create_stream(
                args.nats, jetstream=args.jetstream, subject_prefix=args.subject_prefix,
                max_bytes=args.max_bytes, max_age=args.max_age, discard=args.discard,
                memory=args.memory,
            )
        )
    except FleetConfigError as exc:
        print(f"aperf.fleet: {exc}", file=sys.stderr)
        return 1
    print(f"stream {args.jetstream} takes {args.subject_prefix}.>", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
