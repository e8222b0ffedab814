"""Leases: columnar batches viewing the perf rings' memory in place (docs/columnar.md).

Kernel tests: the producer writes exact counts; what a lease shows is checked
against its sequence numbers, and the ring space a lease (or a kept view) holds
is checked by what the producer can still write.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
from typing import Any

import anyio
import numpy as np
import pytest

import aperf
from aperf._rings.perf.lease_ring import _Pin
from aperf.testing import Producer

from ..helpers import BPF_DIR

pytestmark = [pytest.mark.usefixtures("kernel")]
BENCH_OBJECT = BPF_DIR / "bench_getpid.bpf.o"
RECORD32 = 48  # a 32-byte sample's perf record: 8 header + 4 size + 36 raw


def decoder(size: int) -> Any:
    with aperf.BPFObject(BENCH_OBJECT) as bench:
        return aperf.decoders.from_btf(bench, f"bench_sample{size}")


def seqs_of(batch: list[Any], cpus: dict[int, list[Any]], lost: list[int]) -> int:
    """Sort a batch's items into per-CPU seq arrays and lost counts; how many viewed the ring."""
    in_place = 0
    for item in batch:
        if isinstance(item, aperf.SampleArray):
            cpus.setdefault(item.cpu, []).append(item.values["seq"].copy())
            in_place += isinstance(item.values.base, _Pin)
        else:
            assert isinstance(item, aperf.Lost)
            lost.append(item.count)
    return in_place


def check_exact(cpus: dict[int, list[Any]], n: int) -> None:
    """CPU 0 got seqs 0..n-1, CPU 1 n..2n-1, each once, in ring order."""
    for cpu, first in ((0, 0), (1, n)):
        got = np.concatenate(cpus[cpu])
        assert got.tolist() == list(range(first, first + n))


@pytest.mark.anyio
@pytest.mark.parametrize("size", [32, 256])
async def test_leases_deliver_every_sample_in_place(producer: Producer, size: int) -> None:
    n = 1000
    async with aperf.PerfStream(producer.map, pages=256, decoder=decoder(size), cpus=[0, 1],
                                wakeup="throughput") as stream:
        producer.emit(n, size=size, cpu=0)
        producer.emit(n, size=size, cpu=1)
        cpus: dict[int, list[Any]] = {}
        lost: list[int] = []
        in_place = 0
        with anyio.fail_after(20):
            while sum(map(len, cpus.get(0, []))) + sum(map(len, cpus.get(1, []))) < 2 * n:
                async with stream.lease() as batch:
                    in_place += seqs_of(batch, cpus, lost)
        assert not lost
        assert in_place >= 2  # the ring, viewed: neither span wrapped in a fresh 1 MiB ring
        check_exact(cpus, n)
        assert [r.held_bytes() for r in stream._reader.rings.values()] == [0, 0]


@pytest.mark.parametrize("size", [32, 256])
def test_perf_buffer_leases_deliver_every_sample(producer: Producer, size: int) -> None:
    n = 1000
    with aperf.PerfBuffer(producer.map, pages=256, decoder=decoder(size), cpus=[0, 1],
                          on_array=print) as pb:
        producer.emit(n, size=size, cpu=0)
        producer.emit(n, size=size, cpu=1)
        cpus: dict[int, list[Any]] = {}
        lost: list[int] = []
        in_place = 0
        for _ in range(100):
            with pb.lease(timeout_ms=100) as batch:
                in_place += seqs_of(batch, cpus, lost)
            if sum(len(a) for arrays in cpus.values() for a in arrays) == 2 * n:
                break
        assert not lost and in_place >= 2
        check_exact(cpus, n)


@pytest.mark.anyio
async def test_overfilled_small_ring_counts_every_sample(producer: Producer) -> None:
    """Flat out into small rings, read through leases: received + lost == emitted."""
    n = 200_000
    async with aperf.PerfStream(producer.map, pages=16, decoder=decoder(32),
                                cpus=[1]) as stream:
        thread = producer.spawn(n, size=32, cpu=1, then_flush=True)
        cpus: dict[int, list[Any]] = {}
        lost: list[int] = []
        with anyio.fail_after(60):
            while sum(map(len, cpus.get(1, []))) + sum(lost) < n + 1:
                async with stream.lease(max_rows=4096) as batch:
                    seqs_of(batch, cpus, lost)
        await anyio.to_thread.run_sync(thread.join)
    got = np.concatenate(cpus[1])
    assert (np.diff(got) > 0).all()  # ring order, no duplicate
    counters = producer.counters()
    assert len(got) + sum(lost) == n + 1 == counters.ok + counters.failed
    assert sum(lost) == counters.failed


@pytest.mark.parametrize("size", [32, 256])
def test_spans_that_wrap_around_the_ring(producer: Producer, size: int) -> None:
    """A one-page ring read many times over: spans cross its end in every place (such a
    span is copied, the others viewed); every record comes out once, in order."""
    record = RECORD32 if size == 32 else 272
    counts = [1 + (7 * i) % (4096 // record) for i in range(120)]
    with aperf.PerfBuffer(producer.map, pages=1, decoder=decoder(size), cpus=[0],
                          on_array=print) as pb:
        seq = 0
        in_place = 0
        for count in counts:
            producer.emit(count, size=size, cpu=0)
            got: dict[int, list[Any]] = {}
            lost: list[int] = []
            with pb.lease(timeout_ms=1000) as batch:
                in_place += seqs_of(batch, got, lost)
            assert not lost
            assert np.concatenate(got[0]).tolist() == list(range(seq, seq + count))
            seq += count
        assert 0 < in_place < len(counts)  # the spans that did not wrap were viewed


@pytest.mark.anyio
async def test_lease_holds_the_ring_space_until_it_ends(producer: Producer) -> None:
    """A one-page ring, full, leased: the producer fails until the lease ends."""
    fits = 4096 // RECORD32  # 85 records of 48 bytes in 4096
    async with aperf.PerfStream(producer.map, pages=1, decoder=decoder(32),
                                cpus=[0]) as stream:
        producer.emit(fits, size=32, cpu=0)
        async with stream.lease() as batch:
            assert [len(a) for a in batch] == [fits]
            assert isinstance(batch[0].values.base, _Pin)
            producer.emit(1, size=32, cpu=0)
            assert producer.counters().failed == 1  # full: nothing was released
        assert batch == []  # emptied when the lease ended
        producer.emit(10, size=32, cpu=0)
        counters = producer.counters()
        assert (counters.ok, counters.failed) == (fits + 10, 1)
        async with stream.lease() as batch:
            assert isinstance(batch[0], aperf.Lost) and batch[0].count == 1
            assert batch[1].values["seq"].tolist() == list(range(fits + 1, fits + 11))


async def lease_what_is_there(stream: Any, counts: dict[str, int]) -> None:
    """Lease whatever the rings hold now (never waits): samples and lost counts added up."""
    while stream.flush():
        async with stream.lease() as batch:
            for entry in batch:
                if isinstance(entry, aperf.Lost):
                    counts["lost"] += entry.count
                else:
                    counts["received"] += len(entry)


@pytest.mark.anyio
async def test_a_kept_view_keeps_its_records_and_the_item_raises(producer: Producer) -> None:
    """After its lease, an array kept shows its own records however often the producer
    writes (its ring space is held until it is dropped); the batch's item raises."""
    async with aperf.PerfStream(producer.map, pages=4, decoder=decoder(32),
                                cpus=[0]) as stream:
        producer.emit(100, size=32, cpu=0)
        async with stream.lease() as batch:
            item = batch[0]
            kept = item.values  # a NumPy view of the ring, kept past the lease
        with pytest.raises(aperf.ClosedResourceError, match="lease ended"):
            _ = item.values
        with pytest.raises(aperf.ClosedResourceError):
            len(item)
        assert isinstance(kept.base, _Pin)
        counts = {"lost": 0, "received": 0}
        for _ in range(20):  # 20 x 9.6 KiB of samples through a 16 KiB ring
            producer.emit(200, size=32, cpu=0)
            await lease_what_is_there(stream, counts)
            assert kept["seq"].tolist() == list(range(100))  # its own records
        ring = stream._reader.rings[0]
        assert ring.held_bytes() >= 100 * RECORD32  # still held: the producer failed
        stuck = producer.counters()
        assert stuck.failed > 0 and stuck.ok < 100 + 20 * 200
        del kept, item
        gc.collect()
        await lease_what_is_there(stream, counts)  # the ring is looked at: space released
        assert ring.held_bytes() == 0
        producer.emit(1, size=32, cpu=0)  # fits now, after the lost record
        await lease_what_is_there(stream, counts)
        counters = producer.counters()
        assert counters.ok == stuck.ok + 1
        assert counts == {"received": counters.ok - 100, "lost": counters.failed}


@pytest.mark.anyio
async def test_other_rings_are_read_while_a_lease_is_held(producer: Producer) -> None:
    """A lease holds only its spans: a lease taken inside it reads and releases another
    ring's new samples, the outer one's ring stays held until the outer lease ends."""
    async with aperf.PerfStream(producer.map, pages=4, decoder=decoder(32),
                                cpus=[0, 1]) as stream:
        producer.emit(10, size=32, cpu=0)
        rings = stream._reader.rings
        async with stream.lease() as outer:
            assert [(a.cpu, len(a)) for a in outer] == [(0, 10)]
            producer.emit(20, size=32, cpu=1)
            async with stream.lease() as inner:
                assert [(a.cpu, a.values["seq"].tolist()) for a in inner] == [
                    (1, list(range(10, 30)))]
            assert rings[1].held_bytes() == 0
            assert rings[0].held_bytes() == 10 * RECORD32
            assert outer[0].values["seq"].tolist() == list(range(10))
        assert rings[0].held_bytes() == 0


@pytest.mark.anyio
async def test_other_consumers_after_a_lease(producer: Producer) -> None:
    """After a stream's first lease, events and arrays() still come out exact: events
    are built from (copied out of) the ring, arrays view it."""
    async with aperf.PerfStream(producer.map, pages=4, decoder=decoder(32),
                                cpus=[0]) as stream:
        producer.emit(5, size=32, cpu=0)
        async with stream.lease() as batch:
            assert batch[0].values["seq"].tolist() == list(range(5))
        producer.emit(5, size=32, cpu=0)
        events = []
        with anyio.fail_after(20):
            async for event in stream:
                events.append(event)
                if len(events) == 5:
                    break
        assert [e.value.seq for e in events] == list(range(5, 10))
        assert all(type(e.data) is bytes and len(e.data) == 36 for e in events)
        producer.emit(5, size=32, cpu=0)
        with anyio.fail_after(20):
            item = await stream.arrays().__anext__()
        assert isinstance(item.values.base, _Pin)
        assert item.values["seq"].tolist() == list(range(10, 15))


def run_script(body: str) -> str:
    """Run ``body`` in a fresh interpreter (a crash there is a failed test, not ours)."""
    script = textwrap.dedent(f"""\
        import asyncio, gc, os, sys, threading
        import numpy as np
        import aperf
        from aperf.testing import Producer
        with aperf.BPFObject({str(BENCH_OBJECT)!r}) as bench:
            DECODER = aperf.decoders.from_btf(bench, "bench_sample32")
    """) + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr)
    return done.stdout


def test_closing_the_stream_during_a_lease_keeps_the_mapping(kernel: None) -> None:
    """aclose() inside a lease: the views stay readable, with their records, during the
    lease and after it (a view kept); a new stream on the map recycles nothing of it."""
    out = run_script("""
        async def main():
            with Producer() as p:
                stream = aperf.PerfStream(p.map, pages=1, decoder=DECODER, cpus=[0])
                await stream.open()
                p.emit(80, size=32, cpu=0)
                async with stream.lease() as batch:
                    kept = batch[0].values
                    await stream.aclose()
                    assert stream.closed
                    assert batch[0].values["seq"].tolist() == list(range(80))
                gc.collect()
                assert kept["seq"].tolist() == list(range(80))
                async with aperf.PerfStream(p.map, pages=1, decoder=DECODER, cpus=[0]) as again:
                    for _ in range(10):
                        p.emit(80, size=32, cpu=0)
                        async with again.lease() as batch:
                            pass
                assert kept["seq"].tolist() == list(range(80))
                del kept
                gc.collect()
            print("ok")
        asyncio.run(main())
    """)
    assert out.strip() == "ok"


def test_closing_a_perf_buffer_from_another_thread_during_a_lease(kernel: None) -> None:
    out = run_script("""
        with Producer() as p:
            pb = aperf.PerfBuffer(p.map, pages=1, decoder=DECODER, cpus=[0], on_array=print)
            p.emit(80, size=32, cpu=0)
            with pb.lease() as batch:
                values = batch[0].values
                closer = threading.Thread(target=pb.close)
                closer.start()
                closer.join()
                assert pb.closed
                assert values["seq"].tolist() == list(range(80))
            try:
                batch_after = pb.lease()
            except aperf.ClosedResourceError:
                pass
            else:
                raise AssertionError("a lease on a closed buffer")
            assert values["seq"].tolist() == list(range(80))
        print("ok")
    """)
    assert out.strip() == "ok"


def test_a_forked_child_keeps_the_leased_records(kernel: None) -> None:
    """fork inside a lease: the child's views hold the records as they were at the fork
    (a private copy: the ring is not mapped into children), its stream is inert; the
    parent's lease and stream go on unchanged."""
    out = run_script("""
        async def main():
            with Producer() as p:
                async with aperf.PerfStream(p.map, pages=4, decoder=DECODER, cpus=[0]) as s:
                    p.emit(100, size=32, cpu=0)
                    async with s.lease() as batch:
                        values = batch[0].values
                        pid = os.fork()
                        if pid == 0:
                            code = 1
                            try:
                                assert values["seq"].tolist() == list(range(100))
                                try:
                                    values.setflags(write=True)
                                except ValueError:
                                    pass  # the child's copy is as read-only as the ring
                                else:
                                    raise AssertionError("writable in the child")
                                try:
                                    s.statistics()
                                except aperf.ClosedResourceError:
                                    code = 0
                            finally:
                                os._exit(code)
                        _, status = os.waitpid(pid, 0)
                        assert os.waitstatus_to_exitcode(status) == 0, status
                        assert values["seq"].tolist() == list(range(100))
                    del values
                    p.emit(100, size=32, cpu=0)
                    async with s.lease() as batch:
                        assert batch[0].values["seq"].tolist() == list(range(100, 200))
            print("ok")
        asyncio.run(main())
    """)
    assert out.strip() == "ok"


@pytest.mark.anyio
async def test_a_ring_buffer_lease_copies(kernel: None) -> None:
    """A BPF ring buffer is leased as arrays() reads it: copied, every sample delivered."""
    with Producer(ring="ringbuf") as producer:
        async with aperf.PerfStream(producer.source(), decoder=decoder(32)) as stream:
            producer.emit(500, size=32, cpu=0)
            cpus: dict[int, list[Any]] = {}
            lost: list[int] = []
            in_place = 0
            with anyio.fail_after(20):
                while sum(map(len, cpus.get(-1, []))) < 500:
                    async with stream.lease() as batch:
                        in_place += seqs_of(batch, cpus, lost)
        assert in_place == 0 and not lost
        assert np.concatenate(cpus[-1]).tolist() == list(range(500))


def test_lease_needs_a_decoder_with_a_layout(producer: Producer) -> None:
    with aperf.PerfBuffer(producer.map, pages=1, cpus=[0], on_sample=print) as pb, \
            pytest.raises(TypeError, match="layout"):
        pb.lease()
    with aperf.PerfBuffer(producer.map, pages=1, cpus=[0], decoder=decoder(32),
                          on_array=print) as pb, pytest.raises(ValueError, match="max_rows"):
        pb.lease(max_rows=0)


def test_fork_hook_copies_the_live_mappings_then_forgets_the_copies(producer: Producer) -> None:
    """Before a fork every live mapping is copied (for the child); the parent drops the
    copies after it (unit test of the hooks, on a leased buffer's two rings)."""
    from aperf._native.libc import shared_ring as _shared_ring

    with aperf.PerfBuffer(producer.map, pages=1, decoder=decoder(32), cpus=[0, 1],
                          on_array=print) as pb, pb.lease(timeout_ms=0):
        live = {address: prot for _, _, address, prot in _shared_ring._live.values()}
        _shared_ring._before_fork()
        try:
            saved = {address: (data, prot) for address, data, prot in _shared_ring._saved}
            assert live.keys() <= saved.keys() and len(live) >= 4  # two mappings a ring
            # The read-only mapping whole (views), the read-write one's control page only.
            assert sorted((len(saved[a][0]), saved[a][1]) for a in live) == [
                (4096, 3), (4096, 3), (2 * 4096, 1), (2 * 4096, 1)]
        finally:
            _shared_ring._after_fork_in_parent()
        assert _shared_ring._saved == []


def test_lease_views_cannot_be_made_writable(kernel: None) -> None:
    """A lease's arrays view ring memory the kernel lets nobody write (a write there is
    SIGBUS, not an exception): every way to a writable view of them is refused, for the
    arrays in the lease, their columns, slices, views and bases, and arrays kept after
    the lease and after close; the interpreter survives (a crash fails the test)."""
    out = run_script("""
        import ctypes
        from numpy.lib.stride_tricks import as_strided

        def refused(what, attempt, errors=(ValueError,)):
            try:
                attempt()
            except errors:
                return
            raise AssertionError(f"{what}: a writable view of the ring was made")

        def read_only(what, arr):
            assert not arr.flags.writeable, what
            refused(what + ".setflags", lambda: arr.setflags(write=True))
            refused(what + " write", lambda: arr.__setitem__(..., arr[...]))
            refused(what + " asarray", lambda: np.asarray(arr).setflags(write=True))
            refused(what + " frombuffer", lambda: np.frombuffer(arr, np.uint8).setflags(write=True))
            refused(what + " ndarray(buffer=)",
                    lambda: np.ndarray(arr.nbytes, np.uint8, buffer=arr).setflags(write=True))
            refused(what + " as_strided",
                    lambda: as_strided(arr, writeable=True).setflags(write=True))
            view = memoryview(arr)
            assert view.readonly, what
            refused(what + " memoryview", lambda: view.cast("B").__setitem__(0, 0), (TypeError,))
            refused(what + " ctypes",
                    lambda: (ctypes.c_char * arr.nbytes).from_buffer(arr), (TypeError,))

        def every_way(arr):
            read_only("values", arr)
            read_only("column", arr["seq"])
            read_only("slice", arr[1::3])
            read_only("column slice", arr["ts"][2:])
            read_only("byte view", arr.view(np.uint8))
            read_only("view of a view", arr["seq"][::2].view(np.int64)[1:])
            base, depth = arr, 0
            while isinstance(base, np.ndarray):
                read_only(f"base {depth}", base)
                base, depth = base.base, depth + 1
            assert depth >= 2, depth  # the values, then the ring's bytes they view
            assert memoryview(base).readonly
            read_only("the mapping", np.frombuffer(base, np.uint8))

        def check(batch, first):
            assert isinstance(batch[0], aperf.SampleArray), batch
            values = batch[0].values
            assert values["seq"].tolist() == list(range(first, first + 50))
            every_way(values)
            return values

        kept = []
        with Producer() as p:
            with aperf.PerfBuffer(p.map, pages=4, decoder=DECODER, cpus=[0],
                                  on_array=print) as pb:
                p.emit(50, size=32, cpu=0)
                with pb.lease(timeout_ms=1000) as batch:
                    kept.append(check(batch, 0))
                every_way(kept[-1])  # kept past its lease

            async def main():
                async with aperf.PerfStream(p.map, pages=4, decoder=DECODER, cpus=[1]) as s:
                    p.emit(50, size=32, cpu=1)
                    async with s.lease() as batch:
                        kept.append(check(batch, 50))
                    every_way(kept[-1])
                every_way(kept[-1])  # and past the stream's close
            asyncio.run(main())
        gc.collect()
        for first, values in zip((0, 50), kept):
            every_way(values)
            assert values["seq"].tolist() == list(range(first, first + 50))
        print("ok")
    """)
    assert out.strip() == "ok"
