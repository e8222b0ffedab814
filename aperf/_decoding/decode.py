"""Decoders: what every decoder is, and decoders compiled from C type layouts.

Every decoder is a callable ``bytes -> value`` that reads the type's own size
from the start of the sample (the kernel pads samples, see docs/decoding.md)
and raises ``ValueError`` when the sample is shorter than the type.

BTF structs (``_bpf/btf.py``) and ctypes structures both become a layout
(``layout.py``) and are compiled here, once, into a single ``struct`` format
plus generated code that builds records: the same C layout decodes to equal
values whichever way it was declared. Records are named tuples (immutable,
attribute access, a readable repr, built at C speed, equal to plain tuples)
that pickle by value, so they can be handed to worker processes.
"""

from __future__ import annotations

import collections
import enum
import functools
import itertools
import keyword
import operator
import re
import struct
import sys
from collections.abc import Callable, Iterable
from typing import Any, Literal

from .layout import (
    ArrayType,
    CType,
    EnumType,
    FloatType,
    IntType,
    OpaqueType,
    PointerType,
    RecordType,
    byte_order,
    ctypes_layout,
    dtype_spec,
    flat_members,
    flexible_member,
    is_byte,
    python_names,
    record_fields,
    struct_layout,
    type_size,
)

Decoder = Callable[[bytes], Any]
_tuple_new = tuple.__new__
_INT_FORMATS = {(1, False): "B", (1, True): "b", (2, False): "H", (2, True): "h",
                (4, False): "I", (4, True): "i", (8, False): "Q", (8, True): "q"}
_FLOAT_FORMATS = {2: "e", 4: "f", 8: "d"}
NUMPY_HINT = "pip install 'aperf-bpf[numpy]'"


def c_string(raw: bytes) -> str:
    """A C ``char[N]``: cut at the first NUL, invalid UTF-8 replaced (never raises)."""
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


def require_numpy(what: str) -> Any:
    """The numpy module, or an ImportError saying what to install."""
    try:
        import numpy
    except ImportError as exc:
        raise ImportError(f"{what} needs NumPy: {NUMPY_HINT}") from exc
    return numpy


# --- records and enums that pickle by value ----------------------------------------------


class Record(tuple[Any, ...]):
    """The base of decoded records: tuples with named fields, like named tuples
    (``_fields``, ``_asdict()``, ``_replace()``, ``_make()``, a readable repr).

    Unlike ``collections.namedtuple`` classes they have no ``__new__`` of
    their own: ``Rec(values)`` takes one iterable, as ``tuple()`` does, and
    costs a third less per record (measured), which matters at millions of
    samples per second. Records pickle by value: a process that never built
    the decoder unpickles them into an equal record.
    """

    __slots__ = ()
    _fields: tuple[str, ...] = ()
    _c_name = ""
    _make: Any = classmethod(tuple.__new__)

    def _asdict(self) -> dict[str, Any]:
        return dict(zip(self._fields, self, strict=True))

    def _replace(self, **changes: Any) -> Any:
        values = [changes.pop(name, value) for name, value in zip(self._fields, self,
                                                                   strict=True)]
        if changes:
            raise ValueError(f"{type(self).__name__} has no fields {sorted(changes)}")
        return tuple.__new__(type(self), values)

    def __repr__(self) -> str:
        pairs = ", ".join(f"{name}={value!r}" for name, value in zip(self._fields, self,
                                                                     strict=True))
        return f"{type(self).__name__}({pairs})"

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild_record, (self._c_name, self._fields, tuple(self))


_field = getattr(collections, "_tuplegetter", None)  # CPython's own, as namedtuple uses


@functools.cache
def record_class(name: str, fields: tuple[str, ...]) -> type[Record]:
    """The record class named after C type ``name`` with these (Python) field names."""
    typename = name if name.isidentifier() and not keyword.iskeyword(name) else "record"
    namespace: dict[str, Any] = {
        "__slots__": (), "_fields": fields, "_c_name": name, "__match_args__": fields,
    }
    for index, field in enumerate(fields):
        namespace[field] = (_field(index, None) if _field is not None else
                            property(operator.itemgetter(index)))
    return type(typename, (Record,), namespace)


def _rebuild_record(name: str, fields: tuple[str, ...], values: tuple[Any, ...]) -> Any:
    return record_class(name, fields)(values)


class CEnum(enum.IntEnum):
    """The base of the enums decoders make from C enums.

    A value the C enum does not name is still a member of the field's class
    (its ``name`` is None), so a field never changes type: ``rec.kind.name``
    is a str or None, ``int(rec.kind)`` the number the program wrote.
    Members pickle by value.
    """

    @classmethod
    def _missing_(cls, value: object) -> Any:
        if not isinstance(value, int):
            return None
        member = int.__new__(cls, value)
        member._name_ = None  # type: ignore[assignment]
        member._value_ = value
        return member

    def __repr__(self) -> str:
        if self._name_ is None:
            return f"<{type(self).__name__}: {int(self)}>"
        return super().__repr__()

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        cls = type(self)
        return _enum_member, (cls.__name__, cls.__aperf_members__, int(self))  # type: ignore[attr-defined]


@functools.cache
def enum_class(name: str, members: tuple[tuple[str, int], ...]) -> type[CEnum] | None:
    """The IntEnum of a C enum (None if Python cannot name its members so)."""
    make: Any = CEnum  # the functional API, on a base with methods and no members
    try:
        cls: Any = make(name or "enum", list(members), module=__name__)
    except (ValueError, TypeError):
        return None
    cls.__aperf_members__ = members
    return cls  # type: ignore[no-any-return]


def _enum_member(name: str, members: tuple[tuple[str, int], ...], value: int) -> Any:
    cls = enum_class(name, members)
    return value if cls is None else cls(value)


class _EnumLookup(dict[int, Any]):
    """value -> member at dict speed; a value without a member becomes a nameless one."""

    __slots__ = ("cls",)

    def __init__(self, cls: type[CEnum]) -> None:
        super().__init__((int(m), m) for m in cls)
        self.cls = cls

    def __missing__(self, value: int) -> Any:
        return self.cls(value)


# --- the decoder -------------------------------------------------------------------------


class SizedDecoder:
    """A decoder of records whose fixed part is ``size`` bytes, unpacked by ``struct``.

    Compiled decoders (BTF, ctypes, ``struct`` formats) also carry their
    ``layout``, from which NumPy dtypes are made (``dtype``), and decode runs of
    records at C speed (``decode_many``; ``strided``/``decode_rows`` read them
    straight out of a ring's copied span). With ``tail`` (a struct ending in a
    flexible array member), the value's last field holds the sample's bytes
    after the fixed part.
    """

    def __init__(
        self,
        name: str,
        fmt: struct.Struct,
        build: Callable[..., Any] | None,
        build_many: Callable[[list[bytes]], list[Any]] | None = None,
        *,
        build_rows: Callable[[Iterable[tuple[Any, ...]]], list[Any]] | None = None,
        row_class: Callable[[tuple[Any, ...]], Any] | None = None,
        layout: RecordType | None = None,
        tail: str | None = None,
    ) -> None:
        self.name = name
        self.size = fmt.size
        self.struct = fmt
        self.build = build
        self.layout = layout
        self.tail = tail
        self._build_many = build_many
        self._build_rows = build_rows
        self._row_class = row_class  # value = row_class(unpacked row), if that is all
        self._strided: dict[tuple[int, int], struct.Struct | None] = {}
        unpack_from = fmt.unpack_from
        size = fmt.size
        if build is None:

            def decode(data: bytes) -> Any:
                if len(data) < size:
                    raise ValueError(f"{name} needs {size} bytes, the sample has {len(data)}")
                return unpack_from(data)
        elif tail is not None:

            def decode(data: bytes) -> Any:
                if len(data) < size:
                    raise ValueError(f"{name} needs {size} bytes, the sample has {len(data)}")
                return build(unpack_from(data), data)
        else:

            def decode(data: bytes) -> Any:
                if len(data) < size:
                    raise ValueError(f"{name} needs {size} bytes, the sample has {len(data)}")
                return build(unpack_from(data))

        self._decode = decode

    def __call__(self, data: bytes) -> Any:
        return self._decode(data)

    def decode_many(self, payloads: list[bytes]) -> list[Any]:
        """Decode payloads already known to be long enough, at C speed where possible."""
        if self._build_many is not None:
            return self._build_many(payloads)
        if self.tail is not None:
            return list(map(self._decode, payloads))
        unpacked = map(self.struct.unpack_from, payloads)
        return list(unpacked if self.build is None else map(self.build, unpacked))

    def strided(self, skip: int, stride: int) -> struct.Struct | None:
        """A ``struct`` reading this decoder's fields out of records of ``stride`` bytes
        whose payload starts ``skip`` bytes in (``iter_unpack`` over a span of them);
        None where that cannot be done (a tail, a native-aligned format)."""
        key = (skip, stride)
        if key not in self._strided:
            fmt = self.struct.format
            room = stride - skip - self.size
            fits = self.tail is None and fmt[:1] in ("<", ">", "!", "=") and room >= 0
            self._strided[key] = (
                struct.Struct(f"{fmt[0]}{skip}x{fmt[1:]}{room}x") if fits else None
            )
        return self._strided[key]

    def decode_rows(self, rows: Iterable[tuple[Any, ...]]) -> list[Any]:
        """Values from tuples this decoder's format (or a ``strided`` one) unpacked."""
        if self._build_rows is not None:
            return self._build_rows(rows)
        if self.build is None:
            return list(rows)
        if self.tail is not None:
            raise TypeError(f"{self.name} has a tail: decode its payloads")
        return list(map(self.build, rows))

    @functools.cached_property
    def fields_plan(self) -> tuple[str, tuple[tuple[int, str], ...]] | None:
        """The fields' plan for the compiled fast path: the byte order (``<`` or ``>``) and
        each field's (offset, ``struct`` code), where every value is a number ``struct``
        unpacks at a standard size (integers, ``?``, ``d``); else None (bytes, strings,
        ``f``, a tail: the ``struct`` module unpacks those)."""
        if self.tail is not None:
            return None
        return _fields_plan(self.struct.format)

    @property
    def row_class(self) -> Callable[[tuple[Any, ...]], Any] | None:
        """The record class each unpacked row becomes (``row_class(row)``), where that is
        all a value is; else None."""
        return self._row_class

    def each_row(self, rows: Iterable[tuple[Any, ...]]) -> Iterable[Any]:
        """``decode_rows(rows)``, one value at a time where that is cheaper (no list in
        between: a record class applied to each row, or the rows themselves)."""
        if self._row_class is not None:
            return map(self._row_class, rows)
        if self.build is None and self.tail is None:
            return rows
        return self.decode_rows(rows)

    @property
    def dtype(self) -> Any:
        """The NumPy structured dtype of the fixed part (needs NumPy and a layout)."""
        if self.layout is None:
            raise TypeError(f"{self.name} has no layout to make a NumPy dtype from")
        np = require_numpy("SizedDecoder.dtype")
        return np.dtype(dtype_spec(self.layout, byte_order(self.struct.format), size=self.size))

    def __repr__(self) -> str:
        tail = f", then {self.tail}[]" if self.tail else ""
        return f"<aperf decoder {self.name} ({self.size} bytes{tail})>"


# What the compiled fast path reads itself (a float's conversion is left to struct).
_STANDARD_SIZES = {"b": 1, "B": 1, "?": 1, "h": 2, "H": 2, "i": 4, "I": 4, "l": 4, "L": 4,
                   "q": 8, "Q": 8, "d": 8}
_FORMAT_ITEM = re.compile(r"(\d*)([a-zA-Z?])")


def _fields_plan(fmt: str) -> tuple[str, tuple[tuple[int, str], ...]] | None:
    """``SizedDecoder.fields_plan`` of a ``struct`` format."""
    order, rest = (fmt[0], fmt[1:]) if fmt[:1] in "<>!=@" else ("@", fmt)
    if order == "@":
        return None  # native sizes and alignment: left to struct
    if order in "!=":
        order = ">" if order == "!" or sys.byteorder == "big" else "<"
    fields: list[tuple[int, str]] = []
    at = 0
    for count_text, code in _FORMAT_ITEM.findall(rest.replace(" ", "")):
        count = int(count_text) if count_text else 1
        if code == "x":
            at += count
            continue
        size = _STANDARD_SIZES.get(code)
        if size is None:
            return None
        for _ in range(count):
            fields.append((at, code))
            at += size
    return order, tuple(fields)


# --- compiling a layout ------------------------------------------------------------------


class _Compiler:
    """Turns a layout into one struct format plus the expression that builds its value
    from the unpacked tuple ``t`` (and the sample ``d``, for a tail)."""

    def __init__(self, order: str, env: dict[str, Any]) -> None:
        self.order = order
        self.env = env
        self.fmt: list[str] = []
        self.fields = 0  # how many values the flat format yields so far
        self.pos = 0  # byte position the format has reached

    def _name(self, prefix: str, value: Any) -> str:
        name = f"_{prefix}{len(self.env)}"
        self.env[name] = value
        return name

    def pad_to(self, offset: int) -> None:
        if offset < self.pos:
            raise TypeError(f"members overlap at byte {offset}: aperf cannot decode this layout")
        if offset > self.pos:
            self.fmt.append(f"{offset - self.pos}x")
            self.pos = offset

    def take(self, code: str, size: int, count: int = 1) -> str:
        """Add ``count`` values of ``code``; their expression (one index, or a slice)."""
        self.fmt.append(code if count == 1 else f"{count}{code}")
        self.pos += size * count
        first = self.fields
        self.fields += count
        return f"t[{first}]" if count == 1 else f"t[{first}:{first + count}]"

    def value(self, t: CType, offset: int) -> str:
        """Emit the format of ``t`` at ``offset``; return the expression of its value."""
        self.pad_to(offset)
        code = _number_code(t)
        if code is not None:
            return self.take(code, t.size)  # type: ignore[union-attr]
        if isinstance(t, IntType | FloatType):  # odd sizes: their raw bytes
            return self.take(f"{t.size}s", t.size)
        if isinstance(t, EnumType):
            if t.size not in (1, 2, 4, 8):
                return self.take(f"{t.size}s", t.size)
            expr = self.take(_INT_FORMATS[(t.size, t.signed)], t.size)
            cls = enum_class(t.name, t.members) if t.members else None
            return expr if cls is None else f"{self._name('e', _EnumLookup(cls))}[{expr}]"
        if isinstance(t, OpaqueType):
            return self.take(f"{t.size}s", t.size) if t.size else "b''"
        if isinstance(t, ArrayType):
            return self._array(t, offset)
        assert isinstance(t, RecordType)
        if t.union:
            raw = self.take(f"{t.size}s", t.size)
            return f"{self.union(t, as_record=True)}({raw})"
        return self.record(t, offset)

    def _array(self, t: ArrayType, offset: int) -> str:
        elem, count = t.elem, t.count
        if is_byte(elem):
            if count == 0:
                return "''" if elem.kind == "char" else "b''"  # type: ignore[union-attr]
            raw = self.take(f"{count}s", count)
            if elem.kind != "char":  # type: ignore[union-attr]
                return raw
            # c_string() inlined: a function call per field costs more than the work.
            return f"{raw}.partition(b'\\0')[0].decode('utf-8', 'replace')"
        if count == 0:
            return "()"
        code = _number_code(elem)
        if code is not None:
            return self.take(code, elem.size, count)  # type: ignore[union-attr]  # one slice
        size = type_size(elem)
        parts = [self.value(elem, offset + i * size) for i in range(count)]
        return "(" + "".join(p + ", " for p in parts) + ")"

    def record(self, t: RecordType, offset: int, *, tail: bool = False) -> str:
        """A struct: its members in order, anonymous ones lifted; a tail, if asked, last."""
        names = tuple(name for name, _, _ in record_fields(t))
        members = flat_members(t)
        exprs: list[str] = []
        for index, (name, member_offset, member_type) in enumerate(members):
            at = offset + member_offset
            if tail and index == len(members) - 1:
                self.pad_to(at)
                exprs.append(f"d[{at}:]")
                break
            if not name and isinstance(member_type, RecordType):  # an anonymous union
                self.pad_to(at)
                raw = self.take(f"{member_type.size}s", member_type.size)
                exprs.append(f"*{self.union(member_type, as_record=False)}({raw})")
                continue
            exprs.append(self.value(member_type, at))
        if not tail:
            self.pad_to(offset + t.size)
        record = self._name("rec", record_class(t.name or "anon", names))
        return f"{record}(({''.join(e + ', ' for e in exprs)}))"

    def union(self, t: RecordType, *, as_record: bool) -> str:
        """A function of the union's bytes: every member decoded (they overlap), as a
        record, or as a plain tuple to splice into the record of an anonymous union's
        parent."""
        parts: list[str] = []
        for _, offset, member_type in flat_members(t):
            sub = _Compiler(self.order, self.env)
            expr = sub.value(member_type, offset)
            unpack = self._name("u", struct.Struct(self.order + "".join(sub.fmt)).unpack_from)
            build = self._name("b", eval(f"lambda t: {expr}", self.env))
            parts.append(f"{build}({unpack}(b))")
        values = "(" + "".join(p + ", " for p in parts) + ")"
        if as_record:
            names = tuple(name for name, _, _ in record_fields(t))
            values = f"{self._name('rec', record_class(t.name or 'anon', names))}({values})"
        return self._name("union", eval(f"lambda b: {values}", self.env))


def _number_code(t: CType) -> str | None:
    """The struct code of a type decoded as the plain number struct gives, if it is one."""
    if isinstance(t, IntType) and t.size in (1, 2, 4, 8):
        return "?" if t.kind == "bool" else _INT_FORMATS[(t.size, t.signed)]
    if isinstance(t, FloatType):
        return _FLOAT_FORMATS.get(t.size)
    if isinstance(t, PointerType):
        return "Q" if t.size == 8 else "I"
    return None


def compile_layout(layout: RecordType, name: str, order: str = "<") -> SizedDecoder:
    """A decoder of the struct ``layout`` (``order``: ``<`` or ``>``).

    Generated from names and counts of the layout only (field names are
    identifiers, see ``layout.python_names``). When every field maps straight
    across (no strings, enums, unions or nesting), records are made from the
    unpacked tuples with no per-record Python code at all.
    """
    if layout.union:
        raise TypeError(f"{name} is a union: decode the struct that holds it")
    env: dict[str, Any] = {"_tn": _tuple_new, "_map": map, "_repeat": itertools.repeat}
    compiler = _Compiler(order, env)
    flex = flexible_member(layout)
    expr = compiler.record(layout, 0, tail=flex is not None)
    packed = struct.Struct(order + "".join(compiler.fmt))
    env["_unpack"] = packed.unpack_from
    if flex is not None:
        build = eval(f"lambda t, d: {expr}", env)
        many = eval(f"lambda payloads: [{expr} for d in payloads for t in (_unpack(d),)]", env)
        return SizedDecoder(name, packed, build, many, layout=layout,
                            tail=record_fields(layout)[-1][0])
    build = eval(f"lambda t: {expr}", env)
    straight = "".join(f"t[{i}], " for i in range(compiler.fields))
    record = next((v for k, v in env.items() if k.startswith("_rec") and
                   expr == f"{k}(({straight}))"), None)
    if record is not None:
        many = eval("lambda payloads: list(_map(_r, _map(_unpack, payloads)))",
                    dict(env, _r=record))
        rows = eval("lambda rows: list(_map(_r, rows))", dict(env, _r=record))
    else:
        many = eval(f"lambda payloads: [{expr} for t in _map(_unpack, payloads)]", env)
        rows = eval(f"lambda rows: [{expr} for t in rows]", env)
    return SizedDecoder(name, packed, build, many, build_rows=rows, row_class=record,
                        layout=layout)


# --- struct formats ----------------------------------------------------------------------


def from_struct(fmt: struct.Struct | str, names: str | list[str] | None = None) -> SizedDecoder:
    """Decode with a ``struct`` format; with ``names``, into a named tuple ``Record``.

    Values are exactly what ``struct`` unpacks. Names follow the rule of every
    decoder (``from`` -> ``from_``, see docs/decoding.md).
    """
    packed = fmt if isinstance(fmt, struct.Struct) else struct.Struct(fmt)
    label = f"struct {packed.format!r}"
    if names is None:
        return SizedDecoder(label, packed, None, layout=_layout_or_none(packed, None))
    fields = names.replace(",", " ").split() if isinstance(names, str) else list(names)
    record = record_class("Record", tuple(python_names(fields)))
    return SizedDecoder(
        label, packed, record, build_rows=lambda rows: list(map(record, rows)),
        row_class=record, layout=_layout_or_none(packed, fields),
    )


def _layout_or_none(packed: struct.Struct, names: list[str] | None) -> RecordType | None:
    if names is not None and len(names) != len(packed.unpack(bytes(packed.size))):
        raise ValueError(f"struct format {packed.format!r} does not unpack into {len(names)} "
                         f"values ({names})")
    try:
        return struct_layout(packed, names)
    except TypeError:
        return None  # no array layout (Pascal strings): per-item decoding only


# --- ctypes structures -------------------------------------------------------------------


def is_ctypes_structure(spec: object) -> bool:
    return (
        isinstance(spec, type)
        and hasattr(spec, "_fields_")
        and hasattr(spec, "from_buffer_copy")
    )


def from_ctypes(cls: type) -> SizedDecoder:
    """Decode into records with the fields of a ``ctypes.Structure`` subclass.

    The structure is compiled like a BTF struct (same speed, same values):
    ``c_char * N`` becomes ``str`` (cut at NUL), ``c_uint8 * N`` bytes,
    pointers ints, unions records of every member, ``_anonymous_`` members'
    fields the record's own; a trailing zero-length array is the sample's tail.
    Bitfields and byte-swapped structures are refused (TypeError).
    """
    return compile_layout(ctypes_layout(cls), cls.__name__, byte_order("="))


# --- JSON --------------------------------------------------------------------------------


def jsonable(value: Any, *, enums: Literal["name", "value"] = "name") -> Any:
    """``value`` as plain JSON types, for ``json.dumps``: records (any named tuple, so
    also ``Sample``) become objects, tuples lists, bytes lowercase hex strings, enum
    members their name (``enums="value"``: their number; a value the enum does not
    name is always its number), exceptions their message, NumPy values lists or
    numbers."""
    if value is None or isinstance(value, str | bool | float):
        return value
    if isinstance(value, enum.Enum):
        if enums == "name" and value.name is not None:
            return value.name
        return value.value
    if isinstance(value, int):
        return value
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).hex()
    if isinstance(value, BaseException):
        return str(value)
    asdict = getattr(value, "_asdict", None)
    if asdict is not None:
        return {key: jsonable(item, enums=enums) for key, item in asdict().items()}
    if isinstance(value, tuple | list):
        return [jsonable(item, enums=enums) for item in value]
    if isinstance(value, dict):
        return {str(key): jsonable(item, enums=enums) for key, item in value.items()}
    tolist = getattr(value, "tolist", None)  # NumPy arrays and scalars
    if tolist is not None:
        return jsonable(tolist(), enums=enums)
    raise TypeError(f"aperf.decoders.jsonable: {type(value).__name__} has no JSON form")
