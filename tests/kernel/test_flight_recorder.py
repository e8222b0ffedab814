"""Flight-recorder rings against the real kernel (issue 20, item 2).

``overwritable=True`` opens ``write_backward`` perf rings mapped read-only: the
kernel overwrites the oldest records and never drops, and ``snapshot()`` reads
the newest ones. Every count is exact: a 32-byte sample is a 48-byte record
(8-byte header, u32 size, 36 padded bytes), so a ring of D data bytes keeps
exactly D // 48 samples, the newest, contiguous, ending at the last one produced.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import anyio
import pytest

import aperf
from aperf.testing import Producer, sample_header

from ..helpers import open_fds

pytestmark = [pytest.mark.usefixtures("kernel")]
CPUS = sorted(os.sched_getaffinity(0))
RING_BYTES = 2 * 4096
RECORD = 48  # a 32-byte sample's perf record
CAPACITY = RING_BYTES // RECORD  # 170 samples


class Header(ctypes.Structure):
    _fields_ = (("seq", ctypes.c_uint64), ("ts", ctypes.c_uint64))


def seqs(events: list[Any]) -> list[int]:
    assert all(isinstance(e, aperf.Sample) for e in events), events
    return [sample_header(e.data)[0] for e in events]


def ignore(event: Any) -> None:
    raise AssertionError(f"a flight-recorder ring delivered {event!r} on its own")


def test_a_snapshot_holds_exactly_the_newest_samples(producer: Producer) -> None:
    total = 10 * CAPACITY
    fds = open_fds()
    with aperf.PerfBuffer(
        producer.map, ring_bytes=RING_BYTES, cpus=[CPUS[0]], overwritable=True,
        on_sample=ignore, on_lost=ignore,
    ) as pb:
        producer.emit(total, cpu=CPUS[0])
        assert pb.poll(50) == 0  # never read on wakeups: nothing delivered, nothing lost
        snap = pb.snapshot()
        stats = pb.statistics()
    assert producer.counters().failed == 0  # the kernel never dropped
    assert seqs(snap) == list(range(total - CAPACITY, total))
    assert {e.cpu for e in snap} == {CPUS[0]}
    assert sum(cpu.lost for cpu in stats.cpus) == 0
    assert open_fds() == fds  # the ring's fd closed (and its memory unmapped) on close


@pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs")
def test_both_cpus_per_cpu_and_merged_by_timestamp(producer: Producer) -> None:
    per_cpu: dict[int, list[int]] = {cpu: [] for cpu in CPUS[:2]}
    with aperf.PerfBuffer(
        producer.map, ring_bytes=RING_BYTES, cpus=CPUS[:2], decoder=Header,
        overwritable=True, on_sample=ignore,
    ) as pb:
        block = 7  # alternate CPUs, so that the newest of the two interleave
        while min(len(s) for s in per_cpu.values()) < 10 * CAPACITY:
            for cpu in per_cpu:
                first = producer.emit(block, cpu=cpu)
                per_cpu[cpu].extend(range(first, first + block))
        by_cpu = pb.snapshot()
        merged = pb.snapshot(order_by="ts")
    assert producer.counters().failed == 0
    newest = {cpu: s[-CAPACITY:] for cpu, s in per_cpu.items()}
    assert seqs(by_cpu) == newest[CPUS[0]] + newest[CPUS[1]]
    assert [e.cpu for e in by_cpu] == [CPUS[0]] * CAPACITY + [CPUS[1]] * CAPACITY
    # The emits ran one after another: ktime order is sequence order, across CPUs.
    assert seqs(merged) == sorted(newest[CPUS[0]] + newest[CPUS[1]])
    assert [e.value.seq for e in merged] == seqs(merged)
    assert seqs(merged) != seqs(by_cpu)


def test_snapshot_twice_and_the_producer_resumes(producer: Producer) -> None:
    cpu = CPUS[-1]
    with aperf.PerfBuffer(
        producer.map, ring_bytes=RING_BYTES, cpus=[cpu], overwritable=True, on_sample=ignore,
    ) as pb:
        producer.emit(3 * CAPACITY, cpu=cpu)
        first = pb.snapshot()
        again = pb.snapshot()  # the rings keep their records
        producer.emit(5, cpu=cpu)  # resumed: the slot is back
        after = pb.snapshot()
    assert producer.counters().failed == 0
    total = 3 * CAPACITY + 5
    assert seqs(first) == seqs(again) == list(range(2 * CAPACITY, 3 * CAPACITY))
    assert seqs(after) == list(range(total - CAPACITY, total))


def test_a_paused_buffer_stays_paused_through_a_snapshot(producer: Producer) -> None:
    cpu = CPUS[0]
    with aperf.PerfBuffer(
        producer.map, ring_bytes=RING_BYTES, cpus=[cpu], overwritable=True, on_sample=ignore,
    ) as pb:
        producer.emit(10, cpu=cpu)
        pb.pause()
        assert seqs(pb.snapshot()) == list(range(10))
        producer.emit(4, cpu=cpu)
        assert producer.counters().failed == 4  # still paused: -ENOENT
        pb.resume()
        producer.emit(2, cpu=cpu)
        assert seqs(pb.snapshot()) == [*range(10), 14, 15]


def test_a_snapshot_of_empty_rings_is_empty(producer: Producer) -> None:
    with aperf.PerfBuffer(producer.map, pages=1, overwritable=True, on_sample=ignore) as pb:
        assert pb.snapshot() == []
        assert pb.buffer_cnt == len(CPUS)


def test_sizes_that_vary_give_the_newest_complete_records(producer: Producer) -> None:
    cpu = CPUS[0]
    sizes = [16, 100, 40, 300, 24]  # records of 32, 112, 56, 312 and 40 bytes
    record = {16: 32, 100: 112, 40: 56, 300: 312, 24: 40}
    emitted: list[tuple[int, int]] = []
    with aperf.PerfBuffer(
        producer.map, pages=1, cpus=[cpu], overwritable=True, on_sample=ignore,
    ) as pb:
        for n in range(200):
            size = sizes[n % len(sizes)]
            emitted.append((producer.emit(1, size=size, cpu=cpu), size))
        snap = pb.snapshot()
    # The newest records whose bytes all fit in the 4096-byte ring.
    kept, used = [], 0
    for seq, size in reversed(emitted):
        if used + record[size] > 4096:
            break
        kept.append(seq)
        used += record[size]
    assert seqs(snap) == kept[::-1] and kept[0] == emitted[-1][0]


@pytest.mark.anyio
async def test_a_stream_snapshot(producer: Producer) -> None:
    cpu = CPUS[-1]
    async with aperf.PerfStream(
        producer.map, ring_bytes=RING_BYTES, cpus=[cpu], decoder=Header, overwritable=True,
        wakeup="lowest-latency",
    ) as stream:
        producer.emit(10 * CAPACITY, cpu=cpu)
        await anyio.sleep(0.05)  # the loop sees the wakeups; there is nothing to deliver
        assert stream.flush() == 0
        snap = stream.snapshot(order_by="ts")
        stats = stream.statistics()
    assert seqs(snap) == list(range(9 * CAPACITY, 10 * CAPACITY))
    assert sum(c.samples for c in stats.cpus) == 0 and sum(c.lost for c in stats.cpus) == 0


def test_snapshot_needs_flight_recorder_rings(producer: Producer) -> None:
    with aperf.PerfBuffer(producer.map, pages=1, on_sample=ignore) as pb, pytest.raises(
        aperf.UnsupportedError, match="overwritable=True"
    ):
        pb.snapshot()


def test_order_by_needs_a_field_of_the_decoded_values(producer: Producer) -> None:
    cpu = CPUS[0]
    with aperf.PerfBuffer(
        producer.map, pages=1, cpus=[cpu], overwritable=True, on_sample=ignore,
    ) as pb:
        with pytest.raises(aperf.ArgumentError, match="order_by") as raised:
            pb.snapshot(order_by="ts")  # no decoder
        assert raised.value.argument == "order_by"
    with aperf.PerfBuffer(
        producer.map, pages=1, cpus=[cpu], decoder=Header, overwritable=True, on_sample=ignore,
    ) as pb:
        producer.emit(3, cpu=cpu)
        with pytest.raises(aperf.ArgumentError, match="no field 'when'"):
            pb.snapshot(order_by="when")
        with pytest.raises(TypeError, match="order_by"):
            pb.snapshot(order_by=1)  # type: ignore[arg-type]
        assert seqs(pb.snapshot(order_by="seq")) == [0, 1, 2]


def test_flight_recorder_rings_are_perf_rings_only(kernel: None) -> None:
    with Producer(ring="ringbuf") as rb:
        with pytest.raises(aperf.UnsupportedError, match="overwritable=True"):
            aperf.PerfBuffer(rb.map, overwritable=True, on_sample=ignore)
        with aperf.PerfBuffer(rb.map, on_sample=ignore) as pb, pytest.raises(
            aperf.UnsupportedError, match="perf event array"
        ):
            pb.snapshot()
        with pytest.raises(TypeError, match="overwritable"):
            aperf.PerfBuffer(rb.map, overwritable="yes", on_sample=ignore)  # type: ignore[call-overload]


def test_a_given_up_source_frees_its_rings_and_leaves_the_slots(producer: Producer) -> None:
    # What a take-over does to the holder (tests/kernel/test_map_lock.py): its slots emptied,
    # its map fd pointed at /dev/null; freeing its rings then touches no slot.
    from aperf._rings.perf.source import PerfEventArraySource
    from aperf._rings.seam import RingConfig

    cpu = CPUS[0]
    source = PerfEventArraySource(producer.map)
    source.open(RingConfig(4096, aperf.Wakeup.balanced(), cpus=(cpu,), overwritable=True))
    producer.emit(3, cpu=cpu)
    assert source._give_up()
    producer.emit(2, cpu=cpu)  # the slot is empty: -ENOENT
    source.free()
    source.free()
    assert producer.counters().failed == 2 and producer.counters().ok == 3


@pytest.mark.anyio
async def test_snapshot_pause_and_resume_after_close_say_closed(producer: Producer) -> None:
    """A closed stream or buffer is closed, whatever its rings were: ClosedResourceError,
    as every other use of it raises (not "was not opened with overwritable=True")."""
    cpu = CPUS[0]
    stream = aperf.PerfStream(producer.map, ring_bytes=RING_BYTES, cpus=[cpu],
                              overwritable=True)
    async with stream:
        assert stream.snapshot() == []
    pb = aperf.PerfBuffer(producer.map, ring_bytes=RING_BYTES, cpus=[cpu], overwritable=True,
                          on_sample=ignore)
    pb.close()
    with Producer(ring="ringbuf") as rb_producer:
        async with aperf.PerfStream(rb_producer.source()) as rb_stream:
            pass
    for closed in (stream, pb, rb_stream):
        for call in (closed.snapshot, closed.pause, closed.resume):
            with pytest.raises(aperf.ClosedResourceError, match="closed"):
                call()
