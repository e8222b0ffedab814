"""The drain timer's latency and cost in one process, for A/B runs of two trees (issue 23).

    .venv/bin/python bench/wakeup_latency.py [RATE] [asyncio|uvloop] [WAKEUP]

A thread on CPU 1 emits RATE samples/s (32 B, a batch each millisecond, as
bench/run.py's paced producer) for 2 s with ``aperf.testing.Producer``; ``async for``
on CPU 0 takes them. Prints the loop thread's CPU per sample (from
/proc/thread-self/schedstat: the time it ran, not the producer's), the latency p50
and p99 of every sample (its bpf_ktime_get_ns against CLOCK_MONOTONIC on arrival),
and how many ticks the drain timer made and how far apart. Root (BPF).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import statistics
import struct
import sys
import threading
import time

import aperf
from aperf._drivers.stream import PerfStream
from aperf.testing import Producer

SECONDS = 2.0
TS = struct.Struct("<8xQ")


def thread_cpu_ns() -> int:
    with open("/proc/thread-self/schedstat") as f:
        return int(f.read().split()[0])


def produce(p: Producer, rate: int, done: threading.Event) -> None:
    os.sched_setaffinity(0, {1})
    start, sent, tick, total = time.monotonic(), 0, 0, int(rate * SECONDS)
    while sent < total:
        due = min(total, int((time.monotonic() - start) * rate) + 1)
        if due > sent:
            p.emit(due - sent, size=32, cpu=1)
            sent = due
        tick += 1
        pause = start + tick * 0.001 - time.monotonic()
        if pause > 0:
            time.sleep(pause)
    done.set()


async def main(rate: int, wakeup: str | None) -> None:
    os.sched_setaffinity(0, {0})
    ticks: list[float] = []
    tick = PerfStream._tick

    def counted(self: PerfStream[None]) -> None:
        ticks.append(time.monotonic())
        tick(self)

    PerfStream._tick = counted  # type: ignore[method-assign]
    with Producer() as p:
        async with aperf.PerfStream(p.map, wakeup=wakeup) as stream:
            done = threading.Event()
            thread = threading.Thread(target=produce, args=(p, rate, done))
            lat: list[int] = []
            total, lost = int(rate * SECONDS), 0
            start = thread_cpu_ns()
            thread.start()
            async for event in stream:
                if isinstance(event, aperf.Sample):
                    lat.append(time.monotonic_ns() - TS.unpack_from(event.data)[0])
                else:
                    lost += getattr(event, "count", 0)
                if len(lat) + lost >= total:
                    break
            cpu = (thread_cpu_ns() - start) / 1e9
            thread.join()
    q = statistics.quantiles(lat, n=100)
    gaps = statistics.quantiles([b - a for a, b in itertools.pairwise(ticks)], n=100)
    print(f"{cpu / len(lat) * 1e6:.3f} us/sample, latency p50 {q[49] / 1e3:.0f} us "
          f"p99 {q[98] / 1e3:.0f} us, lost {lost}; {len(ticks) / SECONDS:.0f} ticks/s, "
          f"{gaps[49] * 1e6:.0f} us apart (p50)")


if __name__ == "__main__":
    rate = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    loop = sys.argv[2] if len(sys.argv) > 2 else "asyncio"
    wakeup = sys.argv[3] if len(sys.argv) > 3 else None
    if loop == "uvloop":
        import uvloop

        uvloop.run(main(rate, wakeup))
    else:
        asyncio.run(main(rate, wakeup))
