"""BPF objects: open a ``.bpf.o``, set ``const volatile`` globals, load, attach, close."""

from __future__ import annotations

import errno
import os
import weakref
from collections.abc import Iterator, Mapping
from typing import TypeVar

from . import _libbpf as lb
from ._btf import global_slot
from ._errors import (
    ClosedResourceError,
    GlobalValueError,
    LibbpfError,
    MissingPrivilegesError,
    ObjectFileError,
    ObjectStateError,
    UnknownNameError,
    VerifierError,
)
from ._log import log

# PERCPU_HASH, PERCPU_ARRAY, LRU_PERCPU_HASH, PERCPU_CGROUP_STORAGE
_PER_CPU_MAP_TYPES = frozenset({5, 6, 10, 21})
_V = TypeVar("_V")


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "(libbpf printed nothing)"


class _NameTable(Mapping[str, _V]):
    """A read-only name -> item mapping whose misses raise :class:`UnknownNameError`."""

    def __init__(self, kind: str, items: dict[str, _V]) -> None:
        self._kind = kind
        self._items = items

    def __getitem__(self, name: str) -> _V:
        try:
            return self._items[name]
        except KeyError:
            raise UnknownNameError(self._kind, name, list(self._items)) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"<{self._kind}s {', '.join(self._items)}>"


class Map:
    """A map of a :class:`BPFObject`. ``fd`` is valid from load until the object closes."""

    def __init__(self, owner: BPFObject, ptr: int) -> None:
        self._owner = owner
        self._ptr = ptr
        self.name: str = lb.cstr(lb.bpf_map__name(ptr))
        self.type: int = int(lb.bpf_map__type(ptr))

    @property
    def fd(self) -> int:
        self._owner._check_open()
        fd = int(lb.bpf_map__fd(self._ptr))
        if fd < 0:
            raise ObjectStateError(f"map {self.name!r} has no fd before the object is loaded")
        return fd

    @property
    def max_entries(self) -> int:
        self._owner._check_open()
        return int(lb.bpf_map__max_entries(self._ptr))

    def set_max_entries(self, max_entries: int) -> None:
        """Size the map before its object is loaded (a ring buffer: its bytes, a power of
        two of at least a page)."""
        self._owner._check_open()
        if self._owner.loaded:
            raise ObjectStateError(f"map {self.name!r}: set_max_entries before load()")
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or not (
            0 < max_entries < 1 << 32
        ):
            raise ValueError(f"max_entries must be an int in 1..2**32-1, not {max_entries!r}")
        lb.bpf_map__set_max_entries(self._ptr, max_entries)

    @property
    def value_size(self) -> int:
        self._owner._check_open()
        return int(lb.bpf_map__value_size(self._ptr))

    @property
    def closed(self) -> bool:
        return self._owner.closed

    @property
    def per_cpu(self) -> bool:
        return self.type in _PER_CPU_MAP_TYPES

    def lookup(self, key: bytes) -> bytes:
        """The value stored under ``key`` (per-CPU maps: one 8-byte-aligned slot per CPU)."""
        size = self.value_size
        if self.per_cpu:
            size = ((size + 7) & ~7) * int(lb.libbpf_num_possible_cpus())
        return lb.map_lookup(self.fd, key, size)

    def update(self, key: bytes, value: bytes) -> None:
        lb.map_update(self.fd, key, value)

    def pin(self, path: str | os.PathLike[str]) -> None:
        """Pin the map in bpffs (``/sys/fs/bpf/...``) so that other processes can open it."""
        self._owner._check_open()
        lb.pin_map(self._ptr, os.fspath(path))

    def unpin(self, path: str | os.PathLike[str]) -> None:
        self._owner._check_open()
        lb.unpin_map(self._ptr, os.fspath(path))

    @property
    def object(self) -> BPFObject:
        return self._owner

    def __repr__(self) -> str:
        return f"<aperf.Map {self.name!r} type={self.type}>"


class Link:
    """An attachment of a program to its hook; ``detach()`` (idempotent) removes it."""

    def __init__(self, program: Program, ptr: int) -> None:
        self.program = program
        self._ptr = ptr

    @property
    def attached(self) -> bool:
        return bool(self._ptr)

    def detach(self) -> None:
        ptr, self._ptr = self._ptr, 0
        if ptr:
            self.program._links.remove(self)
            lb.bpf_link__destroy(ptr)

    def __enter__(self) -> Link:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()


class Program:
    """A program of a :class:`BPFObject`."""

    def __init__(self, owner: BPFObject, ptr: int) -> None:
        self._owner = owner
        self._ptr = ptr
        self._links: list[Link] = []
        self.name: str = lb.cstr(lb.bpf_program__name(ptr))
        self.section: str = lb.cstr(lb.bpf_program__section_name(ptr))

    @property
    def type(self) -> int:
        return int(lb.bpf_program__type(self._ptr))

    @property
    def fd(self) -> int:
        self._owner._check_open()
        fd = int(lb.bpf_program__fd(self._ptr))
        if fd < 0:
            raise ObjectStateError(f"program {self.name!r} has no fd before the object is loaded")
        return fd

    @property
    def links(self) -> tuple[Link, ...]:
        return tuple(self._links)

    def attach(self) -> Link:
        """Attach to the hook named by the program's section (e.g. ``tp/sched/...``)."""
        self._owner._check_open()
        if not self._owner.loaded:
            raise ObjectStateError(f"load the object before attaching program {self.name!r}")
        with lb.capture_log() as captured:
            try:
                ptr = lb.attach_program(self._ptr)
            except LibbpfError as exc:
                exc.log = captured.text
                exc.detail = f"attaching {self.name!r} ({self.section}): {_last_line(exc.log)}"
                if exc.errno == errno.ENOENT and self.section.startswith(("tp/", "tracepoint/")):
                    exc.detail += " (is tracefs mounted at /sys/kernel/tracing?)"
                raise
        link = Link(self, ptr)
        self._links.append(link)
        return link

    def detach(self) -> None:
        """Remove every attachment made through :meth:`attach`."""
        for link in list(self._links):
            link.detach()

    def __repr__(self) -> str:
        return f"<aperf.Program {self.name!r} section={self.section!r}>"


class BPFObject:
    """A compiled BPF object file: open, set globals, load, attach, close (exactly once).

    Use it as a context manager; closing detaches every program and releases every fd.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._ptr = 0
        self._loaded = False
        self.path = os.fspath(path)
        if not os.path.exists(self.path):
            raise ObjectFileError(self.path, errno.ENOENT, "bpf_object__open_file", "no such file")
        with lb.capture_log() as captured:
            try:
                self._ptr = lb.open_object(self.path)
            except LibbpfError as exc:
                assert exc.errno is not None
                reason = _last_line(captured.text) if captured.text.strip() else exc.strerror
                error = ObjectFileError(
                    self.path, exc.errno, exc.function,
                    f"not a loadable ELF BPF object: {reason}", exc.strerror,
                )
                error.log = captured.text
                raise error from None
        self._finalizer = weakref.finalize(self, lb.bpf_object__close, self._ptr)
        self.name: str = lb.cstr(lb.bpf_object__name(self._ptr))
        self._maps = _NameTable("map", {m.name: m for m in self._collect_maps()})
        programs = [Program(self, ptr) for ptr in lb.iter_programs(self._ptr)]
        self._programs = _NameTable("program", {p.name: p for p in programs})

    def _collect_maps(self) -> list[Map]:
        return [Map(self, ptr) for ptr in lb.iter_maps(self._ptr)]

    # --- state -------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return not self._ptr

    @property
    def loaded(self) -> bool:
        return self._loaded

    def _check_open(self) -> None:
        if not self._ptr:
            raise ClosedResourceError(f"BPF object {self.path!r} is closed")

    @property
    def maps(self) -> Mapping[str, Map]:
        return self._maps

    @property
    def programs(self) -> Mapping[str, Program]:
        return self._programs

    # --- globals -------------------------------------------------------------------

    def _btf(self) -> lb.Btf | None:
        """The object's BTF (owned by the object: valid until it closes)."""
        self._check_open()
        return lb.object_btf(self._ptr)

    def _section_map(self, section: str) -> Map:
        for m in self._maps.values():
            if m.name.endswith(section):
                return m
        raise UnknownNameError("map", f"*{section}", list(self._maps))

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
        section_map = self._section_map(slot.section)
        current = lb.map_initial_value(section_map._ptr)
        if current is None:
            raise ObjectStateError(f"map {section_map.name!r} has no initial value to edit")
        image = bytearray(current)
        image[slot.offset : slot.offset + slot.size] = raw
        lb.set_map_initial_value(section_map._ptr, bytes(image))

    def get_global(self, name: str) -> int | bytes:
        """The value a global will have (before load) or was loaded with."""
        self._check_open()
        slot = global_slot(self._btf(), name)
        current = lb.map_initial_value(self._section_map(slot.section)._ptr) or b""
        raw = current[slot.offset : slot.offset + slot.size]
        return int.from_bytes(raw, "little", signed=slot.signed) if slot.is_int else raw

    # --- load, attach, close ------------------------------------------------------------

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

    def detach(self) -> None:
        for program in self._programs.values():
            program.detach()

    def close(self) -> None:
        """Detach every program, then free the object and its fds. Idempotent."""
        ptr, self._ptr = self._ptr, 0
        if not ptr:
            return
        self._finalizer.detach()
        try:
            for program in self._programs.values():
                program.detach()
        finally:
            lb.bpf_object__close(ptr)

    def __enter__(self) -> BPFObject:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "loaded" if self._loaded else "opened"
        return f"<aperf.BPFObject {self.path!r} {state}>"
