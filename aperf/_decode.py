"""Decoders: from the BPF object's BTF, from ctypes structures, from struct formats.

Every decoder is a callable ``bytes -> value`` that reads the type's own size
from the start of the sample (the kernel pads samples, see docs/decoding.md)
and raises ``ValueError`` when the sample is shorter than the type. Decoded
records are named tuples: immutable, attribute access, a readable repr, built
at C speed, equal to plain tuples, and ``_asdict()`` for JSON.
"""

from __future__ import annotations

import enum
import itertools
import keyword
import re
import struct
from collections import namedtuple
from collections.abc import Callable
from typing import Any

from . import _libbpf as lb
from ._errors import UnknownNameError

Decoder = Callable[[bytes], Any]
DecoderSpec = Decoder | struct.Struct | str | type | None

_IDENTIFIER = re.compile(r"^(struct\s+)?[A-Za-z_][A-Za-z0-9_]*$")


def c_string(raw: bytes) -> str:
    """A C ``char[N]``: cut at the first NUL, invalid UTF-8 replaced (never raises)."""
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


class SizedDecoder:
    """A decoder of fixed-size records: ``size`` bytes unpacked by ``fmt``, then built."""

    def __init__(
        self,
        name: str,
        fmt: struct.Struct,
        build: Callable[[tuple[Any, ...]], Any] | None,
        build_many: Callable[[list[bytes]], list[Any]] | None = None,
    ) -> None:
        self.name = name
        self.size = fmt.size
        self.struct = fmt
        self.build = build
        self._build_many = build_many
        unpack_from = fmt.unpack_from
        size = fmt.size
        if build is None:

            def decode(data: bytes) -> Any:
                if len(data) < size:
                    raise ValueError(f"{name} needs {size} bytes, the sample has {len(data)}")
                return unpack_from(data)
        else:

            def decode(data: bytes) -> Any:
                if len(data) < size:
                    raise ValueError(f"{name} needs {size} bytes, the sample has {len(data)}")
                return build(unpack_from(data))

        self._decode = decode

    def decode_many(self, payloads: list[bytes]) -> list[Any]:
        """Decode payloads already known to be long enough, at C speed where possible."""
        if self._build_many is not None:
            return self._build_many(payloads)
        unpacked = map(self.struct.unpack_from, payloads)
        return list(unpacked if self.build is None else map(self.build, unpacked))

    def __call__(self, data: bytes) -> Any:
        return self._decode(data)

    def __repr__(self) -> str:
        return f"<aperf decoder {self.name} ({self.size} bytes)>"


# --- struct formats -----------------------------------------------------------------


def from_struct(fmt: struct.Struct | str, names: str | list[str] | None = None) -> SizedDecoder:
    """Decode with a ``struct`` format; with ``names``, into a named tuple ``Record``."""
    packed = fmt if isinstance(fmt, struct.Struct) else struct.Struct(fmt)
    if names is None:
        return SizedDecoder(f"struct {packed.format!r}", packed, None)
    record = namedtuple("Record", names, rename=True)  # type: ignore[misc]
    return SizedDecoder(f"struct {packed.format!r}", packed, record._make)


# --- ctypes structures (duck-typed: ctypes itself stays in aperf._libbpf) ---------------


def _is_ctypes_structure(spec: object) -> bool:
    return (
        isinstance(spec, type)
        and hasattr(spec, "_fields_")
        and hasattr(spec, "from_buffer_copy")
    )


def from_ctypes(cls: type) -> Decoder:
    """Decode into a named tuple with the fields of a ``ctypes.Structure`` subclass.

    ``char`` arrays become ``str`` (cut at NUL), other arrays tuples, nested
    structures named tuples: the same values a BTF decoder gives for the C type.
    """
    size = memoryview(cls()).nbytes
    name = cls.__name__

    def convert(value: Any) -> Any:
        if isinstance(value, bytes):
            return c_string(value)
        if _is_ctypes_structure(type(value)):
            return record_of(value)
        if hasattr(value, "_length_") and hasattr(value, "_type_"):
            return tuple(convert(v) for v in value)
        return value

    records: dict[type, Any] = {}

    def record_of(instance: Any) -> Any:
        kind = type(instance)
        record: Any = records.get(kind)
        names = [f[0] for f in kind._fields_]
        if record is None:
            record = records[kind] = namedtuple(kind.__name__, names, rename=True)
        return record._make(convert(getattr(instance, n)) for n in names)

    def decode(data: bytes) -> Any:
        if len(data) < size:
            raise ValueError(f"{name} needs {size} bytes, the sample has {len(data)}")
        return record_of(cls.from_buffer_copy(data[:size]))  # type: ignore[attr-defined]

    return decode


# --- BTF -------------------------------------------------------------------------------

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


def from_btf(obj: Any, type_name: str) -> SizedDecoder:
    """Decode samples as the C struct ``type_name`` described by ``obj``'s BTF.

    ``obj`` is an :class:`aperf.BPFObject` (open). Integers of every width and
    signedness, bool, enums (as ``IntEnum`` members when the value is named),
    nested structs and fixed arrays are supported; ``char[N]`` becomes ``str``.
    """
    name = type_name.removeprefix("struct").strip()
    btf = lb.object_btf(obj._ptr) if not obj.closed else None
    if btf is None:
        raise UnknownNameError("BTF type (the object has no BTF or is closed)", name, [])
    type_id = btf.find(name, lb.BTF_KIND_STRUCT)
    if type_id is None:
        known = []
        for i in range(1, btf.type_count()):
            t = btf.type(i)
            if t.kind == lb.BTF_KIND_STRUCT and t.name:
                known.append(t.name)
        raise UnknownNameError("struct in the object's BTF", name, known)
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


def resolve_decoder(spec: DecoderSpec, source: object) -> Decoder | None:
    """What ``decoder=`` accepts: None, a callable, a ctypes Structure subclass, a
    ``struct.Struct`` or format string, or a struct name found in the map's object's BTF."""
    if spec is None:
        return None
    if _is_ctypes_structure(spec):
        return from_ctypes(spec)  # type: ignore[arg-type]
    if isinstance(spec, struct.Struct):
        return from_struct(spec)
    if isinstance(spec, str):
        if _IDENTIFIER.match(spec) and not keyword.iskeyword(spec):
            owner = getattr(source, "object", None)
            if owner is None:
                raise TypeError(
                    f"decoder={spec!r} names a BTF struct, but the source is not a map of an "
                    "aperf.BPFObject; pass aperf.decoders.from_btf(obj, name) instead"
                )
            return from_btf(owner, spec)
        return from_struct(spec)
    if callable(spec):
        return spec
    raise TypeError(f"cannot decode with {spec!r}")
