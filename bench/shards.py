"""Shards against one reader, in the same run: total delivered and reader CPU per sample.

usage (as root, from the checkout):
    .venv/bin/python bench/shards.py [--seconds S] [--rounds R] [--chunk N] [--pages P]

The producer is aperf.testing.Producer flat out on every online CPU (one thread per
CPU, each running the program on its CPU over and over, ``--chunk`` samples of 32
bytes a run). The readers are processes of their own reading the pinned perf event
array with ``async for`` over ``aperf.PerfStream`` (asyncio, aperf's default wakeup),
counting samples and lost counts: either one reader of every CPU, or one shard per
CPU (``cpus=[cpu]``). The two layouts alternate, ``--rounds`` times each, so both see
the same machine. Per layout: samples delivered, lost (the kernel's counts, so
delivered + lost = produced), the readers' CPU time (user + system, every thread,
from ready to the end of the drain) and its cost per delivered sample.

``python bench/shards.py --reader PIN CPUS`` is one reader (started by the above).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import aperf
from aperf.testing import Producer


async def read(pin: str, cpus: list[int], pages: int) -> dict[str, Any]:
    delivered = lost = 0
    loop = asyncio.get_running_loop()
    async with aperf.PerfStream(pin, pages=pages, cpus=cpus) as stream:
        loop.add_signal_handler(signal.SIGTERM, stream.close)  # hands over what is left
        print("ready", flush=True)
        start = time.process_time()
        async for item in stream:
            if isinstance(item, aperf.Sample):
                delivered += 1
            elif isinstance(item, aperf.Lost):
                lost += item.count
        cpu = time.process_time() - start
    return {"cpus": cpus, "delivered": delivered, "lost": lost, "cpu_s": cpu}


def reader(pin: str, cpus: str, pages: int) -> None:
    result = asyncio.run(read(pin, [int(c) for c in cpus.split(",")], pages))
    print(json.dumps(result), flush=True)


def produce_flat_out(producer: Producer, cpu: int, chunk: int, stop: threading.Event,
                     produced: list[int]) -> None:
    while not stop.is_set():
        producer.emit(chunk, cpu=cpu)
        produced[cpu] += chunk


def one_round(producer: Producer, pin: str, shares: list[list[int]], seconds: float,
              chunk: int, pages: int) -> dict[str, Any]:
    readers = [
        subprocess.Popen(
            [sys.executable, __file__, "--reader", pin, ",".join(map(str, cpus)),
             "--pages", str(pages)],
            stdout=subprocess.PIPE, text=True,
        )
        for cpus in shares
    ]
    for proc in readers:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready", "a reader did not start"
    online = sorted(cpu for cpus in shares for cpu in cpus)
    produced = [0] * (max(online) + 1)
    stop = threading.Event()
    threads = [threading.Thread(target=produce_flat_out, args=(producer, cpu, chunk, stop,
                                                               produced)) for cpu in online]
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join()
    results = []
    for proc in readers:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"a reader failed ({proc.returncode})"
        results.append(json.loads(out.strip().splitlines()[-1]))
    delivered = sum(r["delivered"] for r in results)
    lost = sum(r["lost"] for r in results)
    cpu_s = sum(r["cpu_s"] for r in results)
    total = sum(produced)
    assert delivered + lost == total, (delivered, lost, total)  # nothing lost silently
    return {
        "readers": len(shares), "produced": total, "delivered": delivered, "lost": lost,
        "delivered_per_s": delivered / seconds, "reader_cpu_s": cpu_s,
        "cpu_ns_per_sample": cpu_s * 1e9 / delivered if delivered else float("nan"),
        "per_reader": results,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--reader", nargs=2, metavar=("PIN", "CPUS"), help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=5.0, help="producing time per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each layout")
    parser.add_argument("--chunk", type=int, default=256, help="samples per program run")
    parser.add_argument("--pages", type=int, default=128, help="pages per CPU ring")
    args = parser.parse_args()
    if args.reader:
        reader(*args.reader, args.pages)
        return
    online = sorted(os.sched_getaffinity(0))
    layouts = {"1 reader": [online], f"{len(online)} shards": [[cpu] for cpu in online]}
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in layouts}
    with Producer() as producer:
        pin = f"/sys/fs/bpf/aperf_bench_shards_{os.getpid()}"
        producer.map.pin(pin)
        try:
            for round_ in range(args.rounds):
                for name, shares in layouts.items():
                    row = one_round(producer, pin, shares, args.seconds, args.chunk, args.pages)
                    rows[name].append(row)
                    print(f"round {round_ + 1} {name}: {json.dumps(row)}", flush=True)
        finally:
            producer.map.unpin(pin)
    print(f"\n{'layout':<10} {'produced/s':>12} {'delivered/s':>12} {'lost %':>7} "
          f"{'reader CPU s/s':>15} {'CPU ns/sample':>14}   (medians of {args.rounds} rounds)")
    for name, done in rows.items():
        def median(key: str, rows: list[dict[str, Any]] = done) -> float:
            return statistics.median(r[key] for r in rows)

        produced = statistics.median(r["produced"] / args.seconds for r in done)
        lost = statistics.median(100 * r["lost"] / r["produced"] for r in done)
        print(f"{name:<10} {produced:>12,.0f} {median('delivered_per_s'):>12,.0f} {lost:>7.1f} "
              f"{median('reader_cpu_s') / args.seconds:>15.2f} "
              f"{median('cpu_ns_per_sample'):>14,.0f}")


if __name__ == "__main__":
    main()
