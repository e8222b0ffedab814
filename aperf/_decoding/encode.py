"""Encoders: the inverse of decoders, for what user space sends to BPF.

An encoder is a callable ``value -> bytes``. It is built from the same specs
``decoder=`` takes (a BTF struct name, a ``ctypes.Structure`` subclass, a
``struct.Struct``) and from the same layouts (``layout.py``), so that
``decode(encode(value)) == value`` for every value a decoder returns. A record
field takes what its decoder gives: numbers, ``str`` for ``char[N]`` (cut at
NUL, so shorter strings are NUL-padded), ``bytes`` for other byte arrays
(shorter ones zero-padded), sequences for other arrays, nested records or
mappings for nested structs. A struct's value is a tuple of every field in
order (a decoded record is one) or a mapping of some fields by name, the
others zero, as a C initializer ``{.seq = 1}`` leaves them. A struct ending in
a flexible array takes its tail as ``bytes`` in the last field, and its message
is the fixed part and the tail (the flexible member's offset plus the tail's
length: less than ``sizeof`` for a short tail, as the decoder reads it back).

Bad values raise ``ArgumentError`` naming the field: nothing is sent.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping
from typing import Any

from .._errors import ArgumentError
from .decode import _number_code
from .layout import (
    ArrayType,
    CType,
    EnumType,
    FloatType,
    IntType,
    OpaqueType,
    RecordType,
    byte_order,
    ctypes_layout,
    flexible_member,
    is_byte,
    record_fields,
    type_size,
)

Encoder = Callable[[Any], bytes]


def _bad(where: str, message: str) -> ArgumentError:
    return ArgumentError("value", f"{where}: {message}")


def raw_bytes(value: Any) -> bytes:
    """The encoder of ``encoder=None``: a bytes-like value, as it is."""
    if not isinstance(value, bytes | bytearray | memoryview):
        raise _bad("value", f"without an encoder, send bytes, not {type(value).__name__}")
    return bytes(value)


class _Writer:
    """Writes values of a layout's types into a buffer, at byte offsets."""

    def __init__(self, order: str) -> None:
        self.order = order
        # Each record's fields, worked out once (the layout lives as long as the encoder).
        self._fields: dict[int, tuple[RecordType, list[tuple[str, int, CType]],
                                      dict[str, tuple[int, CType]]]] = {}

    def fields(self, t: RecordType) -> tuple[list[tuple[str, int, CType]],
                                             dict[str, tuple[int, CType]]]:
        known = self._fields.get(id(t))
        if known is None or known[0] is not t:
            fields = record_fields(t)
            known = (t, fields, {name: (offset, ftype) for name, offset, ftype in fields})
            self._fields[id(t)] = known
        return known[1], known[2]

    def value(self, buf: bytearray, at: int, t: CType, value: Any, where: str) -> None:
        code = _number_code(t)
        if code is not None:
            try:
                struct.pack_into(self.order + code, buf, at, value)
            except (struct.error, TypeError) as exc:
                raise _bad(where, f"{value!r} does not fit ({exc})") from None
        elif isinstance(t, EnumType) and t.size in (1, 2, 4, 8):
            self.value(buf, at, IntType(t.size, t.signed), int(value), where)
        elif isinstance(t, IntType | FloatType | EnumType | OpaqueType):
            self.raw(buf, at, t.size, value, where, exact=True)  # odd sizes: raw bytes
        elif isinstance(t, ArrayType):
            self.array(buf, at, t, value, where)
        else:
            assert isinstance(t, RecordType)
            if t.union:
                self.union(buf, at, t, value, where)
            else:
                self.record(buf, at, t, value, where)

    def raw(self, buf: bytearray, at: int, size: int, value: Any, where: str, *,
            exact: bool = False) -> None:
        if not isinstance(value, bytes | bytearray | memoryview):
            raise _bad(where, f"needs bytes, not {type(value).__name__}")
        data = bytes(value)
        if len(data) > size or (exact and len(data) != size):
            raise _bad(where, f"holds {size} bytes, not {len(data)}")
        buf[at : at + len(data)] = data

    def array(self, buf: bytearray, at: int, t: ArrayType, value: Any, where: str) -> None:
        if is_byte(t.elem):
            if isinstance(value, str) and t.elem.kind == "char":  # type: ignore[union-attr]
                data = value.encode()
                if len(data) >= t.count and t.count:
                    raise _bad(where, f"holds at most {t.count - 1} bytes of text and a NUL, "
                                      f"not {len(data)}")
                value = data
            self.raw(buf, at, t.count, value, where)
            return
        if isinstance(value, str | bytes) or not hasattr(value, "__len__"):
            raise _bad(where, f"needs a sequence of {t.count} values, not {type(value).__name__}")
        if len(value) != t.count:
            raise _bad(where, f"needs {t.count} values, not {len(value)}")
        size = type_size(t.elem)
        for index, item in enumerate(value):
            self.value(buf, at + index * size, t.elem, item, f"{where}[{index}]")

    def record(self, buf: bytearray, at: int, t: RecordType, value: Any, where: str, *,
               tail: bool = False) -> None:
        fields, named = self.fields(t)
        if isinstance(value, Mapping):
            unknown = sorted(set(value) - set(named))
            if unknown:
                raise _bad(where, f"has no fields {unknown}; it has {list(named)}")
            items = [(name, *named[name], value[name]) for name in value]
        else:
            if isinstance(value, str | bytes) or not hasattr(value, "__len__"):
                raise _bad(where, f"needs a tuple of its {len(fields)} fields or a mapping, "
                                  f"not {type(value).__name__}")
            if len(value) != len(fields):
                raise _bad(where, f"has {len(fields)} fields, the value has {len(value)}")
            items = [(name, offset, ftype, item)
                     for (name, offset, ftype), item in zip(fields, value, strict=True)]
        last = fields[-1][0] if tail else None
        for name, offset, ftype, item in items:
            if name == last:
                continue  # the tail: the caller appends it
            self.value(buf, at + offset, ftype, item, f"{where}.{name}")

    def union(self, buf: bytearray, at: int, t: RecordType, value: Any, where: str) -> None:
        """A union takes its raw bytes, a mapping that sets one member, or every member
        in order, as its decoder gives them (read from the same bytes, they agree)."""
        if isinstance(value, bytes | bytearray | memoryview):
            self.raw(buf, at, t.size, value, where)
            return
        if isinstance(value, Mapping) and len(value) != 1:
            raise _bad(where, "is a union: give its bytes, or a mapping that sets one member")
        self.record(buf, at, t, value, where)  # its members, written in order


def from_layout(layout: RecordType, name: str, order: str = "<") -> Encoder:
    """An encoder of struct ``layout`` values (``order``: ``<`` or ``>``)."""
    if layout.union:
        raise TypeError(f"{name} is a union: encode the struct that holds it")
    writer = _Writer(order)
    size = layout.size
    flex = flexible_member(layout)
    if flex is None:

        def encode(value: Any) -> bytes:
            buf = bytearray(size)
            writer.record(buf, 0, layout, value, name)
            return bytes(buf)

        return encode
    tail_name = record_fields(layout)[-1][0]

    def encode_with_tail(value: Any) -> bytes:
        buf = bytearray(size)
        writer.record(buf, 0, layout, value, name, tail=True)
        tail = value.get(tail_name, b"") if isinstance(value, Mapping) else value[-1]
        if not isinstance(tail, bytes | bytearray | memoryview):
            raise _bad(f"{name}.{tail_name}", f"the tail needs bytes, not {type(tail).__name__}")
        # The fixed part and the tail, nothing after: padding up to sizeof would come
        # back from the decoder as tail bytes the value never had.
        return bytes(buf[: flex.offset]) + bytes(tail)

    return encode_with_tail


def from_struct(packed: struct.Struct) -> Encoder:
    """Encode a tuple of the values ``packed`` packs (a single value may go alone)."""

    def encode(value: Any) -> bytes:
        values = value if isinstance(value, tuple | list) else (value,)
        try:
            return packed.pack(*values)
        except struct.error as exc:
            raise _bad(f"struct {packed.format!r}", str(exc)) from None

    return encode


def from_ctypes(cls: type) -> Encoder:
    """Encode instances of a ``ctypes.Structure`` subclass as they are (``bytes(value)``),
    and tuples or mappings of its fields as its decoder's records read them."""
    by_layout = from_layout(ctypes_layout(cls), cls.__name__, byte_order("="))

    def encode(value: Any) -> bytes:
        if isinstance(value, cls):
            return bytes(value)  # type: ignore[call-overload,no-any-return]  # a ctypes instance
        return by_layout(value)

    return encode

