"""aperf's public API on "Windows": PerfStream (asyncio and uvloop through the
waiter-thread binding, trio through its binding's handle watcher) and PerfBuffer
(WaitForMultipleObjects), on the stand-in ebpfapi.dll, with the platform aperf
sees set to "win32" so that a map fd resolves to the eBPF for Windows source as
it would on Windows.

Exactness: for every CPU, samples written = delivered + lost, and what was
delivered is exactly what the producer wrote, in order.
"""

from __future__ import annotations

import asyncio
import struct
import threading
import types
from collections import defaultdict
from collections.abc import Iterator
from functools import partial
from typing import Any

import anyio
import pytest
import sniffio
import trio

import aperf
from aperf._rings.windows.perf import WindowsPerfSource
from aperf._waiting.asyncio import ThreadedHandleBinding
from aperf._waiting.trio import TrioBinding

from ..helpers import asyncio_only
from .conftest import FakeEbpf

pytestmark = pytest.mark.standin


SEQ = struct.Struct("<Q16x")  # 24-byte samples: 32-byte records on a Windows ring


@pytest.fixture
def on_windows(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # Only where aperf picks the source: the event loops (uvloop, trio) must keep
    # seeing Linux, or they would start their Windows I/O.
    monkeypatch.setattr(aperf._drivers.setup, "sys", types.SimpleNamespace(platform="win32"))
    yield


class Producer:
    """Outputs numbered samples on a CPU; remembers which were written."""

    def __init__(self, fake: FakeEbpf, fd: int, cpu: int) -> None:
        self.fake, self.fd, self.cpu = fake, fd, cpu
        self.written: list[int] = []
        self.dropped = 0
        self.next = 0

    def run(self, count: int) -> None:
        for seq in range(self.next, self.next + count):
            if self.fake.output(self.fd, self.cpu, SEQ.pack(seq)):
                self.written.append(seq)
            else:
                self.dropped += 1
        self.next += count

    def spawn(self, count: int) -> threading.Thread:
        thread = threading.Thread(target=self.run, args=(count,), name=f"producer{self.cpu}")
        thread.start()
        return thread


class Tally:
    def __init__(self) -> None:
        self.seqs: dict[int, list[int]] = defaultdict(list)
        self.lost: dict[int, int] = defaultdict(int)

    def add(self, event: Any) -> None:
        if isinstance(event, aperf.Sample):
            value = event.value or SEQ.unpack(event.data)
            self.seqs[event.cpu].append(value[0])
        elif isinstance(event, aperf.Lost):
            self.lost[event.cpu] += event.count
        else:
            raise AssertionError(f"unexpected {event!r}")

    def total(self) -> int:
        return sum(map(len, self.seqs.values())) + sum(self.lost.values())


async def read_until(stream: aperf.PerfStream[Any], tally: Tally, total: int) -> None:
    async def consume() -> None:
        async for event in stream:
            tally.add(event)
            if tally.total() >= total:
                return

    with anyio.fail_after(20):
        await consume()


def expected_binding() -> type:
    """What waits on the handle off Windows: a waiter thread on asyncio, trio's binding
    (worker threads) on trio."""
    return TrioBinding if sniffio.current_async_library() == "trio" else ThreadedHandleBinding


@pytest.mark.anyio
async def test_stream_delivers_or_counts_every_sample(
    fake: FakeEbpf, perf_map: int, on_windows: None
) -> None:
    n = 20_000  # per CPU, into 4 KiB rings (128 records of 32 bytes)
    tally = Tally()
    async with aperf.PerfStream(perf_map, decoder=SEQ) as stream:
        assert isinstance(stream._options.source._chosen, WindowsPerfSource)  # by map type
        assert isinstance(stream._loop, expected_binding())  # no Proactor off Windows
        producers = [Producer(fake, perf_map, cpu) for cpu in (0, 1)]
        for p in producers:
            p.run(300)  # the loop does not run meanwhile: 128 fit, 172 are dropped
            assert p.dropped == 172
        threads = [p.spawn(n - 300) for p in producers]  # then while the stream reads
        await read_until(stream, tally, 2 * n)
        for thread in threads:
            await anyio.to_thread.run_sync(thread.join)
        stats = stream.statistics()
    for cpu, p in enumerate(producers):
        assert tally.seqs[cpu] == p.written  # exactly what was written, in order
        assert tally.lost[cpu] == p.dropped == fake.lost(perf_map, cpu)
        assert len(p.written) + p.dropped == n
    assert stats.lost_counter == "exact"
    assert stats.samples == sum(len(p.written) for p in producers)
    assert stats.lost == sum(p.dropped for p in producers)
    assert stats.wakeups > 0


@pytest.mark.anyio
async def test_callback_mode_and_batches(fake: FakeEbpf, perf_map: int, on_windows: None) -> None:
    got: list[tuple[int, int]] = []
    lost: list[aperf.Lost] = []
    stream = aperf.PerfStream(
        perf_map, decoder=SEQ, wakeup="throughput",  # a threshold: ignored, every record wakes
    )
    async with stream, anyio.create_task_group() as tg:
        # returns once the stream is closed
        tg.start_soon(partial(stream.run, lambda s: got.append((s.cpu, s.value[0])),
                              on_lost=lost.append))
        for seq in range(100):
            assert fake.output(perf_map, seq % 2, SEQ.pack(seq))
        with anyio.fail_after(5):
            while len(got) < 100:
                await anyio.sleep(0.001)
        await stream.aclose()
    assert sorted(got) == sorted((seq % 2, seq) for seq in range(100))
    assert [s for c, s in got if c == 0] == list(range(0, 100, 2))
    assert not lost

    async with aperf.PerfStream(perf_map) as stream:
        for seq in range(10):
            fake.output(perf_map, 1, SEQ.pack(seq))
        batches: list[list[Any]] = []
        async for batch in stream.batches(4):
            batches.append(batch)
            if sum(map(len, batches)) == 10:
                break
    assert all(len(b) <= 4 for b in batches)
    assert [SEQ.unpack(e.data)[0] for b in batches for e in b] == list(range(10))


@pytest.mark.anyio
async def test_close_from_another_thread_while_waiting(
    fake: FakeEbpf, perf_map: int, on_windows: None
) -> None:
    counted: list[int] = []
    async with aperf.PerfStream(perf_map) as stream:
        async def consume() -> None:
            count = 0
            async for _ in stream:
                count += 1
            counted.append(count)

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(consume)
                for seq in range(30):
                    fake.output(perf_map, 0, SEQ.pack(seq))
                handle = stream._options.source.wait_handle  # type: ignore[attr-defined]
                # Wait until the waiter thread is parked on the handle again.
                await anyio.to_thread.run_sync(
                    fake.wait_until, lambda: fake.waiters(handle) == 1
                )
                closer = threading.Thread(target=stream.close)
                closer.start()
        assert counted == [30]
        await anyio.to_thread.run_sync(closer.join)
    # The fixture checks that the handle was not closed under the waiter thread.


@pytest.mark.anyio
async def test_open_close_many_times_leaves_nothing(
    fake: FakeEbpf, perf_map: int, on_windows: None
) -> None:
    for i in range(50):
        async with aperf.PerfStream(perf_map) as stream:
            fake.output(perf_map, i % 2, SEQ.pack(i))
            with anyio.fail_after(5):
                event = await anext(stream)
            assert SEQ.unpack(event.data)[0] == i
    # The fixture checks handles, fds and perf buffers.


@pytest.mark.anyio
async def test_options_that_mean_nothing_on_windows(
    fake: FakeEbpf, perf_map: int, on_windows: None
) -> None:
    for size in ({"pages": 4}, {"ring_bytes": 8192}):
        stream = aperf.PerfStream(perf_map, **size)  # type: ignore[call-overload]
        with pytest.raises(aperf.RingSizeError, match="max_entries"):
            await stream.open()
    # A wakeup watermark is accepted and ignored: every record signals the handle.
    async with aperf.PerfStream(perf_map, wakeup=aperf.Wakeup.watermark(2048)) as stream:
        fake.output(perf_map, 0, SEQ.pack(7))
        with anyio.fail_after(5):
            event = await anext(stream)
        assert SEQ.unpack(event.data)[0] == 7


@pytest.mark.anyio
@asyncio_only
async def test_a_failed_wait_reaches_the_consumer(fake: FakeEbpf) -> None:
    binding = ThreadedHandleBinding(asyncio.get_running_loop(), "win32")
    bogus = 4000  # no such handle: WaitForMultipleObjects fails
    binding.watch([bogus], lambda handle: None)
    with pytest.raises(aperf.AperfError) as failed:
        await asyncio.wait_for(binding.wait(), 5)
    assert failed.value.function == "WaitForMultipleObjects"  # type: ignore[attr-defined]
    assert failed.value.winerror == 6  # type: ignore[attr-defined]
    binding.stop()


def test_a_failed_wait_reaches_the_trio_consumer(fake: FakeEbpf) -> None:
    async def main() -> None:
        binding = TrioBinding("win32")
        binding.watch([4000], lambda handle: None)  # no such handle: the wait fails
        with pytest.raises(aperf.AperfError) as failed, trio.fail_after(5):
            await binding.wait()
        assert failed.value.function == "WaitForMultipleObjects"  # type: ignore[attr-defined]
        binding.stop()

    trio.run(main)


# --- PerfBuffer ------------------------------------------------------------------------


def test_perf_buffer_poll_consume_and_buffers(
    fake: FakeEbpf, perf_map: int, on_windows: None
) -> None:
    tally = Tally()
    with aperf.PerfBuffer(perf_map, on_sample=tally.add, on_lost=tally.add, decoder=SEQ) as pb:
        assert pb.buffer_cnt == 2 and pb.cpus == [0, 1]
        handle = pb.buffer_fd(0)
        assert handle == pb.buffer_fd(1)  # one wait handle for every ring
        assert pb.poll(10) == 0
        for seq in range(5):
            fake.output(perf_map, 1, SEQ.pack(seq))
        assert pb.poll(1000) == 5
        assert not fake.signalled(handle)  # reset before the rings were read
        fake.output(perf_map, 1, SEQ.pack(101))
        assert pb.consume_buffer(0) == 0
        assert pb.consume_buffer(1) == 1
        fake.output(perf_map, 0, SEQ.pack(100))
        assert pb.consume() == 1
        for seq in range(200):  # 128 fit
            fake.output(perf_map, 0, SEQ.pack(1000 + seq))
        assert pb.poll(1000) == 129  # a Lost notice, then 128 samples
        stats = pb.statistics()
    assert tally.seqs[1] == [0, 1, 2, 3, 4, 101]
    assert tally.seqs[0] == [100, *range(1000, 1128)]
    assert tally.lost == {0: 72}
    assert stats.lost == 72 and stats.lost_counter == "exact"


def test_perf_buffer_close_from_another_thread_ends_a_poll(
    fake: FakeEbpf, perf_map: int, on_windows: None
) -> None:
    pb = aperf.PerfBuffer(perf_map, on_sample=lambda s: None)
    handle = pb.buffer_fd(0)
    outcome: list[BaseException | int] = []

    def poll() -> None:
        try:
            outcome.append(pb.poll(-1))
        except BaseException as exc:
            outcome.append(exc)

    poller = threading.Thread(target=poll)
    poller.start()
    fake.wait_until(lambda: fake.waiters(handle) == 1)
    pb.close()
    poller.join(5)
    assert not poller.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], aperf.ClosedResourceError)
    assert pb.closed


def test_perf_buffer_callback_exception_propagates(
    fake: FakeEbpf, perf_map: int, on_windows: None
) -> None:
    seen: list[int] = []

    def on_sample(sample: aperf.Sample[Any]) -> None:
        if sample.value[0] == 3:
            raise KeyError("three")
        seen.append(sample.value[0])

    with aperf.PerfBuffer(perf_map, on_sample=on_sample, decoder=SEQ) as pb:
        for seq in range(6):
            fake.output(perf_map, 0, SEQ.pack(seq))
        with pytest.raises(KeyError, match="three"):
            pb.poll(1000)
        assert pb.poll(0) == 2  # the events after the failing one were kept
    assert seen == [0, 1, 2, 4, 5]


@pytest.mark.anyio
@asyncio_only
async def test_a_dropped_stream_is_released(
    fake: FakeEbpf, perf_map: int, on_windows: None
) -> None:
    import gc

    stream = aperf.PerfStream(perf_map)
    await stream.open()
    handle = stream._options.source.wait_handle  # type: ignore[attr-defined]
    await asyncio.to_thread(fake.wait_until, lambda: fake.waiters(handle) == 1)
    with pytest.warns(ResourceWarning, match="unclosed PerfStream"):
        del stream
        gc.collect()
    await asyncio.sleep(0.01)  # the release was handed to the loop thread
    # The fixture checks: waiter thread gone before the handle closed, nothing leaked.
