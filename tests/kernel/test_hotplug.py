"""CPU hotplug on the kernel: CPU 1 goes offline and comes back under an open stream.

Each test takes CPU 1 offline for a moment (a few seconds at most) and brings it back
in a finalizer whatever happens (and conftest's session finish checks again). They
skip, with the reason, only where CPU 1's ``online`` file is not writable.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

import aperf
from aperf._native import libbpf as lb
from aperf.testing import Producer

from ..helpers import bring_cpus_online

ONLINE = Path("/sys/devices/system/cpu/cpu1/online")
N = 3000  # into a one-page ring, unread: about 100 fit, the rest are dropped
# Then one that carries the lost record (the kernel wakes the reader for it), then a few
# far below the kernel's half-ring wakeup: they wait in the ring.
K = 5
M = 50  # fits in the new one-page ring
PRIME_SIZE = 2036  # a perf record of 2048 bytes: 8 of header, 4 of size, the sample
# No wakeup, and no timer within a test: only the hotplug reads CPU 1 unasked.
NEVER = aperf.Wakeup(events=10**6, max_latency=3600.0)


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, object]]:
    # Not uvloop too: each run takes a CPU of a shared machine offline; asyncio and trio
    # watch added handles in different ways.
    return (request.param, {})


class Cpu1:
    """Takes CPU 1 offline and back."""

    @contextlib.contextmanager
    def offline(self) -> Iterator[None]:
        ONLINE.write_text("0")
        try:
            yield
        finally:
            ONLINE.write_text("1")


@pytest.fixture
def cpu1(kernel: None) -> Iterator[Cpu1]:
    if not ONLINE.exists() or not os.access(ONLINE, os.W_OK):
        pytest.skip(f"{ONLINE} is not writable here: CPU hotplug cannot be tested")
    if ONLINE.read_text().strip() != "1":
        pytest.skip("CPU 1 is offline")
    try:
        yield Cpu1()
    finally:
        bring_cpus_online(["cpu1"])
        assert ONLINE.read_text().strip() == "1"


def tally(events: list[object], cpu: int = 1) -> tuple[int, int]:
    samples = sum(1 for e in events if isinstance(e, aperf.Sample) and e.cpu == cpu)
    lost = sum(e.count for e in events if isinstance(e, aperf.Lost) and e.cpu == cpu)
    return samples, lost


def probe(producer: Producer) -> bool:
    """Emit one sample on CPU 1: whether the output succeeded (it fails while CPU 1 has
    no live ring: those failures are the BPF side's count, and only its)."""
    before = producer.counters().failed
    producer.emit(1, cpu=1)
    return producer.counters().failed == before


@pytest.mark.anyio
async def test_stream_drains_a_cpu_gone_offline_and_reads_it_when_back(
    cpu1: Cpu1, producer: Producer
) -> None:
    events: list[object] = []
    async with aperf.PerfStream(producer.map, pages=1, wakeup=NEVER) as stream:
        # The stream looks at CPU 1's ring once the loop armed its fd, when the loop gets
        # to it. With no wakeup and no tick to come, that look alone finds this sample:
        # once it is taken, the look is over. Its record is 2048 bytes, the kernel's
        # wakeup watermark (half the one-page ring): every later record then sits where
        # it would without it, relative to the watermark, and wakes the reader as then.
        producer.emit(1, size=PRIME_SIZE, cpu=1)
        with anyio.fail_after(10):
            while stream.statistics().cpus[1].samples < 1:
                await anyio.sleep(0.02)
        producer.emit(N, cpu=1)  # nothing reads meanwhile: the loop is blocked here
        dropped = producer.counters().failed
        assert dropped > 0
        with anyio.fail_after(10):
            while stream.statistics().cpus[1].samples < 1 + N - dropped:
                await anyio.sleep(0.02)  # the full ring woke the loop: drained
        producer.emit(1, cpu=1)
        total = 1 + N + 1
        with anyio.fail_after(10):
            while stream.statistics().cpus[1].samples < total - dropped:
                await anyio.sleep(0.02)  # woken for the lost record
        producer.emit(K, cpu=1)
        with cpu1.offline():
            with anyio.fail_after(10):
                while stream.statistics().cpus[1].samples < total - dropped + K:
                    await anyio.sleep(0.02)  # nothing wakes: the uevent makes it drain CPU 1
            with anyio.fail_after(10):
                async for event in stream:
                    events.append(event)
                    if sum(tally(events)) >= total + K:
                        break
            # Before CPU 1 is back: what the kernel wrote is delivered, what it dropped
            # counted, exactly.
            assert tally(events) == (total - dropped + K, dropped)
        # Back online: the stream opens a ring for it; until then outputs fail.
        failed = ok = 0
        with anyio.fail_after(10):
            while not probe(producer):
                failed += 1
                await anyio.sleep(0.02)  # the loop hears the uevent and opens the ring
        ok = 1
        producer.emit(M, cpu=1)
        stream.flush()
        with anyio.fail_after(10):
            async for event in stream:
                events.append(event)
                if sum(tally(events)) >= total + K + ok + M:
                    break
        stats = {c.cpu: c for c in stream.statistics().cpus}
    assert tally(events) == (total - dropped + K + ok + M, dropped)
    counters = producer.counters()
    assert counters.failed == dropped + failed
    assert counters.ok == total - dropped + K + ok + M
    assert (stats[1].samples, stats[1].lost) == (total - dropped + K + ok + M, dropped)
    assert not stats[1].broken


def test_perf_buffer_drains_a_cpu_gone_offline_and_reads_it_when_back(
    cpu1: Cpu1, producer: Producer
) -> None:
    events: list[object] = []
    with aperf.PerfBuffer(
        producer.map, pages=1, wakeup=NEVER, on_sample=events.append, on_lost=events.append
    ) as pb:
        producer.emit(N, cpu=1)
        dropped = producer.counters().failed
        deadline = time.monotonic() + 10
        while pb.statistics().cpus[1].samples < N - dropped and time.monotonic() < deadline:
            pb.poll(100)  # the full ring woke it
        producer.emit(1, cpu=1)
        total = N + 1
        deadline = time.monotonic() + 10
        while pb.statistics().cpus[1].samples < total - dropped and time.monotonic() < deadline:
            pb.poll(100)
        producer.emit(K, cpu=1)
        with cpu1.offline():
            deadline = time.monotonic() + 10
            while sum(tally(events)) < total + K and time.monotonic() < deadline:
                pb.poll(100)  # nothing wakes but the uevent
            assert tally(events) == (total - dropped + K, dropped)
        failed, ok, deadline = 0, 1, time.monotonic() + 10
        while not probe(producer):
            failed += 1
            assert time.monotonic() < deadline, "CPU 1 never got a ring back"
            pb.poll(20)  # hears the uevent and opens the ring
        producer.emit(M, cpu=1)
        pb.consume()
        deadline = time.monotonic() + 10
        while sum(tally(events)) < total + K + ok + M and time.monotonic() < deadline:
            pb.poll(100)
        assert 1 in pb.cpus
    assert tally(events) == (total - dropped + K + ok + M, dropped)
    assert producer.counters().failed == dropped + failed


def test_a_cpu_offline_at_open_gets_a_ring_and_its_lock_slot_when_it_comes_online(
    cpu1: Cpu1, producer: Producer
) -> None:
    events: list[object] = []
    with cpu1.offline():
        pb = aperf.PerfBuffer(producer.map, pages=1, on_sample=events.append)
    with pb:
        assert pb.cpus == [0]  # nothing for CPU 1 yet
        failed, deadline = 0, time.monotonic() + 10
        while not probe(producer):
            failed += 1
            assert time.monotonic() < deadline, "CPU 1 never got a ring"
            pb.poll(20)
        producer.emit(M, cpu=1)
        pb.consume()
        assert tally(events) == (1 + M, 0)
        assert pb.cpus == [0, 1]
        assert producer.counters().failed == failed
        # Slot 1 is this process's now: another process sees it locked by us.
        map_id = lb.object_id(producer.map.fd)[1]
        script = (
            "import sys; from aperf._rings.map_lock import LockDir, MapLock; "
            "m = MapLock(int(sys.argv[1]), 'probe', [1]); m._dir = LockDir(); m._open(); "
            "print([pid for pid, _ in m.holders()]); m.release()"
        )
        seen = subprocess.run([sys.executable, "-c", script, str(map_id)], check=True,
                              capture_output=True, text=True).stdout.strip()
        assert seen == f"[{os.getpid()}]"
