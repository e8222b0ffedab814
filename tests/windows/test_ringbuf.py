"""eBPF for Windows ring buffers on the stand-in DLL: the mapped ring read with aperf's
own ring buffer code (no callback per sample), through the source and PerfStream.

The stand-in's ``fake_ringbuf_*`` exports play the BPF program (bpf_ringbuf_output,
reserve and submit/discard). Exactness: what was written is delivered once, in order.
"""

from __future__ import annotations

import struct
import threading
import types
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

import aperf
from aperf._native.ebpfapi import api as win
from aperf._options import Wakeup
from aperf._rings.ringbuf.format import RINGBUF_RECORDS
from aperf._rings.seam import RingConfig
from aperf._rings.windows.perf import WindowsPerfSource
from aperf._rings.windows.ringbuf import WindowsMapSource, WindowsRingBufferSource

from .conftest import FakeEbpf

pytestmark = pytest.mark.standin
CONFIG = RingConfig(None, Wakeup.per_sample())


def payloads(ring: Any) -> list[bytes]:
    segments, _ = RINGBUF_RECORDS.split(-1, ring.take())
    return [p for segment in segments for p in segment[0]]  # type: ignore[index]


@pytest.fixture
def opened(fake: FakeEbpf, ringbuf_map: int) -> Iterator[tuple[WindowsRingBufferSource, Any]]:
    source = WindowsRingBufferSource(ringbuf_map)
    (ring,) = source.open(CONFIG)
    try:
        yield source, ring
    finally:
        source.free()


def test_one_ring_for_every_cpu_with_the_map_s_wait_handle(
    fake: FakeEbpf, opened: tuple[WindowsRingBufferSource, Any],
) -> None:
    source, ring = opened
    assert ring.key == aperf.NO_CPU and ring.handle == source.wait_handle
    assert source.handle_kind == "win32" and source.records is RINGBUF_RECORDS
    assert source.ring_bytes == 4096 and ring.pending_bytes() == 0


def test_records_come_out_exactly_in_order_and_wrap(
    fake: FakeEbpf, ringbuf_map: int, opened: tuple[WindowsRingBufferSource, Any],
) -> None:
    _, ring = opened
    sent: list[bytes] = []
    for round_ in range(40):  # about 10 rings' worth: records cross the end of the ring
        batch = [bytes([round_]) * (1 + (round_ * 7 + i) % 200) for i in range(5)]
        for data in batch:
            assert fake.ringbuf_output(ringbuf_map, data)
        assert ring.pending_bytes() > 0
        assert payloads(ring) == batch  # exact lengths: no padding
        sent.extend(batch)
    assert ring.pending_bytes() == 0 and payloads(ring) == []


def test_a_locked_record_stops_the_take_and_discarded_ones_are_skipped(
    fake: FakeEbpf, ringbuf_map: int, opened: tuple[WindowsRingBufferSource, Any],
) -> None:
    _, ring = opened
    assert fake.ringbuf_output(ringbuf_map, b"first")
    locked = fake.ringbuf_reserve(ringbuf_map, 6)
    assert fake.ringbuf_output(ringbuf_map, b"behind")
    assert payloads(ring) == [b"first"]  # stops at the locked one, in order
    fake.ringbuf_commit(ringbuf_map, locked, b"second")
    dropped = fake.ringbuf_reserve(ringbuf_map, 4)
    fake.ringbuf_commit(ringbuf_map, dropped, b"gone", discard=True)
    assert fake.ringbuf_output(ringbuf_map, b"last")
    segments, discarded = RINGBUF_RECORDS.split(-1, ring.take())
    assert [p for s in segments for p in s[0]] == [b"second", b"behind", b"last"]  # type: ignore[index]
    assert discarded == 1


def test_the_wait_handle_is_signalled_by_outputs_and_reset_by_acknowledge(
    fake: FakeEbpf, ringbuf_map: int, opened: tuple[WindowsRingBufferSource, Any],
) -> None:
    source, ring = opened
    assert not fake.signalled(ring.handle)
    assert fake.ringbuf_output(ringbuf_map, b"x" * 8)
    assert fake.signalled(ring.handle)  # manual reset: it stays signalled
    source.acknowledge(ring.handle)
    assert not fake.signalled(ring.handle)
    assert fake.ringbuf_output(ringbuf_map, b"y" * 8)  # after the reset, before the take
    assert payloads(ring) == [b"x" * 8, b"y" * 8]
    assert fake.signalled(ring.handle)  # so the next wait returns at once: nothing is lost


def test_no_callback_runs_per_sample(
    fake: FakeEbpf, ringbuf_map: int, monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []
    monkeypatch.setattr(win, "_never_called", lambda *args: calls.append(1) or -1)
    source = WindowsRingBufferSource(ringbuf_map)
    (ring,) = source.open(CONFIG)
    try:
        got = []
        for _ in range(50):
            for i in range(100):
                assert fake.ringbuf_output(ringbuf_map, struct.pack("<Q", i))
            got.extend(payloads(ring))
        assert len(got) == 5000 and calls == []
    finally:
        source.free()


def test_a_full_ring_drops_and_the_bpf_count_reports_it(fake: FakeEbpf, ringbuf_map: int) -> None:
    failed = [0]
    source = WindowsRingBufferSource(ringbuf_map, dropped=lambda: failed[0])
    (ring,) = source.open(CONFIG)
    try:
        written = 0
        for i in range(300):  # 16-byte records: 256 fit in 4 KiB
            if fake.ringbuf_output(ringbuf_map, struct.pack("<Q", i)):
                written += 1
            else:
                failed[0] += 1
        assert written == 256 and failed[0] == 44
        assert ring.lost_total() == 44
        assert [struct.unpack("<Q", p)[0] for p in payloads(ring)] == list(range(256))
    finally:
        source.free()


@pytest.mark.parametrize("fixed", [False, True], ids=["issue-5206", "fixed-dll"])
def test_freeing_leaks_no_wait_event_while_the_map_lives(
    fake: FakeEbpf, ringbuf_map: int, fixed: bool
) -> None:
    # eBPF for Windows #5206, as for perf buffers (test_source.py): ring_buffer__free's
    # clearing of the wait handle fails in kernel mode; aperf parks the ring first.
    fake.set_fixed_5206(fixed)
    try:
        for _ in range(3):
            source = WindowsRingBufferSource(ringbuf_map)
            source.open(CONFIG)
            source.free()
            assert fake.leaked_events() == 0  # and the map is still open
        source = WindowsRingBufferSource(ringbuf_map)
        (ring,) = source.open(CONFIG)
        try:
            assert fake.ringbuf_output(ringbuf_map, b"after")
            assert win.wait_one(ring.handle, 1000) and payloads(ring) == [b"after"]
        finally:
            source.free()
    finally:
        fake.set_fixed_5206(False)


def test_bad_maps_and_sizes_are_typed_errors(
    fake: FakeEbpf, ringbuf_map: int, perf_map: int,
) -> None:
    with pytest.raises(aperf.MapTypeError, match="BPF_MAP_TYPE_RINGBUF"):
        WindowsRingBufferSource(perf_map).open(CONFIG)
    with pytest.raises(aperf.RingSizeError, match="max_entries"):
        WindowsRingBufferSource(ringbuf_map).open(RingConfig(8192, Wakeup.per_sample()))
    with pytest.raises(TypeError):
        WindowsRingBufferSource(ringbuf_map, dropped=3)  # type: ignore[arg-type]
    source = WindowsRingBufferSource(ringbuf_map)
    source.open(CONFIG)
    try:
        with pytest.raises(aperf.BusyResourceError):
            WindowsRingBufferSource(ringbuf_map).open(CONFIG)  # a second reader of the map
    finally:
        source.free()
    source.free()  # idempotent


def test_a_pinned_ring_buffer_and_the_source_picked_by_type(
    fake: FakeEbpf, ringbuf_map: int, perf_map: int,
) -> None:
    fake.pin(ringbuf_map, "/ebpf/global/aperf_ringbuf")
    by_type = WindowsMapSource("/ebpf/global/aperf_ringbuf")
    (ring,) = by_type.open(CONFIG)
    try:
        assert isinstance(by_type._chosen, WindowsRingBufferSource)
        assert by_type.records is RINGBUF_RECORDS and by_type.ring_bytes == 4096
        assert fake.ringbuf_output(ringbuf_map, b"pinned")
        by_type.acknowledge(ring.handle)
        assert payloads(ring) == [b"pinned"]
    finally:
        by_type.free()
    perf = WindowsMapSource(perf_map)
    rings = perf.open(CONFIG)
    try:
        assert isinstance(perf._chosen, WindowsPerfSource) and len(rings) == 2
    finally:
        perf.free()


@pytest.fixture
def on_windows(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(aperf._drivers.setup, "sys", types.SimpleNamespace(platform="win32"))
    yield


@pytest.mark.anyio
async def test_perf_stream_reads_a_ring_buffer_as_it_fills(
    fake: FakeEbpf, ringbuf_map: int, on_windows: None,
) -> None:
    n = 20_000  # into a 4 KiB ring: the producer retries when it is full, nothing is lost
    seq = struct.Struct("<Q8x")

    def produce() -> None:
        for i in range(n):
            while not fake.ringbuf_output(ringbuf_map, seq.pack(i)):
                threading.Event().wait(0.0005)

    got: list[int] = []
    async with aperf.PerfStream(ringbuf_map, decoder=seq) as stream:
        assert isinstance(stream._options.source._chosen, WindowsRingBufferSource)  # type: ignore[attr-defined]
        assert stream.cpus == [aperf.NO_CPU]
        thread = threading.Thread(target=produce)
        thread.start()
        with anyio.fail_after(30):
            async for event in stream:
                assert isinstance(event, aperf.Sample) and event.cpu == aperf.NO_CPU
                got.append(event.value[0])
                if len(got) == n:
                    break
        await anyio.to_thread.run_sync(thread.join)
        stats = stream.statistics()
    assert got == list(range(n))
    assert stats.samples == n and stats.lost == 0 and stats.lost_counter == "none"
