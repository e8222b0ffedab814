"""C type layouts: one description of a sample's type, whatever it was declared with.

A BTF struct (``_bpf/btf.py``), a ctypes structure and a ``struct`` format all
become the same small tree of ``CType`` nodes; decoders (``decode.py``)
and NumPy dtypes (``dtype_spec``) are compiled from that tree only, so a
ctypes structure and the BTF struct of the same layout decode to equal values
by construction. Pure Python: NumPy is never imported here.
"""

from __future__ import annotations

import keyword
import re
import struct
import sys
from dataclasses import dataclass
from typing import Any, Literal, Union

# --- the tree ----------------------------------------------------------------------------


@dataclass(frozen=True)
class IntType:
    """An integer; ``kind`` "char" is C's plain ``char``, "bool" is ``_Bool``."""

    size: int
    signed: bool
    kind: Literal["int", "char", "bool"] = "int"


@dataclass(frozen=True)
class FloatType:
    size: int


@dataclass(frozen=True)
class EnumType:
    name: str
    size: int
    signed: bool
    members: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class PointerType:
    size: int = 8


@dataclass(frozen=True)
class OpaqueType:
    """Bytes aperf gives no meaning (odd-sized integers, functions, forward declarations)."""

    size: int


@dataclass(frozen=True)
class ArrayType:
    """``elem[count]``; a count of 0 at the end of the outer struct is a flexible array."""

    elem: CType
    count: int


@dataclass(frozen=True)
class Member:
    """A member at a byte offset; an empty name is an anonymous struct or union."""

    name: str
    offset: int
    type: CType


@dataclass(frozen=True)
class RecordType:
    """A struct or a union."""

    name: str
    union: bool
    size: int
    members: tuple[Member, ...]


CType = Union[IntType, FloatType, EnumType, PointerType, OpaqueType, ArrayType, RecordType]  # noqa: UP007


def is_byte(t: CType) -> bool:
    """A 1-byte integer that is not a bool: arrays of it are text (char) or bytes."""
    return isinstance(t, IntType) and t.size == 1 and t.kind != "bool"


def is_plain_number(t: CType) -> bool:
    """Decoded as the number ``struct`` gives, with no conversion."""
    return isinstance(t, IntType | FloatType | PointerType) and not (
        isinstance(t, IntType) and t.size not in (1, 2, 4, 8)
    )


def flexible_member(record: RecordType) -> Member | None:
    """The trailing flexible array member (``u8 data[]`` or ``[0]``) a struct ends with."""
    if record.union or not record.members:
        return None
    last = record.members[-1]
    if isinstance(last.type, ArrayType) and last.type.count == 0 and last.name:
        return last
    return None


# --- names -------------------------------------------------------------------------------


def field_name(c_name: str) -> str:
    """The Python name of a C member: as in C, but a keyword or a name starting with an
    underscore (named tuples reserve those) loses its leading underscores and gets a
    trailing one: ``from`` -> ``from_``, ``__pad`` -> ``pad_``."""
    if keyword.iskeyword(c_name) or c_name.startswith("_"):
        return c_name.lstrip("_") + "_"
    return c_name


def flat_members(record: RecordType, base: int = 0) -> list[tuple[str, int, CType]]:
    """The members of a record as (Python name, offset, type), anonymous members' own
    members lifted into it as C does (``rec.pid`` for ``struct { union { u32 pid; }; }``).

    An anonymous union stays one entry (name ""): its members overlap, a decoder
    reads them from the union's bytes. Duplicates and unusable names become
    positional ``_N`` (the named-tuple rule).
    """
    out: list[tuple[str, int, CType]] = []
    for member in record.members:
        offset = base + member.offset
        t = member.type
        if not member.name and isinstance(t, RecordType):
            if t.union and not record.union:
                out.append(("", offset, t))
            else:
                out.extend(flat_members(t, offset))
            continue
        out.append((member.name, offset, t))
    return out


def python_names(c_names: list[str]) -> list[str]:
    """Python names for a record's fields, unique, each a valid named-tuple field."""
    names: list[str] = []
    for index, c_name in enumerate(c_names):
        name = field_name(c_name)
        if not name.isidentifier() or keyword.iskeyword(name) or name.startswith("_") or (
            name in names
        ):
            name = f"_{index}"
        names.append(name)
    return names


def record_fields(record: RecordType) -> list[tuple[str, int, CType]]:
    """The decoded fields of a record: every anonymous member lifted, Python-named, in C order."""
    raw: list[tuple[str, int, CType]] = []
    for name, offset, t in flat_members(record):
        if not name and isinstance(t, RecordType):
            raw.extend(flat_members(t, offset))  # an anonymous union's members, overlapping
        else:
            raw.append((name, offset, t))
    names = python_names([name for name, _, _ in raw])
    return [(py, offset, t) for py, (_, offset, t) in zip(names, raw, strict=True)]


# --- struct formats ----------------------------------------------------------------------

_TOKEN = re.compile(r"\s*(\d*)\s*([xcbB?hHiIlLqQnNefdspP])")
_STANDARD_ORDERS = "<>!="


def struct_layout(packed: struct.Struct, names: list[str] | None) -> RecordType:
    """The layout a ``struct`` format describes: one member per value it unpacks.

    Members are named ``names`` (the rule of ``python_names``) or ``f0``,
    ``f1``... (NumPy's default). ``s`` and ``c`` are bytes; ``p`` is refused.
    """
    fmt = packed.format
    order = fmt[0] if fmt[:1] in ("@", *_STANDARD_ORDERS) else "@"
    body = (fmt[1:] if fmt[:1] in ("@", *_STANDARD_ORDERS) else fmt).rstrip()
    members: list[tuple[int, CType]] = []
    prefix = order
    pos = 0
    while pos < len(body):
        match = _TOKEN.match(body, pos)
        if match is None:
            raise ValueError(f"struct format {fmt!r}: cannot read {body[pos:]!r}")
        pos = match.end()
        count, code = int(match.group(1) or 1), match.group(2)
        if code == "p":
            raise TypeError(f"struct format {fmt!r}: 'p' (Pascal strings) has no array layout")
        if code in "sx":
            if code == "s":
                members.append((struct.calcsize(prefix), ArrayType(IntType(1, False), count)))
            prefix += f"{count}{code}"
            continue
        for _ in range(count):
            # "0X" aligns to X without adding one: the offset of the next X (native mode).
            members.append((struct.calcsize(prefix + f"0{code}"),
                            _struct_code(code, struct.calcsize(order + code))))
            prefix += code
    if names is not None and len(names) != len(members):
        raise ValueError(f"struct format {fmt!r} has {len(members)} values, {len(names)} names")
    labels = python_names(list(names)) if names is not None else [
        f"f{i}" for i in range(len(members))
    ]
    return RecordType(
        "Record" if names is not None else "struct",
        False,
        packed.size,
        tuple(Member(n, o, t) for n, (o, t) in zip(labels, members, strict=True)),
    )


def byte_order(fmt: str) -> str:
    """``<`` or ``>`` for a struct format's byte order (``@`` and ``=`` are the machine's)."""
    first = fmt[:1]
    if first in ("<", ">"):
        return first
    if first == "!":
        return ">"
    return "<" if sys.byteorder == "little" else ">"


def _struct_code(code: str, size: int) -> CType:
    if code == "c":
        return ArrayType(IntType(1, False), 1)
    if code == "?":
        return IntType(1, False, "bool")
    if code in "efd":
        return FloatType(size)
    if code == "P":
        return PointerType(size)
    return IntType(size, code.islower())


# --- ctypes structures -------------------------------------------------------------------

_CTYPES_INTS = "bBhHiIlLqQ"
_NATIVE_ORDER = "__ctype_le__" if sys.byteorder == "little" else "__ctype_be__"


def ctypes_layout(cls: type) -> RecordType:
    """The layout of a ``ctypes.Structure`` (or ``Union``) subclass, from ctypes' own offsets.

    ``_anonymous_`` members are anonymous, as in C. Refused with a TypeError
    naming the field: bitfields, byte-swapped structures, ``c_wchar``,
    ``c_longdouble``, ``py_object`` (BTF decoders refuse bitfields too).
    """
    import ctypes

    return _ctypes_record(ctypes, cls, cls.__name__)


def _ctypes_record(ctypes: Any, cls: Any, where: str) -> RecordType:
    if hasattr(cls, "_swappedbytes_"):
        raise TypeError(f"{where}: byte-swapped structures are not supported")
    fields: list[tuple[Any, ...]] = []
    for base in reversed(cls.__mro__):  # a subclass's fields follow its base's
        fields.extend(base.__dict__.get("_fields_", ()))
    anonymous = set(getattr(cls, "_anonymous_", ()))
    members = []
    for field in fields:
        name, ftype = field[0], field[1]
        if len(field) > 2:
            raise TypeError(f"{where}: bitfield member {name!r} is not supported")
        members.append(Member(
            "" if name in anonymous else name,
            getattr(cls, name).offset,
            _ctypes_type(ctypes, ftype, f"{where}.{name}"),
        ))
    return RecordType(cls.__name__, issubclass(cls, ctypes.Union), ctypes.sizeof(cls),
                      tuple(members))


def _ctypes_type(ctypes: Any, t: Any, where: str) -> CType:
    if not isinstance(t, type):
        raise TypeError(f"{where}: {t!r} is not a ctypes type")
    if issubclass(t, ctypes.Structure | ctypes.Union):
        return _ctypes_record(ctypes, t, where)
    if issubclass(t, ctypes.Array):
        return ArrayType(_ctypes_type(ctypes, getattr(t, "_type_"), where),  # noqa: B009
                         getattr(t, "_length_"))  # noqa: B009
    if issubclass(t, ctypes._Pointer):
        return PointerType(ctypes.sizeof(t))
    code = getattr(t, "_type_", None)
    if not isinstance(code, str):
        raise TypeError(f"{where}: {t.__name__} is not a ctypes type aperf can decode")
    if getattr(t, _NATIVE_ORDER, t) is not t:
        raise TypeError(f"{where}: byte-swapped fields are not supported")
    size = ctypes.sizeof(t)
    if code == "c":
        return IntType(1, True, "char")  # C's char: signed on x86-64 and on BPF
    if code == "?":
        return IntType(1, False, "bool")
    if code in _CTYPES_INTS:
        return IntType(size, code.islower())
    if code in "fd":
        return FloatType(size)
    if code in "zZP":
        return PointerType(size)
    raise TypeError(f"{where}: ctypes type code {code!r} ({t.__name__}) is not supported")


# --- NumPy dtypes (as plain Python specs: numpy.dtype(spec) builds them) -----------------


def dtype_spec(record: RecordType, order: str = "<", *, size: int | None = None) -> dict[str, Any]:
    """A NumPy structured-dtype spec (``names``, ``formats``, ``offsets``, ``itemsize``).

    The same fields, names and flattening as the decoder's records (a union's
    members overlap). A trailing flexible array is left out (its bytes are a
    sample's tail); ``size`` is the itemsize (default: the C size).
    """
    fields = record_fields(record)
    if flexible_member(record) is not None:
        fields = fields[:-1]
    fields = [f for f in fields if type_size(f[2])]
    return {
        "names": [name for name, _, _ in fields],
        "formats": [_dtype_of(t, order) for _, _, t in fields],
        "offsets": [offset for _, offset, _ in fields],
        "itemsize": record.size if size is None else size,
    }


def type_size(t: CType) -> int:
    if isinstance(t, ArrayType):
        return t.count * type_size(t.elem)
    return t.size


def _dtype_of(t: CType, order: str) -> Any:
    if isinstance(t, IntType):
        if t.kind == "bool":
            return "?"
        if t.size not in (1, 2, 4, 8):
            return f"V{t.size}"
        return f"{order}{'i' if t.signed else 'u'}{t.size}"
    if isinstance(t, EnumType):
        return _dtype_of(IntType(t.size, t.signed), order) if t.size in (1, 2, 4, 8) else (
            f"V{t.size}"
        )
    if isinstance(t, FloatType):
        return f"{order}f{t.size}"
    if isinstance(t, PointerType):
        return f"{order}u{t.size}"
    if isinstance(t, OpaqueType):
        return f"V{t.size}"
    if isinstance(t, ArrayType):
        shape = [t.count]
        elem = t.elem
        while isinstance(elem, ArrayType):
            shape.append(elem.count)
            elem = elem.elem
        if isinstance(elem, IntType) and elem.kind == "char":
            last = shape.pop()  # the innermost char[N] is one string
            return f"S{last}" if not shape else (f"S{last}", tuple(shape))
        return (_dtype_of(elem, order), tuple(shape))
    return dtype_spec(t, order)  # a nested struct, or a union (its members overlap)
