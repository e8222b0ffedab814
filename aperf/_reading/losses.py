"""The loss ledger: what a reader reported lost per ring, and from which count.

Losses reach the consumer in the stream, in order: a ``Lost`` for each lost
record the producer wrote and, where the producer counts its drops itself
(``Ring.lost_total()``: perf events on Linux 6.0+ opened with
``PERF_FORMAT_LOST``), a ``Lost`` for drops no record has announced yet. A
lost record that later announces drops reported that way is absorbed, so no
drop is counted twice and none is left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from .._rings.seam import RecordFormat, Ring

LostCounter = Literal["exact", "records", "none"]


class LossLedger:
    """Per ring: the producer's count at open, what was reported, and what was reported
    ahead of the lost records that will announce it; and which drops aperf's own queue
    caused (``queue``, see ``held_back``)."""

    __slots__ = ("_ahead", "_base", "_recheck", "after", "marks", "queue", "reported")

    def __init__(self, rings: Sequence[Ring]) -> None:
        self.reported = {ring.key: 0 for ring in rings}
        self._base: dict[int, int] = {}
        for ring in rings:
            total = ring.lost_total()
            if total is not None:
                self._base[ring.key] = total
        self._ahead = dict.fromkeys(self._base, 0)
        self.queue: dict[int, int] = {}  # per ring: drops while aperf's queue held it back
        self.marks: dict[int, int | None] = {}  # rings held back: the count at that moment
        self.after: set[int] = set()  # caught up, no exact count: the next lost record is ours
        self._recheck: set[int] = set()  # filled up unread: read the count at the next drain

    def held_back(self, ring: Ring) -> None:
        """aperf refused to drain ``ring`` because its queue is full: from now until it
        drains the ring again, the kernel's drops on it are queue drops."""
        if ring.key not in self.marks:
            self.marks[ring.key] = ring.lost_total() if ring.key in self._base else None

    def count_before_take(self, ring: Ring, full_mark: int) -> int | None:
        """The producer's count, read before a drain reads the ring's head, if the ring
        can have dropped since its last drain (more than ``full_mark`` bytes pending);
        else None.

        Read before the head, the count covers only drops that came after every sample
        the drain takes, or before one of them (whose lost record is then among them):
        what ``unannounced`` finds missing belongs at the end of the drain's span. Read
        after, it would take in drops made once the space was released, behind samples
        written since, and announce them ahead of those samples.
        """
        key = ring.key
        if key not in self._base:
            return None
        if key in self._recheck or key in self.marks or ring.pending_bytes() > full_mark:
            self._recheck.discard(key)
            return ring.lost_total()
        return None

    def took_full(self, key: int) -> None:
        """A drain took nearly a whole ring: the ring may have dropped after the count
        was read (or, if it filled up after ``count_before_take`` looked, none was),
        until the space was released. Its next drain reads the count first: a sample
        written since brings the lost record, and if none came, the drops are
        announced there, behind every sample taken."""
        if key in self._base:
            self._recheck.add(key)

    def caught_up(self, ring: Ring, total: int | None = None) -> None:
        """``ring`` was drained after being held back (its space is released): its drops
        since ``held_back`` were aperf's queue's. With the producer's count that is exact
        (``total``: read before the drain, see ``count_before_take``); without it, they
        are announced by the lost record the kernel writes in front of the first sample
        that fits, the first record of the ring's next drain."""
        key = ring.key
        if key not in self.marks:
            return
        mark = self.marks.pop(key)
        if mark is None:
            self.after.add(key)
        else:
            if total is None:
                total = ring.lost_total()
            if total is not None:
                self.queue[key] = self.queue.get(key, 0) + total - mark

    def first_record(self, key: int, record: object) -> None:
        """The first record of a drain: a lost record right after catching up (no exact
        count) announces the drops made while the ring was held back."""
        self.after.discard(key)
        if isinstance(record, int):
            self.queue[key] = self.queue.get(key, 0) + record

    def split(self, key: int, lost: int) -> tuple[int, int]:
        """``lost`` (what ``lost()`` says) as (queue drops, ring drops), which add up to it."""
        queue = min(self.queue.get(key, 0), lost)
        return queue, lost - queue

    def exact(self, key: int) -> bool:
        """Whether the producer counts this ring's drops itself."""
        return key in self._base

    def announced(self, key: int, count: int) -> int:
        """A lost record of ``count``: what of it to report (an earlier exact count may
        have reported some or all of it already)."""
        ahead = self._ahead.get(key, 0)
        if ahead:
            absorbed = min(ahead, count)
            self._ahead[key] = ahead - absorbed
            count -= absorbed
        if count:
            self.reported[key] += count
        return count

    def unannounced(self, ring: Ring, total: int | None = None) -> int:
        """Drops the producer counted on ``ring`` that nothing reported yet (0 if none, or
        if it keeps no count); reported now, ahead of the lost records to come.
        ``total``: the count read before the drain's take (``count_before_take``); None:
        read now, for a ring taken for the last time.

        Such drops come after every record taken so far: a sample written after a
        drop is preceded by its lost record.
        """
        key = ring.key
        if key not in self._base:
            return 0
        if total is None:
            total = ring.lost_total()
        if total is None:
            return 0
        missing = total - self._base[key] - self.reported[key]
        if missing <= 0:
            return 0
        self.reported[key] += missing
        self._ahead[key] += missing
        return missing

    def reopened(self, ring: Ring) -> None:
        """A new ring for ``ring.key`` (its CPU came back online): its producer counts from
        its own start, after everything reported on the key's earlier rings."""
        key = ring.key
        self.reported.setdefault(key, 0)
        total = ring.lost_total()
        if total is not None:
            self._base[key] = total - self.reported[key]
            self._ahead[key] = 0

    def lost(self, key: int, ring: Ring | None) -> int:
        """What the producer counts as lost on this ring (``ring``: None once it is
        gone), if more than the reader reported yet."""
        reported = self.reported[key]
        total = ring.lost_total() if ring is not None and key in self._base else None
        return reported if total is None else max(reported, total - self._base[key])

    def counter(self, records: RecordFormat) -> LostCounter:
        """Where loss counts come from: the producer's exact count, lost records, or nowhere
        (a BPF ring buffer without the BPF side's count: the kernel keeps none)."""
        if self._base:
            return "exact"
        return "records" if getattr(records, "lost_records", True) else "none"
