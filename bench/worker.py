"""One aperf consumer of the benchmark, alone in its process (started by bench/run.py).

usage: python bench/worker.py SPEC_JSON

SPEC_JSON fields:
  map        path of the pinned map to read (a perf event array or a BPF ring buffer:
             aperf tells them apart by the map's type)
  mode       "aiter" (async for), "batches" (stream.batches()), "callback"
             (run(on_sample)), "on_batch" (run_batches(on_batch)), "sync" (PerfBuffer.poll),
             "slow" (async for that sleeps 1 ms at every timed sample, for the memory
             scenario); columnar (NumPy arrays): "arrays" (stream.arrays()), "on_array"
             (run_arrays(on_array)), "sync_array" (PerfBuffer(on_array=...).poll), "lease"
             (async with stream.lease() as batch), "sync_lease" (with PerfBuffer.lease())
  loop       "asyncio", "uvloop" or "trio" (all three through anyio.run; the consumer
             code is the same, aperf picks its loop binding)
  decoder    null (raw bytes), "btf" (from_btf on bench_getpid.bpf.o), "struct",
             "ctypes" (a ctypes.Structure mirror of the same struct)
  size       sample size in bytes (32 or 256): picks the decoded type
  max_items  batches(max_items=...), absent for aperf's default
  channels   open this many rings, ring k on CPU k % 2 in map slot k (cpus=, map_keys=)
  wakeup     null (aperf's default), a preset name, "every:N", or "strict" (the
             default's timer without its idle stretch: Wakeup.balanced(idle_latency=0.001))
  pages      pages per CPU ring, null for aperf's default
  cpu        the CPU to pin this process to
  lat_every  take the latency of every lat_every-th sample (a power of two)
  lat_path   where to write those latencies (array('q'), native endian)
  btf_object path of bench_getpid.bpf.o

Protocol: that of bench/common.py; on SIGUSR1 (anyio's signal receiver) the stream
is closed, which hands over what the rings still hold. The per-sample work is the
same in every mode: count it, and for every lat_every-th sample read its timestamp (the raw bytes at
offset 8, or the decoded ``ts`` field) against ``time.monotonic_ns()``, which reads
the clock bpf_ktime_get_ns() reads. Columnar consumers do it a whole array at a
time: count its rows, and read the ``ts`` column of those of them that fall on a
lat_every-th sample (one clock reading per array).
"""

from __future__ import annotations

import ctypes
import signal
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import anyio
from anyio.abc import TaskStatus
from common import Tally, rss_kb, start

import aperf

Sample = aperf.Sample
_TS = struct.Struct("<8xQ")
STRUCT_FORMATS = {32: "<QQQQ", 256: "<QQII16s200sQQ"}
BTF_TYPES = {32: "bench_sample32", 256: "bench_sample256"}
SLOW_PAUSE = 0.001  # the "slow" consumer's sleep at every timed sample
LOOPS: dict[str, tuple[str, dict[str, Any]]] = {
    "asyncio": ("asyncio", {}),
    "uvloop": ("asyncio", {"use_uvloop": True}),
    "trio": ("trio", {}),
}


class Sample32(ctypes.Structure):
    """struct bench_sample32 (bpf/bench.h), as a ctypes user would declare it."""

    _fields_ = (("seq", ctypes.c_uint64), ("ts", ctypes.c_uint64),
                ("pid_tgid", ctypes.c_uint64), ("cpu", ctypes.c_uint64))


class Sample256(ctypes.Structure):
    """struct bench_sample256 (bpf/bench.h)."""

    _fields_ = (("seq", ctypes.c_uint64), ("ts", ctypes.c_uint64), ("pid", ctypes.c_uint32),
                ("tgid", ctypes.c_uint32), ("comm", ctypes.c_char * 16),
                ("path", ctypes.c_char * 200), ("a", ctypes.c_uint64), ("b", ctypes.c_uint64))


CTYPES = {32: Sample32, 256: Sample256}


def make_decoder(spec: dict[str, Any]) -> Any:
    kind = spec.get("decoder")
    if kind is None:
        return None
    if kind == "struct":
        return struct.Struct(STRUCT_FORMATS[spec["size"]])
    if kind == "ctypes":
        return CTYPES[spec["size"]]
    if kind == "btf":
        with aperf.BPFObject(spec["btf_object"]) as obj:
            return aperf.decoders.from_btf(obj, BTF_TYPES[spec["size"]])
    raise ValueError(f"unknown decoder {kind!r}")


def make_wakeup(text: str | None) -> Any:
    if text is None:
        return None
    if text.startswith("every:"):
        return aperf.Wakeup.every(int(text.split(":", 1)[1]))
    if text == "strict":
        return aperf.Wakeup.balanced(idle_latency=0.001)
    return text


def timestamp_getter(spec: dict[str, Any]) -> Callable[[Any], int]:
    """sample -> its ktime ns, read the way a user of that decoder would."""
    kind = spec.get("decoder")
    if kind is None:
        ts_of = _TS.unpack_from
        return lambda ev: ts_of(ev.data)[0]
    if kind == "struct":
        return lambda ev: ev.value[1]
    return lambda ev: ev.value.ts


# --- the consumers ------------------------------------------------------------------------
# The per-sample body stands inline in each loop, as a user would write it.


async def consume_aiter(stream: aperf.PerfStream, t: Tally, ts_of: Callable[[Any], int],
                        pause: float = 0.0) -> None:
    """``async for``; with ``pause``, a sleep at every timed sample (the slow consumer)."""
    n = lost = 0
    mask, lat, mono, last = t.mask, t.lat, time.monotonic_ns, 0
    try:
        async for ev in stream:
            if ev.__class__ is Sample:
                n += 1
                if not n & mask:
                    last = mono()
                    lat.append(last - ts_of(ev))
                    if pause:
                        await anyio.sleep(pause)
            else:
                lost += ev.count
    finally:
        t.samples, t.lost, t.t_last = n, lost, last


def batch_counter(t: Tally, ts_of: Callable[[Any], int]) -> Callable[[list[Any]], None]:
    """A function counting a batch of events into ``t``: ``on_batch``, and the body
    of the ``batches()`` loop."""
    mask, lat, mono = t.mask, t.lat, time.monotonic_ns

    def on_batch(batch: list[Any]) -> None:
        n, lost, last = t.samples, t.lost, t.t_last
        for ev in batch:
            if ev.__class__ is Sample:
                n += 1
                if not n & mask:
                    last = mono()
                    lat.append(last - ts_of(ev))
            else:
                lost += ev.count
        t.samples, t.lost, t.t_last = n, lost, last

    return on_batch


def array_counter(t: Tally) -> Callable[[Any], None]:
    """A function counting one item of a columnar consumer (an array, or a lost notice)
    into ``t``: ``on_array``/``on_lost``, and the body of the ``arrays()`` loop."""
    every, lat, mono = t.mask + 1, t.lat, time.monotonic_ns
    sample_array = aperf.SampleArray

    def on_item(item: Any) -> None:
        if item.__class__ is not sample_array:
            t.lost += item.count
            return
        before = t.samples
        rows = len(item)
        t.samples = before + rows
        first = every - before % every - 1  # the row that is the next lat_every-th sample
        if first < rows:
            t.t_last = now = mono()
            lat.extend((now - item.values["ts"][first::every].astype("int64")).tolist())

    return on_item


def sample_callbacks(t: Tally, ts_of: Callable[[Any], int]) -> dict[str, Any]:
    """``on_sample`` and ``on_lost`` counting into ``t``."""
    mask, lat, mono = t.mask, t.lat, time.monotonic_ns

    def on_sample(ev: Any) -> None:
        t.samples += 1
        if not t.samples & mask:
            t.t_last = now = mono()
            lat.append(now - ts_of(ev))

    def on_lost(ev: Any) -> None:
        t.lost += ev.count

    return {"on_sample": on_sample, "on_lost": on_lost}


async def sample_rss(series: list[tuple[float, int]], start: float) -> None:
    while True:
        series.append((round(time.monotonic() - start, 3), rss_kb()))
        await anyio.sleep(1.0)


def ring_options(spec: dict[str, Any]) -> dict[str, Any]:
    """What PerfStream and PerfBuffer take alike from the spec."""
    options = {"pages": spec.get("pages"), "decoder": make_decoder(spec),
               "wakeup": make_wakeup(spec.get("wakeup"))}
    if spec.get("order_by"):
        options["order_by"] = spec["order_by"]
    if spec.get("channels"):
        options["cpus"] = [k % 2 for k in range(spec["channels"])]
        options["map_keys"] = list(range(spec["channels"]))
    return options


async def run_async(spec: dict[str, Any], t: Tally, rss: list[tuple[float, int]],
                    ) -> aperf.StreamStatistics:
    mode = spec["mode"]
    ts_of = timestamp_getter(spec)
    stream = aperf.PerfStream(spec["map"], **ring_options(spec))
    stats: list[aperf.StreamStatistics] = []

    async def finish_on_signal(*, task_status: TaskStatus[None]) -> None:
        with anyio.open_signal_receiver(signal.SIGUSR1) as signals:
            task_status.started()
            async for _ in signals:
                stats.append(stream.statistics())  # before close: counters of the open stream
                await stream.aclose()
                return

    async with stream, anyio.create_task_group() as tg:
        await tg.start(finish_on_signal)
        if mode == "slow":
            tg.start_soon(sample_rss, rss, time.monotonic())
        # A columnar consumer sets up (and imports NumPy) before it says it is ready: a
        # program imports its libraries at start.
        arrays = stream.arrays() if mode in ("arrays", "on_array") else None
        if mode == "lease":
            stream.lease()  # switches the rings to in-place reads; not entered
        t.ready()
        if mode in ("aiter", "slow"):
            await consume_aiter(stream, t, ts_of, SLOW_PAUSE if mode == "slow" else 0.0)
        elif mode == "batches":
            count = batch_counter(t, ts_of)
            sizing = {"max_items": spec["max_items"]} if spec.get("max_items") else {}
            async for batch in stream.batches(**sizing):
                count(batch)
        elif mode == "callback":
            callbacks = sample_callbacks(t, ts_of)
            await stream.run(callbacks["on_sample"], on_lost=callbacks["on_lost"])
        elif mode == "on_batch":
            await stream.run_batches(batch_counter(t, ts_of))
        elif mode == "on_array":
            count_item = array_counter(t)
            await stream.run_arrays(count_item, on_lost=count_item)
        elif mode == "lease":
            count_item = array_counter(t)
            while True:
                async with stream.lease() as batch:
                    if not batch:
                        break  # closed, nothing left
                    for item in batch:
                        count_item(item)
        elif arrays is not None:
            count_item = array_counter(t)
            async for item in arrays:
                count_item(item)
        else:
            raise ValueError(f"unknown mode {mode!r}")
        tg.cancel_scope.cancel()  # the RSS sampler; the signal task has returned
    return stats[0]


def run_sync(spec: dict[str, Any], t: Tally) -> aperf.StreamStatistics:
    finished = threading.Event()
    signal.signal(signal.SIGUSR1, lambda *_: finished.set())
    if spec["mode"] in ("sync_array", "sync_lease"):
        count_item = array_counter(t)
        callbacks = {"on_array": count_item, "on_lost": count_item}
    else:
        callbacks = sample_callbacks(t, timestamp_getter(spec))
    with aperf.PerfBuffer(spec["map"], **ring_options(spec), **callbacks) as pb:
        t.ready()
        while not finished.is_set():
            if spec["mode"] == "sync_lease":
                with pb.lease(timeout_ms=10) as batch:
                    for item in batch:
                        callbacks["on_array"](item)
            else:
                pb.poll(timeout_ms=10)
        pb.consume()
        return pb.statistics()


def main() -> None:
    spec = start()
    t = Tally(spec.get("lat_every", 64))
    rss: list[tuple[float, int]] = []
    if spec["mode"] in ("sync", "sync_array", "sync_lease"):
        stats = run_sync(spec, t)
    else:
        backend, options = LOOPS[spec["loop"]]
        stats = anyio.run(run_async, spec, t, rss, backend=backend, backend_options=options)
    t.report(spec["lat_path"], wakeups=stats.wakeups, ring_bytes=stats.ring_bytes,
             memory_bytes=stats.memory_bytes, drain_period=stats.drain_period,
             rss_series=rss, fast_path=stats.fast_path)


if __name__ == "__main__":
    main()
