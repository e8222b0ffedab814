"""Gathered wakeups: a wakeup left to the drain timer, so that records gather meanwhile.

The kernel wakes a BPF ring buffer's reader only for a record committed at its
consumer position (``aperf.abc.GatheringSource``): a reader that does not catch up at
once gets no more wakeups while records gather, and the tick due ``max_latency`` after
the ring's last drain takes them all in one drain. A reader has a ``Gathering`` only
for such a source with batched wakeups (``Gathering.of``); otherwise it reads every
wakeup at once, and none of this runs.
"""

from __future__ import annotations

from collections.abc import Callable

from .._options import Wakeup
from .._rings.seam import GatheringSource, Ring, RingSource
from .clock import DrainClock


def gather_threshold(source: RingSource, wakeup: Wakeup, ring_bytes: int) -> int:
    """Below how many pending bytes a wakeup is left to the drain timer (0: never).

    Only for sources whose kernel wakes the reader once it caught up (a BPF ring
    buffer: ``GatheringSource``), with batched wakeups: the wakeup policy's
    watermark, or a quarter of the ring.
    """
    if not wakeup.batched or not isinstance(source, GatheringSource):
        return 0
    if wakeup.watermark_bytes:
        return min(wakeup.watermark_bytes, ring_bytes)
    if wakeup.watermark_fraction:
        return int(ring_bytes * wakeup.watermark_fraction)
    return ring_bytes >> 2


class Gathering:
    """Which rings' wakeups wait for the drain timer (``gathering``), which rings' wakeups
    the source holds back (``hushed``), and the span each ring's last drain took."""

    __slots__ = ("_clock", "_hush", "_last_span", "below", "gathering", "hushed")

    def __init__(self, below: int, hush: Callable[[int, bool], None],
                 clock: DrainClock) -> None:
        self.below = below  # the threshold (gather_threshold)
        self._hush = hush  # the source's hush_wakeups
        self._clock = clock
        self.gathering: set[int] = set()  # rings whose wakeup was left to the drain timer
        self._last_span: dict[int, int] = {}  # per ring: the bytes its last drain took
        self.hushed: set[int] = set()  # rings whose wakeups the source holds back

    @classmethod
    def of(cls, source: RingSource, wakeup: Wakeup, ring_bytes: int,
           clock: DrainClock) -> Gathering | None:
        """What a reader of ``source`` gathers with, or None: every wakeup read at once."""
        below = gather_threshold(source, wakeup, ring_bytes)
        if not below or not isinstance(source, GatheringSource):
            return None
        return cls(below, source.hush_wakeups, clock)

    def leaves(self, ring: Ring) -> bool:
        """Whether to leave this wakeup of ``ring`` to the drain timer.

        Read at once a ring last drained longer ago than ``max_latency`` (wakeups
        are rare: reading costs no more drains than the timer's), one above the
        threshold, and one whose last drain took a sizeable span: at such rates
        wakeups are few per sample anyway, and no wakeup would come to say the ring
        is filling.
        """
        key = ring.key
        limit = self.below
        if (not self._clock.recently_drained(key) or self._last_span.get(key, 0) >= limit >> 2
                or ring.pending_bytes() >= limit):
            return False
        self.gathering.add(key)
        if key not in self.hushed:
            # The drain that catches up gets the next record's wakeup: with records
            # flowing the ticks find them anyway, so hold the wakeups back until a
            # drain finds the ring empty (or a sizeable span).
            self._hush(ring.handle, True)
            self.hushed.add(key)
        return True

    def took(self, ring: Ring, length: int) -> None:
        """A drain took ``length`` bytes out of ``ring``: its wakeup is served; idle again,
        or busy, its wakeups pass from now on."""
        key = ring.key
        self.gathering.discard(key)
        self._last_span[key] = length  # what ``leaves`` reads
        if key in self.hushed and (not length or length >= self.below >> 2):
            self.hushed.discard(key)
            self._hush(ring.handle, False)
