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

import contextlib
import mmap
import os
import platform
import select
from collections.abc import Callable, Sequence

from ..._errors import AperfError, BusyResourceError, RingSizeError
from ..._options import PAGE_SIZE
from .. import map_spec as maps
from ..map_spec import RING_ACCESS_ENV, MapBackedSource, ring_access
from ..seam import HandleKind, RecordFormat, RingConfig
from .format import RINGBUF_RECORDS, RingBufferRing


class RingBufferSource(MapBackedSource):
    """The one ring of a ``BPF_MAP_TYPE_RINGBUF`` map, for ``PerfStream`` and ``PerfBuffer``.

    ``PerfStream(map)`` builds one by itself when the map is a ring buffer;
    build it yourself to give ``dropped``: a function returning the BPF
    side's own count of failed ``bpf_ringbuf_output``/``bpf_ringbuf_reserve``
    calls (the kernel counts none). The stream then reports drops as
    [`aperf.Lost`][aperf.Lost] events and in its statistics (``lost_counter="exact"``).

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
        if dropped is not None and not callable(dropped):
            raise TypeError(f"dropped must be callable, not {type(dropped).__name__}")
        self._dropped = dropped
        self._map_fd = -1
        self._consumer: mmap.mmap | None = None
        self._producer: mmap.mmap | None = None
        self._epoll: select.epoll | None = None
        self._more_fd = -1
        self._ring: RingBufferRing | None = None

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
        if self._ring is not None:
            raise BusyResourceError(f"ring buffer {self.name} is already open")
        try:
            return [self._open(config)]
        except BaseException:
            self.free()
            raise

    def _open(self, config: RingConfig) -> RingBufferRing:
        if ring_access() != "direct":
            raise AperfError(
                f"ring buffer {self.name}: aperf reads BPF ring buffers straight from their "
                "memory, which is correct only on x86-64 (TSO), and has no libbpf read path "
                f"for them yet ({RING_ACCESS_ENV}={os.environ.get(RING_ACCESS_ENV, '')!r}, "
                f"machine {platform.machine()})"
            )
        self._map_fd = maps.open_map_fd(self._spec)
        facts = maps.map_facts(self._map_fd, f"map {self.name}")
        maps.require_type(facts, self.name, maps.BPF_MAP_TYPE_RINGBUF, "a ring buffer")
        size = facts.max_entries
        if config.ring_bytes is not None and config.ring_bytes != size:
            raise RingSizeError(
                f"ring buffer {self.name} holds {size} bytes, fixed when the map was created "
                f"(max_entries); pages/ring_bytes asked for {config.ring_bytes}: leave them out"
            )
        self.map_id = facts.id
        self._claim([0])  # one ring: the whole map
        fd = self._map_fd
        self._consumer = mmap.mmap(
            fd, PAGE_SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=0
        )
        self._producer = mmap.mmap(
            fd, PAGE_SIZE + 2 * size, mmap.MAP_SHARED, mmap.PROT_READ, offset=PAGE_SIZE
        )
        self._more_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._epoll = select.epoll()
        self._epoll.register(fd, select.EPOLLIN | select.EPOLLET)
        self._epoll.register(self._more_fd, select.EPOLLIN | select.EPOLLET)
        self._ring_bytes = size
        self._memory_bytes = size + 2 * PAGE_SIZE
        self._ring = RingBufferRing(
            self._epoll.fileno(), self._consumer, self._producer, PAGE_SIZE, size,
            lost=self._dropped, more=self._signal_more,
        )
        return self._ring

    def _signal_more(self) -> None:
        os.eventfd_write(self._more_fd, 1)

    def acknowledge(self, handle: int) -> None:
        """Take the wakeups off the epoll fd (edge-triggered: they are reported once)."""
        if handle == self._notice_fd:
            self._taken_over()
            return
        epoll = self._epoll
        if epoll is None:
            return
        for fd, _ in epoll.poll(0):
            if fd == self._more_fd:
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(fd)

    def hush_wakeups(self, handle: int, hushed: bool) -> None:
        """Hold the kernel's wakeups back from the readiness handle (True), or pass them again.

        The reader holds them back while records flow and its drain timer takes them:
        a reader that catches up is woken by the very next record, and each wakeup
        costs the loop far more than the record. Passing them again polls the map
        fd: records already there are reported at once, none is missed.
        """
        epoll = self._epoll
        if epoll is None or handle != epoll.fileno():
            return
        if hushed:
            with contextlib.suppress(FileNotFoundError):
                epoll.unregister(self._map_fd)
        else:
            with contextlib.suppress(FileExistsError):
                epoll.register(self._map_fd, select.EPOLLIN | select.EPOLLET)

    def _give_up(self) -> bool:
        """Taken over: the ring and its consumer position are the taker's from now on.
        What we took out of it is ours to deliver; what it still holds is the taker's."""
        return False

    def free(self) -> None:
        """Drop the ring's views, unmap, close the epoll fd, the eventfd and our map fd."""
        ring, self._ring = self._ring, None
        try:
            if ring is not None:
                ring.release()
            for mapping in (self._consumer, self._producer):
                if mapping is not None:
                    mapping.close()
        finally:
            self._consumer = self._producer = None
            epoll, self._epoll = self._epoll, None
            if epoll is not None:
                epoll.close()
            for name in ("_more_fd", "_map_fd"):
                fd = getattr(self, name)
                setattr(self, name, -1)
                if fd >= 0:
                    os.close(fd)
            self._release_claim()

    def after_fork(self) -> None:
        """In a child process: drop the child's views, mappings and fds. Nothing of the
        parent's is touched: unmapping and closing act on the child's copies only, and
        the consumer position is never written."""
        self.free()
