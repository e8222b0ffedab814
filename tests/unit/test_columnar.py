"""Columnar batches on FakeRingSource, without root: arrays hold exactly what per-item
iteration yields, in the same order, with lost notices and bad samples in place, under
every guarantee of batches() (backpressure, put-back, close, cancellation). The async
tests run on asyncio, uvloop and trio (the anyio_backend fixture of conftest.py)."""

from __future__ import annotations

import ctypes
import struct
import subprocess
import sys
from typing import Any

import anyio
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import aperf
from aperf._rings.perf.format import split_span, uniform_run_end
from aperf._rings.perf.runs import RunFinder
from aperf._rings.seam import payloads_of
from aperf.testing import FakeRingSource, encode_lost, encode_sample

from ..helpers import take, until

QQ = struct.Struct("<QQ")
DECODER = aperf.decoders.from_struct("<QQ", names="seq cpu")


def numpy_run_end(span: bytes, pos: int, size: int, end: int) -> int:
    """One check of the columnar run finder."""
    return RunFinder(uniform_run_end)(span, pos, size, end)


def write(src: FakeRingSource, cpu: int, first: int, count: int, extra: int = 0) -> int:
    """Samples seq first..first+count-1 (``extra`` bytes longer); how many fitted."""
    return sum(src.write(cpu, QQ.pack(i, cpu) + b"t" * extra) for i in range(first, first + count))


def flatten(items: list[Any]) -> list[Any]:
    """Arrays as (cpu, seq) per row; lost notices and bad samples as they are."""
    out: list[Any] = []
    for item in items:
        if isinstance(item, aperf.SampleArray):
            out.extend((item.cpu, int(s)) for s in item.values["seq"])
        elif isinstance(item, aperf.Sample):
            out.append((item.cpu, item.value.seq))
        elif isinstance(item, aperf.BadSample):
            out.append(("bad", item.cpu, len(item.data)))
        else:
            out.append(item)
    return out


async def take_arrays(stream: aperf.PerfStream[Any], rows: int, **kw: Any) -> list[Any]:
    """Items of stream.arrays() until ``rows`` rows, lost notices and bad samples came."""
    out: list[Any] = []

    async def consume() -> None:
        async for item in stream.arrays(**kw):
            out.append(item)
            if len(flatten(out)) >= rows:
                return

    with anyio.fail_after(5):
        await consume()
    return out


def fill(src: FakeRingSource) -> list[Any]:
    """A uniform run on CPU 0; a short sample and longer ones on CPU 1. What per-item
    iteration yields, as (cpu, seq) and ("bad", cpu, length)."""
    expected: list[Any] = []
    write(src, 0, 0, 60)
    expected += [(0, i) for i in range(60)]
    assert src.write(1, b"short")  # 12 bytes padded: shorter than the decoder's 16
    expected.append(("bad", 1, 12))
    write(src, 1, 100, 5, extra=4)  # 20-byte samples: another run
    expected += [(1, i) for i in range(100, 105)]
    return expected


@pytest.mark.anyio
async def test_arrays_hold_what_per_item_iteration_yields() -> None:
    per_item: list[Any] = []
    arrays: list[Any] = []
    for mode in ("items", "arrays"):
        src = FakeRingSource(cpus=[0, 1], ring_bytes=4096)
        async with aperf.PerfStream(src, decoder=DECODER) as stream:
            expected = fill(src)
            stream.flush()
            if mode == "items":
                async for event in stream:
                    per_item.append(event)
                    if len(per_item) == len(expected):
                        break
            else:
                arrays = await take_arrays(stream, len(expected))
        assert flatten(per_item if mode == "items" else arrays) == expected
    assert all(isinstance(a, aperf.SampleArray | aperf.BadSample) for a in arrays)
    runs = [a for a in arrays if isinstance(a, aperf.SampleArray)]
    assert [(a.cpu, len(a)) for a in runs] == [(0, 60), (1, 5)]
    for a in runs:
        assert a.values.dtype.names == ("seq", "cpu") and not a.values.flags.writeable
        assert a.tails is None
        assert (a.values["cpu"] == a.cpu).all()
    # A uniform run is a strided view: itemsize = the record's size, header skipped.
    assert runs[0].values.dtype.itemsize == 32 and runs[0].values.dtype.fields["seq"][1] == 12


@pytest.mark.anyio
async def test_lost_notices_keep_their_place() -> None:
    src = FakeRingSource(cpus=[0], ring_bytes=4096, exact_lost=False)
    async with aperf.PerfStream(src, decoder=DECODER) as stream:
        assert write(src, 0, 0, 200) == 128
        items = await take_arrays(stream, 128)
        write(src, 0, 500, 3)  # the lost record of the 72 drops goes in front
        items += await take_arrays(stream, 4)
    assert flatten(items) == [(0, i) for i in range(128)] + [aperf.Lost(0, 72)] + [
        (0, 500), (0, 501), (0, 502)
    ]


@pytest.mark.anyio
async def test_max_rows_cuts_arrays_and_keeps_order() -> None:
    src = FakeRingSource(cpus=[0], ring_bytes=1 << 16)
    async with aperf.PerfStream(src, decoder=DECODER) as stream:
        write(src, 0, 0, 1000)
        items = await take_arrays(stream, 1000, max_rows=300)
    assert [len(a) for a in items] == [300, 300, 300, 100]
    assert flatten(items) == [(0, i) for i in range(1000)]


@pytest.mark.anyio
async def test_decode_error_policies_for_arrays() -> None:
    for policy in ("skip", "raise"):
        src = FakeRingSource(cpus=[0], ring_bytes=4096)
        async with aperf.PerfStream(src, decoder=DECODER, decode_errors=policy) as stream:
            write(src, 0, 0, 3)
            src.write(0, b"short")
            write(src, 0, 3, 3)
            stream.flush()
            got: list[Any] = []
            if policy == "raise":
                iterator = aiter(stream.arrays())
                got.append(await anext(iterator))
                with pytest.raises(aperf.DecodeError, match="needs 16 bytes"):
                    await anext(iterator)
                got.append(await anext(stream.arrays()))  # the stream goes on after it
            else:
                got = await take_arrays(stream, 6)
            assert flatten(got) == [(0, i) for i in range(6)], policy
            assert stream.statistics().decode_errors == 1


@pytest.mark.anyio
async def test_a_consumer_that_stops_loses_nothing_whatever_it_switches_to() -> None:
    src = FakeRingSource(cpus=[0], ring_bytes=1 << 16)
    async with aperf.PerfStream(src, decoder=DECODER) as stream:
        write(src, 0, 0, 600)
        got: list[Any] = []
        async for item in stream.arrays(max_rows=100):
            got.append(item)
            break  # 500 rows in 5 arrays stay queued in the reader
        async for event in stream:  # per item: the arrays' rows, in order
            got.append(event)
            if len(flatten(got)) == 350:
                break  # this batch's rest stays queued too
        got += await take_arrays(stream, 600 - 350)  # and arrays again
    assert flatten(got) == [(0, i) for i in range(600)]


@pytest.mark.anyio
async def test_backpressure_counts_rows_and_loses_nothing_that_fitted() -> None:
    src = FakeRingSource(cpus=[0, 1], ring_bytes=4096)
    async with aperf.PerfStream(src, decoder=DECODER, max_pending=100) as stream:
        written = [write(src, cpu, 0, 128) for cpu in (0, 1)]
        # The readiness callbacks: one ring fills the queue, the other is refused.
        await until(lambda: stream.statistics().paused)
        stats = stream.statistics()
        assert stats.paused and stats.pending == 128
        assert sorted(src.pending_bytes(cpu) for cpu in (0, 1)) == [0, 128 * 32]
        seen = await take_arrays(stream, 1)  # one array: the first ring's 128 rows
        assert stream.statistics().pending == 0
        seen += await take_arrays(stream, 128)  # resumed: the other ring, drained now
        stats = stream.statistics()
    rows = flatten(seen)
    for cpu in (0, 1):
        assert [s for c, s in rows if c == cpu] == list(range(written[cpu]))
    assert stats.samples == sum(written)


@pytest.mark.anyio
async def test_callback_mode_puts_back_what_follows_a_failure() -> None:
    src = FakeRingSource(cpus=[0], ring_bytes=1 << 16)
    seen: list[Any] = []
    calls = 0

    def on_array(array: aperf.SampleArray) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("consumer bug")
        seen.append(array)

    async with aperf.PerfStream(src, decoder=DECODER) as stream:
        for first in (0, 10, 20):  # three drains: three arrays
            write(src, 0, first, 10)
            stream.flush()
        with pytest.raises(RuntimeError, match="consumer bug"), anyio.fail_after(5):
            await stream.run_arrays(on_array)
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(stream.run_arrays, on_array)  # returns once the stream is closed
                while len(flatten(seen)) < 20:
                    await anyio.sleep(0.01)
                await stream.aclose()
    # The failing array is the callback's; the one after it was put back and handed over.
    assert flatten(seen) == [(0, i) for i in range(10)] + [(0, i) for i in range(20, 30)]


@pytest.mark.anyio
async def test_coroutine_callbacks_are_awaited() -> None:
    src = FakeRingSource(cpus=[0], ring_bytes=4096)
    seen: list[int] = []

    async def on_array(array: aperf.SampleArray) -> None:
        await anyio.sleep(0)
        seen.extend(int(s) for s in array.values["seq"])

    async with aperf.PerfStream(src, decoder=DECODER) as stream:
        write(src, 0, 0, 50)
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(stream.run_arrays, on_array)
                while len(seen) < 50:
                    await anyio.sleep(0.01)
                await stream.aclose()
    assert seen == list(range(50))


@pytest.mark.anyio
async def test_the_deprecated_on_array_keyword_still_works_and_warns() -> None:
    src = FakeRingSource(cpus=[0], ring_bytes=4096)
    seen: list[int] = []

    def on_array(array: aperf.SampleArray) -> None:
        seen.extend(int(s) for s in array.values["seq"])

    with pytest.warns(DeprecationWarning, match=r"run_arrays\(on_array"):
        stream = aperf.PerfStream(src, decoder=DECODER, on_array=on_array)
    async with stream:
        write(src, 0, 0, 50)
        with anyio.fail_after(5), pytest.warns(DeprecationWarning, match="constructor's"):
            async with anyio.create_task_group() as tg:
                tg.start_soon(stream.run)
                while len(seen) < 50:
                    await anyio.sleep(0.01)
                await stream.aclose()
    assert seen == list(range(50))


@pytest.mark.anyio
async def test_close_hands_over_what_the_rings_hold_then_ends() -> None:
    src = FakeRingSource(cpus=[0, 1], ring_bytes=4096)
    stream = aperf.PerfStream(src, decoder=DECODER, wakeup=aperf.Wakeup.every(1000))
    await stream.open()
    write(src, 0, 0, 7)  # below the wakeup threshold: nobody was woken
    write(src, 1, 0, 3)
    await stream.aclose()
    items = [item async for item in stream.arrays()]
    assert sorted(flatten(items)) == sorted([(0, i) for i in range(7)] + [(1, i) for i in range(3)])


@pytest.mark.anyio
async def test_cancelling_a_waiting_consumer_loses_nothing() -> None:
    src = FakeRingSource(cpus=[0], ring_bytes=4096)
    async with aperf.PerfStream(src, decoder=DECODER) as stream:
        got: list[Any] = []
        with anyio.move_on_after(0.05) as scope:  # cancels the waiting consumer
            got += await take_arrays(stream, 1)
        assert scope.cancelled_caught and got == []
        write(src, 0, 0, 5)
        assert flatten(await take_arrays(stream, 5)) == [(0, i) for i in range(5)]


def test_the_sync_buffer_hands_arrays_to_on_array() -> None:
    got: list[Any] = []
    src = FakeRingSource(cpus=[0, 1])
    with aperf.PerfBuffer(src, decoder=DECODER, on_array=got.append, on_lost=got.append) as pb:
        write(src, 1, 0, 10)
        assert pb.poll(1000) == 10  # samples handled, as in per-item mode
        write(src, 0, 10, 5)
        assert pb.consume() == 5
    assert flatten(got) == [(1, i) for i in range(10)] + [(0, i) for i in range(10, 15)]
    assert all(isinstance(a, aperf.SampleArray) for a in got)


class Event(ctypes.Structure):
    _fields_ = (("seq", ctypes.c_uint64), ("comm", ctypes.c_char * 4),
                ("size", ctypes.c_uint32), ("data", ctypes.c_uint8 * 0))


@pytest.mark.anyio
async def test_a_flexible_array_member_is_each_samples_tail() -> None:
    src = FakeRingSource(cpus=[0], ring_bytes=1 << 14)
    payloads = [struct.pack("<Q4sI", i, b"ab", n) + bytes(range(n)) for i, n in
                enumerate([3, 3, 3, 9, 0, 20])]
    async with aperf.PerfStream(src, decoder=Event) as stream:
        items = []
        for part in (payloads[:3], payloads[3:]):  # a uniform run, then mixed sizes
            for payload in part:
                src.write(0, payload)
            stream.flush()
            items += await take_arrays(stream, 0)
        for payload in payloads:
            src.write(0, payload)
        stream.flush()
        events = [e async for e in take(stream, len(payloads))]
    tails = [t for a in items for t in a.tails]
    values = np.concatenate([a.values for a in items])
    for payload, event, tail, row in zip(payloads, events, tails, values, strict=True):
        n = event.value.size
        # The tail is the rest of the sample, kernel padding included.
        assert event.value.data == event.data[16:] == tail
        assert tail[:n] == bytes(range(n)) and len(event.data) == (len(payload) + 11) // 8 * 8 - 4
        assert (row["seq"], row["comm"], row["size"]) == (event.value.seq, b"ab", n)
        assert event.value.comm == "ab"
    assert [len(a) for a in items] == [3, 3]  # a uniform run, then mixed sizes
    assert items[0].tails.lengths.tolist() == [4, 4, 4]


def test_arrays_need_a_decoder_with_a_layout() -> None:
    src = FakeRingSource(cpus=[0])
    with pytest.raises(TypeError, match="decoder with a layout"):
        aperf.PerfStream(src, decoder=lambda data: data, on_array=print)
    with pytest.raises(TypeError, match="decoder with a layout"):
        aperf.PerfBuffer(src, on_array=print)
    with pytest.raises(ValueError, match="not both"):
        aperf.PerfStream(src, decoder=QQ, on_array=print, on_sample=print)


@pytest.mark.anyio
async def test_arrays_refuse_bad_arguments_at_the_call() -> None:
    async with aperf.PerfStream(FakeRingSource(cpus=[0]), decoder=None) as stream:
        with pytest.raises(TypeError, match="decoder with a layout"):
            stream.arrays()
        with pytest.raises(TypeError, match="decoder with a layout"):
            await stream.run_arrays(print)
    async with aperf.PerfStream(FakeRingSource(cpus=[0]), decoder=QQ) as stream:
        with pytest.raises(ValueError, match="max_rows"):
            stream.arrays(max_rows=0)
        with pytest.raises(ValueError, match="max_rows"):
            await stream.run_arrays(print, max_rows=0)


def test_without_numpy_the_error_says_what_to_install() -> None:
    code = (
        "import sys; sys.modules['numpy'] = None\n"  # makes `import numpy` fail
        "import aperf, struct, asyncio\n"
        "from aperf.testing import FakeRingSource\n"
        "try:\n"
        "    aperf.PerfStream(FakeRingSource(), decoder=struct.Struct('<Q'), on_array=print)\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
        "async def main():\n"
        "    async with aperf.PerfStream(FakeRingSource(), decoder=struct.Struct('<Q')) as s:\n"
        "        try:\n"
        "            s.arrays()\n"
        "        except ImportError as exc:\n"
        "            print(exc)\n"
        "        try:\n"
        "            await s.run_arrays(print)\n"
        "        except ImportError as exc:\n"
        "            print(exc)\n"
        "        s.flush()\n"  # the stream still works per item
        "asyncio.run(main())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    lines = out.stdout.splitlines()
    assert len(lines) == 3
    assert all("pip install 'aperf-bpf[numpy]'" in line for line in lines)


def test_importing_aperf_does_not_import_numpy() -> None:
    code = "import sys, aperf, aperf.decoders, aperf.testing; print('numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --- the run finder that serves columnar consumers ---------------------------------------

records = st.one_of(
    st.sampled_from([4, 12, 12, 12, 28]).flatmap(
        lambda n: st.binary(min_size=n, max_size=n)).map(encode_sample),
    st.integers(1, 1000).map(encode_lost),
    st.binary(min_size=8, max_size=24).map(lambda b: struct.pack("<IHH", 3, 0, 8 + len(b)) + b),
)


@given(st.lists(records, min_size=1, max_size=300))
def test_numpy_runs_split_spans_as_the_pure_parser_does(parts: list[bytes]) -> None:
    span = b"".join(parts)
    flat = []
    for run_end in (None, numpy_run_end):
        segments, other = split_span(0, span) if run_end is None else split_span(
            0, span, run_end)
        flat.append(([s if isinstance(s, int) else payloads_of(s) for s in segments], other))
    assert _joined(flat[0][0]) == _joined(flat[1][0]) and flat[0][1] == flat[1][1]


def _joined(segments: list[Any]) -> list[Any]:
    out: list[Any] = []
    for s in segments:
        out.extend([s] if isinstance(s, int) else s)
    return out


def test_numpy_runs_end_exactly_at_a_different_record() -> None:
    same = b"".join(encode_sample(QQ.pack(i, 0)) for i in range(100))
    odd = encode_sample(b"x" * 40)
    span = same + odd + same
    assert numpy_run_end(span, 0, 32, len(span)) == 3200
    segments, _ = split_span(0, span, numpy_run_end)
    assert [type(s).__name__ for s in segments] == ["Run", "tuple", "Run"]  # (payloads, False)


@pytest.mark.anyio
async def test_items_waiting_in_front_count_as_their_samples() -> None:
    src = FakeRingSource(cpus=[0], ring_bytes=1 << 14)
    async with aperf.PerfStream(src, decoder=DECODER) as stream:
        write(src, 0, 0, 300)
        async for item in stream.arrays(max_rows=100):
            assert repr(item) == f"<SampleArray cpu=0 100 samples dtype={item.values.dtype}>"
            break
        assert stream.statistics().pending == 200  # two arrays of 100 wait in front
        assert flatten(await take_arrays(stream, 200)) == [(0, i) for i in range(100, 300)]
        assert stream.statistics().pending == 0
