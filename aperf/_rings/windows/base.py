"""What eBPF for Windows' sources share (as ``MapBackedSource`` is for every map's):
an ebpfapi fd of their own for the map, one buffer made over it whose one manual-reset
wait handle every ring shares, and the order they free in.

Frees in a fixed order: (drivers stop waiting on the handle first) the buffer (its
``free`` unmaps the rings and closes the wait handle), then aperf's own map fd, then
the claim on the map.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from ..._bpf.object import Map
from ..._errors import BusyResourceError, ClosedResourceError, MapTypeError, RingSizeError
from ..._native.ebpfapi import api as win
from ..map_spec import MapBackedSource, MapSpec
from ..seam import HandleKind, RingConfig

if TYPE_CHECKING:
    from ..._native.prototypes import MapInfo


class Buffer(Protocol):
    """What ebpfapi's buffers (``SyncPerfBuffer``, ``SyncRingBuffer``) have in common."""

    wait_handle: int

    def free(self) -> None: ...


B = TypeVar("B", bound=Buffer)
R = TypeVar("R")  # its rings


def own_map_fd(source: MapSpec) -> int:
    """An ebpfapi fd of our own for the map the user named (closed with ``win.close_fd``)."""
    if isinstance(source, Map):
        if source.closed:
            raise ClosedResourceError(f"map {source.name!r} belongs to a closed BPFObject")
        return win.duplicate_fd(source.fd)
    if isinstance(source, int):
        return win.duplicate_fd(source)
    return win.pinned_map_fd(os.fspath(source))


class WindowsSource(MapBackedSource, Generic[B, R]):
    """An eBPF for Windows map read through one ebpfapi buffer (``_buffer``, while open).

    A subclass says what it reads (``_noun``), why a ring size is refused
    (``_fixed_size``), and makes its rings in ``_open`` (with ``_own_map`` and
    ``_hold``).
    """

    handle_kind: HandleKind = "win32"
    _noun = "map"
    _fixed_size = "pages/ring_bytes: the ring size is fixed by the map"

    def __init__(self, source: MapSpec) -> None:
        super().__init__(source)
        self._lock = threading.Lock()  # the buffer's uses, the reset and free never overlap
        self._buffer: B | None = None
        self._map_fd = -1

    @property
    def wait_handle(self) -> int | None:
        """The buffer's wait handle, while open."""
        buffer = self._buffer
        return None if buffer is None else buffer.wait_handle

    def open(self, config: RingConfig) -> Sequence[R]:
        if config.ring_bytes is not None:
            raise RingSizeError(self._fixed_size)
        with self._lock:
            if self._buffer is not None:
                raise BusyResourceError(f"{self._noun} {self.name} is already open")
        try:
            return self._open()
        except BaseException:
            self.free()
            raise

    def _open(self) -> Sequence[R]:
        raise NotImplementedError

    def _own_map(self, map_type: int, wrong_type: str) -> MapInfo:
        """Our own fd for the map (the buffer still uses it; closed by free()), its facts
        (MapTypeError, saying ``wrong_type`` of them, unless it has ``map_type``), and
        the claim on it."""
        self._map_fd = own_map_fd(self._spec)
        facts = win.map_info(self._map_fd)
        if facts.type != map_type:
            raise MapTypeError(wrong_type.format(name=self.name, type=facts.type))
        self.map_id = facts.id
        self._claim()
        return facts

    def _hold(self, buffer: B) -> B:
        with self._lock:
            self._buffer = buffer
        return buffer

    def acknowledge(self, handle: int) -> None:
        """Reset the manual-reset wait handle before its rings are read."""
        with self._lock:
            buffer = self._buffer
            if buffer is not None and buffer.wait_handle == handle:
                win.reset(handle)

    def free(self) -> None:
        """Free the buffer (rings unmapped, wait handle closed), then our map fd."""
        with self._lock:
            buffer, self._buffer = self._buffer, None
        try:
            if buffer is not None:
                buffer.free()
        finally:
            try:
                fd, self._map_fd = self._map_fd, -1
                if fd >= 0:
                    win.close_fd(fd)
            finally:
                self._release_claim()

    def after_fork(self) -> None:
        """Windows processes do not fork; should a copy of this source exist in a
        child anyway, it forgets the parent's buffer and fd without freeing them."""
        with self._lock:
            self._buffer = None
        self._map_fd = -1
        self._claimed = 0

    def __repr__(self) -> str:
        state = "open" if self._buffer is not None else "closed"
        return f"<{type(self).__name__} {self.name!r} {state}>"
