"""The Linux perf event array as a ring source: one perf ring per online CPU.

``PerfEventArraySource`` resolves what the user passed (an
``aperf.Map``, a map fd, or a pinned path), checks it, opens one ring per
online CPU with the map slot keyed by CPU id, and frees everything in a fixed
order, exactly once. The rings' fds are their readiness handles.
"""

from __future__ import annotations

import errno
import os
import struct
from collections.abc import Sequence

from . import _libbpf as lb
from ._errors import BusyResourceError, ClosedResourceError, LibbpfError, RingSizeError
from ._log import log
from ._map_spec import (
    BPF_MAP_TYPE_PERF_EVENT_ARRAY,
    MapBackedSource,
    MapSpec,
    map_facts,
    open_map_fd,
    require_type,
    ring_access,
)
from ._options import DEFAULT_PAGES, PAGE_SIZE, Wakeup
from ._perf_format import PERF_RECORDS, PerfRing
from ._source import HandleKind, RecordFormat, RingConfig

__all__ = ["PerfEventArraySource", "perf_wakeup"]

_LOST_READ = struct.Struct("<QQ")  # read() with PERF_FORMAT_LOST: u64 value, u64 lost


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,5' -> [0, 1, 2, 3, 5] (the format of /sys/devices/system/cpu/online)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def online_cpus() -> list[int]:
    try:
        with open("/sys/devices/system/cpu/online") as f:
            return parse_cpu_list(f.read())
    except OSError:
        return list(range(os.cpu_count() or 1))


def perf_wakeup(wakeup: Wakeup, ring_bytes: int) -> tuple[int, int]:
    """``wakeup`` as ``perf_event_attr`` says it: (wakeup_events, wakeup_watermark).

    A watermark stays below the ring's size: the kernel would never reach it.
    """
    if wakeup.events:
        return wakeup.events, 0
    nbytes = wakeup.watermark_bytes or int(ring_bytes * wakeup.watermark_fraction)
    return 0, max(1, min(nbytes, ring_bytes - PAGE_SIZE if ring_bytes > PAGE_SIZE else 1))


class _KernelPerfRing(PerfRing):
    """A CPU's mmapped perf ring whose fd also reports the kernel's exact lost count
    (Linux 6.0+). ``take()`` copies straight out of the ring (x86-64)."""

    __slots__ = ("_exact",)

    def __init__(self, key: int, fd: int, memory: lb.RingMemory, exact: bool) -> None:
        super().__init__(key, fd, memory)
        self._exact = exact

    def lost_total(self) -> int | None:
        if not self._exact:
            return None
        return int(_LOST_READ.unpack(os.read(self.handle, _LOST_READ.size))[1])


class _LibbpfReadRing(_KernelPerfRing):
    """The same ring, with records copied by libbpf's reader (any architecture)."""

    __slots__ = ("_index", "_rings")

    def __init__(
        self, key: int, fd: int, memory: lb.RingMemory, exact: bool, rings: lb.PerfRings,
        index: int,
    ) -> None:
        super().__init__(key, fd, memory, exact)
        self._rings = rings
        self._index = index

    def take(self) -> bytes:
        return self._rings.consume_records(self._index)


class PerfEventArraySource(MapBackedSource):
    """The perf rings of one ``BPF_MAP_TYPE_PERF_EVENT_ARRAY`` map (Linux)."""

    handle_kind: HandleKind = "fd"
    records: RecordFormat = PERF_RECORDS

    def __init__(self, source: MapSpec) -> None:
        super().__init__(source)
        self._rings: lb.PerfRings | None = None
        self._map_fd = -1
        self._paused = False

    def open(self, config: RingConfig) -> Sequence[PerfRing]:
        if self._rings is not None:
            raise BusyResourceError(f"perf event array {self.name} is already open")
        try:
            return self._open(config)
        except BaseException:
            self.free()
            raise

    def _open(self, config: RingConfig) -> list[PerfRing]:
        self._map_fd = open_map_fd(self._spec)
        facts = map_facts(self._map_fd, f"map {self.name}")
        require_type(facts, self.name, BPF_MAP_TYPE_PERF_EVENT_ARRAY, "a perf event array")
        self.map_id = facts.id
        cpus = online_cpus()
        usable = [cpu for cpu in cpus if cpu < facts.max_entries]
        if not usable:
            raise RingSizeError(
                f"map {self.name} has {facts.max_entries} slots, no online CPU id fits"
            )
        if len(usable) < len(cpus):
            # As libbpf does: a slot per CPU id, CPUs beyond max_entries get no ring.
            log.warning("perf map smaller than cpu count", map=self.name,
                        max_entries=facts.max_entries, skipped=[c for c in cpus if c not in usable])
        self._claim()
        ring_bytes = config.ring_bytes or DEFAULT_PAGES * PAGE_SIZE
        events, watermark = perf_wakeup(config.wakeup, ring_bytes)
        pages = ring_bytes // PAGE_SIZE
        exact = True
        try:
            self._rings = lb.PerfRings(
                self._map_fd, pages, usable, wakeup_events=events, wakeup_watermark=watermark,
                count_lost=True,
            )
        except LibbpfError as exc:
            if exc.errno != errno.EINVAL:
                raise
            # Before Linux 6.0 read_format has no PERF_FORMAT_LOST: lost records only.
            exact = False
            self._rings = lb.PerfRings(
                self._map_fd, pages, usable, wakeup_events=events, wakeup_watermark=watermark,
            )
        self._ring_bytes = ring_bytes
        perf = self._rings
        if ring_access() == "direct":
            rings: list[PerfRing] = [
                _KernelPerfRing(h.cpu, h.fd, h.memory, exact) for h in perf.rings
            ]
        else:
            rings = [
                _LibbpfReadRing(h.cpu, h.fd, h.memory, exact, perf, index)
                for index, h in enumerate(perf.rings)
            ]
        self._memory_bytes = len(rings) * (ring_bytes + PAGE_SIZE)
        return rings

    def pause(self) -> None:
        """Empty the map slots of this source's rings: the BPF program's output fails
        with -ENOENT (its own failure count is the only record of those samples);
        what the rings already hold is still read. Idempotent."""
        self._set_paused(True)

    def resume(self) -> None:
        """Put the rings back into their slots (idempotent)."""
        self._set_paused(False)

    def _set_paused(self, paused: bool) -> None:
        if self._rings is None:
            raise ClosedResourceError(f"perf event array {self.name} is not open")
        if paused != self._paused:
            self._rings.set_slots(not paused)
            self._paused = paused

    def acknowledge(self, handle: int) -> None:
        """Nothing to do: polling a perf fd clears its readiness."""

    def after_fork(self) -> None:
        """In a child process: close this process's fds only (see PerfRings.forget_after_fork)."""
        rings, self._rings = self._rings, None
        try:
            if rings is not None:
                rings.forget_after_fork()
        finally:
            self._release_map()

    def free(self) -> None:
        """Drop the ring views, free the rings (fds closed, slots deleted), release our map fd."""
        rings, self._rings = self._rings, None
        try:
            if rings is not None:
                rings.free()
        finally:
            self._release_map()

    def _release_map(self) -> None:
        """Give up the claim on the map and close our fd of it."""
        self._release_claim()
        fd, self._map_fd = self._map_fd, -1
        if fd >= 0:
            os.close(fd)
