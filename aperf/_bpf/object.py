"""BPF objects: open a ``.bpf.o``, set ``const volatile`` globals, load, attach, close.

Closing is safe from any thread. Every call that reaches libbpf or the kernel
runs inside ``_guarded``: it registers itself on the object's ``_Handle`` (a
list append, atomic under the GIL; no lock per call), then checks the handle is
not closing. ``close()`` marks the handle closing first, then waits for the
calls already in flight before it frees anything; a call that starts later
raises ``ClosedResourceError``. So no call reads freed memory or a reused fd.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import mmap
import os
import stat
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any, Literal, TypeVar, cast

from .._decoding.decode import SizedDecoder
from .._errors import (
    ArgumentError,
    ClosedResourceError,
    GlobalValueError,
    LibbpfError,
    MissingPrivilegesError,
    ObjectFileError,
    ObjectStateError,
    UnknownNameError,
    UnsupportedError,
    VerifierError,
)
from .._log import log
from .._native import libbpf as lb
from .btf import GlobalSlot, btf_decoder, global_decoder, global_slot, global_slots
from .header import BUFFER_DROPS, BUFFER_MARK, RINGS_DROPS, RINGS_MARK

_V = TypeVar("_V")
_F = TypeVar("_F", bound=Callable[..., Any])
_CLOSE_POLL = 0.0002  # seconds between looks at the calls a close waits for (each is short)


BufferChoice = Literal["auto", "ringbuf", "perf"]
"""What ``BPFObject(path, buffer=...)`` makes of the buffers of ``<aperf/buffer.bpf.h>``."""
BUFFER_CHOICES = ("auto", "ringbuf", "perf")
BPF_MAP_TYPE_PERF_EVENT_ARRAY = 4
BPF_MAP_TYPE_ARRAY_OF_MAPS = 12
BPF_MAP_TYPE_RINGBUF = 27
BPF_F_MMAPABLE = 1 << 10
_WORDS: dict[int, Literal["B", "H", "I", "Q"]] = {1: "B", 2: "H", 4: "I", 8: "Q"}


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "(libbpf printed nothing)"


class _NameTable(Mapping[str, _V]):
    """A read-only name -> item mapping whose misses raise ``UnknownNameError``.

    That error is a KeyError, so ``in`` and ``.get()`` answer False / None.
    """

    def __init__(self, kind: str, items: dict[str, _V]) -> None:
        self._kind = kind
        self._items = items

    def __getitem__(self, name: str) -> _V:
        try:
            return self._items[name]
        except KeyError:
            raise UnknownNameError(self._kind, name, list(self._items)) from None

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"<{self._kind}s {', '.join(self._items)}>"


class _Handle:
    """The libbpf object and the links made from its programs: freed once, links first.

    Shared by the ``BPFObject`` and its finalizer, which must not hold the object.
    ``calls`` holds a token (a bare ``object()``) for each call in flight on the
    object, its maps, programs or links; ``closing`` turns true when a close
    begins, before it waits for the calls that were already in flight.
    """

    __slots__ = ("calls", "closing", "links", "lock", "pending", "ptr", "release")

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr
        self.links: set[int] = set()
        self.calls: list[object] = []
        self.closing = not ptr
        self.lock = threading.Lock()  # taken by closes and detaches, never per call
        self.release: Callable[[], None] | None = None
        self.pending: set[object] = set()

    def begin_close(self) -> list[object] | None:
        """Mark the handle closing and return the calls that may be inside libbpf now
        (a call that starts later sees ``closing``); None if another close began first."""
        with self.lock:
            if self.closing:
                return None
            self.closing = True
            return list(self.calls)

    def run_after(self, inflight: list[object], release: Callable[[], None]) -> None:
        """Run ``release`` once every call of ``inflight`` has ended (now, or by the last
        of them to end): for a close from inside a call of its own thread (a signal
        handler), which cannot wait for that call."""
        with self.lock:
            self.pending = {call for call in inflight if call in self.calls}
            if self.pending:
                self.release = release
                return
        release()

    def leave(self, call: object) -> None:
        self.calls.remove(call)
        if self.release is not None:
            with self.lock:
                self.pending.discard(call)
                release = None
                if not self.pending:
                    release, self.release = self.release, None
            if release is not None:
                release()

    def free(self) -> None:
        self.closing = True
        ptr, self.ptr = self.ptr, 0
        links, self.links = self.links, set()
        failure: LibbpfError | None = None
        for link in links:
            try:
                lb.bpf_link__destroy(link)  # frees the link even when detaching fails
            except LibbpfError as exc:
                failure = failure or exc
        if ptr:
            lb.bpf_object__close(ptr)
        if failure is not None:
            raise failure


def _guarded(method: _F) -> _F:
    """Run ``method`` as a call in flight on its object (see the module docstring)."""

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        handle: _Handle = self._guard
        token = object()
        handle.calls.append(token)  # before the check: a close that missed it waits for it
        try:
            if handle.closing:
                self._check_open()  # raises the object's, map's or program's message
            return method(self, *args, **kwargs)
        finally:
            handle.leave(token)

    return cast(_F, call)


_GUARD_CODE = _guarded(lambda self: None).__code__


def _inside_a_call(handle: _Handle) -> bool:
    """Whether this thread is inside a guarded call on ``handle`` (a signal handler
    closing the object it interrupted): found on the stack, so calls pay nothing."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _GUARD_CODE and frame.f_locals.get("handle") is handle:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _release_guarded(method: _F) -> _F:
    """As ``_guarded``, for a release (``detach``): a no-op once the object is closing."""
    guarded = _guarded(method)

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> None:
        if not self._guard.closing:
            with contextlib.suppress(ClosedResourceError):  # closed meanwhile: released
                guarded(self, *args, **kwargs)

    return cast(_F, call)


def _encode_global(name: str, slot: GlobalSlot, value: object) -> bytes:
    """``value`` as global ``name``'s bytes: an int checked against its size and
    signedness, or bytes no longer than it (zero-padded)."""
    if isinstance(value, bool | int) and slot.is_int:
        try:
            return int(value).to_bytes(slot.size, "little", signed=slot.signed)
        except OverflowError:
            kind = "signed" if slot.signed else "unsigned"
            raise GlobalValueError(
                f"{value!r} does not fit global {name!r} ({kind} {slot.size * 8}-bit)"
            ) from None
    if isinstance(value, bytes | bytearray):
        if len(value) > slot.size:
            raise GlobalValueError(
                f"{len(value)} bytes do not fit global {name!r} ({slot.size} bytes)"
            )
        return bytes(value).ljust(slot.size, b"\0")
    raise GlobalValueError(
        f"global {name!r} takes {'an int' if slot.is_int else 'bytes'}, "
        f"not {type(value).__name__}"
    )


def _check_max_entries(max_entries: object) -> None:
    if isinstance(max_entries, bool) or not isinstance(max_entries, int):
        raise TypeError(f"max_entries must be an int, not {type(max_entries).__name__}")
    if not 0 < max_entries < 1 << 32:
        raise ArgumentError("max_entries", f"max_entries must be in 1..2**32-1, not "
                            f"{max_entries!r}")


class SectionMemory:
    """A global-data section's map (``.data``, ``.bss``, ``.rodata``) mapped into this
    process: the globals' live bytes, shared with the programs (what a libbpf
    skeleton's ``skel->bss`` points at). ``.rodata`` is frozen at load: mapped read-only.

    The mapping holds the map: it stays valid after the object closes, until ``close``.
    An aligned integer of 1, 2, 4 or 8 bytes is read and written in one access.
    """

    def __init__(self, fd: int, name: str, writable: bool) -> None:
        info = lb.map_info(fd)
        if not info.flags & BPF_F_MMAPABLE:
            raise UnsupportedError(
                f"map {name!r} cannot be mapped (no BPF_F_MMAPABLE: Linux 5.5+ and libbpf "
                "make global data mappable); its globals' live values cannot be read"
            )
        self.name = name
        self.size = info.value_size
        self.writable = writable
        length = max(mmap.PAGESIZE, -(-self.size // mmap.PAGESIZE) * mmap.PAGESIZE)
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        self._mmap: mmap.mmap | None = mmap.mmap(fd, length, mmap.MAP_SHARED, prot)

    def _memory(self, offset: int, size: int) -> mmap.mmap:
        if self._mmap is None:
            raise ClosedResourceError(f"the mapping of map {self.name!r} is closed")
        if offset < 0 or size < 0 or offset + size > self.size:
            raise ObjectStateError(
                f"bytes {offset}..{offset + size} lie outside map {self.name!r} "
                f"({self.size} bytes)"
            )
        return self._mmap

    def read(self, offset: int, size: int) -> bytes:
        memory = self._memory(offset, size)
        word = _WORDS.get(size)
        if word is None or offset % size:
            return memory[offset : offset + size]
        with memoryview(memory) as view, view[offset : offset + size].cast(word) as cell:
            return int(cell[0]).to_bytes(size, "little")

    def write(self, offset: int, data: bytes) -> None:
        memory = self._memory(offset, len(data))
        if not self.writable:
            raise ObjectStateError(f"map {self.name!r} is read-only")
        word = _WORDS.get(len(data))
        if word is None or offset % len(data):
            memory[offset : offset + len(data)] = data
            return
        with memoryview(memory) as view, view[offset : offset + len(data)].cast(word) as cell:
            cell[0] = int.from_bytes(data, "little")

    def close(self) -> None:
        mapping, self._mmap = self._mmap, None
        if mapping is not None:
            mapping.close()


class DropCounter:
    """The drops that ``<aperf/buffer.bpf.h>`` counts for one map, read live from its own
    mapping of ``.bss`` (valid after the object closes, until ``close``): ``count()`` for
    a buffer, ``count(index)`` for a ring of a per-CPU ring buffer map."""

    def __init__(self, memory: SectionMemory, slot: GlobalSlot, global_name: str) -> None:
        self._memory = memory
        self._offset = slot.offset
        self.slots = slot.size // 8
        self.name = global_name

    def count(self, index: int = 0) -> int:
        if not 0 <= index < self.slots:
            raise IndexError(f"{self.name} counts {self.slots} ring(s), not ring {index}")
        return int.from_bytes(self._memory.read(self._offset + 8 * index, 8), "little")

    def close(self) -> None:
        self._memory.close()


class _Part:
    """A map or program: memory inside a ``BPFObject``, freed when that object closes.

    Every C call takes the pointer from ``_ptr``, which refuses once the
    object is closed: one guard instead of a check in each accessor.
    """

    _kind = "part"

    def __init__(self, owner: BPFObject, ptr: int, name: str) -> None:
        self._owner = owner
        self._guard = owner._handle
        self._raw = ptr
        self.name = name

    def _check_open(self) -> None:
        if self._guard.closing:
            raise ClosedResourceError(
                f"{self._kind} {self.name!r} belongs to BPF object {self._owner.path!r}, "
                "which is closed"
            )

    @property
    def _ptr(self) -> int:
        self._check_open()
        return self._raw

    def _state(self) -> str:
        return " (closed)" if self._owner.closed else ""


class Map(_Part):
    """A map of a [`BPFObject`][aperf.BPFObject]. ``fd`` is valid from load until the object closes.

    After the object closes, everything but ``name``, ``closed`` and ``object``
    raises [`ClosedResourceError`][aperf.ClosedResourceError].
    """

    _kind = "map"

    def __init__(self, owner: BPFObject, ptr: int) -> None:
        super().__init__(owner, ptr, lb.cstr(lb.bpf_map__name(ptr)))
        self._layout: lb.MapLayout | None = None  # known once loaded, fixed from then on

    @property
    @_guarded
    def type(self) -> int:
        """The map type (``BPF_MAP_TYPE_*``)."""
        return int(lb.bpf_map__type(self._ptr))

    @property
    @_guarded
    def fd(self) -> int:
        """The map's fd (valid from load until the object closes)."""
        return self._fd()

    def _fd(self) -> int:  # inside a guarded call
        fd = int(lb.bpf_map__fd(self._ptr))
        if fd < 0:
            raise ObjectStateError(f"map {self.name!r} has no fd before the object is loaded")
        return fd

    @property
    @_guarded
    def max_entries(self) -> int:
        """How many entries the map holds (for a perf event array: CPU slots)."""
        return int(lb.bpf_map__max_entries(self._ptr))

    @_guarded
    def set_max_entries(self, max_entries: int) -> None:
        """Size the map before its object is loaded (a ring buffer: its bytes, a power of
        two of at least a page)."""
        _check_max_entries(max_entries)
        ptr = self._ptr  # ClosedResourceError once the object is closed
        if self._owner.loaded:
            raise ObjectStateError(f"map {self.name!r}: set_max_entries before load()")
        lb.bpf_map__set_max_entries(ptr, max_entries)

    @_guarded
    def set_inner_max_entries(self, max_entries: int) -> None:
        """Size the rings the loader makes for a per-CPU ring buffer map
        (``APERF_RINGBUF_PER_CPU`` of ``<aperf/buffer.bpf.h>``), before load: the bytes
        of each CPU's ring buffer (a power of two of at least a page). The kernel
        does not hold a map of maps' ring buffers to its inner map's size."""
        _check_max_entries(max_entries)
        self._check_open()
        if self._owner.loaded:
            raise ObjectStateError(f"map {self.name!r}: set_inner_max_entries before load()")
        if self.name not in self._owner._ring_arrays:
            raise ObjectStateError(
                f"map {self.name!r} is not a per-CPU ring buffer map of <aperf/buffer.bpf.h> "
                "(APERF_RINGBUF_PER_CPU), whose rings the loader makes; libbpf 1.1 cannot "
                "resize another map's inner map"
            )
        self._owner._ring_bytes[self.name] = max_entries

    @property
    @_guarded
    def key_size(self) -> int:
        """Bytes of one key (0 for queues and stacks)."""
        return int(lb.bpf_map__key_size(self._ptr))

    @property
    @_guarded
    def value_size(self) -> int:
        """Bytes of one value (per-CPU maps: of one CPU's value)."""
        return int(lb.bpf_map__value_size(self._ptr))

    @property
    def closed(self) -> bool:
        """Whether the map's object is closed (the map with it)."""
        return self._owner.closed

    @property
    def per_cpu(self) -> bool:
        """Whether each value holds one slot per possible CPU (the per-CPU map types)."""
        return self.type in lb.PER_CPU_MAP_TYPES

    def _element(self) -> tuple[int, lb.MapLayout]:  # inside a guarded call
        fd = self._fd()
        if self._layout is None:
            self._layout = lb.MapLayout.of(
                repr(self.name), self.type, self.key_size, self.value_size
            )
        return fd, self._layout

    @_guarded
    def lookup(self, key: bytes | bytearray | memoryview) -> bytes:
        """The value stored under ``key`` (per-CPU maps: one 8-byte-aligned slot per CPU).

        ``key`` must be exactly ``key_size`` bytes, else [`ArgumentError`][aperf.ArgumentError].
        """
        fd, layout = self._element()
        return lb.map_lookup(fd, key, layout=layout)

    @_guarded
    def update(
        self, key: bytes | bytearray | memoryview, value: bytes | bytearray | memoryview,
        flags: int = 0,
    ) -> None:
        """Store ``value`` under ``key``, both of exactly the map's sizes.

        ``key`` is ``key_size`` bytes, ``value`` is ``value_size`` bytes (per-CPU
        maps: a value for every possible CPU, each padded to 8 bytes); anything
        else raises [`ArgumentError`][aperf.ArgumentError] before the kernel reads our memory.

        ``flags``: 0 (``BPF_ANY``), 1 (``BPF_NOEXIST``), 2 (``BPF_EXIST``),
        optionally ``| 4`` (``BPF_F_LOCK``). Anything else: [`ArgumentError`][aperf.ArgumentError].
        """
        fd, layout = self._element()
        lb.map_update(fd, key, value, flags, layout=layout)

    @_guarded
    def pin(self, path: str | os.PathLike[str]) -> None:
        """Pin the map in bpffs (``/sys/fs/bpf/...``) so that other processes can open it.

        The directory must exist. [`PinnedPathError`][aperf.PinnedPathError] if ``path`` is taken
        or not on a BPF filesystem; a failed pin leaves nothing behind.
        """
        fd = self._fd()
        lb.pin_object(fd, lb.c_path(path, "path"))

    @_guarded
    def unpin(self, path: str | os.PathLike[str]) -> None:
        """Remove this map's pin at ``path``; a pin of anything else there is left alone."""
        fd = self._fd()
        lb.unpin_object(fd, lb.c_path(path, "path"), f"map {self.name!r}")

    @property
    def object(self) -> BPFObject:
        """The BPF object the map belongs to."""
        return self._owner

    @_guarded
    def _drop_counter(self) -> DropCounter | None:
        """The drops ``<aperf/buffer.bpf.h>`` counts for this map (a ring buffer's, or each
        ring's of a per-CPU ring buffer map), on a mapping of its own; None if the
        program keeps no such count."""
        return self._owner._drop_counter(self.name)

    def __repr__(self) -> str:
        return f"<aperf.Map {self.name!r}{self._state()}>"


class Link:
    """An attachment of a program to its hook; ``detach()`` (idempotent) removes it.

    ``attached`` raises [`ClosedResourceError`][aperf.ClosedResourceError] once the object is closed
    (closing detached it); ``detach()`` stays a harmless no-op.
    """

    def __init__(self, program: Program, ptr: int) -> None:
        self.program = program
        self._guard = program._guard
        self._raw = ptr

    def _check_open(self) -> None:
        self.program._check_open()

    @property
    def _ptr(self) -> int:
        """The libbpf link, 0 once detached."""
        self.program._check_open()
        return self._raw

    @property
    def attached(self) -> bool:
        """Whether the link still attaches its program (False once detached)."""
        return bool(self._ptr)

    @_release_guarded
    def detach(self) -> None:
        """Remove the attachment (idempotent)."""
        self._destroy()

    def _destroy(self) -> None:
        with self._guard.lock:  # two threads detaching one link destroy it once
            ptr, self._raw = self._raw, 0
            if ptr:
                self.program._links.remove(self)
                self._guard.links.discard(ptr)
        if ptr:
            lb.bpf_link__destroy(ptr)

    def __enter__(self) -> Link:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def __repr__(self) -> str:
        state = "detached" if not self._raw else "attached"
        return f"<aperf.Link of {self.program.name!r} {state}>"


class Program(_Part):
    """A program of a [`BPFObject`][aperf.BPFObject].

    After the object closes, everything but ``name``, ``section``, ``closed``
    and the no-op ``detach()`` raises [`ClosedResourceError`][aperf.ClosedResourceError].
    """

    _kind = "program"

    def __init__(self, owner: BPFObject, ptr: int) -> None:
        super().__init__(owner, ptr, lb.cstr(lb.bpf_program__name(ptr)))
        self._links: list[Link] = []
        self.section: str = lb.cstr(lb.bpf_program__section_name(ptr))

    @property
    @_guarded
    def type(self) -> int:
        """The program type (``BPF_PROG_TYPE_*``)."""
        return int(lb.bpf_program__type(self._ptr))

    @property
    @_guarded
    def fd(self) -> int:
        """The program's fd (valid from load until the object closes)."""
        fd = int(lb.bpf_program__fd(self._ptr))
        if fd < 0:
            raise ObjectStateError(f"program {self.name!r} has no fd before the object is loaded")
        return fd

    @property
    def closed(self) -> bool:
        """Whether the program's object is closed (the program with it)."""
        return self._owner.closed

    @property
    def links(self) -> tuple[Link, ...]:
        """The attachments made through attach() and not yet detached."""
        self._check_open()
        return tuple(self._links)

    @_guarded
    def attach(self) -> Link:
        """Attach to the hook named by the program's section (e.g. ``tp/sched/...``)."""
        ptr = self._ptr
        if not self._owner.loaded:
            raise ObjectStateError(f"load the object before attaching program {self.name!r}")
        with lb.capture_log() as captured:
            try:
                link_ptr = lb.attach_program(ptr)
            except LibbpfError as exc:
                exc.log = captured.text
                exc.detail = f"attaching {self.name!r} ({self.section}): {_last_line(exc.log)}"
                if exc.errno == errno.ENOENT and self.section.startswith(("tp/", "tracepoint/")):
                    exc.detail += " (is tracefs mounted at /sys/kernel/tracing?)"
                raise
        self._owner._handle.links.add(link_ptr)
        link = Link(self, link_ptr)
        self._links.append(link)
        return link

    @_release_guarded
    def detach(self) -> None:
        """Remove every attachment made through [`attach()`][aperf.Program.attach]."""
        self._detach_all()

    @_guarded
    def test_run(self, *, cpu: int | None = None) -> int:
        """Run the program once through ``BPF_PROG_TEST_RUN``, with no input, and return
        its return value: a ``raw_tp`` program (as
        [`aperf.testing.Producer`][aperf.testing.Producer]'s), on ``cpu`` (None: the
        calling thread's CPU). Blocks the calling thread, not others, while it runs; the
        object cannot close under it (a close waits for the run to end).
        """
        if cpu is not None and (isinstance(cpu, bool) or not isinstance(cpu, int)):
            raise TypeError(f"cpu must be an int or None, not {type(cpu).__name__}")
        if cpu is not None and cpu < 0:
            raise ArgumentError("cpu", f"cpu={cpu}: a CPU id is 0 or more")
        if not self._owner.loaded:
            raise ObjectStateError(f"load the object before running program {self.name!r}")
        return lb.test_run_on_cpu(self.fd, cpu)

    def _detach_all(self) -> None:
        for link in list(self._links):
            link._destroy()

    def __repr__(self) -> str:
        return f"<aperf.Program {self.name!r} section={self.section!r}{self._state()}>"


class Globals(MutableMapping[str, Any]):
    """``BPFObject.globals``: the object's globals by name, read and written live."""

    def __init__(self, owner: BPFObject) -> None:
        self._owner = owner

    def __getitem__(self, name: str) -> Any:
        return self._owner.read_global(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self._owner.write_global(name, value)

    def __delitem__(self, name: str) -> None:
        raise TypeError("a global cannot be deleted")

    def __iter__(self) -> Iterator[str]:
        return iter(self._owner._global_names())

    def __len__(self) -> int:
        return len(self._owner._global_names())

    def __repr__(self) -> str:
        return f"<globals of {self._owner!r}>"


class BPFObject:
    """A compiled BPF object file: open, set globals, load, attach, close (exactly once).

    Use it as a context manager; closing detaches every program and releases every fd.

    ``buffer`` picks the type of the buffers the program declares with
    ``APERF_BUFFER`` (``#include <aperf/buffer.bpf.h>``, docs/own-program.md) before
    anything is loaded: ``"ringbuf"`` (a BPF ring buffer), ``"perf"`` (a perf event
    array, a ring per CPU) or ``"auto"`` (a ring buffer where the kernel has them,
    Linux 5.8+, else a perf event array). None (the default) leaves every map as the
    object declares it. [`buffer`][aperf.BPFObject.buffer] says what it became;
    ``PerfStream(obj.maps[name])`` reads either.
    """

    def __init__(
        self, path: str | os.PathLike[str], *, buffer: BufferChoice | None = None
    ) -> None:
        if buffer is not None and buffer not in BUFFER_CHOICES:
            raise ArgumentError(
                "buffer", f"buffer={buffer!r}: use 'auto', 'ringbuf', 'perf' or None"
            )
        self._handle = self._guard = _Handle(0)
        self._loaded = False
        self._sections: dict[str, SectionMemory] = {}
        self._sections_lock = threading.Lock()
        self._decoders: dict[str, SizedDecoder] = {}
        self._buffers: list[str] = []  # APERF_BUFFER maps
        self._ring_arrays: list[str] = []  # APERF_RINGBUF_PER_CPU maps
        self._ring_bytes: dict[str, int] = {}  # their rings' size, if set before load
        self._maps: _NameTable[Map] = _NameTable("map", {})
        self._programs: _NameTable[Program] = _NameTable("program", {})
        raw = lb.c_path(path, "path")
        self.path = os.fsdecode(raw)
        self._check_regular_file()
        with lb.capture_log() as captured:
            try:
                ptr = lb.open_object(raw)
            except LibbpfError as exc:
                assert exc.errno is not None
                reason = _last_line(captured.text) if captured.text.strip() else exc.strerror
                error = ObjectFileError(
                    self.path, exc.errno, exc.function,
                    f"not a loadable ELF BPF object: {reason}", exc.strerror,
                )
                error.log = captured.text
                raise error from None
        self._handle = self._guard = _Handle(ptr)
        self._finalizer = weakref.finalize(self, self._handle.free)
        try:
            self.name: str = lb.cstr(lb.bpf_object__name(ptr))
            self._maps = _NameTable("map", {m.name: m for m in self._collect_maps()})
            programs = [Program(self, p) for p in lb.iter_programs(ptr)]
            self._programs = _NameTable("program", {p.name: p for p in programs})
            self._buffers = self._marked(BUFFER_MARK, (BPF_MAP_TYPE_RINGBUF,))
            self._ring_arrays = self._marked(RINGS_MARK, (BPF_MAP_TYPE_ARRAY_OF_MAPS,))
            if buffer is not None:
                self._choose_buffer(buffer)
        except BaseException:
            self.close()
            raise

    def _marked(self, mark: str, types: tuple[int, ...]) -> list[str]:
        """The maps ``<aperf/buffer.bpf.h>`` declared, found by the globals it puts beside
        them (a global ``mark + name`` in ``.rodata``), as opened (of ``types``)."""
        names = []
        for name, slot in global_slots(self._btf()).items():
            if not name.startswith(mark) or slot.section != ".rodata":
                continue
            map_name = name.removeprefix(mark)
            if map_name not in self._maps or self._maps[map_name].type not in types:
                raise ObjectFileError(
                    self.path, errno.EINVAL, "bpf_object__open_file",
                    f"global {name!r} marks map {map_name!r} as declared by "
                    "<aperf/buffer.bpf.h>, but the object has no such map of that type",
                )
            names.append(map_name)
        return names

    def _choose_buffer(self, buffer: BufferChoice) -> None:
        if not self._buffers:
            raise ArgumentError(
                "buffer", f"buffer={buffer!r}: {self.path!r} declares no buffer to choose a "
                "type for (APERF_BUFFER from <aperf/buffer.bpf.h>, docs/own-program.md)"
            )
        ringbuf = buffer == "ringbuf" or (
            buffer == "auto" and lb.map_type_supported(BPF_MAP_TYPE_RINGBUF)
        )
        for name in self._buffers:
            if not ringbuf:  # no key or value for a ring buffer, 4 bytes each for perf
                lb.retype_map(self._maps[name]._ptr, BPF_MAP_TYPE_PERF_EVENT_ARRAY, 4, 4, 0)
            self._set_global_unguarded(BUFFER_MARK + name, int(ringbuf))
        log.debug("bpf object buffers", path=self.path, buffer=buffer,
                  chosen="ringbuf" if ringbuf else "perf", maps=",".join(self._buffers))

    @property
    def buffer(self) -> Literal["ringbuf", "perf"] | None:
        """What the program's ``APERF_BUFFER`` maps are: ``"ringbuf"`` or ``"perf"``
        (chosen by ``buffer=``, else as declared: a ring buffer); None if it has none."""
        self._check_open()
        if not self._buffers:
            return None
        first = self._maps[self._buffers[0]]
        return "ringbuf" if first.type == BPF_MAP_TYPE_RINGBUF else "perf"

    def _check_regular_file(self) -> None:
        # libbpf 1.1 leaks its fd when libelf refuses what it opened (a
        # directory), and blocks for ever opening a FIFO: only regular files go in.
        try:
            st = os.stat(self.path)
        except OSError as exc:
            assert exc.errno is not None
            reason = "no such file" if exc.errno == errno.ENOENT else exc.strerror
            raise ObjectFileError(
                self.path, exc.errno, "bpf_object__open_file", str(reason)
            ) from None
        if not stat.S_ISREG(st.st_mode):
            is_dir = stat.S_ISDIR(st.st_mode)
            raise ObjectFileError(
                self.path, errno.EISDIR if is_dir else errno.EINVAL, "bpf_object__open_file",
                f"{'a directory' if is_dir else 'not a regular file'}, not a BPF object file",
            )

    def _collect_maps(self) -> list[Map]:
        return [Map(self, ptr) for ptr in lb.iter_maps(self._ptr)]

    # --- state -------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether the object was closed (its maps, programs and links with it)."""
        return self._handle.closing

    @property
    def loaded(self) -> bool:
        """Whether load() succeeded."""
        return self._loaded

    def _check_open(self) -> None:
        if self._handle.closing:
            raise ClosedResourceError(f"BPF object {self.path!r} is closed")

    @property
    def _ptr(self) -> int:
        """The libbpf object; every C call takes it from here, so none runs after close."""
        self._check_open()
        return self._handle.ptr

    @property
    def maps(self) -> Mapping[str, Map]:
        """The object's maps by name (a read-only Mapping; a miss raises UnknownNameError)."""
        return self._maps

    @property
    def programs(self) -> Mapping[str, Program]:
        """The object's programs by name (a read-only Mapping)."""
        return self._programs

    # --- globals -------------------------------------------------------------------

    @_guarded
    def btf(self) -> lb.Btf | None:
        """The object's BTF handle, or None if it has none (aperf's internal type, for
        [`aperf.decoders.from_btf`][aperf.decoders.from_btf]; owned by the object: valid
        until it closes)."""
        return self._btf()

    def _btf(self) -> lb.Btf | None:  # inside a guarded call
        return lb.object_btf(self._ptr)

    @_guarded
    def _btf_decoder(self, type_name: str) -> SizedDecoder:
        """``aperf.decoders.from_btf``'s work, as one call: the BTF stays valid meanwhile."""
        return btf_decoder(self._btf(), type_name, self.path)

    def _section_map(self, section: str) -> Map:
        for m in self._maps.values():
            if m.name.endswith(section):
                return m
        raise UnknownNameError("map", f"*{section}", list(self._maps))

    def _section_image(self, name: str, slot: GlobalSlot) -> tuple[Map, bytes]:
        """The map holding ``slot`` and its current bytes, which must contain the slot."""
        section_map = self._section_map(slot.section)
        current = lb.map_initial_value(section_map._ptr)
        if current is None:
            raise ObjectStateError(f"map {section_map.name!r} has no initial value to edit")
        if slot.offset + slot.size > len(current):  # BTF that disagrees with the ELF section
            raise ObjectStateError(
                f"the BTF of {self.path!r} puts global {name!r} at bytes "
                f"{slot.offset}..{slot.offset + slot.size}, past the end of {slot.section} "
                f"({len(current)} bytes)"
            )
        return section_map, current

    @_guarded
    def set_global(self, name: str, value: int | bool | bytes) -> None:
        """Set a global (``const volatile`` in ``.rodata``, or ``.data``/``.bss``) before load.

        Integers are checked against the variable's size and signedness; bytes
        must not be longer than the variable (shorter values are zero-padded).
        After load, [`write_global`][aperf.BPFObject.write_global] changes a
        ``.data``/``.bss`` global the programs see.
        """
        self._set_global_unguarded(name, value)

    def _set_global_unguarded(self, name: str, value: int | bool | bytes) -> None:
        self._check_open()
        if self._loaded:
            raise ObjectStateError(
                f"set_global({name!r}) after load: globals are frozen into the program at load "
                "time (write_global() changes a .data or .bss global the programs see)"
            )
        slot = global_slot(self._btf(), name)
        section_map, current = self._section_image(name, slot)
        image = bytearray(current)
        image[slot.offset : slot.offset + slot.size] = _encode_global(name, slot, value)
        lb.set_map_initial_value(section_map._ptr, bytes(image))

    @_guarded
    def get_global(self, name: str) -> int | bytes:
        """The value a global will have (before load) or was loaded with (after load).

        After load this is the value libbpf handed the kernel, not what the programs
        have made of it since: [`read_global`][aperf.BPFObject.read_global] reads the
        current value. Integers come as ``int``, anything else as its bytes.
        """
        self._check_open()
        slot = global_slot(self._btf(), name)
        _, current = self._section_image(name, slot)
        raw = current[slot.offset : slot.offset + slot.size]
        return int.from_bytes(raw, "little", signed=slot.signed) if slot.is_int else raw

    # --- live globals: the section maps, mapped -------------------------------------

    @_guarded
    def read_global(self, name: str) -> Any:
        """A global's current value, decoded with the object's BTF.

        After load it is read from the section's map, as the programs see it now (a
        counter they keep, a value [`write_global`][aperf.BPFObject.write_global]
        set); before load, the value it will be loaded with. Integers come as
        ``int``, ``bool`` as ``bool``, enums as their ``IntEnum``, structs, arrays and
        ``char`` arrays as a sample's fields would (docs/decoding.md).
        """
        slot = global_slot(self._btf(), name)
        if self._loaded:
            raw = self._section_memory(slot.section).read(slot.offset, slot.size)
        else:
            _, image = self._section_image(name, slot)
            raw = image[slot.offset : slot.offset + slot.size]
        decoder = self._decoders.get(name)
        if decoder is None:
            btf = self._btf()
            assert btf is not None  # global_slot found the global in it
            decoder = self._decoders[name] = global_decoder(btf, name, slot)
        return decoder(raw)[0]

    @_guarded
    def write_global(self, name: str, value: int | bool | bytes) -> None:
        """Change a ``.data`` or ``.bss`` global: the programs see the new value at once.

        Before load it is [`set_global`][aperf.BPFObject.set_global]. A ``.rodata``
        (``const volatile``) global is frozen at load:
        [`ObjectStateError`][aperf.ObjectStateError]. Values are checked as
        ``set_global`` checks them; an aligned integer of 1, 2, 4 or 8 bytes is
        written in one store, anything larger byte by byte (a program may see it
        half written).
        """
        if not self._loaded:
            self._set_global_unguarded(name, value)
            return
        slot = global_slot(self._btf(), name)
        if slot.section == ".rodata":
            raise ObjectStateError(
                f"write_global({name!r}): a .rodata (const volatile) global is frozen when the "
                "object loads; set it before load with set_global()"
            )
        raw = _encode_global(name, slot, value)
        self._section_memory(slot.section).write(slot.offset, raw)

    @property
    def globals(self) -> MutableMapping[str, Any]:
        """The object's globals by name, as a mapping: reading one is
        [`read_global`][aperf.BPFObject.read_global], assigning one is
        [`write_global`][aperf.BPFObject.write_global] (a skeleton's
        ``skel->bss->counter``)."""
        self._check_open()
        return Globals(self)

    @_guarded
    def _global_names(self) -> list[str]:
        return list(global_slots(self._btf()))

    def _section_memory(self, section: str) -> SectionMemory:  # inside a guarded call
        with self._sections_lock:
            memory = self._sections.get(section)
            if memory is None:
                section_map = self._section_map(section)
                memory = SectionMemory(section_map._fd(), section_map.name,
                                       writable=section != ".rodata")
                self._sections[section] = memory
            return memory

    def _drop_counter(self, map_name: str) -> DropCounter | None:  # inside a guarded call
        """The drop count of map ``map_name`` kept by ``<aperf/buffer.bpf.h>``, on a
        mapping of its own (its reader closes it), or None."""
        if map_name in self._buffers:
            name = BUFFER_DROPS + map_name
        elif map_name in self._ring_arrays:
            name = RINGS_DROPS + map_name
        else:
            return None
        if not self._loaded:
            raise ObjectStateError(f"map {map_name!r} has no drop count before load")
        slot = global_slot(self._btf(), name)
        section_map = self._section_map(slot.section)
        memory = SectionMemory(section_map._fd(), section_map.name, writable=False)
        return DropCounter(memory, slot, name)

    def _fill_ring_arrays(self, sizes: dict[str, int | None]) -> None:  # after the load
        """Give each per-CPU ring buffer map of ``<aperf/buffer.bpf.h>`` a ring buffer
        per possible CPU (as many as its slots hold), of its inner map's size."""
        cpus = int(lb.libbpf_num_possible_cpus())
        for name in self._ring_arrays:
            outer = self._maps[name]
            size = sizes[name]
            if size is None:
                raise ObjectStateError(f"map {name!r} has no inner ring buffer to copy")
            for cpu in range(min(cpus, outer.max_entries)):
                ring = lb.create_map(BPF_MAP_TYPE_RINGBUF, f"{name[:10]}_{cpu}", 0, 0, size)
                try:
                    lb.map_update(outer._fd(), cpu.to_bytes(4, "little"),
                                  ring.to_bytes(4, "little"))
                finally:
                    os.close(ring)  # the outer map holds it now

    # --- load, attach, close ------------------------------------------------------------

    @_guarded
    def load(self) -> None:
        """Create the maps and load the programs into the kernel."""
        self._check_open()
        if self._loaded:
            raise ObjectStateError(f"BPF object {self.path!r} is already loaded")
        # libbpf frees a map-in-map's inner template once the outer map exists: its
        # ring size is read before (set_inner_max_entries's size, else the declared one).
        ring_sizes = {name: self._ring_bytes.get(name) or lb.inner_map_max_entries(
            self._maps[name]._ptr) for name in self._ring_arrays}
        with lb.capture_log() as captured:
            try:
                lb.bpf_object__load(self._ptr)
            except LibbpfError as exc:
                assert exc.errno is not None
                text = captured.text
                if "BEGIN PROG LOAD LOG" in text or "failed to load program" in text:
                    raise VerifierError(self.path, exc.errno, text) from None
                detail = f"loading {self.path!r}: {_last_line(text)}"
                if isinstance(exc, MissingPrivilegesError) or os.geteuid() != 0:
                    denied = MissingPrivilegesError(exc.errno, exc.function, detail)
                    denied.log = text
                    raise denied from None
                exc.detail, exc.log = detail, text
                raise
        self._fill_ring_arrays(ring_sizes)
        self._loaded = True
        log.debug("bpf object loaded", path=self.path, maps=len(self._maps),
                  programs=len(self._programs))

    @_guarded
    def attach(self) -> None:
        """Attach every program, all or nothing."""
        self._check_open()
        done: list[Link] = []
        try:
            for program in self._programs.values():
                done.append(program.attach())
        except BaseException:
            for link in done:
                link.detach()
            raise

    @_release_guarded
    def detach(self) -> None:
        """Remove every attachment of every program."""
        for program in self._programs.values():
            program._detach_all()

    def close(self) -> None:
        """Detach every program, then free the object and its fds. Idempotent.

        Its maps, programs and links refuse use from then on
        ([`ClosedResourceError`][aperf.ClosedResourceError]) instead of reading freed memory.
        Safe from any thread: calls already running in other threads finish first
        (each is a short libbpf call), and calls made later raise
        ``ClosedResourceError``.
        """
        handle = self._handle
        inflight = handle.begin_close()
        if inflight is None:
            return
        self._finalizer.detach()
        if _inside_a_call(handle):
            # Called from inside a call of this thread (a signal handler): that call
            # cannot end while we wait, so the last call to end frees.
            handle.run_after(inflight, self._release)
            return
        while any(call in handle.calls for call in inflight):
            time.sleep(_CLOSE_POLL)
        self._release()

    def _release(self) -> None:
        with self._sections_lock:
            sections, self._sections = self._sections, {}
        for memory in sections.values():
            memory.close()
        try:
            for program in self._programs.values():
                program._detach_all()
        finally:
            for program in self._programs.values():
                for link in program._links:
                    link._raw = 0  # the handle destroys what detaching did not reach
                program._links.clear()
            self._handle.free()

    def __enter__(self) -> BPFObject:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "loaded" if self._loaded else "opened"
        return f"<aperf.BPFObject {self.path!r} {state}>"
