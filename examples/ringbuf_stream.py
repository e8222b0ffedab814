"""A BPF ring buffer (``BPF_MAP_TYPE_RINGBUF``) through the same API as a perf event array.

    $ sudo .venv/bin/python -m examples.ringbuf_stream                    # asyncio
    $ sudo .venv/bin/python -m examples.ringbuf_stream --backend trio     # through anyio

``PerfStream(map)`` tells a ring buffer from a perf event array by the map's
type. A ring buffer is one ring for every CPU, so samples carry ``cpu=-1``
(``aperf.NO_CPU``), and the kernel counts no drops: the BPF side must count its
failed ``bpf_ringbuf_output``/``reserve`` calls, and ``aperf.RingBufferSource``
takes that count (``dropped=``) to report ``Lost`` events. The deterministic
producer keeps such a count; ``producer.source()`` wires it in.

The example reads batches with a decoder on an async loop, then the same map
with the synchronous ``PerfBuffer`` (``poll``/``consume``), and exits non-zero
if a sample is unaccounted for.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import anyio

import aperf
from aperf.testing import Producer

EVENT = aperf.decoders.from_struct("<QQ", names="seq ts")


async def stream_batches(producer: Producer, count: int, cpu: int) -> tuple[int, int]:
    """(samples, lost): ``count`` samples read as batches of decoded events."""
    samples = lost = 0
    last = -1
    async with aperf.PerfStream(producer.source(), decoder=EVENT) as stream:
        thread = producer.spawn(count, size=32, cpu=cpu)
        with anyio.move_on_after(30):
            async for batch in stream.batches(max_items=1024):
                for event in batch:
                    if isinstance(event, aperf.Sample):
                        assert event.cpu == aperf.NO_CPU and event.value.seq > last
                        last = event.value.seq
                        samples += 1
                    elif isinstance(event, aperf.Lost):
                        lost += event.count
                if samples + lost >= count:
                    break
        stats = stream.statistics()
        await anyio.to_thread.run_sync(thread.join)
    print(f"ring buffer of {stats.ring_bytes >> 10} KiB, lost counted by: {stats.lost_counter}; "
          f"{stats.wakeups} wakeups for {stats.samples} samples")
    return samples, lost


def poll_synchronously(producer: Producer, count: int, cpu: int) -> int:
    got: list[int] = []
    with aperf.PerfBuffer(producer.map, decoder=EVENT, on_sample=lambda e: got.append(1)) as pb:
        producer.emit(count, cpu=cpu)
        while len(got) < count:
            pb.poll(timeout_ms=100)  # libbpf's names: ring_buffer__poll's, here
        return len(got)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.ringbuf_stream",
                                     description=__doc__)
    parser.add_argument("--count", type=int, default=50_000, help="samples to produce")
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    parser.add_argument("--ring-kib", type=int, default=4096,
                        help="ring buffer size in KiB (a small one drops samples: counted)")
    args = parser.parse_args(argv)
    cpu = sorted(os.sched_getaffinity(0))[-1]
    with Producer(ring="ringbuf", ringbuf_bytes=args.ring_kib << 10) as producer:
        samples, lost = anyio.run(stream_batches, producer, args.count, cpu,
                                  backend=args.backend)
        polled = poll_synchronously(producer, 1000, cpu)
        counters = producer.counters()
    print(f"ring buffer on {args.backend}: {samples} samples, {lost} lost, {args.count} produced;"
          f" then {polled} through PerfBuffer (BPF side: {counters.ok} written, "
          f"{counters.failed} dropped)")
    exact = samples + polled == counters.ok and lost == counters.failed
    return 0 if exact and samples + lost == args.count else 1


if __name__ == "__main__":
    sys.exit(main())
