"""Several maps, one stream: a ring source made of other ring sources.

``PerfStream({"events": perf_map, "rb": ringbuf_map})`` reads every member
through one reader, one bounded queue and one drain clock (libbpf's
``ring_buffer__add``, libbpf-rs's ``RingBufferBuilder::add``). The reader sees
only rings, keyed here by a composite key, ``map_key_offset(index) + cpu`` (a ring
buffer's cpu -1 fits: ``seam.py``), so that every ring of every member has a key of its
own; it builds each map's events with the map's own decoder (``_reading/multi.py``),
so the composite key never leaves aperf. What a stream of several maps can do besides
(notices, CPU hotplug, pausing, quiescing) it has when its maps do: ``several_maps()``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .._errors import BrokenRingError, UnsupportedError
from .seam import (
    MAP_KEY_STRIDE,
    HandleKind,
    HotplugSource,
    NoticeSource,
    PausableSource,
    QuiescingSource,
    RecordFormat,
    Ring,
    RingConfig,
    RingSource,
    Segment,
    SourceEnded,
    Split,
    map_key_offset,
)

Decoder = Callable[[bytes], Any]


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
            index = key // MAP_KEY_STRIDE
            try:
                return splits[index](key - map_key_offset(index), span)
            except BrokenRingError as exc:
                if exc.map is None:
                    exc.map = names[index]
                    exc.args = (f"map {names[index]!r}: {exc.args[0]}", *exc.args[1:])
                raise

        return split


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
    the member that owns it. What it may add (notices, CPU hotplug, pausing, quiescing)
    it has when its members do: ``several_maps()`` makes it of a class with those
    abilities and no others (``_rings/seam.py``).
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
        offset = map_key_offset(index)
        adopted = []
        for ring in rings:
            if not -1 <= ring.key < MAP_KEY_STRIDE - 1:
                raise UnsupportedError(
                    f"map {self.members[index].name!r}: ring key {ring.key} is too large for "
                    f"a stream of several maps (below {MAP_KEY_STRIDE - 1})"
                )
            adopted.append(_MemberRing(ring, offset))
            self._owner[ring.handle] = index
        self._rings[index].extend(adopted)
        return adopted

    def _learn_notices(self) -> None:
        for index, member in enumerate(self.members):
            if isinstance(member.source, NoticeSource):
                for handle in member.source.notices:
                    self._owner[handle] = index

    @property
    def ring_bytes(self) -> int:
        """The largest member's ring (see ``ring_bytes_of`` for each ring's)."""
        return max(self._sizes, default=0)

    def ring_bytes_of(self, key: int) -> int:
        """The data bytes of ring ``key``: its map's ring size."""
        return self._sizes[key // MAP_KEY_STRIDE]

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

    def split_with(self, splits: Sequence[Split]) -> Split:
        """A split over composite keys that hands each span to its member's ``splits``."""
        return self.multi_records.dispatching(splits)

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

    def free(self) -> None:
        self._each(_free)

    def after_fork(self) -> None:
        self._each(_after_fork)

    def _each(self, step: Callable[[RingSource], None], *, forget: bool = True) -> None:
        """``step`` for every member's source, in order, even after one fails (the first
        error raised); ``forget``: the rings too."""
        if forget:
            self._owner = {}
            self._rings = [[] for _ in self.members]
        failure: BaseException | None = None
        for member in self.members:
            try:
                step(member.source)
            except BaseException as exc:  # raised below, after the others are done
                failure = failure or exc
        if failure is not None:
            raise failure


def _free(source: RingSource) -> None:
    source.free()


def _after_fork(source: RingSource) -> None:
    source.after_fork()


def _quiesce(source: RingSource) -> None:
    if isinstance(source, QuiescingSource):
        source.quiesce()


# --- what a stream of several maps may add, when its maps do -------------------------


class _Notices(MultiSource):
    """Some member has notices (``NoticeSource``)."""

    @property
    def notices(self) -> list[int]:
        """Every member's notices (handles of no ring: map locks, CPU hotplug)."""
        return [h for m in self.members if isinstance(m.source, NoticeSource)
                for h in m.source.notices]


class _Hotplug(_Notices):
    """Some member follows CPU hotplug (``HotplugSource``)."""

    def cpus_changed(self) -> tuple[list[int], list[Ring]]:
        """CPU hotplug, for every member that follows it: keys as composite keys."""
        gone: list[int] = []
        new: list[Ring] = []
        for index, member in enumerate(self.members):
            if not isinstance(member.source, HotplugSource):
                continue
            went, came = member.source.cpus_changed()
            offset = map_key_offset(index)
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


class _Pausing(MultiSource):
    """Every member can pause its producer (``PausableSource``): all of them or none."""

    def pause(self) -> None:
        """Pause every map's producer."""
        for member in self.members:
            assert isinstance(member.source, PausableSource)
            member.source.pause()

    def resume(self) -> None:
        for member in self.members:
            assert isinstance(member.source, PausableSource)
            member.source.resume()


class _Quiescing(MultiSource):
    """Some member stops its producer before the close (``QuiescingSource``)."""

    def quiesce(self) -> None:
        """Stop every member's producer before the close drains any ring: a map whose
        producer wrote on until the maps before it were freed would lose what it wrote
        meanwhile. Every member is asked, even after one fails."""
        self._each(_quiesce, forget=False)


@functools.cache
def _with(abilities: tuple[type[MultiSource], ...]) -> type[MultiSource]:
    """The class of a stream of several maps with these abilities (one class each)."""
    return abilities[0] if len(abilities) == 1 else type(
        "MultiSource", abilities, {"__doc__": MultiSource.__doc__})


def several_maps(members: Sequence[Member]) -> MultiSource:
    """The source of a stream of several maps, with what its maps can do: notices and CPU
    hotplug if any map has them, pausing if every map can pause, quiescing if any map
    can be quiesced."""
    sources = [m.source for m in members]
    abilities: list[type[MultiSource]] = []
    if any(isinstance(s, HotplugSource) for s in sources):
        abilities.append(_Hotplug)
    elif any(isinstance(s, NoticeSource) for s in sources):
        abilities.append(_Notices)
    if all(isinstance(s, PausableSource) for s in sources):
        abilities.append(_Pausing)
    if any(isinstance(s, QuiescingSource) for s in sources):
        abilities.append(_Quiescing)
    return _with((*abilities, MultiSource))(members)


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

