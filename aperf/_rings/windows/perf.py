"""The eBPF for Windows perf event array as a ring source (handle kind "win32").

eBPF for Windows does not map perf rings into user space for its callers
(docs/PerfEventArray.md: "Windows does not support direct memory mapped
access to perf event arrays"; the ``ebpf_perf_buffer_get_buffer`` of the PR's
first drafts was never exported), so a ring's ``_WindowsRing.take()`` runs
``perf_buffer__consume_buffer`` and frames what its callbacks copy out in the
record format below. Every ring shares the buffer's one manual-reset wait
handle: the driver waits on it, ``WindowsPerfSource.acknowledge()`` resets
it before the rings are read, so a record written during the read signals it
again and no wakeup is lost.

Frees in the order of ``base.WindowsSource``: the perf buffer
(``perf_buffer__free`` unmaps the rings and closes the wait handle), then
aperf's own map fd, then the claim on the map.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from ..._errors import BrokenRingError, ClosedResourceError
from ..._native.ebpfapi import api as win
from ..._native.ebpfapi import binding as c
from ..seam import RecordFormat, Segment
from .base import WindowsSource

_WORD = struct.Struct("<I")
_LOST = struct.Struct("<IQ")
_LOST_FLAG = 1 << 31  # a word with this bit is a lost record: a u64 count follows


class WindowsRecords:
    """aperf's framing of what ``perf_buffer__consume_buffer`` hands over.

    A sample is a u32 length (below 2**31) then its bytes, exactly as the
    callback got them (no padding: eBPF for Windows gives the exact size); a
    lost notice is the u32 ``1 << 31`` then a u64 count.
    """

    name = "ebpf-for-windows"
    lost_records = True  # libbpf's lost callback, framed as lost notices

    @staticmethod
    def encode(records: Sequence[win.Record]) -> bytes:
        parts: list[bytes] = []
        for record in records:
            if isinstance(record, int):
                parts.append(_LOST.pack(_LOST_FLAG, record))
            else:
                parts.append(_WORD.pack(len(record)))
                parts.append(record)
        return b"".join(parts)

    @staticmethod
    def split(key: int, span: bytes) -> tuple[list[Segment], int]:
        segments: list[Segment] = []
        run: list[bytes] = []
        end = len(span)
        pos = 0
        unpack_word = _WORD.unpack_from
        while pos < end:
            if end - pos < 4:
                raise BrokenRingError(key, f"{end - pos} trailing bytes are shorter than a header")
            (word,) = unpack_word(span, pos)
            if word & _LOST_FLAG:
                if end - pos < _LOST.size:
                    raise BrokenRingError(key, f"lost record at byte {pos} is cut short")
                if run:
                    segments.append((run, len({len(p) for p in run}) == 1))
                    run = []
                segments.append(_LOST.unpack_from(span, pos)[1])
                pos += _LOST.size
                continue
            if not run and _uniform_to_end(span, pos, word):
                # One struct type and no loss in between, the common case: cut at C speed.
                cut = struct.Struct(f"4x{word}s")
                segments.append(([p for (p,) in cut.iter_unpack(span[pos:])], True))
                return segments, 0
            pos += 4
            if pos + word > end:
                raise BrokenRingError(key, f"sample at byte {pos - 4} claims {word} of {end - pos}")
            run.append(span[pos : pos + word])
            pos += word
        if run:
            segments.append((run, len({len(p) for p in run}) == 1))
        return segments, 0


def _uniform_to_end(span: bytes, pos: int, length: int) -> bool:
    """Whether the rest of ``span`` is samples of ``length`` bytes only (2 or more).

    Compares the 4 header bytes of every record, column by column, with
    strided slices; a lost record (its flag bit set) breaks the run.
    """
    size = 4 + length
    rest = len(span) - pos
    if rest % size or rest // size < 2:
        return False
    count = rest // size
    return all(
        span[column::size] == span[column : column + 1] * count
        for column in range(pos, pos + 4)
    )


WINDOWS_RECORDS = WindowsRecords()


class _WindowsRing:
    """One CPU's ring of a ``WindowsPerfSource`` (they all share one wait handle)."""

    __slots__ = ("_lost", "_source", "handle", "key")

    def __init__(self, source: WindowsPerfSource, key: int, handle: int) -> None:
        self._source = source
        self.key = key
        self.handle = handle
        self._lost = 0  # drops the lost callback reported since the ring opened

    def take(self) -> bytes:
        records = self._source._consume(self.key)
        for record in records:
            if isinstance(record, int):
                self._lost += record
        return WINDOWS_RECORDS.encode(records) if records else b""

    def pending_bytes(self) -> int:
        """Not known without the mapping: 0. (The reader then drains this ring on
        wakeups and timer ticks only, not between a busy consumer's batches.)"""
        return 0

    def lost_total(self) -> int:
        """The producer page's lost count (since open) as of this ring's last take.

        eBPF for Windows reports it on every consume, in front of the records,
        so no drop waits for a later record to be announced.
        """
        return self._lost


class WindowsPerfSource(WindowsSource[win.SyncPerfBuffer, "_WindowsRing"]):
    """The per-CPU rings of one eBPF for Windows ``BPF_MAP_TYPE_PERF_EVENT_ARRAY``.

    ``source`` is the map's fd (an ebpfapi fd, e.g. from ``bpf_map__fd`` or
    ``bpf_obj_get``), the path it is pinned at, or an ``Map``. The
    ring size is the map's ``max_entries`` (bytes per CPU): ``pages`` and
    ``ring_bytes`` are refused; wakeup thresholds are ignored (the producer
    signals the wait handle on every record).
    """

    records: RecordFormat = WINDOWS_RECORDS

    _takeover = "take over its rings' wait handle"
    _noun = "perf event array"
    _fixed_size = (
        "pages/ring_bytes: on eBPF for Windows the ring size is fixed by the map "
        "(max_entries bytes per CPU) and perf_buffer__new takes no page count; "
        "leave pages and ring_bytes unset"
    )

    def _open(self) -> list[_WindowsRing]:
        facts = self._own_map(
            c.BPF_MAP_TYPE_PERF_EVENT_ARRAY,
            "map {name} has type {type}; aperf reads BPF_MAP_TYPE_PERF_EVENT_ARRAY "
            f"({c.BPF_MAP_TYPE_PERF_EVENT_ARRAY} on Windows) maps",
        )
        pb = self._hold(win.SyncPerfBuffer(self._map_fd))
        self._ring_bytes = facts.max_entries
        self._memory_bytes = pb.count * facts.max_entries
        return [_WindowsRing(self, index, pb.wait_handle) for index in range(pb.count)]

    def _consume(self, index: int) -> list[win.Record]:
        with self._lock:
            pb = self._buffer
            if pb is None:
                raise ClosedResourceError(f"perf event array {self.name} was closed")
            return pb.consume(index)
