"""The perf ring format on fake memory: wrapping, corrupt headers, record kinds, wakeups."""

from __future__ import annotations

import struct

import pytest

import aperf
from aperf._rings.perf.format import PerfRing, split_span
from aperf._rings.perf.source import perf_wakeup
from aperf._rings.seam import Run, payloads_of
from aperf.testing import FakeRingMemory, FakeRingSource, encode_lost, encode_sample


def test_record_wrapping_the_ring_end_is_reassembled() -> None:
    memory = FakeRingMemory(256)
    reader = PerfRing(0, -1, memory)
    filler = encode_sample(b"a" * 200)  # 212 bytes
    assert memory.write(filler)
    assert reader.take() == filler
    wrapping = encode_sample(bytes(range(60)))  # crosses byte 256
    assert memory.write(wrapping)
    assert memory.tail % 256 + len(wrapping) > 256
    span = reader.take()
    assert span == wrapping
    segments, other = split_span(0, span)
    assert segments == [([bytes(range(60))], False)] and other == 0
    assert memory.tail == memory.head


def test_samples_lost_and_other_records_in_order() -> None:
    other_record = struct.pack("<IHH", 3, 0, 16) + b"\0" * 8  # PERF_RECORD_COMM-ish
    span = encode_sample(b"one") + encode_lost(7) + other_record + encode_sample(b"two!")
    segments, other = split_span(0, span)
    assert segments == [([b"one\0"], False), 7, ([b"two!"], False)]
    assert other == 1


def test_padding_rule() -> None:
    for size, seen in [(32, 36), (168, 172), (13, 20), (1, 4), (4096, 4100)]:
        [([payload], _)], _ = split_span(0, encode_sample(b"x" * size))
        assert len(payload) == seen


@pytest.mark.parametrize(
    "bad",
    [
        struct.pack("<IHH", 9, 0, 0) + b"\0" * 8,  # size 0: would loop for ever
        struct.pack("<IHH", 9, 0, 4) + b"\0" * 8,  # smaller than a header
        struct.pack("<IHH", 9, 0, 64) + b"\0" * 8,  # larger than what is there
        struct.pack("<IHHI", 9, 0, 16, 100) + b"\0" * 4,  # raw size beyond the record
        b"\x09\0\0",  # trailing bytes shorter than a header
    ],
)
def test_corrupt_header_raises_broken_ring(bad: bytes) -> None:
    with pytest.raises(aperf.BrokenRingError):
        split_span(3, encode_sample(b"ok") + bad)


def test_runs_between_lost_records_and_mixed_sizes() -> None:
    same = [encode_sample(struct.pack("<Q", i)) for i in range(5)]
    span = b"".join(same[:3]) + encode_lost(9) + b"".join(same[3:]) + encode_sample(b"x" * 30)
    segments, other = split_span(0, span)
    payloads = [struct.pack("<Q", i) + b"\0" * 4 for i in range(5)]
    odd = b"x" * 30 + b"\0" * 6  # padded to round_up(30 + 4, 8) - 4
    # The first run stays in the span: 3 records of 24 bytes, payloads 12 bytes in.
    assert segments[:2] == [Run(span, 0, 3, 24, 12, 12), 9]
    assert payloads_of(segments[0]) == payloads[:3]  # type: ignore[arg-type]
    # However the rest is cut, the payloads come out in ring order.
    flat = [p for seg in segments if not isinstance(seg, int) for p in payloads_of(seg)]
    assert flat == [*payloads, odd]
    assert other == 0


@pytest.mark.parametrize("seed", range(20))
def test_split_matches_record_by_record_parsing(seed: int) -> None:
    import random

    rng = random.Random(seed)
    records, expected = [], []
    for _ in range(rng.randrange(1, 60)):
        if rng.random() < 0.1:
            count = rng.randrange(1, 1000)
            records.append(encode_lost(count))
            expected.append(count)
        else:
            payload = bytes(rng.randrange(256) for _ in range(rng.choice([4, 12, 12, 12, 28])))
            records.append(encode_sample(payload))
            expected.append(payload)
    segments, _ = split_span(0, b"".join(records))
    flat: list[bytes | int] = []
    for seg in segments:
        if isinstance(seg, int):
            flat.append(seg)
        else:
            payloads = payloads_of(seg)
            assert payloads, "no empty runs"
            if isinstance(seg, Run) or seg[1]:
                assert len({len(p) for p in payloads}) == 1
            flat.extend(payloads)
    assert flat == expected


def test_head_beyond_ring_size_is_corrupt_and_never_read() -> None:
    memory = FakeRingMemory(128)
    memory.head = 1000  # claims more than the ring holds
    reader = PerfRing(1, -1, memory)
    with pytest.raises(aperf.BrokenRingError, match="CPU 1"):
        reader.take()
    with pytest.raises(aperf.BrokenRingError):
        reader.take()  # stays stopped


def test_wakeup_kernel_settings_is_deprecated_and_keeps_working() -> None:
    for wakeup, ring in ((aperf.Wakeup.balanced(), 512 * 1024), (aperf.Wakeup.every(64), 4096),
                         (aperf.Wakeup.watermark(1 << 20), 8192)):
        with pytest.warns(DeprecationWarning, match="kernel_settings"):
            assert wakeup.kernel_settings(ring) == perf_wakeup(wakeup, ring)


def test_wakeup_policies_validate() -> None:
    assert aperf.Wakeup.named("balanced") == aperf.Wakeup.balanced()
    assert not aperf.Wakeup.named("lowest-latency").batched
    assert aperf.Wakeup.every(1) == aperf.Wakeup.per_sample()
    assert perf_wakeup(aperf.Wakeup.balanced(), 512 * 1024) == (0, 128 * 1024)
    assert perf_wakeup(aperf.Wakeup.every(64), 4096) == (64, 0)
    with pytest.raises(aperf.ArgumentError, match="unknown wakeup preset") as info:
        aperf.Wakeup.named("fast")
    assert isinstance(info.value, ValueError) and info.value.argument == "wakeup"
    src = FakeRingSource(cpus=[0])
    with pytest.raises(aperf.ArgumentError, match="unknown wakeup preset 'fast'"):
        aperf.PerfStream(src, wakeup="fast")  # as the stream says it, typed as the API's
    for bad, argument in (({"max_pending": 0}, "max_pending"),
                          ({"decode_errors": "ignore"}, "decode_errors")):
        with pytest.raises(aperf.ArgumentError) as info:
            aperf.PerfStream(src, **bad)  # type: ignore[call-overload]
        assert info.value.argument == argument
    with pytest.raises(ValueError, match="need max_latency"):
        aperf.Wakeup(events=64)
    with pytest.raises(ValueError, match="idle_latency"):
        aperf.Wakeup.watermark(4096, max_latency=0.01, idle_latency=0.001)
    with pytest.raises(ValueError):
        aperf.Wakeup.every(0)


def test_each_payload_is_payloads_one_at_a_time() -> None:
    # The builder zips a run's payloads without a list; they must be the same bytes.
    span = b"".join(encode_sample(struct.pack("<QQ", i, ~i & 0xFFFF)) for i in range(7))
    (run,), _ = split_span(0, span)
    assert isinstance(run, Run)
    for first, stop in ((0, 7), (2, 5), (6, 7), (3, 3)):
        each = list(run.each_payload(first, stop))
        assert each == run.payloads(first, stop)
        assert all(type(p) is bytes for p in each)
