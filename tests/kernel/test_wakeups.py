"""A quiet source under per-sample wakeups: one sample, then nothing, arrives at once.

Arming a perf fd polls it, and that poll takes the kernel's one-shot wakeup flag:
epoll then reports nothing for a sample written before the arm. uvloop (libuv)
arms a new fd only in the poll phase of its next iteration, after its timers, so
a consumer that took a burst by itself before the loop ran once left the next
sample's wakeup to be eaten by the arm, and that sample waited for another one,
which a quiet source may never write. Every loop (asyncio, uvloop, trio), perf
rings and ring buffers, with and without a burst first. Counts are the BPF side's.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

import aperf
from aperf._drivers import sync as _sync
from aperf.testing import Producer, sample_header

from ..helpers import require_kernel

pytestmark = [pytest.mark.usefixtures("kernel"), pytest.mark.anyio]
CPU = sorted(os.sched_getaffinity(0))[-1]
# Overflows either 4 KiB ring (drops arrive as Lost) and takes tens of milliseconds to
# write: the consumer's own drain of it comes well after the open on any clock (uvloop's
# counts milliseconds; the first look used to skip a ring drained after the open).
BURST = 100_000
# The producer, and the stream's keywords, per kind of ring: 4 KiB each.
RINGS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "perf": ({"ring": "perf"}, {"pages": 1}),
    "ringbuf": ({"ring": "ringbuf", "ringbuf_bytes": 1 << 12}, {}),
}


@pytest.fixture(params=sorted(RINGS))
def ring(request: pytest.FixtureRequest) -> Iterator[tuple[Producer, dict[str, Any]]]:
    require_kernel()
    producer_options, stream_options = RINGS[request.param]
    with Producer(**producer_options) as producer:
        yield producer, stream_options


async def take_burst(events: Any, producer: Producer) -> None:
    """Every sample and Lost of the burst, counted against the BPF side's counts."""
    samples = lost = 0
    with anyio.fail_after(10):
        while samples + lost < BURST:
            event = await anext(events)
            if isinstance(event, aperf.Lost):
                lost += event.count
            else:
                samples += 1
    counters = producer.counters()
    assert counters.failed > 0
    assert (samples, lost) == (counters.ok, counters.failed)


@pytest.mark.parametrize("burst", [False, True], ids=["alone", "after-a-burst"])
async def test_one_sample_then_nothing_arrives_at_once(
    ring: tuple[Producer, dict[str, Any]], burst: bool
) -> None:
    producer, options = ring
    async with aperf.PerfStream(producer.source(), wakeup="lowest-latency", **options) as stream:
        assert stream.statistics().drain_period is None  # no timer: wakeups only
        events = aiter(stream)
        if burst:
            # Written before the loop ran once, and taken by the consumer itself (the
            # ring is full): uvloop has not armed the fds yet.
            producer.emit(BURST, cpu=CPU)
            await take_burst(events, producer)
        for _ in range(3):  # one sample at a time, each delivered before the next
            seq = producer.emit(1, cpu=CPU)
            with anyio.fail_after(10):
                event = await anext(events)
            assert isinstance(event, aperf.Sample)
            assert sample_header(event.data)[0] == seq
        assert stream.statistics().pending == 0


def test_a_sample_written_while_a_perf_buffer_arms_its_rings_is_handed_over(
    producer: Producer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The window between opening the rings and adding their fds to the epoll set,
    # made wide: the sample's wakeup is taken by the epoll_ctl that adds its fd.
    make_waiter = _sync.handle_waiter

    def waiter_after_a_sample(*args: Any) -> Any:
        producer.emit(1, cpu=CPU)
        return make_waiter(*args)

    monkeypatch.setattr(_sync, "handle_waiter", waiter_after_a_sample)
    got: list[aperf.Sample] = []
    with aperf.PerfBuffer(producer.map, pages=8, wakeup="lowest-latency",
                          on_sample=got.append) as pb:
        monkeypatch.undo()
        assert pb.poll(timeout_ms=10_000) == 1
    assert [sample_header(s.data)[0] for s in got] == [0]
