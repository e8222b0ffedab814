"""A Pythonic surface over the declared prototypes: bytes in, bytes and ints out.

The rest of aperf calls these functions and never sees a ctypes type.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ..._errors import ArgumentError, ClosedResourceError, LibbpfError, PinnedPathError
from ..prototypes import MapInfo, read_map_info
from . import binding as c

# --- libbpf's log -----------------------------------------------------------------

VERBOSE_ENV = "APERF_LIBBPF_VERBOSE"
LIBBPF_WARN, LIBBPF_INFO, LIBBPF_DEBUG = 0, 1, 2

_libc_functions: dict[str, Any] = {}


def _libc(name: str, restype: Any, *argtypes: Any) -> Any:
    """A libc function, declared on first use (importing aperf loads no library)."""
    fn = _libc_functions.get(name)
    if fn is None:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
        fn.argtypes = list(argtypes)
        fn.restype = restype
        _libc_functions[name] = fn
    return fn


class _LogState(threading.local):
    def __init__(self) -> None:
        self.capture: list[str] | None = None


_log_state = _LogState()
_verbose = os.environ.get(VERBOSE_ENV, "") not in ("", "0")
_print_installed = False
_print_lock = threading.Lock()


def _format(fmt: bytes, args: int | None) -> str:
    buf = ctypes.create_string_buffer(4096)
    vsnprintf = _libc(
        "vsnprintf", ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p,
        ctypes.c_void_p,
    )
    vsnprintf(buf, len(buf), fmt, args)
    return buf.value.decode("utf-8", "replace")


def _print_message(level: int, fmt: bytes, args: int | None) -> int:
    try:
        if level == LIBBPF_DEBUG and not _verbose and _log_state.capture is None:
            return 0
        text = _format(fmt, args)
        if _log_state.capture is not None:
            _log_state.capture.append(text)
        if _verbose or (level == LIBBPF_WARN and _log_state.capture is None):
            # libbpf's own warnings go to stderr as libbpf itself would print them,
            # unless a caller is capturing them to put into an exception.
            sys.stderr.write(text)
    except BaseException as exc:  # parked, re-raised by the C call's errcheck
        c.park_callback_error(exc)
    return 0


_print_callback = c.PRINT_FN(_print_message)


def install_print() -> None:
    """Route libbpf's log through aperf (once per process)."""
    global _print_installed
    if _print_installed:
        return
    with _print_lock:
        if not _print_installed:
            c.libbpf_set_print(_print_callback)
            _print_installed = True


def set_libbpf_verbose(verbose: bool = True) -> None:
    """Print all of libbpf's output, debug included, to stderr (or set APERF_LIBBPF_VERBOSE=1)."""
    global _verbose
    _verbose = verbose
    install_print()


def libbpf_version() -> tuple[int, int]:
    """The (major, minor) version of the libbpf aperf loaded (>= 1.0)."""
    return c.version()


class capture_log:
    """Collect libbpf's messages (all levels) emitted by this thread inside the block."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __enter__(self) -> capture_log:
        install_print()
        self._outer = _log_state.capture
        _log_state.capture = self.lines
        return self

    def __exit__(self, *exc: object) -> None:
        _log_state.capture = self._outer
        if self._outer is not None:
            self._outer.extend(self.lines)

    @property
    def text(self) -> str:
        return "".join(self.lines)


# --- objects, maps, programs ---------------------------------------------------------


def cstr(raw: bytes | None) -> str:
    # Names come from the ELF file; a hostile one must not make open() fail untyped.
    return raw.decode(errors="replace") if raw else ""


def c_path(path: str | bytes | os.PathLike[str] | os.PathLike[bytes], argument: str) -> bytes:
    """``path`` as the bytes C sees. A NUL byte is refused: C would silently cut the path there."""
    try:
        raw = os.fsencode(path)
    except TypeError:
        raise TypeError(
            f"{argument} must be a path (str, bytes or os.PathLike), not {type(path).__name__}"
        ) from None
    if b"\0" in raw:
        raise ArgumentError(
            argument, f"{argument} {os.fsdecode(raw)!r} contains a NUL byte (C would cut it there)"
        )
    return raw


def open_object(path: bytes) -> int:
    return int(c.bpf_object__open_file(path, None))


def iter_maps(obj: int) -> Iterator[int]:
    cur = c.bpf_object__next_map(obj, None)
    while cur:
        yield int(cur)
        cur = c.bpf_object__next_map(obj, cur)


def iter_programs(obj: int) -> Iterator[int]:
    cur = c.bpf_object__next_program(obj, None)
    while cur:
        yield int(cur)
        cur = c.bpf_object__next_program(obj, cur)


def map_initial_value(map_ptr: int) -> bytes | None:
    size = ctypes.c_size_t(0)
    ptr = c.bpf_map__initial_value(map_ptr, ctypes.byref(size))
    if not ptr:
        return None
    return ctypes.string_at(ptr, size.value)


def set_map_initial_value(map_ptr: int, data: bytes) -> None:
    c.bpf_map__set_initial_value(map_ptr, data, len(data))


def retype_map(map_ptr: int, map_type: int, key_size: int, value_size: int,
               max_entries: int) -> None:
    """Make an opened, not yet loaded map another type (libbpf-tools' ``bpf_buffer``):
    its type first, then sizes that suit it (max_entries 0: a perf event array's slots
    are then one per possible CPU)."""
    c.bpf_map__set_type(map_ptr, map_type)
    c.bpf_map__set_key_size(map_ptr, key_size)
    c.bpf_map__set_value_size(map_ptr, value_size)
    c.bpf_map__set_max_entries(map_ptr, max_entries)


def inner_map_max_entries(map_ptr: int) -> int | None:
    """A map-in-map's inner map template's ``max_entries`` (None: it has no template)."""
    inner = c.bpf_map__inner_map(map_ptr)
    return int(c.bpf_map__max_entries(inner)) if inner else None


def map_type_supported(map_type: int) -> bool:
    """Whether the running kernel creates maps of ``map_type`` (libbpf's probe)."""
    return bool(c.libbpf_probe_bpf_map_type(map_type, None))


def create_map(map_type: int, name: str, key_size: int, value_size: int,
               max_entries: int) -> int:
    """A new map's fd (the caller closes it), with no BTF."""
    return int(c.bpf_map_create(map_type, name.encode()[:15], key_size, value_size,
                                max_entries, None))


def map_fd_by_id(map_id: int) -> int:
    """A new fd of the map with kernel id ``map_id`` (the caller closes it)."""
    if isinstance(map_id, bool) or not isinstance(map_id, int) or not 0 < map_id < 1 << 32:
        raise ArgumentError("map_id", f"map_id must be a map id (1..2**32-1), not {map_id!r}")
    return int(c.bpf_map_get_fd_by_id(map_id))


# --- map elements: every size checked before the syscall reads or writes our memory ---

PER_CPU_MAP_TYPES = frozenset({5, 6, 10, 21})
"""PERCPU_HASH, PERCPU_ARRAY, LRU_PERCPU_HASH, PERCPU_CGROUP_STORAGE: one value per possible CPU."""
BPF_ANY, BPF_NOEXIST, BPF_EXIST, BPF_F_LOCK = 0, 1, 2, 4


@dataclass(frozen=True)
class MapLayout:
    """How many bytes the kernel copies from a key and to or from a value of one map."""

    name: str
    key_size: int
    value_size: int  # per-CPU maps: one 8-byte-aligned slot per possible CPU

    @classmethod
    def of(cls, name: str, map_type: int, key_size: int, value_size: int) -> MapLayout:
        if map_type in PER_CPU_MAP_TYPES:  # as the kernel's bpf_map_value_size()
            value_size = ((value_size + 7) & ~7) * int(c.libbpf_num_possible_cpus())
        return cls(name, key_size, value_size)

    def key(self, key: object) -> bytes | None:
        raw = self._exact(key, self.key_size, "key")
        return raw or None  # queue and stack maps have no key: the kernel wants NULL

    def value(self, value: object) -> bytes:
        return self._exact(value, self.value_size, "value")

    def _exact(self, data: object, size: int, argument: str) -> bytes:
        if isinstance(data, bytes):
            raw = data
        elif isinstance(data, bytearray | memoryview):
            raw = bytes(data)
        else:
            raise TypeError(
                f"{argument} must be bytes, bytearray or memoryview, not {type(data).__name__}"
            )
        if len(raw) != size:
            raise ArgumentError(
                argument,
                f"{argument} is {len(raw)} bytes; map {self.name} takes {size}-byte {argument}s",
            )
        return raw


_ANON_INODE_KINDS = {
    "anon_inode:bpf-map": "map", "anon_inode:bpf-prog": "prog", "anon_inode:bpf_link": "link",
}


def object_kind(fd: int) -> str:
    """The kind of BPF object behind ``fd``: ``map``, ``prog``, ``link``, or "" if none."""
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")  # cheaper than reading fdinfo
    except FileNotFoundError:
        raise ClosedResourceError(f"fd {fd} is not open") from None
    return _ANON_INODE_KINDS.get(target, "")


def map_layout(fd: int) -> MapLayout:
    """The layout of the map behind ``fd``, as the kernel reports it."""
    info = map_info(fd)
    return MapLayout.of(f"fd {fd}", info.type, info.key_size, info.value_size)


def update_flags(flags: object) -> int:
    if isinstance(flags, bool) or not isinstance(flags, int):
        raise TypeError(f"flags must be an int (BPF_ANY, BPF_NOEXIST, BPF_EXIST | BPF_F_LOCK), "
                        f"not {type(flags).__name__}")
    if flags < 0 or flags & ~BPF_F_LOCK not in (BPF_ANY, BPF_NOEXIST, BPF_EXIST):
        raise ArgumentError(
            "flags", f"flags={flags!r}: one of BPF_ANY (0), BPF_NOEXIST (1), BPF_EXIST (2), "
            "optionally | BPF_F_LOCK (4)"
        )
    return flags


def map_update(
    fd: int, key: object, value: object, flags: int = 0, *, layout: MapLayout | None = None
) -> None:
    """Store ``value`` under ``key``; sizes checked against ``layout`` (default: ask the kernel)."""
    layout = layout or map_layout(fd)
    c.bpf_map_update_elem(fd, layout.key(key), layout.value(value), update_flags(flags))


def map_lookup(
    fd: int, key: object, value_size: int | None = None, *, layout: MapLayout | None = None
) -> bytes:
    """The value under ``key``; ``value_size``, if given, must be what the kernel will write."""
    layout = layout or map_layout(fd)
    if value_size is not None and value_size != layout.value_size:
        raise ArgumentError(
            "value_size", f"value_size={value_size}, but map {layout.name} writes "
            f"{layout.value_size} bytes per lookup"
        )
    out = ctypes.create_string_buffer(layout.value_size)
    c.bpf_map_lookup_elem(fd, layout.key(key), out)
    return out.raw


# --- pinning: paths in bpffs --------------------------------------------------------

BPF_FS_MAGIC = 0xCAFE4A11


def _on_bpffs(path: bytes) -> bool | None:
    """Whether ``path`` lies on a BPF filesystem (None: it cannot be looked up)."""
    buf = ctypes.create_string_buffer(256)  # struct statfs: 120 bytes on x86-64, f_type first
    if _libc("statfs", ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(path, buf) != 0:
        return None
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF == BPF_FS_MAGIC


_NOT_BPFFS = (
    "is not on a BPF filesystem: pinned BPF objects live in a bpffs mount "
    "(mount -t bpf bpf /sys/fs/bpf)"
)


@contextmanager
def _explained_by_path(path: bytes, why: Callable[[bytes, int], str | None]) -> Iterator[None]:
    """Re-raise a libbpf failure as PinnedPathError when ``why`` finds the path at fault."""
    try:
        yield
    except LibbpfError as exc:
        err = exc.errno or 0
        reason = why(path, err)
        if reason is None:
            raise
        raise PinnedPathError(os.fsdecode(path), reason, err, exc.function) from None


def _why_not_pinned(path: bytes, err: int) -> str | None:
    """Why bpf_obj_get() refused ``path``, when the path itself says (None: errno says it)."""
    if not os.path.lexists(path):
        return None
    on_bpffs = _on_bpffs(path)
    if on_bpffs is False:
        return _NOT_BPFFS
    if os.path.isdir(path):
        return "is a directory, not a pinned BPF object"
    if on_bpffs and (os.geteuid() == 0 or err not in (errno.EPERM, errno.EACCES)):
        return "is not a pinned BPF map, program or link"
    return None  # not root and refused: a privilege problem after all


def pinned_object_fd(
    path: str | bytes | os.PathLike[str] | os.PathLike[bytes], argument: str = "path"
) -> int:
    """A new fd of the BPF object pinned at ``path`` (the caller closes it).

    ``ArgumentError`` for a NUL byte in ``path``; ``PinnedPathError``
    when ``path`` exists but holds no pinned object (not bpffs, a directory).
    """
    raw = c_path(path, argument)
    with _explained_by_path(raw, _why_not_pinned):
        fd = int(c.bpf_obj_get(raw))
    return fd


def _why_not_pinnable(path: bytes, err: int) -> str | None:
    """Why bpf_obj_pin() refused ``path``, when the path itself says (None: errno says it)."""
    if err == errno.EEXIST:
        return "already exists (unpin it first, or choose another path)"
    parent = os.path.dirname(path) or b"."
    if not os.path.isdir(parent):
        return "is in a directory that does not exist (create it in bpffs first)"
    if _on_bpffs(parent) is False:
        return _NOT_BPFFS
    return None


def pin_object(fd: int, path: bytes) -> None:
    """Pin the BPF object behind ``fd`` at ``path`` (checked by ``c_path()``).

    Through ``bpf_obj_pin`` rather than ``bpf_map__pin``: libbpf keeps the path
    of a failed pin in the map, which fails every later pin elsewhere and makes
    ``bpf_object__load`` pin (or reuse a stale map) there.
    """
    with _explained_by_path(path, _why_not_pinnable):
        c.bpf_obj_pin(fd, path)


class _bpf_info_head(ctypes.Structure):
    # What bpf_map_info, bpf_prog_info and bpf_link_info all start with.
    _fields_ = (("type", ctypes.c_uint32), ("id", ctypes.c_uint32))


def object_id(fd: int) -> tuple[str, int]:
    """("map" | "prog" | "link", kernel id) of the BPF object behind ``fd``."""
    kind = object_kind(fd)
    if not kind:
        raise LibbpfError(errno.EINVAL, "bpf_obj_get_info_by_fd", f"fd {fd} is no BPF object")
    head = _bpf_info_head()
    size = ctypes.c_uint32(ctypes.sizeof(head))
    c.bpf_obj_get_info_by_fd(fd, ctypes.byref(head), ctypes.byref(size))
    return kind, int(head.id)


def unpin_object(fd: int, path: bytes, what: str) -> None:
    """Remove the pin at ``path`` if it is the object behind ``fd`` (never another one's pin)."""
    pinned = pinned_object_fd(path)
    try:
        if object_id(pinned) != object_id(fd):
            raise PinnedPathError(
                os.fsdecode(path), f"holds another BPF object than {what}; left in place",
                errno.EINVAL, "bpf_obj_get",
            )
    finally:
        os.close(pinned)
    os.unlink(path)


class _bpf_map_info(ctypes.Structure):
    _fields_ = (
        ("type", ctypes.c_uint32),
        ("id", ctypes.c_uint32),
        ("key_size", ctypes.c_uint32),
        ("value_size", ctypes.c_uint32),
        ("max_entries", ctypes.c_uint32),
        ("map_flags", ctypes.c_uint32),
        ("name", ctypes.c_char * 16),
        ("ifindex", ctypes.c_uint32),
        ("btf_vmlinux_value_type_id", ctypes.c_uint32),
        ("netns_dev", ctypes.c_uint64),
        ("netns_ino", ctypes.c_uint64),
        ("btf_id", ctypes.c_uint32),
        ("btf_key_type_id", ctypes.c_uint32),
        ("btf_value_type_id", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
        ("map_extra", ctypes.c_uint64),
    )


def map_info(fd: int) -> MapInfo:
    """What the kernel says of the BPF map behind ``fd`` (EINVAL if it is not a map)."""
    # bpf_obj_get_info_by_fd() fills a program's or link's info just as well,
    # which this struct would misread as a map's.
    if object_kind(fd) != "map":
        raise LibbpfError(errno.EINVAL, "bpf_obj_get_info_by_fd", f"fd {fd} is not a BPF map")
    return read_map_info(fd, _bpf_map_info(), c.bpf_obj_get_info_by_fd)


class _bpf_test_run_opts(ctypes.Structure):
    _fields_ = (
        ("sz", ctypes.c_size_t),
        ("data_in", ctypes.c_void_p),
        ("data_out", ctypes.c_void_p),
        ("data_size_in", ctypes.c_uint32),
        ("data_size_out", ctypes.c_uint32),
        ("ctx_in", ctypes.c_void_p),
        ("ctx_out", ctypes.c_void_p),
        ("ctx_size_in", ctypes.c_uint32),
        ("ctx_size_out", ctypes.c_uint32),
        ("retval", ctypes.c_uint32),
        ("repeat", ctypes.c_int),
        ("duration", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("cpu", ctypes.c_uint32),
        ("batch_size", ctypes.c_uint32),
    )


BPF_F_TEST_RUN_ON_CPU = 1 << 0


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


_CLOCK_MONOTONIC = 1
_TFD_NONBLOCK, _TFD_CLOEXEC = os.O_NONBLOCK, os.O_CLOEXEC  # as timerfd.h defines them


class TimerFd:
    """A one-shot ``CLOCK_MONOTONIC`` timer on an fd (``timerfd_create(2)``), to the nanosecond.

    Event loops round a timer's wait up to the millisecond (``epoll_wait``'s unit):
    a 1 ms timer re-armed after some work fires 1 ms after that work, and a drain
    timer drifts to about 1.2 ms. This one fires when it is due; the loop waits on
    its fd like on any other (Python has ``os.timerfd_create`` only from 3.13).
    """

    __slots__ = ("_ref", "_settime", "_spec", "fd")

    def __init__(self) -> None:
        create = _libc("timerfd_create", ctypes.c_int, ctypes.c_int, ctypes.c_int)
        fd = create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"timerfd_create: {os.strerror(err)}")
        self.fd = fd
        self._settime = _libc("timerfd_settime", ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.POINTER(_Itimerspec), ctypes.c_void_p)
        self._spec = _Itimerspec()
        self._ref = ctypes.byref(self._spec)

    def arm(self, delay: float | None) -> None:
        """Fire once ``delay`` seconds from now (at once if not positive); None: disarm."""
        value = self._spec.it_value
        if delay is None:
            value.tv_sec = value.tv_nsec = 0
        else:
            value.tv_sec, value.tv_nsec = divmod(max(1, int(delay * 1e9)), 1_000_000_000)
        if self._settime(self.fd, 0, self._ref, None) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"timerfd_settime: {os.strerror(err)}")

    def expired(self) -> bool:
        """Clear the fd; whether the timer had fired (False: a stale report)."""
        try:
            os.read(self.fd, 8)
        except BlockingIOError:
            return False
        return True

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


def test_run_on_cpu(prog_fd: int, cpu: int) -> int:
    """Run a raw_tp program once on ``cpu`` (the GIL is released meanwhile); its return value."""
    opts = _bpf_test_run_opts()
    opts.sz = ctypes.sizeof(opts)
    opts.flags = BPF_F_TEST_RUN_ON_CPU
    opts.cpu = cpu
    c.bpf_prog_test_run_opts(prog_fd, ctypes.byref(opts))
    return int(opts.retval)


def attach_program(prog: int) -> int:
    return int(c.bpf_program__attach(prog))


# --- BTF -----------------------------------------------------------------------------

BTF_KIND_INT, BTF_KIND_PTR, BTF_KIND_ARRAY, BTF_KIND_STRUCT, BTF_KIND_UNION = 1, 2, 3, 4, 5
BTF_KIND_ENUM, BTF_KIND_FWD, BTF_KIND_TYPEDEF, BTF_KIND_VOLATILE, BTF_KIND_CONST = 6, 7, 8, 9, 10
BTF_KIND_RESTRICT, BTF_KIND_VAR, BTF_KIND_DATASEC, BTF_KIND_FLOAT = 11, 14, 15, 16
BTF_KIND_TYPE_TAG, BTF_KIND_ENUM64 = 18, 19
BTF_INT_SIGNED, BTF_INT_BOOL = 1 << 0, 1 << 2


@dataclass(frozen=True)
class BtfMember:
    name: str
    type_id: int
    bit_offset: int
    bitfield_size: int


@dataclass(frozen=True)
class BtfType:
    """One BTF type as libbpf's ``btf__type_by_id`` describes it."""

    id: int
    kind: int
    name: str
    size: int  # bytes, for ints, structs, unions, enums, datasecs, floats
    ref: int  # the referenced type for ptr, typedef, modifiers, var, func
    vlen: int
    kind_flag: bool
    int_encoding: int = 0
    int_bits: int = 0
    int_offset: int = 0
    members: tuple[BtfMember, ...] = ()
    array_elem: int = 0
    array_len: int = 0
    enum_values: tuple[tuple[str, int], ...] = ()
    datasec_vars: tuple[tuple[int, int, int], ...] = field(default=())  # (var id, offset, size)


class Btf:
    """Read access to a BTF object owned by a BPF object (not freed here)."""

    def __init__(self, ptr: int) -> None:
        self._ptr = ptr

    def find(self, name: str, kind: int) -> int | None:
        try:
            return int(c.btf__find_by_name_kind(self._ptr, name.encode(), kind))
        except LibbpfError:
            return None

    def type_count(self) -> int:
        return int(c.btf__type_cnt(self._ptr))

    def resolve_size(self, type_id: int) -> int:
        return int(c.btf__resolve_size(self._ptr, type_id))

    def _name(self, off: int) -> str:
        return cstr(c.btf__name_by_offset(self._ptr, off))

    def type(self, type_id: int) -> BtfType:
        base = int(c.btf__type_by_id(self._ptr, type_id))
        name_off, info, size_or_type = (ctypes.c_uint32 * 3).from_address(base)
        kind = (info >> 24) & 0x1F
        vlen = info & 0xFFFF
        kind_flag = bool(info >> 31)
        extra = base + 12
        common: dict[str, Any] = {
            "id": type_id,
            "kind": kind,
            "name": self._name(name_off),
            "vlen": vlen,
            "kind_flag": kind_flag,
        }
        sized = kind in (
            BTF_KIND_INT, BTF_KIND_STRUCT, BTF_KIND_UNION, BTF_KIND_ENUM,
            BTF_KIND_DATASEC, BTF_KIND_FLOAT, BTF_KIND_ENUM64,
        )
        size = size_or_type if sized else 0
        ref = 0 if sized else size_or_type
        if kind == BTF_KIND_INT:
            word = ctypes.c_uint32.from_address(extra).value
            return BtfType(
                **common, size=size, ref=0,
                int_encoding=(word >> 24) & 0x0F, int_offset=(word >> 16) & 0xFF,
                int_bits=word & 0xFF,
            )
        if kind == BTF_KIND_ARRAY:
            elem, _index, nelems = (ctypes.c_uint32 * 3).from_address(extra)
            return BtfType(**common, size=0, ref=0, array_elem=elem, array_len=nelems)
        if kind in (BTF_KIND_STRUCT, BTF_KIND_UNION):
            members = []
            raw = (ctypes.c_uint32 * (3 * vlen)).from_address(extra)
            for i in range(vlen):
                m_name, m_type, m_offset = raw[3 * i : 3 * i + 3]
                if kind_flag:
                    bit_offset, bitfield = m_offset & 0xFFFFFF, m_offset >> 24
                else:
                    bit_offset, bitfield = m_offset, 0
                members.append(BtfMember(self._name(m_name), m_type, bit_offset, bitfield))
            return BtfType(**common, size=size, ref=0, members=tuple(members))
        if kind == BTF_KIND_ENUM:
            raw = (ctypes.c_uint32 * (2 * vlen)).from_address(extra)
            signed = kind_flag
            values = []
            for i in range(vlen):
                v = raw[2 * i + 1]
                if signed and v >= 1 << 31:
                    v -= 1 << 32
                values.append((self._name(raw[2 * i]), v))
            return BtfType(**common, size=size, ref=0, enum_values=tuple(values))
        if kind == BTF_KIND_ENUM64:
            raw = (ctypes.c_uint32 * (3 * vlen)).from_address(extra)
            values = []
            for i in range(vlen):
                v = raw[3 * i + 1] | (raw[3 * i + 2] << 32)
                if kind_flag and v >= 1 << 63:
                    v -= 1 << 64
                values.append((self._name(raw[3 * i]), v))
            return BtfType(**common, size=size, ref=0, enum_values=tuple(values))
        if kind == BTF_KIND_DATASEC:
            raw = (ctypes.c_uint32 * (3 * vlen)).from_address(extra)
            svars = tuple(tuple(raw[3 * i : 3 * i + 3]) for i in range(vlen))
            return BtfType(**common, size=size, ref=0, datasec_vars=svars)  # type: ignore[arg-type]
        return BtfType(**common, size=size, ref=ref)

    def skip_modifiers(self, type_id: int) -> BtfType:
        """The type behind typedefs, const, volatile, restrict and type tags."""
        t = self.type(type_id)
        while t.kind in (
            BTF_KIND_TYPEDEF, BTF_KIND_VOLATILE, BTF_KIND_CONST, BTF_KIND_RESTRICT,
            BTF_KIND_TYPE_TAG,
        ):
            t = self.type(t.ref)
        return t


def object_btf(obj: int) -> Btf | None:
    ptr = c.bpf_object__btf(obj)
    return Btf(int(ptr)) if ptr else None


# --- perf rings ------------------------------------------------------------------------

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


_SYS_MEMBARRIER = {"x86_64": 324, "aarch64": 283}
_MEMBARRIER_CMD_GLOBAL = 1  # implemented with synchronize_rcu()


def rcu_grace_period() -> bool:
    """Wait until every BPF program running now has returned (an RCU grace period, by
    ``membarrier(MEMBARRIER_CMD_GLOBAL)``): one that read a map slot just before it was
    deleted has then finished writing. False where this cannot be waited for."""
    number = _SYS_MEMBARRIER.get(os.uname().machine)
    if number is None:
        return False
    syscall = ctypes.CDLL(None, use_errno=True).syscall  # libc's; variadic, so typed here
    return int(syscall(ctypes.c_long(number), ctypes.c_int(_MEMBARRIER_CMD_GLOBAL),
                       ctypes.c_uint(0))) == 0


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
        syscall = _libc("syscall", ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_int,
                        ctypes.c_int, ctypes.c_int, ctypes.c_ulong)
        fd = int(syscall(number, ctypes.byref(attr), -1, cpu, -1, _PERF_FLAG_FD_CLOEXEC))
        if fd < 0:
            raise LibbpfError(ctypes.get_errno(), "perf_event_open",
                              detail=f"an overwritable ring on CPU {cpu}")
        return fd

    def _map(self, fd: int) -> int:
        mmap = _libc("mmap", ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                     ctypes.c_int, ctypes.c_int, ctypes.c_long)
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
            munmap = _libc("munmap", ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t)
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
