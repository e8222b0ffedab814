"""A BPF ring read under trio: the same ``PerfStream``, trio's own primitives.

    $ sudo .venv/bin/python -m examples.trio_stream               # 50 000 samples
    $ sudo .venv/bin/python -m examples.trio_stream --count 10000 --ringbuf

The deterministic producer (``aperf.testing.Producer``) makes the kernel emit
COUNT samples from a thread pinned to one CPU, into a perf event array (or,
with ``--ringbuf``, a BPF ring buffer); a trio task reads them with
``async for``. aperf sees that trio runs (through ``sniffio``) and waits on
the rings with ``trio.lowlevel.wait_readable`` in a system task of its own,
so no nursery is handed to it. A cancel scope bounds the whole read; a
cancellation loses nothing (the events not yet taken stay queued in the
stream). It prints what arrived against the BPF side's own counters and exits
non-zero if a sample is unaccounted for.
"""

from __future__ import annotations

import argparse
import os
import struct
import sys
from collections.abc import Sequence

import trio

import aperf
from aperf.testing import Producer

SEQ_TS = struct.Struct("<QQ")  # the producer's samples start with a sequence number and a time


async def read(producer: Producer, count: int, cpu: int) -> tuple[int, int, bool]:
    """(samples, lost, in order) of ``count`` samples produced on ``cpu``."""
    samples = lost = 0
    last = -1
    in_order = True
    # 4 MiB rings: room for the whole burst. (Smaller ones drop samples, and the drops
    # are counted: Lost events, from the kernel or from the BPF side's own count.)
    pages = None if producer.map.type == aperf.RingBufferSource.MAP_TYPE else 1024
    async with aperf.PerfStream(producer.source(), decoder=SEQ_TS, pages=pages) as stream:
        # Nothing arrives yet: a wait cancelled by trio's own cancel scope takes nothing.
        with trio.move_on_after(0.05):
            await anext(stream)
        thread = producer.spawn(count, size=32, cpu=cpu)
        with trio.move_on_after(30):  # the whole read, bounded
            async for event in stream:
                if isinstance(event, aperf.Sample):
                    seq, _ts = event.value
                    in_order = in_order and seq > last
                    last = seq
                    samples += 1
                elif isinstance(event, aperf.Lost):
                    lost += event.count
                if samples + lost == count:
                    break
        await trio.to_thread.run_sync(thread.join)
    return samples, lost, in_order


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.trio_stream", description=__doc__)
    parser.add_argument("--count", type=int, default=50_000, help="samples to produce")
    parser.add_argument("--ringbuf", action="store_true", help="a BPF ring buffer, not perf")
    args = parser.parse_args(argv)
    cpu = sorted(os.sched_getaffinity(0))[-1]
    ring = "ringbuf" if args.ringbuf else "perf"
    with Producer(ring=ring, ringbuf_bytes=1 << 22 if args.ringbuf else None) as producer:
        samples, lost, in_order = trio.run(read, producer, args.count, cpu)
        counters = producer.counters()
    print(f"{ring} on trio: {samples} samples, {lost} lost, {args.count} produced "
          f"(BPF side: {counters.ok} written, {counters.failed} dropped)")
    exact = samples == counters.ok and lost == counters.failed
    return 0 if exact and in_order and samples + lost == args.count else 1


if __name__ == "__main__":
    sys.exit(main())
