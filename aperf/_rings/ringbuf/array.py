"""Per-CPU BPF ring buffers: a ``BPF_MAP_TYPE_ARRAY_OF_MAPS`` whose slots hold ring
buffers, one per CPU (Falco's modern probe), read as one source.

A program that outgrows one ring buffer (every CPU contends for its one producer
lock) gives each CPU a ring of its own: ``bpf_map_lookup_elem(&rings, &cpu)`` picks
the running CPU's, ``bpf_ringbuf_output`` writes into it. ``<aperf/buffer.bpf.h>``
declares such a map (``APERF_RINGBUF_PER_CPU``), and ``BPFObject`` fills its slots at
load. The reader side asks the outer map for each slot's inner map (a lookup gives
its id, ``bpf_map_get_fd_by_id`` an fd) and maps every ring as the one-ring source
does (``mapping.MappedRing``), each ring keyed by its slot: the CPU, what
``Sample.cpu`` says. Each ring has a readiness handle of its own, so a wakeup drains
only the ring that has records.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from ..._bpf.object import DropCounter
from ..._errors import BusyResourceError, MapTypeError, RingSizeError
from ..._options import PAGE_SIZE
from .. import map_spec as maps
from ..map_spec import MapBackedSource
from ..seam import HandleKind, RecordFormat, RingConfig
from .format import RINGBUF_RECORDS, RingBufferRing
from .mapping import MappedRing, check_dropped, check_ring_access, own_drop_counter


class RingBufferArraySource(MapBackedSource):
    """Every ring buffer in the slots of a ``BPF_MAP_TYPE_ARRAY_OF_MAPS``, as one source.

    ``PerfStream(map)`` builds one by itself when the map is an array of maps. The
    rings are keyed by their slot, the CPU whose ring it is: ``Sample.cpu`` says it,
    ``order_by=`` merges them in time order, and each ring's drops are its own.
    Empty slots are skipped; the slots are read when the stream opens (a ring put in
    a slot later is not read).

    ``dropped``: a function of a slot returning the BPF side's count of failed
    outputs into that slot's ring (the kernel counts none); a map declared with
    ``APERF_RINGBUF_PER_CPU`` (``<aperf/buffer.bpf.h>``) brings the header's own count,
    used when ``dropped`` is not given. Drops are then [`aperf.Lost`][aperf.Lost]
    events of that ring's CPU (``lost_counter="exact"``).

    The rings' sizes are their maps' own (``pages``/``ring_bytes`` must be left out);
    ``ring_bytes`` is the smallest ring's. Wakeups work as for one ring buffer.
    """

    handle_kind: HandleKind = "fd"
    records: RecordFormat = RINGBUF_RECORDS
    MAP_TYPE = maps.BPF_MAP_TYPE_ARRAY_OF_MAPS
    """``BPF_MAP_TYPE_ARRAY_OF_MAPS`` (12): the ``aperf.Map.type`` of the maps it reads."""

    _takeover = "race it for the consumer positions"  # what a second reader would do
    wakes_when_caught_up = True
    """As for one ring buffer: the kernel wakes the reader for a record at ``consumer_pos``."""

    def __init__(
        self, source: maps.MapSpec, *, dropped: Callable[[int], int] | None = None
    ) -> None:
        super().__init__(source)
        self._dropped = check_dropped(dropped)
        self._counter: DropCounter | None = None
        self._mapped: dict[int, MappedRing] = {}  # readiness handle -> its ring

    def open(self, config: RingConfig) -> Sequence[RingBufferRing]:
        """Map every ring in the map's slots; all or nothing (the driver calls it)."""
        if self._mapped:
            raise BusyResourceError(f"map {self.name} is already open")
        try:
            return self._open(config)
        except BaseException:
            self.free()
            raise

    def _open(self, config: RingConfig) -> list[RingBufferRing]:
        check_ring_access(self.name)
        fd = maps.open_map_fd(self._spec)
        try:
            facts = maps.map_facts(fd, f"map {self.name}")
            maps.require_type(facts, self.name, maps.BPF_MAP_TYPE_ARRAY_OF_MAPS,
                              "an array of ring buffers")
            inner = maps.inner_maps(fd, facts.max_entries)
        finally:
            os.close(fd)
        try:
            rings = self._check_rings(inner, config)
        except BaseException:
            for _, inner_fd in inner:
                os.close(inner_fd)
            raise
        self.map_id = facts.id
        try:
            self._counter = None if self._dropped is not None else own_drop_counter(self._spec)
            self._claim([slot for slot, _, _ in rings])
        except BaseException:
            for _, inner_fd, _ in rings:
                os.close(inner_fd)
            raise
        opened = []
        pending = list(rings)
        try:
            while pending:
                slot, inner_fd, size = pending.pop(0)
                mapped = MappedRing(inner_fd, size, key=slot, lost=self._lost_of(slot))
                self._mapped[mapped.handle] = mapped
                assert mapped.ring is not None
                opened.append(mapped.ring)
        except BaseException:
            for _, inner_fd, _ in pending:
                os.close(inner_fd)
            raise
        sizes = [size for _, _, size in rings]
        self._ring_bytes = min(sizes)
        self._memory_bytes = sum(sizes) + MappedRing.MEMORY_PAGES * PAGE_SIZE * len(sizes)
        return opened

    def _check_rings(
        self, inner: list[tuple[int, int]], config: RingConfig
    ) -> list[tuple[int, int, int]]:
        """``(slot, fd, size)`` of each inner map, which must all be ring buffers."""
        if not inner:
            raise MapTypeError(
                f"map {self.name} holds no ring buffer: its slots are empty (fill them before "
                "the stream opens; BPFObject fills a map declared with APERF_RINGBUF_PER_CPU)"
            )
        rings = []
        for slot, inner_fd in inner:
            facts = maps.map_facts(inner_fd, f"map {self.name}[{slot}]")
            maps.require_type(facts, f"{self.name}[{slot}]", maps.BPF_MAP_TYPE_RINGBUF,
                              "a ring buffer")
            if config.ring_bytes is not None and config.ring_bytes != facts.max_entries:
                raise RingSizeError(
                    f"ring buffer {self.name}[{slot}] holds {facts.max_entries} bytes, fixed "
                    f"when the map was created; pages/ring_bytes asked for "
                    f"{config.ring_bytes}: leave them out"
                )
            rings.append((slot, inner_fd, facts.max_entries))
        return rings

    def _lost_of(self, slot: int) -> Callable[[], int] | None:
        dropped, counter = self._dropped, self._counter
        if dropped is not None:
            return lambda: dropped(slot)
        if counter is not None and slot < counter.slots:
            return lambda: counter.count(slot)
        return None

    def acknowledge(self, handle: int) -> None:
        """Take the wakeups off a ring's epoll fd (edge-triggered: reported once)."""
        if handle == self._notice_fd:
            self._taken_over()
            return
        mapped = self._mapped.get(handle)
        if mapped is not None:
            mapped.acknowledge()

    def hush_wakeups(self, handle: int, hushed: bool) -> None:
        """As ``RingBufferSource.hush_wakeups``, for the ring whose handle it is."""
        mapped = self._mapped.get(handle)
        if mapped is not None:
            mapped.hush(hushed)

    def _give_up(self) -> bool:
        """Taken over: the rings and their consumer positions are the taker's now."""
        return False

    def free(self) -> None:
        """Unmap every ring and close its fds, then the drop count's mapping."""
        mapped, self._mapped = self._mapped, {}
        counter, self._counter = self._counter, None
        failure: BaseException | None = None
        for ring in mapped.values():
            try:
                ring.free()
            except BaseException as exc:  # the others are freed all the same
                failure = failure or exc
        if counter is not None:
            counter.close()
        self._release_claim()
        if failure is not None:
            raise failure

    def after_fork(self) -> None:
        """In a child process: drop the child's views, mappings and fds only."""
        self.free()
