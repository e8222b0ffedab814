"""Queue drops and ring drops on rings that behave like the kernel's (FakeRingSource), with
and without the producer's exact count: the kernel tests (tests/kernel/test_backlog.py) run only
where the kernel counts exactly (Linux 6.0+); here also the lost-record path of older ones."""

from __future__ import annotations

import anyio
import pytest

import aperf
from aperf.testing import FakeRingSource

from ..helpers import fake_reader

PAYLOAD = bytes(36)  # 8 + 4 + 36: a 48-byte record; 85 fit in 4096 bytes
TICKING = aperf.Wakeup.watermark(1 << 20, max_latency=0.002)


async def read(stream: aperf.PerfStream, total: int) -> tuple[int, int]:
    samples = lost = 0
    with anyio.fail_after(20):
        async for event in stream:
            if isinstance(event, aperf.Lost):
                lost += event.count
            else:
                samples += 1
            if samples + lost >= total:
                break
    return samples, lost


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "records"])
def test_drops_while_the_queue_is_full_are_queue_drops_the_rest_ring_drops(exact: bool) -> None:
    src = FakeRingSource(cpus=[0], ring_bytes=4096, exact_lost=exact)

    async def main() -> aperf.StreamStatistics:
        async with aperf.PerfStream(src, wakeup=TICKING, max_pending=10) as stream:
            written = [src.write(0, PAYLOAD) for _ in range(500)]  # a burst: ring drops
            assert written.count(True) == 85
            assert stream.flush() == 85 + exact  # exact: the drops reported at once
            with anyio.fail_after(20):
                while not stream.statistics().paused:  # the timer found the queue full
                    await anyio.sleep(0.01)
            # Held back: the lost record of the burst (24 bytes) and 84 samples fit.
            assert [src.write(0, PAYLOAD) for _ in range(500)].count(True) == 84
            assert stream.statistics().cpus[0].backlog_bytes == 24 + 84 * 48
            samples, lost = await read(stream, 85 + 84 + 415 + 416 * exact)
            assert src.write(0, PAYLOAD)  # without an exact count, the lost record comes now
            assert await read(stream, 1 + 416 * (not exact)) == (1, 416 * (not exact))
            assert (samples, lost) == (169, 415 + 416 * exact)
            return stream.statistics()

    stats = anyio.run(main)
    ring = stats.cpus[0]
    assert ring.lost == src.dropped(0) == 831
    assert (ring.queue_lost, ring.ring_lost) == (416, 415)
    assert stats.queue_lost + stats.ring_lost == stats.lost == 831
    assert ring.high_water == 85 * 48 / 4096
    assert ring.backlog_bytes == 0  # closed


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "records"])
def test_drops_on_every_ring_are_queue_drops_while_the_reader_is_paused(exact: bool) -> None:
    # A full queue stops the reader draining every ring, not only the one whose drain it
    # refused: a ring it had not tried yet (no wakeup, no tick reached it) is held back
    # as much. On the kernel, uvloop's millisecond clock let a tick refuse CPU 0 and skip
    # CPU 1 (drained in a later millisecond than the open): CPU 1's drops were ring drops.
    src = FakeRingSource(cpus=[0, 1], ring_bytes=4096, exact_lost=exact)
    wakeup = aperf.Wakeup.per_sample()
    reader, _ = fake_reader(src, wakeup, max_pending=10)
    ready = {cpu: src._rings[cpu].handle for cpu in (0, 1)}
    for _ in range(10):
        assert src.write(0, PAYLOAD)
    assert reader.on_ready(ready[0]) == 10  # the queue is at its bound
    assert src.write(0, PAYLOAD)
    assert reader.on_ready(ready[0]) == 0 and reader.paused  # refused: paused from now on
    written = [src.write(1, PAYLOAD) for _ in range(500)]  # CPU 1, never refused yet
    assert written.count(True) == 85
    events = reader.take(1000)  # the queue
    events += reader.take(1000)  # below the low-water mark: every ring drained again
    assert not reader.paused
    assert src.write(1, PAYLOAD)  # without an exact count, its lost record comes now
    reader.on_ready(ready[1])
    events += reader.take(1000)
    samples = sum(1 for e in events if isinstance(e, aperf.Sample) and e.cpu == 1)
    lost = sum(e.count for e in events if isinstance(e, aperf.Lost) and e.cpu == 1)
    assert (samples, lost) == (86, 415)
    cpu1 = reader.statistics().cpus[1]
    assert (cpu1.lost, cpu1.queue_lost, cpu1.ring_lost) == (415, 415, 0)
