"""The reader's policy on a fake source and a fake clock: backpressure, the drain
clock, exact losses, decode errors, dispatch and put-back, broken rings."""

from __future__ import annotations

import gc
import os
import struct
from typing import Any

import pytest

import aperf
import aperf.abc
from aperf._reading.callbacks import Handlers
from aperf._reading.reader import Reader
from aperf._rings.perf.fake import _FakeRing
from aperf._rings.seam import RingConfig
from aperf.testing import FakeRingSource

from ..helpers import FakeClock, fake_reader

Q = struct.Struct("<Q")


def make(
    cpus: list[int] | None = None,
    *,
    ring_bytes: int = 4096,
    wakeup: aperf.Wakeup | None = None,
    exact_lost: bool = True,
    **kwargs: Any,
) -> tuple[Reader, FakeRingSource, FakeClock]:
    src = FakeRingSource(cpus=cpus or [0, 1], ring_bytes=ring_bytes, exact_lost=exact_lost)
    reader, clock = fake_reader(src, wakeup, **kwargs)
    return reader, src, clock


def seqs(events: list[Any]) -> list[tuple[int, int]]:
    return [(e.cpu, Q.unpack_from(e.data)[0]) for e in events]


def fd(src: FakeRingSource, cpu: int) -> int:
    return src._rings[cpu].handle


def test_pauses_when_full_and_resumes_by_draining_every_ring() -> None:
    reader, src, _ = make(max_pending=10)
    for i in range(12):
        src.write(0, Q.pack(i))
    assert reader.on_ready(fd(src, 0)) == 12  # one span is taken whole
    src.write(1, Q.pack(100))
    assert reader.on_ready(fd(src, 1)) == 0 and reader.paused  # full: the ring keeps its data
    assert src.pending_bytes(1) > 0
    assert seqs(reader.take(8)) == [(0, i) for i in range(8)]
    # Below the low-water mark: CPU 1 is drained without a wakeup of its own.
    rest = reader.take(100)
    assert seqs(rest) == [(0, 8), (0, 9), (0, 10), (0, 11), (1, 100)]
    stats = reader.statistics()
    assert stats.samples == 13 and stats.wakeups == 2 and not stats.paused


@pytest.mark.parametrize("cpus", [[0, 1], [0, 1, 2]])
def test_every_ring_gets_its_turn_while_the_consumer_never_yields(cpus: list[int]) -> None:
    # A consumer busy with its events never lets its loop run: no wakeup, no tick, only
    # its takes drain the rings, and every ring fills between two of them. One ring's
    # drain takes more than the queue holds (128 records, max_pending 100), so each
    # pass fills the queue before it reaches the next ring. Before the fix every pass
    # went in key order: CPU 0 was drained each time and the others never again (each
    # stalled for good, its drops counted as the queue's).
    reader, src, _ = make(cpus, max_pending=100)
    written = dict.fromkeys(cpus, 0)
    got = dict.fromkeys(cpus, 0)
    late = dict.fromkeys(cpus, 0)  # what each ring delivered in the last quarter of the run
    seq = 0
    for round_ in range(400):
        for cpu in cpus:  # the producers, flat out: each ring filled
            while src.write(cpu, Q.pack(seq)):
                written[cpu] += 1
                seq += 1
        for event in reader.take(16):
            if isinstance(event, aperf.Sample):
                got[event.cpu] += 1
                late[event.cpu] += round_ >= 300
    assert all(late.values()), late  # every ring is still read at the end of the run
    total = sum(got.values())
    assert all(n * len(cpus) >= total // 2 for n in got.values()), got  # each a fair share
    reader.close()
    for event in reader.take(1 << 20):
        if isinstance(event, aperf.Sample):
            got[event.cpu] += 1
    stats = reader.statistics()
    assert stats.samples == sum(got.values()) == sum(written.values())  # all that fitted
    for cpu in cpus:
        ring = next(c for c in stats.cpus if c.cpu == cpu)
        assert ring.samples == got[cpu]
        assert ring.samples + ring.lost == written[cpu] + src.dropped(cpu)  # exact


def test_every_ring_gets_its_turn_at_the_ticks_that_look_only_at_busy_rings() -> None:
    # The same fairness when the drain timer does the draining: a tick that finds the queue
    # below its bound looks only at the rings that hold something (or that the reader owes
    # a drain), and takes the refused ones first, as a pass over every ring does. Each
    # ring's span (128 records) is more than the queue holds, so a tick in key order would
    # drain CPU 0 each time and leave the others stalled.
    cpus = [0, 1, 2]
    wakeup = aperf.Wakeup.watermark(1 << 20, max_latency=0.002, idle_latency=None)
    reader, src, clock = make(cpus, max_pending=100, wakeup=wakeup)
    got = dict.fromkeys(cpus, 0)
    late = dict.fromkeys(cpus, 0)
    seq = 0
    for round_ in range(200):
        for cpu in cpus:
            while src.write(cpu, Q.pack(seq)):
                seq += 1
        for event in reader.take(40):  # stays above the low-water mark: no pass over all
            if isinstance(event, aperf.Sample):
                got[event.cpu] += 1
                late[event.cpu] += round_ >= 150
        clock.now = reader.deadline if reader.deadline is not None else clock.now + 0.002
        reader.tick()
    assert all(late.values()), late
    total = sum(got.values())
    assert all(n * len(cpus) >= total // 2 for n in got.values()), got


def test_a_broken_ring_is_a_failure_in_order_and_stops_being_watched() -> None:
    reader, src, _ = make(max_pending=100)
    src.write(0, b"fine")
    src.inject(0, struct.pack("<IHH", 9, 0, 0) + bytes(8))
    reader.on_ready(fd(src, 0))
    assert [e.data for e in reader.take(10)] == [b"fine"]
    with pytest.raises(aperf.BrokenRingError, match="CPU 0"):
        reader.take(10)
    assert reader.statistics().cpus[0].broken
    assert not reader.watches(fd(src, 0)) and reader.watches(fd(src, 1))
    src.write(1, b"other cpu")
    reader.on_ready(fd(src, 1))
    assert [e.data for e in reader.take(10)] == [b"other cpu\0\0\0"]


def test_put_back_keeps_order_in_the_one_front_queue() -> None:
    reader, src, _ = make()
    for i in range(5):
        src.write(0, Q.pack(i))
    reader.flush()
    batch = reader.take(3)
    reader.put_back(batch[1:])
    assert reader.statistics().pending == 4
    assert [s for _, s in seqs(reader.take(10))] == [1, 2, 3, 4]
    assert reader.statistics().pending == 0


def test_drain_clock_relaxes_when_idle_and_tightens_on_traffic() -> None:
    wakeup = aperf.Wakeup.watermark(1 << 20, max_latency=0.002, idle_latency=0.2, idle_after=1.0)
    reader, src, clock = make(wakeup=wakeup)
    assert reader.deadline == pytest.approx(100.002)
    for _ in range(499):  # 0.998 s of ticks that find nothing
        clock.now = reader.deadline
        assert reader.tick() == 0
    assert reader.period(clock.now) == 0.002
    clock.now = reader.deadline + 0.01
    reader.tick()
    assert reader.period(clock.now) == 0.2 and reader.deadline == pytest.approx(clock.now + 0.2)
    # A sample below the watermark wakes nobody; the idle tick finds it, then the
    # clock is busy again.
    src.write(0, Q.pack(7))
    clock.now = reader.deadline
    assert reader.tick() == 1
    assert reader.period(clock.now) == 0.002
    assert reader.deadline == pytest.approx(clock.now + 0.002)
    # A wakeup while idle pulls a far deadline in at once.
    for _ in range(3):
        clock.now += 0.6
        reader.tick()
    assert reader.period(clock.now) == 0.2
    src.write(1, Q.pack(8))
    reader.on_ready(fd(src, 1))
    assert reader.deadline == pytest.approx(clock.now + 0.002)


def test_the_look_after_an_arm_drains_its_rings_and_what_it_finds_is_traffic() -> None:
    # The look a driver takes once its loop armed a handle (an arm may take a wakeup):
    # no wakeup is counted, and samples found keep the drain clock busy, as a tick's do
    # (else a stream whose first samples only the look found went idle, and its timer
    # came back in idle_latency instead of finding the queue full).
    wakeup = aperf.Wakeup.watermark(1 << 20, max_latency=0.002, idle_latency=60, idle_after=0.01)
    reader, src, clock = make(wakeup=wakeup)
    clock.now += 0.05  # the loop armed the handles late: past idle_after
    assert reader.look(fd(src, 0)) == 0 and reader.period(clock.now) == 60
    src.write(0, Q.pack(1))
    src.write(1, Q.pack(2))
    assert reader.look(fd(src, 0)) == 1  # that handle's rings only
    assert reader.period(clock.now) == 0.002
    assert reader.deadline is not None and reader.deadline <= clock.now + 0.002
    assert seqs(reader.take(10)) == [(0, 1)]
    assert reader.statistics().wakeups == 0


def test_a_tick_skips_a_ring_its_wakeup_drained_and_keeps_the_bound() -> None:
    reader, src, clock = make(wakeup=aperf.Wakeup.watermark(1 << 20, max_latency=0.002))
    clock.now = reader.deadline  # 100.002: both rings looked at
    reader.tick()
    clock.now += 0.0015
    src.write(0, Q.pack(1))
    reader.on_ready(fd(src, 0))  # ring 0 drained at 100.0035 by its wakeup
    src.write(0, Q.pack(2))  # below the watermark: waits for a look
    src.write(1, Q.pack(3))
    clock.now = reader.deadline  # 100.004
    assert reader.tick() == 1  # ring 1 only: ring 0 was drained 0.5 ms ago
    assert src.pending_bytes(0) > 0
    assert reader.deadline == pytest.approx(100.0035 + 0.002)  # ring 0's own bound
    clock.now = reader.deadline
    assert reader.tick() == 1  # sample 2, max_latency after ring 0's last drain
    assert [s for _, s in seqs(reader.take(10))] == [1, 3, 2]


def test_backpressure_parks_the_timer_and_is_not_idleness() -> None:
    wakeup = aperf.Wakeup.watermark(1 << 20, max_latency=0.002, idle_latency=0.2)
    reader, src, clock = make(cpus=[0], wakeup=wakeup, max_pending=10)
    for i in range(20):
        src.write(0, Q.pack(i))
    clock.now = reader.deadline
    assert reader.tick() == 20
    src.write(0, Q.pack(20))
    clock.now = reader.deadline
    reader.tick()
    assert reader.paused and reader.deadline is None  # parked: no ticks while nobody reads
    clock.now += 5.0
    assert reader.statistics().drain_period == 0.002  # backpressure, not silence
    assert len(reader.take(16)) == 16
    # The next take finds the queue below the low-water mark: resumed, the ring
    # drained without a wakeup, the timer back at max_latency.
    assert [s for _, s in seqs(reader.take(100))] == list(range(16, 21))
    assert not reader.paused and reader.deadline == pytest.approx(clock.now + 0.002)


def test_a_tick_that_finds_the_queue_full_pauses_though_no_ring_is_due() -> None:
    wakeup = aperf.Wakeup.watermark(1 << 20, max_latency=0.002, idle_latency=60, idle_after=0.01)
    reader, src, clock = make(cpus=[0], wakeup=wakeup, max_pending=10)
    for i in range(20):
        src.write(0, Q.pack(i))
    clock.now += 0.001
    assert reader.on_ready(fd(src, 0)) == 20  # one span taken whole: the queue is full
    clock.now += 0.02  # the tick comes late (a loaded machine), past idle_after; the ring
    reader.tick()  # was drained since the tick before (none): not due, but held back
    assert reader.paused and reader.deadline is None  # parked, not idle
    assert reader.statistics().drain_period == 0.002
    assert [s for _, s in seqs(reader.take(100))] == list(range(20))


def test_per_sample_wakeups_need_no_timer() -> None:
    reader, _, _ = make()
    assert reader.deadline is None and reader.statistics().drain_period is None


def test_exact_losses_without_a_trailing_sample_and_no_double_count() -> None:
    reader, src, _ = make(cpus=[0], ring_bytes=256)
    for i in range(10):
        src.write(0, Q.pack(i))  # 24-byte records: 10 fit in 256
    assert [src.write(0, Q.pack(10 + i)) for i in range(5)] == [False] * 5
    assert reader.statistics().lost == 5  # the producer's count, before any notice
    reader.on_ready(fd(src, 0))
    events = reader.take(100)
    assert [type(e).__name__ for e in events] == ["Sample"] * 10 + ["Lost"]
    assert events[-1] == aperf.Lost(0, 5)
    # The lost record the kernel writes later announces the same 5: not reported twice.
    src.write(0, Q.pack(99))
    reader.on_ready(fd(src, 0))
    assert seqs(reader.take(100)) == [(0, 99)]
    assert reader.statistics().lost == 5
    assert reader.lost_counter == "exact"


def test_losses_are_reported_at_close() -> None:
    reader, src, _ = make(cpus=[0], ring_bytes=256, max_pending=1)
    for i in range(20):
        src.write(0, Q.pack(i))
    reader.on_ready(fd(src, 0))  # takes the 10 that fit: over max_pending now
    reader.close()
    events = reader.take(100)
    assert events[-1] == aperf.Lost(0, 10) and len(events) == 11


def test_without_an_exact_count_only_lost_records_count() -> None:
    reader, src, _ = make(cpus=[0], ring_bytes=256, exact_lost=False)
    for i in range(15):
        src.write(0, Q.pack(i))
    reader.on_ready(fd(src, 0))
    assert len(reader.take(100)) == 10
    assert reader.statistics().lost == 0 and reader.lost_counter == "records"
    src.write(0, Q.pack(15))
    reader.on_ready(fd(src, 0))
    assert reader.take(100)[0] == aperf.Lost(0, 5)


def bad_decoder(data: bytes) -> int:
    value = Q.unpack_from(data)[0]
    if value % 3 == 2:
        raise ValueError("not this one")
    return value  # type: ignore[no-any-return]


def bad_build(row: tuple[int]) -> int:
    if row[0] % 3 == 2:
        raise ValueError("not this one")
    return row[0]


@pytest.mark.parametrize("policy", ["item", "skip", "raise"])
@pytest.mark.parametrize("kind", ["callable", "sized", "sized, two lengths"])
def test_decode_error_policies(policy: str, kind: str) -> None:
    # A SizedDecoder decodes a whole run at C speed (decode_many): its build failing on
    # one record raised out of take() whatever the policy. Now that record alone is the
    # decode error, as with any decoder; with two lengths the samples come one by one.
    decoder = bad_decoder if kind == "callable" else aperf.decoders.SizedDecoder(
        "u64", Q, bad_build)
    reader, src, _ = make(decoder=decoder, decode_errors=policy)
    for i in range(6):
        src.write(0, Q.pack(i) + b"x" * 8 * (kind == "sized, two lengths" and i % 2))
    reader.flush()
    events: list[Any] = []
    if policy == "item":
        events = reader.take(100)
        kinds = [type(e).__name__ for e in events]
        assert kinds == ["Sample", "Sample", "BadSample", "Sample", "Sample", "BadSample"]
        assert [e.value for e in events if isinstance(e, aperf.Sample)] == [0, 1, 3, 4]
        bad = events[2]
        assert isinstance(bad.error, aperf.DecodeError) and bad.cpu == 0
        assert Q.unpack_from(bad.data)[0] == 2 and isinstance(bad.error.__cause__, ValueError)
    elif policy == "skip":
        assert [e.value for e in reader.take(100)] == [0, 1, 3, 4]
    else:
        assert [e.value for e in reader.take(100)] == [0, 1]
        with pytest.raises(aperf.DecodeError, match="not this one"):
            reader.take(100)
        assert [e.value for e in reader.take(100)] == [3, 4]
    assert reader.statistics().decode_errors == 2
    # What the errors keep (their causes' tracebacks) holds no view of a ring's span that
    # the collector could not clear: Python before 3.12.7 crashes on one (CPython
    # gh-77894), and an error kept in a cycle with its events is collected that way.
    events = []
    gc.collect()


def test_dispatch_puts_back_what_follows_a_failing_callback() -> None:
    reader, src, _ = make()
    for i in range(6):
        src.write(0, Q.pack(i))
    reader.flush()
    seen: list[int] = []

    def on_sample(event: aperf.Sample[Any]) -> None:
        value = Q.unpack_from(event.data)[0]
        if value == 2 and 2 not in seen:
            seen.append(2)
            raise RuntimeError("boom")
        seen.append(value)

    batch = reader.take(100)
    with pytest.raises(RuntimeError, match="boom"):
        list(reader.dispatch(batch, Handlers(on_sample)))
    assert seen == [0, 1, 2]
    list(reader.dispatch(reader.take(100), Handlers(on_sample)))
    assert seen == [0, 1, 2, 3, 4, 5]


def test_dispatch_yields_awaitables_and_takes_their_failure_back() -> None:
    reader, src, _ = make()
    for i in range(4):
        src.write(0, Q.pack(i))
    reader.flush()

    class Pending:
        def __await__(self) -> Any:
            yield

    pending = reader.dispatch(reader.take(100), Handlers(lambda e: Pending()))
    first = next(pending)
    assert isinstance(first, Pending)
    with pytest.raises(KeyError):
        pending.throw(KeyError("awaited callback failed"))
    assert len(reader.take(100)) == 3  # the three after the failing one


def test_handlers_must_be_callable() -> None:
    with pytest.raises(TypeError, match="on_lost must be callable"):
        Handlers(print, on_lost=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="on_sample must be callable"):
        Handlers("print")  # type: ignore[arg-type]


def drain_events(reader: Reader, how: str, batch: int) -> list[Any]:
    """Every event, taken the way ``batches()`` does (take) or ``async for`` does (fill,
    then one at a time); a DecodeError (policy "raise") as itself, in its place."""
    out: list[Any] = []
    while True:
        try:
            if how == "take":
                got = reader.take(batch)
                if not got:
                    return out
                out.extend(got)
                continue
            if not reader.fill(batch):
                return out
            while True:
                try:
                    out.append(reader.next_event())
                except IndexError:
                    break
        except aperf.DecodeError as exc:
            out.append(exc)


@pytest.mark.parametrize("policy", ["item", "skip", "raise"])
@pytest.mark.parametrize("batch", [1, 3, 256])
def test_fill_builds_the_front_queue_as_take_builds_batches(policy: str, batch: int) -> None:
    # fill() builds straight into the front queue: the same events in the same order as
    # take(), across runs, lost notices, a ring of odd sizes and decode failures.
    def ring_events(how: str) -> list[Any]:
        reader, src, _ = make(cpus=[0, 1], ring_bytes=1024, decoder=bad_decoder,
                              decode_errors=policy)
        for i in range(60):  # ring 0 overflows: a run, the drops, then a run again
            src.write(0, Q.pack(i))
        for i in range(10):  # ring 1: samples of two sizes
            src.write(1, Q.pack(i) + b"x" * (i % 2) * 8)
        reader.flush()
        for i in range(60, 70):
            src.write(0, Q.pack(i))
        reader.flush()
        return [(type(e).__name__, getattr(e, "cpu", None),
                 e.count if isinstance(e, aperf.Lost) else getattr(e, "value", None),
                 str(e) if isinstance(e, Exception) else "")
                for e in drain_events(reader, how, batch)]

    taken, filled = ring_events("take"), ring_events("fill")
    assert filled == taken
    assert {kind for kind, *_ in taken} >= {"Sample", "Lost"}


def test_a_tick_takes_nothing_from_empty_rings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 31 §4: a tick looks at every ring's head but drains only the rings that hold
    something, so an idle ring costs a look, not a drain; what it delivers, and when the
    next tick is due, are as before."""
    from aperf._rings.perf.fake import _FakeRing

    taken: list[int] = []
    take = _FakeRing.take

    def counting(ring: _FakeRing) -> bytes:
        taken.append(ring.key)
        return take(ring)

    monkeypatch.setattr(_FakeRing, "take", counting)
    wakeup = aperf.Wakeup.watermark(1 << 20, max_latency=0.002, idle_latency=None)
    reader, src, clock = make(cpus=list(range(64)), wakeup=wakeup, ring_bytes=1 << 17)
    for _ in range(3):
        clock.now = reader.deadline
        assert reader.tick() == 0
    assert taken == []
    src.write(5, Q.pack(1))
    src.write(40, Q.pack(2))
    clock.now = reader.deadline
    assert reader.tick() == 2 and sorted(taken) == [5, 40]
    assert reader.deadline == pytest.approx(clock.now + 0.002)
    assert seqs(reader.take(10)) == [(5, 1), (40, 2)]
    # A ring drained by its wakeup between ticks is not due at the next one; its own
    # drain time sets the deadline, as before.
    clock.now += 0.0015
    src.write(7, Q.pack(3))
    reader.on_ready(fd(src, 7))
    clock.now = reader.deadline
    taken.clear()
    src.write(7, Q.pack(4))
    assert reader.tick() == 0 and taken == []
    assert reader.deadline == pytest.approx(clock.now - 0.0005 + 0.002)


# --- CPU hotplug (a HotplugSource: tests/kernel/test_hotplug.py does it on the kernel) --


class _Hotplugged(FakeRingSource):
    """Fake rings whose notice (an eventfd) says CPU 1 went offline and CPU 2 came online."""

    def __init__(self) -> None:
        super().__init__(cpus=[0, 1])
        self.notice = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    @property
    def notices(self) -> list[int]:
        return [self.notice]

    def cpus_changed(self) -> tuple[list[int], list[Any]]:
        ring = _FakeRing(2, self.ring_bytes, self._lock, True)
        self._rings[2] = ring
        return [1], [ring]


def test_a_cpu_going_offline_is_drained_then_retired_and_a_new_one_watched() -> None:
    src = _Hotplugged()
    assert isinstance(src, aperf.abc.HotplugSource)
    try:
        rings = src.open(RingConfig(None, aperf.Wakeup.per_sample()))
        reader = Reader(src, rings, wakeup=aperf.Wakeup.per_sample(), clock=FakeClock())
        assert reader.handles() == [fd(src, 0), fd(src, 1), src.notice]
        old = fd(src, 1)
        src.write(1, Q.pack(7))  # written before the CPU went offline: delivered
        assert reader.on_ready(src.notice) == 1
        assert reader.handle_changes() == ([fd(src, 2)], [old])
        assert reader.handle_changes() == ([], [])
        src.write(2, Q.pack(8))
        assert reader.on_ready(fd(src, 2)) == 1
        assert seqs(reader.take(10)) == [(1, 7), (2, 8)]
        assert reader.keys() == [0, 1, 2] and not reader.watches(old)
        stats = {c.cpu: (c.samples, c.broken) for c in reader.statistics().cpus}
        assert stats == {0: (0, False), 1: (1, False), 2: (1, False)}
    finally:
        os.close(src.notice)
