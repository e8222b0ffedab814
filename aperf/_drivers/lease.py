"""Leases: columnar batches that view the perf rings' memory in place (docs/columnar.md).

Once a stream gives its first lease, each of its perf rings is read through a
``LeaseRing``: a read-only mapping of the ring, made by aperf (a Python
``mmap.mmap``, ``_native/shared_ring.py``; no view of it can be made writable,
where a write would kill the process), that the readable span is viewed in
(a ``_Pin``: a NumPy byte array of that span, the base of every array made from
it) instead of being copied out. ``data_tail`` then advances over a span only
once nothing references its pin any more: not the reader's queue, not an
``aperf.SampleArray``, not an array the user kept (checked with the pin's
reference count, which every view made from it raises: NumPy makes the pin the
base of each of them). So a view never shows recycled ring memory, and the
mapping lives while any view does (even after the stream closed and libbpf
unmapped its own mapping: the kernel keeps the ring's pages for ours).

A lease hands out what is queued (``take_arrays``); when it ends, every
``SampleArray`` it handed out is switched to ``_EndedArray`` (its ``values`` and
``tails`` raise ``ClosedResourceError``; its references to the ring are dropped),
the batch list is emptied, and each ring's ``data_tail`` is stored once, past
every span nothing references any more.

A span that wraps around the end of the ring is copied (cheaper, measured, than
viewing both sides and copying the record across the end); a ring that
is not a directly mapped perf ring (a BPF ring buffer, libbpf's own reader on
other architectures, a fake) is read as ``arrays()`` reads it: copied.
"""

from __future__ import annotations

import sys
from collections import deque
from typing import Any

import numpy as np

from .._errors import ClosedResourceError
from .._events import SampleArray
from .._native.shared_ring import SharedRingMapping
from .._reading.columnar import ArrayItem
from .._reading.reader import Reader
from .._rings.perf.format import span_length
from .._rings.perf.source import _KernelPerfRing

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
_ENDED = ("this array's lease ended: its ring memory was released. Keep what you need "
          "while the lease is held (arr.values.copy())")


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


def enable(reader: Reader) -> list[LeaseRing]:
    """Read ``reader``'s directly mapped perf rings in place from now on (idempotent:
    rings added since, by CPU hotplug, are switched too); its leased rings."""
    reader.columns()
    leased: list[LeaseRing] = []
    if not _IN_PLACE:
        return leased
    for ring in list(reader.rings.values()):
        if ring.__class__ is LeaseRing:
            leased.append(ring)
        elif ring.__class__ is _KernelPerfRing:
            try:
                lease_ring = LeaseRing(ring)
            except (OSError, ValueError):
                continue  # the kernel would not map it again: this ring is copied
            reader.rings.swap(lease_ring)
            leased.append(lease_ring)
    return leased


class _EndedArray(SampleArray):
    """A ``SampleArray`` whose lease ended: it no longer shows anything."""

    __slots__ = ()

    @property
    def values(self) -> Any:
        raise ClosedResourceError(_ENDED)

    @property
    def tails(self) -> Any:  # type: ignore[override]
        raise ClosedResourceError(_ENDED)

    def __len__(self) -> int:
        raise ClosedResourceError(_ENDED)

    def __repr__(self) -> str:
        return f"<SampleArray cpu={self.cpu}, lease ended>"


_SLOTS: dict[str, Any] = dict(vars(SampleArray))
_set_values, _set_tails = _SLOTS["values"].__set__, _SLOTS["tails"].__set__


class Lease:
    """One lease on a reader: ``take()`` the batch, ``end()`` it (idempotent)."""

    __slots__ = ("_batch", "_reader", "_rings", "max_rows")

    def __init__(self, reader: Reader, max_rows: int | None) -> None:
        self._reader = reader
        self.max_rows = max_rows
        self._rings = enable(reader)
        self._batch: list[Any] | None = None

    def started(self, batch: list[Any]) -> list[Any]:
        self._batch = batch
        return batch

    def end(self) -> None:
        batch, self._batch = self._batch, None
        if batch is not None:
            for item in batch:
                if item.__class__ is SampleArray:
                    _set_values(item, None)
                    _set_tails(item, None)
                    item._source = None
                    item.__class__ = _EndedArray
            batch.clear()
        for ring in self._rings:
            ring.release()


class AsyncLease:
    """``async with stream.lease() as batch``: waits for data as ``arrays()`` does."""

    __slots__ = ("_lease", "_reader", "_stream")

    def __init__(self, stream: Any, reader: Reader, max_rows: int | None) -> None:
        self._stream = stream
        self._reader = reader
        self._lease = Lease(reader, max_rows)

    async def __aenter__(self) -> list[ArrayItem]:
        stream, lease = self._stream, self._lease
        while True:
            batch = stream._take_arrays(self._reader, lease.max_rows)
            if batch or stream.closed:
                return lease.started(batch)
            await stream._wait()

    async def __aexit__(self, *exc: object) -> None:
        self._lease.end()


class SyncLease:
    """``with perf_buffer.lease() as batch``: ``wait(timeout_ms)`` fills the batch."""

    __slots__ = ("_buffer", "_lease", "_timeout")

    def __init__(self, buffer: Any, reader: Reader, max_rows: int | None,
                 timeout_ms: float) -> None:
        self._buffer = buffer
        self._timeout = timeout_ms
        self._lease = Lease(reader, max_rows)

    def __enter__(self) -> list[ArrayItem]:
        lease = self._lease
        return lease.started(self._buffer._lease_batch(lease.max_rows, self._timeout))

    def __exit__(self, *exc: object) -> None:
        with self._buffer._lock:
            self._lease.end()
