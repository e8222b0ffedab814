"""Reading a backward ring (``_rings/perf/backward.newest_records``) on memory written as the kernel
writes a ``write_backward`` ring: each record below the one before, wrapping, overwriting."""

from __future__ import annotations

import random

import pytest

from aperf._rings.perf.backward import newest_records
from aperf.testing import encode_sample

U64 = 1 << 64


class BackwardRing:
    def __init__(self, size: int) -> None:
        self.size = size
        self.data = bytearray(size)
        self.head = 0  # data_head: starts at 0, goes down mod 2**64

    def write(self, record: bytes) -> None:
        self.head = (self.head - len(record)) % U64
        at = self.head % self.size
        for i, byte in enumerate(record):
            self.data[(at + i) % self.size] = byte

    def copy(self, offset: int, length: int) -> bytes:
        assert offset >= 0 and offset + length <= self.size
        return bytes(self.data[offset : offset + length])

    def newest(self) -> bytes:
        return newest_records(self.head, self.size, self.copy)


def test_an_empty_ring_has_no_records() -> None:
    assert BackwardRing(256).newest() == b""


def test_a_ring_not_yet_full_gives_every_record_oldest_first() -> None:
    ring = BackwardRing(256)
    records = [encode_sample(bytes([n]) * 12) for n in range(5)]
    for record in records:
        ring.write(record)
    assert ring.newest() == b"".join(records)


@pytest.mark.parametrize("seed", range(20))
def test_a_wrapped_ring_gives_the_newest_complete_records(seed: int) -> None:
    rng = random.Random(seed)
    ring = BackwardRing(512)
    records = [encode_sample(bytes([n % 256]) * rng.choice([4, 12, 28, 60]))
               for n in range(rng.randrange(30, 200))]
    for record in records:
        ring.write(record)
    kept, used = [], 0
    for record in reversed(records):
        if used + len(record) > ring.size:
            break
        kept.append(record)
        used += len(record)
    assert ring.newest() == b"".join(reversed(kept))


def test_a_size_no_record_can_have_ends_the_walk() -> None:
    ring = BackwardRing(256)
    ring.write(encode_sample(b"a" * 12))
    ring.write(bytes(8))  # a header of size 0: nothing older is trusted
    ring.write(encode_sample(b"b" * 12))
    assert ring.newest() == encode_sample(b"b" * 12)
