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
from collections.abc import Iterable, Sequence

from ..._errors import (
    ArgumentError,
    BusyResourceError,
    ClosedResourceError,
    LibbpfError,
    RingSizeError,
    UnsupportedError,
)
from ..._log import log
from ..._native import libbpf as lb
from ..._native.libc.functions import rcu_grace_period
from ..._options import DEFAULT_PAGES, PAGE_SIZE, Wakeup, budget_ring_bytes
from ..map_spec import (
    BPF_MAP_TYPE_PERF_EVENT_ARRAY,
    MapBackedSource,
    MapSpec,
    map_facts,
    open_map_fd,
    require_type,
    ring_access,
)
from ..seam import HandleKind, RecordFormat, RingConfig
from .backward import newest_records
from .format import PERF_RECORDS, PerfRing
from .hotplug import RESYNC, CpuWatch

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


def online_cpus(which: str = "online") -> list[int]:
    try:
        with open(f"/sys/devices/system/cpu/{which}") as f:
            return parse_cpu_list(f.read())
    except OSError:
        return list(range(os.cpu_count() or 1))


def _cpu_ids(argument: str, values: Iterable[int]) -> list[int]:
    if isinstance(values, str | bytes) or not isinstance(values, Iterable):
        raise TypeError(f"{argument} must be a list of ints, not {type(values).__name__}")
    ids = list(values)
    for value in ids:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{argument} must hold ints, not {type(value).__name__}")
        if value < 0:
            raise ArgumentError(argument, f"{argument}={ids}: {value} is negative")
    repeated = sorted({value for value in ids if ids.count(value) > 1})
    if repeated and argument == "map_keys":
        raise ArgumentError(argument, f"map_keys={ids} names slot {repeated} more than once: "
                            "a slot holds one ring")
    return ids


def check_layout(
    cpus: Iterable[int] | None, map_keys: Iterable[int] | None
) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    """``cpus=`` and ``map_keys=`` checked against this host's possible CPUs, before any
    ring exists (the map's ``max_entries`` and the online CPUs are checked at open)."""
    if cpus is None:
        if map_keys is not None:
            raise ArgumentError("map_keys", "map_keys= needs cpus=: the CPU of each slot's "
                                "ring, index for index")
        return None, None
    cpu_ids = _cpu_ids("cpus", cpus)
    if not cpu_ids:
        raise ArgumentError("cpus", "cpus=[] opens no ring: name at least one CPU, or leave "
                            "cpus out for every online CPU")
    possible = online_cpus("possible")
    impossible = [cpu for cpu in cpu_ids if cpu not in possible]
    if impossible:
        raise ArgumentError("cpus", f"cpus={cpu_ids}: CPU {impossible} is not possible on this "
                            f"host (possible: {possible[0]}-{possible[-1]})")
    if map_keys is None:
        repeated = sorted({cpu for cpu in cpu_ids if cpu_ids.count(cpu) > 1})
        if repeated:
            raise ArgumentError("cpus", f"cpus={cpu_ids} names CPU {repeated} more than once: "
                                "one ring per CPU (several channels per CPU need map_keys=)")
        return tuple(cpu_ids), None
    keys = _cpu_ids("map_keys", map_keys)
    if len(keys) != len(cpu_ids):
        raise ArgumentError("map_keys", f"map_keys has {len(keys)} slots for {len(cpu_ids)} "
                            "cpus: one slot per ring, index for index")
    return tuple(cpu_ids), tuple(keys)


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


def _point_at_null(fd: int) -> None:
    """Make ``fd`` a /dev/null: what libbpf later deletes through it goes nowhere."""
    null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.dup2(null, fd, inheritable=False)
    finally:
        os.close(null)


class _CpuRing:
    """The ring of one CPU that came online after the stream opened: a libbpf perf
    buffer of its own (so that it can be freed alone) on a map fd of its own (so that
    freeing it can leave the slot to the CPU's next ring)."""

    def __init__(self, map_fd: int, cpu: int, ring_args: dict[str, object]) -> None:
        self.map_fd = os.dup(map_fd)
        try:
            self.rings = lb.PerfRings(self.map_fd, cpus=[cpu], **ring_args)  # type: ignore[arg-type]
        except BaseException:
            os.close(self.map_fd)
            raise

    def free(self, *, keep_slot: bool) -> None:
        if keep_slot:
            _point_at_null(self.map_fd)
        try:
            self.rings.free()
        finally:
            os.close(self.map_fd)

    def forget_after_fork(self) -> None:
        try:
            self.rings.forget_after_fork()
        finally:
            os.close(self.map_fd)


class _OverwriteRing:
    """One CPU's overwritable ring. Never read on wakeups (``take()`` is always empty:
    the kernel keeps overwriting; nothing waits, nothing is lost); ``newest()`` reads it."""

    __slots__ = ("_memory", "handle", "key")

    def __init__(self, key: int, handle: int, memory: lb.RingMemory) -> None:
        self.key = key
        self.handle = handle
        self._memory = memory

    def take(self) -> bytes:
        return b""

    def pending_bytes(self) -> int:
        return 0

    def lost_total(self) -> int | None:
        return None

    def newest(self) -> bytes:
        """Its complete records, oldest first (call it while the producer is paused)."""
        memory = self._memory
        head, _ = memory.positions()
        return newest_records(head, memory.size, memory.copy)


class PerfEventArraySource(MapBackedSource):
    """The perf rings of one ``BPF_MAP_TYPE_PERF_EVENT_ARRAY`` map (Linux)."""

    handle_kind: HandleKind = "fd"
    records: RecordFormat = PERF_RECORDS

    def __init__(self, source: MapSpec) -> None:
        super().__init__(source)
        self._rings: lb.PerfRings | lb.OverwritableRings | None = None
        self._map_fd = -1
        self._paused = False
        # CPU hotplug (streams over every online CPU): the uevent socket, the changes
        # it announced, each CPU's live ring, the rings opened for CPUs that came
        # online later, and those retired (their CPU went offline) and not freed yet.
        self._cpu_watch: CpuWatch | None = None
        self._announced: list[tuple[str, int]] = []
        self._live: dict[int, PerfRing] = {}
        self._added: dict[int, _CpuRing] = {}
        self._retired: list[_CpuRing] = []
        self._ring_args: dict[str, object] = {}
        self._max_entries = 0
        self._overwrite: list[_OverwriteRing] = []

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
        usable, slots = self._layout(config, facts.max_entries)
        self._claim(usable if slots is None else slots)  # the map keys, across processes
        if config.memory_bytes is not None:
            ring_bytes = budget_ring_bytes(config.memory_bytes, len(usable))
        else:
            ring_bytes = config.ring_bytes or DEFAULT_PAGES * PAGE_SIZE
        events, watermark = perf_wakeup(config.wakeup, ring_bytes)
        pages = ring_bytes // PAGE_SIZE
        if config.overwritable:
            self._rings = lb.OverwritableRings(self._map_fd, pages, usable, map_keys=slots)
            self._ring_bytes = ring_bytes
            self._overwrite = [_OverwriteRing(h.slot, h.fd, h.memory) for h in self._rings.rings]
            self._memory_bytes = len(self._overwrite) * (ring_bytes + PAGE_SIZE)
            return list(self._overwrite)  # type: ignore[arg-type]  # a Ring, not a PerfRing
        exact = True
        try:
            self._rings = lb.PerfRings(
                self._map_fd, pages, usable, map_keys=slots, wakeup_events=events,
                wakeup_watermark=watermark, count_lost=True,
            )
        except LibbpfError as exc:
            if exc.errno != errno.EINVAL:
                raise
            # Before Linux 6.0 read_format has no PERF_FORMAT_LOST: lost records only.
            exact = False
            self._rings = lb.PerfRings(
                self._map_fd, pages, usable, map_keys=slots, wakeup_events=events,
                wakeup_watermark=watermark,
            )
        self._ring_bytes = ring_bytes
        rings = self._views(self._rings, exact)
        self._memory_bytes = len(rings) * (ring_bytes + PAGE_SIZE)
        if config.cpus is None:
            self._watch_hotplug(max_entries=facts.max_entries, page_count=pages,
                                wakeup_events=events, wakeup_watermark=watermark,
                                count_lost=exact)
            self._live = {ring.key: ring for ring in rings}
        return rings

    @staticmethod
    def _views(perf: lb.PerfRings, exact: bool) -> list[PerfRing]:
        if ring_access() == "direct":
            return [_KernelPerfRing(h.slot, h.fd, h.memory, exact) for h in perf.rings]
        return [
            _LibbpfReadRing(h.slot, h.fd, h.memory, exact, perf, index)
            for index, h in enumerate(perf.rings)
        ]

    # --- CPU hotplug ---------------------------------------------------------------------

    def _watch_hotplug(self, *, max_entries: int, **ring_args: object) -> None:
        """Listen for CPUs going offline and coming online (where the kernel lets us:
        uevents reach the initial network namespace only; elsewhere no hotplug)."""
        try:
            self._cpu_watch = CpuWatch()
        except OSError as exc:
            log.debug("no cpu hotplug uevents", map=self.name, error=str(exc))
            return
        self._max_entries = max_entries
        self._ring_args = ring_args

    @property
    def notices(self) -> list[int]:
        """The map lock's notice, and the CPU hotplug uevent socket (``cpus_changed``)."""
        watch = self._cpu_watch
        return [*super().notices, *([watch.fd] if watch is not None and watch.fd >= 0 else [])]

    def cpus_changed(self) -> tuple[list[int], list[PerfRing]]:
        """After the uevent socket fired: the keys of the rings whose CPU went offline
        (still readable: the reader drains them; they are freed at the next change or
        at close), and new rings for the CPUs that came online, in their slots."""
        changes, self._announced = self._announced, []
        if not changes or self._rings is None:
            return [], []
        for stale in self._retired:  # retired at an earlier change: drained and unwatched
            stale.free(keep_slot=True)  # the slot may hold the CPU's new ring already
        self._retired = []
        online = set(online_cpus())
        # An offline CPU's event never runs again, even once the CPU is back.
        went = {cpu for action, cpu in changes if action == "offline"}
        gone = [cpu for cpu in self._live if cpu in went or cpu not in online]
        for cpu in gone:
            del self._live[cpu]
            added = self._added.pop(cpu, None)
            if added is not None:
                self._retired.append(added)
        if RESYNC in changes:
            log.warning("cpu hotplug uevents lost: compared with sysfs", map=self.name)
        new: list[PerfRing] = []
        for cpu in sorted(online - self._live.keys()):
            ring = self._open_cpu(cpu)
            if ring is not None:
                self._live[cpu] = ring
                new.append(ring)
        return gone, new

    def _open_cpu(self, cpu: int) -> PerfRing | None:
        """A ring for a CPU that came online, in its slot (empty while paused)."""
        if cpu >= self._max_entries:
            return None
        if self._map_lock is not None and not self._map_lock.add_slot(cpu):
            log.warning("slot of a cpu that came online is locked by another reader",
                        map=self.name, cpu=cpu)
            return None
        try:
            added = _CpuRing(self._map_fd, cpu, self._ring_args)
        except LibbpfError as exc:
            if exc.errno in (errno.ENODEV, errno.ENXIO, errno.EINVAL):
                return None  # offline again already: its uevent follows
            raise
        if self._paused:
            added.rings.set_slots(False)
        self._added[cpu] = added
        return self._views(added.rings, bool(self._ring_args.get("count_lost")))[0]

    def pause(self) -> None:
        """Empty the map slots of this source's rings: the BPF program's output fails
        with -ENOENT (its own failure count is the only record of those samples);
        what the rings already hold is still read. Idempotent."""
        self._set_paused(True)

    def resume(self) -> None:
        """Put the rings back into their slots (idempotent)."""
        self._set_paused(False)

    @property
    def paused(self) -> bool:
        """Whether ``pause()`` emptied the slots."""
        return self._paused

    def newest(self) -> list[tuple[int, bytes]]:
        """Each overwritable ring's records, oldest first, by ring key: read with the
        producer paused (and every BPF program that had read a slot finished), then
        resumed unless it was paused already."""
        if not self._overwrite:
            raise UnsupportedError(f"snapshot() reads flight-recorder rings: perf event array "
                                   f"{self.name} was not opened with overwritable=True")
        paused = self._paused
        self.pause()
        try:
            rcu_grace_period()
            return [(ring.key, ring.newest()) for ring in self._overwrite]
        finally:
            if not paused:
                self.resume()

    def _set_paused(self, paused: bool) -> None:
        if self._rings is None:
            raise ClosedResourceError(f"perf event array {self.name} is not open")
        if paused != self._paused:
            self._rings.set_slots(not paused)
            for added in self._added.values():
                added.rings.set_slots(not paused)
            self._paused = paused

    def _layout(self, config: RingConfig, max_entries: int) -> tuple[list[int], list[int] | None]:
        """The CPUs to open rings on, and their slots (None: keyed by CPU id)."""
        if config.cpus is None:
            cpus = online_cpus()
            usable = [cpu for cpu in cpus if cpu < max_entries]
            if not usable:
                raise RingSizeError(
                    f"map {self.name} has {max_entries} slots, no online CPU id fits"
                )
            if len(usable) < len(cpus):
                # As libbpf does: a slot per CPU id, CPUs beyond max_entries get no ring.
                log.warning("perf map smaller than cpu count", map=self.name,
                            max_entries=max_entries, skipped=[c for c in cpus if c not in usable])
            return usable, None
        online = online_cpus()
        offline = [cpu for cpu in config.cpus if cpu not in online]
        if offline:
            raise ArgumentError("cpus", f"cpus={list(config.cpus)}: CPU {offline} is offline "
                                f"(online now: {online})")
        argument, keys = ("cpus", config.cpus) if config.map_keys is None else (
            "map_keys", config.map_keys)
        beyond = [key for key in keys if key >= max_entries]
        if beyond:
            raise ArgumentError(argument, f"{argument}={list(keys)}: slot {beyond} is beyond the "
                                f"{max_entries} slots (max_entries) of map {self.name}")
        return list(config.cpus), None if config.map_keys is None else list(config.map_keys)

    def acknowledge(self, handle: int) -> None:
        """Nothing to do for a ring: polling a perf fd clears its readiness. The map
        lock's notice: a take-over request, maybe (``SourceEnded``)."""
        if handle == self._notice_fd:
            self._taken_over()
        elif self._cpu_watch is not None and handle == self._cpu_watch.fd:
            self._announced.extend(self._cpu_watch.changes())

    def quiesce(self) -> None:
        """Before the close's last drain (``QuiescingSource``): empty every slot of this
        source's rings and wait for the BPF programs that read one before to return, so
        that nothing is written into the rings between that drain and their free (it
        would be freed with them, neither delivered nor counted). From then on the
        BPF side's output fails with -ENOENT, as while paused. Idempotent."""
        if self._rings is None or self._ended is not None:
            return  # not open, or taken over: the slots are not ours any more
        self._empty_slots()
        self._paused = True

    def _empty_slots(self) -> None:
        """Empty the slots of every ring of ours, then wait until no BPF program that
        read one before is still writing into it (an RCU grace period)."""
        rings = self._rings
        if rings is None:
            return
        perfs = (rings, *(a.rings for a in self._added.values()))
        lb.delete_slots(self._map_fd, [ring.slot for perf in perfs for ring in perf.rings])
        rcu_grace_period()

    def _give_up(self) -> bool:
        """Taken over: empty our slots (the BPF side gets -ENOENT until the taker's are
        in), wait for BPF programs writing through them to finish, then point our map
        fd at /dev/null: perf_buffer__free deletes slots through it, and they will be
        the taker's. Our rings keep what was written: the reader drains them."""
        if self._rings is not None:
            self._empty_slots()
            for fd in (self._map_fd, *(a.map_fd for a in self._added.values())):
                _point_at_null(fd)
        return True

    def after_fork(self) -> None:
        """In a child process: close this process's fds only (see PerfRings.forget_after_fork)."""
        rings, self._rings = self._rings, None
        try:
            for added in (*self._added.values(), *self._retired):
                added.forget_after_fork()
            if rings is not None:
                rings.forget_after_fork()
        finally:
            self._release_map()

    def free(self) -> None:
        """Drop the ring views, free the rings (fds closed, slots deleted), release our map fd."""
        rings, self._rings = self._rings, None
        self._overwrite = []
        try:
            retired, added = self._retired, list(self._added.values())
            self._added, self._retired, self._live = {}, [], {}
            for extra in retired:
                extra.free(keep_slot=True)
            for extra in added:
                extra.free(keep_slot=False)
            if rings is not None:
                rings.free()
        finally:
            self._release_map()

    def _release_map(self) -> None:
        """Give up the claim on the map and close our fd of it."""
        self._release_claim()
        watch, self._cpu_watch = self._cpu_watch, None
        if watch is not None:
            watch.close()
        fd, self._map_fd = self._map_fd, -1
        if fd >= 0:
            os.close(fd)
