"""Perf rings (libbpf-rs: ``perf_buffer.rs``): libbpf's ``perf_buffer`` for a perf event
array, the ring memory aperf reads itself, and flight-recorder rings opened here."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import sys
import threading
from dataclasses import dataclass

from ..._errors import ClosedResourceError, LibbpfError
from ..libc.functions import libc_function
from . import binding as c
from .log import capture_log

PERF_TYPE_SOFTWARE = 1
PERF_COUNT_SW_BPF_OUTPUT = 10
PERF_SAMPLE_RAW = 1 << 10
PERF_FORMAT_LOST = 1 << 4  # Linux 6.0+: read() on the fd reports the event's lost samples
_ATTR_WATERMARK_BIT = 1 << 14
_ATTR_WRITE_BACKWARD_BIT = 1 << 27  # perf_event_attr.write_backward (Linux 4.7+)


class _perf_event_attr(ctypes.Structure):
    _fields_ = (
        ("type", ctypes.c_uint32),
        ("size", ctypes.c_uint32),
        ("config", ctypes.c_uint64),
        ("sample_period", ctypes.c_uint64),
        ("sample_type", ctypes.c_uint64),
        ("read_format", ctypes.c_uint64),
        ("flags", ctypes.c_uint64),
        ("wakeup", ctypes.c_uint32),  # wakeup_events, or wakeup_watermark with the flag
        ("bp_type", ctypes.c_uint32),
        ("config1", ctypes.c_uint64),
        ("config2", ctypes.c_uint64),
        ("branch_sample_type", ctypes.c_uint64),
        ("sample_regs_user", ctypes.c_uint64),
        ("sample_stack_user", ctypes.c_uint32),
        ("clockid", ctypes.c_int32),
        ("sample_regs_intr", ctypes.c_uint64),
        ("aux_watermark", ctypes.c_uint32),
        ("sample_max_stack", ctypes.c_uint16),
        ("reserved_2", ctypes.c_uint16),
        ("aux_sample_size", ctypes.c_uint32),
        ("reserved_3", ctypes.c_uint32),
        ("sig_data", ctypes.c_uint64),
        ("config3", ctypes.c_uint64),
    )


class _perf_buffer_raw_opts(ctypes.Structure):
    _fields_ = (
        ("sz", ctypes.c_size_t),
        ("cpu_cnt", ctypes.c_int),
        ("cpus", ctypes.POINTER(ctypes.c_int)),
        ("map_keys", ctypes.POINTER(ctypes.c_int)),
    )


LIBBPF_PERF_EVENT_CONT = -2  # enum bpf_perf_event_ret: go on with the next record


class _Collected(threading.local):
    def __init__(self) -> None:
        self.records: list[bytes] | None = None


_collected = _Collected()


def _collect_record(ctx: int | None, cpu: int, event: int | None) -> int:
    """libbpf's raw event callback: copy the record (header and all) for the caller.

    Called only inside ``perf_buffer__consume_buffer`` on this thread, which
    reads the head with acquire and writes the tail with release semantics.
    """
    try:
        records = _collected.records
        if records is not None and event:
            size = ctypes.c_uint16.from_address(event + 6).value  # perf_event_header.size
            records.append(ctypes.string_at(event, size))
    except BaseException as exc:  # parked, re-raised by the C call's errcheck
        c.park_callback_error(exc)
        return -1  # LIBBPF_PERF_EVENT_ERROR: stop
    return LIBBPF_PERF_EVENT_CONT


_record_callback = c.PERF_EVENT_FN(_collect_record)


class RingMemory:
    """One CPU's mmapped perf ring: the control page's head/tail and the data area.

    Only whole records between ``data_tail`` and ``data_head`` are copied out;
    the tail is written after the copy, the head read before it (x86-64 TSO
    makes that ordering sufficient, see docs/rings.md).
    """

    __slots__ = ("_data", "_head", "_mapped", "_tail", "size")

    def __init__(self, base: int) -> None:
        control = (ctypes.c_uint64 * 4).from_address(base + 1024)
        data_offset, data_size = control[2], control[3]
        self._head = ctypes.c_uint64.from_address(base + 1024)
        self._tail = ctypes.c_uint64.from_address(base + 1032)
        self._data = base + data_offset
        self.size = int(data_size)
        self._mapped = True

    def positions(self) -> tuple[int, int]:
        """(head, tail): the head is read first so every byte below it is written."""
        if not self._mapped:
            raise ClosedResourceError("perf ring memory was released")
        head = self._head.value
        return head, self._tail.value

    def copy(self, offset: int, length: int) -> bytes:
        if not self._mapped:
            raise ClosedResourceError("perf ring memory was released")
        return ctypes.string_at(self._data + offset, length)

    def set_tail(self, tail: int) -> None:
        if not self._mapped:
            raise ClosedResourceError("perf ring memory was released")
        self._tail.value = tail

    def release(self) -> None:
        """Forget the mapping; called before the rings are unmapped."""
        self._mapped = False
        self._head = self._tail = None  # type: ignore[assignment]
        self._data = 0


@dataclass(frozen=True)
class RingHandle:
    cpu: int
    fd: int
    memory: RingMemory
    slot: int  # the map key whose slot holds ``fd``


def delete_slots(map_fd: int, keys: list[int]) -> None:
    """Empty these slots of a perf event array (a slot already empty is fine)."""
    for key in keys:
        try:
            c.bpf_map_delete_elem(map_fd, key.to_bytes(4, sys.byteorder))
        except LibbpfError as exc:
            if exc.errno != errno.ENOENT:
                raise


def _set_slots(map_fd: int, rings: list[RingHandle], present: bool) -> None:
    for ring in rings:
        key = ctypes.c_uint32(ring.slot)
        if present:
            value = ctypes.c_uint32(ring.fd)
            c.bpf_map_update_elem(map_fd, ctypes.byref(key), ctypes.byref(value), 0)
            continue
        try:
            c.bpf_map_delete_elem(map_fd, ctypes.byref(key))
        except LibbpfError as exc:
            if exc.errno != errno.ENOENT:  # already empty: nothing to undo
                raise


class PerfRings:
    """libbpf's ``perf_buffer`` for one map: one ring per listed CPU, in the slot of the
    same index of ``map_keys`` (default: keyed by CPU id). ``map_fd`` must stay open
    while the rings are (``set_slots`` writes through it)."""

    def __init__(
        self,
        map_fd: int,
        page_count: int,
        cpus: list[int],
        *,
        map_keys: list[int] | None = None,
        wakeup_events: int = 1,
        wakeup_watermark: int = 0,
        count_lost: bool = False,
    ) -> None:
        self._pb = 0
        self._map_fd = map_fd
        slots = cpus if map_keys is None else map_keys
        attr = _perf_event_attr()
        if count_lost:
            attr.read_format = PERF_FORMAT_LOST
        attr.size = ctypes.sizeof(attr)
        attr.type = PERF_TYPE_SOFTWARE
        attr.config = PERF_COUNT_SW_BPF_OUTPUT
        attr.sample_period = 1
        attr.sample_type = PERF_SAMPLE_RAW
        if wakeup_watermark:
            attr.flags = _ATTR_WATERMARK_BIT
            attr.wakeup = wakeup_watermark
        else:
            attr.wakeup = wakeup_events
        opts = _perf_buffer_raw_opts()
        opts.sz = ctypes.sizeof(opts)
        opts.cpu_cnt = len(cpus)
        opts.cpus = (ctypes.c_int * len(cpus))(*cpus)
        opts.map_keys = (ctypes.c_int * len(slots))(*slots)
        with capture_log() as captured:
            try:
                self._pb = int(
                    c.perf_buffer__new_raw(
                        map_fd, page_count, ctypes.byref(attr), _record_callback, None,
                        ctypes.byref(opts),
                    )
                )
            except LibbpfError as exc:
                # E.g. "failed to mmap perf buffer": the errno alone does not say which step.
                exc.log = captured.text
                said = [line for line in captured.text.splitlines() if line.strip()]
                if said and not exc.detail:
                    exc.detail = f"opening {page_count}-page rings: {said[-1].strip()}"
                raise
        try:
            self.rings = self._collect(cpus, slots)
        except BaseException:
            self.free()
            raise

    def _collect(self, cpus: list[int], slots: list[int]) -> list[RingHandle]:
        count = int(c.perf_buffer__buffer_cnt(self._pb))
        rings = []
        for index in range(count):
            base = ctypes.c_void_p()
            size = ctypes.c_size_t()
            c.perf_buffer__buffer(self._pb, index, ctypes.byref(base), ctypes.byref(size))
            fd = int(c.perf_buffer__buffer_fd(self._pb, index))
            assert base.value is not None
            rings.append(RingHandle(cpus[index], fd, RingMemory(base.value), slots[index]))
        return rings

    def set_slots(self, present: bool) -> None:
        """Put the rings' fds into their map slots, or delete them from the slots (a
        BPF program's output to an empty slot fails with -ENOENT). Idempotent."""
        if not self._pb:
            raise ClosedResourceError("perf rings were freed")
        _set_slots(self._map_fd, self.rings, present)

    def consume_records(self, index: int) -> bytes:
        """Every record of ring ``index``, copied by libbpf's own reader, which orders
        its memory accesses for any architecture; the ring space is then released."""
        if not self._pb:
            raise ClosedResourceError("perf rings were freed")
        records: list[bytes] = []
        _collected.records = records
        try:
            c.perf_buffer__consume_buffer(self._pb, index)
        finally:
            _collected.records = None
        return b"".join(records)

    def free(self) -> None:
        """Unmap the rings, close their fds and delete the map slots (idempotent)."""
        pb, self._pb = self._pb, 0
        if pb:
            for ring in getattr(self, "rings", ()):
                ring.memory.release()
            c.perf_buffer__free(pb)

    def forget_after_fork(self) -> None:
        """In a child process: close this process's copies of the ring fds and nothing
        else. The rings are not mapped here (perf mmaps are not inherited) and the map
        slots are the parent's: perf_buffer__free would delete them under it."""
        pb, self._pb = self._pb, 0
        if pb:
            for ring in getattr(self, "rings", ()):
                ring.memory.release()
                with contextlib.suppress(OSError):
                    os.close(ring.fd)


_SYS_PERF_EVENT_OPEN = {"x86_64": 298, "aarch64": 241}
_PERF_FLAG_FD_CLOEXEC = 1 << 3
_PROT_READ, _MAP_SHARED = 1, 1
_MAP_FAILED = ctypes.c_void_p(-1).value


class OverwritableRings:
    """Flight-recorder perf rings for one map: ``write_backward`` events mapped read-only,
    so the kernel overwrites the oldest records and never drops (the kernel makes a ring
    overwritable when its mmap is not writable; libbpf maps rings writable, so these are
    opened here, as cilium/ebpf's ``Overwritable`` rings are). Same members as
    ``PerfRings`` for what a source uses: ``rings``, ``set_slots``, ``free``."""

    def __init__(
        self, map_fd: int, page_count: int, cpus: list[int], *, map_keys: list[int] | None = None,
    ) -> None:
        self._map_fd = map_fd
        self._length = (page_count + 1) * os.sysconf("SC_PAGE_SIZE")
        self._mapped: list[int] = []
        self.rings: list[RingHandle] = []
        self._open = True
        slots = cpus if map_keys is None else map_keys
        try:
            for cpu, slot in zip(cpus, slots, strict=True):
                fd = self._event_fd(cpu)
                try:
                    base = self._map(fd)
                except BaseException:
                    os.close(fd)
                    raise
                self._mapped.append(base)
                self.rings.append(RingHandle(cpu, fd, RingMemory(base), slot))
            _set_slots(map_fd, self.rings, True)
        except BaseException:
            self.free()
            raise

    @staticmethod
    def _event_fd(cpu: int) -> int:
        number = _SYS_PERF_EVENT_OPEN.get(os.uname().machine)
        if number is None:
            raise LibbpfError(errno.ENOSYS, "perf_event_open",
                              detail=f"no syscall number known for {os.uname().machine}")
        attr = _perf_event_attr()
        attr.size = ctypes.sizeof(attr)
        attr.type = PERF_TYPE_SOFTWARE
        attr.config = PERF_COUNT_SW_BPF_OUTPUT
        attr.sample_period = 1
        attr.sample_type = PERF_SAMPLE_RAW
        # Nobody reads these rings on wakeups: ask for as few as the kernel allows.
        attr.flags = _ATTR_WRITE_BACKWARD_BIT | _ATTR_WATERMARK_BIT
        attr.wakeup = 1 << 31
        syscall = libc_function("syscall", ctypes.c_long, ctypes.c_long, ctypes.c_void_p,
                                ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_ulong)
        fd = int(syscall(number, ctypes.byref(attr), -1, cpu, -1, _PERF_FLAG_FD_CLOEXEC))
        if fd < 0:
            raise LibbpfError(ctypes.get_errno(), "perf_event_open",
                              detail=f"an overwritable ring on CPU {cpu}")
        return fd

    def _map(self, fd: int) -> int:
        mmap = libc_function("mmap", ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                             ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
        base = mmap(None, self._length, _PROT_READ, _MAP_SHARED, fd, 0)
        if base is None or base == _MAP_FAILED:
            raise LibbpfError(ctypes.get_errno(), "mmap",
                              detail=f"mapping a {self._length}-byte overwritable ring")
        return int(base)

    def set_slots(self, present: bool) -> None:
        """As ``PerfRings.set_slots``."""
        if not self._open:
            raise ClosedResourceError("perf rings were freed")
        _set_slots(self._map_fd, self.rings, present)

    def free(self) -> None:
        """Delete the map slots, unmap the rings, close their fds (idempotent)."""
        if not self._open:
            return
        self._open = False
        try:
            # As perf_buffer__free, errors ignored: a map given up (taken over) has its
            # fd pointed at /dev/null, so that the taker's slots stay.
            with contextlib.suppress(LibbpfError):
                delete_slots(self._map_fd, [ring.slot for ring in self.rings])
        finally:
            munmap = libc_function("munmap", ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t)
            for ring, base in zip(self.rings, self._mapped, strict=False):
                ring.memory.release()
                munmap(ctypes.c_void_p(base), self._length)
            for ring in self.rings:
                os.close(ring.fd)
            self._mapped = []

    def forget_after_fork(self) -> None:
        """In a child process: close this process's copies of the fds only."""
        if self._open:
            self._open = False
            for ring in self.rings:
                ring.memory.release()
                with contextlib.suppress(OSError):
                    os.close(ring.fd)
