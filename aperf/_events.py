"""What a stream yields: samples, lost notices, decode failures; and its statistics."""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Literal, NamedTuple, Union

from ._errors import DecodeError

if sys.version_info >= (3, 13):
    from typing import TypeVar
else:
    from typing_extensions import TypeVar

# What the decoder returns; a bare Sample (or PerfStream) means Sample[Any].
T = TypeVar("T", default=Any)

if sys.version_info < (3, 11) and not TYPE_CHECKING:
    # Python 3.10: NamedTuple cannot be generic there; the same fields. (This branch
    # comes first so that the API reference, which reads the last one, shows the other.)

    class Sample(NamedTuple):
        """One sample a BPF program wrote (``bpf_perf_event_output()``)."""

        cpu: int
        data: bytes
        value: Any = None

        map = None
        late = False

    Sample.__class_getitem__ = classmethod(lambda cls, item: cls)  # type: ignore[attr-defined]

else:

    class Sample(NamedTuple, Generic[T]):
        """One sample a BPF program wrote (``bpf_perf_event_output()``).

        ``data`` is a ``bytes`` object owned by the caller (never a view of ring
        memory). The kernel pads raw samples: ``len(data)`` is ``round_up(S + 4, 8) - 4``
        for an S-byte output. ``value`` is the decoder's result, or None without one.
        """

        cpu: int
        data: bytes
        value: T = None  # type: ignore[assignment]

        @property
        def map(self) -> str | None:
            """The name of the map the sample came from, in a stream of several maps
            (``PerfStream({"name": map, ...})``); None in a stream of one."""
            return None

        @property
        def late(self) -> bool:
            """True for a sample an ordered stream (``order_by=``) received after it had
            released later ones: delivered anyway, out of order, and counted
            (``statistics().late``)."""
            return False


class Lost(NamedTuple):
    """The kernel dropped ``count`` samples on ``cpu`` because its ring was full.

    It arrives in ring order: after the samples that made it before the overflow.
    """

    cpu: int
    count: int  # type: ignore[assignment]  # shadows tuple.count on purpose: the contract

    @property
    def map(self) -> str | None:
        """The map whose ring dropped them, in a stream of several maps; else None."""
        return None


class BadSample(NamedTuple):
    """A sample the decoder could not decode (yielded under ``decode_errors="item"``)."""

    cpu: int
    data: bytes
    error: DecodeError

    @property
    def map(self) -> str | None:
        """The map the sample came from, in a stream of several maps; else None."""
        return None

    @property
    def late(self) -> bool:
        """As ``Sample.late``."""
        return False


Event = Union[Sample[T], Lost, BadSample]  # noqa: UP007 - a generic alias needs Union here
"""What a stream yields: ``Event[T]`` for a stream whose decoder returns ``T``."""


def tagged(kind: type, map: str | None = None, late: bool = False) -> type:
    """The subclass of ``Sample``, ``Lost`` or ``BadSample`` whose events say ``map`` and
    ``late``: the tags are class attributes, so an event stays the same tuple of the
    same fields (unpacking, ``==`` and ``match`` work as before) and costs nothing
    more per event. ``kind`` itself when there is nothing to say. Cached: one class
    per (kind, map, late); they pickle through ``_untag``."""
    return _tagged(kind, map, late)  # one cache key however the tags were passed


@functools.cache
def _tagged(kind: type, map: str | None, late: bool) -> type:
    base = getattr(kind, "_untagged", kind)
    if map is None and not late:
        return base
    if late and base is Lost:
        raise ValueError("a Lost notice is never late")

    def __repr__(self: Any) -> str:
        tags = f", map={map!r}" if map is not None else ""
        tags += ", late=True" if late else ""
        return str(base.__repr__(self))[:-1] + tags + ")"  # type: ignore[call-arg]

    def __reduce__(self: Any) -> tuple[Any, ...]:
        return (_untag, (base.__name__, map, late, tuple(self)))

    namespace = {
        "__slots__": (), "map": map, "late": late, "_untagged": base,
        "__repr__": __repr__, "__reduce__": __reduce__, "__module__": base.__module__,
        "__qualname__": base.__qualname__,
    }
    return type(base.__name__, (base,), namespace)


def _untag(kind: str, map: str | None, late: bool, fields: tuple[Any, ...]) -> Any:
    """Unpickle a tagged event."""
    base = {"Sample": Sample, "Lost": Lost, "BadSample": BadSample}[kind]
    return tuple.__new__(tagged(base, map, late), fields)


class _Failure(NamedTuple):
    """An exception queued in stream order (a broken ring); raised when the consumer reaches it."""

    error: BaseException


@dataclass(frozen=True)
class CpuStatistics:
    """Counters of one ring (one CPU's) since the stream opened.

    ``backlog_bytes`` is what the ring holds now, written and not yet taken
    (record headers included; cilium/ebpf's ``Record.Remaining``, libbpf's
    ``ring__avail_data_size``). ``high_water`` is the fullest the ring was
    found: the largest span one drain took, as a fraction of ``ring_bytes``.
    ``lost`` is split by cause: ``queue_lost`` counts the drops the kernel
    made while aperf held the ring back because its own queue was full
    (backpressure: ``max_pending``), ``ring_lost`` the others (the ring
    filled faster than aperf drained it); ``queue_lost + ring_lost == lost``.
    See docs/rings.md.
    """

    cpu: int
    samples: int
    lost: int
    bytes: int
    wakeups: int
    decode_errors: int
    other_records: int
    broken: bool
    backlog_bytes: int = 0
    high_water: float = 0.0
    queue_lost: int = 0
    map: str | None = None
    """The map of the ring, in a stream of several maps (None in a stream of one);
    ``cpu`` is then the ring's real CPU (-1 for a BPF ring buffer)."""
    late: int = 0  # samples an ordered stream delivered late (docs/ordering.md)

    @property
    def ring_lost(self) -> int:
        """Drops that were not the queue's: ``lost - queue_lost``."""
        return self.lost - self.queue_lost


@dataclass(frozen=True)
class StreamStatistics:
    """A snapshot of a stream's counters; ``cpus`` holds one entry per ring.

    ``lost_counter`` says where loss counts come from: ``"exact"`` when the
    producer keeps its own count (Linux 6.0+ perf events with
    ``PERF_FORMAT_LOST``; ``lost`` then includes drops that no lost record has
    announced yet), ``"records"`` when only the kernel's lost records count
    (older kernels: drops at the end of a burst show up once a sample follows),
    ``"none"`` for a BPF ring buffer read without the BPF side's count of failed
    outputs (the kernel counts none: see [`aperf.RingBufferSource`][aperf.RingBufferSource]).
    ``fast_path`` says whether the stream runs on aperf's compiled fast path
    ([`aperf.EXTENSIONS`][aperf.EXTENSIONS]).
    """

    cpus: tuple[CpuStatistics, ...]
    pending: int
    max_pending: int
    paused: bool
    ring_bytes: int
    memory_bytes: int
    closed: bool
    drain_period: float | None = None  # the drain timer's current period (None: no timer)
    lost_counter: Literal["exact", "records", "none"] = "records"
    fast_path: bool = dataclasses.field(default=False, compare=False)
    """Whether the stream runs on aperf's compiled fast path (``aperf.EXTENSIONS``)."""
    # Several maps: each map's (ring_bytes, memory_bytes, lost_counter), for by_map().
    _maps: dict[str, tuple[int, int, Any]] | None = dataclasses.field(
        default=None, repr=False, compare=False)

    @property
    def samples(self) -> int:
        """Samples taken out of the rings, all CPUs."""
        return sum(c.samples for c in self.cpus)

    @property
    def lost(self) -> int:
        """Samples the kernel dropped, all CPUs."""
        return sum(c.lost for c in self.cpus)

    @property
    def bytes(self) -> int:
        """Bytes taken out of the rings, all CPUs."""
        return sum(c.bytes for c in self.cpus)

    @property
    def wakeups(self) -> int:
        """Kernel wakeups, all CPUs."""
        return sum(c.wakeups for c in self.cpus)

    @property
    def decode_errors(self) -> int:
        """Samples the decoder refused, all CPUs."""
        return sum(c.decode_errors for c in self.cpus)

    @property
    def backlog_bytes(self) -> int:
        """Bytes waiting in the rings now, all CPUs."""
        return sum(c.backlog_bytes for c in self.cpus)

    @property
    def queue_lost(self) -> int:
        """Drops made while aperf's queue was full, all CPUs."""
        return sum(c.queue_lost for c in self.cpus)

    @property
    def late(self) -> int:
        """Samples an ordered stream (``order_by=``) delivered late, all CPUs."""
        return sum(c.late for c in self.cpus)

    @property
    def ring_lost(self) -> int:
        """The other drops, all CPUs: ``lost == queue_lost + ring_lost``."""
        return sum(c.ring_lost for c in self.cpus)

    def by_map(self) -> dict[str | None, StreamStatistics]:
        """This snapshot per map, in a stream of several maps: for each map's name, the
        same statistics with ``cpus`` holding that map's rings only, so that its sums
        (``samples``, ``lost``, ``bytes``...) are the map's, and with the map's own
        ``ring_bytes``, ``memory_bytes`` and ``lost_counter``. The queue's fields
        (``pending``, ``max_pending``, ``paused``, ``drain_period``, ``closed``) are the
        stream's: one queue serves every map. A stream of one map: ``{None: self}``.

        The stream's own ``ring_bytes`` is its largest ring's, ``memory_bytes`` the sum,
        and ``lost_counter`` the best any map has (``"exact"`` if one map's producer
        counts its drops)."""
        if self._maps is None:  # a stream of one map (or statistics made by hand)
            names = dict.fromkeys(c.map for c in self.cpus) or {None: None}
            return {name: dataclasses.replace(
                self, cpus=tuple(c for c in self.cpus if c.map == name)) for name in names}
        out: dict[str | None, StreamStatistics] = {}
        for name, (ring_bytes, memory_bytes, counter) in self._maps.items():
            out[name] = dataclasses.replace(
                self, cpus=tuple(c for c in self.cpus if c.map == name), ring_bytes=ring_bytes,
                memory_bytes=memory_bytes, lost_counter=counter, _maps=None)
        return out


class SampleArray:
    """Samples of one CPU, in ring order, as a NumPy structured array (columnar batches).

    ``map`` names the map they came from in a stream of several maps (None otherwise).

    ``values`` has one row per sample and the decoder's fields as columns (the
    same names as its records: ``values["pid"]``); it is read-only and, for a
    run of equal-sized records, a view of the bytes aperf copied out of the
    ring (a lease's arrays view the ring's memory itself, while it is held: docs/columnar.md,
    "Leases: arrays in the ring itself"): ``values.copy()`` makes a compact, writable
    copy. ``tails``, for a struct ending in a flexible array member, holds each
    sample's bytes after the fixed part; otherwise None. ``len()`` is the
    number of samples. See docs/columnar.md.

    From an ordered stream (``order_by=``, docs/ordering.md) an array holds the rows
    of one release, sorted, from any rings: ``cpu`` is -1 when they come from
    several, and ``cpus`` then gives each row's (a NumPy array; None otherwise).
    ``late`` is True for an array of late rows: received after later ones had been
    released (counted in ``statistics().late``).
    """

    __slots__ = ("_columns", "_source", "cpu", "cpus", "late", "map", "tails", "values")
    __match_args__ = ("cpu", "values", "tails")

    def __init__(self, cpu: int, values: Any, tails: Tails | None = None, *,
                 map: str | None = None, _source: Any = None, _columns: Any = None) -> None:
        self.cpu = cpu
        self.values = values
        self.tails = tails
        self.map = map  # the map's name in a stream of several maps, else None
        self._source = _source  # the raw records, to rebuild Sample events from
        self._columns = _columns  # what made it (its decoder): for to_arrow()
        self.cpus: Any = None  # per-row ring keys, for rows of several rings (ordered)
        self.late = False

    def to_arrow(self) -> Any:
        """These samples as a ``pyarrow.RecordBatch``: ``_cpu`` (each row's ring key),
        ``_map`` (in a stream of several maps), ``_late``, then the decoder's fields typed
        from its C layout (docs/arrow.md). Each fixed-width column is gathered once out of
        the rows (the only copy) and that NumPy buffer is the Arrow buffer; nothing in
        the batch views ring memory, so a batch made in a lease stays valid after it.

        Needs pyarrow: ``aperf.MissingExtraError`` (an ImportError) naming the extra,
        ``pip install 'aperf-bpf[arrow]'``, without it."""
        columns = self._columns
        if columns is None:
            raise TypeError("this SampleArray was not made by a stream: its decoder, which "
                            "the Arrow schema comes from, is unknown")
        return columns.to_arrow(self)

    def __len__(self) -> int:
        return len(self.values)

    def __repr__(self) -> str:
        tails = ", tails" if self.tails is not None else ""
        where = f" map={self.map!r}" if self.map is not None else ""
        tails += ", late" if self.late else ""
        return (f"<SampleArray{where} cpu={self.cpu} {len(self)} samples{tails} "
                f"dtype={self.values.dtype}>")


class Tails:
    """The bytes each sample holds after its fixed part: ``data[starts[i]:stops[i]]``.

    ``starts`` and ``stops`` are NumPy int64 arrays into ``data`` (for vectorised
    work, e.g. ``numpy.frombuffer(tails.data, numpy.uint8)``); ``tails[i]`` is
    one sample's bytes, ``list(tails)`` all of them. They include the kernel's
    padding (up to 7 bytes, not zeroed): a program should write the length it
    means into a field of the fixed part.
    """

    __slots__ = ("data", "starts", "stops")

    def __init__(self, data: bytes, starts: Any, stops: Any) -> None:
        self.data = data
        self.starts = starts
        self.stops = stops

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> bytes:
        return self.data[int(self.starts[index]) : int(self.stops[index])]

    def __iter__(self) -> Iterator[bytes]:
        data = self.data
        return (data[a:b] for a, b in zip(self.starts.tolist(), self.stops.tolist(), strict=True))

    @property
    def lengths(self) -> Any:
        """The length of each tail (a NumPy array)."""
        return self.stops - self.starts
