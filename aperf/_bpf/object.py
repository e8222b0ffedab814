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
import os
import stat
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar, cast

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
    VerifierError,
)
from .._log import log
from .._native import libbpf as lb
from .btf import GlobalSlot, btf_decoder, global_slot

_V = TypeVar("_V")
_F = TypeVar("_F", bound=Callable[..., Any])
_CLOSE_POLL = 0.0002  # seconds between looks at the calls a close waits for (each is short)


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
        if isinstance(max_entries, bool) or not isinstance(max_entries, int):
            raise TypeError(f"max_entries must be an int, not {type(max_entries).__name__}")
        if not 0 < max_entries < 1 << 32:
            raise ArgumentError("max_entries", f"max_entries must be in 1..2**32-1, not "
                                f"{max_entries!r}")
        ptr = self._ptr  # ClosedResourceError once the object is closed
        if self._owner.loaded:
            raise ObjectStateError(f"map {self.name!r}: set_max_entries before load()")
        lb.bpf_map__set_max_entries(ptr, max_entries)

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

    def _detach_all(self) -> None:
        for link in list(self._links):
            link._destroy()

    def __repr__(self) -> str:
        return f"<aperf.Program {self.name!r} section={self.section!r}{self._state()}>"


class BPFObject:
    """A compiled BPF object file: open, set globals, load, attach, close (exactly once).

    Use it as a context manager; closing detaches every program and releases every fd.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._handle = self._guard = _Handle(0)
        self._loaded = False
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
        except BaseException:
            self.close()
            raise

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
        """
        self._check_open()
        if self._loaded:
            raise ObjectStateError(
                f"set_global({name!r}) after load: globals are frozen into the program at load time"
            )
        slot = global_slot(self._btf(), name)
        if isinstance(value, bool | int) and slot.is_int:
            try:
                raw = int(value).to_bytes(slot.size, "little", signed=slot.signed)
            except OverflowError:
                kind = "signed" if slot.signed else "unsigned"
                raise GlobalValueError(
                    f"{value!r} does not fit global {name!r} ({kind} {slot.size * 8}-bit)"
                ) from None
        elif isinstance(value, bytes | bytearray):
            if len(value) > slot.size:
                raise GlobalValueError(
                    f"{len(value)} bytes do not fit global {name!r} ({slot.size} bytes)"
                )
            raw = bytes(value).ljust(slot.size, b"\0")
        else:
            raise GlobalValueError(
                f"global {name!r} takes {'an int' if slot.is_int else 'bytes'}, "
                f"not {type(value).__name__}"
            )
        section_map, current = self._section_image(name, slot)
        image = bytearray(current)
        image[slot.offset : slot.offset + slot.size] = raw
        lb.set_map_initial_value(section_map._ptr, bytes(image))

    @_guarded
    def get_global(self, name: str) -> int | bytes:
        """The value a global will have (before load) or was loaded with."""
        self._check_open()
        slot = global_slot(self._btf(), name)
        _, current = self._section_image(name, slot)
        raw = current[slot.offset : slot.offset + slot.size]
        return int.from_bytes(raw, "little", signed=slot.signed) if slot.is_int else raw

    # --- load, attach, close ------------------------------------------------------------

    @_guarded
    def load(self) -> None:
        """Create the maps and load the programs into the kernel."""
        self._check_open()
        if self._loaded:
            raise ObjectStateError(f"BPF object {self.path!r} is already loaded")
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
