"""A perf ring mapped a second time, by aperf itself, for leases (zero-copy views).

libbpf's own mapping of a ring is unmapped by ``perf_buffer__free``; a view of it
would then point at nothing. A second ``mmap`` of the ring's perf fd (the kernel
lets the same event be mapped again, same size) is a Python ``mmap.mmap``: it
stays mapped while anything exports its buffer (NumPy views of it), whatever
happens to libbpf's mapping or to the fd, and the kernel keeps the ring's pages
for as long as it is mapped.

fork: the kernel does not copy perf mappings into a child (``VM_DONTCOPY``), so
a child's views of one would fault. Before a fork every such mapping still alive
is copied; in the child, private memory with that copy is mapped at the same
address, so what the child holds keeps its bytes (a snapshot; the parent's
ring is no longer visible from the child).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import weakref

PAGE_SIZE = mmap.PAGESIZE
_PROT_RW = 0x1 | 0x2
_MAP_PRIVATE, _MAP_ANONYMOUS, _MAP_FIXED_NOREPLACE = 0x02, 0x20, 0x100000
_MAP_FAILED = ctypes.c_void_p(-1).value

# Live mappings (weakly: a mapping lives as long as its views): address and length.
_live: dict[int, tuple[weakref.ref[mmap.mmap], int, int]] = {}
_live_lock = threading.Lock()
_saved: list[tuple[int, bytes]] = []  # copies made before a fork, for the child


class SharedRingMapping:
    """One perf ring (control page + data area) mapped read-write by aperf.

    ``mapping`` is the ``mmap.mmap`` whose buffer views are made from; ``data_offset``
    and ``size`` locate the data area in it. ``head()`` reads ``data_head``;
    ``set_tail()`` stores ``data_tail`` (one aligned 8-byte store: the kernel reads it
    with ``READ_ONCE``). Both go through this mapping, so they stay harmless after
    libbpf freed the ring: the kernel keeps the pages while this mapping exists.
    """

    __slots__ = ("_head", "_tail", "data_offset", "mapping", "size")

    def __init__(self, fd: int, size: int) -> None:
        self.mapping = mmap.mmap(fd, PAGE_SIZE + size, mmap.MAP_SHARED, _PROT_RW)
        self._head = ctypes.c_uint64.from_buffer(self.mapping, 1024)
        self._tail = ctypes.c_uint64.from_buffer(self.mapping, 1032)
        data_offset, data_size = (ctypes.c_uint64 * 2).from_buffer(self.mapping, 1040)
        if data_size != size or data_offset + data_size > len(self.mapping):
            raise ValueError(f"perf ring of {data_size} bytes mapped as {size}")
        self.data_offset = int(data_offset)
        self.size = size
        _register(self.mapping)

    def head(self) -> int:
        return self._head.value

    def tail(self) -> int:
        return self._tail.value

    def set_tail(self, tail: int) -> None:
        self._tail.value = tail

    def copy(self, offset: int, length: int) -> bytes:
        """Bytes ``offset`` to ``offset + length`` of the data area, copied."""
        start = self.data_offset + offset
        return self.mapping[start : start + length]


def _address(mapping: mmap.mmap) -> int:
    probe = ctypes.c_char.from_buffer(mapping)
    try:
        return ctypes.addressof(probe)
    finally:
        del probe


def _register(mapping: mmap.mmap) -> None:
    address = _address(mapping)

    def gone(_: object, address: int = address) -> None:
        with _live_lock:
            _live.pop(address, None)

    with _live_lock:
        _live[address] = (weakref.ref(mapping, gone), len(mapping), address)


def _before_fork() -> None:
    """Copy every live mapping (views of it may be used in the child)."""
    saved = []
    with _live_lock:
        entries = list(_live.values())
    for ref, _length, address in entries:
        mapping = ref()
        if mapping is not None and not mapping.closed:
            saved.append((address, mapping[:]))
    _saved[:] = saved


def _after_fork_in_parent() -> None:
    _saved.clear()


def _after_fork_in_child() -> None:
    """Private memory holding the copy, where each perf mapping was (not inherited)."""
    saved = list(_saved)
    _saved.clear()
    if not saved:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    for address, data in saved:
        got = libc.mmap(address, len(data), _PROT_RW,
                        _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_FIXED_NOREPLACE, -1, 0)
        if got != address:
            # The range is in use (not a hole left by the perf mapping): nothing safe to
            # do for views there; the child's reads of them would fault. Never seen.
            if got not in (None, _MAP_FAILED):
                libc.munmap(ctypes.c_void_p(got), ctypes.c_size_t(len(data)))
            continue
        ctypes.memmove(address, data, len(data))


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)
