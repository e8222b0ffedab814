"""Checked by mypy (scripts/check.sh), never run: what a user's checker sees."""

from __future__ import annotations

import struct
from typing import Any

from typing_extensions import assert_type

import aperf
import aperf.abc
from aperf.testing import FakeRingSource


def decode(data: bytes) -> int:
    return int.from_bytes(data[:8], "little")


async def events() -> None:
    src = FakeRingSource(cpus=[0])
    typed = aperf.PerfStream(src, decoder=decode)
    assert_type(typed, aperf.PerfStream[int])
    async for event in typed:
        assert_type(event, aperf.Sample[int] | aperf.Lost | aperf.BadSample)
        # (mypy 2.4 narrows a generic NamedTuple to Sample[Any] under isinstance or
        # match: a limitation of the checker, not of these annotations)
        if isinstance(event, aperf.Lost):
            assert_type(event.count, int)
    raw = aperf.PerfStream(src)
    async for batch in raw.batches():
        assert_type(batch, list[aperf.Sample[None] | aperf.Lost | aperf.BadSample])
    by_name = aperf.PerfStream(src, decoder=struct.Struct("<Q"))
    assert_type(by_name, aperf.PerfStream[Any])
    bare: aperf.Sample = aperf.Sample(0, b"")  # a bare Sample is Sample[Any]
    assert_type(bare.value, Any)


async def several_maps() -> None:
    a, b = FakeRingSource(name="a"), FakeRingSource(name="b")
    decoded = aperf.PerfStream({"a": a, "b": b}, decoder={"a": struct.Struct("<Q")})
    assert_type(decoded, aperf.PerfStream[Any])
    sources = [a, b]
    raw = aperf.PerfStream(sources)
    assert_type(raw, aperf.PerfStream[None])
    async for event in decoded:
        assert_type(event.map, str | None)
    assert_type(decoded.statistics().by_map(), dict[str | None, aperf.StreamStatistics])
    assert_type(decoded.statistics().cpus[0].map, str | None)
    aperf.PerfBuffer((a, b), decoder={"b": decode}, on_sample=print)


async def callbacks() -> None:
    src = FakeRingSource(cpus=[0])
    typed = aperf.PerfStream(src, decoder=decode)

    def on_sample(sample: aperf.Sample[int]) -> None: ...

    async def on_lost(lost: aperf.Lost) -> None: ...

    def on_bad(bad: aperf.BadSample) -> None: ...

    def on_batch(batch: list[aperf.Event[int]]) -> None: ...

    def on_array(array: aperf.SampleArray) -> None: ...

    assert_type(await typed.run(on_sample, on_lost=on_lost, on_decode_error=on_bad), None)
    assert_type(await typed.run_batches(on_batch), None)
    assert_type(await typed.run_arrays(on_array, on_lost=on_lost, max_rows=64), None)


async def leases() -> None:
    stream = aperf.PerfStream(FakeRingSource(), decoder=struct.Struct("<Q"))
    async with stream.lease(max_rows=64) as batch:
        assert_type(batch, list[aperf.SampleArray | aperf.Lost | aperf.BadSample])

    def on_array(array: aperf.SampleArray) -> None: ...

    buffer = aperf.PerfBuffer(FakeRingSource(), decoder=struct.Struct("<Q"), on_array=on_array)
    with buffer.lease(timeout_ms=10) as items:
        assert_type(items, list[aperf.SampleArray | aperf.Lost | aperf.BadSample])


def sync() -> None:
    def on_sample(sample: aperf.Sample[int]) -> None: ...

    buffer = aperf.PerfBuffer(FakeRingSource(), decoder=decode, on_sample=on_sample)
    assert_type(buffer, aperf.PerfBuffer[int])
    assert_type(buffer.poll(10), int)


async def stopping() -> None:
    import asyncio
    import signal

    stream = aperf.PerfStream(FakeRingSource())
    async with aperf.closing_on_signals(stream) as stop:
        assert_type(stop, aperf.SignalCloser)
        assert_type(stop.signal, signal.Signals | None)
        stop.add(asyncio.Event().set)  # a function to call instead of a close()
    with aperf.closing_on_signals(stream, signals=[signal.SIGUSR1]):
        pass


async def user_ring_buffer(fd: int) -> None:
    with aperf.UserRingBuffer(fd, encoder=struct.Struct("<QI")) as urb:
        view = urb.reserve(8)
        assert_type(view, memoryview)
        urb.submit(view)
        urb.send_nowait((1, 2))
        await urb.send((1, 2), timeout=0.5)
        assert_type(urb.free_bytes(), int)
        assert_type(urb.encode((1, 2)), bytes)


async def recordings(path: str) -> None:
    stream = aperf.PerfStream(FakeRingSource(), decoder=struct.Struct("<QQ"))
    async with stream:
        stats = await stream.record(path, seconds=1.0, max_file_seconds=5)
        assert_type(stats, aperf.RecorderStatistics)
        assert_type(stats.unwritten, int)
    source = aperf.replay(path, speed=2.0)
    assert_type(source, aperf.ReplaySource)
    async with aperf.PerfStream(source, decoder=source.decoder) as replayed:
        async for item in replayed.arrays():
            if isinstance(item, aperf.SampleArray):
                batch = item.to_arrow()  # a pyarrow.RecordBatch (pyarrow has no types: Any)
                del batch
    with aperf.Recorder(path, struct.Struct("<QQ")) as recorder:
        recorder.write(aperf.Lost(0, 1))
        assert_type(recorder.statistics(), aperf.RecorderStatistics)
    recording = aperf.Recording(path)
    assert_type(recording.boot_offset_ns, int | None)
    builder = aperf.ArrowBuilder(struct.Struct("<QQ"), max_rows=100)
    assert_type(len(builder), int)


def objects(path: str) -> None:
    with aperf.BPFObject(path) as obj:
        obj.load()
        assert_type(obj.programs["produce"].test_run(cpu=0), int)
        assert_type(obj.programs["produce"].test_run(), int)


def abilities(source: aperf.abc.RingSource) -> None:
    # What a source may add narrows under isinstance, as trio.abc's sub-protocols do.
    if isinstance(source, aperf.abc.PausableSource):
        assert_type(source.pause(), None)
    if isinstance(source, aperf.abc.HotplugSource):
        gone, new = source.cpus_changed()
        assert_type(gone, list[int])
        assert_type(new[0].key, int)
        assert_type(list(source.notices), list[int])
    if isinstance(source, aperf.abc.MapSource):
        source.take_over = True
