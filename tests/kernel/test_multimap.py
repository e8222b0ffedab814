"""Several maps in one stream, against the kernel: a perf event array and a BPF ring
buffer (or two perf event arrays), each fed by its own producer, read by one
``PerfStream``/``PerfBuffer``. Every sample arrives once, says its map and its real
CPU, and is decoded by its own map's decoder; losses are exact per map and CPU, in
every reading mode, on asyncio, uvloop and trio."""

from __future__ import annotations

import ctypes
import os
import struct
from collections import defaultdict
from collections.abc import Iterator
from functools import partial
from typing import Any

import anyio
import pytest

import aperf
from aperf.testing import Producer, object_path

from ..helpers import require_kernel

pytestmark = [pytest.mark.usefixtures("kernel"), pytest.mark.anyio]
CPUS = sorted(os.sched_getaffinity(0))[:2]
N = 500  # samples per CPU per map
PERF = struct.Struct("<QQ")


class Rec(ctypes.Structure):
    _fields_ = [("seq", ctypes.c_uint64), ("ts", ctypes.c_uint64)]


@pytest.fixture
def perf() -> Iterator[Producer]:
    require_kernel()
    if len(CPUS) < 2:
        pytest.skip("needs two CPUs")
    with Producer() as p:
        yield p


@pytest.fixture
def ringbuf() -> Iterator[Producer]:
    require_kernel()
    with Producer(ring="ringbuf") as p:
        yield p


def seq_of(data: bytes) -> int:
    return int.from_bytes(data[:8], "little")


class Seen:
    """What a consumer saw, per (map, cpu): sequence numbers in order, and lost counts."""

    def __init__(self) -> None:
        self.seqs: dict[tuple[str | None, int], list[int]] = defaultdict(list)
        self.lost: dict[tuple[str | None, int], int] = defaultdict(int)

    def add(self, event: Any) -> None:
        where = (event.map, event.cpu)
        if isinstance(event, aperf.Sample):
            seq = seq_of(event.data)
            if event.map == "events":
                assert event.value == PERF.unpack(event.data[:16])  # its map's decoder
            elif event.map == "rb":
                assert event.value is None  # raw
            self.seqs[where].append(seq)
        elif isinstance(event, aperf.Lost):
            self.lost[where] += event.count
        elif isinstance(event, aperf.SampleArray):
            values = event.values
            first = values.dtype.names[0]
            self.seqs[where].extend(int(s) for s in values[first])
            ts = values[values.dtype.names[1]]
            assert len(ts) == len(event) and all(int(t) > 0 for t in ts)
        else:  # pragma: no cover - would be a bug
            raise AssertionError(f"unexpected event {event!r}")

    def total(self, name: str) -> int:
        return sum(len(v) for (m, _), v in self.seqs.items() if m == name) + sum(
            v for (m, _), v in self.lost.items() if m == name)


def emit_both(perf: Producer, ringbuf: Producer, n: int = N) -> None:
    for cpu in CPUS:
        perf.emit(n, size=32, cpu=cpu)
        ringbuf.emit(n, size=32, cpu=cpu)


def assert_all_once(seen: Seen, n: int = N) -> None:
    for index, cpu in enumerate(CPUS):
        assert seen.seqs["events", cpu] == list(range(index * n, (index + 1) * n))
    assert seen.seqs["rb", aperf.NO_CPU] == list(range(len(CPUS) * n))
    assert set(seen.seqs) == {("events", cpu) for cpu in CPUS} | {("rb", aperf.NO_CPU)}
    assert not seen.lost


def assert_statistics(stats: aperf.StreamStatistics, seen: Seen) -> None:
    by_ring = {(c.map, c.cpu): c for c in stats.cpus}
    assert set(by_ring) == set(seen.seqs) | set(seen.lost)
    for where, ring in by_ring.items():
        assert ring.samples == len(seen.seqs[where])
        assert ring.lost == seen.lost[where]
    per_map = stats.by_map()
    assert set(per_map) == {"events", "rb"}
    assert per_map["rb"].samples == len(seen.seqs["rb", aperf.NO_CPU])
    assert per_map["events"].lost == sum(v for (m, _), v in seen.lost.items() if m == "events")


MODES = ["iter", "batches", "run", "run_batches", "arrays", "run_arrays"]


@pytest.mark.parametrize("mode", MODES)
async def test_a_perf_event_array_and_a_ring_buffer_in_one_stream(
    perf: Producer, ringbuf: Producer, mode: str,
) -> None:
    columnar = "arrays" in mode
    # Raw for the ring buffer, but arrays need a layout: a ctypes structure there.
    decoder = {"events": PERF, "rb": Rec} if columnar else {"events": PERF}
    seen = Seen()
    expected = 2 * len(CPUS) * N
    done = anyio.Event()

    def add(event: Any) -> None:
        seen.add(event)
        if seen.total("events") + seen.total("rb") >= expected:
            done.set()

    async with aperf.PerfStream({"events": perf.map, "rb": ringbuf.source()},
                                decoder=decoder, pages=64) as stream:
        assert stream.cpus == sorted({aperf.NO_CPU, *CPUS})
        emit_both(perf, ringbuf)
        with anyio.fail_after(20):
            if mode == "iter":
                async for event in stream:
                    add(event)
                    if done.is_set():
                        break
            elif mode == "batches":
                async for batch in stream.batches(max_items=100):
                    assert len(batch) <= 100
                    for event in batch:
                        add(event)
                    if done.is_set():
                        break
            elif mode == "arrays":
                async for item in stream.arrays(max_rows=64):
                    add(item)
                    if done.is_set():
                        break
            else:
                run = {
                    "run": partial(stream.run, add, on_lost=add),
                    "run_batches": partial(stream.run_batches, lambda b: [add(e) for e in b]),
                    "run_arrays": partial(stream.run_arrays, add, on_lost=add),
                }[mode]
                async with anyio.create_task_group() as tg:
                    tg.start_soon(run)
                    await done.wait()
                    stats = stream.statistics()
                    await stream.aclose()
        if mode in ("iter", "batches", "arrays"):
            stats = stream.statistics()
    assert_all_once(seen)
    assert_statistics(stats, seen)


async def test_two_perf_event_arrays_in_one_stream(perf: Producer) -> None:
    with Producer() as other:
        with pytest.raises(ValueError, match="'samples'"):  # both maps are named so
            aperf.PerfStream([perf.map, other.map])
        seen: dict[tuple[str | None, int], list[Any]] = defaultdict(list)
        async with aperf.PerfStream({"a": perf.map, "b": other.map},
                                    decoder={"b": PERF}) as stream:
            for cpu in CPUS:
                perf.emit(N, cpu=cpu)
                other.emit(N, cpu=cpu)
            with anyio.fail_after(20):
                async for event in stream:
                    seen[event.map, event.cpu].append(event)
                    if sum(map(len, seen.values())) == 4 * N:
                        break
            stats = stream.statistics()
    for index, cpu in enumerate(CPUS):
        wanted = list(range(index * N, (index + 1) * N))
        assert [seq_of(e.data) for e in seen["a", cpu]] == wanted
        assert [e.value[0] for e in seen["b", cpu]] == wanted
        assert all(e.value is None for e in seen["a", cpu])
    assert {(c.map, c.cpu): c.samples for c in stats.cpus} == {
        (m, cpu): N for m in "ab" for cpu in CPUS}


async def test_cpus_choose_the_perf_rings_and_pages_need_a_perf_map(
    perf: Producer, ringbuf: Producer,
) -> None:
    with pytest.raises(aperf.UnsupportedError, match="every map here is a BPF ring buffer"):
        aperf.PerfStream({"rb": ringbuf.map}, pages=8)
    async with aperf.PerfStream({"events": perf.map, "rb": ringbuf.map}, cpus=[CPUS[1]],
                                pages=8) as stream:
        assert stream.cpus == [aperf.NO_CPU, CPUS[1]]
        assert {(c.map, c.cpu) for c in stream.statistics().cpus} == {
            ("events", CPUS[1]), ("rb", aperf.NO_CPU)}
        per_map = stream.statistics().by_map()
        assert per_map["events"].ring_bytes == 8 * 4096
        assert per_map["rb"].ring_bytes == ringbuf.map.max_entries
        assert per_map["events"].lost_counter == "exact"
        assert per_map["rb"].lost_counter == "none"  # the map alone: no BPF-side count
        assert stream.statistics().ring_bytes == max(8 * 4096, ringbuf.map.max_entries)
        perf.emit(4, cpu=CPUS[0])  # no ring there: -ENOENT, the BPF side's count
        perf.emit(3, cpu=CPUS[1])
        ringbuf.emit(2, cpu=CPUS[0])
        got = []
        with anyio.fail_after(20):
            async for event in stream:
                got.append((event.map, event.cpu))
                if len(got) == 5:
                    break
    assert perf.counters().failed == 4
    assert sorted(got) == [("events", CPUS[1])] * 3 + [("rb", aperf.NO_CPU)] * 2


async def test_pause_and_resume_every_perf_event_array(perf: Producer) -> None:
    with Producer() as other:
        async with aperf.PerfStream({"a": perf.map, "b": other.map}) as stream:
            stream.pause()
            perf.emit(5, cpu=CPUS[0])
            other.emit(5, cpu=CPUS[1])
            assert (perf.counters().failed, other.counters().failed) == (5, 5)  # -ENOENT
            stream.resume()
            perf.emit(3, cpu=CPUS[0])
            other.emit(2, cpu=CPUS[1])
            got = []
            with anyio.fail_after(20):
                async for event in stream:
                    got.append((event.map, event.cpu))
                    if len(got) == 5:
                        break
            assert stream.statistics().lost == 0  # the BPF side counted those, not the rings
    assert sorted(got) == [("a", CPUS[0])] * 3 + [("b", CPUS[1])] * 2


async def test_losses_are_exact_per_map_and_cpu() -> None:
    require_kernel()
    if len(CPUS) < 2:
        pytest.skip("needs two CPUs")
    n_perf, n_rb = 3000, 4000
    with Producer() as perf, Producer(ring="ringbuf", ringbuf_bytes=1 << 16) as ringbuf:
        seen = Seen()
        async with aperf.PerfStream({"events": perf.map, "rb": ringbuf.source()},
                                    decoder={"events": PERF}, pages=1) as stream:
            # Nobody reads while the loop's thread emits: both small rings overflow.
            for cpu in CPUS:
                perf.emit(n_perf, size=32, cpu=cpu)
            ringbuf.emit(n_rb, size=32, cpu=CPUS[0])
            with anyio.fail_after(20):
                async for event in stream:
                    seen.add(event)
                    if (seen.total("events"), seen.total("rb")) == (
                            len(CPUS) * n_perf, n_rb):
                        break
            stats = stream.statistics()
            perf_counts, rb_counts = perf.counters(), ringbuf.counters()
            # A flush sample per perf ring: the kernel writes the lost record in front of
            # it, which announces drops already reported from the exact count: absorbed,
            # per map and CPU, not counted twice.
            for cpu in CPUS:
                perf.emit(1, size=32, cpu=cpu, first_seq=n_perf * 10 + cpu)
            flushed = Seen()
            with anyio.fail_after(20):
                async for event in stream:
                    flushed.add(event)
                    if flushed.total("events") == len(CPUS):
                        break
            assert not flushed.lost
            assert sorted(flushed.seqs) == [("events", cpu) for cpu in CPUS]
            assert stream.statistics().lost == stats.lost
    # Per map: received + lost == emitted, and the producers' own counts agree.
    assert perf_counts.failed > 0 and rb_counts.failed > 0
    for cpu in CPUS:
        assert len(seen.seqs["events", cpu]) + seen.lost["events", cpu] == n_perf
        assert seen.lost["events", cpu] > 0
        got = seen.seqs["events", cpu]
        assert got == sorted(got)
    assert sum(v for (m, _), v in seen.lost.items() if m == "events") == perf_counts.failed
    assert sum(len(v) for (m, _), v in seen.seqs.items() if m == "events") == perf_counts.ok
    assert seen.lost["rb", aperf.NO_CPU] == rb_counts.failed
    assert len(seen.seqs["rb", aperf.NO_CPU]) == rb_counts.ok
    assert rb_counts.ok + rb_counts.failed == n_rb
    assert_statistics(stats, seen)
    assert stats.lost == perf_counts.failed + rb_counts.failed


def test_perf_buffer_over_two_maps(perf: Producer, ringbuf: Producer) -> None:
    seen = Seen()
    expected = 2 * len(CPUS) * N
    with aperf.PerfBuffer({"events": perf.map, "rb": ringbuf.source()},
                          decoder={"events": PERF}, on_sample=seen.add,
                          on_lost=seen.add) as pb:
        assert pb.cpus == sorted({aperf.NO_CPU, *CPUS})
        assert pb.buffer_cnt == len(CPUS) + 1
        emit_both(perf, ringbuf)
        for _ in range(200):
            pb.poll(100)
            if seen.total("events") + seen.total("rb") >= expected:
                break
        stats = pb.statistics()
    assert_all_once(seen)
    assert_statistics(stats, seen)


def test_perf_buffer_arrays_over_two_maps(perf: Producer, ringbuf: Producer) -> None:
    seen = Seen()
    expected = 2 * len(CPUS) * N
    with aperf.PerfBuffer({"events": perf.map, "rb": ringbuf.source()},
                          decoder={"events": PERF, "rb": Rec}, on_array=seen.add,
                          on_lost=seen.add) as pb:
        emit_both(perf, ringbuf)
        for _ in range(200):
            pb.poll(100)
            if seen.total("events") + seen.total("rb") >= expected:
                break
        stats = pb.statistics()
    assert_all_once(seen)
    assert_statistics(stats, seen)


def test_perf_buffer_losses_per_map_and_cpu(perf: Producer) -> None:
    n = 3000
    with Producer(ring="ringbuf", ringbuf_bytes=1 << 16) as ringbuf:
        seen = Seen()
        with aperf.PerfBuffer({"events": perf.map, "rb": ringbuf.source()}, pages=1,
                              decoder={"events": PERF}, on_sample=seen.add,
                              on_lost=seen.add) as pb:
            for cpu in CPUS:
                perf.emit(n, size=32, cpu=cpu)
            ringbuf.emit(n, size=32, cpu=CPUS[-1])
            for _ in range(200):
                pb.poll(100)
                if (seen.total("events"), seen.total("rb")) == (len(CPUS) * n, n):
                    break
            stats = pb.statistics()
        rb_counts = ringbuf.counters()
    perf_counts = perf.counters()
    for cpu in CPUS:
        assert len(seen.seqs["events", cpu]) + seen.lost["events", cpu] == n
    assert sum(v for (m, _), v in seen.lost.items() if m == "events") == perf_counts.failed
    assert seen.lost["rb", aperf.NO_CPU] == rb_counts.failed > 0
    assert len(seen.seqs["rb", aperf.NO_CPU]) == rb_counts.ok
    assert_statistics(stats, seen)


async def test_two_objects_each_map_decoded_by_its_own_btf() -> None:
    """The brief's example: a perf event array of one object and a ring buffer of
    another, each decoded by the name of a struct in its own object's BTF."""
    import subprocess

    require_kernel()
    with aperf.BPFObject(object_path("bootstrap_legacy")) as legacy, \
            aperf.BPFObject(object_path("bootstrap")) as modern:
        legacy.load()
        modern.load()
        source = {"events": legacy.maps["perf_buffer"], "rb": modern.maps["rb"]}
        async with aperf.PerfStream(source, decoder={"events": "event", "rb": "event"}) as stream:
            members = stream._options.source.members  # type: ignore[attr-defined]
            assert [m.source.object for m in members] == [legacy, modern]
            legacy.attach()
            modern.attach()
            child = await anyio.to_thread.run_sync(
                lambda: subprocess.Popen(["/bin/true"]))
            await anyio.to_thread.run_sync(child.wait)
            seen: set[tuple[str, bool]] = set()
            with anyio.fail_after(20):
                async for event in stream:
                    if isinstance(event, aperf.Sample) and event.value.pid == child.pid:
                        assert event.cpu >= 0 if event.map == "events" else event.cpu == -1
                        seen.add((event.map, bool(event.value.exit_event)))
                        if len(seen) == 4:
                            break
    assert seen == {("events", False), ("events", True), ("rb", False), ("rb", True)}
