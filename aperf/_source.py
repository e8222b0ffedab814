"""The ring-source seam: what a reader needs from "something that has rings".

A source owns rings and their readiness handles; the reader (``_reader.py``)
takes spans out of the rings and applies the one policy; drivers wait on the
handles and call the reader. A backend plugs in by implementing
``RingSource``: the Linux perf event array (``_perf_source.py``) is one,
``aperf.testing.FakeRingSource`` another.

Readiness is one-shot, as the kernel's perf fds are: a handle fires once per
wakeup, and ``acknowledge()`` clears it before the rings are
read, so a wakeup that arrives while they are read is not lost.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ._options import Wakeup
from ._perf_format import Segment
from ._waiting.base import HandleKind as HandleKind  # what sources say their handles are
from ._waiting.base import OnHandle as OnHandle


class RecordFormat(Protocol):
    """How the records of a span are laid out (perf records; BPF ring buffer records)."""

    name: str

    lost_records: bool
    """Whether the producer writes lost records into the ring (perf does; a BPF ring buffer not)."""

    def split(self, key: int, span: bytes) -> tuple[list[Segment], int]:
        """Segments of ``span`` in ring order, and the count of records skipped.

        Raises ``BrokenRingError`` on a record that does not fit.
        """
        ...


class Ring(Protocol):
    """One ring of a source."""

    key: int
    """The ring's id: the CPU for a perf event array (what ``Sample.cpu`` says); -1 for a
    BPF ring buffer, one ring for every CPU."""

    handle: int
    """Its readiness handle (several rings may share one)."""

    def take(self) -> bytes:
        """Copy out every complete record and release the space at once (b"" if none)."""
        ...

    def pending_bytes(self) -> int:
        """Bytes written and not yet taken."""
        ...

    def lost_total(self) -> int | None:
        """The producer's own count of samples dropped since the ring opened, if it keeps one.

        With it the reader reports losses that no lost record announces yet
        (the kernel writes one only in front of the next sample that fits).
        """
        ...


@dataclass(frozen=True)
class RingConfig:
    """What a driver asks of a source when it opens it."""

    ring_bytes: int | None
    """Data bytes per ring (a power of two), or None for the source's own size."""

    wakeup: Wakeup


class RingSource(Protocol):
    """Something that has rings. ``open`` is all-or-nothing; ``free`` is idempotent."""

    name: str
    handle_kind: HandleKind
    records: RecordFormat

    def open(self, config: RingConfig) -> Sequence[Ring]:
        """Create (or attach to) the rings; raise and hold nothing if any step fails."""
        ...

    @property
    def ring_bytes(self) -> int:
        """Data bytes of each ring (once open)."""
        ...

    @property
    def memory_bytes(self) -> int:
        """Memory the rings take in all (once open)."""
        ...

    def acknowledge(self, handle: int) -> None:
        """Clear ``handle``'s readiness before its rings are read."""
        ...

    def free(self) -> None:
        """Release the rings and handles (idempotent). No ring may be read afterwards."""
        ...

    def after_fork(self) -> None:
        """In a child process that inherited the open source: close this process's
        copies of the handles and release nothing shared with the parent (memory,
        map slots). Nothing may be read afterwards."""
        ...
