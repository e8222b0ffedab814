"""Closing while the producers write: nothing the kernel accepted is left behind.

Producers write flat out on both CPUs (a process pinned to each CPU per map, in runs
of the deterministic producer) while the stream closes, and go on after it. The BPF
side counts its outputs that succeeded, those that found the ring full (the kernel
counts them too) and those that found the map slot empty (``no_ring``: after the
close emptied it; nobody but the producer can count those). After the close and
after the producers stopped, for every map: samples delivered + lost reported ==
outputs that succeeded + outputs that found the ring full, exactly.
"""

from __future__ import annotations

import struct
import subprocess
import sys
import textwrap
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

import aperf
from aperf.testing import Producer

pytestmark = [pytest.mark.usefixtures("kernel")]
CPUS = (0, 1)
RUN = 20_000  # samples per run of the producer (a few ms on a CPU, preemption off)
PAGES = 256  # 1 MiB rings: 21,845 records of 48 bytes
# Above what drains of every full ring add (4 x 21,845 records), so that a consumer busy
# with its events still drains every ring, not only the first one it looks at.
MAX_PENDING = 1 << 17


class FlatOut:
    """The producers writing on every CPU of ``CPUS``, run after run, from ``start()``
    until ``stop()``: a process pinned to each CPU per producer (threads would take
    turns at the GIL with the consumer, and starve); each begins one more run once
    ``stop()`` was called, so that every producer wrote after the close."""

    SCRIPT = textwrap.dedent("""\
        import os, select, sys
        from aperf._native import libbpf as lb
        prog, cpu = int(sys.argv[1]), int(sys.argv[2])
        os.sched_setaffinity(0, {cpu})
        while True:
            last = bool(select.select([sys.stdin], [], [], 0)[0])  # stop(): stdin closed
            if lb.test_run_on_cpu(prog, cpu) != 0:
                sys.exit("the producer refused the run")
            if last:
                break
    """)

    def __init__(self, producers: list[Producer], *, target: int = 0) -> None:
        self._producers = producers
        self._target = target  # 0: the perf event array, 1: the BPF ring buffer
        self._processes: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        for producer in self._producers:
            prog = producer.object.programs["produce"].fd
            for cpu in CPUS:
                # count, size, first_seq, target (perf), rb_flags, discard_every, perf_flags
                producer.object.maps["config"].update(struct.pack("<I", cpu), struct.pack(
                    "<7Q", RUN, 32, 0, self._target, 0, 0, 0))
                self._processes.append(subprocess.Popen(
                    [sys.executable, "-c", self.SCRIPT, str(prog), str(cpu)],
                    stdin=subprocess.PIPE, pass_fds=[prog]))

    def stop(self) -> None:
        for process in self._processes:
            assert process.stdin is not None
            process.stdin.close()
        codes = [process.wait(timeout=120) for process in self._processes]
        assert codes == [0] * len(codes)


@pytest.fixture(params=[1, 2], ids=["one map", "two maps"])
def producers(request: pytest.FixtureRequest, kernel: None) -> Iterator[list[Producer]]:
    made: list[Producer] = []
    try:
        for _ in range(request.param):
            made.append(Producer())
        yield made
    finally:
        for producer in made:
            producer.close()


def source_of(producers: list[Producer]) -> Any:
    if len(producers) == 1:
        return producers[0].map
    return {f"m{index}": p.map for index, p in enumerate(producers)}


class Tally:
    """What the consumer got, by map (None: a stream of one map) and by CPU."""

    def __init__(self) -> None:
        self.samples: Counter[tuple[str | None, int]] = Counter()
        self.lost: Counter[str | None] = Counter()

    def add(self, event: Any) -> None:
        if isinstance(event, aperf.Sample):
            self.samples[event.map, event.cpu] += 1
        else:
            assert isinstance(event, aperf.Lost), event
            self.lost[event.map] += event.count

    def started(self, producers: list[Producer]) -> bool:
        """Samples from every producer on every CPU: all of them are writing."""
        maps = [None] if len(producers) == 1 else [f"m{i}" for i in range(len(producers))]
        return all(self.samples[name, cpu] for name in maps for cpu in CPUS)

    def check(self, producers: list[Producer]) -> None:
        for index, producer in enumerate(producers):
            name = None if len(producers) == 1 else f"m{index}"
            counters = producer.counters()
            assert counters.no_ring > 0  # it wrote on after the close
            full = counters.failed - counters.no_ring
            delivered = sum(n for (m, _), n in self.samples.items() if m == name)
            assert delivered + self.lost[name] == counters.ok + full, (
                name, delivered, self.lost[name], counters)


@pytest.mark.anyio
async def test_a_stream_closed_while_producers_write_leaves_nothing_behind(
    producers: list[Producer],
) -> None:
    tally = Tally()
    flat = FlatOut(producers)
    try:
        async with aperf.PerfStream(source_of(producers), pages=PAGES, cpus=list(CPUS),
                                    max_pending=MAX_PENDING) as stream:
            flat.start()
            with anyio.fail_after(120):
                async for batch in stream.batches():
                    for event in batch:
                        tally.add(event)
                    if not stream.closed and tally.started(producers):
                        await stream.aclose()  # the producers write on meanwhile
                        # what the close took out of the rings comes next, then the end
    finally:
        flat.stop()
    tally.check(producers)


def test_a_perf_buffer_closed_while_producers_write_leaves_nothing_behind(
    producers: list[Producer],
) -> None:
    """Closed from another thread (as at Ctrl-C) while poll() hands samples to the
    callbacks as fast as the producers write: the close gets in (the poll raises
    ClosedResourceError), and what it took out of the rings is handed over by the next
    calls."""
    tally = Tally()
    started = threading.Event()
    asked = threading.Event()
    after: list[int] = [0]

    def on_sample(sample: aperf.Sample[Any]) -> None:
        tally.add(sample)
        if not started.is_set() and tally.started(producers):
            started.set()
        if asked.is_set():
            after[0] += 1
            # Never once the close got in: poll() must let it in, not hand out the
            # producers' flood for ever (the queue and the rings hold 200 k at most).
            assert after[0] < 10_000_000, "close() never got in"

    def close() -> None:
        started.wait(timeout=300)
        asked.set()
        pb.close()

    flat = FlatOut(producers)
    pb = aperf.PerfBuffer(source_of(producers), pages=PAGES, cpus=list(CPUS),
                          max_pending=MAX_PENDING, on_sample=on_sample, on_lost=tally.add)
    closer = threading.Thread(target=close)
    try:
        flat.start()
        closer.start()
        with pytest.raises(aperf.ClosedResourceError, match="closed"):
            while True:
                pb.poll(100)
        closer.join()  # closed
        with pytest.raises(aperf.ClosedResourceError, match="is closed"):
            while True:  # what the close took out, then ClosedResourceError
                pb.consume()
    finally:
        pb.close()
        closer.join()
        flat.stop()
    assert started.is_set() and pb.statistics().pending == 0
    tally.check(producers)


def test_what_a_perf_buffer_closed_took_out_of_the_rings_is_handed_over_after(
    producer: Producer,
) -> None:
    """close() takes what the rings hold into the queue; poll() and consume() hand it
    to the callbacks after, then raise ClosedResourceError (the stream's iteration
    after aclose(), for callbacks)."""
    got: list[Any] = []
    pb = aperf.PerfBuffer(producer.map, pages=4, cpus=[0, 1], on_sample=got.append)
    producer.emit(10, cpu=0)
    producer.emit(5, cpu=1)
    pb.close()
    assert pb.statistics().pending == 15 and got == []
    assert pb.consume() == 15
    assert sorted(int.from_bytes(s.data[:8], "little") for s in got) == list(range(15))
    assert pb.statistics().pending == 0
    with pytest.raises(aperf.ClosedResourceError, match="closed"):
        pb.consume()
    with pytest.raises(aperf.ClosedResourceError, match="closed"):
        pb.poll(0)

    again = aperf.PerfBuffer(producer.map, pages=4, cpus=[0], on_sample=got.append)
    producer.emit(3, cpu=0)
    again.close()
    assert again.poll(1000) == 3 and len(got) == 18


@pytest.mark.anyio
async def test_a_ring_buffer_keeps_what_comes_after_the_close_for_its_next_reader(
    kernel: None,
) -> None:
    """A BPF ring buffer has no slots to empty: its ring is the map's memory, which the
    close does not free. What the producers write after the close's drain stays there,
    and the next reader of the map gets it: delivered by both == accepted, exactly."""
    counts = [0, 0]
    with Producer(ring="ringbuf", ringbuf_bytes=1 << 20) as producer:
        flat = FlatOut([producer], target=1)
        try:
            async with aperf.PerfStream(producer.map, max_pending=MAX_PENDING) as stream:
                flat.start()
                async for batch in stream.batches():
                    counts[0] += sum(isinstance(e, aperf.Sample) for e in batch)
                    if counts[0] and not stream.closed:
                        await stream.aclose()  # the producers write on meanwhile
        finally:
            flat.stop()
        accepted = producer.counters().ok
        assert accepted > counts[0]  # written after the close's drain

        def count(_: aperf.Sample[Any]) -> None:
            counts[1] += 1

        with aperf.PerfBuffer(producer.map, on_sample=count) as pb:
            while pb.consume():
                pass
    assert counts[0] + counts[1] == accepted
