"""Forwarding perf samples into NATS JetStream, measured on this machine.

    sudo .venv/bin/python bench/fleet.py             # about 2 minutes
    sudo .venv/bin/python bench/fleet.py --quick     # one repeat, shorter latency runs
    sudo .venv/bin/python bench/fleet.py --replicas 1 3 --batches 256 --parts forward
                                                     # R1 and R3 streams on a 3-node cluster

What it measures (docs/fleet.md records the method and a run's figures):

- **forwarded samples/s** from one host, per sink batch size: the deterministic
  producer offers a paced rate (a burst every 10 ms) for a few seconds into a
  4 MiB ring, aperf reads it, a JetStreamSink publishes to a local
  ``nats-server -js`` (file storage); the rate is samples acknowledged by
  JetStream over the time from the first burst to the last acknowledgement. What
  the sink cannot take the kernel drops and counts: reported as "lost in kernel".
- **CPU per sample** of the forwarding thread (aperf reading the rings, framing,
  the NATS client: one asyncio thread, ``time.thread_time``), next to the same
  stream read by a consumer that only counts (aperf's own share); and the
  nats-server's CPU per message and per sample (``/proc/<pid>/stat``).
- **end-to-end latency** p50/p99, from ``bpf_ktime_get_ns()`` in the sample to the
  moment a FleetReader in another process hands it out (both CLOCK_MONOTONIC),
  with the producer paced at 1 k and 10 k samples/s.
- **reader rate**: a FleetReader decoding the stored samples back.
- with ``--replicas``: the same forwarding into streams of each replica count,
  all on one three-node JetStream cluster on loopback (the sink connected to n1,
  wherever JetStream put the stream's leader); server CPU is the three nodes'.

The sink thread is pinned to CPU 0 and the producer to CPU 1; nats-server and the
reader float. On a 2-CPU machine they compete: read the figures as this box's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import aperf
from aperf.fleet import FleetReader, JetStreamSink, create_stream
from aperf.fleet.testing import NatsCluster, NatsServer
from aperf.testing import Producer, sample_header

BENCH = Path(__file__).resolve().parent
SINK_CPU, PRODUCER_CPU = 0, 1
PAGES = 1024  # 4 MiB per CPU
SIZE = 32  # bytes per sample: seq, ktime, 16 bytes of zeroes
TICKS = os.sysconf("SC_CLK_TCK")


def server_cpu(pids: list[int]) -> float:
    """User + system seconds the processes have used."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / TICKS


class Emitter(threading.Thread):
    """A thread pinned to the producer CPU emitting ``total`` samples, ``chunk`` at a
    time, a chunk every ``period`` seconds (on a fixed schedule: no drift); ``seconds``
    is how long the emitting took, to tell the offered rate reached from the one asked."""

    def __init__(self, producer: Producer, total: int, chunk: int, period: float) -> None:
        super().__init__(daemon=True)
        self._args = (producer, total, chunk, period)
        self.seconds = 0.0
        self.start()

    def run(self) -> None:
        producer, total, chunk, period = self._args
        os.sched_setaffinity(0, {PRODUCER_CPU})
        start = time.monotonic()
        left = total
        while left > 0:
            n = min(chunk, left)
            producer.emit(n, size=SIZE, cpu=PRODUCER_CPU)
            left -= n
            if left:
                next_at = start + (total - left) // chunk * period
                time.sleep(max(0.0, next_at - time.monotonic()))
        self.seconds = time.monotonic() - start


async def wait_for(condition: Any, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the run did not finish")
        await asyncio.sleep(0.002)


async def fresh_stream(url: str, replicas: int = 1) -> str | None:
    """A new, empty stream APERF; the name of its leader on a cluster."""
    import nats

    nc = await nats.connect(url)
    try:
        await nc.jetstream().delete_stream("APERF")
    except Exception:
        pass  # not there yet
    finally:
        await nc.close()
    info = await create_stream(url, max_bytes=8 << 30, replicas=replicas)
    return info.cluster.leader if info.cluster is not None else None


async def forward_run(
    url: str, server_pid: list[int], rate: int, seconds: float, batch: int | None,
    replicas: int = 1,
) -> dict[str, Any]:
    """One host forwarding ``rate`` samples/s for ``seconds`` (``batch`` None: a consumer
    that only counts, no sink: aperf's own share)."""
    leader = await fresh_stream(url, replicas)
    chunk = rate // 100  # a burst every 10 ms
    offered = chunk * int(seconds * 100)
    with Producer() as producer:
        async with aperf.PerfStream(producer.map, pages=PAGES) as stream:
            sink = None
            if batch is not None:
                sink = JetStreamSink(url, host="bench", name="producer", batch=batch)
                await sink.open()
            counted = 0

            async def consume() -> None:
                nonlocal counted
                async for events in stream.batches(batch or 256):
                    if sink is not None:
                        await sink.send(events)
                    counted += len(events)

            task = asyncio.ensure_future(consume())
            nodes0 = [server_cpu([p]) for p in server_pid]
            cpu0, srv0, t0 = time.thread_time(), server_cpu(server_pid), time.monotonic()
            emitter = Emitter(producer, offered, chunk, 0.01)
            await asyncio.to_thread(emitter.join)
            ok = producer.counters().ok
            await wait_for(lambda: stream.statistics().samples == ok and counted >= ok)
            if sink is not None:
                await sink.flush()
            t1, cpu1, srv1 = time.monotonic(), time.thread_time(), server_cpu(server_pid)
            nodes = [server_cpu([p]) - c for p, c in zip(server_pid, nodes0, strict=True)]
            stream.close()
            await task
            result: dict[str, Any] = {
                "batch": batch, "offered_per_s": rate, "offered": offered, "read": ok,
                "achieved_per_s": offered / emitter.seconds,
                "lost_in_kernel": offered - ok, "seconds": t1 - t0,
                "samples_per_s": ok / (t1 - t0), "cpu_us_per_sample": (cpu1 - cpu0) / ok * 1e6,
                "load_average": os.getloadavg()[0], "replicas": replicas, "leader": leader,
            }
            if sink is not None:
                stats = sink.statistics()
                await sink.aclose()
                result |= {
                    "messages": stats.published, "acknowledged": stats.samples_acknowledged,
                    "dropped": stats.dropped_samples, "retried": stats.retried,
                    "server_cpu_us_per_message": (srv1 - srv0) / stats.published * 1e6,
                    "server_cpu_us_per_sample": (srv1 - srv0) / ok * 1e6,
                    # Each node's share, n1 first (the leader is named in "leader").
                    "node_cpu_us_per_message": [n / stats.published * 1e6 for n in nodes],
                    "stored_bytes_per_sample": await stored_bytes(url) / ok,
                }
            return result


async def stored_bytes(url: str) -> float:
    import nats

    nc = await nats.connect(url)
    try:
        info = await nc.jetstream().stream_info("APERF")
        return float(info.state.bytes)
    finally:
        await nc.close()


async def read_back(url: str, server_pid: list[int], expected: int) -> dict[str, Any]:
    """A FleetReader decoding every stored sample, in this process."""
    decoder = aperf.decoders.from_struct("<QQ", "seq ts")
    got = 0
    cpu0, t0, srv0 = time.thread_time(), time.monotonic(), server_cpu(server_pid)
    async with FleetReader(url, durable="bench-read", decoder=decoder, batch=256) as reader:
        async for _host, _stream, event in reader:
            if event.__class__ is aperf.Sample:
                got += 1
                if got == expected:
                    break
        messages = reader.statistics().messages
    t1, cpu1, srv1 = time.monotonic(), time.thread_time(), server_cpu(server_pid)
    return {"samples": got, "samples_per_s": got / (t1 - t0),
            "cpu_us_per_sample": (cpu1 - cpu0) / got * 1e6,
            "server_cpu_us_per_message": (srv1 - srv0) / messages * 1e6}


async def latency_run(url: str, rate: int, seconds: float, wakeup: str) -> dict[str, Any]:
    """Paced samples through sink, JetStream and a reader in another process."""
    await fresh_stream(url)
    chunk = max(1, rate // 100)  # a chunk every 10 ms
    total = chunk * int(seconds * 100)
    warmup = rate // 5  # the first 0.2 s: the drain timer leaves its idle period (50 ms)
    reader = subprocess.Popen(
        [sys.executable, __file__, "--reader", url, str(total), str(warmup)],
        stdout=subprocess.PIPE, text=True,
    )
    assert reader.stdout is not None
    if reader.stdout.readline().strip() != "ready":
        raise RuntimeError("the latency reader did not start")
    with Producer() as producer:
        async with (
            aperf.PerfStream(producer.map, pages=PAGES, wakeup=wakeup) as stream,
            JetStreamSink(url, host="bench", name="producer") as sink,
        ):
            task = asyncio.ensure_future(sink.forward(stream))
            emitter = Emitter(producer, total, chunk, 0.01)
            await asyncio.to_thread(emitter.join)
            await wait_for(lambda: sink.statistics().samples_acknowledged >= total)
            stream.close()
            await task
    out, _ = await asyncio.to_thread(reader.communicate)
    lat = json.loads(out.splitlines()[-1])
    return {"rate": rate, "wakeup": wakeup, "samples": total, "warmup": warmup,
            "load_average": os.getloadavg()[0], **lat}


def reader_process(url: str, total: int, warmup: int) -> None:
    """``--reader URL N W``: hand out N samples, print the latency quantiles (microseconds)
    of those after the first W."""

    async def run() -> None:
        lat: list[int] = []
        got = 0
        async with FleetReader(url, durable="bench-latency", fetch_timeout=0.5) as reader:
            print("ready", flush=True)
            async for _host, _stream, event in reader:
                if event.__class__ is aperf.Sample:
                    seq, ktime = sample_header(event.data)
                    if seq >= warmup:
                        lat.append(time.monotonic_ns() - ktime)
                    got += 1
                    if got == total:
                        break
        q = statistics.quantiles(lat, n=100)
        print(json.dumps({"p50_us": q[49] / 1e3, "p99_us": q[98] / 1e3,
                          "max_us": max(lat) / 1e3}))

    asyncio.run(run())


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median rate (its own figures stay together)."""
    return sorted(runs, key=lambda r: r["samples_per_s"])[len(runs) // 2]


async def main(args: argparse.Namespace) -> dict[str, Any]:
    os.sched_setaffinity(0, {SINK_CPU})
    results: dict[str, Any] = {"forward": [], "latency": []}
    clustered = max(args.replicas) > 1
    with tempfile.TemporaryDirectory(prefix="aperf-fleet-bench-") as tmp:
        servers = NatsCluster(tmp) if clustered else NatsServer(tmp)
        with servers:
            if isinstance(servers, NatsCluster):
                url, pids = servers.urls[0], [s.pid for s in servers.servers]
            else:
                url, pids = servers.url, [servers.pid]
            await measure(args, url, pids, results)
    print(json.dumps({"read_back": results.get("read_back")}), flush=True)
    return results


async def measure(
    args: argparse.Namespace, url: str, pids: list[int], results: dict[str, Any]
) -> None:
    for batch in [None, *args.batches] if "forward" in args.parts else []:
        for rate in args.rates:
            # Replica counts take turns within each repeat: a shared machine's load
            # drifts over minutes, and R1 against R3 is the comparison wanted.
            runs: dict[int, list[dict[str, Any]]] = {r: [] for r in args.replicas}
            for _ in range(args.repeat):
                for replicas in args.replicas if batch is not None else args.replicas[:1]:
                    runs[replicas].append(
                        await forward_run(url, pids, rate, args.seconds, batch, replicas)
                    )
                    if batch == 256 and rate == args.rates[-1] and replicas == 1:
                        results["read_back"] = await read_back(
                            url, pids, runs[replicas][-1]["read"]
                        )
            for found in runs.values():
                if found:
                    best = median_run(found)
                    results["forward"].append(best)
                    print(json.dumps(best), flush=True)
    for wakeup in ("balanced", "lowest-latency") if "latency" in args.parts else ():
        for rate in (1_000, 10_000):
            run = await latency_run(url, rate, args.latency_seconds, wakeup)
            results["latency"].append(run)
            print(json.dumps(run), flush=True)


def _offered(r: dict[str, Any]) -> str:
    return f"{r['offered_per_s']:,} ({r['achieved_per_s']:,.0f})"


def table(results: dict[str, Any]) -> str:
    rows = [
        "| replicas | sink batch | offered/s (reached) | forwarded samples/s | lost in kernel | "
        "messages/s | forwarding thread CPU/sample | nats-server CPU/message | /sample | "
        "stored bytes/sample |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["forward"]:
        lost = f"{r['lost_in_kernel'] / r['offered']:.1%}"
        replicas = f"R{r.get('replicas', 1)}"
        if r["batch"] is None:
            rows.append(
                f"| - | (none: aperf reads, counts) | {_offered(r)} | "
                f"{r['samples_per_s']:,.0f} | {lost} | - | {r['cpu_us_per_sample']:.2f} µs "
                "| - | - | - |"
            )
            continue
        rows.append(
            f"| {replicas} | {r['batch']} | {_offered(r)} | {r['samples_per_s']:,.0f} | {lost} | "
            f"{r['messages'] / r['seconds']:,.0f} | {r['cpu_us_per_sample']:.2f} µs | "
            f"{r['server_cpu_us_per_message']:.1f} µs | {r['server_cpu_us_per_sample']:.2f} µs | "
            f"{r['stored_bytes_per_sample']:.1f} |"
        )
    rows += ["", "| producer rate | wakeup | p50 | p99 | max |", "|---|---|---|---|---|"]
    for r in results["latency"]:
        rows.append(
            f"| {r['rate']:,}/s | {r['wakeup']} | {r['p50_us'] / 1e3:.2f} ms | "
            f"{r['p99_us'] / 1e3:.2f} ms | {r['max_us'] / 1e3:.1f} ms |"
        )
    back = results.get("read_back")
    if back:
        rows += ["", f"FleetReader decoding a batch-256 run back: {back['samples_per_s']:,.0f} "
                 f"samples/s, {back['cpu_us_per_sample']:.2f} µs of its thread per sample; "
                 f"nats-server {back['server_cpu_us_per_message']:.1f} µs per message delivered."]
    loads = [r["load_average"] for r in results["forward"] + results["latency"]]
    rows += ["", f"1-minute load average during the runs: {min(loads):.1f} to {max(loads):.1f} "
             f"on {os.cpu_count()} CPUs."]
    return "\n".join(rows)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--reader":
        reader_process(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        sys.exit(0)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one repeat, short latency runs")
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument(
        "--rates", type=int, nargs="+", default=[250_000, 1_000_000, 4_000_000],
        help="offered samples/s (4 M is about the producer's peak here)",
    )
    parser.add_argument(
        "--parts", nargs="+", choices=("forward", "latency"), default=["forward", "latency"]
    )
    parser.add_argument(
        "--replicas", type=int, nargs="+", default=[1],
        help="stream replicas to measure, each in turn (above 1: on a 3-node cluster)",
    )
    cli = parser.parse_args()
    cli.repeat = 1 if cli.quick else 3
    cli.seconds = 1.0 if cli.quick else 3.0
    cli.latency_seconds = 2.0 if cli.quick else 5.0
    found = asyncio.run(main(cli))
    (BENCH / "fleet.json").write_text(json.dumps(found, indent=1))
    print(table(found))
