"""Coalesced ring buffer wakeups against the kernel (issue 23).

The kernel wakes a BPF ring buffer's reader only for a record committed at its
consumer position. With batched wakeups (the default) aperf reads a wakeup at the
next tick of its drain timer, so the records that come meanwhile wake nobody: a
producer that spaces its records (bpf/paced.bpf.c, default wakeup rule, flags 0)
wakes the reader about once per drain period instead of once per record.
``wakeup="lowest-latency"`` still reads every wakeup at once. Exact counts on
asyncio, uvloop, trio and PerfBuffer; no timed assertion: the wakeup bound is a
count that reading at once could not meet.
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Iterator

import anyio
import pytest

import aperf
from aperf._native import libbpf as lb
from aperf.testing import Producer

from ..helpers import BPF_DIR, require_kernel

pytestmark = pytest.mark.usefixtures("kernel")
CPUS = sorted(os.sched_getaffinity(0))
PRODUCER_CPU = CPUS[0]
RUN = 200  # records per program run


class Spaced:
    """bpf/paced.bpf.c: 16-byte records (u64 seq, u64 ktime) spaced ``gap_ns`` apart."""

    def __init__(self, obj: aperf.BPFObject) -> None:
        self.obj = obj
        self.map = obj.maps["ringbuf"]

    def emit(self, count: int, gap_ns: int) -> None:
        prog, pace = self.obj.programs["paced"].fd, self.obj.maps["pace"]
        # On the producer's CPU: run from another CPU, the program would run in an IPI
        # with interrupts off, and its wakeups (irq_work) would wait for the run's end.
        os.sched_setaffinity(0, {PRODUCER_CPU})
        sent = 0
        while sent < count:
            n = min(RUN, count - sent)
            pace.update(struct.pack("<I", 0), struct.pack("<QQQ", n, gap_ns, sent))
            assert lb.test_run_on_cpu(prog, PRODUCER_CPU) == 0
            sent += n

    def spawn(self, count: int, gap_ns: int) -> threading.Thread:
        thread = threading.Thread(target=self.emit, args=(count, gap_ns))
        thread.start()
        return thread

    def counters(self) -> tuple[int, int]:
        """(records written, records that found no room)."""
        counters = self.obj.maps["counters"]
        written, failed = (struct.unpack("<Q", counters.lookup(struct.pack("<I", i)))[0]
                           for i in range(2))
        return written, failed


@pytest.fixture
def spaced() -> Iterator[Spaced]:
    require_kernel()
    if len(CPUS) < 2:
        pytest.skip("needs two CPUs: the producer's and the reader's")
    # The reader on the other CPU: a program run holds its CPU (preemption off) for
    # the whole run, and a reader there would be woken only after it.
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {CPUS[-1]})
    try:
        with aperf.BPFObject(BPF_DIR / "paced.bpf.o") as obj:
            obj.load()
            yield Spaced(obj)
    finally:
        os.sched_setaffinity(0, saved)


def seqs(events: list[aperf.Event[None]]) -> list[int]:
    out = []
    for event in events:
        assert isinstance(event, aperf.Sample)
        out.append(int.from_bytes(event.data[:8], "little"))
    return out


async def read_all(stream: aperf.PerfStream[None], n: int) -> list[int]:
    got: list[int] = []
    with anyio.fail_after(30):
        async for batch in stream.batches():
            got += seqs(batch)
            if len(got) >= n:
                return got
    return got


# 20 us apart: reading each wakeup at once catches up between most records (a wakeup
# costs about 10 us of Python), so the old reader was woken for a large part of them.
GAP_NS = 20_000
N = 20_000


@pytest.mark.anyio
async def test_spaced_records_wake_the_reader_about_once_per_drain(spaced: Spaced) -> None:
    async with aperf.PerfStream(spaced.map) as stream:
        thread = spaced.spawn(N, GAP_NS)
        got = await read_all(stream, N)
        await anyio.to_thread.run_sync(thread.join)
        stats = stream.statistics()
    assert spaced.counters() == (N, 0)
    assert got == list(range(N))  # every record once, in order
    assert stats.samples == N
    # Reading at once: a wakeup for most records. Gathered: about one per drain period.
    assert 0 < stats.wakeups < N // 10


def test_perf_buffer_poll_gathers_too(spaced: Spaced) -> None:
    got: list[int] = []
    with aperf.PerfBuffer(spaced.map, on_sample=lambda s: got.append(
            int.from_bytes(s.data[:8], "little"))) as pb:
        thread = spaced.spawn(N, GAP_NS)
        while len(got) < N and (thread.is_alive() or pb.poll(100)):
            pb.poll(10)
        thread.join()
        pb.consume()
        stats = pb.statistics()
    assert spaced.counters() == (N, 0)
    assert got == list(range(N)) and stats.samples == N
    assert 0 < stats.wakeups < N // 10


@pytest.mark.anyio
async def test_lowest_latency_reads_every_wakeup(spaced: Spaced) -> None:
    """One record at a time, the next written only once the last was handed over: each
    lands in an empty ring, so the kernel wakes the reader for each, and with no drain
    timer (a wakeup per sample has none) only reading every wakeup at once hands each
    over. Lockstep, so the count is exact whatever the machine's load."""
    n = 300
    got: list[int] = []
    async with aperf.PerfStream(spaced.map, wakeup="lowest-latency") as stream:
        assert stream.statistics().drain_period is None  # nothing but wakeups reads
        items = stream.__aiter__()
        for _ in range(n):
            await anyio.to_thread.run_sync(spaced.emit, 1, 0)
            with anyio.fail_after(30):
                got += seqs([await items.__anext__()])
        stats = stream.statistics()
    assert got == [0] * n  # each program run numbers its records from 0
    assert spaced.counters() == (n, 0)
    # A wakeup each; the first record may be found by the look the stream takes once
    # its fd is armed (not a wakeup).
    assert n - 1 <= stats.wakeups <= n


@pytest.fixture
def small_ringbuf() -> Iterator[Producer]:
    require_kernel()
    with Producer(ring="ringbuf", ringbuf_bytes=1 << 14) as p:
        yield p


@pytest.mark.anyio
async def test_a_ring_that_fills_while_records_gather_loses_nothing_uncounted(
    small_ringbuf: Producer,
) -> None:
    # A 16 KiB ring and bursts far larger: it fills during the gather delay; what found
    # no room is counted by the BPF side and reported as Lost, the rest delivered.
    n, rounds = 5000, 4
    samples = lost = 0
    async with aperf.PerfStream(small_ringbuf.source()) as stream:
        for _ in range(rounds):
            thread = threading.Thread(target=small_ringbuf.emit, args=(n,),
                                      kwargs={"size": 32, "cpu": CPUS[-1]})
            thread.start()
            await anyio.to_thread.run_sync(thread.join)
            with anyio.fail_after(30):
                async for event in stream:
                    if isinstance(event, aperf.Lost):
                        lost += event.count
                    else:
                        samples += 1
                    counters = small_ringbuf.counters()
                    if samples + lost == counters.ok + counters.failed:
                        break
        stats = stream.statistics()
    counters = small_ringbuf.counters()
    assert counters.ok + counters.failed == n * rounds and counters.failed > 0
    assert samples == counters.ok == stats.samples
    assert lost == counters.failed == stats.lost
