"""Encoders are the inverse of decoders: decode(encode(v)) == v, on every layout kind."""

from __future__ import annotations

import ctypes
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

import aperf
from aperf._decoding.decode import from_ctypes as decoder_of
from aperf._decoding.encode import from_ctypes, from_struct, raw_bytes
from aperf._rings.ringbuf.format import BUSY_BIT, DISCARD_BIT
from aperf._rings.ringbuf.user_format import UserRingWriter, record_step


class Inner(ctypes.Structure):
    _fields_ = (("a", ctypes.c_uint16), ("b", ctypes.c_int8))


class Either(ctypes.Union):
    _fields_ = (("word", ctypes.c_uint32), ("half", ctypes.c_uint16))


class Outer(ctypes.Structure):
    _fields_ = (
        ("seq", ctypes.c_uint64), ("ratio", ctypes.c_double), ("ok", ctypes.c_bool),
        ("inner", Inner), ("pairs", Inner * 2), ("either", Either), ("text", ctypes.c_char * 8),
        ("raw", ctypes.c_uint8 * 3), ("ptr", ctypes.c_void_p),
    )


class WithTail(ctypes.Structure):
    _fields_ = (("len", ctypes.c_uint32), ("data", ctypes.c_uint8 * 0))


def test_ctypes_layouts_round_trip_through_their_decoder() -> None:
    decode, encode = decoder_of(Outer), from_ctypes(Outer)
    value = Outer(seq=1 << 40, ratio=0.5, ok=True, text=b"abc", ptr=0x1234)
    value.inner.a, value.inner.b = 7, -2
    value.pairs[1].a = 9
    value.either.word = 0x01020304
    value.raw[:] = (1, 2, 3)
    data = encode(value)
    assert data == bytes(value)  # an instance goes as it is
    record = decode(data)
    assert encode(record) == data  # and its decoded record encodes back to the same bytes
    partial = Outer(seq=5, text="hé".encode())
    assert decode(encode({"seq": 5, "text": "hé"})) == decode(bytes(partial))


def test_a_flexible_tail_is_appended() -> None:
    decode, encode = decoder_of(WithTail), from_ctypes(WithTail)
    data = encode({"len": 3, "data": b"xyz"})
    assert data == struct.pack("<I", 3) + b"xyz"
    assert decode(data) == (3, b"xyz")
    assert encode(decode(data)) == data


class PaddedTail(ctypes.Structure):
    """sizeof 16, the tail at 10: a tail of up to 6 bytes ends inside the padding."""

    _fields_ = (("seq", ctypes.c_uint64), ("len", ctypes.c_uint16), ("data", ctypes.c_uint8 * 0))


class TextTail(ctypes.Structure):
    """sizeof 8, the tail (char[]) at 5."""

    _fields_ = (("a", ctypes.c_uint32), ("b", ctypes.c_int8), ("text", ctypes.c_char * 0))


U32 = st.integers(0, 2**32 - 1)
TAILED = {  # each struct with a tail, and its fixed fields' values
    PaddedTail: (st.integers(0, 2**64 - 1), st.integers(0, 2**16 - 1)),
    TextTail: (U32, st.integers(-128, 127)),
    WithTail: (U32,),
}


@given(st.data())
def test_flexible_tails_of_any_length_round_trip(data: st.DataObject) -> None:
    """decode(encode(v)) == v for every tail, the short ones too (0 or 1 byte, or any
    that ends before sizeof): the message is the fixed part and the tail, no padding."""
    cls = data.draw(st.sampled_from(list(TAILED)))
    decode, encode = decoder_of(cls), from_ctypes(cls)
    fixed = [data.draw(field) for field in TAILED[cls]]
    tail = data.draw(st.binary(max_size=24) | st.binary(max_size=1))
    value = (*fixed, tail)
    encoded = encode(value)
    assert len(encoded) == decode.size + len(tail)
    assert decode(encoded) == value
    names = [name for name, _ in cls._fields_]
    assert decode(encode(dict(zip(names, value, strict=True)))) == value


@pytest.mark.parametrize(
    "value, where",
    [({"seq": -1}, "seq"), ({"text": "x" * 8}, "text"), ({"raw": b"1234"}, "raw"),
     ({"pairs": [(1, 2)]}, "pairs"), ({"either": {"word": 1, "half": 2}}, "either"),
     ({"inner": 5}, "inner"), ({"zzz": 1}, "zzz"), ((1, 2), "fields")],
)
def test_bad_values_raise_an_argument_error_naming_the_field(value: object, where: str) -> None:
    with pytest.raises(aperf.ArgumentError, match=where) as info:
        from_ctypes(Outer)(value)
    assert info.value.argument == "value"


def test_struct_and_raw_encoders() -> None:
    assert from_struct(struct.Struct("<IH"))((1, 2)) == b"\1\0\0\0\2\0"
    assert from_struct(struct.Struct("<Q"))(5) == (5).to_bytes(8, "little")
    with pytest.raises(aperf.ArgumentError):
        from_struct(struct.Struct("<B"))(300)
    assert raw_bytes(bytearray(b"ab")) == b"ab"
    with pytest.raises(aperf.ArgumentError):
        raw_bytes("ab")


def test_the_writer_lays_records_out_as_the_kernel_reads_them() -> None:
    size = 256
    consumer, producer = bytearray(4096), bytearray(4096 + 2 * size)
    writer = UserRingWriter(consumer, producer, 4096, size)
    view = writer.reserve(5)
    assert view is not None
    assert struct.unpack_from("<IIQ", producer[4096:], 0)[:2] == (5 | BUSY_BIT, 0)
    assert struct.unpack_from("<Q", producer)[0] == 16  # producer_pos moved at reserve
    view[:] = b"hello"
    writer.commit(view)
    assert struct.unpack_from("<I", producer, 4096)[0] == 5  # BUSY cleared after the data
    assert producer[4096 + 8 : 4096 + 13] == b"hello"
    other = writer.reserve(1)
    assert other is not None
    writer.commit(other, discard=True)
    assert struct.unpack_from("<I", producer, 4096 + 16)[0] == 1 | DISCARD_BIT
    assert writer.free_bytes() == size - 32
    # Wrapping: the kernel consumed everything; a record across the end reads whole.
    struct.pack_into("<Q", consumer, 0, 240)
    struct.pack_into("<Q", producer, 0, 240)
    wrap = writer.reserve(20)
    assert wrap is not None and len(wrap) == 20
    wrap[:] = bytes(range(20))
    writer.commit(wrap)
    assert producer[4096 + 248 : 4096 + 256] == bytes(range(8))
    assert producer[4096 + 256 : 4096 + 268] == bytes(range(8, 20))  # the second mapping
    assert record_step(20) == 32 and writer.reserve(size) is None
    writer.release(discard_pending=True)
