"""Write docs/api.md from the docstrings of aperf's public names.

    python scripts/apidoc.py          # rewrites docs/api.md
    python scripts/apidoc.py --check  # exits 1 if docs/api.md is out of date
"""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

import aperf
import aperf.decoders
import aperf.fleet
import aperf.fleet.testing
import aperf.testing

OUT = Path(__file__).resolve().parent.parent / "docs" / "api.md"


def _doc(obj: object) -> str:
    return inspect.cleandoc(inspect.getdoc(obj) or "(undocumented)")


def _signature(obj: object) -> str:
    try:
        text = str(inspect.signature(obj))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return ""
    text = re.sub(r"ForwardRef\('([^']*)'\)", r"\1", text).replace("'", "")
    return text.replace("(self, ", "(").replace("(self)", "()")


def _members(cls: type) -> list[str]:
    lines = []
    for name, member in vars(cls).items():
        if name.startswith("_") and name not in ("__aiter__", "__enter__", "__aenter__"):
            continue
        if isinstance(member, property):
            first = _doc(member).splitlines()[0] if member.__doc__ else ""
            lines.append(f"- `.{name}`" + (f": {first}" if first else ""))
        elif callable(member) or isinstance(member, classmethod | staticmethod):
            func = member.__func__ if isinstance(member, classmethod | staticmethod) else member
            first = _doc(func).splitlines()[0] if func.__doc__ else ""
            lines.append(f"- `.{name}{_signature(func)}`" + (f": {first}" if first else ""))
    return lines


def render() -> str:
    parts = [
        "# API reference",
        "",
        "Generated from the docstrings by `python scripts/apidoc.py`; do not edit by hand.",
        "",
    ]
    for module, names in (
        (aperf, aperf.__all__),
        (aperf.decoders, aperf.decoders.__all__),
        (aperf.testing, aperf.testing.__all__),
        (aperf.fleet, aperf.fleet.__all__),
        (aperf.fleet.testing, aperf.fleet.testing.__all__),
    ):
        parts += [f"## `{module.__name__}`", "", _doc(module), ""]
        for name in names:
            obj = getattr(module, name)
            if not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            kind = "class" if inspect.isclass(obj) else "def"
            parts += [f"### {kind} `{module.__name__}.{name}{_signature(obj)}`", "", _doc(obj), ""]
            if inspect.isclass(obj) and not issubclass(obj, BaseException):
                parts += [*_members(obj), ""]
    return "\n".join(parts).rstrip() + "\n"


if __name__ == "__main__":
    text = render()
    if "--check" in sys.argv:
        sys.exit(0 if OUT.exists() and OUT.read_text() == text else 1)
    OUT.write_text(text)
