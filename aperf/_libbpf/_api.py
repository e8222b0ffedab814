"""A Pythonic surface over the declared prototypes: bytes in, bytes and ints out.

The rest of aperf calls these functions and never sees a ctypes type.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .._errors import ClosedResourceError, LibbpfError
from . import _binding as c

# --- libbpf's log -----------------------------------------------------------------

VERBOSE_ENV = "APERF_LIBBPF_VERBOSE"
LIBBPF_WARN, LIBBPF_INFO, LIBBPF_DEBUG = 0, 1, 2

_vsnprintf: Any = None  # libc's, declared on first use (importing aperf loads no library)


def _libc_vsnprintf() -> Any:
    global _vsnprintf
    if _vsnprintf is None:
        fn = ctypes.CDLL(None, use_errno=True).vsnprintf
        fn.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        _vsnprintf = fn
    return _vsnprintf


class _LogState(threading.local):
    def __init__(self) -> None:
        self.capture: list[str] | None = None


_log_state = _LogState()
_verbose = os.environ.get(VERBOSE_ENV, "") not in ("", "0")
_print_installed = False
_print_lock = threading.Lock()


def _format(fmt: bytes, args: int | None) -> str:
    buf = ctypes.create_string_buffer(4096)
    _libc_vsnprintf()(buf, len(buf), fmt, args)
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
    return raw.decode() if raw else ""


def open_object(path: str) -> int:
    return int(c.bpf_object__open_file(os.fsencode(path), None))


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


def pin_map(map_ptr: int, path: str) -> None:
    c.bpf_map__pin(map_ptr, os.fsencode(path))


def unpin_map(map_ptr: int, path: str) -> None:
    c.bpf_map__unpin(map_ptr, os.fsencode(path))


def map_update(fd: int, key: bytes, value: bytes, flags: int = 0) -> None:
    c.bpf_map_update_elem(fd, key, value, flags)


def map_lookup(fd: int, key: bytes, value_size: int) -> bytes:
    out = ctypes.create_string_buffer(value_size)
    c.bpf_map_lookup_elem(fd, key, out)
    return out.raw


def pinned_object_fd(path: str) -> int:
    return int(c.bpf_obj_get(os.fsencode(path)))


@dataclass(frozen=True)
class MapInfo:
    type: int
    id: int
    key_size: int
    value_size: int
    max_entries: int
    flags: int
    name: str


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
    """What the kernel says of the BPF object behind ``fd`` (EINVAL if it is not a map)."""
    return read_map_info(fd, _bpf_map_info(), c.bpf_obj_get_info_by_fd)


def read_map_info(fd: int, info: Any, get_info: Any) -> MapInfo:
    """``get_info`` (a ``bpf_obj_get_info_by_fd``) into ``info`` (its ``bpf_map_info``)."""
    size = ctypes.c_uint32(ctypes.sizeof(info))
    get_info(fd, ctypes.byref(info), ctypes.byref(size))
    return MapInfo(
        type=info.type,
        id=info.id,
        key_size=info.key_size,
        value_size=info.value_size,
        max_entries=info.max_entries,
        flags=info.map_flags,
        name=info.name.decode(errors="replace"),
    )


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


def _ignore_event(ctx: int | None, cpu: int, event: int | None) -> int:
    # aperf never asks libbpf to consume (it reads the rings itself), so libbpf
    # never calls this; perf_buffer__new_raw just needs a valid pointer.
    return 0


_unused_event_callback = c.PERF_EVENT_FN(_ignore_event)


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


class PerfRings:
    """libbpf's ``perf_buffer`` for one map: one ring per listed CPU, slots keyed by CPU id."""

    def __init__(
        self,
        map_fd: int,
        page_count: int,
        cpus: list[int],
        *,
        wakeup_events: int = 1,
        wakeup_watermark: int = 0,
        count_lost: bool = False,
    ) -> None:
        self._pb = 0
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
        keys = (ctypes.c_int * len(cpus))(*cpus)
        opts = _perf_buffer_raw_opts()
        opts.sz = ctypes.sizeof(opts)
        opts.cpu_cnt = len(cpus)
        opts.cpus = keys
        opts.map_keys = keys
        self._pb = int(
            c.perf_buffer__new_raw(
                map_fd, page_count, ctypes.byref(attr), _unused_event_callback, None,
                ctypes.byref(opts),
            )
        )
        try:
            self.rings = self._collect(cpus)
        except BaseException:
            self.free()
            raise

    def _collect(self, cpus: list[int]) -> list[RingHandle]:
        count = int(c.perf_buffer__buffer_cnt(self._pb))
        rings = []
        for index in range(count):
            base = ctypes.c_void_p()
            size = ctypes.c_size_t()
            c.perf_buffer__buffer(self._pb, index, ctypes.byref(base), ctypes.byref(size))
            fd = int(c.perf_buffer__buffer_fd(self._pb, index))
            assert base.value is not None
            rings.append(RingHandle(cpus[index], fd, RingMemory(base.value)))
        return rings

    def free(self) -> None:
        """Unmap the rings, close their fds and delete the map slots (idempotent)."""
        pb, self._pb = self._pb, 0
        if pb:
            for ring in getattr(self, "rings", ()):
                ring.memory.release()
            c.perf_buffer__free(pb)
