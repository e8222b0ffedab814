"""The BPF ring buffer protocol on memory laid out like the kernel's (no root needed).

``KernelRing`` plays the kernel's side (``kernel/bpf/ringbuf.c``): positions in
the consumer and producer pages, the data area mapped twice, records reserved
BUSY, then committed or discarded. ``RingBufferRing`` is aperf's reader.
"""

from __future__ import annotations

import random
import struct

import pytest

import aperf
from aperf._rings.ringbuf.format import (
    BUSY_BIT,
    DISCARD_BIT,
    RingBufferRing,
    encode_record,
    split_span,
)

PAGE = 4096


class Mirror(bytearray):
    """Mapped memory: slicing copies out bytes, as slicing an mmap does."""

    def __getitem__(self, key):  # type: ignore[no-untyped-def,override]
        got = super().__getitem__(key)
        return bytes(got) if isinstance(key, slice) else got


class KernelRing:
    def __init__(self, size: int) -> None:
        self.size = size
        self.consumer = bytearray(PAGE)
        self.producer = Mirror(PAGE + 2 * size)
        self.reader = RingBufferRing(0, self.consumer, self.producer, PAGE, size)

    @property
    def cons(self) -> int:
        return int(struct.unpack_from("<Q", self.consumer)[0])

    @property
    def prod(self) -> int:
        return int(struct.unpack_from("<Q", self.producer)[0])

    def _write(self, pos: int, data: bytes) -> None:
        start = pos & (self.size - 1)
        for index, byte in enumerate(data):  # both mappings of each data byte
            at = (start + index) % self.size
            self.producer[PAGE + at] = byte
            self.producer[PAGE + self.size + at] = byte

    def reserve(self, length: int) -> int | None:
        step = (length + 8 + 7) & ~7
        if self.prod + step - self.cons > self.size:
            return None  # no room: bpf_ringbuf_reserve() fails, the BPF side counts it
        pos = self.prod
        self._write(pos, struct.pack("<II", length | BUSY_BIT, 0))
        struct.pack_into("<Q", self.producer, 0, pos + step)
        return pos

    def commit(self, pos: int, payload: bytes, *, discard: bool = False) -> None:
        self._write(pos + 8, payload)
        word = len(payload) | (DISCARD_BIT if discard else 0)
        self._write(pos, struct.pack("<I", word))

    def output(self, payload: bytes) -> bool:
        pos = self.reserve(len(payload))
        if pos is None:
            return False
        self.commit(pos, payload)
        return True

    def take(self) -> list[bytes]:
        segments, _ = split_span(-1, self.reader.take())
        return [p for segment in segments for p in segment[0]]  # type: ignore[index]


def test_records_come_out_in_order_with_their_exact_lengths() -> None:
    ring = KernelRing(4096)
    payloads = [bytes([n]) * n for n in (1, 7, 8, 9, 32, 32, 32, 100)]
    for payload in payloads:
        assert ring.output(payload)
    assert ring.take() == payloads
    assert ring.cons == ring.prod  # the space is released
    assert ring.take() == []


def test_a_busy_record_stops_the_take_until_it_is_committed() -> None:
    ring = KernelRing(4096)
    assert ring.output(b"a" * 16)
    busy = ring.reserve(24)
    assert busy is not None
    assert ring.output(b"c" * 16)  # committed, but behind a reserved one
    assert ring.take() == [b"a" * 16]
    assert ring.cons == busy  # stopped at the BUSY record: its commit wakes the reader
    assert ring.take() == []
    ring.commit(busy, b"b" * 24)
    assert ring.take() == [b"b" * 24, b"c" * 16]
    assert ring.cons == ring.prod


def test_discarded_records_are_skipped_and_counted() -> None:
    ring = KernelRing(4096)
    ring.output(b"x" * 8)
    for _ in range(3):
        pos = ring.reserve(8)
        assert pos is not None
        ring.commit(pos, b"d" * 8, discard=True)
    ring.output(b"y" * 8)
    segments, discarded = split_span(-1, ring.reader.take())
    assert discarded == 3
    assert [p for s in segments for p in s[0]] == [b"x" * 8, b"y" * 8]  # type: ignore[index]
    assert ring.cons == ring.prod


def test_a_record_wrapping_the_end_reads_whole_through_the_second_mapping() -> None:
    ring = KernelRing(256)
    for _ in range(5):  # 5 x 40 bytes: the next 40-byte record crosses byte 256
        ring.output(b"f" * 32)
    assert len(ring.take()) == 5
    wrapping = bytes(range(100))
    assert ring.output(wrapping)
    assert ring.cons % 256 + 112 > 256
    assert ring.take() == [wrapping]


def test_a_full_ring_refuses_records_until_the_reader_frees_space() -> None:
    ring = KernelRing(256)
    accepted = sum(ring.output(b"s" * 24) for _ in range(20))
    assert accepted == 256 // 32
    assert ring.reader.pending_bytes() == 256
    assert len(ring.take()) == accepted
    assert ring.output(b"s" * 24)


def test_uniform_runs_and_mixed_sizes_split_alike() -> None:
    span = b"".join(encode_record(bytes([n % 256]) * 24) for n in range(50))
    span += encode_record(b"odd", discard=False) + encode_record(b"z" * 24)
    segments, discarded = split_span(-1, span)
    assert discarded == 0
    assert segments[0] == ([bytes([n]) * 24 for n in range(50)], True)  # one uniform run
    flat = [p for s in segments for p in s[0]]  # type: ignore[index]
    assert flat[-2:] == [b"odd", b"z" * 24]


@pytest.mark.parametrize("seed", range(10))
def test_reader_matches_a_model_of_the_kernel(seed: int) -> None:
    # Random reserves, commits in any order, discards and takes: the reader must
    # hand over every committed, undiscarded record once, in position order.
    rng = random.Random(seed)
    ring = KernelRing(1024)
    records: list[tuple[int, bytes, bool]] = []
    reserved: list[tuple[int, bytes, bool]] = []
    got: list[bytes] = []
    for _ in range(400):
        action = rng.random()
        if action < 0.6:
            payload = rng.randbytes(rng.choice([8, 8, 8, 13, 40, 1, 200]))
            pos = ring.reserve(len(payload))
            if pos is not None:
                reserved.append((pos, payload, rng.random() < 0.1))
                records.append(reserved[-1])
        elif action < 0.8 and reserved:
            pos, payload, discard = reserved.pop(rng.randrange(len(reserved)))
            ring.commit(pos, payload, discard=discard)
        else:
            got.extend(ring.take())
            busy = min((pos for pos, _, _ in reserved), default=ring.prod)
            assert ring.cons == busy  # everything before the first BUSY record, no more
    for pos, payload, discard in reserved:
        ring.commit(pos, payload, discard=discard)
    got.extend(ring.take())
    assert ring.cons == ring.prod
    assert got == [payload for _, payload, discard in sorted(records) if not discard]
    assert len(got) > 50


def test_reader_order_is_position_order_whatever_the_commit_order() -> None:
    ring = KernelRing(4096)
    rng = random.Random(3)
    positions = []
    for n in range(30):
        payload = struct.pack("<Q", n) * rng.choice([1, 2, 5])
        pos = ring.reserve(len(payload))
        assert pos is not None
        positions.append((pos, payload))
    order = positions[:]
    rng.shuffle(order)
    got: list[bytes] = []
    for pos, payload in order:
        ring.commit(pos, payload)
        got.extend(ring.take())
    assert got == [payload for _, payload in positions]
    assert ring.cons == ring.prod


@pytest.mark.parametrize(
    "corrupt",
    ["beyond-producer", "producer-too-far", "consumer-ahead"],
)
def test_corrupt_positions_and_headers_break_the_ring(corrupt: str) -> None:
    ring = KernelRing(256)
    ring.output(b"r" * 16)
    if corrupt == "beyond-producer":
        ring._write(0, struct.pack("<I", 200))  # the record claims more than was written
    elif corrupt == "producer-too-far":
        struct.pack_into("<Q", ring.producer, 0, 1000)
    else:
        struct.pack_into("<Q", ring.consumer, 0, 1000)
    with pytest.raises(aperf.BrokenRingError, match="ring buffer is corrupt"):
        ring.reader.take()


def test_split_refuses_reserved_or_truncated_records() -> None:
    with pytest.raises(aperf.BrokenRingError, match="still reserved"):
        split_span(-1, encode_record(b"q" * 8, busy=True))
    with pytest.raises(aperf.BrokenRingError, match="claims"):
        split_span(-1, encode_record(b"q" * 16)[:16])
    with pytest.raises(aperf.BrokenRingError, match="shorter than a header"):
        split_span(-1, b"\0" * 4)


def test_released_memory_is_never_read() -> None:
    ring = KernelRing(256)
    ring.reader.release()
    with pytest.raises(aperf.ClosedResourceError):
        ring.reader.take()
    with pytest.raises(aperf.ClosedResourceError):
        ring.reader.pending_bytes()


class StoreBufferRace(KernelRing):
    """The kernel commits a record at the one moment the fence exists for: after the
    reader stored ``consumer_pos``, before its last look at the ring. On x86 the
    reader's store can still sit in its store buffer then, so the kernel reads the
    old ``consumer_pos`` and wakes nobody; only a look after a full fence finds it."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.fences: list[int] = []  # consumer_pos at each fence
        self.at_fence: list[bytes] = []  # committed by "the kernel" during the next fence
        self.reader = RingBufferRing(
            0, self.consumer, self.producer, PAGE, size, fence=self.fence
        )

    def fence(self) -> None:
        self.fences.append(self.cons)
        while self.at_fence:
            assert self.output(self.at_fence.pop(0))


def test_a_record_committed_just_after_the_consumer_store_is_taken_not_stranded() -> None:
    ring = StoreBufferRace(4096)
    ring.output(b"a" * 16)
    ring.at_fence.append(b"b" * 16)
    assert ring.take() == [b"a" * 16, b"b" * 16]
    assert ring.cons == ring.prod
    assert ring.fences == [24, 48]  # after each store, then the look that found nothing


def test_a_reserved_record_is_looked_at_again_after_the_fence() -> None:
    ring = StoreBufferRace(4096)
    ring.output(b"a" * 16)
    busy = ring.reserve(8)
    assert busy is not None
    assert ring.take() == [b"a" * 16]  # stops at the BUSY record, after a fence
    assert ring.fences == [busy]
    ring.commit(busy, b"b" * 8)
    assert ring.take() == [b"b" * 8]


def test_a_take_that_moves_nothing_needs_no_fence() -> None:
    ring = StoreBufferRace(4096)
    assert ring.take() == []
    busy = ring.reserve(8)
    assert busy is not None
    assert ring.take() == []  # BUSY at the consumer position, which it did not move
    assert ring.fences == []

