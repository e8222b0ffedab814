"""The eBPF for Windows ring buffer as a ring source (handle kind "win32").

eBPF for Windows maps a ``BPF_MAP_TYPE_RINGBUF`` (13 there) into the reader's
process since v1.1: ``ring_buffer__new`` in synchronous mode, then
``ebpf_ring_buffer_get_buffer`` gives the consumer page (read-write), the
producer page and the data area mapped twice, and
``ebpf_ring_buffer_get_wait_handle`` one manual-reset event that the producer
signals after a record whenever the ring is not empty. Offsets only grow and
records are laid out as on Linux (an 8-byte header with the lock and discard
bits, the data padded to 8), so the ring is
read with aperf's own ring buffer code (``ringbuf/format.RingBufferRing``):
committed records are copied out of the mapping in one slice and the space is
released at once, with no callback per sample (the perf path pays one ctypes
callback per record, about 0.9 us). ``acknowledge()`` resets the event before
the ring is read, so an output during the read signals it again.

Frees in a fixed order: (drivers stop waiting on the handle first) the ring's
views, then, as ``base.WindowsSource`` frees, the ring buffer
(``ring_buffer__free`` unmaps the memory and closes the event), then aperf's own
map fd, then the claim on the map.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..._bpf.object import Map
from ..._native.ebpfapi import api as win
from ..._native.ebpfapi import binding as c
from ..map_spec import MapSpec
from ..ringbuf.format import RINGBUF_RECORDS, RingBufferRing
from ..seam import HandleKind, RecordFormat, RingConfig
from .base import WindowsSource, own_map_fd
from .perf import WindowsPerfSource


class WindowsRingBufferSource(WindowsSource[win.SyncRingBuffer, RingBufferRing]):
    """The one ring of an eBPF for Windows ``BPF_MAP_TYPE_RINGBUF`` map (``PerfStream``
    builds one by itself for a ring buffer's fd or pin path).

    ``source`` is the map's fd (an ebpfapi fd), the path it is pinned at, or an
    ``aperf.Map``. ``dropped`` is the BPF side's own count of failed outputs, if it
    keeps one (the ring keeps none), as for
    [`aperf.RingBufferSource`][aperf.RingBufferSource]. The ring size is the
    map's ``max_entries``: ``pages`` and ``ring_bytes`` are refused. Samples carry
    ``cpu=-1``.
    """

    records: RecordFormat = RINGBUF_RECORDS

    _takeover = "race it for the consumer offset and take its wait handle"
    _noun = "ring buffer"
    _fixed_size = (
        "pages/ring_bytes: a ring buffer's size is fixed by its map (max_entries); "
        "leave pages and ring_bytes unset"
    )

    def __init__(self, source: MapSpec, *, dropped: Callable[[], int] | None = None) -> None:
        super().__init__(source)
        if dropped is not None and not callable(dropped):
            raise TypeError(f"dropped must be callable, not {type(dropped).__name__}")
        self._dropped = dropped
        self._ring: RingBufferRing | None = None

    def _open(self) -> list[RingBufferRing]:
        self._own_map(
            c.BPF_MAP_TYPE_RINGBUF,
            "map {name} has type {type}, not BPF_MAP_TYPE_RINGBUF "
            f"({c.BPF_MAP_TYPE_RINGBUF} on Windows)",
        )
        rb = self._hold(win.SyncRingBuffer(self._map_fd))
        assert rb.consumer is not None and rb.producer is not None
        ring = RingBufferRing(
            rb.wait_handle, rb.consumer, rb.producer, 0, rb.size, lost=self._dropped,
            more=self._signal_more, data=rb.data,
        )
        self._ring = ring
        self._ring_bytes = rb.size
        self._memory_bytes = rb.size + 2 * 4096  # the data (mapped twice) and two pages
        return [ring]

    def _signal_more(self) -> None:
        """A take stopped with records left: signal our own event so the reader comes back."""
        with self._lock:
            rb = self._buffer
            if rb is not None:
                win.signal(rb.wait_handle)

    def free(self) -> None:
        """Drop the ring's views, then free as every Windows source does."""
        ring, self._ring = self._ring, None
        try:
            if ring is not None:
                ring.release()
        finally:
            super().free()

    def after_fork(self) -> None:
        self._ring = None
        super().after_fork()


class WindowsMapSource:
    """What ``PerfStream(fd_or_path)`` reads on Windows: the map's own source, picked by
    the map's type when the stream opens (a ring buffer, else a perf event array, whose
    open says what is wrong with any other map), so that constructing a stream loads
    no library. Once open, everything is the chosen source's."""

    handle_kind: HandleKind = "win32"

    def __init__(self, source: MapSpec) -> None:
        self._spec = source
        self._chosen: WindowsPerfSource | WindowsRingBufferSource = WindowsPerfSource(source)

    @property
    def records(self) -> RecordFormat:
        return self._chosen.records

    def open(self, config: RingConfig) -> Sequence[object]:
        if _map_type(self._spec) == c.BPF_MAP_TYPE_RINGBUF:
            self._chosen = WindowsRingBufferSource(self._spec)
        return self._chosen.open(config)

    def acknowledge(self, handle: int) -> None:
        self._chosen.acknowledge(handle)

    def free(self) -> None:
        self._chosen.free()

    def after_fork(self) -> None:
        self._chosen.after_fork()

    def __getattr__(self, name: str) -> object:  # name, ring_bytes, memory_bytes, wait_handle...
        if name.startswith("__") or name in ("_chosen", "_spec"):
            raise AttributeError(name)
        return getattr(self._chosen, name)

    def __repr__(self) -> str:
        return repr(self._chosen)


def _map_type(spec: MapSpec) -> int | None:
    """The eBPF for Windows map type behind ``spec``, or None when it cannot be told
    (the chosen source's open then says why)."""
    if isinstance(spec, Map):
        return spec.type
    try:
        fd = own_map_fd(spec)
    except OSError:
        return None
    try:
        return win.map_info(fd).type
    except OSError:
        return None
    finally:
        win.close_fd(fd)
