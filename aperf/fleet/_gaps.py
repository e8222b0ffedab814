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

The chain. Every message carries its own tag and a commitment to the next
message's tag (``_wire.py``); only the sink can answer that commitment. A range
is *checked* when its first message answered the commitment of a checked range
below it (the first message this reader sees of a source is trusted: trust on
first use). So:

- a message that continues a checked range but does not answer its commitment is
  forged: refused (a forger claiming a live sink's next sequence numbers);
- a checked range whose last commitment the range above it does not answer shows
  that range to be forged: it is reported (it was handed out) and forgotten, so
  the genuine events it claimed are accepted when they come;
- a message over events a checked range holds is a duplicate (whoever sent it,
  it hides nothing); one over an unchecked range that is not a copy of that
  range's first message conflicts with it: handed out, and reported.
"""

from __future__ import annotations

import bisect
import enum
from typing import NamedTuple

from ._wire import commit


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
    """The seen ranges of one source, and the holes they leave."""

    def __init__(self) -> None:
        self._ranges: list[_Range] = []
        self._starts: list[int] = []
        self.floor: int | None = None
        self.exposed: list[Exposed] = []
        self.last_checked = 0  # stream sequence of the last checked message accepted

    def add(
        self, first: int, count: int, samples_before: int, lost_before: int, samples: int,
        lost: int, tag: bytes | None = None, next_commit: bytes | None = None,
        origin: int = 0, redelivered: bool = False,
    ) -> Verdict:
        """Record a message (``tag`` and ``next_commit`` from its header, ``origin`` its
        stream sequence); ranges the chain shows forged are left in ``exposed``."""
        self.exposed = []
        end = first + count
        new = _Range(first, end, samples_before, lost_before, samples_before + samples,
                     lost_before + lost, tag, next_commit, tag is None, origin)
        verdict = self._add(new, redelivered)
        if verdict is Verdict.NEW and self.checked(first):
            self.last_checked = max(self.last_checked, origin)
        return verdict

    def _add(self, new: _Range, redelivered: bool) -> Verdict:
        first, end, tag = new.start, new.end, new.start_tag
        if self.floor is None:
            self.floor = first
            new.checked = True  # trust on first use
            self._ranges.append(new)
            self._starts.append(first)
            return Verdict.NEW
        if first < self.floor:
            return Verdict.NEW  # before this reader's time: handed out, not tracked
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
            if redelivered or (first == r.start and tag == r.start_tag):
                return Verdict.DUPLICATE  # a copy of a message seen
            if any(ranges[k].checked for k in over):
                return Verdict.DUPLICATE  # over genuine events: whoever sent it, hides nothing
            if not (lower is not None and lower.checked and tag is not None
                    and lower.leads_to(tag)):
                return Verdict.CONFLICT
            # It answers a checked range: genuine, so what it overlaps is forged.
            for k in reversed(over):
                self.exposed.append(
                    Exposed(ranges[k].start, ranges[k].end - ranges[k].start, ranges[k].origin)
                )
                del ranges[k]
                del self._starts[k]
            self.exposed.reverse()
        if lower is not None and not lower.leads_to(tag):
            if lower.checked:
                return Verdict.FORGED
            lower = None  # which of the two is forged is not known yet: kept apart
        elif lower is not None:
            new.checked = lower.checked or new.checked
        ranges.insert(i + 1, new)
        self._starts.insert(i + 1, first)
        at = i + 1
        if lower is not None:
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
        elif low.checked:
            self.exposed.append(Exposed(high.start, high.end - high.start, high.origin))
            del ranges[i + 1]
            del self._starts[i + 1]

    def checked(self, first: int) -> bool:
        """Whether the range holding event ``first`` is checked (or untracked: below the floor)."""
        i = bisect.bisect_right(self._starts, first) - 1
        return i < 0 or self._ranges[i].checked

    def would_settle(self, watermark: int) -> bool:
        """Whether ``watermark`` passes a hole (a watermark that would report a Gap)."""
        return len(self._ranges) > 1 and self._ranges[1].start <= watermark

    def anchor(self, first: int) -> None:
        """Trust the range holding ``first`` though no checked range leads to it: the
        hole below it is one JetStream's limits made (the reader asked)."""
        i = bisect.bisect_right(self._starts, first) - 1
        if i >= 0:
            self._ranges[i].checked = True

    def end(
        self, total: int, samples_total: int, lost_total: int, tag: bytes | None = None,
        origin: int = 0,
    ) -> list[Hole] | None:
        """The sink's end of stream: every event before ``total`` is settled; the holes
        left (none yet if it cannot be checked). None if it cannot be the sink's: it fails
        the chain, or ends inside events already seen."""
        verdict = self.add(total, 0, samples_total, lost_total, 0, 0, tag, None, origin)
        if verdict is Verdict.FORGED or (verdict is not Verdict.NEW and total > (self.floor or 0)):
            return None
        return self.holes_below(total) if self.checked(total) else []

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
        """Holes that end at or below ``watermark``: gone for good; each reported once."""
        holes: list[Hole] = []
        ranges = self._ranges
        while len(ranges) > 1 and ranges[1].start <= watermark:
            a, b = ranges[0], ranges[1]
            if b.start > a.end:  # (two ranges that meet but were kept apart: no hole)
                holes.append(
                    Hole(a.end, b.start - a.end, b.samples_start - a.samples_end,
                         b.lost_start - a.lost_end)
                )
            a.end, a.samples_end, a.lost_end = b.end, b.samples_end, b.lost_end
            a.end_commit = b.end_commit
            del ranges[1]
            del self._starts[1]
        return holes

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return [(r.start, r.end) for r in self._ranges]
