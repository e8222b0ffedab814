"""Where ``Lost`` notices fall, against the producer's own record of where its outputs
failed (issue 28): in each ring's events, the notices between two samples announce
exactly the sequence numbers missing between them, and those are the ones the BPF
side saw fail (``Producer.failures``), no more, no fewer, nowhere else. Unordered and
ordered (``order_by="ts"``), on every loop and through the sync ``PerfBuffer``."""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

import anyio
import pytest

import aperf
from aperf.testing import Producer

pytestmark = [pytest.mark.usefixtures("kernel"), pytest.mark.anyio]
CPUS = sorted(os.sched_getaffinity(0))
A, B = CPUS[0], CPUS[-1]
# One page of ring data holds 85 samples of 32 bytes (48-byte records): a burst of 300
# drops 215, whatever the machine.
BURST = 300
FLAT_OUT = 200_000  # per CPU, while the reader reads: the rings fill again and again
CHUNK = 1000  # samples per program run: between runs the reader gets the CPU too


class Ev(ctypes.Structure):
    _fields_ = [("seq", ctypes.c_uint64), ("ts", ctypes.c_uint64)]


def gaps(events: list[Any], first: int, end: int) -> list[tuple[range, int]]:
    """One ring's events, sequence numbers ``first`` to ``end`` emitted: each run of
    numbers missing between two samples (or before the first, after the last) with the
    count the Lost notices placed there announce; a notice where nothing is missing
    shows as an empty range with its count."""
    out = []
    expected, announced = first, 0
    for event in events:
        if isinstance(event, aperf.Lost):
            announced += event.count
            continue
        seq = event.value.seq
        if seq != expected or announced:
            out.append((range(expected, seq), announced))
        expected, announced = seq + 1, 0
    if end != expected or announced:
        out.append((range(expected, end), announced))
    return out


def check_in_place(producer: Producer, events: list[Any], cpu: int, first: int,
                   end: int) -> int:
    """Every Lost of ``cpu``'s ring where the producer failed, announcing exactly that
    many; the failures found. Samples of one ring come in ring order."""
    mine = [e for e in events if e.cpu == cpu]
    places = gaps(mine, first, end)
    assert [(missing, len(missing)) for missing, _ in places] == places, (
        "a Lost notice away from the drops it announces")
    failed = [r for r in producer.failures(cpu) if first <= r.start < end]
    assert [missing for missing, _ in places] == failed
    return sum(map(len, failed))


class WritesAfterTake:
    """A ring whose first ``take()`` lets the producer write once the space is released:
    the producer running while a drain works through its span, at a point the test
    chooses instead of one a race picks."""

    def __init__(self, ring: Any, then: Any) -> None:
        self._ring = ring
        self._then = then

    def take(self) -> bytes:
        span: bytes = self._ring.take()
        then, self._then = self._then, None
        if then is not None:
            then()
        return span

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ring, name)


async def collect(stream: aperf.PerfStream[Any], producer: Producer) -> list[Any]:
    """Events until every sample the producer wrote is delivered and every drop announced."""
    events: list[Any] = []
    samples = lost = 0
    with anyio.fail_after(30):
        async for event in stream:
            events.append(event)
            if isinstance(event, aperf.Lost):
                lost += event.count
            else:
                samples += 1
            counters = producer.counters()
            if samples == counters.ok and lost == counters.failed:
                return events
    raise AssertionError("the stream ended early")


@pytest.mark.parametrize("order_by", [None, "ts"], ids=["unordered", "ordered"])
async def test_drops_after_a_take_are_announced_after_the_samples_written_before_them(
    producer: Producer, order_by: str | None,
) -> None:
    # A burst fills the ring and drops; right after the first drain released the space,
    # a second burst fills it again (85 samples) and drops. Before issue 28 the drain
    # read the kernel's lost count only then: the second burst's drops were announced
    # at the end of the first span, ahead of the 85 samples written before them, and
    # where they happened (after those) no Lost came.
    async with aperf.PerfStream(producer.map, decoder=Ev, pages=1, cpus=[A],
                                order_by=order_by) as stream:
        producer.emit(BURST, size=32, cpu=A, first_seq=0)
        reader = stream._reader
        assert reader is not None
        reader.rings.swap(WritesAfterTake(
            reader.rings[A], lambda: producer.emit(BURST, size=32, cpu=A, first_seq=BURST)))
        events = await collect(stream, producer)
        stats = stream.statistics()
    failed = check_in_place(producer, events, A, 0, 2 * BURST)
    assert len(producer.failures(A)) == 2  # each burst dropped
    assert failed == producer.counters().failed == stats.lost
    assert stats.samples == producer.counters().ok == 2 * BURST - failed
    assert stats.pending == 0


def emit_pinned(producer: Producer, cpu: int, count: int, first: int) -> threading.Thread:
    def run() -> None:
        os.sched_setaffinity(0, {cpu})  # on its CPU: no busy wait for another's run
        for at in range(0, count, CHUNK):
            producer.emit(min(CHUNK, count - at), size=32, cpu=cpu, first_seq=first + at)

    thread = threading.Thread(target=run, name=f"producer-cpu{cpu}", daemon=True)
    thread.start()
    return thread


def check_flat_out(producer: Producer, events: list[Any], stats: aperf.StreamStatistics) -> None:
    total = BURST + FLAT_OUT
    failed = (check_in_place(producer, events, A, 0, total)
              + check_in_place(producer, events, B, total, 2 * total))
    assert failed == producer.counters().failed == stats.lost
    assert stats.samples == producer.counters().ok == 2 * total - failed
    assert failed >= 2 * (BURST - 85)  # the bursts before reading dropped at least that
    assert stats.pending == 0


@pytest.mark.parametrize("order_by", [None, "ts"], ids=["unordered", "ordered"])
async def test_lost_notices_fall_where_the_producer_failed_with_both_cpus_flat_out(
    producer: Producer, order_by: str | None,
) -> None:
    if A == B:
        pytest.skip("needs two CPUs")
    total = BURST + FLAT_OUT
    async with aperf.PerfStream(producer.map, decoder=Ev, pages=1, cpus=[A, B],
                                order_by=order_by) as stream:
        # Full rings before the reader starts (drops for sure), then both CPUs flat out
        # while it reads: the rings fill and drain and fill again as the race goes.
        producer.emit(BURST, size=32, cpu=A, first_seq=0)
        producer.emit(BURST, size=32, cpu=B, first_seq=total)
        threads = [emit_pinned(producer, A, FLAT_OUT, BURST),
                   emit_pinned(producer, B, FLAT_OUT, total + BURST)]
        events: list[Any] = []
        samples = lost = 0
        batches = stream.batches()
        with anyio.fail_after(60):
            while True:
                running = any(t.is_alive() for t in threads)  # then the counts are final
                counters = producer.counters()
                if not running and (samples, lost) == (counters.ok, counters.failed):
                    break
                # While they run, the last events may already be in: look again soon (a
                # cancelled anext() loses nothing, the iterator goes on).
                with anyio.move_on_after(0.05 if running else 60):
                    for event in await anext(batches):
                        events.append(event)
                        if isinstance(event, aperf.Lost):
                            lost += event.count
                        else:
                            samples += 1
        for thread in threads:
            thread.join()
        stats = stream.statistics()
    check_flat_out(producer, events, stats)


@pytest.mark.parametrize("order_by", [None, "ts"], ids=["unordered", "ordered"])
def test_lost_notices_fall_where_the_producer_failed_in_the_sync_buffer(
    producer: Producer, order_by: str | None,
) -> None:
    if A == B:
        pytest.skip("needs two CPUs")
    total = BURST + FLAT_OUT
    events: list[Any] = []
    with aperf.PerfBuffer(producer.map, decoder=Ev, pages=1, cpus=[A, B], order_by=order_by,
                          on_sample=events.append, on_lost=events.append) as pb:
        producer.emit(BURST, size=32, cpu=A, first_seq=0)
        producer.emit(BURST, size=32, cpu=B, first_seq=total)
        threads = [emit_pinned(producer, A, FLAT_OUT, BURST),
                   emit_pinned(producer, B, FLAT_OUT, total + BURST)]
        while any(t.is_alive() for t in threads):
            pb.poll(10)
        for thread in threads:
            thread.join()
        while pb.consume():  # the rest, and what is held for ordering
            pass
        stats = pb.statistics()
    check_flat_out(producer, events, stats)
