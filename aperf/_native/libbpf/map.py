"""Maps (libbpf-rs: ``map.rs``): their elements, every size checked before the syscall
reads or writes our memory; their initial values and types before load; maps made or
found by id."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from ..._errors import ArgumentError
from . import binding as c
from .query import map_info

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
