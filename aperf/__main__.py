"""``python -m aperf COMMAND ...``: aperf's tools: ``trace`` (also ``aperf-trace``) and
``doctor`` (what this machine has of what aperf needs)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

USAGE = """usage: python -m aperf COMMAND [ARGS...]

commands:
  trace    trace process exec and exit events (the same as aperf-trace)
  doctor   check what this machine and process have of what aperf needs (--json)

python -m aperf trace --help shows the tracer's options."""


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "trace":
        from ._tools.trace.cli import main as trace

        return trace(args[1:], command="python -m aperf trace")
    if args and args[0] == "doctor":
        from ._tools.doctor import main as doctor

        return doctor(args[1:])
    if args and args[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    what = f"unknown command {args[0]!r}" if args else "a command is needed"
    print(f"{USAGE}\n\npython -m aperf: error: {what}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
