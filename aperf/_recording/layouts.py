"""A decoder's C layout as JSON, and back: what a recording keeps of its decoder.

A recording stores the layout its samples were decoded with, so that it can be read
and replayed without the BPF object (``Recording.decoder`` compiles it again), and so
that a replay can tell whether a stream's decoder is the one it was made with. The
JSON is read from a file: untrusted input. ``layout_from_json`` checks every node
(kinds, sizes, offsets, counts, names, nesting) and raises ``ValueError`` saying
what is wrong; nothing it accepts can make a decoder larger than a perf sample.
"""

from __future__ import annotations

from typing import Any

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
    byte_order,
    type_size,
)

MAX_SAMPLE = 1 << 16  # no perf or ring buffer sample is larger
MAX_DEPTH = 32
MAX_NODES = 4096
MAX_NAME = 256


def layout_json(t: CType) -> Any:
    """A layout node as plain JSON values."""
    if isinstance(t, IntType):
        return {"kind": "int", "size": t.size, "signed": t.signed, "c": t.kind}
    if isinstance(t, FloatType):
        return {"kind": "float", "size": t.size}
    if isinstance(t, EnumType):
        return {"kind": "enum", "name": t.name, "size": t.size, "signed": t.signed,
                "members": [[name, value] for name, value in t.members]}
    if isinstance(t, PointerType):
        return {"kind": "pointer", "size": t.size}
    if isinstance(t, OpaqueType):
        return {"kind": "opaque", "size": t.size}
    if isinstance(t, ArrayType):
        return {"kind": "array", "count": t.count, "elem": layout_json(t.elem)}
    return {"kind": "union" if t.union else "struct", "name": t.name, "size": t.size,
            "members": [{"name": m.name, "offset": m.offset, "type": layout_json(m.type)}
                        for m in t.members]}


def decoder_json(decoder: SizedDecoder) -> dict[str, Any]:
    """What a recording keeps of a decoder with a layout."""
    assert decoder.layout is not None
    return {"name": decoder.name, "size": decoder.size,
            "order": byte_order(decoder.struct.format),
            "tail": decoder.tail, "layout": layout_json(decoder.layout)}


def decoder_from_json(value: Any) -> SizedDecoder:
    """The decoder a recording was made with, compiled again (``ValueError`` if the JSON
    is not one ``decoder_json`` could have written)."""
    if not isinstance(value, dict):
        raise ValueError("the decoder is not a JSON object")
    name, order = value.get("name"), value.get("order")
    if not isinstance(name, str) or len(name) > MAX_NAME or order not in ("<", ">"):
        raise ValueError("the decoder's name or byte order is missing or wrong")
    layout = layout_from_json(value.get("layout"))
    if not isinstance(layout, RecordType) or layout.union:
        raise ValueError("the decoder's layout is not a struct")
    decoder = compile_layout(layout, name, order)
    if decoder.size != value.get("size") or decoder.tail != value.get("tail"):
        raise ValueError("the decoder's size or tail does not match its layout")
    return decoder


def layout_from_json(value: Any) -> CType:
    """A layout node from ``layout_json``'s form, every part of it checked."""
    budget = [MAX_NODES]
    return _node(value, 0, budget)


def _int(value: Any, low: int, high: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{what} must be an integer from {low} to {high}, not {value!r}")
    return value


def _name(value: Any, what: str) -> str:
    if not isinstance(value, str) or len(value) > MAX_NAME:
        raise ValueError(f"{what} must be a string of at most {MAX_NAME} characters")
    return value


def _node(value: Any, depth: int, budget: list[int]) -> CType:
    budget[0] -= 1
    if depth > MAX_DEPTH or budget[0] < 0:
        raise ValueError("the layout is nested too deeply or has too many members")
    if not isinstance(value, dict):
        raise ValueError("a layout node is not a JSON object")
    kind = value.get("kind")
    size = value.get("size")
    if kind == "int":
        c = value.get("c")
        if c not in ("int", "char", "bool") or not isinstance(value.get("signed"), bool):
            raise ValueError("an integer node needs 'c' (int, char, bool) and 'signed'")
        return IntType(_int(size, 1, 16, "an integer's size"), value["signed"], c)
    if kind == "float":
        return FloatType(_int(size, 2, 16, "a float's size"))
    if kind == "pointer":
        return PointerType(_int(size, 4, 8, "a pointer's size"))
    if kind == "opaque":
        return OpaqueType(_int(size, 0, MAX_SAMPLE, "an opaque member's size"))
    if kind == "enum":
        members = value.get("members")
        if not isinstance(members, list) or len(members) > MAX_NODES or not isinstance(
                value.get("signed"), bool):
            raise ValueError("an enum node needs 'members' (a list) and 'signed'")
        pairs = []
        for pair in members:
            if not isinstance(pair, list) or len(pair) != 2:
                raise ValueError("an enum member is not a [name, value] pair")
            pairs.append((_name(pair[0], "an enum member's name"),
                          _int(pair[1], -(1 << 63), (1 << 64) - 1, "an enum value")))
        return EnumType(_name(value.get("name"), "an enum's name"),
                        _int(size, 1, 8, "an enum's size"), value["signed"], tuple(pairs))
    if kind == "array":
        elem = _node(value.get("elem"), depth + 1, budget)
        count = _int(value.get("count"), 0, MAX_SAMPLE, "an array's count")
        if count * type_size(elem) > MAX_SAMPLE:
            raise ValueError("an array is larger than a sample can be")
        return ArrayType(elem, count)
    if kind in ("struct", "union"):
        size = _int(size, 0, MAX_SAMPLE, "a struct's size")
        members = value.get("members")
        if not isinstance(members, list):
            raise ValueError("a struct node needs 'members' (a list)")
        out = []
        for member in members:
            if not isinstance(member, dict):
                raise ValueError("a struct member is not a JSON object")
            t = _node(member.get("type"), depth + 1, budget)
            offset = _int(member.get("offset"), 0, size, "a member's offset")
            if offset + type_size(t) > size:
                raise ValueError("a member goes past the end of its struct")
            out.append(Member(_name(member.get("name"), "a member's name"), offset, t))
        return RecordType(_name(value.get("name"), "a struct's name"), kind == "union", size,
                          tuple(out))
    raise ValueError(f"unknown layout node kind {kind!r}")


def _shape(t: Any) -> Any:
    """A layout's JSON without the names that only name classes (structs', enums'):
    what decides the values a decoder makes."""
    if isinstance(t, dict):
        return {k: _shape(v) for k, v in t.items() if not (k == "name" and t.get("kind") in (
            "struct", "union", "enum"))}
    if isinstance(t, list):
        return [_shape(v) for v in t]
    return t


def same_decoding(recorded: dict[str, Any], decoder: SizedDecoder) -> str | None:
    """None if ``decoder`` decodes samples into the same values as the recorded one did;
    else what differs."""
    if decoder.layout is None:
        return "the stream's decoder has no layout"
    given = decoder_json(decoder)
    if recorded.get("order") != given["order"]:
        return "byte order"
    if recorded.get("size") != given["size"]:
        return f"{recorded.get('size')} bytes against {given['size']}"
    if _shape(recorded.get("layout")) != _shape(given["layout"]):
        return "members"
    return None
