"""Several maps, one stream: a ring source made of other ring sources.

``PerfStream({"events": perf_map, "rb": ringbuf_map})`` reads every member
through one reader, one bounded queue and one drain clock (libbpf's
``ring_buffer__add``, libbpf-rs's ``RingBufferBuilder::add``). The reader is
the single-map one: it only sees rings, keyed here by a composite key,
``index * STRIDE + cpu + 1`` (a ring buffer's cpu -1 fits), so that every ring
of every member has a key of its own. The composite key never leaves aperf:
each map has an ``EventBuilder`` (and a ``Columns``) of its own that builds the
map's tagged event classes (``tagged(Sample, name)``) with the real CPU.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from .._errors import BrokenRingError, UnsupportedError
from .._events import Event, Lost, SampleArray
from .._options import DecodeErrorPolicy
from .._rings.seam import (
    HandleKind,
    RecordFormat,
    Ring,
    RingConfig,
    RingSource,
    Run,
    Segment,
    SourceEnded,
)
from .build import Decoder, EventBuilder, Payloads, Requeue, RunPiece

if TYPE_CHECKING:
    from .columnar import ArrayItem, Columns

STRIDE = 1 << 20
"""Ring keys of member ``i`` are ``i * STRIDE + cpu + 1``: room for any CPU id (or perf
map key) below ``STRIDE - 1``, and for -1 (a ring buffer)."""

Split = Callable[[int, bytes], tuple[list[Segment], int]]


def offset_of(index: int) -> int:
    """What member ``index`` adds to its rings' keys."""
    return index * STRIDE + 1


def _nothing() -> bytes:
    return b""


def _empty() -> int:
    return 0


class _MemberRing:
    """A member's ring under its composite key; its calls are the member ring's own."""

    __slots__ = ("handle", "key", "lost_total", "pending_bytes", "ring", "take")

    def __init__(self, ring: Ring, offset: int) -> None:
        self.ring = ring
        self.key = ring.key + offset
        self.handle = ring.handle
        self.take: Callable[[], bytes] = ring.take
        self.pending_bytes: Callable[[], int] = ring.pending_bytes
        self.lost_total: Callable[[], int | None] = ring.lost_total

    def __getattr__(self, name: str) -> Any:
        # Anything else a ring may offer (optional calls a reader looks up) is the
        # member ring's own; only the key differs.
        if name == "ring":
            raise AttributeError(name)  # not set yet: no recursion
        return getattr(self.ring, name)

    def silence(self) -> None:
        """The ring is no longer ours (its map was taken over): nothing more to read, and
        no drop counted from now on is ours to report."""
        frozen = self.lost_total()
        self.take = _nothing
        self.pending_bytes = _empty
        self.lost_total = lambda: frozen


class MultiRecords:
    """The members' record formats, by ring key: each span split by its own map's format,
    with its member key (the real CPU), so that a ``BrokenRingError`` says it; and the
    map's name."""

    name: str
    lost_records: bool

    def __init__(self, names: Sequence[str], sources: Sequence[RingSource]) -> None:
        self.names = list(names)
        self.formats = [source.records for source in sources]
        self.name = "+".join(sorted({f.name for f in self.formats}))
        self.lost_records = any(getattr(f, "lost_records", True) for f in self.formats)
        self.split: Split = self.dispatching([f.split for f in self.formats])

    def dispatching(self, splits: Sequence[Split]) -> Split:
        """A split over composite keys that hands each span to its member's ``splits``."""
        names = self.names

        def split(key: int, span: bytes) -> tuple[list[Segment], int]:
            index = key // STRIDE
            try:
                return splits[index](key - offset_of(index), span)
            except BrokenRingError as exc:
                if exc.map is None:
                    exc.map = names[index]
                    exc.args = (f"map {names[index]!r}: {exc.args[0]}", *exc.args[1:])
                raise

        return split


class MultiBuilder:
    """The reader's event builder over several maps: each piece goes to its map's builder
    (by ring key); decode errors are counted in one dict by ring key."""

    __slots__ = ("decode_errors", "decoder", "errors", "members")

    def __init__(self, members: Sequence[EventBuilder], errors: dict[int, int],
                 decode_errors: DecodeErrorPolicy) -> None:
        self.members = list(members)
        self.errors = errors
        self.decode_errors = decode_errors
        self.decoder: Decoder | None = None  # one per map: see members

    def run(self, key: int, run: Run, start: int, stop: int, out: list[Any]) -> None:
        self.members[key // STRIDE].run(key, run, start, stop, out)

    def payloads(self, key: int, payloads: list[bytes], uniform: bool, out: list[Any]) -> None:
        self.members[key // STRIDE].payloads(key, payloads, uniform, out)

    def failed(
        self, key: int, payloads: list[bytes], uniform: bool, index: int, exc: Exception,
        out: list[Event[Any]],
    ) -> bool:
        return self.members[key // STRIDE].failed(key, payloads, uniform, index, exc, out)

    def lost(self, key: int, count: int) -> Lost:
        return self.members[key // STRIDE].lost(key, count)

    def cpu_of(self, key: int) -> int:
        return key - offset_of(key // STRIDE)

    def key_of(self, event: Lost) -> int:
        """The ring key of a notice a member made: its map's offset plus its real CPU."""
        for index, member in enumerate(self.members):
            if member.map == event.map:
                return int(event.cpu) + offset_of(index)
        raise LookupError(f"no map named {event.map!r} in this stream")

    def map_of(self, key: int) -> str | None:
        return self.members[key // STRIDE].map


class MultiColumns:
    """Columnar batches over several maps: a ``Columns`` per map (each its own dtype),
    by ring key; the front queues' items go to the ``Columns`` of their map."""

    def __init__(self, members: Sequence[Columns]) -> None:
        self.members = list(members)
        self._index = {columns.map: index for index, columns in enumerate(members)}

    def split_for(self, records: Any) -> Split:
        """The reader's split, with each map's runs found as its ``Columns`` finds them."""
        assert isinstance(records, MultiRecords)
        return records.dispatching([
            columns.split_for(fmt) for columns, fmt in zip(self.members, records.formats,
                                                           strict=True)
        ])

    def arrays(self, piece: RunPiece | Payloads, builder: MultiBuilder, max_rows: int | None,
               out: list[Any]) -> None:
        index = piece.key // STRIDE
        self.members[index].arrays(piece, builder.members[index], max_rows, out)

    def front(self, events: Iterable[Event[Any]]) -> list[ArrayItem]:
        """Built events as arrays: each run of one map's events by its ``Columns``."""
        out: list[ArrayItem] = []
        group: list[Any] = []
        for event in events:
            if group and event.map != group[0].map:
                out.extend(self.members[self._index[group[0].map]].front(group))
                group = []
            group.append(event)
        if group:
            out.extend(self.members[self._index[group[0].map]].front(group))
        return out

    def events(self, items: Iterable[ArrayItem], builder: MultiBuilder) -> list[Event[Any]]:
        """Built arrays as events again, each by its map's builder."""
        events: list[Event[Any]] = []
        for item in items:
            if item.__class__ is SampleArray:
                index = self._index[item.map]
                events.extend(self.members[index].events([item], builder.members[index]))
            else:
                events.append(item)  # type: ignore[arg-type]
        return events


@dataclasses.dataclass(frozen=True)
class Member:
    """One map of a stream of several: its name, its source, its decoder, and which of
    the stream's options its rings take."""

    name: str
    source: RingSource
    decoder: Decoder | None
    sized: bool  # pages/ring_bytes are for its rings (not a BPF ring buffer's)
    laid_out: bool  # cpus=/map_keys= are for its rings (a perf event array's)


class MultiSource:
    """A ring source over several others (``PerfStream({name: map, ...})``).

    ``open`` is all or nothing; ``free`` and ``after_fork`` go to every member, in order.
    Readiness handles are the members' own fds, so each one's ``acknowledge`` goes to
    the member that owns it.
    """

    def __init__(self, members: Sequence[Member]) -> None:
        kinds = {m.source.handle_kind for m in members}
        if len(kinds) != 1:
            raise UnsupportedError(
                "several maps in one stream must be waited on alike; these have handles of "
                f"kinds {sorted(kinds)}"
            )
        self.members = list(members)
        self.handle_kind: HandleKind = kinds.pop()
        self.name = f"several maps ({', '.join(m.name for m in members)})"
        self.multi_records = MultiRecords([m.name for m in members], [m.source for m in members])
        self.records: RecordFormat = self.multi_records
        self._owner: dict[int, int] = {}  # readiness handle -> member index
        self._rings: list[list[_MemberRing]] = [[] for _ in members]
        self._sizes: list[int] = [0] * len(members)

    # --- the RingSource protocol ------------------------------------------------------

    def open(self, config: RingConfig) -> Sequence[Ring]:
        opened: list[RingSource] = []
        rings: list[Ring] = []
        try:
            for index, member in enumerate(self.members):
                own = dataclasses.replace(
                    config,
                    ring_bytes=config.ring_bytes if member.sized else None,
                    cpus=config.cpus if member.laid_out else None,
                    map_keys=config.map_keys if member.laid_out else None,
                )
                member_rings = member.source.open(own)
                opened.append(member.source)
                self._sizes[index] = member.source.ring_bytes
                rings.extend(self._adopt(index, member_rings))
        except BaseException:
            for source in reversed(opened):
                with contextlib.suppress(Exception):  # the open's error is the one to raise
                    source.free()
            self._owner.clear()
            self._rings = [[] for _ in self.members]
            raise
        self._learn_notices()
        return rings

    def _adopt(self, index: int, rings: Iterable[Ring]) -> list[_MemberRing]:
        offset = offset_of(index)
        adopted = []
        for ring in rings:
            if not -1 <= ring.key < STRIDE - 1:
                raise UnsupportedError(
                    f"map {self.members[index].name!r}: ring key {ring.key} is too large for "
                    f"a stream of several maps (below {STRIDE - 1})"
                )
            adopted.append(_MemberRing(ring, offset))
            self._owner[ring.handle] = index
        self._rings[index].extend(adopted)
        return adopted

    def _learn_notices(self) -> None:
        for index, member in enumerate(self.members):
            for handle in getattr(member.source, "notices", ()):
                self._owner[handle] = index

    @property
    def notices(self) -> list[int]:
        """Every member's notices (handles of no ring: map locks, CPU hotplug)."""
        return [h for m in self.members for h in getattr(m.source, "notices", ())]

    @property
    def ring_bytes(self) -> int:
        """The largest member's ring (see ``ring_bytes_of`` for each ring's)."""
        return max(self._sizes, default=0)

    def ring_bytes_of(self, key: int) -> int:
        """The data bytes of ring ``key``: its map's ring size."""
        return self._sizes[key // STRIDE]

    @property
    def memory_bytes(self) -> int:
        return sum(m.source.memory_bytes for m in self.members)

    def map_facts(self, exact: Callable[[int], bool]) -> dict[str, tuple[int, int, str]]:
        """Each map's ring size, memory and where its loss counts come from (as
        ``LossLedger.counter`` says for a stream of one; ``exact``: whether the producer
        of ring ``key`` counts its drops)."""
        facts = {}
        for index, member in enumerate(self.members):
            if any(exact(ring.key) for ring in self._rings[index]):
                counter = "exact"
            else:
                counter = "records" if getattr(member.source.records, "lost_records",
                                               True) else "none"
            facts[member.name] = (self._sizes[index], member.source.memory_bytes, counter)
        return facts

    def acknowledge(self, handle: int) -> None:
        index = self._owner.get(handle)
        if index is None:
            self._learn_notices()  # a notice made since open (none today; cheap)
            index = self._owner.get(handle)
            if index is None:
                return
        try:
            self.members[index].source.acknowledge(handle)
        except SourceEnded as end:
            if not end.drain:
                # This map's rings are the taker's now; the other maps' are still ours:
                # the reader drains them before it ends the stream.
                for ring in self._rings[index]:
                    ring.silence()
            raise SourceEnded(end.error, drain=True) from end.error

    def cpus_changed(self) -> tuple[list[int], list[Ring]]:
        """CPU hotplug, for every member that follows it: keys as composite keys."""
        gone: list[int] = []
        new: list[Ring] = []
        for index, member in enumerate(self.members):
            changed = getattr(member.source, "cpus_changed", None)
            if changed is None:
                continue
            went, came = changed()
            offset = offset_of(index)
            keys = {key + offset for key in went}
            gone.extend(sorted(keys))
            # The rings of CPUs gone offline are the reader's to drain and forget: their
            # handles stop being this member's (an fd number may come back as another's).
            kept = [ring for ring in self._rings[index] if ring.key not in keys]
            live = {ring.handle for ring in kept}
            for ring in self._rings[index]:
                if ring.key in keys and ring.handle not in live:
                    self._owner.pop(ring.handle, None)
            self._rings[index] = kept
            new.extend(self._adopt(index, came))
        return gone, new

    def pause(self) -> None:
        """Pause every map's producer (``PausableSource``), or none of them."""
        self._set_paused("pause")

    def resume(self) -> None:
        self._set_paused("resume")

    def _set_paused(self, step: str) -> None:
        cannot = [m.name for m in self.members if not hasattr(m.source, step)]
        if cannot:
            raise UnsupportedError(
                f"map {', '.join(map(repr, cannot))} cannot {step} its producer: a BPF ring "
                "buffer has no map slots to empty; a stream of several maps pauses all of "
                "them or none (stop or detach the BPF programs instead)"
            )
        for member in self.members:
            getattr(member.source, step)()

    def quiesce(self) -> None:
        """Stop every member's producer (``QuiescingSource``) before the close drains any
        ring: a map whose producer wrote on until the maps before it were freed would
        lose what it wrote meanwhile. Every member is asked, even after one fails."""
        self._each("quiesce", optional=True, forget=False)

    def free(self) -> None:
        self._each("free")

    def after_fork(self) -> None:
        self._each("after_fork")

    def _each(self, step: str, *, optional: bool = False, forget: bool = True) -> None:
        """Every member's ``step`` (``optional``: of those that have it), in order, even
        after one fails (the first error raised); ``forget``: the rings too."""
        if forget:
            self._owner = {}
            self._rings = [[] for _ in self.members]
        failure: BaseException | None = None
        for member in self.members:
            if optional and not hasattr(member.source, step):
                continue
            try:
                getattr(member.source, step)()
            except BaseException as exc:  # raised below, after the others are done
                failure = failure or exc
        if failure is not None:
            raise failure

    # --- what the reader builds on it ----------------------------------------------------

    def event_builder(self, decode_errors: DecodeErrorPolicy, requeue: Requeue) -> MultiBuilder:
        errors: dict[int, int] = {}
        return MultiBuilder([
            EventBuilder(m.decoder, decode_errors, requeue, map=m.name, offset=offset_of(i),
                         errors=errors)
            for i, m in enumerate(self.members)
        ], errors, decode_errors)

    def columns(self, load_columns: Callable[..., Columns]) -> MultiColumns:
        """A ``Columns`` per map, each made by ``load_columns`` (``reader.load_columns``):
        ImportError without NumPy; TypeError naming the map whose decoder has no layout."""
        members = []
        for index, member in enumerate(self.members):
            try:
                members.append(load_columns(member.decoder, map=member.name,
                                            offset=offset_of(index)))
            except TypeError as exc:
                raise TypeError(f"map {member.name!r}: {exc}") from None
        return MultiColumns(members)


def check_names(names: Sequence[str]) -> None:
    """Map names must be unique strings."""
    bad = [n for n in names if not isinstance(n, str) or not n]
    if bad:
        raise TypeError(f"source: map names must be non-empty strings, not {bad!r}")
    repeated = sorted(name for name, count in collections.Counter(names).items() if count > 1)
    if repeated:
        raise ValueError(
            f"source: the maps of one stream need distinct names; {repeated} repeat (give a "
            "mapping: PerfStream({'name': map, ...}))"
        )

