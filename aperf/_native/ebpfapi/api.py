"""A Pythonic surface over the eBPF for Windows and kernel32 prototypes: ints and
bytes in and out, no ctypes type leaves this module.

- ``SyncPerfBuffer``: ``perf_buffer__new`` in synchronous mode (the
  default since ebpf-for-windows PR #4640), one ring per CPU, one manual-reset
  wait handle shared by every ring; records copied out in
  ``perf_buffer__consume_buffer``'s callbacks.
- ``SyncRingBuffer``: ``ring_buffer__new`` in synchronous mode, its mapped
  memory (``ebpf_ring_buffer_get_buffer``, eBPF for Windows v1.1+) and its one
  manual-reset wait handle; records are read straight out of the memory.
- ``Event``, ``wait_any()``, ``is_signalled()``, ``reset()``: the
  kernel32 event and wait calls the waiters need.
- map fds: ``map_info()``, ``pinned_map_fd()``, ``duplicate_fd()``,
  ``close_fd()``.
- ``park()``: before either buffer is freed, its rings are pointed at one event of the
  process's own, so that the buffer's event is not leaked (eBPF for Windows #5206).
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from collections.abc import Iterable, Sequence

from ..._errors import LibbpfError, LibbpfUnavailableError, Win32Error
from ..prototypes import MapInfo, park_callback_error, read_map_info
from . import binding as c

# --- maps and fds -----------------------------------------------------------------------


def map_info(fd: int) -> MapInfo:
    """What eBPF for Windows says of the map behind ``fd`` (EBADF if it is not open)."""
    return read_map_info(fd, c.bpf_map_info(), c.bpf_obj_get_info_by_fd)


def pinned_map_fd(path: str) -> int:
    """A new fd for the object pinned at ``path`` (closed with ``close_fd()``)."""
    return int(c.bpf_obj_get(os.fsencode(path)))


def duplicate_fd(fd: int) -> int:
    dup = c.fd_t(-1)
    c.ebpf_duplicate_fd(fd, ctypes.byref(dup))
    return int(dup.value)


def close_fd(fd: int) -> None:
    """Close an eBPF fd and its handle (``ebpf_close_fd``: the fd is ebpfapi's, not Python's)."""
    c.ebpf_close_fd(fd)


# --- events and waits ------------------------------------------------------------------


def wait_any(handles: Sequence[int], timeout_ms: int) -> int | None:
    """Wait until one of ``handles`` is signalled: its index (the lowest), or None on timeout
    (``timeout_ms`` negative or INFINITE: no timeout).

    A satisfied wait resets an auto-reset event and leaves a manual-reset one
    signalled (WaitForMultipleObjects with bWaitAll=FALSE).
    """
    count = len(handles)
    if not 0 < count <= c.MAXIMUM_WAIT_OBJECTS:
        raise ValueError(f"can wait on 1 to {c.MAXIMUM_WAIT_OBJECTS} handles, not {count}")
    array = (c.HANDLE * count)(*handles)
    result = int(c.WaitForMultipleObjects(count, array, 0, _milliseconds(timeout_ms)))
    if result == c.WAIT_TIMEOUT:
        return None
    if c.WAIT_OBJECT_0 <= result < c.WAIT_OBJECT_0 + count:
        return result - c.WAIT_OBJECT_0
    if c.WAIT_ABANDONED_0 <= result < c.WAIT_ABANDONED_0 + count:  # mutexes only
        return result - c.WAIT_ABANDONED_0
    raise Win32Error(0, "WaitForMultipleObjects", f"unexpected result {result:#x}")


def _milliseconds(timeout_ms: int) -> int:
    """A DWORD timeout: negative (or INFINITE) waits for ever; longer ones are capped."""
    if timeout_ms < 0 or timeout_ms >= c.INFINITE:
        return c.INFINITE
    return timeout_ms


def wait_one(handle: int, timeout_ms: int) -> bool:
    """Whether ``handle`` was (or became) signalled within ``timeout_ms`` (negative: for ever)."""
    return int(c.WaitForSingleObject(handle, _milliseconds(timeout_ms))) != c.WAIT_TIMEOUT


def is_signalled(handle: int) -> bool:
    return wait_one(handle, 0)


def reset(handle: int) -> None:
    c.ResetEvent(handle)


def signal(handle: int) -> None:
    c.SetEvent(handle)


class Event:
    """A kernel32 event of our own (``CreateEventW``); ``close()`` is idempotent."""

    def __init__(self, *, manual_reset: bool) -> None:
        self.handle: int = c.CreateEventW(None, int(manual_reset), 0, None)

    def set(self) -> None:
        c.SetEvent(self.handle)

    def close(self) -> None:
        handle, self.handle = self.handle, 0
        if handle:
            c.CloseHandle(handle)


# --- eBPF for Windows #5206: a parking event for freed buffers' rings ------------------------

_parking: Event | None = None
_parking_lock = threading.Lock()


def parking_handle() -> int:
    """One manual-reset event per process, never closed, that nobody waits on: where
    ``park()`` points the rings of a buffer about to be freed."""
    global _parking
    with _parking_lock:
        if _parking is None:
            _parking = Event(manual_reset=True)
        return _parking.handle


def park(map_fd: int, indices: Iterable[int]) -> None:
    """Point the rings ``indices`` of the map at the parking event, before
    ``perf_buffer__free``/``ring_buffer__free``.

    Those free calls clear each ring's wait handle by setting ``ebpf_handle_invalid``,
    which fails in kernel mode (eBPF for Windows #5206, open): the kernel keeps its
    reference to the buffer's event, which outlives its closed handle for as long as the
    map lives. Setting a valid event instead releases that reference (the kernel
    dereferences the old event whenever it takes a new one), so the buffer's event is
    freed with its handle, and the one parking event is all that stays referenced.
    Where #5206 is fixed, the free call then clears the parking event as well.
    Best-effort: a DLL that refuses it leaves things as they were (the leak, no worse).
    """
    try:
        handle = parking_handle()
        for index in indices:
            c.ebpf_map_set_wait_handle(map_fd, index, handle)
    except (LibbpfError, LibbpfUnavailableError, Win32Error):
        pass  # the free goes on: only the mitigation is lost


# --- the synchronous perf buffer ------------------------------------------------------------

Record = bytes | int
"""What a consume hands back, in callback order: a sample's bytes, or a lost count."""


class SyncPerfBuffer:
    """``perf_buffer__new(map_fd, 0, ...)``: every CPU's ring, one wait handle for all.

    eBPF for Windows requires page_cnt 0 (the ring size is the map's
    max_entries) and both callbacks. The callbacks run only inside
    ``consume()`` (``perf_buffer__consume_buffer``) on the calling thread: the
    lost callback first, with the producer page's count of drops since the
    last consume, then one call per record. Not thread-safe: the caller
    serializes consume and free.
    """

    def __init__(self, map_fd: int) -> None:
        self._out: list[Record] | None = None
        self._map_fd = map_fd  # the caller's, open until after free()
        self.count = 0
        # Kept alive as long as the buffer: C holds these pointers.
        self._sample_fn = c.PERF_SAMPLE_FN(self._on_sample)
        self._lost_fn = c.PERF_LOST_FN(self._on_lost)
        self._pb = int(c.perf_buffer__new(map_fd, 0, self._sample_fn, self._lost_fn, None, None))
        try:
            self.count = int(c.perf_buffer__buffer_cnt(self._pb))
            self.wait_handle = int(c.ebpf_perf_buffer_get_wait_handle(self._pb))
            if self.wait_handle in (c.EBPF_HANDLE_INVALID, 0):
                raise LibbpfError(
                    errno.EINVAL, "ebpf_perf_buffer_get_wait_handle",
                    "the perf buffer has no wait handle (it is not in synchronous mode)",
                )
        except BaseException:
            self.free()
            raise

    def _on_sample(self, ctx: int | None, cpu: int, data: int | None, size: int) -> None:
        try:
            out = self._out
            if out is None or data is None:
                raise RuntimeError("perf_buffer sample callback outside a consume, or no data")
            out.append(ctypes.string_at(data, size) if size else b"")
        except BaseException as exc:  # parked, re-raised by consume's errcheck
            park_callback_error(exc)

    def _on_lost(self, ctx: int | None, cpu: int, count: int) -> None:
        try:
            out = self._out
            if out is None:
                raise RuntimeError("perf_buffer lost callback outside a consume")
            out.append(int(count))
        except BaseException as exc:
            park_callback_error(exc)

    def consume(self, index: int) -> list[Record]:
        """Everything ring ``index`` holds now, in callback order; the space is released."""
        if not self._pb:
            raise LibbpfError(errno.EBADF, "perf_buffer__consume_buffer", "the buffer was freed")
        out: list[Record] = []
        self._out = out
        try:
            c.perf_buffer__consume_buffer(self._pb, index)
        finally:
            self._out = None
        return out

    def free(self) -> None:
        """``perf_buffer__free``: unmaps the rings and closes the wait handle (its rings
        parked first: ``park()``). Idempotent."""
        pb, self._pb = self._pb, 0
        if pb:
            park(self._map_fd, range(self.count))
            c.perf_buffer__free(pb)


# --- the synchronous ring buffer ----------------------------------------------------------


_from_memory = ctypes.pythonapi.PyMemoryView_FromMemory
_from_memory.restype = ctypes.py_object
_from_memory.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
_PYBUF_READ, _PYBUF_WRITE = 0x100, 0x200


def _memory(address: int, size: int, *, writable: bool) -> memoryview:
    """A byte-format memoryview of mapped memory we do not own (ctypes arrays export
    a "<c" format, which memoryview cannot cast to words)."""
    view = _from_memory(address, size, _PYBUF_WRITE if writable else _PYBUF_READ)
    assert isinstance(view, memoryview)
    return view


def _never_called(ctx: int | None, data: int | None, size: int) -> int:
    """ring_buffer__new requires a sample callback; aperf never consumes through it."""
    return -1  # were it called (ring_buffer__consume), it would stop at once


class SyncRingBuffer:
    """``ring_buffer__new(map_fd, ...)`` in synchronous mode: the ring's mapped memory
    and the manual-reset wait handle its producer signals.

    ``consumer`` (the consumer page, read-write, ``u64 consumer_offset``),
    ``producer`` (the producer page, ``u64 producer_offset``) and ``data`` (the
    data area, ``size`` bytes mapped twice in a row) are buffers over the mapping
    whose slices are copies (``bytes``), as an mmap's are. They must all be dropped
    (every view of them released) before ``free()``, which unmaps them.
    """

    def __init__(self, map_fd: int) -> None:
        self._map_fd = map_fd  # the caller's, open until after free()
        self.consumer: memoryview | None = None
        self.producer: memoryview | None = None
        self.data: memoryview | None = None
        self._sample_fn = c.RING_SAMPLE_FN(_never_called)  # C holds it until free
        self._rb = int(c.ring_buffer__new(map_fd, self._sample_fn, None, None))
        try:
            consumer, producer, data = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
            size = ctypes.c_uint64()
            c.ebpf_ring_buffer_get_buffer(
                self._rb, 0, ctypes.byref(consumer), ctypes.byref(producer),
                ctypes.byref(data), ctypes.byref(size),
            )
            if not (consumer.value and producer.value and data.value and size.value):
                raise LibbpfError(
                    errno.EINVAL, "ebpf_ring_buffer_get_buffer", "the ring is not mapped"
                )
            self.size = int(size.value)
            self.consumer = _memory(consumer.value, 8, writable=True)
            self.producer = _memory(producer.value, 8, writable=False)
            self.data = _memory(data.value, 2 * self.size, writable=False)
            self.wait_handle = int(c.ebpf_ring_buffer_get_wait_handle(self._rb))
            if self.wait_handle in (c.EBPF_HANDLE_INVALID, 0):
                raise LibbpfError(
                    errno.EINVAL, "ebpf_ring_buffer_get_wait_handle",
                    "the ring buffer has no wait handle (it is not in synchronous mode)",
                )
        except BaseException:
            self.free()
            raise

    def free(self) -> None:
        """``ring_buffer__free``: unmaps the ring and closes the wait handle. Idempotent.

        Raises BufferError, leaving everything mapped, if a view of the memory is still
        exported (the views' owner releases them first)."""
        for view in (self.consumer, self.producer, self.data):
            if view is not None:
                view.release()  # BufferError while exported: then nothing is unmapped
        self.consumer = self.producer = self.data = None
        rb, self._rb = self._rb, 0
        if rb:
            park(self._map_fd, (0,))
            c.ring_buffer__free(rb)
