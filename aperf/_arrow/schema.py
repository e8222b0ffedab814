"""A decoder's C layout as Arrow fields: the same columns, names and flattening as its
NumPy dtype (``_decoding/layout.dtype_spec``), typed for Arrow.

| C | Arrow |
| --- | --- |
| integers, ``char`` (one) | ``int8`` ... ``uint64`` |
| ``bool`` | ``bool`` |
| enums | their integer type; ``aperf.enum`` in the field's metadata names the members |
| ``float``, ``double`` (and half) | ``float32``, ``float64`` (``float16``) |
| pointers | ``uint64``, ``aperf.c_type: pointer`` in the metadata |
| ``char[N]`` | ``string``: cut at the first NUL, invalid UTF-8 replaced as records have it |
| ``__u8[N]`` and other 1-byte arrays | ``fixed_size_binary(N)``: every byte (records' ``bytes``) |
| other fixed arrays, ``T[2][3]`` | ``fixed_size_list`` (nested for each dimension) |
| nested structs, unions | ``struct`` (a union's members overlap, as in records) |
| odd-sized integers, opaque bytes | ``fixed_size_binary(size)`` |
| a trailing flexible array member | ``binary``: each sample's bytes after the fixed part |

The columns a stream adds are named with a leading underscore, which no decoder field
has (``layout.python_names``): ``_cpu``, ``_map``, ``_late``; a recording adds ``_time``
and ``_data``.
"""

from __future__ import annotations

import json
from typing import Any

from .._decoding.layout import (
    ArrayType,
    CType,
    EnumType,
    FloatType,
    IntType,
    OpaqueType,
    PointerType,
    RecordType,
    flexible_member,
    is_byte,
    record_fields,
    type_size,
)
from .._errors import MissingExtraError

CPU = "_cpu"  # the ring's key: its CPU (-1 for a BPF ring buffer), or its map key
MAP = "_map"  # the map's name, in a stream of several maps
LATE = "_late"  # delivered late by an ordered stream
TIME = "_time"  # when the recorder received the sample (a recording's column)
DATA = "_data"  # the raw sample, as Sample.data (a recording's column)
HOST = "_host"  # an aperf.fleet event's host
STREAM = "_stream"  # an aperf.fleet event's stream
ENUM_KEY = b"aperf.enum"
C_TYPE_KEY = b"aperf.c_type"


def require_pyarrow(what: str) -> Any:
    """The pyarrow module, or ``MissingExtraError`` naming the extra to install."""
    try:
        import pyarrow
    except ImportError as exc:
        raise MissingExtraError(what, extra="arrow", package="pyarrow") from exc
    return pyarrow


def decoded_fields(record: RecordType) -> list[tuple[str, int, CType]]:
    """The columns of a layout: ``dtype_spec``'s fields (no flexible member, nothing of
    size 0), as (name, offset, type)."""
    fields = record_fields(record)
    if flexible_member(record) is not None:
        fields = fields[:-1]
    return [f for f in fields if type_size(f[2])]


def arrow_field(pa: Any, name: str, t: CType) -> Any:
    """The Arrow field of one member (see the table above)."""
    metadata: dict[bytes, bytes] = {}
    if isinstance(t, EnumType):
        metadata[ENUM_KEY] = json.dumps({"name": t.name, "members": dict(t.members)}).encode()
        metadata[C_TYPE_KEY] = f"enum {t.name}".strip().encode()
    elif isinstance(t, PointerType):
        metadata[C_TYPE_KEY] = b"pointer"
    return pa.field(name, arrow_type(pa, t), metadata=metadata or None)


def arrow_type(pa: Any, t: CType) -> Any:
    if isinstance(t, IntType | EnumType):
        if isinstance(t, IntType) and t.kind == "bool":
            return pa.bool_()
        if t.size not in (1, 2, 4, 8):
            return pa.binary(t.size)
        return getattr(pa, f"{'int' if t.signed else 'uint'}{t.size * 8}")()
    if isinstance(t, FloatType):
        return {2: pa.float16(), 4: pa.float32(), 8: pa.float64()}.get(t.size) or pa.binary(
            t.size)
    if isinstance(t, PointerType):
        return pa.uint64() if t.size == 8 else pa.uint32()
    if isinstance(t, OpaqueType):
        return pa.binary(t.size)
    if isinstance(t, ArrayType):
        elem = t.elem
        if isinstance(elem, IntType) and elem.kind == "char":
            return pa.string()  # char[N]: one string
        if is_byte(elem):
            return pa.binary(t.count)  # __u8[N]: N bytes
        return pa.list_(arrow_type(pa, elem), t.count)
    assert isinstance(t, RecordType)
    return pa.struct([arrow_field(pa, name, member) for name, _, member in decoded_fields(t)])


def layout_fields(pa: Any, record: RecordType, tail: str | None) -> list[Any]:
    """The decoded columns of a layout, then its tail's (``binary``) if it has one."""
    fields = [arrow_field(pa, name, t) for name, _, t in decoded_fields(record)]
    if tail is not None:
        fields.append(pa.field(tail, pa.binary()))
    return fields


def stream_fields(pa: Any, *, maps: bool, fleet: bool = False) -> list[Any]:
    """The columns a stream adds before the decoded ones."""
    fields = [pa.field(CPU, pa.int32(), nullable=False)]
    if maps:
        fields.append(pa.field(MAP, pa.string()))
    if fleet:
        fields += [pa.field(HOST, pa.string()), pa.field(STREAM, pa.string())]
    fields.append(pa.field(LATE, pa.bool_(), nullable=False))
    return fields
