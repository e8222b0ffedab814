"""The eBPF for Windows ring source on the stand-in DLL: records, losses, the wait
handle's reset semantics, and the order in which things are freed."""

from __future__ import annotations

import struct

import pytest

import aperf
from aperf._native.ebpfapi import api as win
from aperf._options import Wakeup
from aperf._rings.seam import RingConfig
from aperf._rings.windows.perf import WINDOWS_RECORDS, WindowsPerfSource

from .conftest import BPF_MAP_TYPE_RINGBUF, FakeEbpf

pytestmark = pytest.mark.standin


CONFIG = RingConfig(None, Wakeup.per_sample())


def payload(seq: int, size: int = 24) -> bytes:
    return struct.pack("<Q", seq).ljust(size, b"x")


def records(ring: object) -> list[bytes | int]:
    """What one take() held: sample bytes and lost counts, in order."""
    out: list[bytes | int] = []
    segments, other = WINDOWS_RECORDS.split(0, ring.take())  # type: ignore[attr-defined]
    assert other == 0
    for segment in segments:
        if isinstance(segment, int):
            out.append(segment)
        else:
            out.extend(segment[0])
    return out


def test_rings_are_the_cpus_and_share_one_wait_handle(fake: FakeEbpf, perf_map: int) -> None:
    source = WindowsPerfSource(perf_map)
    rings = source.open(CONFIG)
    try:
        assert [r.key for r in rings] == [0, 1]
        assert len({r.handle for r in rings}) == 1
        assert source.handle_kind == "win32"
        assert source.ring_bytes == 4096  # the map's max_entries
        assert source.memory_bytes == 2 * 4096
    finally:
        source.free()


def test_take_copies_records_exactly_in_order(fake: FakeEbpf, perf_map: int) -> None:
    source = WindowsPerfSource(perf_map)
    ring0, ring1 = source.open(CONFIG)
    try:
        sent = [payload(i, size=1 + i) for i in range(20)]  # odd sizes: no padding added
        for p in sent:
            assert fake.output(perf_map, 0, p)
        fake.output(perf_map, 1, b"one")
        assert records(ring0) == sent
        assert records(ring1) == [b"one"]
        assert ring0.take() == b""  # the space was released
        assert ring0.pending_bytes() == 0  # unknown without the mapping
    finally:
        source.free()


def test_the_wait_handle_stays_signalled_until_acknowledged(fake: FakeEbpf, perf_map: int) -> None:
    source = WindowsPerfSource(perf_map)
    ring0, _ = source.open(CONFIG)
    handle = ring0.handle
    try:
        assert not fake.signalled(handle)
        fake.output(perf_map, 0, b"a")
        assert fake.signalled(handle)
        ring0.take()
        assert fake.signalled(handle), "reading does not reset a manual-reset event"
        source.acknowledge(handle)
        assert not fake.signalled(handle)
        # Reset before reading: a record written after the reset signals it again.
        fake.output(perf_map, 0, b"b")
        assert fake.signalled(handle)
        assert records(ring0) == [b"b"]
    finally:
        source.free()


def test_losses_come_from_the_producer_page_in_front_of_the_records(
    fake: FakeEbpf,
) -> None:
    fd = fake.create_map(1024, cpus=1)  # 1024 bytes: 32 records of 24 + 8 bytes
    source = WindowsPerfSource(fd)
    (ring,) = source.open(CONFIG)
    try:
        results = [fake.output(fd, 0, payload(i)) for i in range(50)]
        written, dropped = results.count(True), results.count(False)
        assert (written, dropped) == (32, 18)
        assert fake.lost(fd, 0) == 18
        got = records(ring)
        assert got[0] == 18  # the lost callback runs first
        assert got[1:] == [payload(i) for i in range(32)]
        assert ring.lost_total() == 18
        # The count only grows; what was reported is not reported again.
        assert fake.output(fd, 0, payload(99))
        assert records(ring) == [payload(99)]
        assert ring.lost_total() == 18
    finally:
        source.free()
        fake.close(fd)


def test_losses_before_open_are_not_reported(fake: FakeEbpf) -> None:
    fd = fake.create_map(64, cpus=1)
    for i in range(5):
        fake.output(fd, 0, payload(i))
    assert fake.lost(fd, 0) == 3  # two 32-byte records fit
    source = WindowsPerfSource(fd)
    (ring,) = source.open(CONFIG)
    try:
        assert records(ring) == [payload(0), payload(1)]
        assert ring.lost_total() == 0
    finally:
        source.free()
        fake.close(fd)


def test_free_releases_buffer_handle_and_fd_in_order(fake: FakeEbpf, perf_map: int) -> None:
    handles, fds = fake.open_handles(), fake.open_fds()
    source = WindowsPerfSource(perf_map)
    (ring0, _) = source.open(CONFIG)
    assert fake.open_handles() == handles + 1  # the perf buffer's wait handle
    assert fake.open_fds() == fds + 1  # our own duplicate of the map fd
    assert fake.live_buffers() >= 1
    source.free()
    source.free()  # idempotent
    assert fake.open_handles() == handles
    assert fake.open_fds() == fds
    with pytest.raises(aperf.ClosedResourceError):
        ring0.take()
    source.acknowledge(ring0.handle)  # a late reset after free touches nothing


@pytest.mark.parametrize("fixed", [False, True], ids=["issue-5206", "fixed-dll"])
def test_freeing_leaks_no_wait_event_while_the_map_lives(
    fake: FakeEbpf, perf_map: int, fixed: bool
) -> None:
    # eBPF for Windows #5206: perf_buffer__free clears the rings' wait handle with
    # ebpf_handle_invalid, which fails in kernel mode, so the kernel kept a reference to
    # the buffer's event (closed by the free) until the map went away. aperf parks the
    # rings on an event of its own first: nothing leaks, whether or not the DLL is fixed.
    fake.set_fixed_5206(fixed)
    try:
        for _ in range(3):
            source = WindowsPerfSource(perf_map)
            source.open(CONFIG)
            source.free()
            assert fake.leaked_events() == 0  # and the map is still open
        # The next reader's wait handle is signalled by what the program writes.
        source = WindowsPerfSource(perf_map)
        ring0, ring1 = source.open(CONFIG)
        try:
            assert fake.output(perf_map, 1, payload(7))
            assert win.wait_one(ring0.handle, 1000) and records(ring1) == [payload(7)]
        finally:
            source.free()
    finally:
        fake.set_fixed_5206(False)


def test_pinned_path_and_map_type(fake: FakeEbpf, perf_map: int) -> None:
    fake.pin(perf_map, "/ebpf/global/aperf_events")
    source = WindowsPerfSource("/ebpf/global/aperf_events")
    rings = source.open(CONFIG)
    fake.output(perf_map, 1, b"pinned")
    assert records(rings[1]) == [b"pinned"]
    source.free()

    with pytest.raises(aperf.LibbpfError) as missing:
        WindowsPerfSource("/ebpf/global/nothing").open(CONFIG)
    assert missing.value.function == "bpf_obj_get"

    ringbuf = fake.create_map(4096, type=BPF_MAP_TYPE_RINGBUF)
    try:
        with pytest.raises(aperf.MapTypeError, match="BPF_MAP_TYPE_PERF_EVENT_ARRAY"):
            WindowsPerfSource(ringbuf).open(CONFIG)
    finally:
        fake.close(ringbuf)


def test_bad_arguments_are_typed_errors(fake: FakeEbpf, perf_map: int) -> None:
    with pytest.raises(TypeError, match="source must be"):
        WindowsPerfSource(1.5)  # type: ignore[arg-type]
    with pytest.raises(aperf.LibbpfError) as bad_fd:
        WindowsPerfSource(12345).open(CONFIG)
    assert bad_fd.value.function == "ebpf_duplicate_fd"
    assert bad_fd.value.errno == 9  # EBADF
    with pytest.raises(aperf.RingSizeError, match="max_entries"):
        WindowsPerfSource(perf_map).open(RingConfig(8192, Wakeup.per_sample()))


def test_one_reader_per_map(fake: FakeEbpf, perf_map: int) -> None:
    first = WindowsPerfSource(perf_map)
    first.open(CONFIG)
    try:
        with pytest.raises(aperf.BusyResourceError, match="wait handle"):
            WindowsPerfSource(perf_map).open(CONFIG)
    finally:
        first.free()
    again = WindowsPerfSource(perf_map)
    again.open(CONFIG)
    again.free()


def test_the_binding_reports_the_dlls_errors(fake: FakeEbpf, perf_map: int) -> None:
    ringbuf = fake.create_map(4096, type=BPF_MAP_TYPE_RINGBUF)
    try:
        with pytest.raises(aperf.LibbpfError) as wrong:
            win.SyncPerfBuffer(ringbuf)
        assert (wrong.value.function, wrong.value.errno) == ("perf_buffer__new", 22)
    finally:
        fake.close(ringbuf)
    pb = win.SyncPerfBuffer(perf_map)
    try:
        with pytest.raises(aperf.LibbpfError) as index:
            pb.consume(pb.count)
        assert (index.value.function, index.value.errno) == ("perf_buffer__consume_buffer", 22)
    finally:
        pb.free()
    with pytest.raises(aperf.AperfError) as closed:
        win.reset(pb.wait_handle)  # closed by perf_buffer__free
    assert isinstance(closed.value, aperf._errors.Win32Error)
    assert (closed.value.winerror, closed.value.function) == (6, "ResetEvent")
    with pytest.raises(aperf.LibbpfError) as close:
        win.close_fd(99999)
    assert (close.value.function, close.value.errno) == ("ebpf_close_fd", 9)


def test_an_exception_in_a_callback_propagates_out_of_the_consume(
    fake: FakeEbpf, perf_map: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    pb = win.SyncPerfBuffer(perf_map)
    try:
        fake.output(perf_map, 0, b"first")
        fake.output(perf_map, 0, b"second")

        def broken(address: int, size: int) -> bytes:
            raise MemoryError("copying the sample failed")

        monkeypatch.setattr(win.ctypes, "string_at", broken)
        with pytest.raises(MemoryError, match="copying the sample failed"):
            pb.consume(0)
        monkeypatch.undo()
        assert pb.consume(0) == []  # the records were consumed by the failed call
    finally:
        pb.free()


def test_wait_any_follows_windows(fake: FakeEbpf) -> None:
    manual, auto = fake.new_event(manual=True), fake.new_event(manual=False)
    try:
        assert win.wait_any([manual, auto], 0) is None
        fake.set_event(auto)
        assert win.wait_any([manual, auto], 0) == 1
        assert win.wait_any([manual, auto], 0) is None  # a satisfied wait reset it
        fake.set_event(manual)
        assert win.wait_any([manual, auto], 0) == 0
        assert win.wait_any([manual, auto], 10) == 0  # manual reset: still signalled
        with pytest.raises(ValueError, match="1 to 64"):
            win.wait_any([], 0)
        # DWORD timeouts: negative is INFINITE, longer than a DWORD is capped there
        assert [win._milliseconds(ms) for ms in (-1, 0, 5, 2**40)] == [2**32 - 1, 0, 5, 2**32 - 1]
        with pytest.raises(aperf.AperfError) as duplicate:
            win.wait_any([manual, manual], 0)
        assert duplicate.value.winerror == 87  # type: ignore[attr-defined]
    finally:
        fake.close_handle(manual)
        fake.close_handle(auto)


def test_the_record_format_round_trips_and_refuses_a_cut_span() -> None:
    same = [b"a" * 8] * 5
    mixed = [b"", b"xyz", 5, b"\x08\x00\x00\x00" * 2, b"q" * 8, 7, b"q" * 8, b"q" * 8]
    for records, expected in (
        (same, [(same, True)]),  # the strided fast path
        ([3, *same], [3, (same, True)]),  # a lost notice first, as eBPF for Windows reports
        (mixed, [([b"", b"xyz"], False), 5, ([b"\x08\x00\x00\x00" * 2, b"q" * 8], True), 7,
                 ([b"q" * 8, b"q" * 8], True)]),
    ):
        span = WINDOWS_RECORDS.encode(records)
        assert WINDOWS_RECORDS.split(0, span) == (expected, 0)
    span = WINDOWS_RECORDS.encode(same)
    for cut in (1, 5, 13):
        with pytest.raises(aperf.BrokenRingError):
            WINDOWS_RECORDS.split(2, span[:-cut])
    with pytest.raises(aperf.BrokenRingError, match="lost record"):
        WINDOWS_RECORDS.split(2, WINDOWS_RECORDS.encode([4])[:-1])
