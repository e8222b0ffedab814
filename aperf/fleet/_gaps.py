"""What the sequence numbers of one host stream say: duplicates, and holes that are gone.

Sans-I/O. A sink numbers its events 0, 1, 2, ... and every message carries the
range it holds, a *watermark* (every event before it had been acknowledged by
JetStream, or given up by the sink, when the message was framed) and cumulative
counters (samples and lost counts before its first event).

A reader keeps, per source (host, stream, epoch), the ranges it has seen, merged.
A message inside a seen range is a duplicate (a redelivery, or a retry stored
twice after JetStream's de-duplication window). A hole between two seen ranges
whose upper end is at or below a watermark can no longer be filled: those events
were stored before the message carrying the watermark, and JetStream delivers in
stored order, so they were removed (the stream's limits) or never stored (the
sink dropped them). The hole is reported once, with the exact samples and lost
counts it held, from the counters at its two ends.

Holes above the watermark may still fill: a retry after a reconnect can be
stored after later messages, so such messages arrive out of order and are simply
yielded when they come. Ranges below the first one seen are not tracked: a new
reader on a durable consumer starts wherever the previous one stopped.
"""

from __future__ import annotations

import bisect
from typing import NamedTuple


class Hole(NamedTuple):
    first: int
    count: int  # type: ignore[assignment]
    samples: int
    lost: int


class _Range:
    """Seen events ``start .. end-1``, with the cumulative counters at both ends."""

    __slots__ = ("end", "lost_end", "lost_start", "samples_end", "samples_start", "start")

    def __init__(
        self, start: int, end: int, samples_start: int, lost_start: int, samples_end: int,
        lost_end: int,
    ) -> None:
        self.start = start
        self.end = end
        self.samples_start = samples_start
        self.lost_start = lost_start
        self.samples_end = samples_end
        self.lost_end = lost_end


class SourceTrack:
    """The seen ranges of one source, and the holes they leave."""

    def __init__(self) -> None:
        self._ranges: list[_Range] = []
        self._starts: list[int] = []
        self.floor: int | None = None

    def add(
        self, first: int, count: int, samples_before: int, lost_before: int, samples: int,
        lost: int,
    ) -> bool:
        """Record a message; False if its events were already seen (a duplicate)."""
        end = first + count
        if self.floor is None:
            self.floor = first
        elif first < self.floor:
            return True  # before this reader's time: handed out, not tracked
        i = bisect.bisect_right(self._starts, first) - 1
        if i >= 0:
            r = self._ranges[i]
            if first < r.end:
                return False
        new = _Range(first, end, samples_before, lost_before, samples_before + samples,
                     lost_before + lost)
        self._ranges.insert(i + 1, new)
        self._starts.insert(i + 1, first)
        self._merge_at(i + 1)
        if i >= 0:
            self._merge_at(i)
        return True

    def end(self, total: int, samples_total: int, lost_total: int) -> list[Hole]:
        """The sink's end of stream: every event before ``total`` is settled; the holes left."""
        if self.floor is None or total < self.floor:
            return []
        i = bisect.bisect_right(self._starts, total) - 1
        if self._ranges[i].end != total:
            self._ranges.insert(
                i + 1, _Range(total, total, samples_total, lost_total, samples_total, lost_total)
            )
            self._starts.insert(i + 1, total)
        return self.holes_below(total)

    def _merge_at(self, i: int) -> None:
        """Merge range i with range i+1 if they touch."""
        ranges = self._ranges
        if i + 1 < len(ranges) and ranges[i].end == ranges[i + 1].start:
            a, b = ranges[i], ranges[i + 1]
            a.end, a.samples_end, a.lost_end = b.end, b.samples_end, b.lost_end
            del ranges[i + 1]
            del self._starts[i + 1]

    def holes_below(self, watermark: int) -> list[Hole]:
        """Holes that end at or below ``watermark``: gone for good; each reported once."""
        holes: list[Hole] = []
        ranges = self._ranges
        while len(ranges) > 1 and ranges[1].start <= watermark:
            a, b = ranges[0], ranges[1]
            holes.append(
                Hole(a.end, b.start - a.end, b.samples_start - a.samples_end,
                     b.lost_start - a.lost_end)
            )
            a.end, a.samples_end, a.lost_end = b.end, b.samples_end, b.lost_end
            del ranges[1]
            del self._starts[1]
        return holes

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return [(r.start, r.end) for r in self._ranges]
