"""A perf ring read in place, for leases (docs/columnar.md, "Leases").

A ``LeaseRing`` reads a perf ring through a read-only mapping of it made by aperf
(a Python ``mmap.mmap``, ``_native/libc/shared_ring.py``; no view of it can be made
writable, where a write would kill the process): the readable span is viewed in
place (a ``_Pin``: a NumPy byte array of that span, the base of every array made
from it) instead of being copied out. ``data_tail`` then advances over a span only
once nothing references its pin any more: not the reader's queue, not an
``aperf.SampleArray``, not an array the user kept (checked with the pin's reference
count, which every view made from it raises: NumPy makes the pin the base of each of
them). So a view never shows recycled ring memory, and the mapping lives while any
view does (even after the stream closed and libbpf unmapped its own mapping: the
kernel keeps the ring's pages for ours).

A span that wraps around the end of the ring is copied (cheaper, measured, than
viewing both sides and copying the record across the end). ``leased(ring)`` says how a
reader's ring is read in place: a directly mapped perf ring gets a ``LeaseRing``;
any other (a BPF ring buffer, libbpf's own reader on other architectures, a fake)
none, and is read as ``arrays()`` reads it: copied.
"""

from __future__ import annotations

import sys
from collections import deque
from typing import Any

import numpy as np

from ..._native.libc.shared_ring import SharedRingMapping
from ..seam import Ring
from .format import span_length
from .source import _KernelPerfRing

_getrefcount = sys.getrefcount


def _count_unused() -> int:
    """The reference count ``LeaseRing.release`` sees for a pin nothing else holds (the
    holds entry, the loop's variable, getrefcount's argument: 3 on CPython 3.11; taken
    the same way here, so that an interpreter borrowing references differently agrees).
    More than that: something still views the span."""
    holds = deque([(0, object())])
    _end, pin = holds[0]
    return _getrefcount(pin)


_PIN_UNUSED = _count_unused()
# Without the GIL (free-threaded CPython) reference counts are deferred and per thread:
# they cannot say that nothing views a span, so leases copy there.
_IN_PLACE = getattr(sys, "_is_gil_enabled", lambda: True)()


class _Pin(np.ndarray):
    """Bytes of a ring, in place: the span a reader parses and views.

    Slicing it gives ``bytes`` (as slicing a copied span does: payloads and tails
    are the user's own); NumPy views made from it keep it as their base, so its
    reference count says whether anything still shows these bytes.
    """

    def __getitem__(self, index: Any) -> Any:
        if index.__class__ is slice:
            return np.ndarray.__getitem__(self.view(np.ndarray), index).tobytes()
        return np.ndarray.__getitem__(self, index)

    def __bool__(self) -> bool:
        return len(self) > 0


def _pin(mapping: SharedRingMapping, offset: int, length: int) -> _Pin:
    pin = np.ndarray.__new__(_Pin, shape=(length,), dtype=np.uint8, buffer=mapping.mapping,
                             offset=mapping.data_offset + offset)
    pin.flags.writeable = False
    return pin  # type: ignore[no-any-return]


class LeaseRing:
    """A perf ring read in place: ``take()`` views the readable span (copies it if it
    wraps) and holds it; ``release()`` advances ``data_tail`` over the spans nothing
    views any more, in ring order, with one store."""

    __slots__ = ("_cursor", "_holds", "_inner", "_mapping", "_mask", "handle", "key")

    def __init__(self, inner: _KernelPerfRing) -> None:
        self.key = inner.key
        self.handle = inner.handle
        self._inner = inner
        size = inner.memory.size
        self._mapping = SharedRingMapping(inner.handle, size)
        self._mask = size - 1
        self._cursor = self._mapping.tail()  # read up to here (the tail waits for the views)
        self._holds: deque[tuple[int, _Pin | None]] = deque()  # (end, its pin), in order

    def take(self) -> bytes:
        self.release()
        mapping = self._mapping
        head = mapping.head()
        cursor = self._cursor
        size = self._mask + 1
        length = span_length(self.key, head, cursor, size)
        if length == 0:
            return b""
        start = cursor & self._mask
        self._cursor = head
        if start + length <= size:
            pin = _pin(mapping, start, length)
            self._holds.append((head, pin))
            return pin  # type: ignore[return-value]  # bytes-like: what split() needs
        # Wrapped: copied. Measured, that is cheaper than viewing both sides of the end
        # and copying the record across it (two NumPy run checks instead of one).
        first = size - start
        span = mapping.copy(start, first) + mapping.copy(0, length - first)
        self._holds.append((head, None))
        self.release()
        return span

    def release(self) -> None:
        """Store ``data_tail`` past the spans that nothing views any more (in order)."""
        holds = self._holds
        tail = -1
        while holds:
            end, pin = holds[0]
            if pin is not None and _getrefcount(pin) > _PIN_UNUSED:
                break
            holds.popleft()
            tail = end
        if tail >= 0:
            self._mapping.set_tail(tail)

    def held_bytes(self) -> int:
        """Bytes read and still held by views (not yet given back to the kernel)."""
        return self._cursor - self._mapping.tail()

    def pending_bytes(self) -> int:
        return self._mapping.head() - self._cursor

    def lost_total(self) -> int | None:
        return self._inner.lost_total()


def leased(ring: Ring) -> LeaseRing | None:
    """``ring`` read in place: its ``LeaseRing`` (a new one for a directly mapped perf
    ring, itself for one already), or None (it is copied)."""
    if ring.__class__ is LeaseRing:
        return ring
    if ring.__class__ is not _KernelPerfRing or not _IN_PLACE:
        return None
    try:
        return LeaseRing(ring)
    except (OSError, ValueError):
        return None  # the kernel would not map it again: this ring is copied
