"""The two drivers' shared text, written once and copied, as httpcore's scripts/unasync.py
writes its sync twin from the async code.

``PerfStream`` (aperf/_drivers/stream.py) is the source, ``PerfBuffer``
(aperf/_drivers/sync.py) the twin:

- The keywords both take (``SHARED``) are described in PerfStream's docstring (its
  ``Args:`` entries); PerfBuffer's docstring gets the same entries, with the few
  words that differ replaced (``SUBS``). Both docstrings keep every entry, so
  ``help()`` and the API reference show every keyword.
- Each driver's three ``__init__`` overloads (no decoder; a decoder by name, class,
  ``struct.Struct`` or per map; a decoder function) are written from the signature of
  its own ``__init__``: add a keyword there and every overload has it.

Edit PerfStream's entries or either ``__init__``, then run::

    .venv/bin/python scripts/driver_keywords.py          # rewrites what is generated
    .venv/bin/python scripts/driver_keywords.py --check  # exit 1 and a diff if it drifted

scripts/check.sh and tests/unit/test_driver_keywords.py run ``--check``.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import re
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STREAM = Path("aperf/_drivers/stream.py")
SYNC = Path("aperf/_drivers/sync.py")

SHARED = (
    "source", "pages", "ring_bytes", "decoder", "wakeup", "max_pending", "decode_errors",
    "cpus", "map_keys", "memory_bytes", "take_over", "overwritable", "order_by", "lateness",
)
"""The keywords whose ``Args:`` entry PerfBuffer takes from PerfStream."""

SUBS = {
    "max_pending": [("events the stream queues", "events the buffer queues")],
    "decode_errors": [(
        "raised to the consumer where", "raised out of ``poll()``/``consume()`` where",
    )],
    "take_over": [(
        '"Two readers of one map").',
        '"Two readers of one map"). This buffer, if taken over, learns it in ``poll()``, '
        "which then raises ``aperf.TakenOverError`` after the events it had.",
    )],
}
"""PerfStream's words -> PerfBuffer's, per entry (an entry changed so is wrapped anew)."""

OVERLOADS = (
    ("None", "decoder: None = ..."),
    ("Any", "decoder: str | type | struct.Struct | Mapping[str, Any]"),
    ("T", "decoder: Callable[[bytes], T]"),
)
"""Each overload: the stream's type argument, and its ``decoder`` parameter."""

TYPED = {
    "PerfStream": {"on_batch": "Callable[[list[Event[{T}]]], Any] | None"},
    "PerfBuffer": {"on_sample": "Callable[[Sample[{T}]], Any] | None"},
}
"""The parameters whose type names the overload's type argument ``{T}``; every other one
is typed as in ``__init__``."""

ENTRY = re.compile(r" {8}(\w+): ")
WIDTH = 92  # as the entries are wrapped by hand


class DriftError(Exception):
    """The generated text cannot be made (the source changed under SUBS or SHARED)."""


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise DriftError(f"no class {name}")


def _args_entries(lines: list[str], cls: ast.ClassDef) -> tuple[int, int, dict[str, list[str]]]:
    """The ``Args:`` section of the class docstring: (first line, end line, the entries
    by keyword, each its source lines), line numbers 0-based."""
    doc = cls.body[0]
    if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)):
        raise DriftError(f"{cls.name} has no docstring")
    start = next((i + 1 for i in range(doc.lineno - 1, doc.end_lineno or 0)
                  if lines[i] == "    Args:"), None)
    if start is None:
        raise DriftError(f"{cls.name}'s docstring has no Args: section")
    entries: dict[str, list[str]] = {}
    end = start
    while end < len(lines):
        match = ENTRY.match(lines[end])
        if match:
            entries[match.group(1)] = [lines[end]]
        elif lines[end].startswith(" " * 12) and entries:
            entries[list(entries)[-1]].append(lines[end])
        else:
            break
        end += 1
    return start, end, entries


def _twin_entry(name: str, lines: list[str]) -> list[str]:
    """PerfStream's entry for ``name`` as PerfBuffer's."""
    subs = SUBS.get(name)
    if not subs:
        return lines
    text = " ".join(line.strip() for line in lines)
    for old, new in subs:
        if old not in text:
            raise DriftError(f"PerfStream's {name} entry no longer says {old!r}: mend SUBS")
        text = text.replace(old, new)
    first = f"        {name}: "
    return textwrap.wrap(text[len(name) + 2:], WIDTH, initial_indent=first,
                         subsequent_indent=" " * 12, break_long_words=False,
                         break_on_hyphens=False)


def _overloads(text: str, cls: ast.ClassDef) -> tuple[int, int, list[str]]:
    """(first line, end line, the overloads as they should be) of the class's __init__."""
    inits = [node for node in cls.body
             if isinstance(node, ast.FunctionDef) and node.name == "__init__"]
    overloads = [f for f in inits if any(getattr(d, "id", "") == "overload"
                                         for d in f.decorator_list)]
    implementation = [f for f in inits if f not in overloads]
    if not overloads or len(implementation) != 1:
        raise DriftError(f"{cls.name}: expected overloads of __init__ and one implementation")
    init = implementation[0].args
    if init.vararg or init.kwarg or init.posonlyargs or init.defaults:
        raise DriftError(f"{cls.name}.__init__: only (self, source, *, keywords...) is written")
    typed = TYPED[cls.name]

    def annotation(arg: ast.arg) -> str:
        if arg.annotation is None:
            raise DriftError(f"{cls.name}.__init__: {arg.arg} has no annotation")
        return ast.get_source_segment(text, arg.annotation) or ""

    out: list[str] = []
    for type_arg, decoder in OVERLOADS:
        out += ["    @overload", "    def __init__(", f"        self: {cls.name}[{type_arg}],"]
        out += [f"        {arg.arg}: {annotation(arg)}," for arg in init.args[1:]]
        out.append("        *,")
        for arg in init.kwonlyargs:
            if arg.arg == "decoder":
                out.append(f"        {decoder},")
            elif arg.arg in typed:
                out.append(f"        {arg.arg}: {typed[arg.arg].format(T=type_arg)} = ...,")
            else:
                out.append(f"        {arg.arg}: {annotation(arg)} = ...,")
        out += ["    ) -> None: ...", ""]
    first = overloads[0].decorator_list[0].lineno - 1
    end = overloads[-1].end_lineno or 0
    return first, end, out[:-1]


def _replace(lines: list[str], start: int, end: int, new: list[str]) -> list[str]:
    return lines[:start] + new + lines[end:]


def _with_overloads(text: str, name: str) -> str:
    lines = text.split("\n")
    first, end, new = _overloads(text, _class(ast.parse(text), name))
    return "\n".join(_replace(lines, first, end, new))


def generate(stream: str, sync: str) -> tuple[str, str]:
    """(stream.py, sync.py) as they should be, given what they are."""
    stream = _with_overloads(stream, "PerfStream")
    sync = _with_overloads(sync, "PerfBuffer")
    _, _, source = _args_entries(stream.split("\n"), _class(ast.parse(stream), "PerfStream"))
    lines = sync.split("\n")
    start, end, twin = _args_entries(lines, _class(ast.parse(sync), "PerfBuffer"))
    for name in SHARED:
        if name not in source or name not in twin:
            raise DriftError(f"{name} is not described in both drivers' docstrings")
        twin[name] = _twin_entry(name, source[name])
    entries = [line for entry in twin.values() for line in entry]
    return stream, "\n".join(_replace(lines, start, end, entries))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 with a diff if a generated part drifted")
    args = parser.parse_args(argv)
    paths = (REPO / STREAM, REPO / SYNC)
    old = tuple(path.read_text() for path in paths)
    try:
        new = generate(*old)
    except DriftError as exc:
        print(f"{Path(__file__).name}: {exc}", file=sys.stderr)
        return 1
    drifted = [(path, a, b) for path, a, b in zip(paths, old, new, strict=True) if a != b]
    if args.check:
        for path, a, b in drifted:
            name = str(path.relative_to(REPO))
            sys.stdout.writelines(difflib.unified_diff(
                a.splitlines(keepends=True), b.splitlines(keepends=True), name, name))
        if drifted:
            print(f"the drivers' shared text drifted: run .venv/bin/python "
                  f"scripts/{Path(__file__).name}", file=sys.stderr)
        return 1 if drifted else 0
    for path, _, b in drifted:
        path.write_text(b)
        print(f"wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
