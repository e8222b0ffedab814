"""The user ring buffer protocol, producer's side, sans I/O (``BPF_MAP_TYPE_USER_RINGBUF``).

The BPF ring buffer's protocol with the roles swapped (``kernel/bpf/ringbuf.c``):
user space reserves a record (header BUSY, then ``producer_pos`` moves on),
writes the data and clears BUSY (or sets DISCARD); a BPF program drains with
``bpf_user_ringbuf_drain()``, which stops at the first BUSY record and moves
``consumer_pos``. On x86-64 (TSO) plain stores in that order are what the
kernel's acquire loads need. Nothing here knows about fds or mmap: a
``UserRingWriter`` works on any buffer with the mapping's layout.
"""

from __future__ import annotations

import contextlib
from typing import Any

from ..._errors import ArgumentError
from .format import BUSY_BIT, DISCARD_BIT, HEADER_SIZE, LENGTH_MASK


def record_step(length: int) -> int:
    """Bytes a message of ``length`` bytes takes in the ring: header, data, padding to 8."""
    return (length + HEADER_SIZE + 7) & ~7


class UserRingWriter:
    """The producer's side of the protocol on memory with the mapping's layout, sans I/O.

    ``consumer`` is the consumer page, ``producer`` the producer page followed by
    the data area (``size`` bytes, twice) at ``data_offset``; a bytearray works
    in tests as well as the mapping. One writer per ring: the kernel's protocol
    has a single producer.
    """

    def __init__(self, consumer: Any, producer: Any, data_offset: int, size: int) -> None:
        if size <= 0 or size & (size - 1) or size % 8:
            raise ValueError(f"user ring buffer size {size} is not a power of two of at least 8")
        self.size = size
        self._mask = size - 1
        self._offset = data_offset
        self._consumer = memoryview(consumer)[:8].cast("Q")
        self._data = memoryview(producer)
        self._producer = self._data[:8].cast("Q")
        self._words = self._data.cast("I")
        self._pending: dict[int, tuple[memoryview, int, int]] = {}  # id(view) -> reservation

    def check_size(self, length: int, argument: str = "size") -> None:
        if isinstance(length, bool) or not isinstance(length, int):
            raise TypeError(f"{argument} must be an int, not {type(length).__name__}")
        if length <= 0 or length > LENGTH_MASK or record_step(length) > self.size:
            raise ArgumentError(
                argument,
                f"a message of {length} bytes cannot go into a {self.size}-byte user ring "
                f"buffer: 1 to {self.size - HEADER_SIZE} bytes (8 of each record are its header)",
            )

    def free_bytes(self) -> int:
        """Bytes the ring has room for now (headers and padding count)."""
        return self.size - int(self._producer[0] - self._consumer[0])

    def reserve(self, length: int) -> memoryview | None:
        """A writable view of ``length`` bytes in the ring, or None if there is no room."""
        step = record_step(length)
        prod = self._producer[0]
        if step > self.size - (prod - self._consumer[0]):
            return None
        at = self._offset + (prod & self._mask)
        self._words[at >> 2] = length | BUSY_BIT
        self._words[(at >> 2) + 1] = 0
        self._producer[0] = prod + step  # after the header: the kernel stops at BUSY
        view = self._data[at + HEADER_SIZE : at + HEADER_SIZE + length]
        self._pending[id(view)] = (view, at >> 2, length)
        return view

    def commit(self, view: memoryview, *, discard: bool = False) -> None:
        """Hand the reservation to the kernel (or drop it); the view is released."""
        entry = self._pending.get(id(view))
        if entry is None or entry[0] is not view:
            raise ArgumentError(
                "buffer", "not a pending reservation of this user ring buffer (submitted "
                "or discarded already, or from another one)",
            )
        del self._pending[id(view)]
        _, word, length = entry
        with contextlib.suppress(BufferError):  # exported further: the mapping outlives it
            view.release()
        self._words[word] = length | (DISCARD_BIT if discard else 0)  # after the data

    def pending(self) -> int:
        return len(self._pending)

    def release(self, *, discard_pending: bool) -> None:
        """Release every view; with ``discard_pending``, drop pending reservations first
        (a BUSY record would stop the kernel's drain for good)."""
        for view, word, length in list(self._pending.values()):
            if discard_pending:
                self._words[word] = length | DISCARD_BIT
            with contextlib.suppress(BufferError):
                view.release()
        self._pending.clear()
        for own in (self._producer, self._words, self._consumer):
            own.release()
        with contextlib.suppress(BufferError):
            self._data.release()
