"""The fenced code blocks of README.md, docs/**/*.md and the API's docstrings.

tests/docs/test_docs.py runs them. A block is run according to its language and to
the directives of an HTML comment on the line right above its fence (invisible
on the rendered page), separated by ``;``:

- ``not run: REASON``: never run; the reason is required (and is the last
  directive of its comment, so it may hold anything).
- ``needs root``: runs in the kernel tier (it loads BPF programs, as root).
- ``needs the toolchain``: runs in the kernel tier too, where ``scripts/setup.sh``
  has installed clang and bpftool and built ``bpf/*.bpf.o`` (no root needed).
- ``runs until Ctrl-C``: a command that runs until stopped. Each command (each
  line of a shell block, backslash continuations joined, or the whole Python
  block) is started in its own process group, must print a first line to
  stdout, then gets SIGINT (what Ctrl-C sends to the terminal's foreground
  group), and must exit with status 0 and no traceback. Meanwhile the runner
  starts short processes (``sleep``), so that tracers have something to show.
- ``runs until SIGTERM``: the same with SIGTERM (``kill``, ``systemctl stop``);
  a block with both directives is run once with each.
- ``expect: REGEX``: what the block prints (stdout and stderr, as a terminal
  shows them) must match (``re.MULTILINE``). Like ``not run``, it is the last
  directive of its comment: the regex may hold ``;``.
- ``in a scratch copy of: DIR``: runs in a temporary directory holding a copy
  of the checkout's DIR (for commands that write files there).
- ``timeout: SECONDS``: instead of the default.
- ``excerpt of: PATH``: not run; its lines must appear in PATH (relative to
  the checkout) in the same order, comments after the code aside. Lines of PATH
  may be left out in between, and a ``...`` line, which tells the reader so, is
  not looked for.

- ``run``: nothing special; a shell block that is safe to run as written.

``python`` blocks run as a script with the interpreter running the tests, unless
marked otherwise. ``sh``/``bash`` blocks run with ``bash -euo pipefail`` only when
a directive above says how (``run`` at least): commands can install packages or
start servers, so a shell block without a directive is an error, never run (a
page merged from elsewhere must not change the machine the tests run on). Both
run from the root of the checkout, with the virtual environment's ``bin``
removed from ``PATH`` (a reader who did not activate it types
``.venv/bin/python``). Blocks in other languages (output, C, JSON, ...) are not
run; they may be marked ``excerpt of``.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUNNABLE = {"python", "sh", "bash"}
SHELL = {"sh", "bash"}
HOW_TO_RUN = {
    "run", "needs root", "needs the toolchain", "runs until Ctrl-C", "runs until SIGTERM",
    "expect", "in a scratch copy of", "timeout",
}
DIRECTIVES = HOW_TO_RUN | {"not run", "excerpt of"}
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```+|~~~+)[ \t]*(?P<lang>[\w+-]*)")
_COMMENT = re.compile(r"^\s*<!--\s*(?P<body>.*?)\s*-->\s*$")


@dataclass
class Block:
    """One fenced block: where it is, its language, its code, its directives."""

    where: str  # "docs/rings.md:91" or "aperf.testing.Producer (docstring)"
    lang: str
    code: str
    directives: dict[str, str] = field(default_factory=dict)

    @property
    def runnable(self) -> bool:
        if self.lang not in RUNNABLE or {"not run", "excerpt of"} & set(self.directives):
            return False
        return self.lang not in SHELL or bool(HOW_TO_RUN & set(self.directives))

    @property
    def kernel_tier(self) -> bool:
        return "needs root" in self.directives or "needs the toolchain" in self.directives


def parse_directives(comment: str) -> dict[str, str]:
    """``"needs root; expect: x"`` -> ``{"needs root": "", "expect": "x"}``."""
    out: dict[str, str] = {}
    rest = comment
    while rest:
        if rest.startswith(("not run", "expect")):  # the rest of the comment is the value
            key, _, value = rest.partition(":")
            out[key.strip()] = value.strip()
            break
        item, _, rest = rest.partition(";")
        key, _, value = item.partition(":")
        out[key.strip()] = value.strip()
        rest = rest.strip()
    return out


def blocks_in(text: str, origin: str, first_line: int = 1) -> Iterator[Block]:
    """Every fenced block of a Markdown text; ``origin`` names the text in ids."""
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.group("indent"), m.group("fence"), m.group("lang")
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        body = [ln[len(indent):] if ln.startswith(indent) else ln for ln in lines[i + 1:end]]
        above = lines[i - 1] if i > 0 else ""
        c = _COMMENT.match(above)
        directives = parse_directives(c.group("body")) if c else {}
        yield Block(f"{origin}:{first_line + i}", lang, "\n".join(body) + "\n", directives)
        i = end + 1


def doc_files() -> list[Path]:
    """README.md and every Markdown page under docs/, whoever added it."""
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def reference_targets() -> list[str]:
    """The objects the API reference shows: every ``::: NAME`` in docs/reference/."""
    names = []
    for page in sorted((REPO / "docs" / "reference").glob("*.md")):
        names += re.findall(r"^::: *([\w.]+)", page.read_text(), flags=re.MULTILINE)
    return names


def resolve(name: str) -> object:
    """The object a dotted name names (a module, or an attribute of one)."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(name)


def docstring_blocks() -> Iterator[Block]:
    """The fenced blocks of the docstrings the API reference shows (members included)."""
    for name in reference_targets():
        obj = resolve(name)
        docs = [(name, inspect.getdoc(obj) or "")]
        if inspect.isclass(obj):
            for attr, member in vars(obj).items():
                if not attr.startswith("_"):
                    target = getattr(member, "__func__", getattr(member, "fget", member))
                    docs.append((f"{name}.{attr}", inspect.getdoc(target) or ""))
        for where, doc in docs:
            yield from blocks_in(doc, f"{where} (docstring)")


def all_blocks() -> list[Block]:
    found: list[Block] = []
    for path in doc_files():
        found += blocks_in(path.read_text(), str(path.relative_to(REPO)))
    found += docstring_blocks()
    return found


def excerpt_mismatch(code: str, source: str) -> str | None:
    """None if every line of ``code`` occurs in ``source`` in order, else the first that does not.

    Lines are compared without their leading and trailing blanks and without a
    comment after the code (a page may annotate a line differently); ``...``
    lines (which tell the reader that lines were left out) are not looked for.
    """
    wanted = [_code_of(line) for line in code.split("\n") if line.strip()]
    have = [_code_of(line) for line in source.split("\n")]
    pos = 0
    for line in wanted:
        if line == "...":
            continue
        try:
            pos = have.index(line, pos) + 1
        except ValueError:
            return line
    return None


_TRAILING_COMMENT = re.compile(r"\s+(#|//|/\*).*$")


def _code_of(line: str) -> str:
    return _TRAILING_COMMENT.sub("", line.strip())


def shell_commands(code: str) -> list[str]:
    """The commands of a shell block: one a line, backslash continuations joined, no comments."""
    commands, pending = [], ""
    for line in code.splitlines():
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        command = pending + line
        pending = ""
        if command.strip() and not command.lstrip().startswith("#"):
            commands.append(command)
    return commands
