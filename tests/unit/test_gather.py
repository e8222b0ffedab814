"""Coalesced wakeups (issue 23): a source whose kernel wakes the reader only once it caught
up (a BPF ring buffer) has, with batched wakeups, each wakeup read at the next tick, so
records gather meanwhile; on a fake source marked so, with a fake clock."""

from __future__ import annotations

import struct
from typing import Any

import pytest

import aperf
from aperf._reading.gather import gather_threshold
from aperf._reading.reader import Reader
from aperf.testing import FakeRingSource

from ..helpers import FakeClock, fake_reader

Q = struct.Struct("<Q")


class CaughtUpSource(FakeRingSource):
    """Fake rings whose kernel wakes the reader only once it caught up, as a BPF ring
    buffer's does (``aperf.abc.GatheringSource``); its wakeups held back are recorded."""

    wakes_when_caught_up = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hushes: list[tuple[int, bool]] = []

    def hush_wakeups(self, handle: int, hushed: bool) -> None:
        self.hushes.append((handle, hushed))


def gathering(reader: Reader) -> set[int]:
    assert reader.gather is not None
    return reader.gather.gathering


def hushed(reader: Reader) -> set[int]:
    assert reader.gather is not None
    return reader.gather.hushed


def make(wakeup: aperf.Wakeup, *, caught_up: bool = True,
         ring_bytes: int = 4096) -> tuple[Reader, FakeRingSource, FakeClock, int]:
    kind = CaughtUpSource if caught_up else FakeRingSource
    src = kind(cpus=[0], ring_bytes=ring_bytes)
    # Readiness per sample, whatever the reader's wakeup.
    reader, clock = fake_reader(src, wakeup, ring_wakeup=aperf.Wakeup.per_sample())
    return reader, src, clock, src._rings[0].handle


def test_a_wakeup_is_left_to_the_next_tick_and_counted() -> None:
    reader, src, clock, handle = make(aperf.Wakeup.balanced())
    clock.now = reader.deadline  # the first tick: nothing yet
    reader.tick()
    clock.now += 0.0001
    src.write(0, Q.pack(0))
    assert reader.on_ready(handle) == 0  # not read: records gather
    assert gathering(reader) == {0}
    assert reader.deadline == pytest.approx(100.002)  # within max_latency of the wakeup
    for i in range(1, 5):
        src.write(0, Q.pack(i))  # (the kernel would not wake a reader that did not catch up)
    clock.now = reader.deadline
    assert reader.tick() == 5 and not gathering(reader)
    assert [Q.unpack_from(e.data)[0] for e in reader.take(10)] == list(range(5))
    stats = reader.statistics()
    assert stats.wakeups == 1 and stats.samples == 5


def test_a_ring_past_the_threshold_is_read_at_once() -> None:
    reader, src, _, handle = make(aperf.Wakeup.watermark(64))
    for i in range(8):  # 8 records of 16 bytes with their headers: past 64 bytes
        src.write(0, Q.pack(i))
    assert reader.on_ready(handle) == 8 and not gathering(reader)


def test_after_a_large_drain_wakeups_are_read_at_once() -> None:
    # At a rate where one tick's drain takes a quarter of the threshold or more, a
    # filling ring would get no wakeup to say so: read each wakeup at once again.
    reader, src, clock, handle = make(aperf.Wakeup.watermark(256))
    for i in range(5):  # 80 bytes: below the threshold, more than a quarter of it
        src.write(0, Q.pack(i))
    assert reader.on_ready(handle) == 0
    clock.now = reader.deadline
    assert reader.tick() == 5
    src.write(0, Q.pack(5))
    assert reader.on_ready(handle) == 1


def test_lowest_latency_and_perf_rings_read_every_wakeup() -> None:
    for wakeup, caught_up in ((aperf.Wakeup.per_sample(), True),
                              (aperf.Wakeup.balanced(), False)):
        reader, src, _, handle = make(wakeup, caught_up=caught_up)
        assert reader.gather is None  # no gathering: nothing of it runs
        src.write(0, Q.pack(1))
        assert reader.on_ready(handle) == 1


def test_the_threshold_follows_the_wakeup_policy() -> None:
    src = CaughtUpSource()
    assert gather_threshold(src, aperf.Wakeup.balanced(), 1 << 20) == 1 << 18
    assert gather_threshold(src, aperf.Wakeup.throughput(), 1 << 20) == 1 << 19
    assert gather_threshold(src, aperf.Wakeup.watermark(1000), 1 << 20) == 1000
    assert gather_threshold(src, aperf.Wakeup.every(10), 1 << 20) == 1 << 18
    assert gather_threshold(src, aperf.Wakeup.per_sample(), 1 << 20) == 0


def test_drain_gathered_takes_what_waits_for_the_timer() -> None:
    reader, src, _, handle = make(aperf.Wakeup.balanced())
    src.write(0, Q.pack(1))
    assert reader.on_ready(handle) == 0
    assert reader.drain_gathered() == 1 and not gathering(reader)
    assert reader.drain_gathered() == 0


def test_wakeups_are_held_back_while_records_flow_and_passed_again_when_idle() -> None:
    reader, src, clock, handle = make(aperf.Wakeup.balanced())
    assert isinstance(src, CaughtUpSource)
    calls = src.hushes
    src.write(0, Q.pack(0))
    assert reader.on_ready(handle) == 0
    assert calls == [(handle, True)] and hushed(reader) == {0}
    src.write(0, Q.pack(1))
    clock.now = reader.deadline
    assert reader.tick() == 2  # records flow: the ticks take them, still held back
    assert calls == [(handle, True)]
    clock.now = reader.deadline
    assert reader.tick() == 0  # an empty drain: wakeups again, for the next record
    assert calls == [(handle, True), (handle, False)] and not hushed(reader)


def test_a_sizeable_drain_passes_wakeups_again() -> None:
    reader, src, clock, handle = make(aperf.Wakeup.watermark(256))
    assert isinstance(src, CaughtUpSource)
    src.write(0, Q.pack(0))
    assert reader.on_ready(handle) == 0
    for i in range(1, 5):  # 80 bytes in all: a quarter of the threshold or more
        src.write(0, Q.pack(i))
    clock.now = reader.deadline
    assert reader.tick() == 5
    assert [hushed for _, hushed in src.hushes] == [True, False]


def test_a_wakeup_long_after_the_last_drain_is_read_at_once() -> None:
    # Rare wakeups cost no more drains than the timer's: read them at once.
    reader, src, clock, handle = make(aperf.Wakeup.balanced())
    clock.now += 0.0015  # the last drain (at open) is more than max_latency ago
    src.write(0, Q.pack(0))
    assert reader.on_ready(handle) == 1 and not gathering(reader)
    clock.now += 0.0002  # 0.2 ms after that drain: gathered until 1 ms after it
    src.write(0, Q.pack(1))
    assert reader.on_ready(handle) == 0 and gathering(reader) == {0}
    assert reader.deadline is not None and reader.deadline <= clock.now - 0.0002 + 0.001 + 1e-9
