"""BTF (libbpf-rs: ``btf/``): the type records of a BPF object's BTF, read through libbpf."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any

from ..._errors import LibbpfError
from . import binding as c
from .object import cstr

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
