"""What every map-backed ring source does: turn what the user passed (a
``MapSpec``: an ``aperf.Map``, a map fd, a pinned path) into an fd of its own,
check the kernel's facts about it, and claim the map so that a second reader, in
this process or (through the map lock, ``map_lock``) in another, stays off it
(``MapBackedSource``, the base of the perf event array, BPF ring buffer and eBPF
for Windows sources); and how their rings are read (``ring_access``).
"""

from __future__ import annotations

import errno
import os
import platform
import threading
from collections.abc import Sequence

from .._bpf.map_types import map_type_name
from .._bpf.object import Map
from .._errors import BusyResourceError, ClosedResourceError, LibbpfError, MapTypeError
from .._native import libbpf as lb
from .map_lock import MapLock, lock_map
from .seam import SourceEnded

MapSpec = Map | int | str | os.PathLike[str]
"""What ``PerfStream``/``PerfBuffer`` accept besides a ring source: a map, its fd, a pinned path."""

BPF_MAP_TYPE_PERF_EVENT_ARRAY = 4
BPF_MAP_TYPE_ARRAY_OF_MAPS = 12
BPF_MAP_TYPE_RINGBUF = 27
READABLE_TYPES = (
    "BPF_MAP_TYPE_PERF_EVENT_ARRAY (4), BPF_MAP_TYPE_RINGBUF (27) and "
    "BPF_MAP_TYPE_ARRAY_OF_MAPS (12) of ring buffers"
)


def check_map_source(source: object) -> MapSpec:
    if isinstance(source, bool) or not isinstance(source, Map | int | str | os.PathLike):
        raise TypeError(
            "source must be an aperf.Map, a map fd (int), a pinned map path or a ring "
            f"source, not {type(source).__name__}"
        )
    return source


def source_name(source: MapSpec) -> str:
    if isinstance(source, Map):
        return source.name
    return f"fd {source}" if isinstance(source, int) else os.fspath(source)


def open_map_fd(source: MapSpec) -> int:
    """An fd of our own for the map (the caller closes it)."""
    if isinstance(source, Map):
        if source.closed:
            raise ClosedResourceError(f"map {source.name!r} belongs to a closed BPFObject")
        return os.dup(source.fd)
    if isinstance(source, int):
        try:
            return os.dup(source)
        except OSError as exc:
            raise ClosedResourceError(f"map fd {source} is not open ({exc.strerror})") from None
    path = os.fspath(source)
    try:
        return lb.pinned_object_fd(path, argument="source")
    except LibbpfError as exc:
        exc.detail = f"opening pinned map {path!r}"
        raise


def map_facts(fd: int, name: str) -> lb.MapInfo:
    """The kernel's facts about the map behind ``fd``; MapTypeError if it is no BPF map."""
    try:
        os.fstat(fd)
    except OSError:
        raise ClosedResourceError(f"{name}: fd {fd} is not open") from None
    kind = lb.object_kind(fd)
    if kind != "map":
        what = f"a BPF {kind}" if kind else "not a BPF object"
        raise MapTypeError(f"{name} is not a BPF map ({what}); aperf reads {READABLE_TYPES} maps")
    return lb.map_info(fd)


def map_type_of(source: MapSpec) -> int | None:
    """The map's type, or None when it cannot be told now (the source's open says why)."""
    if isinstance(source, Map):
        return source.type
    try:
        fd = open_map_fd(source)
    except (OSError, ClosedResourceError):
        return None
    try:
        return map_facts(fd, source_name(source)).type
    except (OSError, MapTypeError, ClosedResourceError):
        return None
    finally:
        os.close(fd)


def inner_maps(fd: int, slots: int) -> list[tuple[int, int]]:
    """``(slot, fd)`` for every filled slot of the map-in-map behind ``fd`` (an array of
    ``slots`` maps), each fd new (the caller closes them); empty slots are skipped. A
    map in a slot may go meanwhile (another process deleted it): skipped too."""
    found: list[tuple[int, int]] = []
    try:
        for slot in range(slots):
            try:
                raw = lb.map_lookup(fd, slot.to_bytes(4, "little"))
                inner = lb.map_fd_by_id(int.from_bytes(raw, "little"))
            except LibbpfError as exc:
                if exc.errno == errno.ENOENT:
                    continue
                raise
            found.append((slot, inner))
    except BaseException:
        for _, inner in found:
            os.close(inner)
        raise
    return found


def require_type(facts: lb.MapInfo, name: str, wanted: int, what: str) -> None:
    if facts.type != wanted:
        raise MapTypeError(
            f"map {name} is a {map_type_name(facts.type)} (type {facts.type}), not {what} "
            f"({map_type_name(wanted)}); aperf reads {READABLE_TYPES} maps"
        )


_claims: dict[int, str] = {}  # kernel map id -> who holds its slots, in this process
_claims_lock = threading.Lock()


RING_ACCESS_ENV = "APERF_RING_ACCESS"
"""``direct`` (x86-64 only) or ``libbpf``: how perf rings are read (see ``ring_access``)."""


def ring_access() -> str:
    """How to read perf rings on this machine: ``direct`` or ``libbpf``.

    aperf copies records straight out of the mapped ring, reading the head
    before the data and writing the tail after the copy. That order is enough
    only where the CPU keeps loads and stores in program order (x86-64, TSO);
    elsewhere the head and tail need acquire/release barriers that Python
    cannot express, so libbpf's own reader copies the records (about 0.4 us a
    record more, but correct). ``APERF_RING_ACCESS=libbpf`` forces that path.
    """
    chosen = os.environ.get(RING_ACCESS_ENV, "")
    if chosen not in ("", "direct", "libbpf"):
        raise ValueError(f"{RING_ACCESS_ENV}={chosen!r}: use 'direct' or 'libbpf'")
    if chosen == "libbpf" or platform.machine().lower() not in ("x86_64", "amd64"):
        return "libbpf"
    return "direct"


class MapBackedSource:
    """What every map-backed source shares (perf event arrays, Linux here and eBPF
    for Windows in ``windows/``; BPF ring buffers in ``ringbuf/source``): the map the
    user named, its name, sizes once open, and the claim that keeps a second reader off
    the same map: in this process, and in others through the map lock (``map_lock``)."""

    _takeover = "silently take its CPU slots"  # what a second reader would do

    def __init__(self, source: MapSpec) -> None:
        self._spec = check_map_source(source)
        self.name = source_name(source)
        self._claimed = 0
        self._ring_bytes = 0
        self._memory_bytes = 0
        self.map_id = 0
        self.take_over = False  # PerfStream(take_over=True): ask another process's reader
        self._map_lock: MapLock | None = None
        self._notice_fd = -1
        self._ended: SourceEnded | None = None  # once taken over

    @property
    def object(self) -> object | None:
        """The ``BPFObject`` the map belongs to (for BTF decoders), if known."""
        return getattr(self._spec, "object", None)

    @property
    def ring_bytes(self) -> int:
        return self._ring_bytes

    @property
    def memory_bytes(self) -> int:
        return self._memory_bytes

    @property
    def notices(self) -> list[int]:
        """The map lock's take-over notice handle, while open (see ``acknowledge``)."""
        return [self._notice_fd] if self._notice_fd >= 0 else []

    def _claim(self, slots: Sequence[int] = ()) -> None:
        """Claim the map in this process, then lock ``slots`` (map keys) across processes."""
        with _claims_lock:
            holder = _claims.get(self.map_id)
            if holder is not None:
                raise BusyResourceError(
                    f"map {self.name} (id {self.map_id}) already feeds {holder} in this process; "
                    f"a second reader would {self._takeover}. Close the first one"
                    + (" (take_over=True takes a map from a reader in another process only)."
                       if self.take_over else ".")
                )
            _claims[self.map_id] = f"a stream opened as {self.name}"
            self._claimed = self.map_id
        self._ended = None
        self._map_lock = lock_map(self.map_id, self.name, slots, take_over=self.take_over)
        if self._map_lock is not None:
            self._notice_fd = self._map_lock.notice

    def _taken_over(self) -> None:
        """The notice handle fired: if another process's reader took the map over, give
        it up (``_give_up``), unlock it, and end this source (``SourceEnded``)."""
        if self._ended is not None:
            raise self._ended  # acknowledged twice (trio's watcher, then the reader)
        held = self._map_lock
        error = held.taken_over() if held is not None else None
        if held is None or error is None:
            return
        drain = self._give_up()
        held.give_up()
        self._ended = SourceEnded(error, drain=drain)
        raise self._ended

    def _give_up(self) -> bool:
        """Stop touching the map before the taker starts; True if our rings still hold
        records for us to read."""
        raise NotImplementedError

    def _release_claim(self) -> None:
        held, self._map_lock = self._map_lock, None
        self._notice_fd = -1
        if held is not None:
            held.release()
        if self._claimed:
            with _claims_lock:
                _claims.pop(self._claimed, None)
            self._claimed = 0
