"""The consumer-position fence's cost per ring buffer take (issue 22).

    python bench/fence.py     # no root needed

A take that moves ``consumer_pos`` ends with a full fence and one more look at
the ring (``_rings/ringbuf/format.full_fence``). This times takes of one 16-byte
record from a ring in memory laid out like the kernel's, with the fence and
with a no-op in its place, best of seven rounds, in ns per take: the
difference is what the fence costs each drain. The fence itself is timed too.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable

from aperf._rings.ringbuf.format import BUSY_BIT, RingBufferRing, full_fence

PAGE = 4096
SIZE = 1 << 16
ROUNDS = 7
TAKES = 50_000


def ring(fence: Callable[[], None]) -> tuple[RingBufferRing, bytearray, bytearray]:
    consumer, producer = bytearray(PAGE), bytearray(PAGE + 2 * SIZE)
    return RingBufferRing(0, consumer, producer, PAGE, SIZE, fence=fence), consumer, producer


def per_take(fence: Callable[[], None]) -> float:
    reader, _, producer = ring(fence)
    record = struct.pack("<II16s", 16, 0, b"x" * 16)
    assert not 16 & BUSY_BIT
    best = float("inf")
    pos = 0
    for _ in range(ROUNDS):
        elapsed = 0.0
        for _ in range(TAKES):
            at = PAGE + (pos & (SIZE - 1))
            producer[at : at + 24] = record  # a committed record, as the kernel writes it
            pos += 24
            struct.pack_into("<Q", producer, 0, pos)
            start = time.perf_counter_ns()
            reader.take()
            elapsed += time.perf_counter_ns() - start
        best = min(best, elapsed / TAKES)
    return best


def per_call(fn: Callable[[], None], calls: int = 200_000) -> float:
    best = float("inf")
    for _ in range(ROUNDS):
        start = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter_ns() - start) / calls)
    return best


def main() -> None:
    fenced, bare = per_take(full_fence), per_take(lambda: None)
    print(f"take of one record, with the fence: {fenced:7.0f} ns")
    print(f"take of one record, no-op fence:    {bare:7.0f} ns")
    print(f"the fence per take:                 {fenced - bare:7.0f} ns")
    print(f"full_fence() alone:                 {per_call(full_fence):7.0f} ns")
    print(f"an empty Python call, for scale:    {per_call(lambda: None):7.0f} ns")


if __name__ == "__main__":
    main()
