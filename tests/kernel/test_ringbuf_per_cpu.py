"""Per-CPU BPF ring buffers (issue 33, feature 2): a ``BPF_MAP_TYPE_ARRAY_OF_MAPS`` of ring
buffers, one per CPU, read as one stream, each ring keyed by its CPU. The kernel writes
every sample (bpf/buffers.bpf.c, through ``<aperf/buffer.bpf.h>``'s
``APERF_RINGBUF_PER_CPU`` or into a map filled by hand): exact counts and exact drops per
ring, time order across the rings, every reading mode, on asyncio, uvloop and trio."""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import threading
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import anyio
import pytest

import aperf
from aperf._native import libbpf as lb

from ..helpers import require_kernel, run_until
from .buffers_producer import Buffers, seq, stamp

pytestmark = [pytest.mark.usefixtures("kernel")]
CPUS = sorted(os.sched_getaffinity(0))
N = 2000  # samples per CPU
BIG = 1 << 20  # each CPU's ring: room for a whole burst (the kernel outruns any reader)
BPF_MAP_TYPE_RINGBUF = 27
# Ordered tests hold an event until every ring that still has records has passed it, or
# for this long: far beyond any stall of a busy machine, so that order never depends on
# the machine's load (the default, 0.1 s, is what the stream is for; test_ordered.py
# tests the bound itself).
LATENESS = 60.0


class Ev(ctypes.Structure):
    _fields_ = [("seq", ctypes.c_uint64), ("ts", ctypes.c_uint64)]


@contextlib.contextmanager
def rings(ring_bytes: int | None = BIG) -> Iterator[Buffers]:
    require_kernel()
    with Buffers(ring_bytes=ring_bytes) as buffers:
        yield buffers


def first_seq(cpu: int) -> int:
    return cpu * 1_000_000


def emit_all(buffers: Buffers, n: int = N, target: str = "rings") -> None:
    for cpu in CPUS:
        buffers.emit(n, cpu=cpu, target=target, first_seq=first_seq(cpu))


def spawn_all(buffers: Buffers) -> threading.Thread:
    thread = threading.Thread(target=emit_all, args=(buffers,))
    thread.start()
    return thread


class Seen:
    """Samples and drops per ring (by ``Sample.cpu``/``Lost.cpu``)."""

    def __init__(self) -> None:
        self.seqs: dict[int, list[int]] = {}
        self.lost: dict[int, int] = {}
        self.order: list[tuple[int, int]] = []  # (stamp, cpu) as delivered

    def add(self, event: Any) -> None:
        if isinstance(event, aperf.Sample):
            value = event.value
            s, t = (value.seq, value.ts) if value is not None else (seq(event), stamp(event))
            self.seqs.setdefault(event.cpu, []).append(s)
            self.order.append((t, event.cpu))
        elif isinstance(event, aperf.Lost):
            self.lost[event.cpu] = self.lost.get(event.cpu, 0) + event.count
        else:  # pragma: no cover - would be a bug
            raise AssertionError(f"unexpected event {event!r}")

    def add_array(self, item: Any) -> None:
        if isinstance(item, aperf.SampleArray):
            cpus = item.cpus.tolist() if item.cpus is not None else [item.cpu] * len(item)
            for s, t, cpu in zip(item.values["seq"].tolist(), item.values["ts"].tolist(), cpus,
                                 strict=True):
                self.seqs.setdefault(cpu, []).append(s)
                self.order.append((t, cpu))
        else:
            self.add(item)

    @property
    def total(self) -> int:
        return sum(map(len, self.seqs.values())) + sum(self.lost.values())


def assert_every_sample(seen: Seen, n: int = N) -> None:
    assert seen.seqs == {cpu: list(range(first_seq(cpu), first_seq(cpu) + n)) for cpu in CPUS}
    assert seen.lost == {}


async def read_until(items: Any, add: Callable[[Any], None], seen: Seen, total: int) -> None:
    with anyio.fail_after(20):
        async for item in items:
            add(item)
            if seen.total >= total:
                return


@pytest.mark.anyio
async def test_every_ring_is_read_as_one_stream_keyed_by_its_cpu() -> None:
    with rings() as buffers:
        seen = Seen()
        async with aperf.PerfStream(buffers.obj.maps["rings"]) as stream:
            # The loader put a ring in the slot of every possible CPU.
            assert stream.cpus == list(range(lb.libbpf_num_possible_cpus()))
            thread = spawn_all(buffers)  # read while the kernel writes
            await read_until(stream, seen.add, seen, N * len(CPUS))
            await anyio.to_thread.run_sync(thread.join)
            stats = stream.statistics()
        counts = buffers.counts()
    assert_every_sample(seen)
    assert (counts.ok, counts.failed) == (N * len(CPUS), 0)
    assert {c.cpu: c.samples for c in stats.cpus} == dict.fromkeys(CPUS, N)
    assert stats.lost == 0 and stats.lost_counter == "exact"  # the header counts drops
    assert stats.ring_bytes == BIG
    assert stats.memory_bytes == len(CPUS) * (BIG + 2 * 4096)


@pytest.mark.anyio
async def test_drops_are_exact_per_ring() -> None:
    with rings(ring_bytes=4096) as buffers:
        seen = Seen()
        busy, quiet = CPUS[-1], CPUS[0]
        async with aperf.PerfStream(buffers.obj.maps["rings"]) as stream:
            # On this thread: nobody reads meanwhile. One ring overflows, the other not.
            buffers.emit(N, cpu=busy, target="rings", first_seq=first_seq(busy))
            if quiet != busy:
                buffers.emit(20, cpu=quiet, target="rings", first_seq=first_seq(quiet))
            total = N + (20 if quiet != busy else 0)
            await read_until(stream, seen.add, seen, total)
            stats = stream.statistics()
        drops = buffers.obj.read_global("aperf_ringbuf_dropped__rings")
        counts = buffers.counts()
    assert counts.failed > 0 and counts.ok + counts.failed == total
    assert seen.lost == {busy: drops[busy]} and drops[busy] == counts.failed
    assert len(seen.seqs[busy]) + seen.lost[busy] == N
    assert seen.seqs[busy] == sorted(seen.seqs[busy])
    if quiet != busy:
        assert seen.seqs[quiet] == list(range(first_seq(quiet), first_seq(quiet) + 20))
        assert drops[quiet] == 0
    per_cpu = {c.cpu: c.lost for c in stats.cpus}
    assert per_cpu[busy] == counts.failed and stats.lost_counter == "exact"


@pytest.mark.anyio
async def test_ordered_across_the_rings() -> None:
    if len(CPUS) < 2:
        pytest.skip("needs two CPUs")
    rounds, n = 5, 200
    with rings() as buffers:
        seen = Seen()
        async with aperf.PerfStream(buffers.obj.maps["rings"], decoder=Ev, order_by="ts",
                                    lateness=LATENESS) as stream:
            for r in range(rounds):
                for i, cpu in enumerate(CPUS * 2):  # A, B, A, B: stamps interleave
                    buffers.emit(n, cpu=cpu, target="rings",
                                 first_seq=first_seq(cpu) + (2 * r + i // len(CPUS)) * n)
                await read_until(stream, seen.add, seen, (r + 1) * 2 * n * len(CPUS))
            stats = stream.statistics()
    stamps = [t for t, _ in seen.order]
    assert all(a <= b for a, b in itertools.pairwise(stamps)), "out of time order"
    assert sum(a != b for (_, a), (_, b) in itertools.pairwise(seen.order)) >= 4 * rounds - 1
    assert_every_sample(seen, 2 * rounds * n)
    assert stats.late == 0 and stats.pending == 0


@pytest.mark.anyio
async def test_ordered_arrays_across_the_rings() -> None:
    pytest.importorskip("numpy")
    if len(CPUS) < 2:
        pytest.skip("needs two CPUs")
    n = 300
    with rings() as buffers:
        seen = Seen()
        async with aperf.PerfStream(buffers.obj.maps["rings"], decoder=Ev, order_by="ts",
                                    lateness=LATENESS) as stream:
            for i, cpu in enumerate(CPUS * 2):
                buffers.emit(n, cpu=cpu, target="rings",
                             first_seq=first_seq(cpu) + (i // len(CPUS)) * n)
            await read_until(stream.arrays(), seen.add_array, seen, 2 * n * len(CPUS))
    assert all(a <= b for a, b in itertools.pairwise(t for t, _ in seen.order))
    assert_every_sample(seen, 2 * n)


MODES = ["async-for", "batches", "arrays", "lease", "run", "run_batches", "run_arrays"]


@pytest.mark.anyio
@pytest.mark.parametrize("mode", MODES)
async def test_every_reading_mode(mode: str) -> None:
    if "array" in mode or mode == "lease":
        pytest.importorskip("numpy")
    total = N * len(CPUS)
    with rings() as buffers:
        seen = Seen()
        async with aperf.PerfStream(buffers.obj.maps["rings"], decoder=Ev) as stream:
            if mode.startswith("run"):
                done = anyio.Event()

                def check() -> None:
                    if seen.total >= total:
                        done.set()

                def on_sample(event: Any) -> None:
                    seen.add(event)
                    check()

                def on_batch(batch: list[Any]) -> None:
                    for event in batch:
                        seen.add(event)
                    check()

                def on_array(array: Any) -> None:
                    seen.add_array(array)
                    check()

                run = {"run": partial(stream.run, on_sample, on_lost=seen.add),
                       "run_batches": partial(stream.run_batches, on_batch),
                       "run_arrays": partial(stream.run_arrays, on_array,
                                             on_lost=seen.add)}[mode]
                await run_until(stream, run, done, lambda: spawn_all(buffers))
            else:
                emit_all(buffers)  # every ring holds its burst before the first read
                if mode == "async-for":
                    await read_until(stream, seen.add, seen, total)
                elif mode == "batches":
                    with anyio.fail_after(20):
                        async for batch in stream.batches(max_items=300):
                            assert len(batch) <= 300
                            for event in batch:
                                seen.add(event)
                            if seen.total >= total:
                                break
                elif mode == "arrays":
                    await read_until(stream.arrays(), seen.add_array, seen, total)
                else:
                    with anyio.fail_after(20):
                        while seen.total < total:
                            async with stream.lease() as batch:
                                for item in batch:
                                    seen.add_array(item)
    assert_every_sample(seen)


@pytest.mark.parametrize("how", ["poll", "consume"])
def test_sync_buffer_reads_every_ring(how: str) -> None:
    with rings() as buffers:
        seen = Seen()
        with aperf.PerfBuffer(buffers.obj.maps["rings"], on_sample=seen.add,
                              on_lost=seen.add) as pb:
            assert pb.cpus == list(range(lb.libbpf_num_possible_cpus()))
            emit_all(buffers)
            for _ in range(200):
                if seen.total >= N * len(CPUS):
                    break
                pb.poll(100) if how == "poll" else pb.consume()
    assert_every_sample(seen)


@contextlib.contextmanager
def filled_by_hand(buffers: Buffers, size: int) -> Iterator[None]:
    """Put a ring buffer of our own making in each CPU's slot of ``user_rings`` (Falco's
    way); the outer map holds them from then on."""
    outer = buffers.obj.maps["user_rings"]
    for cpu in CPUS:
        fd = lb.create_map(BPF_MAP_TYPE_RINGBUF, f"user_{cpu}", 0, 0, size)
        try:
            outer.update(cpu.to_bytes(4, "little"), fd.to_bytes(4, "little"))
        finally:
            os.close(fd)
    yield


@pytest.mark.anyio
async def test_a_map_filled_by_hand_with_the_programs_own_drop_count() -> None:
    with rings() as buffers:
        user_rings = buffers.obj.maps["user_rings"]
        with pytest.raises(aperf.MapTypeError, match="slots are empty"):
            async with aperf.PerfStream(user_rings):
                pass  # pragma: no cover - the open fails
        with filled_by_hand(buffers, 4096):
            seen = Seen()

            def dropped(cpu: int) -> int:
                return int(buffers.obj.read_global("user_dropped")[cpu])

            source = aperf.RingBufferArraySource(user_rings, dropped=dropped)
            async with aperf.PerfStream(source) as stream:
                emit_all(buffers, target="user_rings")  # 4 KiB rings: most are dropped
                await read_until(stream, seen.add, seen, N * len(CPUS))
                stats = stream.statistics()
            counts = buffers.counts()
            by_cpu = {cpu: dropped(cpu) for cpu in CPUS}
    assert counts.failed > 0
    assert sum(seen.lost.values()) == counts.failed == stats.lost
    for cpu in CPUS:
        assert len(seen.seqs[cpu]) + seen.lost[cpu] == N
    assert seen.lost == by_cpu


@pytest.mark.anyio
async def test_without_a_drop_count_none_is_invented() -> None:
    with rings(ring_bytes=4096) as buffers:
        seen = Seen()
        # A map fd, not the object's map: nothing says where the program counts drops.
        async with aperf.PerfStream(buffers.obj.maps["rings"].fd) as stream:
            buffers.emit(N, cpu=CPUS[0], target="rings", first_seq=first_seq(CPUS[0]))
            ok = buffers.counts().ok
            await read_until(stream, seen.add, seen, ok)
            stats = stream.statistics()
    assert seen.lost == {} and stats.lost_counter == "none"
    assert len(seen.seqs[CPUS[0]]) == ok < N


def test_ring_sizes_are_the_maps_own() -> None:
    with rings() as buffers:
        stream = aperf.PerfStream(buffers.obj.maps["rings"], pages=8)
        with pytest.raises(aperf.RingSizeError, match="leave them out"):
            anyio.run(stream.open)
        with pytest.raises(aperf.ObjectStateError, match="before load"):
            buffers.obj.maps["rings"].set_inner_max_entries(8192)
    with aperf.BPFObject(buffers_object()) as obj, pytest.raises(
        aperf.ObjectStateError, match="APERF_RINGBUF_PER_CPU"
    ):
        obj.maps["user_rings"].set_inner_max_entries(8192)


def buffers_object() -> str:
    from .buffers_producer import OBJECT

    return str(OBJECT)
