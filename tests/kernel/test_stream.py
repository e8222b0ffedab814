"""Perf streams against the real kernel, with the deterministic producer.

Exactness everywhere: produced == delivered + lost, checked against the BPF
side's own counters. Every async test runs on asyncio, uvloop and trio (anyio's
pytest plugin, the ``anyio_backend`` fixture of conftest.py).
"""

from __future__ import annotations

import os
import random
import subprocess
import threading
import time
from collections import defaultdict
from functools import partial
from typing import Any

import anyio
import pytest

import aperf
from aperf.testing import Producer

from ..helpers import check_busy, hand_over_the_rest, open_fds, run_until, take, until

pytestmark = [pytest.mark.usefixtures("kernel"), pytest.mark.anyio]
BIG = 1024  # pages: 4 MiB per CPU, room for every sample of the no-loss tests
CPUS = sorted(os.sched_getaffinity(0))
OTHER_CPU = CPUS[-1]


def seq_of(data: bytes, size: int = 32) -> int:
    width = min(size, 8)
    return int.from_bytes(data[:width], "little")


class Tally:
    """What a consumer saw: sample sequence numbers per CPU, lost counts per CPU."""

    def __init__(self, size: int = 32) -> None:
        self.size = size
        self.seqs: dict[int, list[int]] = defaultdict(list)
        self.lost: dict[int, int] = defaultdict(int)
        self.order: list[tuple[str, int]] = []

    def add(self, event: Any) -> None:
        if isinstance(event, aperf.Sample):
            self.seqs[event.cpu].append(seq_of(event.data, self.size))
            self.order.append(("sample", event.cpu))
        elif isinstance(event, aperf.Lost):
            self.lost[event.cpu] += event.count
            self.order.append(("lost", event.cpu))
        else:  # pragma: no cover - would be a bug
            raise AssertionError(f"unexpected event {event!r}")

    @property
    def samples(self) -> int:
        return sum(len(v) for v in self.seqs.values())

    @property
    def total(self) -> int:
        return self.samples + sum(self.lost.values())


async def read_until(
    stream: aperf.PerfStream, tally: Tally, total: int, timeout: float = 20
) -> None:
    async def consume() -> None:
        async for event in stream:
            tally.add(event)
            if tally.total >= total:
                return

    with anyio.fail_after(timeout):
        await consume()


async def join(thread: threading.Thread) -> None:
    await anyio.to_thread.run_sync(thread.join)


async def flush_when_drained(producer: Producer, tally: Tally, size: int = 32) -> None:
    """Send the flush sample once the consumer has everything the ring took.

    The kernel writes a lost record only in front of the next sample that fits,
    so the flush must find room: sent into a still-full ring it is lost too.
    """
    while tally.samples < producer.counters().ok:
        await anyio.sleep(0.005)
    producer.emit(1, size=size, cpu=OTHER_CPU)


def assert_exact(producer: Producer, tally: Tally, produced: int) -> None:
    counters = producer.counters()
    assert counters.ok + counters.failed == produced
    assert tally.samples == counters.ok
    assert sum(tally.lost.values()) == counters.failed
    assert tally.total == produced


# --- exactness ---------------------------------------------------------------------


async def test_drained_as_it_fills_in_order_without_gaps(producer: Producer) -> None:
    n = 50_000
    tally = Tally()
    async with aperf.PerfStream(producer.map, pages=BIG) as stream:
        thread = producer.spawn(n, size=32, cpu=OTHER_CPU)
        await read_until(stream, tally, n)
        await join(thread)
        stats = stream.statistics()
    assert tally.seqs[OTHER_CPU] == list(range(n))
    assert not tally.lost
    assert_exact(producer, tally, n)
    assert stats.cpus[CPUS.index(OTHER_CPU)].samples == n
    # (no check of wakeups: a consumer that keeps up may drain every byte by timer
    # and by its own look at filling rings before the watermark is ever reached)
    assert stats.lost == 0 and stats.bytes == n * 48


async def test_overflow_then_read_counts_every_sample(producer: Producer) -> None:
    n = 200_000
    tally = Tally()
    async with aperf.PerfStream(producer.map, pages=4, max_pending=1000) as stream:
        # Nobody reads while the burst runs: aperf stops at max_pending, the ring fills,
        # the kernel counts the rest; the flush sample makes it write the lost record.
        thread = producer.spawn(n, size=32, cpu=OTHER_CPU)
        await join(thread)
        async with anyio.create_task_group() as tg:
            tg.start_soon(read_until, stream, tally, n + 1)
            await flush_when_drained(producer, tally)
        stats = stream.statistics()
    assert sum(tally.lost.values()) > 0
    assert_exact(producer, tally, n + 1)
    assert stats.lost == sum(tally.lost.values())
    seqs = tally.seqs[OTHER_CPU]
    assert seqs == sorted(seqs) and seqs[-1] == n  # the flush sample arrives last
    assert tally.order.index(("lost", OTHER_CPU)) < len(tally.order) - 1


async def test_losses_at_the_end_of_a_burst_are_reported_without_a_trailing_sample(
    producer: Producer,
) -> None:
    n = 100_000
    tally = Tally()
    async with aperf.PerfStream(producer.map, pages=4, max_pending=100) as stream:
        assert stream.statistics().lost_counter == "exact"
        thread = producer.spawn(n, size=32, cpu=OTHER_CPU)  # no flush sample after it
        await join(thread)
        failed = producer.counters().failed
        assert failed > 0 and stream.statistics().lost == failed
        await read_until(stream, tally, n)
    assert_exact(producer, tally, n)
    assert tally.order[-1] == ("lost", OTHER_CPU)  # after every sample that made it


async def test_losses_still_in_the_ring_are_reported_at_close(producer: Producer) -> None:
    tally = Tally()
    stream = aperf.PerfStream(producer.map, pages=1, max_pending=10)
    await stream.open()
    producer.emit(5000, size=32, cpu=OTHER_CPU)  # nobody reads: the ring fills, drops
    await stream.aclose()
    async for event in stream:
        tally.add(event)
    assert_exact(producer, tally, 5000)


@pytest.mark.parametrize("size", [1, 3, 7, 8, 13, 16, 31, 100, 1001, 4095, 4096])
async def test_sizes_wrapping_a_small_ring(producer: Producer, size: int) -> None:
    n = 3000
    tally = Tally(size)
    payload_len = ((size + 4 + 7) & ~7) - 4
    lengths = set()

    async with aperf.PerfStream(producer.map, pages=2) as stream:
        thread = producer.spawn(n, size=size, cpu=OTHER_CPU)

        async def consume() -> None:
            async for event in stream:
                if isinstance(event, aperf.Sample):
                    lengths.add(len(event.data))
                    if size >= 16:  # the producer zeroes bytes 16..size-1; the kernel's
                        # padding after them is not cleared (stale ring bytes)
                        assert event.data[16:size] == bytes(size - 16)
                tally.add(event)
                if tally.total >= n + 1:
                    return
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            with anyio.fail_after(30):
                await join(thread)
                await flush_when_drained(producer, tally, size)
    assert lengths == {payload_len}
    assert_exact(producer, tally, n + 1)
    mask = (1 << (8 * min(size, 8))) - 1
    seqs = tally.seqs[OTHER_CPU]
    assert seqs == sorted(seqs, key=lambda s: s) or size < 2
    assert {s & mask for s in seqs} <= {i & mask for i in range(n + 1)}
    assert tally.samples > 0


async def test_both_cpus_at_once(kernel: None) -> None:
    if len(CPUS) < 2:
        pytest.skip("needs two CPUs")
    n = 30_000
    tally = Tally()
    with Producer() as producer:
        async with aperf.PerfStream(producer.map, pages=BIG) as stream:
            first = producer.spawn(n, size=32, cpu=CPUS[0])
            second = producer.spawn(n, size=32, cpu=CPUS[1])
            await read_until(stream, tally, 2 * n)
            await join(first)
            await join(second)
        assert_exact(producer, tally, 2 * n)
    runs = sorted([tally.seqs[CPUS[0]], tally.seqs[CPUS[1]]])
    assert runs == [list(range(n)), list(range(n, 2 * n))]


async def test_callback_mode_with_sync_and_async_callbacks(producer: Producer) -> None:
    n = 20_000
    tally = Tally()
    done = anyio.Event()

    async def on_lost(event: aperf.Lost) -> None:
        tally.add(event)
        await anyio.sleep(0)

    def on_sample(event: aperf.Sample) -> None:
        tally.add(event)
        if tally.total >= n:
            done.set()

    async with aperf.PerfStream(producer.map, pages=BIG) as stream:
        await run_until(stream, partial(stream.run, on_sample, on_lost=on_lost), done,
                        lambda: producer.spawn(n, size=32, cpu=OTHER_CPU))
    assert tally.seqs[OTHER_CPU] == list(range(n))
    assert_exact(producer, tally, n)


def test_sync_fallback_poll_consume_and_buffer(producer: Producer) -> None:
    n = 20_000
    tally = Tally()
    with aperf.PerfBuffer(producer.map, pages=BIG, on_sample=tally.add, on_lost=tally.add) as pb:
        assert pb.buffer_cnt == len(CPUS) and pb.cpus == CPUS
        assert pb.poll(timeout_ms=0) == 0
        thread = producer.spawn(n, size=32, cpu=OTHER_CPU)
        while tally.total < n:
            handled = pb.poll(timeout_ms=100)
            assert handled >= 0
        thread.join()
        producer.emit(10, cpu=OTHER_CPU)
        assert pb.consume_buffer(OTHER_CPU) == 10
        producer.emit(5, cpu=OTHER_CPU)
        assert pb.consume() == 5
        assert pb.consume() == 0
        with pytest.raises(ValueError):
            pb.consume_buffer(4096)
    assert tally.seqs[OTHER_CPU] == list(range(n + 15))
    assert_exact(producer, tally, n + 15)


POLL_PENDING = 1000
RING_RECORDS = 4096 // 48  # pages=1: 85 records of a 32-byte sample


@pytest.mark.parametrize("call", ["poll", "consume"])
def test_sync_poll_and_consume_return_under_a_producer_that_never_stops(
    producer: Producer, call: str,
) -> None:
    # libbpf's perf_buffer__poll() hands over what the rings held when epoll reported
    # them, and returns: `while running: pb.poll(100)` looks at `running` again. Here the
    # producer writes faster than the callbacks take (each 50 events handed over make it
    # write 100 more: no timing). Before the fix poll() and consume() went on draining
    # the rings while they dispatched, and returned only once the producer stopped.
    # Now a call hands over at most what the queue held when it began to hand out
    # (at most max_pending, plus one ring's drain and its lost notices).
    limit = 20_000  # what the producer writes in all
    bound = POLL_PENDING + RING_RECORDS + 2  # and a drain's lost record and exact count
    tally = Tally()
    state = {"emitted": RING_RECORDS, "this_call": 0, "calls": 0}

    def on_event(event: Any) -> None:
        tally.add(event)
        state["this_call"] += 1
        if state["this_call"] > bound:
            raise AssertionError(f"{call}() handed over {state['this_call']} events in one "
                                 f"call, more than the queue and the ring hold ({bound})")
        if tally.total % 50 == 0 and state["emitted"] < limit:
            producer.emit(100, size=32, cpu=OTHER_CPU)
            state["emitted"] += 100

    with aperf.PerfBuffer(producer.map, pages=1, cpus=[OTHER_CPU], max_pending=POLL_PENDING,
                          on_sample=on_event, on_lost=on_event) as pb:
        producer.emit(RING_RECORDS, size=32, cpu=OTHER_CPU)
        while state["emitted"] < limit:
            state["this_call"] = 0
            handled = pb.poll(100) if call == "poll" else pb.consume()
            assert handled == state["this_call"] <= bound
            state["calls"] += 1
    # Every call returned, each with a share: the producer's 20,000 took many calls.
    assert state["calls"] > 2
    hand_over_the_rest(pb)  # what the close took out of the ring
    assert_exact(producer, tally, state["emitted"])


def test_sync_statistics_after_close_are_the_final_counts(producer: Producer) -> None:
    n = 3000
    tally = Tally()
    pb = aperf.PerfBuffer(producer.map, pages=1, on_sample=tally.add, on_lost=tally.add)
    with pb:
        producer.emit(n, cpu=OTHER_CPU)  # into one page: most are dropped, counted exactly
        pb.consume()
        open_stats = pb.statistics()
    stats = pb.statistics()  # the closed buffer's: what a tool reports at exit
    assert pb.closed and stats.closed and not open_stats.closed
    assert_exact(producer, tally, n)
    assert 0 < stats.samples == tally.samples < n
    assert stats.lost == sum(tally.lost.values()) == n - stats.samples
    assert stats.cpus == open_stats.cpus and stats.pending == 0
    with pytest.raises(aperf.ClosedResourceError):
        pb.consume()


def test_sync_poll_relaxes_when_idle(producer: Producer) -> None:
    got: list[aperf.Sample] = []
    wakeup = aperf.Wakeup.watermark(1 << 20, max_latency=0.002, idle_latency=0.02, idle_after=0.1)
    opened = time.monotonic()
    with aperf.PerfBuffer(producer.map, pages=64, wakeup=wakeup, on_sample=got.append) as pb:
        check_busy(pb.statistics, opened, time.monotonic, wakeup)
        assert pb.poll(timeout_ms=150) == 0  # 150 ms and more: past idle_after
        assert pb.statistics().drain_period == 0.02
        emitted = time.monotonic()
        producer.emit(1, cpu=OTHER_CPU)  # below the watermark: found by looking, not woken
        assert pb.poll(timeout_ms=10_000) == 1
        check_busy(pb.statistics, emitted, time.monotonic, wakeup)
    assert [seq_of(s.data) for s in got] == [0]


def test_sync_callback_exception_propagates_and_nothing_is_lost(producer: Producer) -> None:
    seen: list[int] = []

    def on_sample(event: aperf.Sample) -> None:
        if seq_of(event.data) == 3 and 3 not in seen:
            seen.append(-1)
            raise RuntimeError("boom in callback")
        seen.append(seq_of(event.data))

    with aperf.PerfBuffer(producer.map, pages=8, on_sample=on_sample) as pb:
        producer.emit(10, cpu=OTHER_CPU)
        with pytest.raises(RuntimeError, match="boom in callback"):
            pb.consume()
        assert pb.consume() == 6  # the rest, after the failing sample
    assert seen == [0, 1, 2, -1, 4, 5, 6, 7, 8, 9]


async def test_async_callback_exception_propagates_out_of_run(producer: Producer) -> None:
    got: list[int] = []

    async def on_sample(event: aperf.Sample) -> None:
        await anyio.sleep(0)
        if seq_of(event.data) == 5 and not got.count(-1):
            got.append(-1)
            raise KeyError("async boom")
        got.append(seq_of(event.data))

    async with aperf.PerfStream(producer.map, pages=8) as stream:
        producer.emit(10, cpu=OTHER_CPU)
        stream.flush()
        with pytest.raises(KeyError, match="async boom"), anyio.fail_after(10):
            await stream.run(on_sample)
        async with anyio.create_task_group() as tg:
            tg.start_soon(stream.run, on_sample)
            with anyio.fail_after(10):
                while len(got) < 10:
                    await anyio.sleep(0.01)
            await stream.aclose()
    assert got == [0, 1, 2, 3, 4, -1, 6, 7, 8, 9]


# --- lifecycle ------------------------------------------------------------------------


async def test_close_from_another_task_ends_iteration(producer: Producer) -> None:
    tally = Tally()
    async with aperf.PerfStream(producer.map, pages=8) as stream:
        async def consume() -> None:
            async for event in stream:
                tally.add(event)

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(consume)
                producer.emit(100, cpu=OTHER_CPU)
                while tally.samples < 100:
                    await anyio.sleep(0.005)
                await stream.aclose()  # the consumer ends cleanly, no exception
        await stream.aclose()  # idempotent
        assert stream.closed
    assert tally.samples == 100


async def test_close_from_another_thread(producer: Producer) -> None:
    async with aperf.PerfStream(producer.map, pages=8) as stream:
        counted: list[int] = []

        async def consume() -> None:
            count = 0
            async for _ in stream:
                count += 1
            counted.append(count)

        closer = threading.Thread(target=stream.close)
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(consume)
                producer.emit(50, cpu=OTHER_CPU)
                await anyio.sleep(0.05)
                closer.start()
        await join(closer)
        assert counted == [50]


async def test_close_hands_over_what_the_rings_hold(producer: Producer) -> None:
    stream = aperf.PerfStream(producer.map, pages=8, wakeup=aperf.Wakeup.every(1000, 60))
    await stream.open()
    producer.emit(10, cpu=OTHER_CPU)  # below the wakeup threshold, timer far away
    await stream.aclose()
    events = [event async for event in stream]
    assert [seq_of(e.data) for e in events] == list(range(10))


async def test_close_while_paused_hands_over_everything_then_ends(producer: Producer) -> None:
    stream = aperf.PerfStream(producer.map, pages=64, max_pending=100)
    await stream.open()
    producer.emit(1000, cpu=OTHER_CPU)
    stream.flush()
    assert stream.statistics().paused is False  # flush ignores the bound once
    producer.emit(10, cpu=OTHER_CPU)
    # Its wakeup, or the timer, finds the queue full: paused, data left in the ring.
    await until(lambda: stream.statistics().paused)
    await stream.aclose()  # takes what the ring holds, frees the rings
    seqs = [seq_of(e.data) async for e in stream]
    assert seqs == list(range(1010))


async def test_drain_timer_relaxes_when_idle_and_tightens_on_traffic(producer: Producer) -> None:
    wakeup = aperf.Wakeup.watermark(1 << 20, max_latency=0.002, idle_latency=0.02, idle_after=0.1)
    opened = anyio.current_time()
    async with aperf.PerfStream(producer.map, pages=64, wakeup=wakeup) as stream:
        check_busy(stream.statistics, opened, anyio.current_time, wakeup)
        # Nothing produced: idle once idle_after passed.
        await until(lambda: stream.statistics().drain_period == 0.02)
        emitted = anyio.current_time()
        producer.emit(1, cpu=OTHER_CPU)  # below the watermark: only the timer finds it
        with anyio.fail_after(10):
            (event,) = [e async for e in take(stream, 1)]
        assert seq_of(event.data) == 0
        check_busy(stream.statistics, emitted, anyio.current_time, wakeup)
    async with aperf.PerfStream(producer.map, pages=8, wakeup="lowest-latency") as stream:
        assert stream.statistics().drain_period is None  # per-sample wakeups need no timer


async def test_backpressure_is_not_mistaken_for_idleness(producer: Producer) -> None:
    wakeup = aperf.Wakeup.watermark(1 << 20, max_latency=0.002, idle_latency=0.2, idle_after=0.1)
    async with aperf.PerfStream(
        producer.map, pages=64, wakeup=wakeup, max_pending=10
    ) as stream:
        producer.emit(100, cpu=OTHER_CPU)
        await until(lambda: stream.statistics().paused)  # nobody reads: the bound is reached
        await anyio.sleep(0.15)  # past idle_after: the timer finds nothing it may take
        stats = stream.statistics()
        assert stats.paused and stats.drain_period == 0.002
        assert [seq_of(e.data) async for e in take(stream, 100)] == list(range(100))


async def test_events_drained_while_taking_are_handed_over_at_once(producer: Producer) -> None:
    # No wakeup (watermark not reached) and no timer tick for a minute: only the
    # consumer's own look at filling rings finds these samples, and it must not
    # then go to sleep on an empty batch.
    wakeup = aperf.Wakeup.watermark(1 << 20, max_latency=60)
    async with aperf.PerfStream(producer.map, pages=4, wakeup=wakeup) as stream:
        producer.emit(125, size=32, cpu=OTHER_CPU)  # 5000 bytes: over a quarter of 16 KiB
        with anyio.fail_after(5):
            first = await anext(stream)
        assert seq_of(first.data) == 0
        rest = [seq_of(e.data) async for e in take(stream, 124)]
        assert rest == list(range(1, 125))


async def test_cancel_consumer_mid_stream_and_resume(producer: Producer) -> None:
    n = 20_000
    tally = Tally()
    async with aperf.PerfStream(producer.map, pages=BIG) as stream:
        cancelled: list[bool] = []

        async def consume(limit: int) -> None:
            try:
                async for event in stream:
                    tally.add(event)
                    await anyio.sleep(0)  # a cancellation point inside the loop body
                    if tally.total >= limit:
                        await anyio.sleep(3600)
            except anyio.get_cancelled_exc_class():
                cancelled.append(True)
                raise

        thread = producer.spawn(n, size=32, cpu=OTHER_CPU)
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume, 5_000)
            while tally.total < 5_000:
                await anyio.sleep(0.01)
            tg.cancel_scope.cancel()  # the loop's own cancellation (a trio cancel scope)
        assert cancelled == [True]
        await join(thread)
        await read_until(stream, tally, n)
    assert tally.seqs[OTHER_CPU] == list(range(n))
    assert_exact(producer, tally, n)


async def test_two_consumers_get_a_busy_error(producer: Producer) -> None:
    async with aperf.PerfStream(producer.map, pages=8) as stream:
        async def consume() -> None:
            async for _ in stream:
                pass

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(consume)
                await anyio.wait_all_tasks_blocked()  # it reads: parked, waiting for events
                with pytest.raises(aperf.BusyResourceError, match="already reading") as caught:
                    await consume()
                assert isinstance(caught.value, anyio.BusyResourceError)
                await stream.aclose()


async def test_anyio_task_group(producer: Producer) -> None:
    tally = Tally()
    async with aperf.PerfStream(producer.map, pages=BIG) as stream:
        async def consume() -> None:
            async for event in stream:
                tally.add(event)
                if tally.total >= 1000:
                    return

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await anyio.to_thread.run_sync(lambda: producer.emit(1000, cpu=OTHER_CPU))
    assert tally.seqs[OTHER_CPU] == list(range(1000))


async def test_open_close_100_times_leaves_no_fd(producer: Producer) -> None:
    async with aperf.PerfStream(producer.map, pages=1):
        pass
    before = open_fds()
    for _ in range(100):
        async with aperf.PerfStream(producer.map, pages=1) as stream:
            producer.emit(3, cpu=OTHER_CPU)
            stream.flush()
    assert open_fds() == before


def test_sync_open_close_100_times_leaves_no_fd(producer: Producer) -> None:
    with aperf.PerfBuffer(producer.map, pages=1, on_sample=lambda e: None):
        pass
    before = open_fds()
    for _ in range(100):
        with aperf.PerfBuffer(producer.map, pages=1, on_sample=lambda e: None) as pb:
            producer.emit(3, cpu=OTHER_CPU)
            assert pb.consume() == 3
    assert open_fds() == before


# --- sources and bad input -----------------------------------------------------------------


async def test_int_fd_and_pinned_path_sources(producer: Producer, tmp_path: Any) -> None:
    fd = producer.map.fd
    async with aperf.PerfStream(fd, pages=8) as stream:
        producer.emit(5, cpu=OTHER_CPU)
        stream.flush()
        assert [seq_of(e.data) async for e in take(stream, 5)] == list(range(5))
    if not os.path.ismount("/sys/fs/bpf"):
        subprocess.run(["mount", "-t", "bpf", "bpf", "/sys/fs/bpf"], check=True)
    pin = f"/sys/fs/bpf/aperf_test_{os.getpid()}"
    map_id = aperf._native.libbpf.map_info(fd).id
    subprocess.run(["bpftool", "map", "pin", "id", str(map_id), pin], check=True)
    try:
        async with aperf.PerfStream(pin, pages=8) as stream:
            producer.emit(5, cpu=OTHER_CPU)
            stream.flush()
            assert [seq_of(e.data) async for e in take(stream, 5)] == list(range(5, 10))
    finally:
        os.unlink(pin)


async def test_map_with_fewer_slots_than_cpus(kernel: None) -> None:
    if len(CPUS) < 2:
        pytest.skip("needs two CPUs")
    if not os.path.ismount("/sys/fs/bpf"):
        subprocess.run(["mount", "-t", "bpf", "bpf", "/sys/fs/bpf"], check=True)
    pin = f"/sys/fs/bpf/aperf_small_{os.getpid()}"
    subprocess.run(
        ["bpftool", "map", "create", pin, "type", "perf_event_array",
         "key", "4", "value", "4", "entries", "1", "name", "small"],
        check=True,
    )
    try:
        # As libbpf does: a ring per CPU id below max_entries, the others skipped.
        async with aperf.PerfStream(pin, pages=1) as stream:
            assert stream.cpus == [0]
        with aperf.PerfBuffer(pin, pages=1, on_sample=print) as pb:
            assert pb.buffer_cnt == 1
    finally:
        os.unlink(pin)


async def test_bad_sources_and_sizes(producer: Producer) -> None:
    array = r"counters is a BPF_MAP_TYPE_ARRAY \(type 2\), not a perf event array"
    with pytest.raises(aperf.MapTypeError, match=array):
        await aperf.PerfStream(producer.object.maps["counters"]).open()
    with pytest.raises(aperf.MapTypeError, match=r"is a BPF_MAP_TYPE_ARRAY \(type 2\)"):
        await aperf.PerfStream(producer.object.maps["counters"].fd).open()
    read_end, write_end = os.pipe()
    try:
        with pytest.raises(aperf.MapTypeError, match="not a BPF map"):
            await aperf.PerfStream(read_end).open()
    finally:
        os.close(read_end)
        os.close(write_end)
    for pages in (3, 0, -4, 6):
        with pytest.raises(aperf.RingSizeError, match="power of two"):
            aperf.PerfStream(producer.map, pages=pages)
    with pytest.raises(aperf.ClosedResourceError):
        await aperf.PerfStream(99999).open()
    with pytest.raises(TypeError):
        aperf.PerfStream(producer.map, wakeup=3)  # type: ignore[arg-type]
    # The process and the producer are fine afterwards.
    async with aperf.PerfStream(producer.map, ring_bytes=5000) as stream:
        assert stream.statistics().ring_bytes == 8192
        producer.emit(1, cpu=OTHER_CPU)
        stream.flush()
        assert [seq_of(e.data) async for e in take(stream, 1)] == [0]


async def test_closed_map_and_second_stream(kernel: None) -> None:
    producer = Producer()
    async with aperf.PerfStream(producer.map, pages=1):
        with pytest.raises(aperf.BusyResourceError, match="already feeds"):
            await aperf.PerfStream(producer.map, pages=1).open()
        with pytest.raises(aperf.BusyResourceError):
            aperf.PerfBuffer(producer.map, pages=1, on_sample=print)
    m = producer.map
    producer.close()
    with pytest.raises(aperf.ClosedResourceError, match="closed"):
        await aperf.PerfStream(m).open()


def test_statistics_report_memory(producer: Producer) -> None:
    with aperf.PerfBuffer(producer.map, pages=16, on_sample=lambda e: None) as pb:
        stats = pb.statistics()
        assert stats.ring_bytes == 16 * 4096
        assert stats.memory_bytes == len(CPUS) * 17 * 4096
        assert len(stats.cpus) == len(CPUS)


STUCK_AFTER = 10.0  # seconds a pair of samples may take to arrive before it counts as stuck


async def test_no_wakeup_is_lost_while_the_rings_are_read(producer: Producer) -> None:
    # Per-sample wakeups and no drain timer: only wakeups find samples. The second
    # sample of each pair lands at a random moment of the first one's handling; on
    # trio its wakeup would be eaten by the re-arm of the fd if the drain ran first.
    rounds = 1000
    caught_up = threading.Semaphore(0)
    stuck: list[int] = []

    def produce() -> None:
        os.sched_setaffinity(0, {OTHER_CPU})
        rng = random.Random(12)
        for index in range(rounds):
            producer.emit(1, cpu=OTHER_CPU)
            until = time.perf_counter() + rng.uniform(0, 150e-6)
            while time.perf_counter() < until:
                pass
            producer.emit(1, cpu=OTHER_CPU)
            # Without its wakeup a sample waits for ever (no timer): any bound tells; a
            # generous one, so that a loaded machine's late consumer is not taken for it.
            if not caught_up.acquire(timeout=STUCK_AFTER):
                stuck.append(index)
                return

    got = 0

    async def consume() -> None:
        nonlocal got
        async for _ in stream:
            got += 1
            if got % 2 == 0:
                caught_up.release()
            if got == 2 * rounds:
                return

    # However long the rounds take: the producer returns after the last one, or at the
    # first stuck one, which ends the consumer.
    async with (
        aperf.PerfStream(producer.map, pages=8, wakeup="lowest-latency") as stream,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(consume)
        await anyio.to_thread.run_sync(produce)
        if stuck:
            tg.cancel_scope.cancel()
    assert not stuck and got == 2 * rounds, (
        f"a sample waited {STUCK_AFTER} s for a wakeup in round {stuck}")
