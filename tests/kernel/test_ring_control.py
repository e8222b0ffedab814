"""Ring control against the real kernel: pause and resume at the producer, CPU
subsets and slot layouts, memory budgets (issue 20).

Exact counts everywhere, checked against the producer's own counters: a sample
the kernel refuses (no ring in the slot, -ENOENT) is counted as failed by the
BPF side and never reaches aperf.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

import aperf
from aperf.testing import Producer

from .test_stream import Tally

pytestmark = [pytest.mark.usefixtures("kernel")]
CPUS = sorted(os.sched_getaffinity(0))
OTHER_CPU = CPUS[-1]


def lost_total(stats: aperf.StreamStatistics) -> int:
    return sum(cpu.lost for cpu in stats.cpus)


def test_pause_refuses_at_the_producer_and_resume_restores(producer: Producer) -> None:
    before, paused, after = 300, 200, 100
    tally = Tally()
    with aperf.PerfBuffer(producer.map, pages=64, on_sample=tally.add, on_lost=tally.add) as pb:
        producer.emit(before, cpu=OTHER_CPU)
        pb.pause()
        pb.pause()  # idempotent
        producer.emit(paused, cpu=OTHER_CPU)
        assert producer.counters().failed == paused  # -ENOENT at the BPF side
        assert pb.consume() == before  # what the rings held when pausing is delivered
        assert pb.consume() == 0
        pb.resume()
        pb.resume()  # idempotent
        producer.emit(after, cpu=OTHER_CPU)
        assert pb.consume() == after
        stats = pb.statistics()
    counters = producer.counters()
    assert tally.samples == before + after == counters.ok
    assert sum(tally.lost.values()) == 0 == lost_total(stats)
    assert counters.failed == paused
    expected = list(range(before)) + list(range(before + paused, before + paused + after))
    assert tally.seqs[OTHER_CPU] == expected


@pytest.mark.anyio
async def test_stream_pause_and_resume(producer: Producer) -> None:
    before, paused, after = 50, 70, 30
    tally = Tally()
    async with aperf.PerfStream(producer.map, pages=16, wakeup="lowest-latency") as stream:
        producer.emit(before, cpu=OTHER_CPU)
        stream.pause()
        producer.emit(paused, cpu=OTHER_CPU)
        stream.resume()
        producer.emit(after, cpu=OTHER_CPU)
        with anyio.fail_after(20):
            async for event in stream:
                tally.add(event)
                if tally.total == before + after:
                    break
        assert stream.flush() == 0
        stats = stream.statistics()
    assert producer.counters().failed == paused
    assert lost_total(stats) == 0 and not tally.lost
    assert tally.seqs[OTHER_CPU] == list(range(before)) + list(
        range(before + paused, before + paused + after)
    )


@pytest.fixture
def ringbuf() -> Iterator[Producer]:
    with Producer(ring="ringbuf", ringbuf_bytes=1 << 16) as p:
        yield p


def test_a_ring_buffer_refuses_pause(ringbuf: Producer) -> None:
    with aperf.PerfBuffer(ringbuf.source(), on_sample=lambda e: None) as pb:
        with pytest.raises(aperf.UnsupportedError, match="no slots"):
            pb.pause()
        with pytest.raises(aperf.UnsupportedError):
            pb.resume()
        ringbuf.emit(3)
        assert pb.consume() == 3  # it kept reading


def test_pause_needs_an_open_buffer(producer: Producer) -> None:
    pb: aperf.PerfBuffer[Any] = aperf.PerfBuffer(producer.map, pages=1, on_sample=print)
    pb.close()
    with pytest.raises(aperf.ClosedResourceError):
        pb.pause()


# --- CPU subsets and slot layouts: cpus= and map_keys= --------------------------------

FIRST_CPU = CPUS[0]


def test_two_cpus_to_test_on() -> None:
    assert len(CPUS) >= 2, "the CPU subset tests need two CPUs"


def test_cpus_opens_rings_only_there(producer: Producer) -> None:
    tally = Tally()
    with aperf.PerfBuffer(
        producer.map, pages=16, on_sample=tally.add, on_lost=tally.add, cpus=[OTHER_CPU]
    ) as pb:
        assert pb.cpus == [OTHER_CPU] and pb.buffer_cnt == 1
        producer.emit(40, cpu=OTHER_CPU)
        producer.emit(25, cpu=FIRST_CPU)  # no ring in FIRST_CPU's slot: -ENOENT
        assert pb.consume() == 40
        # Pausing and resuming restores the slot keyed by the CPU id, not slot 0.
        pb.pause()
        producer.emit(5, cpu=OTHER_CPU)
        pb.resume()
        producer.emit(7, cpu=OTHER_CPU)
        producer.emit(3, cpu=FIRST_CPU)
        assert pb.consume() == 7
        stats = pb.statistics()
    counters = producer.counters()
    assert counters.ok == 47 and counters.failed == 25 + 5 + 3
    assert set(tally.seqs) == {OTHER_CPU} and not tally.lost and lost_total(stats) == 0
    assert tally.seqs[OTHER_CPU] == list(range(40)) + list(range(70, 77))


@pytest.fixture
def slotted() -> Iterator[Producer]:
    with Producer(perf_slots=8) as p:
        yield p


def test_map_keys_put_several_channels_on_a_cpu(slotted: Producer) -> None:
    tally = Tally()
    with aperf.PerfBuffer(
        slotted.map, pages=16, on_sample=tally.add, on_lost=tally.add,
        cpus=[OTHER_CPU, OTHER_CPU, FIRST_CPU], map_keys=[5, 6, 2],
    ) as pb:
        assert pb.cpus == [2, 5, 6] and pb.buffer_cnt == 3
        slotted.emit(10, cpu=OTHER_CPU, map_key=5)
        slotted.emit(20, cpu=OTHER_CPU, map_key=6)
        slotted.emit(30, cpu=FIRST_CPU, map_key=2)
        slotted.emit(7, cpu=OTHER_CPU, map_key=2)  # slot 2's ring is FIRST_CPU's: refused
        slotted.emit(4, cpu=FIRST_CPU)  # the CPU's own slot is empty: -ENOENT
        assert pb.consume() == 60
        pb.pause()
        slotted.emit(9, cpu=OTHER_CPU, map_key=6)
        pb.resume()
        slotted.emit(2, cpu=OTHER_CPU, map_key=6)
        assert pb.consume() == 2
    counters = slotted.counters()
    assert counters.ok == 62 and counters.failed == 7 + 4 + 9
    assert not tally.lost
    assert tally.seqs == {5: list(range(10)), 6: [*range(10, 30), 80, 81], 2: list(range(30, 60))}


def test_cpu_and_key_errors_name_the_argument(producer: Producer) -> None:
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"cpus": [4095]}, "cpus", "CPU \\[4095\\] is not possible"),
        ({"cpus": [OTHER_CPU, OTHER_CPU]}, "cpus", "more than once"),
        ({"cpus": []}, "cpus", "opens no ring"),
        ({"cpus": [-1]}, "cpus", "negative"),
        ({"cpus": [0, 1], "map_keys": [3, 3]}, "map_keys", "slot \\[3\\] more than once"),
        ({"cpus": [0, 1], "map_keys": [3]}, "map_keys", "1 slots for 2 cpus"),
        ({"map_keys": [3]}, "map_keys", "needs cpus="),
        ({"cpus": [FIRST_CPU], "map_keys": [2]}, "map_keys", "beyond the 2 slots"),
    ]
    for kwargs, argument, message in cases:
        with pytest.raises(aperf.ArgumentError, match=message) as info:
            aperf.PerfBuffer(producer.map, pages=1, on_sample=print, **kwargs)
        assert info.value.argument == argument, kwargs
    with pytest.raises(TypeError, match="cpus must hold ints"):
        aperf.PerfBuffer(producer.map, pages=1, on_sample=print, cpus=["0"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="cpus must be a list"):
        aperf.PerfStream(producer.map, cpus=0)  # type: ignore[call-overload]
    # Nothing was left behind: the map takes a reader again.
    with aperf.PerfBuffer(producer.map, pages=1, on_sample=print, cpus=[FIRST_CPU]) as pb:
        producer.emit(3, cpu=FIRST_CPU)
        assert pb.consume() == 3


def test_cpus_is_for_perf_event_arrays(ringbuf: Producer) -> None:
    with pytest.raises(aperf.UnsupportedError, match="perf event array"):
        aperf.PerfBuffer(ringbuf.source(), on_sample=print, cpus=[0])


@pytest.mark.anyio
async def test_stream_on_a_cpu_subset(producer: Producer) -> None:
    tally = Tally()
    async with aperf.PerfStream(
        producer.map, pages=16, wakeup="lowest-latency", cpus=[FIRST_CPU]
    ) as stream:
        assert stream.cpus == [FIRST_CPU]
        producer.emit(6, cpu=OTHER_CPU)
        producer.emit(12, cpu=FIRST_CPU)
        with anyio.fail_after(20):
            async for event in stream:
                tally.add(event)
                if tally.total == 12:
                    break
    assert tally.seqs == {FIRST_CPU: list(range(6, 18))}
    assert producer.counters().failed == 6


# --- memory budgets: memory_bytes= ------------------------------------------------------

PAGE = mmap.PAGESIZE


def perf_mappings() -> list[int]:
    """Sizes of this process's perf ring mappings, as the kernel lists them."""
    sizes = []
    with open("/proc/self/maps") as f:
        for line in f:
            if "[perf_event]" in line:
                lo, hi = line.split()[0].split("-")
                sizes.append(int(hi, 16) - int(lo, 16))
    return sorted(sizes)


def test_memory_budget_opens_the_rings_promised(producer: Producer) -> None:
    assert PAGE == 4096, "the figures below are for 4 KiB pages"
    budget = 1 << 20  # 1 MiB over the online CPUs
    with aperf.PerfBuffer(producer.map, memory_bytes=budget, on_sample=print) as pb:
        stats = pb.statistics()
        rings = pb.buffer_cnt
        assert rings == len(CPUS)
        # 1 MiB / 2 rings = 128 pages each, one for metadata: 127 data pages round down to 64.
        data_pages = {1: 128, 2: 64, 4: 32}[rings]
        assert stats.ring_bytes == data_pages * PAGE
        assert stats.memory_bytes == rings * (data_pages + 1) * PAGE <= budget
        assert rings * (2 * data_pages + 1) * PAGE > budget  # the next size would not fit
        assert perf_mappings() == [(data_pages + 1) * PAGE] * rings  # what the kernel mapped


def test_memory_budget_ring_holds_what_its_size_says(producer: Producer) -> None:
    tally = Tally()
    # One ring, 300,000 bytes: 73 pages -> 72 data pages -> 64 (256 KiB), 5461 samples of 48.
    with aperf.PerfBuffer(
        producer.map, memory_bytes=300_000, cpus=[OTHER_CPU], on_sample=tally.add,
        on_lost=tally.add,
    ) as pb:
        assert pb.statistics().ring_bytes == 64 * PAGE
        assert pb.statistics().memory_bytes == 65 * PAGE
        producer.emit(6000, cpu=OTHER_CPU)  # nobody reads: the ring keeps what fits
        assert producer.counters().ok == 64 * PAGE // 48 == 5461
        assert pb.consume() >= 5461
    assert tally.samples == 5461 and sum(tally.lost.values()) == 6000 - 5461


def test_an_impossible_budget_says_the_smallest_and_largest(producer: Producer) -> None:
    # The ring count known at once (cpus=): the constructor says so before any ring.
    with pytest.raises(aperf.RingSizeError, match=f"smallest possible is {2 * PAGE}, "):
        aperf.PerfBuffer(producer.map, memory_bytes=PAGE, cpus=[0], on_sample=print)
    # Every online CPU: counted at open.
    rings = len(CPUS)
    with pytest.raises(aperf.RingSizeError) as info:
        aperf.PerfBuffer(producer.map, memory_bytes=2 * PAGE, on_sample=print)
    assert f"smallest possible is {rings * 2 * PAGE}, the largest {rings * ((1 << 28) + PAGE)}" in (
        str(info.value)
    )
    with pytest.raises(aperf.RingSizeError, match="one of pages, ring_bytes or memory_bytes"):
        aperf.PerfStream(producer.map, pages=8, memory_bytes=1 << 20)
    assert perf_mappings() == []  # nothing was left open
