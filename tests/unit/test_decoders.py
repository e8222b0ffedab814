"""Decoders without a kernel: what C types decode to (ctypes structures and layouts
compiled like BTF), names, enums, pickling to another process, JSON, NumPy dtypes.

The same values, written by a BPF program and decoded from BTF and from a ctypes
mirror, are checked in tests/kernel/test_decode.py."""

from __future__ import annotations

import concurrent.futures
import ctypes
import json
import multiprocessing
import pickle
import struct
from typing import Any

import numpy as np
import pytest

import aperf
from aperf._decoding.decode import compile_layout
from aperf._decoding.layout import EnumType, IntType, Member, RecordType

c = ctypes


class Word(c.Union):
    _fields_ = (("u", c.c_uint32), ("s", c.c_int32), ("b", c.c_uint8 * 4))


class Ids(c.Structure):
    _fields_ = (("pid", c.c_uint32), ("tid", c.c_uint32))


class Halves(c.Union):
    _fields_ = (("addr", c.c_uint64), ("halves", c.c_uint32 * 2))


class Event(c.Structure):
    _anonymous_ = ("ids", "either")
    _fields_ = (
        ("c", c.c_char), ("u8s", c.c_uint8 * 3), ("s8s", c.c_byte * 2),
        ("names", (c.c_char * 4) * 2), ("word", Word), ("ids", Ids), ("either", Halves),
        ("ptr", c.POINTER(c.c_int)), ("nothing", c.c_void_p), ("text", c.c_char_p),
        ("from", c.c_uint16), ("None", c.c_uint16), ("__pad", c.c_uint32),
        ("ratio", c.c_double), ("ok", c.c_bool),
    )


def event_bytes() -> bytes:
    e = Event()
    e.c = b"\xfe"
    e.u8s[:] = [1, 0, 255]
    e.s8s[:] = [-1, 5]
    e.names[0].value = b"ab"
    e.names[1].value = b"wxyz"
    e.word.u = 0xFFFFFFFE
    e.pid, e.tid = 7, 8
    e.addr = 0x0000000200000001
    e.ptr = c.cast(c.c_void_p(0x1234), c.POINTER(c.c_int))
    setattr(e, "from", 3)
    setattr(e, "None", 4)
    setattr(e, "__pad", 5)
    e.ratio = 0.5
    e.ok = True
    return bytes(e)


def test_ctypes_values_follow_the_c_rules() -> None:
    decode = aperf.decoders.from_ctypes(Event)
    v = decode(event_bytes() + b"padding")
    assert v.c == -2  # a single char is C's (signed) char, as BTF says
    assert v.u8s == b"\x01\x00\xff" and v.s8s == b"\xff\x05"  # 1-byte arrays: bytes
    assert v.names == ("ab", "wxyz")  # char[2][4]: strings
    assert v.word == (0xFFFFFFFE, -2, b"\xfe\xff\xff\xff") and v.word.s == -2  # every member
    assert (v.pid, v.tid) == (7, 8)  # anonymous members' fields are the record's own
    assert (v.addr, v.halves) == (0x200000001, (1, 2))
    assert (v.ptr, v.nothing, v.text) == (0x1234, 0, 0)  # pointers: addresses; NULL: 0
    assert (v.from_, v.None_, v.pad_) == (3, 4, 5)  # the naming rule
    assert (v.ratio, v.ok) == (0.5, True)
    assert v._fields == ("c", "u8s", "s8s", "names", "word", "pid", "tid", "addr", "halves",
                         "ptr", "nothing", "text", "from_", "None_", "pad_", "ratio", "ok")
    assert decode.size == c.sizeof(Event)
    with pytest.raises(ValueError, match=f"needs {c.sizeof(Event)} bytes"):
        decode(event_bytes()[:-1])


def test_the_compiled_ctypes_decoder_equals_ctypes_itself() -> None:
    """Every field, read by ctypes from the same bytes, converted by the documented rules."""
    data = event_bytes()
    v = aperf.decoders.from_ctypes(Event)(data)
    e = Event.from_buffer_copy(data)
    assert v.c == int.from_bytes(e.c, "little", signed=True)
    assert v.u8s == bytes(e.u8s) and v.s8s == bytes(e.s8s)
    assert v.names == tuple(n.value.decode() for n in e.names)
    assert (v.pid, v.addr, v.halves) == (e.pid, e.addr, tuple(e.halves))
    assert v.ptr == c.cast(e.ptr, c.c_void_p).value and v.nothing == (e.nothing or 0)


def test_records_are_tuples_with_the_named_tuple_api() -> None:
    decode = aperf.decoders.from_struct("<IH", names="pid from")
    v = decode(struct.pack("<IH", 1, 2))
    assert v == (1, 2) and v.pid == 1 and v.from_ == 2
    assert v._fields == ("pid", "from_") and v._asdict() == {"pid": 1, "from_": 2}
    assert v._replace(pid=9) == (9, 2) and type(v)._make([3, 4]) == (3, 4)
    assert repr(v) == "Record(pid=1, from_=2)"
    assert isinstance(v, aperf.decoders.Record) and isinstance(v, tuple)
    with pytest.raises(AttributeError):
        v.pid = 5  # type: ignore[misc]
    with pytest.raises(ValueError, match="values"):
        aperf.decoders.from_struct("<IH", names="just_one")


COLOR = EnumType("color", 4, False, (("RED", 1), ("BLUE", 4)))
SHAPE = RecordType("shape", False, 8, (Member("color", 0, COLOR),
                                        Member("sides", 4, IntType(4, False))))


def test_enum_fields_never_change_type() -> None:
    decode = compile_layout(SHAPE, "struct shape")
    blue, odd = decode(struct.pack("<II", 4, 3)), decode(struct.pack("<II", 7, 3))
    assert type(blue.color) is type(odd.color)
    assert isinstance(odd.color, aperf.decoders.CEnum)
    assert blue.color.name == "BLUE" and blue.color == 4
    assert odd.color.name is None and odd.color == 7 and int(odd.color) == 7
    assert repr(odd.color) == "<color: 7>" and f"{odd.color}" == "7"


def _roundtrip_in_another_process(blob: bytes) -> tuple[str, bool, str]:
    value = pickle.loads(blob)
    return repr(value), value == pickle.loads(blob), type(value.color).__name__


def test_records_and_enums_pickle_into_a_process_that_never_built_the_decoder() -> None:
    decode = compile_layout(SHAPE, "struct shape")
    values = [decode(struct.pack("<II", 4, 3)), decode(struct.pack("<II", 9, 5))]
    for value in values:
        assert pickle.loads(pickle.dumps(value)) == value
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        results = list(pool.map(_roundtrip_in_another_process, [pickle.dumps(v) for v in values]))
    assert results == [
        ("shape(color=<color.BLUE: 4>, sides=3)", True, "color"),
        ("shape(color=<color: 9>, sides=5)", True, "color"),
    ]


def test_jsonable_turns_records_into_json() -> None:
    decode = aperf.decoders.from_ctypes(Event)
    v = decode(event_bytes())
    doc = json.loads(json.dumps(aperf.decoders.jsonable(v)))
    assert doc["u8s"] == "0100ff" and doc["names"] == ["ab", "wxyz"]
    assert doc["word"] == {"u": 0xFFFFFFFE, "s": -2, "b": "feffffff"}
    assert doc["pid"] == 7 and doc["from_"] == 3
    shape = compile_layout(SHAPE, "struct shape")
    blue = shape(struct.pack("<II", 4, 3))
    assert aperf.decoders.jsonable(blue) == {"color": "BLUE", "sides": 3}
    assert aperf.decoders.jsonable(shape(struct.pack("<II", 9, 3))) == {"color": 9, "sides": 3}
    assert aperf.decoders.jsonable(blue, enums="value") == {"color": 4, "sides": 3}
    sample = aperf.Sample(1, b"\x01", shape(struct.pack("<II", 1, 3)))
    assert aperf.decoders.jsonable(sample) == {
        "cpu": 1, "data": "01", "value": {"color": "RED", "sides": 3}}
    assert aperf.decoders.jsonable(np.arange(3)) == [0, 1, 2]
    with pytest.raises(TypeError, match="no JSON form"):
        aperf.decoders.jsonable(object())


def test_ctypes_refuses_what_it_cannot_decode_by_name() -> None:
    class Bits(c.Structure):
        _fields_ = (("flags", c.c_uint32, 3),)

    class Wide(c.Structure):
        _fields_ = (("w", c.c_wchar),)

    class Swapped(c.BigEndianStructure):
        _fields_ = (("port", c.c_uint16),)

    with pytest.raises(TypeError, match="bitfield member 'flags'"):
        aperf.decoders.from_ctypes(Bits)
    with pytest.raises(TypeError, match=r"Wide\.w"):
        aperf.decoders.from_ctypes(Wide)
    with pytest.raises(TypeError, match="byte-swapped"):
        aperf.decoders.from_ctypes(Swapped)


def test_a_zero_length_ctypes_array_at_the_end_is_the_tail() -> None:
    class Msg(c.Structure):
        _fields_ = (("len", c.c_uint32), ("body", c.c_char * 0))

    decode = aperf.decoders.from_ctypes(Msg)
    assert decode.size == 4 and decode.tail == "body"
    assert decode(struct.pack("<I", 3) + b"abc\0") == (3, b"abc\0")


def test_dtypes_name_and_place_fields_as_records_do() -> None:
    decode = aperf.decoders.from_ctypes(Event)
    dtype = decode.dtype
    assert dtype.itemsize == c.sizeof(Event)
    assert dtype.names == tuple(decode(event_bytes())._fields)
    row = np.frombuffer(event_bytes(), dtype)[0]
    assert (row["c"], bytes(row["u8s"])) == (-2, b"\x01\x00\xff")
    assert list(row["names"]) == [b"ab", b"wxyz"]
    assert (row["word"]["s"], row["pid"], row["halves"].tolist()) == (-2, 7, [1, 2])
    assert (row["from_"], row["pad_"], row["ok"]) == (3, 5, True)


@pytest.mark.parametrize("fmt", ["<IQ", "@IQ", "IQ", ">hxI", "=3sBd", "!Q", "@bQ?Hq"])
def test_struct_format_dtypes_read_what_struct_unpacks(fmt: str) -> None:
    packed = struct.Struct(fmt)
    data = bytes(range(1, packed.size + 1))
    row = np.frombuffer(data, aperf.decoders.from_struct(packed).dtype)[0]
    # "s" is bytes, like any 1-byte array: a uint8 column (numpy's "S" would drop NULs).
    values = tuple(bytes(v) if isinstance(v, np.ndarray) else v for v in row.tolist())
    assert values == packed.unpack(data)


class Flat(c.Structure):
    _fields_ = (("seq", c.c_uint64), ("ts", c.c_uint64), ("pid", c.c_uint32),
                ("cpu", c.c_uint32))


class Named(c.Structure):
    _fields_ = (("seq", c.c_uint64), ("comm", c.c_char * 8))


@pytest.mark.parametrize("make", [
    lambda: aperf.decoders.from_ctypes(Flat),  # a record made straight from the row
    lambda: aperf.decoders.from_ctypes(Named),  # a record with a string: generated code
    lambda: aperf.decoders.from_struct("<QQII", "seq ts pid cpu"),
    lambda: aperf.decoders.from_struct("<QQII"),  # plain tuples
], ids=["straight", "generated", "struct-named", "struct-plain"])
def test_each_row_gives_what_decode_rows_gives(make: Any) -> None:
    # The builder takes values one at a time from each_row(): the same values, types,
    # reprs and pickles as decode_rows() and as decoding each sample.
    decoder = make()
    rows = [bytes([i]) * decoder.size for i in range(1, 6)]
    unpacked = [decoder.struct.unpack(r) for r in rows]
    each = list(decoder.each_row(iter(unpacked)))
    assert each == decoder.decode_rows(unpacked) == [decoder(r) for r in rows]
    assert [type(v) for v in each] == [type(decoder(r)) for r in rows]
    assert [repr(v) for v in each] == [repr(decoder(r)) for r in rows]
    assert [pickle.loads(pickle.dumps(v)) for v in each] == each
