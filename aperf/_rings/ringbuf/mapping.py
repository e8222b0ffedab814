"""One BPF ring buffer map mapped for reading, as libbpf's ``ring_buffer__add`` maps it,
with its readiness handle: what the one-ring source (``source.py``) and the array of
ring buffers (``array.py``) each hold per ring. The module docstring of ``source.py``
says how the memory is laid out and why readiness is an epoll fd of its own."""

from __future__ import annotations

import contextlib
import mmap
import os
import platform
import select
from collections.abc import Callable
from typing import TypeVar

from ..._bpf.object import DropCounter, Map
from ..._errors import AperfError
from ..._options import PAGE_SIZE
from .. import map_spec as maps
from ..map_spec import RING_ACCESS_ENV, ring_access
from .format import NO_CPU, RingBufferRing

_Dropped = TypeVar("_Dropped", bound=Callable[..., int] | None)


class MappedRing:
    """One ring buffer map mapped for reading, with its readiness handle: the map fd
    (ours: closed by ``free``) mapped as ``ring_buffer__add`` maps it, an epoll fd of
    its own watching it edge-triggered, and an eventfd the ring signals when a take
    leaves records behind (see the module docstring). Shared by the one-ring source
    and the per-CPU ring buffer map's."""

    def __init__(
        self, map_fd: int, size: int, *, key: int = NO_CPU,
        lost: Callable[[], int] | None = None,
    ) -> None:
        self.map_fd = map_fd
        self._consumer: mmap.mmap | None = None
        self._producer: mmap.mmap | None = None
        self._epoll: select.epoll | None = None
        self._more_fd = -1
        try:
            self._consumer = mmap.mmap(
                map_fd, PAGE_SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=0
            )
            self._producer = mmap.mmap(
                map_fd, PAGE_SIZE + 2 * size, mmap.MAP_SHARED, mmap.PROT_READ,
                offset=PAGE_SIZE,
            )
            self._more_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            self._epoll = select.epoll()
            self._epoll.register(map_fd, select.EPOLLIN | select.EPOLLET)
            self._epoll.register(self._more_fd, select.EPOLLIN | select.EPOLLET)
            self.handle = self._epoll.fileno()
            self.ring: RingBufferRing | None = RingBufferRing(
                self.handle, self._consumer, self._producer, PAGE_SIZE, size,
                lost=lost, more=self._signal_more, key=key,
            )
        except BaseException:
            self.ring = None
            self.free()
            raise

    MEMORY_PAGES = 2
    """Pages mapped besides the data area: the consumer and the producer page."""

    def _signal_more(self) -> None:
        os.eventfd_write(self._more_fd, 1)

    def acknowledge(self) -> None:
        """Take the wakeups off the epoll fd (edge-triggered: they are reported once)."""
        epoll = self._epoll
        if epoll is None:
            return
        for fd, _ in epoll.poll(0):
            if fd == self._more_fd:
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(fd)

    def hush(self, hushed: bool) -> None:
        """Hold the kernel's wakeups back from the handle (True), or pass them again."""
        epoll = self._epoll
        if epoll is None:
            return
        if hushed:
            with contextlib.suppress(FileNotFoundError):
                epoll.unregister(self.map_fd)
        else:
            with contextlib.suppress(FileExistsError):
                epoll.register(self.map_fd, select.EPOLLIN | select.EPOLLET)

    def free(self) -> None:
        """Drop the ring's views, unmap, close the epoll fd, the eventfd and the map fd."""
        ring, self.ring = self.ring, None
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
            for name in ("_more_fd", "map_fd"):
                fd = getattr(self, name)
                setattr(self, name, -1)
                if fd >= 0:
                    os.close(fd)


def check_ring_access(name: str) -> None:
    """Ring buffers are read straight from their memory: x86-64 (TSO) only."""
    if ring_access() != "direct":
        raise AperfError(
            f"ring buffer {name}: aperf reads BPF ring buffers straight from their "
            "memory, which is correct only on x86-64 (TSO), and has no libbpf read path "
            f"for them yet ({RING_ACCESS_ENV}={os.environ.get(RING_ACCESS_ENV, '')!r}, "
            f"machine {platform.machine()})"
        )


def check_dropped(dropped: _Dropped) -> _Dropped:
    """``dropped=`` of a ring buffer source: None or a function."""
    if dropped is not None and not callable(dropped):
        raise TypeError(f"dropped must be callable, not {type(dropped).__name__}")
    return dropped


def own_drop_counter(spec: maps.MapSpec) -> DropCounter | None:
    """The drop count ``<aperf/buffer.bpf.h>`` keeps for the map, if ``spec`` is a map of
    a loaded ``BPFObject`` whose program declared it with that header."""
    return spec._drop_counter() if isinstance(spec, Map) else None
