"""The reader's ring set: its live rings, by key and by readiness handle.

A drain looks a ring up by key (the set is a ``dict`` of them: that lookup is the
dict's own); drivers wait on readiness handles, several rings may share one, and a
source's notices are handles of no ring. Rings leave the set when they break (then
their keys stay ``broken``) or when their CPU goes offline, and come in when a CPU comes
online (``HotplugSource``); ``changes()`` tells the drivers which handles to watch and to
forget since they last asked. A lease reads a ring in place by putting its own ring in
the set instead (``swap``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .._rings.seam import HotplugSource, NoticeSource, Ring, RingSource, SeveralMapsSource

MAX_RECORD = 1 << 16
"""A perf record is at most 64 KiB (its size is a u16): a ring with more free space than
that cannot have dropped a sample since it was last emptied."""


class RingSet(dict[int, Ring]):
    """The live rings by key; by handle; the broken keys; the handles that came and went.

    ``ring_bytes`` and ``memory_bytes`` are the source's, at open; ``cpus_changed`` its
    hotplug call (None: a source that does not follow CPU hotplug).
    """

    __slots__ = ("_forget", "_full_mark", "_handles", "_size_of", "_watch", "broken",
                 "cpus_changed", "memory_bytes", "ring_bytes")

    def __init__(self, source: RingSource, rings: Sequence[Ring]) -> None:
        super().__init__((ring.key, ring) for ring in rings)
        self._handles: dict[int, list[Ring]] = {}
        for ring in rings:
            self._handles.setdefault(ring.handle, []).append(ring)
        if isinstance(source, NoticeSource):  # handles of no ring (see SourceEnded)
            for handle in source.notices:
                self._handles.setdefault(handle, [])
        self.cpus_changed: Callable[[], tuple[list[int], Sequence[Ring]]] | None = (
            source.cpus_changed if isinstance(source, HotplugSource) else None)
        self.ring_bytes = source.ring_bytes
        self.memory_bytes = source.memory_bytes
        self._full_mark = max(0, self.ring_bytes - MAX_RECORD)
        # Several maps: rings of different sizes.
        self._size_of: Callable[[int], int] | None = (
            source.ring_bytes_of if isinstance(source, SeveralMapsSource) else None)
        self.broken: set[int] = set()
        self._watch: list[int] = []  # handles of rings added at run time, for the drivers
        self._forget: list[int] = []  # and of rings retired (their CPU went offline)

    def of_handle(self, handle: int) -> list[Ring] | None:
        """The live rings of a readiness handle ([]: a notice; None: not a handle of ours)."""
        return self._handles.get(handle)

    def handles(self) -> list[int]:
        """Every readiness handle the drivers wait on: the rings', then the source's notices."""
        return list(self._handles)

    def watches(self, handle: int) -> bool:
        """Whether any live ring (or notice) still has this readiness handle."""
        return handle in self._handles

    def handle_of(self, key: int) -> int | None:
        """The readiness handle of ring ``key`` (None: no such live ring)."""
        ring = self.get(key)
        return None if ring is None else ring.handle

    def size_of(self, key: int) -> int:
        """The data bytes of ring ``key``."""
        return self.ring_bytes if self._size_of is None else self._size_of(key)

    def full_mark(self, key: int) -> int:
        """Pending bytes above which ring ``key`` may have dropped (see ``MAX_RECORD``)."""
        if self._size_of is None:
            return self._full_mark
        return self._size_of(key) - MAX_RECORD

    def add(self, ring: Ring) -> None:
        """A ring came (its CPU came online): live, and its handle for the drivers to watch."""
        self[ring.key] = ring
        self._handles.setdefault(ring.handle, []).append(ring)
        self._watch.append(ring.handle)

    def retire(self, ring: Ring, *, broken: bool = True) -> None:
        """A ring leaves: it broke (its key stays ``broken``), or its CPU went offline
        (its handle, once no ring has it, for the drivers to forget)."""
        self.pop(ring.key, None)
        if broken:
            self.broken.add(ring.key)
        else:
            self._forget.append(ring.handle)
        siblings = [r for r in self._handles.get(ring.handle, ()) if r is not ring]
        if siblings:
            self._handles[ring.handle] = siblings
        else:
            self._handles.pop(ring.handle, None)

    def swap(self, ring: Ring) -> None:
        """Put ``ring`` in place of the live ring with its key and handle (a lease reads
        it in place: ``_rings/perf/lease_ring.py``)."""
        old = self.get(ring.key)
        if old is None:
            return
        self[ring.key] = ring
        self._handles[ring.handle] = [
            ring if r is old else r for r in self._handles.get(ring.handle, [])
        ]

    def changes(self) -> tuple[list[int], list[int]]:
        """Handles to watch (new rings) and to forget (retired rings) since the last call."""
        watch, forget = self._watch, self._forget
        self._watch, self._forget = [], []
        return watch, [handle for handle in forget if handle not in self._handles]

    def drop_rings(self) -> None:
        """Forget the rings (no longer ours to read); their handles stay until ``close``."""
        dict.clear(self)

    def close(self) -> None:
        """Forget the rings and every handle."""
        dict.clear(self)
        self._handles = {}
