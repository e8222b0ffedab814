"""Ring control against the real kernel: pause and resume at the producer, CPU
subsets and slot layouts, memory budgets (issue 20).

Exact counts everywhere, checked against the producer's own counters: a sample
the kernel refuses (no ring in the slot, -ENOENT) is counted as failed by the
BPF side and never reaches aperf.
"""

from __future__ import annotations

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
