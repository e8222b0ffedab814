"""Typed samples: BTF, ctypes and struct decoders; decode errors; batches."""

from __future__ import annotations

import ctypes
import enum
import json
import os
import pickle
import struct
from functools import partial
from typing import Any

import anyio
import numpy as np
import pytest

import aperf
from aperf._native import libbpf as lb
from aperf.testing import Producer, object_path

from ..helpers import BPF_DIR, run_until, take

pytestmark = [pytest.mark.usefixtures("kernel"), pytest.mark.anyio]
CPU = sorted(os.sched_getaffinity(0))[-1]
BENCH_OBJECT = BPF_DIR / "bench_getpid.bpf.o"  # bench_sample32: the producer's layout


class Head(ctypes.Structure):
    _fields_ = (("seq", ctypes.c_uint64), ("ts", ctypes.c_uint64))


class TooLong(ctypes.Structure):
    _fields_ = (("seq", ctypes.c_uint64), ("rest", ctypes.c_uint8 * 56))


def test_btf_decoding_of_every_supported_kind() -> None:
    with aperf.BPFObject(object_path("kinds")) as obj:
        obj.load()
        samples: list[aperf.Sample] = []
        with aperf.PerfBuffer(
            obj.maps["samples"], pages=1, decoder="kinds", on_sample=samples.append
        ) as pb:
            lb.test_run_on_cpu(obj.programs["emit_kinds"].fd, CPU)
            assert pb.consume() == 1
    (sample,) = samples
    assert len(sample.data) == 124  # padded; the decoder reads its own 120 bytes
    k = sample.value
    assert (k.u8, k.s8, k.u16, k.s16) == (255, -128, 65535, -32768)
    assert (k.u32, k.s32) == (2**32 - 1, -(2**31))
    assert (k.u64, k.s64) == (2**64 - 1, -(2**63))
    assert k.flag is True
    assert isinstance(k.color, enum.IntEnum) and k.color.name == "BLUE" and k.color == 4
    assert k.name == "hello"
    assert k.raw == "a\ufffd\ufffdb"  # cut at the first NUL, invalid UTF-8 replaced
    assert k.arr == (1, 2, 3, 4)
    assert (k.where.x, k.where.y) == (-5, 7)
    assert [(p.x, p.y) for p in k.pts] == [(1, 2), (3, 4)]
    assert k.matrix == ((1, 2, 3), (4, 5, 6))
    assert type(k).__name__ == "kinds" and "name='hello'" in repr(k)
    with pytest.raises(AttributeError):
        k.u8 = 1  # immutable
    assert k._asdict()["s64"] == -(2**63)


def test_unknown_btf_struct_lists_known_ones() -> None:
    with aperf.BPFObject(object_path("kinds")) as obj, pytest.raises(
        aperf.UnknownNameError, match="kinds"
    ):
        aperf.decoders.from_btf(obj, "struct nope")


def test_a_struct_missing_from_btf_says_how_it_gets_there() -> None:
    path = object_path("kinds")
    with aperf.BPFObject(path) as obj, pytest.raises(aperf.UnknownNameError) as info:
        aperf.decoders.from_btf(obj, "not_there")
    message = str(info.value)
    assert message.startswith("no struct in the object's BTF named 'not_there'; known: ")
    # The usual cause, a struct only a stack variable uses, and the fix and the check:
    assert "global variable or a function's signature" in message
    assert "'struct not_there *unused_not_there __attribute__((unused));'" in message
    assert f"'bpftool btf dump file {path} | grep STRUCT'" in message


def test_a_misspelt_struct_is_suggested_and_nothing_else() -> None:
    with aperf.BPFObject(object_path("kinds")) as obj, pytest.raises(
        aperf.UnknownNameError
    ) as info:
        aperf.decoders.from_btf(obj, "kind")
    assert str(info.value) == "no struct in the object's BTF named 'kind'; did you mean 'kinds'?"
    assert info.value.suggestions[0] == "kinds"


def test_among_a_kernels_worth_of_structs_a_typo_is_one_short_line() -> None:
    # The tracer's object holds some 90 structs (kernel ones its CO-RE reads use): a typo
    # used to list them all, 1,774 characters; now the match, and, without one, 20 names.
    with aperf.BPFObject(object_path("bootstrap_legacy")) as obj:
        with pytest.raises(aperf.UnknownNameError) as typo:
            aperf.decoders.from_btf(obj, "evnet")
        with pytest.raises(aperf.UnknownNameError) as stranger:
            aperf.decoders.from_btf(obj, "zzz_nothing_like_it")
    assert str(typo.value) == "no struct in the object's BTF named 'evnet'; did you mean 'event'?"
    assert len(typo.value.known) > 50  # all still there, for code that wants them
    message = str(stranger.value)
    listed = message.split("known: ", 1)[1].split(" and ", 1)[0].split(", ")
    assert listed == sorted(stranger.value.known)[:20]
    assert f" and {len(stranger.value.known) - 20} more. clang writes" in message


def test_btf_name_needs_an_object_map(producer: Producer) -> None:
    with pytest.raises(TypeError, match="from_btf"):
        aperf.PerfStream(producer.map.fd, decoder="kinds")


async def test_ctypes_and_struct_decoders_agree(producer: Producer) -> None:
    reference = aperf.decoders.from_ctypes(Head)
    for name, decoder in [
        ("ctypes", Head),
        ("struct", struct.Struct("<QQ")),
        ("format (deprecated)", "<QQ"),
        ("named", aperf.decoders.from_struct("<QQ", names="seq ts")),
        ("callable", lambda data: struct.unpack_from("<QQ", data)),
    ]:
        if isinstance(decoder, str):
            with pytest.warns(DeprecationWarning, match=r"struct\.Struct\('<QQ'\)"):
                stream = aperf.PerfStream(producer.map, pages=64, decoder=decoder)
        else:
            stream = aperf.PerfStream(producer.map, pages=64, decoder=decoder)
        async with stream:
            producer.emit(1000, size=32, cpu=CPU, first_seq=0)
            stream.flush()
            seqs = []
            async for event in stream:
                # Every decoder's value equals every other's on the same bytes
                # (named tuples compare equal to plain tuples).
                assert event.value == reference(event.data), name
                assert event.value == struct.unpack_from("<QQ", event.data), name
                seqs.append(event.value[0])
                if len(seqs) == 1000:
                    break
        assert seqs == list(range(1000)), name


async def test_decoder_longer_than_the_sample_yields_error_items(producer: Producer) -> None:
    async with aperf.PerfStream(producer.map, pages=64, decoder=TooLong) as stream:
        producer.emit(10, size=32, cpu=CPU)
        stream.flush()
        events = [e async for e in take(stream, 10)]
        assert all(isinstance(e, aperf.BadSample) for e in events)
        bad = events[0]
        assert bad.cpu == CPU and len(bad.data) == 36
        assert isinstance(bad.error, aperf.DecodeError) and "64 bytes" in str(bad.error)
        assert stream.statistics().decode_errors == 10
        # The stream keeps running.
        producer.emit(1, size=64, cpu=CPU)
        stream.flush()
        (good,) = [e async for e in take(stream, 1)]
        assert isinstance(good, aperf.Sample) and good.value.seq == 10


def emit_short_long_short_long(producer: Producer, stream: aperf.PerfStream) -> None:
    for size in (32, 64, 32, 64):  # TooLong fits only the 64-byte ones
        producer.emit(1, size=size, cpu=CPU)
    stream.flush()


async def test_raise_and_skip_policies(producer: Producer) -> None:
    async with aperf.PerfStream(
        producer.map, pages=64, decoder=TooLong, decode_errors="raise"
    ) as stream:
        emit_short_long_short_long(producer, stream)
        outcomes = []
        for _ in range(4):
            try:
                with anyio.fail_after(5):
                    event = await anext(stream)
                outcomes.append(event.value.seq)
            except aperf.DecodeError as exc:
                outcomes.append(("error", len(exc.data)))
        assert outcomes == [("error", 36), 1, ("error", 36), 3]
        assert stream.statistics().decode_errors == 2
    async with aperf.PerfStream(
        producer.map, pages=64, decoder=TooLong, decode_errors="skip"
    ) as stream:
        emit_short_long_short_long(producer, stream)
        assert [e.value.seq async for e in take(stream, 2)] == [5, 7]
        assert stream.statistics().decode_errors == 2


def test_every_size_against_a_16_byte_type(producer: Producer) -> None:
    events: list[Any] = []
    with aperf.PerfBuffer(
        producer.map, pages=8, decoder=Head, on_sample=events.append,
        on_decode_error=events.append,
    ) as pb:
        for size in range(1, 65):
            producer.emit(1, size=size, cpu=CPU)
        assert pb.consume() == 64
        stats = pb.statistics()
    for size, event in zip(range(1, 65), events, strict=True):
        padded = ((size + 4 + 7) & ~7) - 4
        if padded >= 16:
            assert isinstance(event, aperf.Sample), size
            # below 16 bytes of real data the rest is zero from the producer...
            assert event.value.seq == size - 1
        else:
            assert isinstance(event, aperf.BadSample), size
            assert len(event.data) == padded
    assert stats.decode_errors == sum(1 for s in range(1, 65) if ((s + 11) & ~7) - 4 < 16)


async def test_batches_match_per_item_iteration(producer: Producer) -> None:
    n = 30_000
    decoder = struct.Struct("<QQ")
    runs: dict[str, list[tuple[int, int]]] = {}
    for mode in ("items", "batches", "on_batch"):
        seen: list[tuple[int, int]] = []
        done = anyio.Event()

        def on_batch(batch: list[Any], seen: list[tuple[int, int]] = seen,
                     done: anyio.Event = done) -> None:
            seen.extend((e.cpu, e.value[0]) for e in batch)
            if len(seen) >= n:
                done.set()

        async with aperf.PerfStream(producer.map, pages=1024, decoder=decoder) as stream:
            thread = producer.spawn(n, size=32, cpu=CPU)
            # first_seq restarts so all runs see the same sequence numbers
            if mode == "items":
                async for event in stream:
                    seen.append((event.cpu, event.value[0]))
                    if len(seen) == n:
                        break
            elif mode == "batches":
                sizes = []
                async for batch in stream.batches(max_items=1000):
                    sizes.append(len(batch))
                    seen.extend((e.cpu, e.value[0]) for e in batch)
                    if len(seen) == n:
                        break
                assert max(sizes) <= 1000
            else:
                await run_until(stream, partial(stream.run_batches, on_batch), done,
                                lambda thread=thread: thread)
            await anyio.to_thread.run_sync(thread.join)
        runs[mode] = [(cpu, seq % n) for cpu, seq in seen]
    assert runs["items"] == [(CPU, i) for i in range(n)]
    assert runs["batches"] == runs["items"]
    assert runs["on_batch"] == runs["items"]


async def test_tracer_event_decoded_from_btf_matches_the_kernel_bytes(tracefs: None) -> None:
    from ..helpers import BPF_DIR

    # An independent mirror of struct event, for this check only (the tracer has none).
    layout = struct.Struct("<iiI4xQ16s127s?Q")
    with aperf.BPFObject(BPF_DIR / "bootstrap_legacy.bpf.o") as obj:
        obj.load()
        obj.attach()
        async with aperf.PerfStream(obj.maps["perf_buffer"], pages=8, decoder="event") as stream:
            async with await anyio.open_process(["/bin/sh", "-c", "exit 5"]) as proc:
                assert await proc.wait() == 5
            mine = []
            with anyio.fail_after(10):
                async for event in stream:
                    if event.value.pid == proc.pid:
                        mine.append(event)
                        if event.value.exit_event:
                            break
    assert [e.value.exit_event for e in mine] == [False, True]
    for event in mine:
        assert len(event.data) == 180  # 176 bytes, padded by the kernel
        pid, ppid, code, duration, comm, filename, is_exit, stamp = layout.unpack_from(event.data)
        value = event.value
        assert (value.pid, value.ppid, value.exit_code, value.duration_ns) == (
            pid, ppid, code, duration
        )
        assert value.comm == comm.split(b"\0")[0].decode()
        assert value.filename == filename.split(b"\0")[0].decode()
        assert value.exit_event is is_exit
        assert value.timestamp_ns == stamp > 0
    exec_event, exit_event = (e.value for e in mine)
    assert exec_event.ppid == os.getpid() and exec_event.filename.endswith("sh")
    assert exit_event.exit_code == 5 and exit_event.duration_ns > 0


# --- decoded values that mean the same, whatever the decoder (kinds.h: struct variety) -----


class Word(ctypes.Union):
    _fields_ = (("u", ctypes.c_uint32), ("s", ctypes.c_int32), ("b", ctypes.c_uint8 * 4))


class PairT(ctypes.Structure):
    _fields_ = (("lo", ctypes.c_uint16), ("hi", ctypes.c_uint16))


class Ids(ctypes.Structure):
    _fields_ = (("pid", ctypes.c_uint32), ("tid", ctypes.c_uint32))


class Either(ctypes.Union):
    _fields_ = (("addr", ctypes.c_uint64), ("halves", ctypes.c_uint32 * 2))


class Variety(ctypes.Structure):
    """A ctypes mirror of struct variety, written the way a user would."""

    _anonymous_ = ("ids", "either")
    _fields_ = (
        ("c", ctypes.c_char), ("neg", ctypes.c_char), ("u8s", ctypes.c_uint8 * 4),
        ("uchars", ctypes.c_ubyte * 4), ("schars", ctypes.c_byte * 4),
        ("names", (ctypes.c_char * 8) * 2), ("word", Word), ("ids", Ids), ("either", Either),
        ("ptr", ctypes.POINTER(ctypes.c_uint32)), ("nothing", ctypes.c_void_p),
        ("from", ctypes.c_uint32), ("in", ctypes.c_uint32), ("async", ctypes.c_uint32),
        ("None", ctypes.c_uint32), ("__pad", ctypes.c_uint32), ("st", ctypes.c_uint32),
        ("pair", PairT), ("len", ctypes.c_uint32), ("seq", ctypes.c_uint64),
        ("data", ctypes.c_uint8 * 0),
    )


EXPECTED = {  # what emit_variety writes (kinds.h), as every decoder must give it
    "c": 65, "neg": -2, "u8s": b"\xde\xad\xbe\xef", "uchars": b"\x01\x02\x03\x04",
    "schars": b"\xff\xfe\x7f\x80", "names": ("ab", "cdefghij"),
    "word": (0xFFFFFFFE, -2, b"\xfe\xff\xff\xff"), "pid": 4242, "tid": 4243,
    "addr": 0x1122334455667788, "halves": (0x55667788, 0x11223344), "ptr": 0xDEADBEEF00,
    "nothing": 0, "from_": 1, "in_": 2, "async_": 3, "None_": 4, "pad_": 5,
    "pair": (1, 2),
}
TAILS = [b"xyz\0", b"0123456789\0\0"]  # 112 + 3 -> 116 and 112 + 10 -> 124 bytes, padded


def emit(obj: aperf.BPFObject, program: str, buffer: aperf.PerfBuffer[Any]) -> int:
    assert lb.test_run_on_cpu(obj.programs[program].fd, CPU) == 0, program
    return buffer.consume()


def test_btf_typedef_and_ctypes_decoders_give_equal_values() -> None:
    with aperf.BPFObject(object_path("kinds")) as obj:
        obj.load()
        decoders: dict[str, Any] = {
            "btf": "variety", "typedef": "variety_t", "ctypes": Variety,
        }
        values: dict[str, list[Any]] = {}
        for name, decoder in decoders.items():
            got: list[aperf.Sample] = []
            with aperf.PerfBuffer(obj.maps["samples"], pages=1, decoder=decoder,
                                  on_sample=got.append) as pb:
                assert emit(obj, "emit_variety", pb) == 2
            values[name] = [s.value for s in got]
            assert [len(s.data) for s in got] == [116, 124]
    for name, (first, second) in values.items():
        for field, expected in EXPECTED.items():
            assert getattr(first, field) == expected, (name, field)
            assert getattr(second, field) == expected, (name, field)
        assert (first.len, first.seq, first.data) == (3, 0, TAILS[0]), name
        assert (second.len, second.seq, second.data) == (10, 1, TAILS[1]), name
        assert first.st == 1 and second.st == 7
    assert values["btf"] == values["typedef"] == values["ctypes"]  # every field, nested too
    btf = values["btf"][0]
    assert type(btf).__name__ == "variety" and type(btf.pair).__name__ == "pair_t"
    assert type(values["typedef"][0]).__name__ == "variety"  # the struct's own name
    assert btf.names == ("ab", "cdefghij") and btf.word.s == -2
    # BTF knows the enum: its field is always a member of enum run_state.
    first_st, second_st = values["btf"][0].st, values["btf"][1].st
    assert type(first_st) is type(second_st) and type(first_st).__name__ == "run_state"
    assert first_st.name == "RUNNING" and second_st.name is None and second_st == 7


def test_kernel_written_records_pickle_and_turn_into_json() -> None:
    with aperf.BPFObject(object_path("kinds")) as obj:
        obj.load()
        got: list[aperf.Sample] = []
        with aperf.PerfBuffer(obj.maps["samples"], pages=1, decoder="variety",
                              on_sample=got.append) as pb:
            emit(obj, "emit_variety", pb)
    for sample in got:
        assert pickle.loads(pickle.dumps(sample)) == sample
        assert pickle.loads(pickle.dumps(sample.value.st)) is sample.value.st or (
            sample.value.st.name is None)
    doc = json.loads(json.dumps(aperf.decoders.jsonable(got[1].value)))
    assert doc["word"] == {"u": 0xFFFFFFFE, "s": -2, "b": "feffffff"}
    assert doc["names"] == ["ab", "cdefghij"] and doc["pair"] == {"lo": 1, "hi": 2}
    assert doc["st"] == 7 and doc["data"] == TAILS[1].hex() and doc["from_"] == 1
    assert aperf.decoders.jsonable(got[0].value)["st"] == "RUNNING"


def test_arrays_from_btf_and_ctypes_hold_the_same_columns() -> None:
    arrays: dict[str, list[aperf.SampleArray]] = {}
    with aperf.BPFObject(object_path("kinds")) as obj:
        obj.load()
        for name, decoder in (("btf", "variety"), ("ctypes", Variety)):
            got: list[Any] = []
            with aperf.PerfBuffer(obj.maps["samples"], pages=1, decoder=decoder,
                                  on_array=got.append) as pb:
                assert emit(obj, "emit_variety", pb) == 2
            arrays[name] = got
    (btf,), (cty,) = arrays["btf"], arrays["ctypes"]
    assert btf.values.dtype == cty.values.dtype
    assert btf.values.tobytes() == cty.values.tobytes()
    assert list(btf.tails) == list(cty.tails) == TAILS
    rows = btf.values
    assert rows["pid"].tolist() == [4242, 4242] and rows["from_"].tolist() == [1, 1]
    assert rows["word"]["s"].tolist() == [-2, -2] and rows["c"].tolist() == [65, 65]
    assert rows["names"].tolist() == [[b"ab", b"cdefghij"]] * 2
    assert rows["st"].tolist() == [1, 7] and rows["len"].tolist() == [3, 10]


@pytest.mark.parametrize("columnar", [False, True])
def test_samples_a_few_bytes_short_decode_with_stale_bytes_in_the_last_field(
    columnar: bool,
) -> None:
    """struct shorty is 24 bytes; output 21-23 bytes, the kernel pads the sample to 28
    with whatever the ring held there (0xab, written by emit_filler), not zeros."""
    with aperf.BPFObject(object_path("kinds")) as obj:
        obj.load()
        got: list[Any] = []
        sizes = obj.maps["short_size"]
        callback = {"on_array": got.append} if columnar else {"on_sample": got.append}
        with aperf.PerfBuffer(obj.maps["samples"], pages=1, decoder="shorty",
                              on_decode_error=got.append, **callback) as pb:
            # A 4088-byte record fills the one-page ring: the next ones land on its bytes.
            assert emit(obj, "emit_filler", pb) == 1
            got.clear()
            for size in (21, 22, 23, 24, 20):
                sizes.update(struct.pack("<I", 0), struct.pack("<I", size))
                assert lb.test_run_on_cpu(obj.programs["emit_short"].fd, CPU) == 0
            assert pb.consume() == 5
    if columnar:
        rows, bad = got
        lasts = rows.values["last"].tolist()
        assert rows.values["seq"].tolist() == [7] * 4 and rows.values["x"].tolist() == [9] * 4
    else:
        *samples, bad = got
        lasts = [s.value.last for s in samples]
        assert all(len(s.data) == 28 and (s.value.seq, s.value.x) == (7, 9) for s in samples)
    assert lasts == [0xABABAB11, 0xABAB2211, 0xAB332211, 0x44332211]
    # 4 bytes short is 20 bytes after padding: too short for the struct, a decode error.
    assert isinstance(bad, aperf.BadSample) and len(bad.data) == 20


async def test_arrays_of_a_live_stream_count_every_sample(producer: Producer) -> None:
    """The producer flat out into small rings: every sample is in an array or counted lost."""
    n = 200_000
    with aperf.BPFObject(BENCH_OBJECT) as bench:
        decoder = aperf.decoders.from_btf(bench, "bench_sample32")
    async with aperf.PerfStream(producer.map, pages=64, decoder=decoder) as stream:
        thread = producer.spawn(n, size=32, cpu=CPU, then_flush=True)
        seqs: list[Any] = []
        lost = 0
        with anyio.fail_after(30):
            async for item in stream.arrays():
                if isinstance(item, aperf.SampleArray):
                    assert item.cpu == CPU
                    seqs.append(item.values["seq"])
                else:
                    assert isinstance(item, aperf.Lost)
                    lost += item.count
                if sum(map(len, seqs)) + lost >= n + 1:
                    break
        await anyio.to_thread.run_sync(thread.join)
    got = np.concatenate(seqs)
    assert (np.diff(got) > 0).all()  # ring order, no duplicate
    assert len(got) + lost == n + 1 == producer.counters().ok + producer.counters().failed
