"""Reliability on the real kernel: fork, garbage collection, closing from other
threads, the architecture-neutral read path, and open/close soak."""

from __future__ import annotations

import asyncio
import gc
import os
import random
import signal
import subprocess
import sys
import threading
import time
import warnings
from typing import Any

import anyio
import pytest

import aperf
from aperf.testing import Producer

from ..helpers import REPO, open_fds

CPU = sorted(os.sched_getaffinity(0))[-1]
pytestmark = pytest.mark.usefixtures("kernel")


def seq(event: Any) -> int:
    return int.from_bytes(event.data[:8], "little")


def child(check: Any) -> int:
    """Run ``check()`` in a forked child; its exit status (a signal shows as -signum)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 1
        try:
            check()
            code = 0
        except BaseException as exc:
            os.write(2, f"child failed: {exc!r}\n".encode())
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


# --- fork ----------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_forked_child_cannot_use_an_inherited_stream_and_closing_it_spares_the_parent(
    producer: Producer,
) -> None:
    async with aperf.PerfStream(producer.map, pages=8) as stream:
        producer.emit(5, cpu=CPU)
        stream.flush()

        def in_child() -> None:
            with pytest.raises(aperf.ClosedResourceError, match="inherited across fork"):
                stream.statistics()
            with pytest.raises(aperf.ClosedResourceError, match="inherited across fork"):
                stream.flush()
            stream.close()  # releases the child's fds only: no crash, no slot deleted
            assert stream.closed

        assert child(in_child) == 0
        producer.emit(5, cpu=CPU)  # the parent's slots are intact
        stream.flush()
        got = [seq(e) async for e in _take(stream, 10)]
    assert got == list(range(10))


async def _take(stream: aperf.PerfStream[Any], count: int) -> Any:
    n = 0
    async for event in stream:
        yield event
        n += 1
        if n == count:
            return


def test_forked_child_closing_an_inherited_buffer_spares_the_parent(producer: Producer) -> None:
    got: list[int] = []
    with aperf.PerfBuffer(producer.map, pages=8, on_sample=lambda e: got.append(seq(e))) as pb:

        def in_child() -> None:
            with pytest.raises(aperf.ClosedResourceError, match="inherited across fork"):
                pb.poll(0)
            pb.close()

        assert child(in_child) == 0
        producer.emit(100, cpu=CPU)
        while len(got) < 100:
            assert pb.poll(1000) > 0
    assert got == list(range(100))


def test_a_child_that_lets_an_inherited_buffer_be_collected_spares_the_parent(
    producer: Producer,
) -> None:
    got: list[int] = []
    pb = aperf.PerfBuffer(producer.map, pages=8, on_sample=lambda e: got.append(seq(e)))

    def in_child() -> None:
        nonlocal pb
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            del pb
            gc.collect()

    assert child(in_child) == 0
    producer.emit(10, cpu=CPU)
    assert pb.poll(1000) == 10
    pb.close()


# --- garbage collection -------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_dropped_stream_is_released_with_a_resource_warning(producer: Producer) -> None:
    before = open_fds()
    stream = aperf.PerfStream(producer.map, pages=8)
    await stream.open()
    assert open_fds() > before
    with pytest.warns(ResourceWarning, match="unclosed PerfStream"):
        del stream
        gc.collect()
    assert open_fds() == before
    async with aperf.PerfStream(producer.map, pages=8) as again:  # the map is free again
        producer.emit(3, cpu=CPU)
        again.flush()
        assert [seq(e) async for e in _take(again, 3)] == [0, 1, 2]


def test_a_dropped_buffer_is_released_with_a_resource_warning(producer: Producer) -> None:
    before = open_fds()
    pb = aperf.PerfBuffer(producer.map, pages=8, on_sample=print)
    with pytest.warns(ResourceWarning, match="unclosed PerfBuffer"):
        del pb
        gc.collect()
    assert open_fds() == before
    with aperf.PerfBuffer(producer.map, pages=8, on_sample=lambda e: None) as again:
        producer.emit(2, cpu=CPU)
        assert again.consume() == 2


# --- threads ---------------------------------------------------------------------------------


def test_close_from_another_thread_during_poll_is_clean(producer: Producer) -> None:
    rng = random.Random(7)
    outcomes: dict[str, int] = {}
    for trial in range(150):
        pb = aperf.PerfBuffer(producer.map, pages=1, on_sample=lambda e: None)
        result: list[str] = []

        timeout = -1 if trial % 2 else 5

        def poller(pb: aperf.PerfBuffer[None] = pb, result: list[str] = result,
                   timeout: int = timeout) -> None:
            try:
                while True:
                    pb.poll(timeout)
            except aperf.ClosedResourceError:
                result.append("closed")
            except BaseException as exc:  # anything else is the bug this test is for
                result.append(repr(exc))

        thread = threading.Thread(target=poller)
        thread.start()
        if trial % 3 == 0:
            producer.emit(rng.randrange(1, 50), cpu=CPU)
        time.sleep(rng.random() * 0.003)
        pb.close()
        thread.join(2)
        assert not thread.is_alive(), "poll() did not return after close()"
        outcomes[result[0]] = outcomes.get(result[0], 0) + 1
    assert outcomes == {"closed": 150}


@pytest.mark.anyio
async def test_close_from_a_thread_after_the_loop_stopped_does_not_hang(
    producer: Producer,
) -> None:
    # An asyncio loop of its own, stopped with the stream open (trio: test_stream_drivers.py).
    def run() -> bool:
        loop = asyncio.new_event_loop()
        stream = aperf.PerfStream(producer.map, pages=8)
        loop.run_until_complete(stream.open())
        # The loop is stopped: close() from another thread must not wait for it (that
        # would take CLOSE_TIMEOUT, 10 s; the join is a hang guard below it, not a speed test).
        closer = threading.Thread(target=stream.close)
        closer.start()
        closer.join(5)
        loop.close()
        return stream.closed and not closer.is_alive()

    assert await anyio.to_thread.run_sync(run)


# --- the architecture-neutral read path ----------------------------------------------------------


@pytest.mark.anyio
async def test_libbpf_read_path_is_exact(
    producer: Producer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What non-x86-64 machines use: libbpf's reader copies the records (barriers in C).
    monkeypatch.setenv("APERF_RING_ACCESS", "libbpf")
    n = 20_000
    seqs: list[int] = []
    lost = 0
    async with aperf.PerfStream(producer.map, pages=4, max_pending=500) as stream:
        thread = producer.spawn(n, size=48, cpu=CPU)
        await anyio.to_thread.run_sync(thread.join)
        async for event in stream:
            if isinstance(event, aperf.Lost):
                lost += event.count
            else:
                seqs.append(seq(event))
            if len(seqs) + lost >= n:
                break
    counters = producer.counters()
    assert len(seqs) == counters.ok and lost == counters.failed and counters.ok + lost == n
    assert seqs == sorted(seqs)


def test_unknown_ring_access_setting_is_refused(
    producer: Producer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("APERF_RING_ACCESS", "fast")
    with pytest.raises(ValueError, match="APERF_RING_ACCESS"):
        aperf.PerfBuffer(producer.map, on_sample=print)


# --- soak ----------------------------------------------------------------------------------


SOAK = r"""
import asyncio, gc, os, sys
import aperf
from aperf.testing import FakeRingSource, Producer

def rss_kb():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))

def fds():
    return len(os.listdir("/proc/self/fd"))

async def streams(source, n):
    for _ in range(n):
        pages = None if isinstance(source, FakeRingSource) else 1
        async with aperf.PerfStream(source, pages=pages) as s:
            s.flush()

def buffers(source, n):
    for _ in range(n):
        with aperf.PerfBuffer(source, on_sample=lambda e: None) as b:
            b.consume()

with Producer() as producer:
    fake = FakeRingSource(cpus=[0, 1])
    for kind, run in [
        ("stream", lambda n: asyncio.run(streams(producer.map, n))),
        ("buffer", lambda n: buffers(producer.map, n)),
        ("fake-stream", lambda n: asyncio.run(streams(fake, n))),
        ("fake-buffer", lambda n: buffers(fake, n)),
    ]:
        run(50)
        gc.collect()
        before_rss, before_fds = rss_kb(), fds()
        run(1000)
        gc.collect()
        print(kind, rss_kb() - before_rss, fds() - before_fds, flush=True)
"""


def test_1000_open_close_cycles_of_each_kind_leave_fds_and_rss_flat() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SOAK], capture_output=True, text=True, timeout=300, cwd=REPO,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    rows = {kind: (int(rss), int(fds)) for kind, rss, fds in
            (line.split() for line in out.stdout.splitlines())}
    assert set(rows) == {"stream", "buffer", "fake-stream", "fake-buffer"}
    for kind, (rss_kb, fds) in rows.items():
        assert fds == 0, kind
        assert rss_kb < 5 * 1024, f"{kind}: RSS grew {rss_kb} kB over 1000 cycles"


def test_sigterm_is_not_needed_to_free_rings_at_exit(producer: Producer) -> None:
    # A process that exits with a stream open (no close, no GC before exit) must
    # not crash at interpreter shutdown.
    code = (
        "import asyncio, aperf\n"
        "from aperf.testing import Producer\n"
        "p = Producer()\n"
        "async def main():\n"
        "    global s\n"
        "    s = aperf.PerfStream(p.map, pages=1)\n"
        "    await s.open()\n"
        "asyncio.run(main())\n"
    )
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True,
                         text=True, timeout=60, cwd=REPO, check=False)
    assert out.returncode == 0, out.stderr
    assert out.returncode != -signal.SIGSEGV
