"""Sans-I/O ring reading on fake memory: wrapping, corrupt headers, record kinds, the core."""

from __future__ import annotations

import struct

import pytest

import aperf
from aperf._core import StreamCore
from aperf._ring import RingReader, split_records
from aperf.testing import FakeRingMemory, encode_lost, encode_sample


def test_record_wrapping_the_ring_end_is_reassembled() -> None:
    memory = FakeRingMemory(256)
    reader = RingReader(0, memory)
    filler = encode_sample(b"a" * 200)  # 212 bytes
    assert memory.write(filler)
    assert reader.take() == filler
    wrapping = encode_sample(bytes(range(60)))  # crosses byte 256
    assert memory.write(wrapping)
    assert memory.tail % 256 + len(wrapping) > 256
    span = reader.take()
    assert span == wrapping
    items, other, lost_seen, uniform = split_records(0, span)
    assert items == [bytes(range(60)) + b"\0" * 0]
    assert (other, lost_seen, uniform) == (0, False, True)
    assert memory.tail == memory.head


def test_samples_lost_and_other_records_in_order() -> None:
    other_record = struct.pack("<IHH", 3, 0, 16) + b"\0" * 8  # PERF_RECORD_COMM-ish
    span = encode_sample(b"one") + encode_lost(7) + other_record + encode_sample(b"two!")
    items, other, lost_seen, uniform = split_records(0, span)
    assert items == [b"one\0", 7, b"two!"]
    assert other == 1 and lost_seen and not uniform


def test_padding_rule() -> None:
    for size, seen in [(32, 36), (168, 172), (13, 20), (1, 4), (4096, 4100)]:
        (payload,), *_ = split_records(0, encode_sample(b"x" * size))
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
        split_records(3, encode_sample(b"ok") + bad)


def test_head_beyond_ring_size_is_corrupt_and_never_read() -> None:
    memory = FakeRingMemory(128)
    memory.head = 1000  # claims more than the ring holds
    reader = RingReader(1, memory)
    with pytest.raises(aperf.BrokenRingError, match="CPU 1"):
        reader.take()
    with pytest.raises(aperf.BrokenRingError):
        reader.take()  # stays stopped


def _core(max_pending: int = 10) -> tuple[StreamCore, dict[int, FakeRingMemory]]:
    rings = {0: FakeRingMemory(4096), 1: FakeRingMemory(4096)}
    readers = {cpu: RingReader(cpu, m) for cpu, m in rings.items()}
    return StreamCore(readers, max_pending=max_pending), rings


def test_core_pauses_when_full_and_resumes_by_draining_every_ring() -> None:
    core, rings = _core(max_pending=10)
    for i in range(12):
        rings[0].write(encode_sample(struct.pack("<Q", i)))
    assert core.woken(0) == 12  # one span is taken whole
    assert core.full
    rings[1].write(encode_sample(struct.pack("<Q", 100)))
    assert core.woken(1) == 0 and core.paused  # full: the ring keeps its data
    assert rings[1].head != rings[1].tail
    taken = core.take(8)
    assert [struct.unpack_from("<Q", e.data)[0] for e in taken] == list(range(8))
    assert core.maybe_resume() == 1  # below the low-water mark: CPU 1 drained without a wakeup
    rest = core.take(100)
    assert [(e.cpu, struct.unpack_from("<Q", e.data)[0]) for e in rest] == [
        (0, 8), (0, 9), (0, 10), (0, 11), (1, 100)
    ]
    stats = core.statistics()
    assert stats.samples == 13 and stats.wakeups == 2 and not stats.paused


def test_core_queues_a_broken_ring_as_a_failure_in_order() -> None:
    core, rings = _core(max_pending=100)
    rings[0].write(encode_sample(b"fine"))
    rings[0].write(struct.pack("<IHH", 9, 0, 0) + b"\0" * 8)
    core.drain(0)
    with pytest.raises(aperf.BrokenRingError):
        core.take(10)
    assert core.statistics().cpus[0].broken
    rings[1].write(encode_sample(b"other cpu"))
    core.drain(1)
    assert [e.data for e in core.take(10)] == [b"other cpu\0\0\0"]


def test_put_back_keeps_order() -> None:
    core, rings = _core(max_pending=100)
    for i in range(5):
        rings[0].write(encode_sample(struct.pack("<Q", i)))
    core.drain(0)
    batch = core.take(3)
    core.put_back(batch[1:])
    order = [struct.unpack_from("<Q", e.data)[0] for e in core.take(10)]
    assert order == [1, 2, 3, 4]
    assert core.pending == 0
