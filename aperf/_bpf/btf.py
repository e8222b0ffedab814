"""BTF in one place: struct decoders compiled from a BTF handle, and the DATASEC
lookup behind ``BPFObject.set_global``.

The binding (``_native/libbpf``) hands out raw BTF type records; this module gives
them meaning. Its functions take the handle (``lb.Btf``, from
``BPFObject.btf()``) and the object file's path for hints, as libbpf-rs's
``Btf::from_bpf_object`` does, so this room knows no ``BPFObject``: the public
``aperf.decoders.from_btf(obj, name)`` joins the two.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._decoding.decode import SizedDecoder, compile_layout
from .._decoding.layout import (
    ArrayType,
    CType,
    EnumType,
    FloatType,
    IntType,
    Member,
    OpaqueType,
    PointerType,
    RecordType,
)
from .._errors import LibbpfError, UnknownNameError
from .._native import libbpf as lb

_LOADED_SECTIONS = (".rodata", ".data", ".bss")


class _BtfLayouts:
    """BTF types as layouts (``_decoding/layout.py``): what a decoder is compiled from."""

    def __init__(self, btf: lb.Btf) -> None:
        self.btf = btf
        self._done: dict[tuple[int, str], CType] = {}

    def ctype(self, type_id: int, typedef: str = "") -> CType:
        """The layout of a type; ``typedef`` names an anonymous struct, union or enum."""
        t = self.btf.type(type_id)
        while t.kind == lb.BTF_KIND_TYPEDEF or self.btf.skip_modifiers(t.id).id != t.id:
            if t.kind == lb.BTF_KIND_TYPEDEF and not typedef:
                typedef = t.name  # the name of an anonymous struct, union or enum
            t = self.btf.type(t.ref)
        key = (t.id, typedef)
        if key not in self._done:
            self._done[key] = self._convert(t, typedef)
        return self._done[key]

    def _convert(self, t: lb.BtfType, typedef: str) -> CType:
        if t.kind == lb.BTF_KIND_INT:
            if t.int_encoding & lb.BTF_INT_BOOL and t.size == 1:
                return IntType(1, False, "bool")
            if t.size not in (1, 2, 4, 8) or t.int_offset or t.int_bits != t.size * 8:
                return OpaqueType(t.size)
            signed = bool(t.int_encoding & lb.BTF_INT_SIGNED)
            return IntType(t.size, signed, "char" if t.name == "char" else "int")
        if t.kind in (lb.BTF_KIND_ENUM, lb.BTF_KIND_ENUM64):
            return EnumType(t.name or typedef, t.size, t.kind_flag, t.enum_values)
        if t.kind == lb.BTF_KIND_PTR:
            return PointerType(8)
        if t.kind == lb.BTF_KIND_FLOAT:
            return FloatType(t.size) if t.size in (2, 4, 8) else OpaqueType(t.size)
        if t.kind == lb.BTF_KIND_ARRAY:
            return ArrayType(self.ctype(t.array_elem), t.array_len)
        if t.kind in (lb.BTF_KIND_STRUCT, lb.BTF_KIND_UNION):
            name = t.name or typedef or "anon"
            members = []
            for member in t.members:
                if member.bitfield_size or member.bit_offset % 8:
                    raise TypeError(
                        f"struct {name}: bitfield member {member.name!r} is not supported"
                    )
                members.append(Member(member.name, member.bit_offset // 8,
                                      self.ctype(member.type_id)))
            return RecordType(name, t.kind == lb.BTF_KIND_UNION, t.size, tuple(members))
        try:
            size = self.btf.resolve_size(t.id)
        except LibbpfError:
            size = 0
        return OpaqueType(size)  # functions, forward declarations: their bytes, if any


def btf_layout(btf: lb.Btf, type_name: str, path: str = "the object") -> RecordType:
    """The layout of struct ``type_name`` (or of the struct a typedef of that name means);
    ``path`` names the object file in the hint of a miss."""
    name = type_name.removeprefix("struct ").strip()
    layout = _BtfLayouts(btf).ctype(find_struct(btf, name, path), typedef=name)
    assert isinstance(layout, RecordType)
    return layout


def btf_decoder(btf: lb.Btf | None, type_name: str, path: str) -> SizedDecoder:
    """A decoder of the C struct ``type_name`` described by ``btf`` (None: the object
    at ``path`` has no BTF); ``aperf.decoders.from_btf`` documents what it decodes."""
    name = type_name.removeprefix("struct ").strip()
    if btf is None:
        raise UnknownNameError("BTF type (the object has no BTF)", name, [])
    return compile_layout(btf_layout(btf, name, path), f"struct {name}", "<")


def find_struct(btf: lb.Btf, name: str, path: str = "the object") -> int:
    """The type id of struct ``name``, or of the struct a typedef ``name`` stands for.

    ``path`` names the object file in the error's hint.
    """
    type_id = btf.find(name, lb.BTF_KIND_STRUCT)
    if type_id is not None:
        return type_id
    typedef = btf.find(name, lb.BTF_KIND_TYPEDEF)
    if typedef is not None:
        target = btf.skip_modifiers(typedef)
        if target.kind == lb.BTF_KIND_STRUCT:
            return target.id
    known = []
    for i in range(1, btf.type_count()):
        t = btf.type(i)
        if t.name and lb.BTF_KIND_STRUCT in (t.kind, btf.skip_modifiers(t.id).kind):
            known.append(t.name)
    raise UnknownNameError("struct in the object's BTF", name, known, struct_hint(name, path))


def struct_hint(name: str, path: str) -> str:
    """How a struct gets into an object's BTF: the usual cause of a miss."""
    return (
        "clang writes a struct into the object's BTF only if a global variable or a "
        "function's signature uses it, not a stack variable (such as the one handed to "
        f"bpf_perf_event_output()): add e.g. 'struct {name} *unused_{name} "
        "__attribute__((unused));' to the .bpf.c and rebuild; "
        f"'bpftool btf dump file {path} | grep STRUCT' lists the structs it holds"
    )


# --- globals ---------------------------------------------------------------------------


@dataclass(frozen=True)
class GlobalSlot:
    """Where a global lives: its section, offset and size, how to encode it, and its
    BTF type (``type_id``, for ``global_decoder``)."""

    section: str
    offset: int
    size: int
    signed: bool
    is_int: bool
    type_id: int = 0


def global_slots(btf: lb.Btf | None) -> dict[str, GlobalSlot]:
    """Every global of ``.rodata``, ``.data`` and ``.bss``, by name, in section order."""
    slots: dict[str, GlobalSlot] = {}
    if btf is None:
        return slots
    for type_id in range(1, btf.type_count()):
        sec = btf.type(type_id)
        if sec.kind != lb.BTF_KIND_DATASEC or sec.name not in _LOADED_SECTIONS:
            continue
        for var_id, offset, size in sec.datasec_vars:
            var = btf.type(var_id)
            target = btf.skip_modifiers(var.ref)
            is_int = target.kind in (lb.BTF_KIND_INT, lb.BTF_KIND_ENUM, lb.BTF_KIND_ENUM64)
            signed = (
                bool(target.int_encoding & lb.BTF_INT_SIGNED)
                if target.kind == lb.BTF_KIND_INT
                else target.kind_flag if is_int else False
            )
            slots.setdefault(var.name, GlobalSlot(sec.name, offset, size, signed, is_int,
                                                  var.ref))
    return slots


def global_slot(btf: lb.Btf | None, name: str) -> GlobalSlot:
    """The DATASEC slot of global ``name`` (``.rodata``, ``.data`` or ``.bss``)."""
    slots = global_slots(btf)
    try:
        return slots[name]
    except KeyError:
        raise UnknownNameError("global", name, list(slots)) from None


def global_decoder(btf: lb.Btf, name: str, slot: GlobalSlot) -> SizedDecoder:
    """A decoder of global ``name``'s bytes whose one field is its value, decoded as a
    member of that type is in a sample (ints, enums, structs, arrays, char arrays)."""
    value = _BtfLayouts(btf).ctype(slot.type_id)
    holder = RecordType(f"global {name}", False, slot.size, (Member("value", 0, value),))
    return compile_layout(holder, f"global {name}", "<")
