"""The trio waiter for Windows wait handles, standalone (no trio loop binding yet),
on the stand-in kernel32, both ways it waits: a task per handle waiting in trio's
worker threads, and one waiter thread posting through the TrioToken. The
reader's part is played by the ring source itself: acknowledge (reset), then take.
The ``fake`` fixture fails a test that closed a handle while a thread waited on it.
"""

from __future__ import annotations

import struct
from typing import Any

import pytest

trio = pytest.importorskip("trio")

from aperf._native.ebpfapi import api as win  # noqa: E402
from aperf._options import Wakeup  # noqa: E402
from aperf._rings.seam import RingConfig  # noqa: E402
from aperf._rings.windows.perf import WINDOWS_RECORDS, WindowsPerfSource  # noqa: E402
from aperf._waiting.trio_win32 import TrioHandleWatcher  # noqa: E402

from .conftest import FakeEbpf  # noqa: E402

pytestmark = pytest.mark.standin


SEQ = struct.Struct("<Q")


class Collector:
    """on_ready as the reader does it: reset the handle, then take every ring."""

    def __init__(self, source: WindowsPerfSource, rings: Any) -> None:
        self.source, self.rings = source, rings
        self.seqs: dict[int, list[int]] = {0: [], 1: []}
        self.lost = 0
        self.wakeups = 0

    def on_ready(self, handle: int) -> None:
        self.wakeups += 1
        self.source.acknowledge(handle)
        for ring in self.rings:
            segments, _ = WINDOWS_RECORDS.split(ring.key, ring.take())
            for segment in segments:
                if isinstance(segment, int):
                    self.lost += segment
                else:
                    self.seqs[ring.key].extend(SEQ.unpack(p)[0] for p in segment[0])

    def total(self) -> int:
        return sum(map(len, self.seqs.values())) + self.lost


@pytest.mark.parametrize("mode", ["thread", "task"])
def test_trio_watcher_hands_over_every_firing(
    fake: FakeEbpf, perf_map: int, mode: str
) -> None:
    source = WindowsPerfSource(perf_map)
    rings = source.open(RingConfig(None, Wakeup.per_sample()))
    collector = Collector(source, rings)
    errors: list[BaseException] = []
    written: dict[int, list[int]] = {0: [], 1: []}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            watcher = TrioHandleWatcher(nursery, errors.append, thread=mode == "thread")
            watcher.watch([rings[0].handle], collector.on_ready)

            def produce() -> None:
                for seq in range(3000):
                    if fake.output(perf_map, seq % 2, SEQ.pack(seq)):
                        written[seq % 2].append(seq)

            await trio.to_thread.run_sync(produce)
            with trio.fail_after(5):
                while collector.total() < 3000:
                    await trio.sleep(0.001)
            watcher.stop()

    try:
        trio.run(main)
    finally:
        source.free()  # right after stop(): no thread may still wait on the handle
    assert not errors
    assert collector.seqs == written  # what was written, in order
    assert collector.lost == fake.lost(perf_map, 0) + fake.lost(perf_map, 1)
    assert sum(map(len, written.values())) + collector.lost == 3000
    assert collector.wakeups > 0


@pytest.mark.parametrize("mode", ["thread", "task"])
def test_trio_watcher_reports_a_failed_wait(fake: FakeEbpf, mode: str) -> None:
    errors: list[BaseException] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            watcher = TrioHandleWatcher(nursery, errors.append, thread=mode == "thread")
            watcher.watch([4002], lambda handle: None)  # no such handle
            with trio.fail_after(5):
                while not errors:
                    await trio.sleep(0.001)
            watcher.stop()

    trio.run(main)
    assert len(errors) == 1
    assert getattr(errors[0], "function", None) == "WaitForMultipleObjects"


@pytest.mark.parametrize("mode", ["thread", "task"])
def test_trio_watcher_forget_and_stop(fake: FakeEbpf, mode: str) -> None:
    a, b = fake.new_event(), fake.new_event()
    fired: list[int] = []

    def on_ready(handle: int) -> None:
        fired.append(handle)
        win.reset(handle)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            watcher = TrioHandleWatcher(nursery, pytest.fail, thread=mode == "thread")
            watcher.watch([a, b], on_ready)
            await trio.to_thread.run_sync(fake.wait_until, lambda: fake.waiters(a) == 1)
            watcher.forget(a)
            assert fake.waiters(a) == 0  # forget() returns once nobody waits on it
            await trio.to_thread.run_sync(fake.wait_until, lambda: fake.waiters(b) == 1)
            fake.set_event(a)
            fake.set_event(b)
            with trio.fail_after(5):
                while not fired:
                    await trio.sleep(0.001)
            await trio.sleep(0.02)
            watcher.stop()
            assert fake.waiters(b) == 0  # stop() returns once nobody waits on them

    trio.run(main)
    assert fired == [b]
    fake.close_handle(a)
    fake.close_handle(b)


def test_stop_before_the_worker_started(fake: FakeEbpf) -> None:
    handle = fake.new_event()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            watcher = TrioHandleWatcher(nursery, pytest.fail)
            watcher.watch([handle], lambda h: None)
            watcher.stop()  # the task has not even run yet: nothing to wait for

    trio.run(main)
    assert fake.waiters(handle) == 0
    fake.close_handle(handle)
