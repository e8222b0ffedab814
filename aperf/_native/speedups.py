"""aperf's optional compiled fast path, or None in its place: which one runs.

``_speedups.c`` (a CPython extension on the limited API, one abi3 build for every
CPython from 3.11) does in C what some pure-Python functions of aperf do, with the same
results: the perf and ring buffer record scans, the take of a perf ring, the drain
tick's look at every ring's head, the building of events and the step of ``async for``.
The pure functions stay the reference and run wherever it is missing: a wheel or an
sdist built without a compiler, CPython 3.10, another interpreter, or
``APERF_NO_EXTENSIONS=1`` in the environment (read once, at import). The modules that
use it take each name from here and fall back when it is None, as msgpack, aiohttp and
MarkupSafe do with theirs.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from .._errors import BrokenRingError, ClosedResourceError

if TYPE_CHECKING:
    from . import _speedups as _module

FORCED_PURE = os.environ.get("APERF_NO_EXTENSIONS", "").strip().lower() not in ("", "0", "false",
                                                                                 "no")
"""``APERF_NO_EXTENSIONS`` is set to anything but ``0``/``false``/``no``: run pure."""

_speedups: Any = None
WHY_PURE: str | None = None
"""Why the pure path runs (None: the compiled one does)."""

if FORCED_PURE:
    WHY_PURE = "APERF_NO_EXTENSIONS is set"
else:
    try:
        from . import _speedups
    except ImportError as exc:  # not built into this installation, or built for another ABI
        WHY_PURE = f"the compiled module did not load ({exc})"
    else:
        _speedups.setup(BrokenRingError, ClosedResourceError)

EXTENSIONS: bool = _speedups is not None
"""Whether aperf's compiled fast path runs in this process: True with the platform wheel
(CPython 3.11+, Linux), False on the pure-Python path, which does the same with the same
results, more slowly (the `py3-none-any` wheel, a build without a compiler, or
``APERF_NO_EXTENSIONS=1`` set before aperf is imported). See [install](../install.md)."""

perf_split: _module.PerfSplit | None = getattr(_speedups, "perf_split", None)
ringbuf_split: _module.RingbufSplit | None = getattr(_speedups, "ringbuf_split", None)
ringbuf_committed_end: _module.CommittedEnd | None = getattr(
    _speedups, "ringbuf_committed_end", None)
build_run: _module.BuildRun | None = getattr(_speedups, "build_run", None)
build_payloads: _module.BuildPayloads | None = getattr(_speedups, "build_payloads", None)
RingCell: type[_module.RingCell] | None = getattr(_speedups, "RingCell", None)
RingWatch: type[_module.RingWatch] | None = getattr(_speedups, "RingWatch", None)
Items: type[_module.Items] | None = getattr(_speedups, "Items", None)


def status() -> str:
    """One line saying which path runs, for ``aperf-trace -v`` and bug reports."""
    if _speedups is not None:
        return f"compiled fast path ({os.path.basename(_speedups.__file__)})"
    return f"pure Python: {WHY_PURE}"
