"""What the sequence numbers of one sink run say: duplicates, and holes that are gone.

Sans-I/O. A sink numbers its events 0, 1, 2, ... and every message carries the
range it holds, a *watermark* (every event before it had been acknowledged by
JetStream, or given up by the sink, when the message was framed) and cumulative
counters (samples and lost counts before its first event).

A reader keeps, per run (host, stream, epoch), the ranges it has seen, merged, at
most ``max_ranges`` of them. A message inside a seen range is a duplicate (a
redelivery, or a retry stored twice after JetStream's de-duplication window),
below the first range seen too. A hole between two seen ranges whose upper end is
at or below a watermark can no longer be filled: those events were stored before
the message carrying the watermark, and JetStream delivers in stored order, so
they were removed (the stream's limits) or never stored (the sink dropped them).
The hole is reported once, with the exact samples and lost counts it held, from
the counters at its two ends. Holes below the first range seen are never
reported: a reader on a durable consumer starts where the previous one stopped.

Holes above the watermark may still fill: a retry after a reconnect can be
stored after later messages, so such messages arrive out of order and are simply
yielded when they come. This module only says which holes a watermark passes; the
reader decides when that may be concluded (``_intake.py``: not while a delivery
may still be on its way).

The chain. Every message carries its own tag and a commitment to the next
message's tag (``_wire.py``); only the sink can answer that commitment. A range
is *checked* when its first message answered the commitment of a checked range
below it, or was signed by the host's key (``trusted``), or is the start of the
run (event 0) and the first thing this reader saw of the run: no one but the sink
knows a run's id before its first message is stored. Nothing else is: a reader
that first meets a run in its middle (a restart, a run evicted) trusts none of
it, so no sender is believed just for being seen first. So:

- a message that continues a checked range but does not answer its commitment is
  forged: refused (a forger claiming a live sink's next sequence numbers); one that
  starts where a checked range starts, with another tag, too;
- a checked range whose last commitment the range above it does not answer shows
  that range to be forged: it is reported (it was handed out) and forgotten, so
  the genuine events it claimed are accepted when they come;
- a message over events a checked range holds is a duplicate (whoever sent it,
  it hides nothing); one over an unchecked range that is not a copy of that
  range's first message conflicts with it: handed out, and reported.

Beyond ``max_ranges`` ranges, the unchecked range highest up (else the lowest
range) is forgotten, and listed in ``forgotten`` for the reader to announce.
"""

from __future__ import annotations

import bisect
import enum
from typing import NamedTuple

from ._wire import commit

DEFAULT_MAX_RANGES = 64


class Verdict(enum.Enum):
    NEW = "new"  # unseen events: hand them out
    DUPLICATE = "duplicate"  # events seen already
    FORGED = "forged"  # fails its run's chain: refuse
    CONFLICT = "conflict"  # overlaps an unchecked range: hand out, and report


class Exposed(NamedTuple):
    """A range handed out earlier that the chain shows to be forged."""

    first: int
    count: int  # type: ignore[assignment]
    origin: int  # the JetStream stream sequence of its first message


class Hole(NamedTuple):
    first: int
    count: int  # type: ignore[assignment]
    samples: int
    lost: int


class _Range:
    """Seen events ``start .. end-1``, with the cumulative counters at both ends, the
    tag of its first message and the commitment of its last."""

    __slots__ = (
        "checked", "end", "end_commit", "lost_end", "lost_start", "origin", "samples_end",
        "samples_start", "start", "start_tag",
    )

    def __init__(
        self, start: int, end: int, samples_start: int, lost_start: int, samples_end: int,
        lost_end: int, start_tag: bytes | None = None, end_commit: bytes | None = None,
        checked: bool = True, origin: int = 0,
    ) -> None:
        self.start = start
        self.end = end
        self.samples_start = samples_start
        self.lost_start = lost_start
        self.samples_end = samples_end
        self.lost_end = lost_end
        self.start_tag = start_tag
        self.end_commit = end_commit
        self.checked = checked
        self.origin = origin

    def leads_to(self, tag: bytes | None) -> bool:
        """Whether a message tagged ``tag`` answers this range's last commitment (the
        bookkeeping's own tests use no tags: then it always does)."""
        return tag is None or self.end_commit is None or commit(tag) == self.end_commit


class SourceTrack:
    """The seen ranges of one run, and the holes they leave."""

    def __init__(self, max_ranges: int = DEFAULT_MAX_RANGES) -> None:
        self._ranges: list[_Range] = []
        self._starts: list[int] = []
        self._max_ranges = max_ranges
        self.floor: int | None = None  # where this reader came in: no hole below it
        self.exposed: list[Exposed] = []
        self.forgotten: list[tuple[int, int]] = []  # ranges dropped at the cap
        self.last_checked = 0  # stream sequence of the last checked message accepted
        self.end_at: int | None = None  # the run's end of stream, once accepted
        # (first, tag) of the messages handed out in conflict with a range, whose
        # copies are duplicates too; as many as ranges, the oldest forgotten first
        self._conflicts: dict[tuple[int, bytes | None], None] = {}
        self.end_tag: bytes | None = None

    def add(
        self, first: int, count: int, samples_before: int, lost_before: int, samples: int,
        lost: int, tag: bytes | None = None, next_commit: bytes | None = None,
        origin: int = 0, trusted: bool = False,
    ) -> Verdict:
        """Record a message (``tag`` and ``next_commit`` from its header, ``origin`` its
        stream sequence, ``trusted`` if its signature verified); ranges the chain shows
        forged are left in ``exposed``, ranges dropped at the cap in ``forgotten``."""
        self.exposed = []
        self.forgotten = []
        end = first + count
        checked = trusted or tag is None or (self.floor is None and first == 0)
        new = _Range(first, end, samples_before, lost_before, samples_before + samples,
                     lost_before + lost, tag, next_commit, checked, origin)
        verdict = self._add(new, trusted)
        if verdict is Verdict.NEW:
            if self.checked(first):
                self.last_checked = max(self.last_checked, origin)
            self._cap(first)
        return verdict

    def _add(self, new: _Range, trusted: bool) -> Verdict:
        first, end, tag = new.start, new.end, new.start_tag
        if self.floor is None:
            self.floor = first
        ranges = self._ranges
        i = bisect.bisect_right(self._starts, first) - 1
        lower = ranges[i] if i >= 0 and ranges[i].end == first else None
        over: list[int] = []  # the ranges it overlaps
        k = max(i, 0)
        while k < len(ranges) and ranges[k].start < end:
            if ranges[k].end > first:
                over.append(k)
            k += 1
        if over:
            r = ranges[over[0]]
            if first == r.start and tag == r.start_tag:
                return Verdict.DUPLICATE  # a copy of a message seen
            if first == r.start and r.checked and not trusted and count_of(new):
                return Verdict.FORGED  # another message where a checked one starts
            if any(ranges[k].checked for k in over):
                return Verdict.DUPLICATE  # over genuine events: whoever sent it, hides nothing
            if (first, tag) in self._conflicts:
                return Verdict.DUPLICATE  # a copy of a message handed out in conflict
            if not (trusted or (lower is not None and lower.checked and tag is not None
                                and lower.leads_to(tag))):
                self._conflicts[(first, tag)] = None
                if len(self._conflicts) > self._max_ranges:
                    del self._conflicts[next(iter(self._conflicts))]
                return Verdict.CONFLICT
            # It answers a checked range (or is signed): genuine, so what it overlaps is
            # forged.
            for k in reversed(over):
                self.exposed.append(
                    Exposed(ranges[k].start, ranges[k].end - ranges[k].start, ranges[k].origin)
                )
                del ranges[k]
                del self._starts[k]
            self.exposed.reverse()
            new.checked = True
        if lower is not None and not lower.leads_to(tag):
            if lower.checked and not trusted:
                return Verdict.FORGED
            lower = None  # which of the two is forged is not known yet: kept apart
        elif lower is not None:
            new.checked = lower.checked or new.checked
        ranges.insert(i + 1, new)
        self._starts.insert(i + 1, first)
        at = i + 1
        if lower is not None and (lower.checked or not new.checked):  # never taint one
            self._merge_at(i)
            at = i
        self._link_up(at)
        return Verdict.NEW

    def _link_up(self, i: int) -> None:
        """Range i has just grown: join it to the range above if that one starts where
        it ends and answers its commitment; a checked range not answered is exposed."""
        ranges = self._ranges
        if i + 1 >= len(ranges) or ranges[i].end != ranges[i + 1].start:
            return
        low, high = ranges[i], ranges[i + 1]
        if low.leads_to(high.start_tag):
            if low.checked or not high.checked:  # never taint a checked range
                high.checked = low.checked
                self._merge_at(i)
        elif low.checked and not high.checked:
            self.exposed.append(Exposed(high.start, high.end - high.start, high.origin))
            del ranges[i + 1]
            del self._starts[i + 1]

    def _cap(self, near: int) -> None:
        """At most ``max_ranges`` ranges: forget the unchecked one highest up, else the
        lowest, never the one holding ``near`` (just added)."""
        ranges = self._ranges
        while len(ranges) > self._max_ranges:
            unchecked = [k for k, r in enumerate(ranges) if not r.checked
                         and not r.start <= near < max(r.end, r.start + 1)]
            k = unchecked[-1] if unchecked else (0 if ranges[0].start != near else 1)
            r = ranges.pop(k)
            del self._starts[k]
            self.forgotten.append((r.start, r.end))
            if self.floor is not None and r.start <= self.floor < r.end and k < len(ranges):
                self.floor = ranges[k].start  # no hole is reported below what is left

    def checked(self, first: int) -> bool:
        """Whether the range holding event ``first`` (the last one starting at or below
        it: call it for a message just added) is checked."""
        i = bisect.bisect_right(self._starts, first) - 1
        return i >= 0 and self._ranges[i].checked

    def _base(self) -> int:
        """The index of the range holding the floor: holes are counted from it."""
        return max(bisect.bisect_right(self._starts, self.floor or 0) - 1, 0)

    def would_settle(self, watermark: int) -> bool:
        """Whether ``watermark`` passes a hole (a watermark that would report a Gap)."""
        i = self._base()
        return i + 1 < len(self._ranges) and self._ranges[i + 1].start <= watermark

    def anchor(self, first: int) -> None:
        """Trust the range holding ``first`` though no checked range leads to it: the
        hole below it is one JetStream's limits made (the reader asked)."""
        i = bisect.bisect_right(self._starts, first) - 1
        if i >= 0:
            self._ranges[i].checked = True

    def end(
        self, total: int, samples_total: int, lost_total: int, tag: bytes | None = None,
        origin: int = 0, trusted: bool = False,
    ) -> Verdict:
        """The sink's end of stream (a zero-length range at ``total``): NEW if it fits
        (checked, or not yet: ``checked(total)``), DUPLICATE if seen already, FORGED if
        it fails the chain or ends inside events already seen."""
        if self.end_at is not None:  # an end seen already
            same = (total, tag) == (self.end_at, self.end_tag)
            return Verdict.DUPLICATE if same else Verdict.FORGED
        if any(r.end > total for r in self._ranges):  # events seen beyond it
            return Verdict.FORGED
        # Its commitment is one no tag answers: nothing continues a run after its end.
        verdict = self.add(total, 0, samples_total, lost_total, 0, 0, tag, b"", origin,
                           trusted)
        if verdict is not Verdict.NEW:
            return Verdict.FORGED
        self.end_at, self.end_tag = total, tag
        return verdict

    def _merge_at(self, i: int) -> None:
        """Merge range i with range i+1 if they touch."""
        ranges = self._ranges
        if i + 1 < len(ranges) and ranges[i].end == ranges[i + 1].start:
            a, b = ranges[i], ranges[i + 1]
            a.end, a.samples_end, a.lost_end = b.end, b.samples_end, b.lost_end
            a.end_commit = b.end_commit
            del ranges[i + 1]
            del self._starts[i + 1]

    def holes_below(self, watermark: int) -> list[Hole]:
        """Holes above the floor that end at or below ``watermark``: gone for good; each
        reported once. A hole's counts come from the counters at its ends, clamped to
        what it can hold (a forged counter claims nothing below zero)."""
        holes: list[Hole] = []
        ranges = self._ranges
        i = self._base()
        while i + 1 < len(ranges) and ranges[i + 1].start <= watermark:
            a, b = ranges[i], ranges[i + 1]
            if b.start > a.end:  # (two ranges that meet but were kept apart: no hole)
                count = b.start - a.end
                holes.append(Hole(
                    a.end, count, min(max(b.samples_start - a.samples_end, 0), count),
                    max(b.lost_start - a.lost_end, 0),
                ))
            a.end, a.samples_end, a.lost_end = b.end, b.samples_end, b.lost_end
            a.end_commit = b.end_commit
            a.checked = a.checked and b.checked  # its end is b's: trusted if both were
            del ranges[i + 1]
            del self._starts[i + 1]
        return holes

    def __len__(self) -> int:
        return len(self._ranges)

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return [(r.start, r.end) for r in self._ranges]


def count_of(r: _Range) -> int:
    return r.end - r.start
