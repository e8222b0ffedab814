"""BPF ring buffers against the real kernel, through the same API as perf event arrays.

The deterministic producer writes into its BPF_MAP_TYPE_RINGBUF with
``bpf_ringbuf_output``; every test proves delivered + dropped == produced from
the BPF side's own counters (the kernel counts no ring buffer drops). Every
async test runs on asyncio, uvloop and trio.
"""

from __future__ import annotations

import os
import struct
import subprocess
import threading
from collections.abc import Iterator
from functools import partial
from typing import Any

import anyio
import pytest

import aperf
from aperf.testing import RB_FORCE_WAKEUP, RB_NO_WAKEUP, Producer

from ..helpers import open_fds, require_kernel, run_until, take, until

pytestmark = [pytest.mark.usefixtures("kernel"), pytest.mark.anyio]
CPU = sorted(os.sched_getaffinity(0))[-1]
BIG = 1 << 23  # 8 MiB: room for every sample of the no-loss tests
SMALL = 1 << 16


@pytest.fixture
def ringbuf() -> Iterator[Producer]:
    require_kernel()
    with Producer(ring="ringbuf", ringbuf_bytes=BIG) as p:
        yield p


@pytest.fixture
def small_ringbuf() -> Iterator[Producer]:
    require_kernel()
    with Producer(ring="ringbuf", ringbuf_bytes=SMALL) as p:
        yield p


def seq(event: aperf.Sample) -> int:
    return int.from_bytes(event.data[:8], "little")


class Seen:
    def __init__(self) -> None:
        self.seqs: list[int] = []
        self.lost = 0

    def add(self, event: Any) -> None:
        if isinstance(event, aperf.Sample):
            assert event.cpu == aperf.NO_CPU
            self.seqs.append(seq(event))
        elif isinstance(event, aperf.Lost):
            assert event.cpu == aperf.NO_CPU
            self.lost += event.count
        else:  # pragma: no cover - would be a bug
            raise AssertionError(f"unexpected event {event!r}")

    @property
    def total(self) -> int:
        return len(self.seqs) + self.lost


async def read_until(stream: aperf.PerfStream, seen: Seen, total: int, timeout: float = 20) -> None:
    with anyio.fail_after(timeout):
        async for event in stream:
            seen.add(event)
            if seen.total >= total:
                return


async def join(thread: threading.Thread) -> None:
    await anyio.to_thread.run_sync(thread.join)


def assert_exact(producer: Producer, seen: Seen, produced: int) -> None:
    counters = producer.counters()
    assert counters.ok + counters.failed + counters.discarded == produced
    assert len(seen.seqs) == counters.ok
    assert seen.lost == counters.failed


async def test_streamed_as_it_fills_in_order_without_gaps(ringbuf: Producer) -> None:
    n = 200_000
    seen = Seen()
    async with aperf.PerfStream(ringbuf.map) as stream:  # the map's type picks the source
        assert stream.cpus == [aperf.NO_CPU]
        thread = ringbuf.spawn(n, size=32, cpu=CPU)
        await read_until(stream, seen, n)
        await join(thread)
        stats = stream.statistics()
    assert seen.seqs == list(range(n))
    assert_exact(ringbuf, seen, n)
    assert stats.samples == n and stats.lost == 0 and stats.lost_counter == "none"
    assert stats.bytes == 40 * n  # 8-byte header + 32 bytes, already 8-aligned
    assert stats.ring_bytes == BIG and stats.memory_bytes == BIG + 2 * 4096


async def test_overflow_is_counted_exactly_by_the_bpf_side(small_ringbuf: Producer) -> None:
    n = 100_000
    seen = Seen()
    async with aperf.PerfStream(small_ringbuf.source(), max_pending=500) as stream:
        # Nobody reads during the burst: the ring fills, bpf_ringbuf_output() fails
        # and the program counts it. With that count the stream reports Lost events.
        await join(small_ringbuf.spawn(n, size=32, cpu=CPU))
        await read_until(stream, seen, n)
        stats = stream.statistics()
    assert seen.lost > 0 and len(seen.seqs) > 0
    assert_exact(small_ringbuf, seen, n)
    assert seen.seqs == sorted(seen.seqs)
    assert stats.lost == seen.lost and stats.lost_counter == "exact"


async def test_without_the_bpf_count_drops_are_not_invented(small_ringbuf: Producer) -> None:
    n = 20_000
    async with aperf.PerfStream(small_ringbuf.map) as stream:
        # On the loop's own thread: nobody reads during the burst, so the small ring
        # overflows whatever the machine's speed. (From a thread, a reader fast enough
        # kept up with it on a quiet machine, and nothing was dropped.)
        small_ringbuf.emit(n, size=32, cpu=CPU)
        stream.flush()
        stats = stream.statistics()
        got = [e async for e in take(stream, stats.samples)]
    counters = small_ringbuf.counters()
    assert counters.failed > 0 and counters.ok + counters.failed == n
    assert len(got) == counters.ok and all(isinstance(e, aperf.Sample) for e in got)
    assert stats.lost == 0 and stats.lost_counter == "none"


@pytest.mark.parametrize("size", [1, 3, 7, 8, 13, 16, 31, 100, 1001, 4095, 4096])
async def test_sizes_are_exact_and_wrap_the_ring(small_ringbuf: Producer, size: int) -> None:
    n = 3000
    seen = Seen()
    lengths = set()
    async with aperf.PerfStream(small_ringbuf.source()) as stream:
        thread = small_ringbuf.spawn(n, size=size, cpu=CPU)
        with anyio.fail_after(30):
            async for event in stream:
                if isinstance(event, aperf.Sample):
                    lengths.add(len(event.data))
                    if size >= 16:
                        assert event.data[16:] == bytes(size - 16)
                seen.add(event)
                if seen.total >= n:
                    break
        await join(thread)
    assert lengths == {size}  # what the program wrote, no padding (perf pads)
    assert_exact(small_ringbuf, seen, n)


async def test_discarded_records_are_skipped_and_counted(ringbuf: Producer) -> None:
    n = 10_000
    seen = Seen()
    async with aperf.PerfStream(ringbuf.map) as stream:
        ringbuf.emit(n, size=32, cpu=CPU, discard_every=7)
        stream.flush()
        await read_until(stream, seen, n - ringbuf.counters().discarded)
        stats = stream.statistics()
    discarded = ringbuf.counters().discarded
    assert discarded == len(range(0, n, 7))
    assert seen.seqs == [s for s in range(n) if s % 7]
    assert stats.cpus[0].other_records == discarded
    assert_exact(ringbuf, seen, n)


async def test_wakeups_are_the_producers_choice(ringbuf: Producer) -> None:
    # No drain timer ("lowest-latency"): only the kernel's wakeups find records.
    async with aperf.PerfStream(ringbuf.map, wakeup="lowest-latency") as stream:
        assert stream.statistics().drain_period is None
        # First a record that wakes the reader, taken, and its wakeup handled: then the
        # stream's look once the loop armed its handle is over (every binding looks
        # before it handles a wakeup of that handle), and no wakeup is still to come.
        # (A sleep here raced with the look on a loaded machine: trio ran it late.)
        ringbuf.emit(1, cpu=CPU)
        with anyio.fail_after(10):
            assert [seq(e) async for e in take(stream, 1)] == [0]
            while stream.statistics().wakeups < 1:
                await anyio.sleep(0.01)
        wakeups = stream.statistics().wakeups
        ringbuf.emit(5, cpu=CPU, rb_flags=RB_NO_WAKEUP)
        await anyio.sleep(0.2)  # a window for a wakeup that must not come
        stats = stream.statistics()
        assert (stats.samples, stats.wakeups) == (1, wakeups)  # committed, nobody woken
        assert stream.flush() == 5
        assert [seq(e) async for e in take(stream, 5)] == list(range(1, 6))
        ringbuf.emit(5, cpu=CPU)  # default: a wakeup when the reader has caught up
        with anyio.fail_after(10):
            assert [seq(e) async for e in take(stream, 5)] == list(range(6, 11))
        ringbuf.emit(5, cpu=CPU, rb_flags=RB_FORCE_WAKEUP)
        with anyio.fail_after(10):
            assert [seq(e) async for e in take(stream, 5)] == list(range(11, 16))
        assert stream.statistics().wakeups >= wakeups + 2
    # With the default drain timer, records committed without a wakeup are found too.
    async with aperf.PerfStream(ringbuf.map) as stream:
        ringbuf.emit(5, cpu=CPU, rb_flags=RB_NO_WAKEUP)
        with anyio.fail_after(10):
            assert [seq(e) async for e in take(stream, 5)] == list(range(16, 21))


async def test_batches_callbacks_and_decoders(ringbuf: Producer) -> None:
    n = 20_000
    decoder = struct.Struct("<QQ")
    async with aperf.PerfStream(ringbuf.map, decoder=decoder) as stream:
        thread = ringbuf.spawn(n, size=32, cpu=CPU)
        values: list[int] = []
        with anyio.fail_after(20):
            async for batch in stream.batches(max_items=500):
                assert len(batch) <= 500
                values.extend(e.value[0] for e in batch)
                if len(values) == n:
                    break
        await join(thread)
    assert values == list(range(n))
    got: list[int] = []
    done = anyio.Event()

    async def on_sample(event: aperf.Sample) -> None:
        got.append(event.value.seq)
        if len(got) == n:
            done.set()

    decoder_named = aperf.decoders.from_struct("<QQ", names="seq ts")
    async with aperf.PerfStream(ringbuf.map, decoder=decoder_named) as stream:
        await run_until(stream, partial(stream.run, on_sample), done,
                        lambda: ringbuf.spawn(n, size=32, cpu=CPU))
    assert got == list(range(n, 2 * n))


async def test_backpressure_and_close_while_paused_hand_over_everything(
    ringbuf: Producer,
) -> None:
    stream = aperf.PerfStream(ringbuf.map, max_pending=100)
    await stream.open()
    ringbuf.emit(1000, cpu=CPU)
    stream.flush()  # past the bound once
    ringbuf.emit(10, cpu=CPU)
    # Its wakeup, or the timer, finds the queue full: paused, records left in the ring.
    await until(lambda: stream.statistics().paused)
    stats = stream.statistics()
    assert stats.paused and stats.samples == 1000
    await stream.aclose()  # takes what the ring holds, then unmaps it
    assert [seq(e) async for e in stream] == list(range(1010))


async def test_cancelled_consumer_resumes_where_it_stopped(ringbuf: Producer) -> None:
    async with aperf.PerfStream(ringbuf.map, wakeup="lowest-latency") as stream:
        with anyio.move_on_after(0.05) as scope:
            await anext(stream)  # nothing yet: parked, then cancelled
        assert scope.cancelled_caught
        ringbuf.emit(600, cpu=CPU)
        seen: list[int] = []
        with anyio.move_on_after(5) as scope:
            async for event in stream:
                seen.append(seq(event))
                if len(seen) == 300:
                    await anyio.sleep(3600)  # cancelled in the middle of a batch
        assert scope.cancelled_caught
        with anyio.fail_after(5):
            seen += [seq(e) async for e in take(stream, 300)]
    assert seen == list(range(600))


def test_sync_poll_consume_and_buffer(ringbuf: Producer) -> None:
    n = 20_000
    seen = Seen()
    with aperf.PerfBuffer(ringbuf.map, on_sample=seen.add, on_lost=seen.add) as pb:
        assert pb.buffer_cnt == 1 and pb.cpus == [aperf.NO_CPU]
        assert pb.poll(timeout_ms=0) == 0
        thread = ringbuf.spawn(n, size=32, cpu=CPU)
        while seen.total < n:
            assert pb.poll(timeout_ms=100) >= 0
        thread.join()
        ringbuf.emit(10, cpu=CPU, rb_flags=RB_NO_WAKEUP)
        assert pb.consume_buffer(aperf.NO_CPU) == 10
        ringbuf.emit(5, cpu=CPU)
        assert pb.consume() == 5 and pb.consume() == 0
        assert pb.statistics().lost_counter == "none"
    assert seen.seqs == list(range(n + 15))
    assert_exact(ringbuf, seen, n + 15)


async def test_fd_and_pinned_path_sources(ringbuf: Producer) -> None:
    async with aperf.PerfStream(ringbuf.map.fd) as stream:
        ringbuf.emit(5, cpu=CPU)
        stream.flush()
        assert [seq(e) async for e in take(stream, 5)] == list(range(5))
    if not os.path.ismount("/sys/fs/bpf"):
        subprocess.run(["mount", "-t", "bpf", "bpf", "/sys/fs/bpf"], check=True)
    pin = f"/sys/fs/bpf/aperf_ringbuf_{os.getpid()}"
    ringbuf.map.pin(pin)
    try:
        async with aperf.PerfStream(pin) as stream:
            ringbuf.emit(5, cpu=CPU)
            stream.flush()
            assert [seq(e) async for e in take(stream, 5)] == list(range(5, 10))
    finally:
        ringbuf.map.unpin(pin)


async def test_bad_input_is_refused_and_the_stream_survives(
    ringbuf: Producer, monkeypatch: pytest.MonkeyPatch
) -> None:
    with monkeypatch.context() as patched:  # as on a machine that is not x86-64
        patched.setenv("APERF_RING_ACCESS", "libbpf")
        with pytest.raises(aperf.AperfError, match="only on x86-64"):
            await aperf.PerfStream(ringbuf.map).open()
    with pytest.raises(aperf.RingSizeError, match="fixed when the map was created"):
        await aperf.PerfStream(ringbuf.map, pages=8).open()
    perf = r"PERF_EVENT_ARRAY \(type 4\), not a ring buffer \(BPF_MAP_TYPE_RINGBUF\)"
    with pytest.raises(aperf.MapTypeError, match=perf):
        await aperf.PerfStream(aperf.RingBufferSource(ringbuf.object.maps["samples"])).open()
    with pytest.raises(TypeError, match="dropped must be callable"):
        aperf.RingBufferSource(ringbuf.map, dropped=3)  # type: ignore[arg-type]
    async with aperf.PerfStream(ringbuf.map, ring_bytes=BIG) as stream:  # the same size: fine
        with pytest.raises(aperf.BusyResourceError, match="already feeds"):
            await aperf.PerfStream(ringbuf.map).open()
        with pytest.raises(aperf.BusyResourceError):
            aperf.PerfBuffer(ringbuf.map, on_sample=print)
        ringbuf.emit(1, cpu=CPU)
        stream.flush()
        assert [seq(e) async for e in take(stream, 1)] == [0]


async def test_open_close_100_times_leaves_no_fd_or_mapping(ringbuf: Producer) -> None:
    async with aperf.PerfStream(ringbuf.map):
        pass
    before = open_fds()
    for _ in range(100):
        async with aperf.PerfStream(ringbuf.map) as stream:
            ringbuf.emit(3, cpu=CPU)
            stream.flush()
    assert open_fds() == before
    with open("/proc/self/maps") as f:
        assert "anon_inode:bpf-map" not in f.read()
