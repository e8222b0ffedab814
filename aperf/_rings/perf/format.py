"""The perf ring format, sans I/O: byte-ring arithmetic and record parsing.

Nothing here knows about libbpf, fds or event loops: a ``PerfRing``
works on any object with the ``RingMemoryLike`` shape (the mmapped ring
of a perf event, or plain memory in ``aperf.testing``).
"""

from __future__ import annotations

import struct
from typing import Protocol

from ..._errors import ArgumentError, BrokenRingError
from ..seam import Run, RunEnd, Segment, Split

PERF_RECORD_LOST = 2
PERF_RECORD_SAMPLE = 9

_HEADER = struct.Struct("<IHH")  # perf_event_header: u32 type, u16 misc, u16 size
_RAW_SIZE = struct.Struct("<I")  # PERF_SAMPLE_RAW: u32 size, then the bytes
_LOST_COUNT = struct.Struct("<Q")  # PERF_RECORD_LOST: u64 id, u64 lost
HEADER_SIZE = _HEADER.size
MAX_SAMPLE_BYTES = ((0xFFFF - HEADER_SIZE) & ~7) - 4
"""The largest sample payload a perf record holds (65,516 bytes): the record's u16 size
counts the header, the u32 raw size and the padding to 8 bytes."""



def span_length(key: int, head: int, tail: int, size: int) -> int:
    """Bytes written and not yet read, between a ring's ``tail`` (or read position) and
    ``head``; ``BrokenRingError`` if they are further apart than the ring is big."""
    length = head - tail
    if length < 0 or length > size:
        raise BrokenRingError(
            key, f"head {head} and tail {tail} are {length} bytes apart in a {size}-byte ring"
        )
    return length

class RingMemoryLike(Protocol):
    size: int

    def positions(self) -> tuple[int, int]: ...

    def copy(self, offset: int, length: int) -> bytes: ...

    def set_tail(self, tail: int) -> None: ...


class PerfRing:
    """One perf ring: takes the readable span out of its memory and releases it at once.

    ``key`` is the CPU, ``handle`` the readiness handle; a backend that keeps
    its own count of dropped samples overrides ``lost_total()``.
    """

    __slots__ = ("_mask", "handle", "key", "memory")

    def __init__(self, key: int, handle: int, memory: RingMemoryLike) -> None:
        size = memory.size
        if size <= 0 or size & (size - 1):
            raise ValueError(f"ring data size {size} is not a power of two")
        self.key = key
        self.handle = handle
        self.memory = memory
        self._mask = size - 1

    def pending_bytes(self) -> int:
        head, tail = self.memory.positions()
        return head - tail

    def lost_total(self) -> int | None:
        return None

    def take(self) -> bytes:
        """Copy every complete record out of the ring (wrapping span joined) and free the space."""
        memory = self.memory
        head, tail = memory.positions()
        size = self._mask + 1
        length = span_length(self.key, head, tail, size)
        if length == 0:
            return b""
        start = tail & self._mask
        first = size - start
        if length <= first:
            span = memory.copy(start, length)
        else:
            span = memory.copy(start, first) + memory.copy(0, length - first)
        memory.set_tail(head)
        return span


def uniform_run_end(span: bytes, pos: int, size: int, end: int) -> int:
    """End of the run of identical sample records starting at ``pos``.

    ``pos`` if fewer than two records are in line, -1 if they are not identical.

    The run stops in front of the first lost record, found by a C-speed search
    of the type bytes at every ``size`` stride; the 12 header and raw-size bytes
    of the whole run are then compared column by column with strided slices.
    """
    lost_at = span[pos:end:size].find(PERF_RECORD_LOST.to_bytes(1, "little"))
    count = (end - pos) // size if lost_at < 0 else lost_at
    if count < 2:
        return pos
    stop = pos + count * size
    for column in range(pos, pos + 12):
        if span[column:stop:size] != span[column : column + 1] * count:
            return -1
    return stop


def split_span(
    cpu: int, span: bytes, run_end: RunEnd = uniform_run_end
) -> tuple[list[Segment], int]:
    """Parse a span into segments, in ring order, and count the other records (skipped).

    A segment is a `Run` of identical sample records (the common case of
    one program emitting one struct: found at C speed, also between lost
    records, and left in place in the span), a list of sample payloads
    (``bytes``, each as the kernel padded it) parsed one by one with a flag
    saying they all have one size, or a lost count (``int``). ``run_end`` finds
    where a run ends (a NumPy version serves columnar consumers). Raises
    ``BrokenRingError`` on a record that does not fit; its ``partial``
    holds the segments before it, which are intact.
    """
    segments: list[Segment] = []
    single: list[bytes] = []  # samples parsed one at a time, not yet a segment
    try:
        other = _split(cpu, span, segments, single, run_end)
    except BrokenRingError as exc:
        if single:
            segments.append((single, False))
        exc.partial = segments
        raise
    if single:
        segments.append((single, False))
    return segments, other


def _split(
    cpu: int, span: bytes, segments: list[Segment], single: list[bytes], run_end: RunEnd
) -> int:
    other = 0
    end = len(span)
    pos = 0
    fast = True  # cleared for the rest of the span once a run fails to verify
    unpack_header = _HEADER.unpack_from
    unpack_raw = _RAW_SIZE.unpack_from
    while pos < end:
        if end - pos < HEADER_SIZE:
            raise BrokenRingError(cpu, f"{end - pos} trailing bytes are shorter than a header")
        kind, _misc, size = unpack_header(span, pos)
        if size < HEADER_SIZE or pos + size > end:
            raise BrokenRingError(cpu, f"record at byte {pos} claims size {size} of {end - pos}")
        if kind == PERF_RECORD_SAMPLE:
            if size < 12:
                raise BrokenRingError(cpu, f"sample at byte {pos} is only {size} bytes")
            raw = unpack_raw(span, pos + 8)[0]
            if 12 + raw > size:
                raise BrokenRingError(cpu, f"sample at byte {pos} claims {raw} raw bytes in {size}")
            if fast:
                stop = run_end(span, pos, size, end)
                if stop > pos:
                    if single:
                        segments.append((single.copy(), False))
                        single.clear()
                    segments.append(Run(span, pos, (stop - pos) // size, size, 12, raw))
                    pos = stop
                    continue
                # A failed check is not retried record by record (that would be
                # quadratic); the next lost record starts a fresh attempt.
                fast = stop == pos
            single.append(span[pos + 12 : pos + 12 + raw])
        elif kind == PERF_RECORD_LOST:
            if size < 24:
                raise BrokenRingError(cpu, f"lost record at byte {pos} is only {size} bytes")
            if single:
                segments.append((single.copy(), False))
                single.clear()
            segments.append(_LOST_COUNT.unpack_from(span, pos + 16)[0])
            fast = True
        else:
            other += 1
        pos += size
    return other


def encode_sample(payload: bytes) -> bytes:
    """A PERF_RECORD_SAMPLE record as the kernel writes it (for fakes and tests).

    Like the kernel, it pads the raw data so that u32 size + data is a multiple
    of 8, and the size field counts the padding. A payload over ``MAX_SAMPLE_BYTES``
    (65,516) does not fit a record: [`ArgumentError`][aperf.ArgumentError].
    """
    if len(payload) > MAX_SAMPLE_BYTES:
        raise ArgumentError(
            "payload", f"a {len(payload)}-byte sample does not fit a perf record: at most "
            f"{MAX_SAMPLE_BYTES} bytes (its u16 size counts the 12-byte header and padding)"
        )
    padded = ((len(payload) + 4 + 7) & ~7) - 4
    body = _RAW_SIZE.pack(padded) + payload.ljust(padded, b"\0")
    return _HEADER.pack(PERF_RECORD_SAMPLE, 0, HEADER_SIZE + len(body)) + body


def encode_lost(count: int, event_id: int = 0) -> bytes:
    """A PERF_RECORD_LOST record as the kernel writes it (for fakes and tests)."""
    return _HEADER.pack(PERF_RECORD_LOST, 0, 24) + struct.pack("<QQ", event_id, count)


class PerfRecords:
    """The record format of perf rings (``perf_event_header`` records)."""

    name = "perf"
    lost_records = True

    @staticmethod
    def split(
        key: int, span: bytes, run_end: RunEnd = uniform_run_end
    ) -> tuple[list[Segment], int]:
        return split_span(key, span, run_end)

    @staticmethod
    def columnar_split() -> Split:
        """The split for columnar consumers (``seam.ColumnarRecords``): runs found with
        NumPy (``runs.py``, imported now), a fresh finder per span."""
        from .runs import RunFinder

        def split(key: int, span: bytes) -> tuple[list[Segment], int]:
            return split_span(key, span, RunFinder(uniform_run_end))

        return split


PERF_RECORDS = PerfRecords()
