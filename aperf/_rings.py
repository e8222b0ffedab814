"""Owning the perf rings of one PERF_EVENT_ARRAY map (Linux).

:class:`RingSet` resolves what the user passed (an :class:`aperf.Map`, a map fd,
or a pinned path), checks it, opens one ring per online CPU with the map slot
keyed by CPU id, and frees everything in a fixed order, exactly once.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

from . import _libbpf as lb
from ._errors import (
    BusyResourceError,
    ClosedResourceError,
    LibbpfError,
    MapTypeError,
    RingSizeError,
)
from ._log import log
from ._object import BPF_MAP_TYPE_PERF_EVENT_ARRAY, Map
from ._options import PAGE_SIZE, Wakeup
from ._ring import RingReader

MapSource = Map | int | str | os.PathLike[str]

_claims: dict[int, str] = {}  # kernel map id -> who holds its slots, in this process
_claims_lock = threading.Lock()


@dataclass(frozen=True)
class MapFacts:
    map_type: int
    map_id: int
    max_entries: int
    name: str


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


def map_facts(fd: int) -> MapFacts:
    """What /proc/self/fdinfo says of ``fd``; MapTypeError if it is not a BPF map."""
    try:
        with open(f"/proc/self/fdinfo/{fd}") as f:
            text = f.read()
    except FileNotFoundError:
        raise ClosedResourceError(f"fd {fd} is not open") from None
    fields = dict(
        line.split(":", 1) for line in text.splitlines() if ":" in line
    )
    if "map_type" not in fields:
        raise MapTypeError(
            f"fd {fd} is not a BPF map; aperf needs a BPF_MAP_TYPE_PERF_EVENT_ARRAY map"
        )
    return MapFacts(
        map_type=int(fields["map_type"]),
        map_id=int(fields.get("map_id", "0")),
        max_entries=int(fields.get("max_entries", "0")),
        name="",
    )


class RingSet:
    """The perf rings of one map, one per online CPU (keyed by CPU id)."""

    def __init__(self, source: MapSource, pages: int, wakeup: Wakeup) -> None:
        self._rings: lb.PerfRings | None = None
        self._map_fd = -1
        self._claimed = 0
        self.readers: dict[int, RingReader] = {}
        self.fds: dict[int, int] = {}
        try:
            self._open(source, pages, wakeup)
        except BaseException:
            self.free()
            raise

    def _open(self, source: MapSource, pages: int, wakeup: Wakeup) -> None:
        self.name = self._resolve(source)
        facts = map_facts(self._map_fd)
        if facts.map_type != BPF_MAP_TYPE_PERF_EVENT_ARRAY:
            raise MapTypeError(
                f"map {self.name} has type {facts.map_type}; aperf reads "
                f"BPF_MAP_TYPE_PERF_EVENT_ARRAY ({BPF_MAP_TYPE_PERF_EVENT_ARRAY}) maps"
            )
        self.map_id = facts.map_id
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
        self.ring_bytes = pages * PAGE_SIZE
        events, watermark = wakeup.kernel_settings(self.ring_bytes)
        self._rings = lb.PerfRings(
            self._map_fd, pages, usable, wakeup_events=events, wakeup_watermark=watermark
        )
        for ring in self._rings.rings:
            self.readers[ring.cpu] = RingReader(ring.cpu, ring.memory)
            self.fds[ring.cpu] = ring.fd
        self.memory_bytes = len(self.readers) * (self.ring_bytes + PAGE_SIZE)

    def _resolve(self, source: MapSource) -> str:
        # Each branch leaves self._map_fd as an fd of our own, closed by free().
        if isinstance(source, Map):
            if source.closed:
                raise ClosedResourceError(f"map {source.name!r} belongs to a closed BPFObject")
            self._map_fd = os.dup(source.fd)
            return source.name
        if isinstance(source, bool) or not isinstance(source, int | str | os.PathLike):
            raise TypeError(
                "PerfStream takes an aperf.Map, a map fd (int) or a pinned map path, "
                f"not {type(source).__name__}"
            )
        if isinstance(source, int):
            try:
                self._map_fd = os.dup(source)
            except OSError as exc:
                raise ClosedResourceError(f"map fd {source} is not open ({exc.strerror})") from None
            return f"fd {source}"
        path = os.fspath(source)
        try:
            self._map_fd = lb.pinned_object_fd(path)
        except LibbpfError as exc:
            exc.detail = f"opening pinned map {path!r}"
            raise
        return path

    def _claim(self) -> None:
        with _claims_lock:
            holder = _claims.get(self.map_id)
            if holder is not None:
                raise BusyResourceError(
                    f"map {self.name} (id {self.map_id}) already feeds {holder} in this process; "
                    "a second reader would silently take its CPU slots. Close the first one."
                )
            _claims[self.map_id] = f"a stream opened as {self.name}"
            self._claimed = self.map_id

    def free(self) -> None:
        """Drop the ring views, free the rings (fds closed, slots deleted), release our map fd."""
        self.readers = {}
        self.fds = {}
        rings, self._rings = self._rings, None
        try:
            if rings is not None:
                rings.free()
        finally:
            if self._claimed:
                with _claims_lock:
                    _claims.pop(self._claimed, None)
                self._claimed = 0
            fd, self._map_fd = self._map_fd, -1
            if fd >= 0:
                os.close(fd)
