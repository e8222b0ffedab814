"""Arrow record batches without root: SampleArray.to_arrow() and ArrowBuilder give the
values the decoder's records hold, typed from the C layout, with the columns the stream
adds; fixed-width columns are NumPy buffers handed to Arrow; no pyarrow, a typed error
naming the extra. The async tests run on asyncio, uvloop and trio."""

from __future__ import annotations

import ctypes
import enum
import json
import struct
import subprocess
import sys
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import aperf
from aperf._arrow.columns import Tabler
from aperf._decoding.decode import compile_layout
from aperf._decoding.layout import ArrayType, EnumType, IntType, Member, RecordType
from aperf.testing import FakeRingSource

QQ = aperf.decoders.from_struct("<QQ", names="seq ts")


class Point(ctypes.Structure):
    _fields_ = [("x", ctypes.c_int16), ("y", ctypes.c_int16)]


class Word(ctypes.Union):
    _fields_ = [("u", ctypes.c_uint32), ("b", ctypes.c_uint8 * 4)]


class Event(ctypes.Structure):
    """Every kind a column can have (but enums: ctypes has none; see STATE below)."""

    _fields_ = [
        ("seq", ctypes.c_uint64), ("comm", ctypes.c_char * 8), ("flag", ctypes.c_bool),
        ("raw", ctypes.c_uint8 * 3), ("pts", Point * 2), ("where", Point),
        ("f", ctypes.c_double), ("g", ctypes.c_float), ("names", (ctypes.c_char * 4) * 2),
        ("p", ctypes.c_void_p), ("word", Word), ("matrix", (ctypes.c_int16 * 3) * 2),
        ("c", ctypes.c_char), ("s8", ctypes.c_int8),
    ]


def event(seq: int, comm: bytes) -> bytes:
    e = Event()
    e.seq, e.comm, e.flag, e.f, e.g, e.p, e.c, e.s8 = seq, comm, seq % 2 == 0, seq / 2, 0.5, (
        0xFFFF0000 + seq), b"A", -seq
    e.raw[:] = [seq & 0xFF, 0, 0xFF]
    e.pts[0].x, e.pts[1].y = seq, -seq
    e.where.x, e.where.y = 7, -7
    e.names[0].value, e.names[1].value = b"ab", b"\xff"
    e.word.u = 0xFFFFFFFE
    e.matrix[1][2] = seq
    return bytes(e)


def as_rows(value: Any) -> Any:
    """A decoded value as Arrow's to_pylist() shows it: records as dicts, tuples as lists."""
    asdict = getattr(value, "_asdict", None)
    if asdict is not None:
        return {k: as_rows(v) for k, v in asdict().items()}
    if isinstance(value, tuple | list):
        return [as_rows(v) for v in value]
    if isinstance(value, enum.Enum):
        return int(value)
    return value


async def arrays_and_events(decoder: Any, payloads: list[tuple[int, bytes]],
                            **stream: Any) -> tuple[list[Any], list[Any]]:
    """The same payloads through arrays() and through per-item iteration."""
    out = []
    for mode in ("arrays", "events"):
        src = FakeRingSource(cpus=[0, 1], ring_bytes=1 << 16)
        async with aperf.PerfStream(src, decoder=decoder, **stream) as s:
            for cpu, payload in payloads:
                assert src.write(cpu, payload)
            s.flush()
            items: list[Any] = []
            rows = 0
            iterator = s.arrays() if mode == "arrays" else s
            async for item in iterator:
                items.append(item)
                rows += len(item) if isinstance(item, aperf.SampleArray) else 1
                if rows == len(payloads):
                    break
        out.append(items)
    return out[0], out[1]


@pytest.mark.anyio
async def test_a_batch_holds_what_the_records_hold_typed_from_the_layout() -> None:
    payloads = [(i % 2, event(i, b"sh" if i != 3 else b"a\xff\xfeb\0zz")) for i in range(7)]
    arrays, events = await arrays_and_events(Event, payloads)
    rows = [row for item in arrays for row in item.to_arrow().to_pylist()]
    expected = [{"_cpu": e.cpu, "_late": False, **as_rows(e.value)} for e in events]
    assert rows == expected  # every field, sample by sample, in stream order
    third = next(r for r in rows if r["seq"] == 3)
    assert third["comm"] == "a\ufffd\ufffdb"  # cut at the NUL; bad UTF-8 visible, no error
    schema = arrays[0].to_arrow().schema
    assert schema.names[:2] == ["_cpu", "_late"]
    types = {f.name: f.type for f in schema}
    assert types["seq"] == pa.uint64() and types["s8"] == pa.int8() and types["c"] == pa.int8()
    assert types["comm"] == pa.string() and types["flag"] == pa.bool_()
    assert types["raw"] == pa.binary(3)  # bytes, as records have them
    assert types["pts"] == pa.list_(pa.struct([("x", pa.int16()), ("y", pa.int16())]), 2)
    assert types["where"] == pa.struct([("x", pa.int16()), ("y", pa.int16())])
    assert types["names"] == pa.list_(pa.string(), 2)
    assert types["matrix"] == pa.list_(pa.list_(pa.int16(), 3), 2)
    assert types["word"] == pa.struct([("u", pa.uint32()), ("b", pa.binary(4))])  # overlapping
    assert types["f"] == pa.float64() and types["g"] == pa.float32()
    assert types["p"] == pa.uint64() and schema.field("p").metadata == {
        b"aperf.c_type": b"pointer"}


def test_enums_are_their_integers_with_the_names_in_the_field_metadata() -> None:
    state = EnumType("run_state", 4, False, (("IDLE", 0), ("RUNNING", 1)))
    layout = RecordType("task", False, 8, (Member("state", 0, state),
                                           Member("cpu", 4, IntType(4, True))))
    decoder = compile_layout(layout, "task")
    tabler = Tabler(decoder)
    values = np.frombuffer(struct.pack("<Ii", 1, 3) + struct.pack("<Ii", 7, 4),
                           decoder.dtype)
    batch = tabler.batch(2, tabler.decoded(values))
    field = batch.schema.field("state")
    assert field.type == pa.uint32()
    assert json.loads(field.metadata[b"aperf.enum"]) == {
        "name": "run_state", "members": {"IDLE": 0, "RUNNING": 1}}
    assert batch.column("state").to_pylist() == [1, 7]  # 7: a value the enum does not name
    assert [decoder(struct.pack("<Ii", 1, 3)).state.name] == ["RUNNING"]


def test_a_contiguous_column_is_handed_to_arrow_without_a_copy() -> None:
    tabler = Tabler(QQ)
    column = np.arange(1000, dtype="<u8")
    array = tabler.column(IntType(8, False), column)
    assert array.buffers()[1].address == column.ctypes.data  # the NumPy buffer itself
    # A field of records (strided) is gathered once; that copy is then Arrow's buffer.
    records = np.zeros(10, QQ.dtype)
    records["seq"] = range(10)
    gathered = tabler.column(IntType(8, False), records["seq"])
    assert gathered.to_pylist() == list(range(10))
    assert gathered.buffers()[1].address != records.ctypes.data


@pytest.mark.anyio
async def test_a_flexible_array_members_tail_is_a_binary_column() -> None:
    class Msg(ctypes.Structure):
        _fields_ = [("len", ctypes.c_uint32), ("data", ctypes.c_uint8 * 0)]

    texts = [b"hello", b"variable", b"", b"length"]
    payloads = [(0, len(t).to_bytes(4, "little") + t) for t in texts]
    arrays, events = await arrays_and_events(Msg, payloads)
    batch = arrays[0].to_arrow()
    assert batch.schema.field("data").type == pa.binary()
    assert batch.column("data").to_pylist() == [e.value.data for e in events]
    assert [d[:n] for d, n in zip(batch.column("data").to_pylist(),
                                  batch.column("len").to_pylist(), strict=True)] == texts


@pytest.mark.anyio
async def test_an_ordered_stream_says_each_rows_ring_and_lateness() -> None:
    payloads = [(cpu, QQ.struct.pack(seq, seq)) for seq, cpu in
                [(1, 0), (3, 0), (2, 1), (4, 1)]]
    arrays, _ = await arrays_and_events(QQ, payloads, order_by="ts")
    batch = pa.Table.from_batches([a.to_arrow() for a in arrays]).to_pylist()
    assert [(r["seq"], r["_cpu"], r["_late"]) for r in batch] == [
        (1, 0, False), (2, 1, False), (3, 0, False), (4, 1, False)]


@pytest.mark.anyio
async def test_a_stream_of_several_maps_says_each_rows_map() -> None:
    a, b = FakeRingSource(cpus=[0], name="a"), FakeRingSource(cpus=[1], name="b")
    async with aperf.PerfStream({"first": a, "second": b}, decoder=QQ) as stream:
        a.write(0, QQ.struct.pack(1, 0))
        b.write(1, QQ.struct.pack(2, 0))
        stream.flush()
        rows = []
        async for item in stream.arrays():
            rows += item.to_arrow().to_pylist()
            if len(rows) == 2:
                break
    assert sorted((r["_map"], r["_cpu"], r["seq"]) for r in rows) == [
        ("first", 0, 1), ("second", 1, 2)]


@pytest.mark.anyio
async def test_the_builder_makes_from_events_what_arrays_make() -> None:
    payloads = [(i % 2, event(i, b"x" * (i % 9))) for i in range(40)]
    arrays, events = await arrays_and_events(Event, payloads)
    builder = aperf.ArrowBuilder(Event, max_rows=16)
    batches = [b for b in map(builder.add, events) if b is not None]
    rest = builder.flush()
    assert [b.num_rows for b in batches] == [16, 16] and rest is not None
    assert rest.num_rows == 8 and builder.flush() is None and len(builder) == 0
    from_events = pa.Table.from_batches([*batches, rest])
    from_arrays = pa.Table.from_batches([a.to_arrow() for a in arrays])
    assert from_events.schema == from_arrays.schema
    key = ["seq"]
    assert from_events.sort_by([(k, "ascending") for k in key]).equals(
        from_arrays.sort_by([(k, "ascending") for k in key]))


def test_the_builder_holds_at_most_max_bytes_and_refuses_what_is_not_a_sample() -> None:
    builder = aperf.ArrowBuilder(QQ, max_bytes=100, raw=True)
    sample = aperf.Sample(0, QQ.struct.pack(1, 2) + bytes(20))  # 36 bytes, as the kernel pads
    assert builder.add(sample) is None and builder.add(sample) is None
    batch = builder.add(sample)  # 108 bytes held: handed out
    assert batch is not None and batch.num_rows == 3 and len(builder) == 0
    assert batch.column("_data").to_pylist() == [sample.data] * 3
    with pytest.raises(TypeError, match="Lost notice is not a sample"):
        builder.add(aperf.Lost(0, 5))
    with pytest.raises(TypeError, match=r"takes aperf\.Sample"):
        builder.add("a string")


def test_a_sample_the_decoder_refused_is_a_row_of_nulls_in_place() -> None:
    builder = aperf.ArrowBuilder(QQ, raw=True)
    good = aperf.Sample(0, QQ.struct.pack(1, 2))
    error = aperf.DecodeError(1, b"abc", "too short")
    for ev in (good, aperf.BadSample(1, b"abc", error), good):
        builder.add(ev)
    batch = builder.flush()
    assert batch.to_pylist() == [
        {"_cpu": 0, "_late": False, "seq": 1, "ts": 2, "_data": good.data},
        {"_cpu": 1, "_late": False, "seq": None, "ts": None, "_data": b"abc"},
        {"_cpu": 0, "_late": False, "seq": 1, "ts": 2, "_data": good.data},
    ]


def test_fleet_events_carry_their_host_and_stream() -> None:
    builder = aperf.ArrowBuilder(QQ, fleet=True)
    builder.add(("web1", "tracer", aperf.Sample(3, QQ.struct.pack(5, 6))))
    assert builder.flush().to_pylist() == [
        {"_cpu": 3, "_host": "web1", "_stream": "tracer", "_late": False, "seq": 5, "ts": 6}]


def test_arrays_made_by_hand_have_no_decoder_to_type_them() -> None:
    with pytest.raises(TypeError, match="not made by a stream"):
        aperf.SampleArray(0, np.zeros(1, QQ.dtype)).to_arrow()


def test_without_pyarrow_the_error_names_the_extra() -> None:
    code = (
        "import sys; sys.modules['pyarrow'] = None\n"  # makes `import pyarrow` fail
        "import aperf, struct, asyncio\n"
        "from aperf.testing import FakeRingSource\n"
        "try:\n"
        "    aperf.ArrowBuilder(struct.Struct('<Q'))\n"
        "except aperf.MissingExtraError as exc:\n"
        "    print(exc, exc.extra, isinstance(exc, ImportError))\n"
        "async def main():\n"
        "    src = FakeRingSource()\n"
        "    async with aperf.PerfStream(src, decoder=struct.Struct('<Q')) as s:\n"
        "        src.write(0, bytes(8)); s.flush()\n"
        "        async for item in s.arrays():\n"
        "            try:\n"
        "                item.to_arrow()\n"
        "            except ImportError as exc:\n"
        "                print(exc, exc.extra, isinstance(exc, ImportError))\n"
        "            break\n"
        "asyncio.run(main())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    lines = out.stdout.splitlines()
    assert len(lines) == 2
    assert all("needs pyarrow: pip install 'aperf-bpf[arrow]' arrow True" in line
               for line in lines)


def test_importing_aperf_does_not_import_pyarrow() -> None:
    code = "import sys, aperf, aperf.decoders, aperf.testing; print('pyarrow' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_char_arrays_of_every_shape_become_strings() -> None:
    layout = RecordType("s", False, 8, (
        Member("a", 0, ArrayType(IntType(1, True, "char"), 8)),))
    tabler = Tabler(compile_layout(layout, "s"))
    raw = [b"\0" * 8, b"abcdefgh", b"ab\0cdefg", b"\xc3\xa9t\xc3\0\0\0\0", b"\xff" * 8]
    values = np.frombuffer(b"".join(raw), tabler.decoder.dtype)
    got = tabler.strings(values["a"]).to_pylist()
    assert got == ["", "abcdefgh", "ab", "\u00e9t\ufffd", "\ufffd" * 8]
    assert got == [aperf.decoders.c_string(r) for r in raw]  # what records hold
