"""Recording at the producer's full rate against arrays() alone: lost %, CPU, MB/s.

usage (as root, from the checkout):
    .venv/bin/python bench/recording.py [--samples N] [--rounds R] [--pages P] [--rate R]
        [--modes arrays,record-zstd,record-snappy,record-none] [--dir DIR]

The producer is aperf.testing.Producer flat out on CPU 1 (``--samples`` samples of 32
bytes, in runs of a million, then one more so that the kernel's last lost record is
written); with ``--rate``, paced at that many samples a second instead. The reader is a
process of its own, pinned to CPU 0 (the recorder's worker
thread too), reading the pinned perf event array decoded as ``struct bench_sample32``
(bench_getpid.bpf.o's BTF): ``arrays`` counts the rows of ``stream.arrays()``;
``record-CODEC`` runs ``stream.record(DIR)`` with that Parquet compression. The modes
alternate, ``--rounds`` times each, so all see the same machine. Per mode, the median
over rounds of: samples delivered, lost % (the kernel's counts: delivered + lost =
produced), the reader's CPU time per delivered sample (every thread), and for recordings
the bytes written and MB/s over the round (from the first sample emitted to the end of
the reader's drain).

``python bench/recording.py --reader PIN MODE DIR`` is one reader (started by the above).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aperf
from aperf.testing import Producer

OBJECT = Path(__file__).resolve().parents[1] / "bpf" / "bench_getpid.bpf.o"
RUN = 1_000_000


async def read(pin: str, mode: str, out: str, pages: int) -> dict[str, Any]:
    with aperf.BPFObject(OBJECT) as bench:
        decoder = aperf.decoders.from_btf(bench, "bench_sample32")
    loop = asyncio.get_running_loop()
    delivered = 0
    async with aperf.PerfStream(pin, pages=pages, cpus=[0, 1], decoder=decoder) as stream:
        loop.add_signal_handler(signal.SIGTERM, stream.close)  # hands over what is left
        print("ready", flush=True)
        start = time.process_time()
        if mode == "arrays":
            async for item in stream.arrays():
                if isinstance(item, aperf.SampleArray):
                    delivered += len(item)
        else:
            stats = await stream.record(out, compression=mode.split("-", 1)[1])
            delivered = stats.rows
        cpu = time.process_time() - start
        lost = stream.statistics().lost
    written = sum(f.stat().st_size for f in Path(out).glob("*.parquet")) if mode != "arrays" \
        else 0
    return {"delivered": delivered, "lost": lost, "cpu_s": cpu, "bytes": written}


def reader(pin: str, mode: str, out: str, pages: int) -> None:
    os.sched_setaffinity(0, {0})  # this thread, and the threads it starts
    result = asyncio.run(read(pin, mode, out, pages))
    print(json.dumps(result), flush=True)


def one_round(producer: Producer, pin: str, mode: str, samples: int, pages: int,
              base: Path, rate: float | None) -> dict[str, Any]:
    out = base / f"rec-{time.monotonic_ns()}"
    proc = subprocess.Popen([sys.executable, __file__, "--reader", pin, mode, str(out),
                             "--pages", str(pages)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    start = time.monotonic()
    if rate is None:  # flat out
        left = samples
        while left > 0:
            producer.emit(min(RUN, left), size=32, cpu=1)
            left -= RUN
    else:  # what is due every 10 ms (a late tick catches up)
        sent = tick = 0
        while sent < samples:
            due = min(samples, int((time.monotonic() - start) * rate) + 1)
            if due > sent:
                producer.emit(due - sent, size=32, cpu=1)
                sent = due
            tick += 1
            time.sleep(max(0.0, start + tick * 0.01 - time.monotonic()))
    time.sleep(0.05)
    producer.emit(1, size=32, cpu=1)  # the lost record of the last drops
    proc.send_signal(signal.SIGTERM)
    result: dict[str, Any] = json.loads(proc.stdout.readline())
    proc.wait()
    result["seconds"] = time.monotonic() - start
    shutil.rmtree(out, ignore_errors=True)
    return result


def summary(rounds: list[dict[str, Any]], produced: int) -> dict[str, Any]:
    def median(key: Any) -> float:
        return statistics.median(key(r) for r in rounds)

    return {
        "delivered": median(lambda r: r["delivered"]),
        "lost_pct": median(lambda r: 100 * r["lost"] / produced),
        "us_per_sample": median(lambda r: 1e6 * r["cpu_s"] / max(1, r["delivered"])),
        "mb_written": median(lambda r: r["bytes"] / 1e6),
        "mb_per_s": median(lambda r: r["bytes"] / 1e6 / r["seconds"]),
        "seconds": median(lambda r: r["seconds"]),
        "spread_lost_pct": [round(100 * r["lost"] / produced, 2) for r in rounds],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reader", nargs=3, metavar=("PIN", "MODE", "DIR"))
    parser.add_argument("--samples", type=int, default=4_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pages", type=int, default=128)
    parser.add_argument("--rate", type=float, default=None,
                        help="samples per second, paced (default: flat out)")
    parser.add_argument("--modes", default="arrays,record-zstd,record-snappy,record-none")
    parser.add_argument("--dir", type=Path, default=Path("/var/tmp"),
                        help="where the recordings go (a disk, not a tmpfs)")
    args = parser.parse_args()
    if args.reader:
        reader(*args.reader, args.pages)
        return 0
    os.sched_setaffinity(0, {1})  # the producer's runs: on CPU 1
    modes = args.modes.split(",")
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    base = Path(tempfile.mkdtemp(dir=args.dir, prefix="aperf-bench-"))
    with Producer() as producer:
        pin = f"/sys/fs/bpf/aperf-bench-recording-{os.getpid()}"
        producer.map.pin(pin)
        try:
            for _ in range(args.rounds):
                for mode in modes:
                    results[mode].append(one_round(producer, pin, mode, args.samples,
                                                   args.pages, base, args.rate))
        finally:
            os.unlink(pin)
            shutil.rmtree(base, ignore_errors=True)
    produced = args.samples + 1
    print(json.dumps({"produced": produced, "rounds": args.rounds, "pages": args.pages,
                      "rate": args.rate, "load": os.getloadavg(),
                      "modes": {m: summary(r, produced) for m, r in results.items()}},
                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
