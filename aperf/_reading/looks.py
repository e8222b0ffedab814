"""The drain tick's look at every ring: which hold something.

A reader's ``watcher()`` is what its tick calls with its rings (a dict, key -> ring): the
keys of those whose ``pending_bytes()`` is not 0, in order. With the compiled fast path
one C call reads the heads of the rings that expose their control page (``_cell``:
the kernel's perf rings) and asks the others; without it, each ring is asked. Either
way an idle ring costs a look at its head, not a drain.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from .._native import speedups


def _pure_busy_rings(rings: Mapping[int, Any]) -> list[int]:
    return [key for key, ring in rings.items() if ring.pending_bytes()]


def watcher() -> Callable[[dict[int, Any]], list[int]]:
    """A ``busy_rings`` of its own (the compiled one remembers the rings it saw)."""
    if speedups.RingWatch is None:
        return _pure_busy_rings
    return speedups.RingWatch().busy

