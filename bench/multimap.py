"""Per-event cost of a stream of several maps against a stream of one: the same samples,
queued in one map's rings, or split between two maps (each with its own decoder, its
events tagged with its map).

    .venv/bin/python bench/multimap.py                       # asyncio, 8 rounds
    .venv/bin/python bench/multimap.py --events 200000 --rounds 4

No root and no kernel: the samples come from ``aperf.testing.FakeRingSource`` (16-byte
samples on CPUs 0 and 1), written before each round, so only the consumer's path (drain,
split, build, hand out) is timed, in CPU time of the consumer's thread (the machine may be
shared). Rounds alternate between one map and two, the median is printed in ns per event,
for ``async for``, ``batches()``, ``run(on_sample)`` and ``arrays()``. Figures print;
nothing passes or fails.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import struct
import time
from typing import Any

import aperf
from aperf.testing import FakeRingSource

SAMPLE = struct.Struct("<QQ")
CPUS = (0, 1)


async def one_round(events: int, maps: int, mode: str) -> float:
    """Seconds per event to take ``events`` queued samples in ``mode`` from ``maps`` maps."""
    sources = [FakeRingSource(cpus=CPUS, ring_bytes=1 << 24, name=f"m{i}") for i in range(maps)]
    spec: Any = sources[0] if maps == 1 else {s.name: s for s in sources}
    wakeup = aperf.Wakeup.every(1 << 30, max_latency=60)  # no wakeups: one flush below
    async with aperf.PerfStream(spec, decoder=SAMPLE, wakeup=wakeup,
                                max_pending=events + 16) as stream:
        for i in range(events):
            sources[i % maps].write(CPUS[(i // maps) % 2], SAMPLE.pack(i, 0))
        stream.flush()
        seen = 0
        started = time.thread_time()
        if mode == "iter":
            async for _ in stream:
                seen += 1
                if seen == events:
                    break
        elif mode == "batches":
            async for batch in stream.batches():
                seen += len(batch)
                if seen == events:
                    break
        elif mode == "run":
            def on_sample(_: Any) -> None:
                nonlocal seen
                seen += 1
                if seen == events:
                    stream.close()  # ends run()

            await stream.run(on_sample)
        else:
            async for item in stream.arrays():
                seen += len(item)  # type: ignore[arg-type]
                if seen == events:
                    break
        elapsed = time.thread_time() - started
    return elapsed / events


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    for mode in ("iter", "batches", "run", "arrays"):
        times: dict[int, list[float]] = {1: [], 2: []}
        for _ in range(args.rounds):
            for maps in (1, 2):
                times[maps].append(asyncio.run(one_round(args.events, maps, mode)))
        one, two = (statistics.median(times[m]) * 1e9 for m in (1, 2))
        print(f"{mode:8} one map {one:7.1f} ns/event   two maps {two:7.1f} ns/event   "
              f"ratio {two / one:.2f}")


if __name__ == "__main__":
    main()
