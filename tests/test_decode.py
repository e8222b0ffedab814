"""Typed samples: BTF, ctypes and struct decoders; decode errors; batches."""

from __future__ import annotations

import ctypes
import enum
import os
import struct
from typing import Any

import anyio
import pytest

import aperf
from aperf import _libbpf as lb
from aperf.testing import Producer, object_path

from .conftest import run_until, take

pytestmark = [pytest.mark.usefixtures("kernel"), pytest.mark.anyio]
CPU = sorted(os.sched_getaffinity(0))[-1]


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

        async with aperf.PerfStream(
            producer.map, pages=1024, decoder=decoder,
            on_batch=on_batch if mode == "on_batch" else None,
        ) as stream:
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
                await run_until(stream, done, lambda thread=thread: thread)
            await anyio.to_thread.run_sync(thread.join)
        runs[mode] = [(cpu, seq % n) for cpu, seq in seen]
    assert runs["items"] == [(CPU, i) for i in range(n)]
    assert runs["batches"] == runs["items"]
    assert runs["on_batch"] == runs["items"]


async def test_tracer_event_decoded_from_btf_matches_the_kernel_bytes(tracefs: None) -> None:
    from .conftest import BPF_DIR

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
