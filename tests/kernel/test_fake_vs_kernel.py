"""FakeRingSource against the kernel: the same burst into a ring of the same size,
with nobody reading, fills it the same way, drops the same samples, and announces
them the same way (a lost record in front of the next sample that fits)."""

from __future__ import annotations

import os
from typing import Any

import pytest

import aperf
from aperf.testing import FakeRingSource, Producer

CPU = sorted(os.sched_getaffinity(0))[-1]


def shape(events: list[Any]) -> list[tuple[str, int]]:
    """Runs of event kinds: [("Sample", n), ("Lost", count), ...]."""
    out: list[tuple[str, int]] = []
    for event in events:
        if isinstance(event, aperf.Lost):
            out.append(("Lost", event.count))
        elif out and out[-1][0] == "Sample":
            out[-1] = ("Sample", out[-1][1] + 1)
        else:
            out.append(("Sample", 1))
    return out


@pytest.mark.parametrize("size", [8, 32, 100])
def test_same_burst_same_events(producer: Producer, size: int) -> None:
    burst = 500
    kernel: list[Any] = []
    with aperf.PerfBuffer(producer.map, pages=1, on_sample=kernel.append,
                          on_lost=kernel.append) as pb:
        producer.emit(burst, size=size, cpu=CPU)
        counters = producer.counters()
        lost_before_flush = pb.statistics().lost  # the kernel's exact count
        pb.consume()
        producer.emit(1, size=size, cpu=CPU)  # room again: the lost record, then the sample
        pb.consume()
    fake: list[Any] = []
    src = FakeRingSource(cpus=[CPU], ring_bytes=4096)
    with aperf.PerfBuffer(src, on_sample=fake.append, on_lost=fake.append) as pb:
        fitted = sum(src.write(CPU, bytes(size)) for _ in range(burst))
        fake_lost_before_flush = pb.statistics().lost
        pb.consume()
        src.write(CPU, bytes(size))
        pb.consume()
    assert fitted == counters.ok and burst - fitted == counters.failed > 0
    assert fake_lost_before_flush == lost_before_flush == counters.failed
    assert shape(fake) == shape(kernel) == [("Sample", fitted), ("Lost", burst - fitted),
                                            ("Sample", 1)]
    assert {len(e.data) for e in fake if isinstance(e, aperf.Sample)} == {
        len(e.data) for e in kernel if isinstance(e, aperf.Sample)
    }
