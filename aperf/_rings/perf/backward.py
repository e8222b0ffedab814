"""Reading a backward (overwritable) perf ring, on any memory.

A perf event opened with ``write_backward`` and mapped read-only makes the kernel
write each record *below* the previous one and overwrite the oldest when the ring
is full: it keeps the newest records and never drops. ``data_head`` starts at 0
and goes down (mod 2**64); the newest record starts at ``data_head``, the next
older one right after it, and so on up to the position the ring started at, or
up to the first record that reaches past one ring's length from the head (its
tail was overwritten by newer records).
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["newest_records"]

_HEADER = 8  # struct perf_event_header: u32 type, u16 misc, u16 size
_U64 = 1 << 64


def newest_records(head: int, data_size: int, copy: Callable[[int, int], bytes]) -> bytes:
    """The complete records of a backward ring, oldest first, as one span.

    ``head`` is ``data_head``; ``copy(offset, length)`` reads the data area
    (``offset + length <= data_size``). The walk goes from the newest record to
    older ones by each header's size and stops at the ring's start or before a
    record that would overlap data already overwritten (or a size that cannot be
    a record's): a bounded walk whatever the memory holds.
    """
    written = (_U64 - head) % _U64  # bytes written since the ring opened
    length = min(written, data_size)
    if not length:
        return b""
    start = head % data_size
    first = min(length, data_size - start)
    span = copy(start, first) + (copy(0, length - first) if first < length else b"")
    records: list[bytes] = []
    pos = 0
    while pos + _HEADER <= length:
        size = int.from_bytes(span[pos + 6 : pos + 8], "little")
        if size < _HEADER or pos + size > length:
            break
        records.append(span[pos : pos + size])
        pos += size
    records.reverse()
    return b"".join(records)
