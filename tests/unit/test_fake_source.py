"""FakeRingSource behaves like the kernel's perf rings: bounded, drops counted,
lost records in front of the next sample that fits, one-shot readiness that
follows the wakeup setting."""

from __future__ import annotations

import select
import struct

import pytest

import aperf
from aperf._rings.perf.format import split_span
from aperf._rings.seam import RingConfig
from aperf.testing import MAX_SAMPLE_BYTES, FakeRingSource, encode_sample


def ready(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def opened(src: FakeRingSource, wakeup: aperf.Wakeup | None = None) -> dict[int, object]:
    rings = src.open(RingConfig(None, wakeup or aperf.Wakeup.per_sample()))
    return {ring.key: ring for ring in rings}


def test_a_sample_that_does_not_fit_is_dropped_and_announced_before_the_next() -> None:
    src = FakeRingSource(cpus=[0], ring_bytes=256)
    ring = opened(src)[0]
    payload = bytes(28)  # 4 + 28 = 32: a 40-byte record
    written = [src.write(0, payload) for _ in range(8)]
    assert written == [True] * 6 + [False] * 2  # 6 x 40 = 240 of 256 bytes
    assert src.dropped(0) == 2 and ring.lost_total() == 2
    span = ring.take()  # type: ignore[attr-defined]
    assert len(span) == 240
    assert src.write(0, payload)  # room again: lost record first, then the sample
    segments, _ = split_span(0, ring.take())  # type: ignore[attr-defined]
    assert segments == [2, ([payload], False)]
    src.free()


def test_the_lost_record_needs_room_too() -> None:
    src = FakeRingSource(cpus=[0], ring_bytes=64)
    ring = opened(src)[0]
    assert src.write(0, bytes(28))  # 40 bytes
    assert not src.write(0, bytes(28))
    ring.take()  # type: ignore[attr-defined]
    assert src.write(0, bytes(20))  # 24 (lost) + 32 = 56 <= 64
    segments, _ = split_span(0, ring.take())  # type: ignore[attr-defined]
    assert segments == [1, ([bytes(20)], False)]
    src.free()


@pytest.mark.parametrize(
    ("wakeup", "signalled_after"),
    [
        (aperf.Wakeup.per_sample(), 1),
        (aperf.Wakeup.every(3), 3),
        (aperf.Wakeup.watermark(100), 3),  # 40-byte records: the third reaches 120 >= 100
    ],
)
def test_readiness_follows_the_wakeup_setting(wakeup: aperf.Wakeup, signalled_after: int) -> None:
    src = FakeRingSource(cpus=[0, 1], ring_bytes=8192)  # watermarks need more than a page
    rings = opened(src, wakeup)
    fd = rings[0].handle  # type: ignore[attr-defined]
    for n in range(1, signalled_after):
        src.write(0, bytes(28))
        assert not ready(fd), n
    src.write(0, bytes(28))
    assert ready(fd)
    assert not ready(rings[1].handle)  # type: ignore[attr-defined]
    src.acknowledge(fd)  # one-shot, as polling a perf fd: cleared until the next wakeup
    assert not ready(fd)
    src.free()


def test_inject_writes_raw_bytes_and_wakes() -> None:
    src = FakeRingSource(cpus=[3])
    ring = opened(src)[3]
    assert src.inject(3, struct.pack("<IHH", 9, 0, 0) + bytes(8))
    assert ready(ring.handle)  # type: ignore[attr-defined]
    with pytest.raises(aperf.BrokenRingError):
        split_span(3, ring.take())  # type: ignore[attr-defined]
    src.free()


def test_write_needs_an_open_source_and_a_known_cpu() -> None:
    src = FakeRingSource(cpus=[0, 1])
    with pytest.raises(aperf.ClosedResourceError, match="not open"):
        src.write(0, b"x")
    opened(src)
    with pytest.raises(ValueError, match="no ring for CPU 5"):
        src.write(5, b"x")
    with pytest.raises(TypeError, match="bytes"):
        src.write(0, "text")  # type: ignore[arg-type]
    with pytest.raises(aperf.BusyResourceError):
        src.open(RingConfig(None, aperf.Wakeup.per_sample()))
    src.free()
    src.free()  # idempotent
    with pytest.raises(aperf.ClosedResourceError):
        src.write(1, b"x")


@pytest.mark.parametrize(
    "kwargs",
    [{"cpus": []}, {"cpus": [-1]}, {"cpus": [0, 0]}, {"cpus": [True]},
     {"ring_bytes": 100}, {"ring_bytes": 16}, {"ring_bytes": 4096.0}],
)
def test_bad_arguments_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        FakeRingSource(**kwargs)  # type: ignore[arg-type]


def test_stream_ring_size_overrides_the_fakes_and_records_match_the_kernels() -> None:
    src = FakeRingSource(cpus=[0], ring_bytes=4096)
    ring = opened(src)[0]
    src.write(0, b"abc")
    assert ring.take() == encode_sample(b"abc")  # type: ignore[attr-defined]
    src.free()
    ring = src.open(RingConfig(8192, aperf.Wakeup.per_sample()))[0]
    assert src.ring_bytes == 8192 and ring.memory.size == 8192  # type: ignore[attr-defined]
    src.free()


# --- misuse: typed errors at the call, naming the argument --------------------------------


def test_a_ring_larger_than_the_kernel_allows_is_refused_at_the_constructor() -> None:
    with pytest.raises(aperf.RingSizeError, match=r"ring_bytes=1099511627776 is too large"):
        FakeRingSource(ring_bytes=1 << 40)
    largest = FakeRingSource(ring_bytes=1 << 28)  # the kernel sources' bound, 256 MiB
    assert largest.ring_bytes == 1 << 28


def test_a_sample_over_the_perf_record_limit_names_the_limit() -> None:
    src = FakeRingSource(ring_bytes=1 << 17)
    opened(src)
    assert MAX_SAMPLE_BYTES == 65516
    assert src.write(0, bytes(MAX_SAMPLE_BYTES))
    for size in (MAX_SAMPLE_BYTES + 1, 65523, 65524, 1 << 20):
        with pytest.raises(aperf.ArgumentError, match=f"{size}-byte sample .* at most 65516") as e:
            src.write(0, bytes(size))
        assert e.value.argument == "payload"
    with pytest.raises(aperf.ArgumentError, match="at most 65516"):
        encode_sample(bytes(MAX_SAMPLE_BYTES + 1))
    src.free()


@pytest.mark.parametrize("raw", [64, None, "text", [1, 2]])
def test_inject_takes_bytes_only(raw: object) -> None:
    src = FakeRingSource()
    ring = opened(src)[0]
    with pytest.raises(TypeError, match="raw must be bytes"):
        src.inject(0, raw)  # type: ignore[arg-type]
    assert ring.pending_bytes() == 0  # type: ignore[attr-defined]  # nothing written
    assert src.inject(0, bytearray(b"\x09\0\0\0\x10\0\0\0"))
    src.free()
