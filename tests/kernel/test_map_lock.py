"""Two aperf readers of one map in two processes: refused, or taken over on request.

Each holder is a real process (tests/kernel/map_holder.py) reading a pinned map; the
test process is the second reader. The kernel produces the samples (Producer).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import aperf
from aperf._native import libbpf as lb
from aperf.testing import Producer, sample_header

HOLDER = Path(__file__).resolve().parent / "map_holder.py"
BUSY_LINE = "is read by pid {pid} "


class Holder:
    """A reader of ``pin`` in a child process; its stdout lines, read by a thread."""

    def __init__(self, pin: str, mode: str, *, fork: bool = False) -> None:
        argv = [sys.executable, str(HOLDER), pin, mode, *(["fork"] if fork else [])]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        self.wait_for("ready")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line.strip())
                self._changed.notify_all()

    def wait_for(self, word: str, timeout: float = 30) -> list[str]:
        """The first line that is ``word`` or starts with ``word`` and a space, split."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in self.lines:
                    if line.startswith("error "):
                        pytest.fail(f"the holder failed: {line}")
                    if line == word or line.startswith(word + " "):
                        return line.split()
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._thread.is_alive()):
                    err = self.proc.stderr.read() if self.proc.stderr else ""
                    pytest.fail(f"no {word!r} from the holder; it said {self.lines}, {err}")
                self._changed.wait(min(left, 0.5))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture
def hold() -> Iterator[Callable[..., Holder]]:
    """``hold(pin, mode, fork=False)``: a holder process, killed at the end of the test."""
    made: list[Holder] = []

    def start(pin: str, mode: str, *, fork: bool = False) -> Holder:
        made.append(Holder(pin, mode, fork=fork))
        return made[-1]

    yield start
    for holder in made:
        holder.kill()


def pinned(producer: Producer, tag: str) -> Iterator[str]:
    pin = f"/sys/fs/bpf/aperf_lock_{tag}_{os.getpid()}"
    producer.map.pin(pin)
    try:
        yield pin
    finally:
        producer.map.unpin(pin)


@pytest.fixture
def perf_pin(producer: Producer) -> Iterator[str]:
    yield from pinned(producer, "perf")


@pytest.fixture
def ringbuf(kernel: None) -> Iterator[Producer]:
    with Producer(ring="ringbuf") as p:
        yield p


@pytest.fixture
def ringbuf_pin(ringbuf: Producer) -> Iterator[str]:
    yield from pinned(ringbuf, "rb")


def source_of(producer: Producer, pin: str, how: str) -> Any:
    return {"pin": pin, "map": producer.map, "fd": producer.map.fd}[how]


@pytest.mark.parametrize("how", ["pin", "map", "fd"])
@pytest.mark.parametrize("driver", ["stream", "buffer"])
def test_a_second_reader_in_another_process_is_refused_naming_the_holder(
    producer: Producer, perf_pin: str, hold: Callable[..., Holder], how: str, driver: str
) -> None:
    holder = hold(perf_pin, "iterate")
    source = source_of(producer, perf_pin, how)
    with pytest.raises(aperf.BusyResourceError) as caught:
        if driver == "buffer":
            aperf.PerfBuffer(source, on_sample=print).close()
        else:
            anyio.run(_open_and_close, source)
    message = str(caught.value)
    assert BUSY_LINE.format(pid=holder.proc.pid) in message
    assert f"(id {lb.map_info(producer.map.fd).id})" in message and "take_over=True" in message
    # The holder still has its map: it receives what is produced now.
    producer.emit(300, cpu=0)
    holder.wait_for("count 300")
    assert holder.proc.poll() is None


async def _open_and_close(source: Any, **options: Any) -> None:
    async with aperf.PerfStream(source, **options):
        pass


async def _read(source: Any, count: int, produce: Any, **options: Any) -> list[Any]:
    """Open (with ``options``), call ``produce()`` in a thread, take ``count`` events."""
    events: list[Any] = []
    async with aperf.PerfStream(source, **options) as stream:
        thread = threading.Thread(target=produce)
        thread.start()
        with anyio.fail_after(30):
            async for event in stream:
                events.append(event)
                if len(events) == count:
                    break
        await anyio.to_thread.run_sync(thread.join)
        stream.flush()
        with anyio.move_on_after(0.2):
            async for event in stream:
                events.append(event)  # nothing more may come
    return events


@pytest.mark.parametrize("mode", ["iterate", "run", "trio", "poll"])
def test_take_over_ends_the_holders_stream_after_its_events(
    producer: Producer, perf_pin: str, hold: Callable[..., Holder], mode: str
) -> None:
    holder = hold(perf_pin, mode)
    producer.emit(200, cpu=0)  # in the holder's rings: it must deliver them all first
    producer.emit(100, cpu=1)
    with aperf.PerfBuffer(perf_pin, on_sample=print, take_over=True) as taker:
        cpus = len(taker.cpus)
    taken = holder.wait_for("taken")
    assert taken == ["taken", str(os.getpid()), "300"]
    assert holder.proc.wait(30) == 0
    # The taker (closed at once above) gave it up in turn; a new taker reads all.
    produced = 0

    def produce() -> None:
        nonlocal produced
        for cpu in range(cpus):
            producer.emit(500, cpu=cpu)
            produced += 500

    events = anyio.run(_read, perf_pin, 500 * cpus, produce)
    assert all(isinstance(e, aperf.Sample) for e in events)
    assert len(events) == produced == 500 * cpus
    assert producer.counters().failed == 0


def test_take_over_from_a_live_holder_gets_exactly_what_is_produced(
    producer: Producer, perf_pin: str, hold: Callable[..., Holder]
) -> None:
    holder = hold(perf_pin, "iterate")
    producer.emit(100, cpu=0)
    events = anyio.run(
        lambda: _read(producer.map, 1000, lambda: producer.emit(1000, cpu=1), take_over=True)
    )
    assert holder.wait_for("taken") == ["taken", str(os.getpid()), "100"]
    samples = [e for e in events if isinstance(e, aperf.Sample)]
    assert len(samples) == len(events) == 1000
    assert [sample_header(s.data)[0] for s in samples] == list(range(100, 1100))
    assert producer.counters().failed == 0


def test_a_killed_holder_leaves_the_map_free(
    producer: Producer, perf_pin: str, hold: Callable[..., Holder]
) -> None:
    holder = hold(perf_pin, "iterate")
    holder.kill()
    events = anyio.run(lambda: _read(perf_pin, 400, lambda: producer.emit(400, cpu=0)))
    assert len(events) == 400 and all(isinstance(e, aperf.Sample) for e in events)


def test_a_forked_child_does_not_inherit_the_claim(
    producer: Producer, perf_pin: str, hold: Callable[..., Holder]
) -> None:
    holder = hold(perf_pin, "iterate", fork=True)
    child = int(holder.wait_for("child")[1])
    try:
        with pytest.raises(aperf.BusyResourceError, match=BUSY_LINE.format(pid=holder.proc.pid)):
            anyio.run(_open_and_close, perf_pin)
        holder.kill()  # the child lives on, with its inherited copy of the stream
        os.kill(child, 0)
        events = anyio.run(lambda: _read(perf_pin, 200, lambda: producer.emit(200, cpu=0)))
        assert len(events) == 200
    finally:
        os.kill(child, signal.SIGKILL)


def test_two_ring_buffer_consumers_are_refused_and_taken_over_exactly(
    ringbuf: Producer, ringbuf_pin: str, hold: Callable[..., Holder]
) -> None:
    holder = hold(ringbuf_pin, "iterate")
    with pytest.raises(aperf.BusyResourceError, match=BUSY_LINE.format(pid=holder.proc.pid)):
        anyio.run(_open_and_close, ringbuf_pin)
    ringbuf.emit(300, cpu=0)
    holder.wait_for("count")  # it reads
    # The ring is shared: what the holder took is its own, the rest is the taker's.
    events = anyio.run(
        lambda: _read(ringbuf.map, 300, lambda: ringbuf.emit(300, cpu=1), take_over=True),
    )
    taken = holder.wait_for("taken")
    assert taken[:2] == ["taken", str(os.getpid())]
    had = int(taken[2])
    seqs = [sample_header(e.data)[0] for e in events if isinstance(e, aperf.Sample)]
    assert len(seqs) == len(events)
    assert seqs[: 600 - had] == list(range(had, 600))
    assert len(seqs) == 600 - had
    assert ringbuf.counters().failed == 0
