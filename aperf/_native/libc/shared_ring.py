"""A perf ring mapped again, by aperf itself, for leases (zero-copy views).

libbpf's own mapping of a ring is unmapped by ``perf_buffer__free``; a view of it
would then point at nothing. More ``mmap``s of the ring's perf fd (the kernel
lets the same event be mapped again, same size) are Python ``mmap.mmap``s: each
stays mapped while anything exports its buffer (NumPy views of it), whatever
happens to libbpf's mapping or to the fd, and the kernel keeps the ring's pages
for as long as one is mapped.

Two of them: views are made only from a read-only one. The kernel lets a
read-write mapping write its first page (``data_tail``) and kills the process
with SIGBUS on a write anywhere else; NumPy would let a user flip a view of a
read-write buffer to writable (``setflags(write=True)``), and the first write
through it would crash the interpreter. A view of a read-only mapping cannot be
made writable by any route (its buffer refuses). The read-write mapping is used
for ``data_tail`` (and ``data_head``) only, through ctypes, never exported.

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
_PROT_READ = 0x1
_PROT_RW = _PROT_READ | 0x2
_MAP_PRIVATE, _MAP_ANONYMOUS, _MAP_FIXED_NOREPLACE = 0x02, 0x20, 0x100000
_MAP_FAILED = ctypes.c_void_p(-1).value

# Live mappings (weakly: a mapping lives as long as its views): the bytes of each to
# copy for a child, its address, and its protection there.
_live: dict[int, tuple[weakref.ref[mmap.mmap], int, int, int]] = {}
_live_lock = threading.Lock()
_saved: list[tuple[int, bytes, int]] = []  # copies made before a fork, for the child


class SharedRingMapping:
    """One perf ring (control page + data area) mapped by aperf: read-only for views,
    read-write for ``data_tail``.

    ``mapping`` is the read-only ``mmap.mmap`` whose buffer views are made from (its
    buffer is read-only: no view of it can be made writable); ``data_offset`` and
    ``size`` locate the data area in it. ``head()`` reads ``data_head``;
    ``set_tail()`` stores ``data_tail`` (one aligned 8-byte store: the kernel reads it
    with ``READ_ONCE``) through a read-write mapping of the same ring that nothing
    exports. Both stay harmless after libbpf freed the ring: the kernel keeps the
    pages while a mapping exists.
    """

    __slots__ = ("_control", "_head", "_tail", "data_offset", "mapping", "size")

    def __init__(self, fd: int, size: int) -> None:
        length = PAGE_SIZE + size
        # The kernel maps a ring again only at its own size: the read-write one spans
        # the data area too, but only its first page is ever written.
        self._control = mmap.mmap(fd, length, mmap.MAP_SHARED, _PROT_RW)
        try:
            self.mapping = mmap.mmap(fd, length, access=mmap.ACCESS_READ)
        except BaseException:
            self._control.close()
            raise
        self._head = ctypes.c_uint64.from_buffer(self._control, 1024)
        self._tail = ctypes.c_uint64.from_buffer(self._control, 1032)
        data_offset, data_size = (ctypes.c_uint64 * 2).from_buffer_copy(self.mapping, 1040)
        if data_size != size or data_offset + data_size > len(self.mapping):
            raise ValueError(f"perf ring of {data_size} bytes mapped as {size}")
        self.data_offset = int(data_offset)
        self.size = size
        # A forked child gets private copies at the same addresses: of the control page
        # (a lease ended there stores a tail into it), and of the data read-only.
        _register(self._control, PAGE_SIZE, _PROT_RW)
        _register(self.mapping, length, _PROT_READ)

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


class _PyBuffer(ctypes.Structure):
    """CPython's ``Py_buffer``: where an object's buffer is (read-only ones too, which
    ctypes' ``from_buffer`` refuses)."""

    _fields_ = (
        ("buf", ctypes.c_void_p), ("obj", ctypes.c_void_p), ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p),
    )


def _address(mapping: mmap.mmap) -> int:
    view = _PyBuffer()
    ctypes.pythonapi.PyObject_GetBuffer(ctypes.py_object(mapping), ctypes.byref(view), 0)
    try:
        return int(view.buf)
    finally:
        ctypes.pythonapi.PyBuffer_Release(ctypes.byref(view))


def _register(mapping: mmap.mmap, length: int, prot: int) -> None:
    """Follow ``mapping`` across fork: its first ``length`` bytes, mapped ``prot``."""
    address = _address(mapping)

    def gone(_: object, address: int = address) -> None:
        with _live_lock:
            _live.pop(address, None)

    with _live_lock:
        _live[address] = (weakref.ref(mapping, gone), length, address, prot)


def _before_fork() -> None:
    """Copy every live mapping (views of it may be used in the child)."""
    saved = []
    with _live_lock:
        entries = list(_live.values())
    for ref, length, address, prot in entries:
        mapping = ref()
        if mapping is not None and not mapping.closed:
            saved.append((address, mapping[:length], prot))
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
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for address, data, prot in saved:
        got = libc.mmap(address, len(data), _PROT_RW,
                        _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_FIXED_NOREPLACE, -1, 0)
        if got != address:
            # The range is in use (not a hole left by the perf mapping): nothing safe to
            # do for views there; the child's reads of them would fault. Never seen.
            if got not in (None, _MAP_FAILED):
                libc.munmap(ctypes.c_void_p(got), ctypes.c_size_t(len(data)))
            continue
        ctypes.memmove(address, data, len(data))
        if prot != _PROT_RW:
            libc.mprotect(address, len(data), prot)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)
