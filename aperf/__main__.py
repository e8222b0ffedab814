"""``python -m aperf COMMAND ...``: aperf's tools: ``trace`` (also ``aperf-trace``) and
``record`` (any map of any BPF object, to Parquet files), ``doctor`` (what this machine
has of what aperf needs); and ``python -m aperf --include-dir``, the directory of aperf's
BPF header for ``clang -I``."""

from __future__ import annotations

import sys
from collections.abc import Sequence

USAGE = """usage: python -m aperf COMMAND [ARGS...]

commands:
  trace    trace process exec and exit events (the same as aperf-trace)
  record   record a map of a BPF object to Parquet files (docs/recording.md)
  doctor   check what this machine and process have of what aperf needs (--json)

options:
  --include-dir  print the directory of aperf's BPF header, for clang -I
                 (#include <aperf/buffer.bpf.h>)

python -m aperf COMMAND --help shows a command's options."""


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "trace":
        from ._tools.trace.cli import main as trace

        return trace(args[1:], command="python -m aperf trace")
    if args and args[0] == "doctor":
        from ._tools.doctor import main as doctor

        return doctor(args[1:])
    if args and args[0] == "record":
        from ._tools.record import main as record

        return record(args[1:])
    if args == ["--include-dir"]:
        from ._bpf.header import include_dir

        print(include_dir())
        return 0
    if args and args[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    what = f"unknown command {args[0]!r}" if args else "a command is needed"
    print(f"{USAGE}\n\npython -m aperf: error: {what}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
