"""What one drain tick costs an open, idle stream, against the number of its rings.

    .venv/bin/python bench/tick_cost.py                       # as root: 2 ... 256 rings
    APERF_NO_EXTENSIONS=1 .venv/bin/python bench/tick_cost.py # the pure path

Opens a stream per ring count, each on a test producer's perf event array of its own, with
``map_keys=`` channels (ring k on CPU k % 2 in slot k, 8 pages each: a many-CPU host on two
CPUs), produces nothing, and calls each reader's tick (what the 1 ms drain timer runs)
directly, many times, timing the calling thread's CPU (``time.thread_time_ns``: the
machine may be shared). No event loop wakeup and no timer: only the tick's own work.
Rounds alternate between the ring counts; the median per tick is printed with the
rounds' range. Figures print; nothing passes or fails.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time

import aperf
from aperf._native import speedups
from aperf.testing import Producer

COUNTS = (2, 16, 64, 128, 256)


def per_tick_ns(stream: aperf.PerfStream[object], ticks: int) -> float:
    reader = stream._reader
    assert reader is not None
    start = time.thread_time_ns()
    for _ in range(ticks):
        reader.clock.deadline = 0.0
        reader.tick()
    return (time.thread_time_ns() - start) / ticks


async def measure(ticks: int, rounds: int) -> dict[int, list[float]]:
    got: dict[int, list[float]] = {n: [] for n in COUNTS}
    with contextlib.ExitStack() as producers:
        async with contextlib.AsyncExitStack() as stack:
            streams = {}
            for n in COUNTS:  # a producer (a map) per stream: one reader per map
                producer = producers.enter_context(Producer(perf_slots=n))
                streams[n] = await stack.enter_async_context(aperf.PerfStream(
                    producer.map, pages=8, cpus=[k % 2 for k in range(n)],
                    map_keys=list(range(n)), wakeup=aperf.Wakeup.balanced(idle_latency=0.001)))
            for _ in range(rounds):  # no await in here: the loop's own timers never run
                for n in COUNTS:
                    got[n].append(per_tick_ns(streams[n], ticks))
    return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ticks", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    print(f"aperf {speedups.status()}")
    got = asyncio.run(measure(args.ticks, args.rounds))
    base = statistics.median(got[COUNTS[0]])
    print("rings  us/tick (median)  rounds' range      against 2 rings")
    for n in COUNTS:
        med = statistics.median(got[n])
        print(f"{n:5}  {med / 1000:16.2f}  {min(got[n]) / 1000:6.2f}-{max(got[n]) / 1000:<8.2f}"
              f"  {med / base:.2f}x")


if __name__ == "__main__":
    main()
