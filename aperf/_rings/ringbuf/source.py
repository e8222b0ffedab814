"""A BPF ring buffer (``BPF_MAP_TYPE_RINGBUF``, Linux 5.8+) as a ring source.

The map is mapped from its fd with Python's ``mmap``, as libbpf's
``ring_buffer__add`` does: the consumer page read-write at offset 0, the
producer page and the doubly mapped data area read-only at one page. libbpf
1.1 has no accessor for that memory; from libbpf 1.3 on,
``ring_buffer__ring(rb, 0)`` with ``ring__consumer_pos``, ``ring__producer_pos``,
``ring__size`` and ``ring__map_fd`` (plus ``ring__avail_data_size``) would
describe the same mapping, libbpf's own.

Readiness: the map fd is readable while the ring holds data (level-triggered),
where the driver expects one report per kernel wakeup, as perf fds give. So
the readiness handle is an epoll fd of the source's own that watches the map
fd edge-triggered: it turns readable on each wakeup, and ``acknowledge``
(``epoll_wait`` with no timeout) clears it. It also watches an eventfd that
the ring signals when a take leaves records behind (a producer as fast as the
reader), so that the reader comes back for them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from ..._bpf.object import DropCounter
from ..._errors import BusyResourceError, RingSizeError
from ..._options import PAGE_SIZE
from .. import map_spec as maps
from ..map_spec import MapBackedSource
from ..seam import HandleKind, RecordFormat, RingConfig
from .format import RINGBUF_RECORDS, RingBufferRing
from .mapping import MappedRing, check_dropped, check_ring_access, own_drop_counter


class RingBufferSource(MapBackedSource):
    """The one ring of a ``BPF_MAP_TYPE_RINGBUF`` map, for ``PerfStream`` and ``PerfBuffer``.

    ``PerfStream(map)`` builds one by itself when the map is a ring buffer;
    build it yourself to give ``dropped``: a function returning the BPF
    side's own count of failed ``bpf_ringbuf_output``/``bpf_ringbuf_reserve``
    calls (the kernel counts none). The stream then reports drops as
    [`aperf.Lost`][aperf.Lost] events and in its statistics (``lost_counter="exact"``).
    A map declared with ``APERF_BUFFER`` (``<aperf/buffer.bpf.h>``) brings that count
    along: without ``dropped``, the source reads the header's own.

    Samples carry ``cpu=-1`` ([`aperf.NO_CPU`][aperf.NO_CPU]): one ring serves every CPU.
    The ring's size is the map's ``max_entries``, fixed when the map is
    created (see [`aperf.Map.set_max_entries`][aperf.Map.set_max_entries]); ``pages``/``ring_bytes``
    must match it or be left out. Wakeups are the producer's choice
    (``BPF_RB_NO_WAKEUP``, ``BPF_RB_FORCE_WAKEUP``, or by default a wakeup when
    the reader has caught up); the stream's ``wakeup`` setting sets its drain
    timer, and with a batched one (the default) a wakeup is read at the next
    tick, so that records gather meanwhile without waking the reader again.
    """

    handle_kind: HandleKind = "fd"
    records: RecordFormat = RINGBUF_RECORDS
    MAP_TYPE = maps.BPF_MAP_TYPE_RINGBUF
    """``BPF_MAP_TYPE_RINGBUF`` (27): the ``aperf.Map.type`` of the maps it reads."""

    _takeover = "race it for the consumer position"  # what a second reader would do
    wakes_when_caught_up = True
    """The kernel's default wakeup comes only for a record at ``consumer_pos``: with
    batched wakeups the reader lets records gather after a wakeup (docs/ringbuf.md)."""

    def __init__(
        self, source: maps.MapSpec, *, dropped: Callable[[], int] | None = None
    ) -> None:
        super().__init__(source)
        self._dropped = check_dropped(dropped)
        self._counter: DropCounter | None = None
        self._mapped: MappedRing | None = None

    @property
    def ring_bytes(self) -> int:
        """The ring's data bytes: the map's ``max_entries`` (0 until open)."""
        return self._ring_bytes

    @property
    def memory_bytes(self) -> int:
        """The data area (mapped twice, stored once) and the consumer and producer pages."""
        return self._memory_bytes

    def open(self, config: RingConfig) -> Sequence[RingBufferRing]:
        """Map the ring and make its readiness handle; all or nothing (the driver calls it)."""
        if self._mapped is not None:
            raise BusyResourceError(f"ring buffer {self.name} is already open")
        try:
            return [self._open(config)]
        except BaseException:
            self.free()
            raise

    def _open(self, config: RingConfig) -> RingBufferRing:
        check_ring_access(self.name)
        fd = maps.open_map_fd(self._spec)
        try:
            facts = maps.map_facts(fd, f"map {self.name}")
            maps.require_type(facts, self.name, maps.BPF_MAP_TYPE_RINGBUF, "a ring buffer")
        except BaseException:
            os.close(fd)
            raise
        size = facts.max_entries
        if config.ring_bytes is not None and config.ring_bytes != size:
            os.close(fd)
            raise RingSizeError(
                f"ring buffer {self.name} holds {size} bytes, fixed when the map was created "
                f"(max_entries); pages/ring_bytes asked for {config.ring_bytes}: leave them out"
            )
        self.map_id = facts.id
        lost = self._dropped
        try:
            if lost is None:
                self._counter = own_drop_counter(self._spec)
                lost = None if self._counter is None else self._counter.count
            self._claim([0])  # one ring: the whole map
        except BaseException:
            os.close(fd)
            raise
        self._mapped = MappedRing(fd, size, lost=lost)
        self._ring_bytes = size
        self._memory_bytes = size + MappedRing.MEMORY_PAGES * PAGE_SIZE
        assert self._mapped.ring is not None
        return self._mapped.ring

    def acknowledge(self, handle: int) -> None:
        """Take the wakeups off the epoll fd (edge-triggered: they are reported once)."""
        if handle == self._notice_fd:
            self._taken_over()
            return
        if self._mapped is not None:
            self._mapped.acknowledge()

    def hush_wakeups(self, handle: int, hushed: bool) -> None:
        """Hold the kernel's wakeups back from the readiness handle (True), or pass them again.

        The reader holds them back while records flow and its drain timer takes them:
        a reader that catches up is woken by the very next record, and each wakeup
        costs the loop far more than the record. Passing them again polls the map
        fd: records already there are reported at once, none is missed.
        """
        mapped = self._mapped
        if mapped is not None and handle == mapped.handle:
            mapped.hush(hushed)

    def _give_up(self) -> bool:
        """Taken over: the ring and its consumer position are the taker's from now on.
        What we took out of it is ours to deliver; what it still holds is the taker's."""
        return False

    def free(self) -> None:
        """Drop the ring's views, unmap, close the epoll fd, the eventfd and our map fd."""
        mapped, self._mapped = self._mapped, None
        counter, self._counter = self._counter, None
        try:
            if mapped is not None:
                mapped.free()
        finally:
            if counter is not None:
                counter.close()
            self._release_claim()

    def after_fork(self) -> None:
        """In a child process: drop the child's views, mappings and fds. Nothing of the
        parent's is touched: unmapping and closing act on the child's copies only, and
        the consumer position is never written."""
        self.free()
