"""Per-event cost of ``async for`` over a stream: aperf's iterator class against an async
generator doing the same steps (what ``async for`` used on asyncio before 2026-12-02).

    .venv/bin/python bench/iteration.py                 # asyncio and uvloop, 10 rounds
    .venv/bin/python bench/iteration.py --events 100000 --rounds 4 --loop asyncio
    .venv/bin/python bench/iteration.py --decoded --loop asyncio --loop trio

``--decoded`` writes 32-byte samples and decodes them into records (``from_struct`` with
names: the record path a BTF struct of four u64 takes, as the getpid benchmark's), and adds
``batches()`` as a third way: the cost of building the events without a per-item step.

No root and no kernel: the samples come from ``aperf.testing.FakeRingSource`` (16-byte
samples, no decoder), written before each round, so only the consumer's per-event
path is timed, in CPU time of the consumer's thread (the machine may be shared).
Rounds alternate between the two ways and the median is printed, in ns per event.
Figures print; nothing here passes or fails.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import struct
import time
from collections.abc import AsyncIterator
from typing import Any

import aperf
from aperf.testing import FakeRingSource

SAMPLE = struct.Struct("<QQ")
DECODED = struct.Struct("<QQQQ")  # bench_sample32's layout: seq, ts, pid_tgid, cpu
BATCH = 256  # the stream's own batch (aperf._reading.reader.DEFAULT_BATCH)


async def generator(stream: aperf.PerfStream[Any]) -> AsyncIterator[Any]:
    """The async generator ``async for`` used before: the same front queue, the same takes."""
    reader = stream._reader
    assert reader is not None
    next_event = reader.next_event
    while True:
        try:
            event = next_event()
        except IndexError:
            if reader.fill(BATCH):
                continue
            if stream.closed:
                return
            await stream._loop.wait()  # type: ignore[union-attr]
            continue
        yield event


async def one_round(events: int, way: str, decoded: bool = False) -> float:
    """Seconds per event to iterate ``events`` queued samples one way."""
    src = FakeRingSource(cpus=[0], ring_bytes=1 << 26)
    decoder = aperf.decoders.from_struct(DECODED, "seq ts pid_tgid cpu") if decoded else None
    async with aperf.PerfStream(src, decoder=decoder,
                                wakeup=aperf.Wakeup.every(1 << 30, max_latency=60)) as stream:
        for i in range(events):
            src.write(0, DECODED.pack(i, i, 7 << 32 | 7, 0) if decoded else SAMPLE.pack(i, 0))
        stream.flush()
        seen = 0
        started = time.thread_time()
        if way == "batches":
            async for batch in stream.batches():
                seen += len(batch)
                if seen >= events:
                    break
            return (time.thread_time() - started) / events
        iterator = aiter(stream) if way == "class" else generator(stream)
        async for _ in iterator:
            seen += 1
            if seen == events:
                break
        elapsed = time.thread_time() - started
        if way == "generator":
            await iterator.aclose()  # type: ignore[attr-defined]
    return elapsed / events


def run(loop: str, events: int, rounds: int, ways: tuple[str, ...],
        decoded: bool) -> dict[str, list[float]]:
    def runner(way: str) -> float:
        if loop == "trio":
            import trio

            return trio.run(one_round, events, way, decoded)  # type: ignore[no-any-return]
        if loop == "uvloop":
            import uvloop

            return uvloop.run(one_round(events, way, decoded))
        return asyncio.run(one_round(events, way, decoded))

    times: dict[str, list[float]] = {way: [] for way in ways}
    for r in range(rounds):
        for way in ways if r % 2 == 0 else ways[::-1]:
            times[way].append(runner(way))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=400_000)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--loop", action="append", choices=["asyncio", "uvloop", "trio"])
    parser.add_argument("--decoded", action="store_true",
                        help="32-byte samples decoded into records; batches() as a third way")
    args = parser.parse_args()
    ways = ("class", "generator", "batches") if args.decoded else ("class", "generator")
    what = "32-byte samples decoded into records" if args.decoded else "16-byte samples"
    print(f"{args.events} queued {what} per round, {args.rounds} rounds, median "
          "(min-max) ns per event")
    for loop in args.loop or ["asyncio", "uvloop"]:
        times = run(loop, args.events, args.rounds, ways, args.decoded)
        cells = []
        for way in ways:
            ns = [t * 1e9 for t in times[way]]
            cells.append(f"{way} {statistics.median(ns):.0f} ({min(ns):.0f}-{max(ns):.0f})")
        ratio = statistics.median(times["class"]) / statistics.median(times["generator"])
        print(f"{loop:8} " + "   ".join(cells) + f"   class/generator {ratio:.2f}")


if __name__ == "__main__":
    main()
