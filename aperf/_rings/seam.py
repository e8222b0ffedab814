"""The ring-source seam: what a reader needs from "something that has rings".

A source owns rings and their readiness handles; the reader (``_reading/reader.py``)
takes spans out of the rings and applies the one policy; drivers wait on the
handles and call the reader. A backend plugs in by implementing
``RingSource`` (public as ``aperf.abc``): the Linux perf event array
(``perf/source.py``), the BPF ring buffer (``ringbuf/source.py``), an array of
BPF ring buffers (``ringbuf/array.py``), eBPF for Windows' perf event array
(``windows/perf.py``) and ``aperf.testing.FakeRingSource`` (``perf/fake.py``) are
the five aperf ships.
A record format splits a span into ``Segment``s, the format-neutral pieces
defined here.

Readiness is one-shot, as the kernel's perf fds are: a handle fires once per
wakeup, and ``acknowledge()`` clears it before the rings are
read, so a wakeup that arrives while they are read is not lost.
"""

from __future__ import annotations

import functools
import operator
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

from .._errors import UnsupportedError
from .._options import Wakeup
from .._waiting.base import HandleKind as HandleKind  # what sources say their handles are
from .._waiting.base import OnHandle as OnHandle

# --- what a record format hands the reader: segments of a span, in ring order ---


class Run(NamedTuple):
    """``count`` records of ``stride`` bytes from byte ``start`` of ``span``, each holding a
    ``size``-byte payload ``skip`` bytes in: a run of one program's fixed-size samples,
    kept as it sits in the copied span (columnar consumers view it in place)."""

    span: bytes
    start: int
    count: int  # type: ignore[assignment]  # shadows tuple.count, as Lost.count does
    stride: int
    skip: int
    size: int

    def payloads(self, first: int = 0, stop: int | None = None) -> list[bytes]:
        """The payloads of records ``first`` to ``stop``, each a ``bytes`` of its own."""
        return list(self.each_payload(first, self.count if stop is None else stop))

    def each_payload(self, first: int, stop: int) -> Iterator[bytes]:
        """``payloads(first, stop)`` one at a time, for a consumer that zips them with
        other columns (no list in between)."""
        at = self.start + first * self.stride
        view = memoryview(self.span)[at : at + (stop - first) * self.stride]
        return map(_first, _payload_struct(self.stride, self.skip, self.size).iter_unpack(view))


_first = operator.itemgetter(0)


@functools.lru_cache(maxsize=256)
def _payload_struct(stride: int, skip: int, size: int) -> struct.Struct:
    return struct.Struct(f"{skip}x{size}s{stride - skip - size}x")


Segment = tuple[list[bytes], bool] | Run | int
"""A run of sample payloads (and whether they all have one size), a `Run` of
identical records in place, or a lost count."""


def payloads_of(segment: tuple[list[bytes], bool] | Run) -> list[bytes]:
    """The payloads of a sample segment, whichever form it has."""
    return segment.payloads() if isinstance(segment, Run) else segment[0]


RunEnd = Callable[[bytes, int, int, int], int]
"""``(span, pos, size, end)`` -> where the run of identical records from ``pos`` ends."""

Split = Callable[[int, bytes], tuple[list[Segment], int]]
"""A record format's ``split``."""


# --- the protocols ---



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


@runtime_checkable
class ColumnarRecords(RecordFormat, Protocol):
    """A record format with a split of its own for columnar consumers (aperf's own: perf
    records, whose runs of identical records NumPy finds at C speed)."""

    def columnar_split(self) -> Split:
        """A split as ``split``, for a reader whose consumer takes arrays."""
        ...


class Ring(Protocol):
    """One ring of a source."""

    key: int
    """The ring's id: the CPU for a perf event array (what ``Sample.cpu`` says); -1 for a
    BPF ring buffer, one ring for every CPU; the slot (the CPU) of a ring in an array of
    ring buffers."""

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


class SourceEnded(Exception):
    """Raised by a source's ``acknowledge(handle)`` when the source is over for good
    (e.g. another process took its map over): the reader queues what its rings
    hold if ``drain`` (they are still this reader's), then ``error``, and stops.
    ``error`` None: the source came to its end (a replay of a recording): nothing is
    raised, and the drivers close the stream once it handed out what it holds."""

    def __init__(self, error: BaseException | None, *, drain: bool) -> None:
        super().__init__(error)
        self.error = error
        self.drain = drain


@dataclass(frozen=True)
class RingConfig:
    """What a driver asks of a source when it opens it."""

    ring_bytes: int | None
    """Data bytes per ring (a power of two), or None for the source's own size."""

    wakeup: Wakeup

    cpus: tuple[int, ...] | None = None
    """The CPUs to open rings on (checked), or None for every online CPU (perf only)."""

    map_keys: tuple[int, ...] | None = None
    """The map slot of each ring of ``cpus``, index for index, or None for the CPU ids."""

    memory_bytes: int | None = None
    """A budget for all rings together, instead of ``ring_bytes`` (perf only)."""

    overwritable: bool = False
    """Flight-recorder rings: the kernel overwrites the oldest records (perf only)."""


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
        """Clear ``handle``'s readiness before its rings are read (or a notice's, of a
        ``NoticeSource``: that may raise ``SourceEnded``)."""
        ...

    def free(self) -> None:
        """Release the rings and handles (idempotent). No ring may be read afterwards."""
        ...

    def after_fork(self) -> None:
        """In a child process that inherited the open source: close this process's
        copies of the handles and release nothing shared with the parent (memory,
        map slots). Nothing may be read afterwards."""
        ...


# --- what a source may add: each optional ability is a protocol of its own ---
#
# As trio.abc declares ``HalfCloseableStream(Stream)``, each ability is a sub-protocol of
# ``RingSource``: the reader and the drivers ask ``isinstance(source, HotplugSource)``,
# never for a member by name, and a source has an ability exactly when it has its
# members (tests/unit/test_abc.py holds every source aperf ships to what it declares).


@runtime_checkable
class NoticeSource(RingSource, Protocol):
    """A source with notices: readiness handles of no ring, which the drivers wait on
    too (a map lock's take-over requests, the CPU hotplug uevent socket, a replay's
    end). Their ``acknowledge`` may raise ``SourceEnded``: the reader then queues what
    the rings hold, then the error, and stops."""

    @property
    def notices(self) -> Sequence[int]:
        """The notice handles, while open (the list may change only at open)."""
        ...


@runtime_checkable
class HotplugSource(NoticeSource, Protocol):
    """A source that follows CPU hotplug (a perf event array opened on every online CPU):
    after one of its notices fired, ``cpus_changed()`` says which rings' CPUs went
    offline and hands over the rings of CPUs that came online."""

    def cpus_changed(self) -> tuple[list[int], Sequence[Ring]]:
        """The keys of the rings whose CPU went offline (still readable: the reader drains
        them, then retires them), and the new rings of CPUs that came online."""
        ...


@runtime_checkable
class PausableSource(RingSource, Protocol):
    """A source whose producer can be stopped at the source.

    A perf event array pauses by emptying its map slots, so that the BPF program's
    ``bpf_perf_event_output()`` fails with ``-ENOENT`` (counted by the BPF side, not
    by aperf) instead of filling rings; the rings stay open and what they hold is
    still read. Both calls are idempotent.
    """

    def pause(self) -> None:
        """Stop the producer writing into the rings (idempotent)."""
        ...

    def resume(self) -> None:
        """Let the producer write into the rings again (idempotent)."""
        ...


@runtime_checkable
class QuiescingSource(RingSource, Protocol):
    """A source whose producer can be stopped for good, before the close's last drain.

    ``quiesce()`` returns once nothing writes into the rings any more: a perf event
    array empties its map slots (the BPF side's output fails with ``-ENOENT`` from then
    on, counted by the BPF side only, as while paused) and waits for the BPF programs
    that read a slot before that to return. The last drain then takes everything the
    rings will ever hold, so freeing them loses nothing the kernel accepted. A source
    without it is drained, then freed, as it is (a BPF ring buffer is the map's own
    memory: what is written after the last drain stays in it for the map's next reader).
    """

    def quiesce(self) -> None:
        """Return once nothing writes into the rings any more (idempotent)."""
        ...


@runtime_checkable
class SnapshotSource(RingSource, Protocol):
    """A source with flight-recorder rings (a perf event array opened with
    ``overwritable=True``): ``snapshot()`` reads their newest records on demand."""

    def newest(self) -> list[tuple[int, bytes]]:
        """Each flight-recorder ring's records, oldest first, as ``(key, span)``: read
        with the producer paused, then resumed unless it was paused already.
        ``UnsupportedError`` if the rings are not flight-recorder rings."""
        ...


@runtime_checkable
class GatheringSource(RingSource, Protocol):
    """A source whose kernel wakes the reader only once it caught up (a BPF ring buffer:
    a record committed at the consumer position wakes it, others do not), so that with
    batched wakeups the reader may leave a wakeup to its drain timer and let records
    gather meanwhile; and whose wakeups can be held back while records flow."""

    wakes_when_caught_up: bool
    """True: what makes gathering safe (no wakeup comes while the reader lags)."""

    def hush_wakeups(self, handle: int, hushed: bool) -> None:
        """Hold the kernel's wakeups back from ``handle`` (True), or pass them again
        (False: records already there are reported at once, none is missed)."""
        ...


@runtime_checkable
class MapSource(RingSource, Protocol):
    """A source that reads a BPF map: it claims the map, so that a second reader, in
    this process or another, is refused (``BusyResourceError``) unless it takes the map
    over (``take_over``); and it knows the ``aperf.BPFObject`` the map belongs to, if
    any, whose BTF names decoders (``decoder="struct event"``)."""

    take_over: bool
    """Set before open: ask the reader holding the map in another process to give it up."""

    @property
    def object(self) -> object | None:
        """The ``aperf.BPFObject`` the map belongs to, if known."""
        ...


@runtime_checkable
class RecordedSource(RingSource, Protocol):
    """A source that knows the decoder its samples were made for (a replay of a
    recording), and refuses a stream's decoder that is another one."""

    def check_decoder(self, decoder: object) -> None:
        """Raise ``aperf.DecoderMismatchError`` naming both, if ``decoder`` is not it."""
        ...


# --- several maps in one stream (aperf's own, not for backends) ---

MAP_KEY_STRIDE = 1 << 20
"""In a source of several maps, ring keys of map ``i`` are ``i * MAP_KEY_STRIDE + key + 1``
(``map_key_offset(i) + key``): room for any CPU id (or perf map key) below
``MAP_KEY_STRIDE - 1``, and for -1 (a ring buffer)."""

def map_key_offset(index: int) -> int:
    """What map ``index`` of a source of several maps adds to its rings' keys."""
    return index * MAP_KEY_STRIDE + 1


class MapMember(Protocol):
    """One map of a source of several: its name, its source and its decoder."""

    @property
    def name(self) -> str: ...

    @property
    def source(self) -> RingSource: ...

    @property
    def decoder(self) -> Callable[[bytes], object] | None: ...


@runtime_checkable
class SeveralMapsSource(RingSource, Protocol):
    """A source made of the sources of several maps (``PerfStream({name: map, ...})``),
    whose rings carry composite keys (``map_key_offset``); what the reader builds per
    map (an event builder, columns) it builds from ``members``."""

    @property
    def members(self) -> Sequence[MapMember]: ...

    def ring_bytes_of(self, key: int) -> int:
        """The data bytes of ring ``key``: its map's ring size."""
        ...

    def map_facts(self, exact: Callable[[int], bool]) -> dict[str, tuple[int, int, str]]:
        """Each map's ring size, memory and where its loss counts come from."""
        ...

    def split_with(self, splits: Sequence[Split]) -> Split:
        """A split over the composite keys that hands each span to its map's ``splits``."""
        ...


def quiesce(source: RingSource) -> None:
    """The source's ``quiesce()``, if it has one (``QuiescingSource``)."""
    if isinstance(source, QuiescingSource):
        source.quiesce()


def set_paused(source: RingSource, paused: bool) -> None:
    """``pause()``/``resume()`` of a driver: the source's, or ``UnsupportedError``."""
    step = "pause" if paused else "resume"
    if isinstance(source, PausableSource):
        if paused:
            source.pause()
        else:
            source.resume()
        return
    if isinstance(source, SeveralMapsSource):
        cannot = [m.name for m in source.members if not isinstance(m.source, PausableSource)]
        raise UnsupportedError(
            f"map {', '.join(map(repr, cannot))} cannot {step} its producer: a BPF ring "
            "buffer has no map slots to empty; a stream of several maps pauses all of "
            "them or none (stop or detach the BPF programs instead)"
        )
    raise UnsupportedError(
        f"{source.name} cannot pause its producer: it has no map slots to empty "
        "(a BPF ring buffer has one ring for every CPU and no slots); stop or detach "
        "the BPF program instead"
    )


def _members(protocol: type) -> tuple[str, ...]:
    """A protocol's members as declared: annotated attributes, methods and properties."""
    names = dict.fromkeys(getattr(protocol, "__annotations__", {}))
    for name, value in vars(protocol).items():
        if not name.startswith("_") and (callable(value) or isinstance(value, property)):
            names[name] = None
    return tuple(names)


RING_SOURCE_MEMBERS = _members(RingSource)
"""Every member a ring source must have: ``PerfStream``/``PerfBuffer`` refuse a source
lacking any of them (``TypeError`` naming it), before anything opens."""
