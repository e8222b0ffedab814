"""The BPF ring buffer format, sans I/O: the consumer's side of the kernel's protocol.

A ``BPF_MAP_TYPE_RINGBUF`` is one ring shared by every CPU. Its memory, as
the map fd maps it (``kernel/bpf/ringbuf.c``):

- page 0, the *consumer page*, writable: ``u64 consumer_pos`` at byte 0;
- page 1, the *producer page*, read-only: ``u64 producer_pos`` at byte 0;
- then the data area (``max_entries`` bytes, a power of two) mapped *twice*
  in a row, so that a record that wraps around the end reads as one run.

Positions only grow; a position's offset in the data area is ``pos & mask``.
Each record is an 8-byte header (``u32 len``, ``u32 pg_off``) and ``len``
bytes of data, padded to 8 bytes. The top two bits of ``len`` say BUSY
(reserved, not committed yet) and DISCARD (committed, but dropped by the
producer). The consumer reads ``producer_pos``, walks the headers from
``consumer_pos`` and stops at the first BUSY one, copies the committed
records out, then writes the new ``consumer_pos``, which frees their space.

Nothing here knows about fds or mmap: a ``RingBufferRing`` works on any
buffer with the mapping's layout (the mmapped map, or a bytearray in tests).
On x86-64 (TSO) plain loads and stores give most of the ordering the protocol
needs: ``producer_pos`` and the headers are read before the records they cover,
and ``consumer_pos`` is written after the copy (as the perf ring reader relies
on). The one exception is the last look before the reader sleeps, see
``full_fence``.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable
from typing import Any

from ..._errors import BrokenRingError, ClosedResourceError
from ..._native import speedups
from ..seam import Segment

BUSY_BIT = 1 << 31
DISCARD_BIT = 1 << 30
LENGTH_MASK = DISCARD_BIT - 1
HEADER_SIZE = 8
NO_CPU = -1
"""``Sample.cpu`` of a ring buffer's samples: one ring serves every CPU, so none is known."""

_WORD = struct.Struct("<I")
_HEADER = struct.Struct("<II")


_FENCE_LOCK = threading.Lock()


def full_fence() -> None:
    """A full memory barrier on x86-64: no later load moves before an earlier store.

    The reader stores ``consumer_pos``, then loads ``producer_pos`` and the next
    header to decide whether to sleep. The kernel commits a record (``xchg`` of
    its header, a full barrier), then loads ``consumer_pos`` and wakes the reader
    only if the record sits there. x86's TSO lets a load pass an earlier store to
    another address (the store waits in the store buffer), so without a fence
    both sides can read the old values: the reader sees no record, the kernel
    sees a reader that has not caught up, and nobody wakes the reader (nor do the
    records after it, none of which sits at its position) until a drain tick or a
    forced wakeup (aya fixed the same pattern, commit 7277a57e).

    Python has no fence, but taking and releasing an uncontended lock executes
    locked read-modify-write instructions, and a locked instruction is a full
    barrier on x86 (Intel SDM vol. 3, 9.2.2: loads and stores are not reordered
    with locked instructions): CPython 3.10-3.12 builds ``threading.Lock`` on POSIX
    semaphores where ``sem_timedwait`` exists (glibc 2.36's ``sem_trywait`` and
    ``sem_post`` each do a ``lock cmpxchg``), CPython 3.13+ on ``PyMutex`` (a
    ``lock cmpxchg`` too). It costs 3 to 5 empty Python calls, once per take that
    moved ``consumer_pos`` (bench/fence.py measures it; docs/ringbuf.md).
    """
    _FENCE_LOCK.acquire()
    _FENCE_LOCK.release()


def record_step(word: int) -> int:
    """Bytes a record with header word ``word`` takes: header, data, padding to 8."""
    return ((word & LENGTH_MASK) + HEADER_SIZE + 7) & ~7


def _run_length(memory: Any, at: int, step: int, count: int, word: int) -> int:
    """How many of ``count`` records from ``at``, ``step`` bytes apart, have header ``word``.

    At C speed: each of the header's four bytes is read for the whole run with a
    strided slice, and its leading run of the expected byte measured with lstrip.
    At least 1 (the record at ``at`` has that header).
    """
    stop = at + count * step
    same = count
    for column in range(4):
        expected = bytes(((word >> (8 * column)) & 0xFF,))
        rest = memory[at + column : stop : step].lstrip(expected)
        same = min(same, count - len(rest))
    return max(same, 1)


class _CopyingView:
    """A memoryview whose slices are copies (``bytes``), as an mmap's are."""

    __slots__ = ("_view",)

    def __init__(self, view: memoryview) -> None:
        self._view = view

    def __getitem__(self, key: slice) -> bytes:
        return self._view[key].tobytes()

    def __len__(self) -> int:
        return len(self._view)


class RingBufferRing:
    """The one ring of a BPF ring buffer: takes committed records, frees their space at once.

    ``consumer`` is the writable consumer page, ``producer`` the producer page
    followed by the doubly mapped data area (``size`` bytes, twice) at
    ``data_offset``. ``lost`` is the producer's own count of failed outputs, if
    it keeps one (the kernel keeps none); ``more`` is called when a take stops
    with records left, so that the reader is woken to come back for them;
    ``fence`` is the full barrier between the last store of ``consumer_pos`` and
    the last look at the ring (``full_fence``; tests swap it to count or remove it).
    ``data``, if given, is the doubly mapped data area on its own (at
    ``data_offset`` in it), where the producer page is mapped apart from it
    (eBPF for Windows hands out the two pages and the data as three pointers).
    ``key`` is ``NO_CPU`` for a map's one ring, a ring's index (its CPU) in a map of
    ring buffers.
    Slices of the memory are copies: an mmap's are; a memoryview is read through copies.
    """

    __slots__ = (
        "_consumer", "_fence", "_lost", "_mask", "_memory", "_more", "_offset", "_producer",
        "_words", "handle", "key", "size",
    )

    def __init__(
        self,
        handle: int,
        consumer: Any,
        producer: Any,
        data_offset: int,
        size: int,
        *,
        lost: Callable[[], int] | None = None,
        more: Callable[[], None] | None = None,
        fence: Callable[[], None] = full_fence,
        data: Any = None,
        key: int = NO_CPU,
    ) -> None:
        if size <= 0 or size & (size - 1) or size % 8:
            raise ValueError(f"ring buffer size {size} is not a power of two of at least 8")
        memory = producer if data is None else data
        if len(memory) < data_offset + 2 * size or data_offset % 8:
            raise ValueError("the data mapping must hold the data area twice, 8-aligned")
        self.key = key  # NO_CPU, or a ring's index in a per-CPU ring buffer map (its CPU)
        self.handle = handle
        self.size = size
        self._mask = size - 1
        self._offset = data_offset
        # Slicing it copies (bytes); strided slices read headers.
        self._memory = _CopyingView(memory) if isinstance(memory, memoryview) else memory
        self._producer = memoryview(producer)[:8].cast("Q")
        self._words = memoryview(memory).cast("I")
        self._consumer = memoryview(consumer)[:8].cast("Q")
        self._lost = lost
        self._more = more
        self._fence = fence

    def _check_open(self) -> None:
        if self._memory is None:
            raise ClosedResourceError("ring buffer memory was released")

    def pending_bytes(self) -> int:
        self._check_open()
        return int(self._producer[0] - self._consumer[0])

    def lost_total(self) -> int | None:
        return None if self._lost is None else self._lost()

    def _committed_end(self, pos: int, prod: int) -> int:
        """Position after the last committed record in [pos, prod): stops at a BUSY one."""
        if _committed_end is not None:
            return _committed_end(self._words, self._offset, self._mask, pos, prod)  # in C
        return self.pure_committed_end(pos, prod)

    def pure_committed_end(self, pos: int, prod: int) -> int:
        """``_committed_end`` in Python: the reference the compiled one is tested against."""
        words, memory, offset, mask = self._words, self._memory, self._offset, self._mask
        while pos < prod:
            at = offset + (pos & mask)
            word = words[at >> 2]
            if word & BUSY_BIT:
                break  # reserved, not committed: its commit wakes us (we stop at its position)
            step = record_step(word)
            if step > prod - pos:
                raise BrokenRingError(
                    self.key, f"record at position {pos} claims {step} bytes, {prod - pos} written"
                )
            count = (prod - pos) // step
            pos += step if count < 2 else step * _run_length(memory, at, step, count, word)
        return pos

    def take(self) -> bytes:
        """Copy every committed record out and release the space after the copy."""
        self._check_open()
        size, mask, offset = self.size, self._mask, self._offset
        consumer, producer, memory = self._consumer, self._producer, self._memory
        cons = consumer[0]
        parts: list[bytes] = []
        taken = 0
        fenced = True  # until we store consumer_pos, the last take's fence holds
        while True:
            prod = producer[0]  # before the headers and records below it
            avail = prod - cons
            if avail == 0:
                if fenced:
                    break
                self._fence()  # then look once more (full_fence says why)
                fenced = True
                continue
            if avail < 0 or avail > size:
                raise BrokenRingError(
                    self.key,
                    f"producer {prod} and consumer {cons} are {avail} bytes apart "
                    f"in a {size}-byte ring",
                )
            end = self._committed_end(cons, prod)
            if end == cons:  # reserved, not committed: its commit wakes us if it sees cons
                if fenced:
                    break
                self._fence()
                fenced = True
                continue
            start = offset + (cons & mask)
            parts.append(memory[start : start + (end - cons)])  # one run: mapped twice
            taken += end - cons
            cons = end
            consumer[0] = cons  # after the copy: the producer may reuse the space now
            fenced = False
            # Look again: a record committed while we copied woke nobody (the kernel
            # wakes only for a record at the consumer position). But a producer as
            # fast as we are would keep us here: after a ring's worth, come back later.
            if taken >= size:
                self._fence()
                if producer[0] != cons and self._more is not None:
                    self._more()
                break
        if not parts:
            return b""
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def release(self) -> None:
        """Drop the views of the mapping (before it is unmapped); later takes raise."""
        self._memory = None
        for view in (self._producer, self._words, self._consumer):
            view.release()


_ringbuf_split = speedups.ringbuf_split
_committed_end = speedups.ringbuf_committed_end


def split_span(key: int, span: bytes) -> tuple[list[Segment], int]:
    """Parse taken ring buffer records into segments, in order; count discarded ones.

    A segment is a list of sample payloads with a flag saying they all have one
    length, as for perf records. Payloads are exactly what the program wrote
    (no padding). Runs of records with the same header are cut out at C speed.
    """
    if _ringbuf_split is not None:
        return _ringbuf_split(key, span)  # the same, in C
    return pure_split_span(key, span)


def pure_split_span(key: int, span: bytes) -> tuple[list[Segment], int]:
    """``split_span`` in Python: the reference the compiled one is tested against."""
    segments: list[Segment] = []
    single: list[bytes] | None = None
    discarded = 0
    end = len(span)
    pos = 0
    unpack_word = _WORD.unpack_from
    while pos < end:
        if end - pos < HEADER_SIZE:
            raise BrokenRingError(key, f"{end - pos} trailing bytes are shorter than a header")
        word = unpack_word(span, pos)[0]
        if word & BUSY_BIT:
            raise BrokenRingError(key, f"record at byte {pos} is still reserved")
        length = word & LENGTH_MASK
        step = record_step(word)
        if pos + step > end:
            raise BrokenRingError(key, f"record at byte {pos} claims {step} of {end - pos} bytes")
        count = (end - pos) // step
        same = 1 if count < 2 else _run_length(span, pos, step, count, word)
        if word & DISCARD_BIT:
            discarded += same
        elif same > 1:
            cut = struct.Struct(f"{HEADER_SIZE}x{length}s{step - HEADER_SIZE - length}x")
            payloads = [p for (p,) in cut.iter_unpack(span[pos : pos + same * step])]
            if single is not None:
                segments.append((single, False))
                single = None
            segments.append((payloads, True))
        else:
            if single is None:
                single = []
            single.append(span[pos + HEADER_SIZE : pos + HEADER_SIZE + length])
        pos += same * step
    if single is not None:
        segments.append((single, False))
    return segments, discarded


def encode_record(payload: bytes, *, busy: bool = False, discard: bool = False) -> bytes:
    """A ring buffer record as the kernel lays it out (for fakes and tests)."""
    word = len(payload) | (BUSY_BIT if busy else 0) | (DISCARD_BIT if discard else 0)
    padded = (len(payload) + 7) & ~7
    return _HEADER.pack(word, 0) + payload.ljust(padded, b"\0")


class RingBufferRecords:
    """The record format of BPF ring buffers. The kernel writes no lost records."""

    name = "ringbuf"
    lost_records = False

    @staticmethod
    def split(key: int, span: bytes) -> tuple[list[Segment], int]:
        return split_span(key, span)


RINGBUF_RECORDS = RingBufferRecords()
