"""A backlog through an ordered stream against the same stream unordered (issue 28).

    .venv/bin/python bench/ordered_backlog.py [N] [ROUNDS] [LOOP...]

CPU 1 writes N samples (32 B: a sequence number and ``bpf_ktime_get_ns()``), then CPU 0
writes N, all before the stream reads; ``async for`` then takes the 2 x N samples
(asyncio, uvloop and trio; and ``while PerfBuffer.consume()``, "sync"; LOOP picks
some), ``order_by="ts"`` and unordered. Prints, per consumer, the median seconds from
the first take to the last sample over ROUNDS rounds, and how many came out late or
out of time order (both 0 when ordering holds). Root (BPF); the rings are large
enough for the backlog.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import statistics
import sys
import time
from typing import Any

import anyio

import aperf
from aperf.testing import Producer

PAGES = 1024  # 4 MiB per CPU: 2 x 60,000 samples of 40 bytes fit


class Ev(ctypes.Structure):
    _fields_ = [("seq", ctypes.c_uint64), ("ts", ctypes.c_uint64)]


def backlog(producer: Producer, n: int) -> None:
    producer.emit(n, size=32, cpu=1)
    producer.emit(n, size=32, cpu=0)


def verdict(events: list[Any], stats: aperf.StreamStatistics) -> tuple[int, int]:
    stamps = [e.value.ts for e in events]
    return stats.late, sum(a > b for a, b in itertools.pairwise(stamps))


async def stream_round(producer: Producer, n: int, order_by: str | None) -> tuple[float, int, int]:
    async with aperf.PerfStream(producer.map, decoder=Ev, order_by=order_by,
                                pages=PAGES) as stream:
        backlog(producer, n)
        got: list[Any] = []
        start = time.perf_counter()
        with anyio.fail_after(60):
            async for event in stream:
                got.append(event)
                if len(got) == 2 * n:
                    break
        elapsed = time.perf_counter() - start
        return (elapsed, *verdict(got, stream.statistics()))


def sync_round(producer: Producer, n: int, order_by: str | None) -> tuple[float, int, int]:
    got: list[Any] = []
    with aperf.PerfBuffer(producer.map, decoder=Ev, order_by=order_by, pages=PAGES,
                          on_sample=got.append) as pb:
        backlog(producer, n)
        start = time.perf_counter()
        while pb.consume():
            pass
        if len(got) != 2 * n:  # (before issue 28 an ordered consume() handed over nothing)
            print(f"  consume() handed over {len(got)} of {2 * n}; poll() takes the rest")
            while len(got) < 2 * n:
                pb.poll(100)
        elapsed = time.perf_counter() - start
        return (elapsed, *verdict(got, pb.statistics()))


def run(loop: str, n: int, order_by: str | None) -> tuple[float, int, int]:
    with Producer() as producer:
        if loop == "sync":
            return sync_round(producer, n, order_by)
        options = {"use_uvloop": True} if loop == "uvloop" else {}
        return anyio.run(stream_round, producer, n, order_by,  # type: ignore[no-any-return]
                         backend="trio" if loop == "trio" else "asyncio",
                         backend_options=options)


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 30_000
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    os.sched_setaffinity(0, {0})
    print(f"2 x {n} queued samples, {rounds} rounds (median seconds; late; out of order)")
    for loop in sys.argv[3:] or ("asyncio", "uvloop", "trio", "sync"):
        for order_by in (None, "ts"):
            results = [run(loop, n, order_by) for _ in range(rounds)]
            seconds = statistics.median(r[0] for r in results)
            late = max(r[1] for r in results)
            disorder = max(r[2] for r in results)
            name = "ordered  " if order_by else "unordered"
            print(f"{loop:8} {name} {seconds:7.3f} s   late {late:6}   out of order {disorder:6}",
                  flush=True)


if __name__ == "__main__":
    main()
