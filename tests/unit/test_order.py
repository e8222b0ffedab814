"""Ordered streams (``order_by=``) on a fake source and a fake clock: the watermark, idle
rings, lateness, late events, the memory bound, lost notices in place, the arguments."""

from __future__ import annotations

import ctypes
import struct
from types import SimpleNamespace
from typing import Any

import pytest

import aperf
from aperf._reading.order import Orderer, check_order_by
from aperf._reading.reader import Reader
from aperf.testing import FakeRingSource

from ..helpers import FakeClock, fake_reader

QQ = struct.Struct("<QQ")


class Ev(ctypes.Structure):
    _fields_ = [("seq", ctypes.c_uint64), ("ts", ctypes.c_uint64)]


def make(
    *, ring_bytes: int = 1 << 16, lateness: float = 0.1, **kwargs: Any
) -> tuple[Reader, FakeRingSource, FakeClock]:
    src = FakeRingSource(cpus=[0, 1], ring_bytes=ring_bytes)
    decoder = aperf.decoders.from_ctypes(Ev)
    reader, clock = fake_reader(src, decoder=decoder, order_by=check_order_by("ts", decoder),
                                order_field="ts", lateness=lateness, **kwargs)
    return reader, src, clock


def write(src: FakeRingSource, cpu: int, *stamps: int) -> None:
    for ts in stamps:
        assert src.write(cpu, QQ.pack(cpu * 1000 + ts, ts))


def take(reader: Reader, count: int = 100) -> list[Any]:
    """What a driver does: its wakeups drain the rings, then the consumer takes."""
    reader.drain_all()
    return reader.take(count)


def take_arrays(reader: Reader) -> list[Any]:
    reader.drain_all()
    return reader.take_arrays()


def stamps(events: list[Any]) -> list[int]:
    return [e.value.ts for e in events]


def test_a_busy_ring_holds_the_others_back_until_it_has_passed_them() -> None:
    reader, src, _ = make()
    write(src, 0, 1, 3, 5)
    write(src, 1, 2, 4)
    # Both rings gave samples at this look: CPU 1 may still bring one after 4.
    assert stamps(take(reader, 100)) == [1, 2, 3, 4]
    assert reader.pending == 1 and reader.statistics().pending == 1
    # Next look: both empty, idle: nothing holds 5 back.
    assert stamps(take(reader, 100)) == [5]
    assert reader.pending == 0 and reader.statistics().late == 0


def test_an_idle_ring_does_not_hold_the_others_back() -> None:
    reader, src, _ = make()
    write(src, 0, 7, 8, 9)
    assert stamps(take(reader, 100)) == [7, 8, 9]  # CPU 1 was seen empty


def test_lateness_releases_then_a_late_event_is_delivered_flagged_and_counted() -> None:
    reader, src, clock = make(lateness=0.1)
    write(src, 0, 1, 10)
    write(src, 1, 2)
    assert stamps(take(reader, 100)) == [1, 2]
    for _ in range(3):  # CPU 1 stays busy at 2: 10 waits
        write(src, 1, 2)
        assert stamps(take(reader, 100)) == [2]
    assert reader.pending == 1 and reader.deadline is not None
    clock.now += 0.1  # held for `lateness`: released whatever the rings say
    write(src, 1, 2)
    assert stamps(take(reader, 100)) == [2, 10]
    write(src, 1, 3)  # below 10, already released: late
    late = take(reader, 100)
    assert stamps(late) == [3] and late[0].late and late[0].map is None
    assert isinstance(late[0], aperf.Sample) and late[0] == (1, late[0].data, late[0].value)
    stats = reader.statistics()
    assert stats.late == 1 and [c.late for c in stats.cpus] == [0, 1]
    assert stats.samples == 8 and reader.pending == 0


def test_a_tick_wakes_the_consumer_once_held_events_can_go() -> None:
    reader, src, _ = make(lateness=0.1)
    write(src, 0, 1, 5)
    write(src, 1, 2)
    assert stamps(take(reader, 100)) == [1, 2]
    assert not reader.has_events() and reader.deadline is not None  # 5 waits: a timer
    # Nothing new: at the tick both rings are seen empty, so 5 can go.
    assert reader.tick() >= 1 and reader.has_events()
    assert stamps(take(reader, 100)) == [5]
    assert reader.deadline is None  # nothing held, no timer (per-sample wakeups)


def test_a_tick_never_leaves_the_deadline_in_the_past_while_the_consumer_waits() -> None:
    reader, src, clock = make(lateness=0.1)
    write(src, 0, 1, 5)
    write(src, 1, 2)
    assert stamps(take(reader, 100)) == [1, 2]  # 5 is held: CPU 1 was busy
    clock.now += 1.0  # the consumer does something else: 5 held ten times `lateness`
    for _ in range(3):
        # The driver runs the timer at its deadline: it found 5 releasable and woke the
        # consumer; it looks again a period later, not at once, again and again (that
        # froze trio before issue 28).
        assert reader.tick() >= 1 and reader.has_events()
        assert reader.deadline is not None and reader.deadline > clock.now
        clock.now += 0.001
    assert stamps(take(reader, 100)) == [5] and reader.statistics().late == 0


def test_everything_queued_is_ordered_at_once() -> None:
    reader, src, clock = make()
    write(src, 1, *range(600))  # CPU 1 first: the earlier stamps
    write(src, 0, *range(600, 1200))
    reader.drain_all()  # both rings queued, CPU 0's in front: more than a batch of each
    assert reader.pending == 1200
    out: list[Any] = []
    while len(out) < 1200:
        batch = reader.take(100)
        assert batch  # no take waits for `lateness` (before issue 28 the first ones did:
        out.extend(batch)  # 100 of CPU 0's built, CPU 1's raw held everything back)
    assert stamps(out) == list(range(1200)) and not any(e.late for e in out)
    assert reader.statistics().late == 0 and reader.pending == 0 and clock.now == 100.0


def test_a_decode_error_under_raise_comes_once_and_loses_nothing() -> None:
    def picky(data: bytes) -> Any:
        seq, ts = QQ.unpack(data[:16])
        if ts == 3:
            raise ValueError("not this one")
        return SimpleNamespace(seq=seq, ts=ts)

    src = FakeRingSource(cpus=[0, 1], ring_bytes=1 << 16)
    reader, _ = fake_reader(src, decoder=picky, decode_errors="raise",
                            order_by=check_order_by("ts", picky), order_field="ts")
    write(src, 0, 1, 3, 5)
    write(src, 1, 2, 4)
    reader.drain_all()
    got: list[Any] = []
    errors = []
    for _ in range(4):
        try:
            got.extend(reader.take(100))
        except aperf.DecodeError as exc:
            errors.append(exc)
    assert stamps(got) == [1, 2, 4, 5] and len(errors) == 1 and errors[0].cpu == 0
    assert reader.pending == 0 and reader.statistics().decode_errors == 1


def test_held_events_count_against_max_pending() -> None:
    reader, src, clock = make(max_pending=10)
    write(src, 0, *range(10, 30))
    write(src, 1, 0)
    # CPU 0's 20 fill the queue: CPU 1 is held back, unseen, so they wait for it.
    assert take(reader, 100) == [] and reader.pending == 20 and reader.paused
    assert reader.statistics().pending == 20
    write(src, 0, 30)
    assert reader.on_ready(src._rings[0].handle) == 0  # held back too
    assert reader.deadline is not None
    clock.now += 0.1  # after `lateness` they go: the memory bound wins
    assert stamps(take(reader, 100)) == list(range(10, 30))
    out = take(reader, 100)  # then CPU 1's sample, now late; nothing dropped
    assert stamps(out) == [0, 30] and out[0].late and not out[1].late
    stats = reader.statistics()
    assert stats.late == 1 and stats.lost == 0 and stats.samples == 22
    assert reader.pending == 0 and not reader.paused


def test_a_lost_notice_keeps_its_place_behind_its_rings_sample() -> None:
    reader, src, _ = make(ring_bytes=4096)
    ts = 0
    while src.write(0, QQ.pack(ts, ts * 2)):
        ts += 1
    assert not src.write(0, QQ.pack(ts, ts * 2))
    write(src, 1, 1, 2 * ts - 1)  # CPU 1's samples fall among CPU 0's
    events = []
    while reader.has_events() or reader.pending or not events:
        events.extend(take(reader, 1000))
    assert src.write(0, QQ.pack(999, 2 * ts + 10))  # the lost record goes in front of it
    events.extend(take(reader, 1000))
    events.extend(take(reader, 1000))
    kinds = [type(e).__name__ for e in events]
    lost = kinds.index("Lost")
    assert events[lost].count == 2 and reader.statistics().lost == 2
    samples = [e for e in events if isinstance(e, aperf.Sample)]
    assert stamps(samples) == sorted(stamps(samples))
    # Behind the last sample CPU 0 gave before the drops (2 * (ts - 1)), before the next.
    assert stamps(events[lost - 1 : lost]) == [2 * (ts - 1)]
    assert stamps(events[lost + 1 :]) == [2 * ts - 1, 2 * ts + 10]


def test_the_orderer_alone_sorts_batches_and_flags_late_ones() -> None:
    orderer = Orderer(lambda sample: sample.value, lateness=1.0)
    orderer.add(0, [aperf.Sample(0, b"", 3), aperf.Sample(0, b"", 6)], 0.0)
    orderer.add(1, [aperf.Sample(1, b"", 1), aperf.Lost(1, 4), aperf.Sample(1, b"", 9)], 0.0)
    orderer.looked(0, False)
    orderer.looked(1, True)
    out = orderer.release(0.0)
    assert out == [(1, b"", 1), (1, 4), (0, b"", 3), (0, b"", 6)]  # held: 9
    assert orderer.count == 1 and orderer.deadline() is not None
    orderer.add(0, [aperf.Sample(0, b"", 2)], 0.5)
    out = orderer.release(0.5)
    assert out == [(0, b"", 2)] and out[0].late and orderer.late == {0: 1}
    assert orderer.release(1.0) == [(1, b"", 9)]  # held for lateness


def test_arrays_are_merged_across_rings_with_a_cpu_per_row() -> None:
    pytest.importorskip("numpy")
    reader, src, _ = make()
    write(src, 0, 1, 3, 5)
    write(src, 1, 2, 4)
    first = take_arrays(reader)
    assert len(first) == 1 and first[0].cpu == -1
    assert first[0].values["ts"].tolist() == [1, 2, 3, 4]
    assert first[0].cpus.tolist() == [0, 1, 0, 1]
    assert first[0].values["seq"].tolist() == [1, 1002, 3, 1004]
    rest = take_arrays(reader)
    assert rest[0].cpu == 0 and rest[0].cpus is None and rest[0].values["ts"].tolist() == [5]
    write(src, 1, 0)
    late = take_arrays(reader)
    assert late[0].late and late[0].values["seq"].tolist() == [1000]
    assert reader.statistics().late == 1 and reader.pending == 0
    # A per-item consumer after a columnar one gets the same rows as events.
    write(src, 0, 6, 7)
    write(src, 1, 8)
    take_arrays(reader)
    assert stamps(take(reader, 10)) == [8] or reader.pending == 0


def test_arguments_are_checked_with_typed_errors() -> None:
    src = FakeRingSource(cpus=[0])
    with pytest.raises(aperf.ArgumentError, match="order_by"):
        aperf.PerfBuffer(src, on_sample=print, order_by="ts")
    with pytest.raises(aperf.ArgumentError, match=r"no field 'nope'.*seq, ts") as info:
        aperf.PerfStream(src, decoder=Ev, order_by="nope")
    assert isinstance(info.value, ValueError) and info.value.argument == "order_by"
    with pytest.raises(aperf.ArgumentError, match="not a field name"):
        aperf.PerfStream(src, decoder=Ev, order_by="1st")
    with pytest.raises(TypeError, match="order_by"):
        aperf.PerfStream(src, decoder=Ev, order_by=3)  # type: ignore[call-overload]
    for bad in (0, -1.0, float("inf"), "1", True):
        with pytest.raises(aperf.ArgumentError, match="lateness"):
            aperf.PerfStream(src, decoder=Ev, order_by="ts", lateness=bad)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="callable"):
        aperf.PerfBuffer(src, decoder=Ev, on_array=print, order_by=lambda s: s.value.ts)


def test_arrays_keep_a_lost_notice_behind_its_rings_rows() -> None:
    pytest.importorskip("numpy")
    reader, src, _ = make(ring_bytes=4096)
    ts = 0
    while src.write(0, QQ.pack(ts, ts)):
        ts += 1
    assert not src.write(0, QQ.pack(ts, ts))  # dropped, counted
    items = take_arrays(reader)
    assert src.write(0, QQ.pack(999, 1000))  # the lost record goes in front of it
    items += take_arrays(reader)
    items += take_arrays(reader)
    kinds = [type(i).__name__ for i in items]
    lost = kinds.index("Lost")
    rows = [r for i in items[:lost] if isinstance(i, aperf.SampleArray)
            for r in i.values["ts"].tolist()]
    after = [r for i in items[lost + 1 :] if isinstance(i, aperf.SampleArray)
             for r in i.values["ts"].tolist()]
    assert rows == list(range(ts)) and after == [1000] and items[lost].count == 2
    assert reader.pending == 0 and reader.statistics().lost == 2
