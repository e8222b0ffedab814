"""What forged messages cost a FleetReader in memory, measured against a real nats-server.

    .venv/bin/python bench/fleet_reader_memory.py                  # every case below
    .venv/bin/python bench/fleet_reader_memory.py --case zero-1mb --messages 1 8

Each case publishes ``--messages`` forged messages (on ``aperf.mallory.exec``, as a
host allowed on its own subject could), then one genuine sample from another host;
a FleetReader with the exec tracer's BTF decoder (or none: ``--decoder raw``)
reads until that sample comes out, so every forged message has been handled.
The publisher and the reader are processes of their own; it prints the growth of
the reader's peak RSS (``ru_maxrss``) over the moment before it opened, and, with
``--tracemalloc``, tracemalloc's peak and what the reader still holds once done
(its state), and the bytes per byte of forged payload.

Cases:

- ``zero-1mb``: one samples message of 2-byte zero-length samples filling 1 MB
  (524,000 samples: the issue's message; wire limits may refuse it outright);
- ``zero-max``: the most zero-length samples one message may carry (65,535);
- ``short-1mb``: 65,535 samples of 13 bytes each, about 1 MB, shorter than the
  tracer's event (undecodable);
- ``runs``: 20,000 messages of one sample each, each a run of its own (a new
  epoch per message): the state the reader keeps per run (reported after reading).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import resource
import struct
import subprocess
import sys
import tempfile
import tracemalloc
from pathlib import Path
from typing import Any

import nats

from aperf.fleet import FleetReader, JetStreamSink, create_stream
from aperf.fleet._wire import HEADER, MAGIC, SAMPLES
from aperf.fleet.testing import NatsServer

SUBJECT, HOST, STREAM = "aperf.mallory.exec", b"mallory", b"exec"
CASES = ("zero-1mb", "zero-max", "short-1mb", "runs")


def samples_message(lengths: list[int], epoch: int = 7, first: int = 0) -> bytes:
    """A well-formed samples message (one run, CPU 0) of samples of these lengths."""
    count = len(lengths)
    header = HEADER.pack(MAGIC, SAMPLES, len(HOST), len(STREAM), epoch, first, first, first,
                         0, count, 1, bytes(8), bytes(8))
    body = struct.pack("<II", 0, count) + struct.pack(f"<{count}H", *lengths)
    return header + HOST + STREAM + body + b"".join(bytes(n) for n in lengths)


def payloads(case: str, messages: int) -> list[bytes]:
    lengths = {"zero-1mb": [0] * 524_000, "zero-max": [0] * 65_535,
               "short-1mb": [13] * 65_535}.get(case, [8])
    return [samples_message(lengths, epoch=1000 + i) for i in range(messages)]  # runs apart


async def publish(url: str, case: str, messages: int) -> int:
    nc = await nats.connect(url, max_reconnect_attempts=0)
    total = 0
    try:
        js = nc.jetstream()
        for payload in payloads(case, messages):
            await js.publish(SUBJECT, payload)
            total += len(payload)
    finally:
        await nc.close()
    async with JetStreamSink(url, host="genuine", name="exec") as sink:
        await sink.send([__import__("aperf").Sample(0, bytes(176))])
        await sink.flush()
    return total


def maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


async def measure(url: str, decoder_name: str, trace: bool, forged_bytes: int) -> dict[str, Any]:
    decoder = None
    if decoder_name == "btf":
        import aperf
        from aperf._tools.trace.cli import shipped_object
        from aperf._tools.trace.render import event_decoder

        with aperf.BPFObject(shipped_object()) as obj:
            decoder = event_decoder(obj)
    gc.collect()
    if trace:
        tracemalloc.start()
    rss0 = maxrss()
    events: dict[str, int] = {}
    async with FleetReader(url, durable="mem", decoder=decoder, fetch_timeout=0.5) as reader:
        async for host, _, event in reader:
            kind = type(event).__name__
            events[kind] = events.get(kind, 0) + 1
            if host == "genuine":
                break
        stats = reader.statistics()
        state = None
        if trace:
            peak = tracemalloc.get_traced_memory()[1]
            gc.collect()
            state = tracemalloc.get_traced_memory()[0]  # what stays while the reader is open
    result: dict[str, Any] = {
        "events": events, "rss_growth": maxrss() - rss0, "forged_bytes": forged_bytes,
        "statistics": {k: v for k, v in stats.__dict__.items() if v},
    }
    if trace:
        result["tracemalloc_peak"] = peak
        result["held_after"] = state
        tracemalloc.stop()
    return result


def run(*args: str) -> str:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": "."})
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return out.stdout.strip().splitlines()[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=CASES, nargs="+", default=list(CASES))
    parser.add_argument("--messages", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--decoder", choices=("btf", "raw"), nargs="+", default=["btf", "raw"])
    parser.add_argument("--tracemalloc", action="store_true")
    parser.add_argument("--publish", nargs=3, help=argparse.SUPPRESS)  # url case messages
    parser.add_argument("--read", nargs=4, help=argparse.SUPPRESS)  # url decoder trace bytes
    args = parser.parse_args()
    if args.publish:  # a process of its own: what publishing costs is not the reader's
        url, case, messages = args.publish
        asyncio.run(create_stream(url))
        print(asyncio.run(publish(url, case, int(messages))))
        return
    if args.read:
        url, decoder, trace, forged = args.read
        print(json.dumps(asyncio.run(measure(url, decoder, trace == "1", int(forged)))))
        return
    for case in args.case:
        counts = [20_000] if case == "runs" else args.messages
        for messages in counts:
            for decoder in args.decoder:
                with tempfile.TemporaryDirectory() as tmp, NatsServer(Path(tmp)) as server:
                    try:
                        forged = run("--publish", server.url, case, str(messages))
                        r = json.loads(run("--read", server.url, decoder,
                                           "1" if args.tracemalloc else "0", forged))
                    except RuntimeError as exc:
                        print(f"{case} x{messages} {decoder}: failed\n{exc}")
                        continue
                line = (f"{case:9} x{messages:<5} {decoder:3}: RSS +{r['rss_growth'] / 2**20:8.1f}"
                        f" MiB for {r['forged_bytes'] / 2**20:6.2f} MiB forged")
                if "tracemalloc_peak" in r:
                    line += (f", tracemalloc peak {r['tracemalloc_peak'] / 2**20:8.2f} MiB"
                             f" ({r['tracemalloc_peak'] / r['forged_bytes']:.2f} x the payload),"
                             f" held after {r['held_after'] / 2**20:.2f} MiB")
                print(line)
                print(f"    events {r['events']}; {r['statistics']}")


if __name__ == "__main__":
    main()
