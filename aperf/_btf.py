"""BTF in one place: struct decoders compiled from a BPF object's BTF, and the
DATASEC lookup behind ``BPFObject.set_global``.

The binding (``_libbpf``) hands out raw BTF type records; this module gives
them meaning. Only BPF objects and decoders built from them come here.
"""

from __future__ import annotations

import enum
import itertools
import struct
from collections import namedtuple
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import _libbpf as lb
from ._decode import SizedDecoder
from ._errors import UnknownNameError

if TYPE_CHECKING:
    from ._object import BPFObject

_LOADED_SECTIONS = (".rodata", ".data", ".bss")

_INT_FORMATS = {(1, False): "B", (1, True): "b", (2, False): "H", (2, True): "h",
                (4, False): "I", (4, True): "i", (8, False): "Q", (8, True): "q"}


class _BtfCompiler:
    """Turns a BTF struct into one struct format plus generated code that builds records."""

    def __init__(self, btf: lb.Btf) -> None:
        self.btf = btf
        self.fmt: list[str] = []
        self.fields = 0  # how many values the flat format yields so far
        self.pos = 0  # byte position the format has reached
        self.env: dict[str, Any] = {"_tn": tuple.__new__}
        self.last_record = ""

    def _pad_to(self, offset: int) -> None:
        if offset > self.pos:
            self.fmt.append(f"{offset - self.pos}x")
            self.pos = offset

    def _take(self, code: str, size: int) -> str:
        self.fmt.append(code)
        self.pos += size
        index = self.fields
        self.fields += 1
        return f"t[{index}]"

    def compile(self, type_id: int, offset: int) -> str:
        """Emit the format for the type at ``offset``; return the expression building its value."""
        t = self.btf.skip_modifiers(type_id)
        self._pad_to(offset)
        if t.kind == lb.BTF_KIND_INT:
            if t.int_encoding & lb.BTF_INT_BOOL and t.size == 1:
                return self._take("?", 1)
            if t.size not in (1, 2, 4, 8) or t.int_offset or t.int_bits != t.size * 8:
                return self._opaque(t.size)
            return self._take(_INT_FORMATS[(t.size, bool(t.int_encoding & lb.BTF_INT_SIGNED))],
                              t.size)
        if t.kind in (lb.BTF_KIND_ENUM, lb.BTF_KIND_ENUM64):
            if t.size not in (1, 2, 4, 8):
                return self._opaque(t.size)
            expr = self._take(_INT_FORMATS[(t.size, t.kind_flag)], t.size)
            convert = self._enum(t)
            return f"{convert}({expr})" if convert else expr
        if t.kind == lb.BTF_KIND_PTR:
            return self._take("Q", 8)
        if t.kind == lb.BTF_KIND_FLOAT and t.size in (4, 8):
            return self._take("f" if t.size == 4 else "d", t.size)
        if t.kind == lb.BTF_KIND_ARRAY:
            return self._array(t, offset)
        if t.kind == lb.BTF_KIND_STRUCT:
            return self._struct(t, offset)
        size = self.btf.resolve_size(t.id)
        return self._opaque(size)  # unions and anything else: their raw bytes

    def _opaque(self, size: int) -> str:
        return self._take(f"{size}s", size)

    def _enum(self, t: lb.BtfType) -> str | None:
        if not t.enum_values or not t.name:
            return None
        members = dict(t.enum_values)
        try:
            cls = enum.IntEnum(t.name, members)  # type: ignore[misc]
        except (ValueError, TypeError):
            return None
        values = {int(m): m for m in cls}
        name = f"_enum{len(self.env)}"
        self.env[name] = lambda v, _get=values.get: _get(v, v)
        return name

    def _array(self, t: lb.BtfType, offset: int) -> str:
        elem = self.btf.skip_modifiers(t.array_elem)
        count = t.array_len
        is_bool = bool(elem.int_encoding & lb.BTF_INT_BOOL)
        if elem.kind == lb.BTF_KIND_INT and elem.size == 1 and not is_bool:
            raw = self._take(f"{count}s", count)
            if elem.name != "char":
                return raw
            # c_string() inlined: a function call per field costs more than the work.
            return f"{raw}.partition(b'\\0')[0].decode('utf-8', 'replace')"
        elem_size = self.btf.resolve_size(elem.id)
        parts = [self.compile(elem.id, offset + i * elem_size) for i in range(count)]
        return "(" + "".join(p + ", " for p in parts) + ")"

    def _struct(self, t: lb.BtfType, offset: int) -> str:
        names: list[str] = []
        exprs: list[str] = []
        for member in t.members:
            if member.bitfield_size or member.bit_offset % 8:
                raise TypeError(
                    f"struct {t.name}: bitfield member {member.name!r} is not supported"
                )
            names.append(member.name or f"_anon{len(names)}")
            exprs.append(self.compile(member.type_id, offset + member.bit_offset // 8))
        self._pad_to(offset + t.size)
        record = namedtuple(t.name or "anon", names, rename=True)  # type: ignore[misc]
        name = f"_rec{len(self.env)}"
        self.env[name] = record
        self.last_record = name  # the outermost struct is compiled last
        # tuple.__new__ straight away: a named tuple's own __new__ is a Python call.
        return f"_tn({name}, ({''.join(e + ', ' for e in exprs)}))"


def from_btf(obj: BPFObject, type_name: str) -> SizedDecoder:
    """Decode samples as the C struct ``type_name`` described by ``obj``'s BTF.

    ``obj`` is an open [`BPFObject`][aperf.BPFObject]; ``type_name`` a struct name
    (``"event"`` or ``"struct event"``) or a typedef of a struct. Integers of every width and
    signedness, bool, enums (as ``IntEnum`` members when the value is named),
    nested structs and fixed arrays are supported; ``char[N]`` becomes ``str``.
    """
    name = type_name.removeprefix("struct ").strip()
    btf = obj._btf()
    if btf is None:
        raise UnknownNameError("BTF type (the object has no BTF)", name, [])
    type_id = find_struct(btf, name, obj.path)
    compiler = _BtfCompiler(btf)
    expr = compiler.compile(type_id, 0)
    packed = struct.Struct("<" + "".join(compiler.fmt))
    env = dict(compiler.env, _unpack=packed.unpack_from, _map=map, _repeat=itertools.repeat)
    # Generated from BTF names and counts only. When every field maps straight
    # across (no strings, enums or nesting), records are made from the unpacked
    # tuples with no per-record Python code at all.
    fields = "".join(f"t[{i}], " for i in range(compiler.fields))
    build = eval(f"lambda t: {expr}", env)
    if expr == f"_tn({compiler.last_record}, ({fields}))":
        record = env[compiler.last_record]
        many = eval(
            "lambda payloads: list(_map(_tn, _repeat(_record), _map(_unpack, payloads)))",
            dict(env, _record=record),
        )
    else:
        many = eval(f"lambda payloads: [{expr} for t in _map(_unpack, payloads)]", env)
    return SizedDecoder(f"struct {name}", packed, build, many)


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
    """Where a global lives: its section, offset and size, and how to encode it."""

    section: str
    offset: int
    size: int
    signed: bool
    is_int: bool


def global_slot(btf: lb.Btf | None, name: str) -> GlobalSlot:
    """The DATASEC slot of global ``name`` (``.rodata``, ``.data`` or ``.bss``)."""
    known: list[str] = []
    if btf is not None:
        for type_id in range(1, btf.type_count()):
            sec = btf.type(type_id)
            if sec.kind != lb.BTF_KIND_DATASEC or sec.name not in _LOADED_SECTIONS:
                continue
            for var_id, offset, size in sec.datasec_vars:
                var = btf.type(var_id)
                known.append(var.name)
                if var.name != name:
                    continue
                target = btf.skip_modifiers(var.ref)
                is_int = target.kind in (lb.BTF_KIND_INT, lb.BTF_KIND_ENUM, lb.BTF_KIND_ENUM64)
                signed = (
                    bool(target.int_encoding & lb.BTF_INT_SIGNED)
                    if target.kind == lb.BTF_KIND_INT
                    else target.kind_flag if is_int else False
                )
                return GlobalSlot(sec.name, offset, size, signed, is_int)
    raise UnknownNameError("global", name, known)
