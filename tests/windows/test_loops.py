"""The win32 handle bindings and waiters, on the stand-in kernel32.

asyncio's IocpProactor exists on Windows only; :class:`ThreadProactor` stands in
for its ``wait_for_handle`` (a one-shot wait completing a future on the loop,
whose cancel unregisters the wait before it returns) so that
``ProactorHandleBinding`` runs here. What asyncio's own proactor does is not
verified here: see docs/windows.md.
"""

from __future__ import annotations

import asyncio
import ctypes
import struct
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

import aperf
from aperf._native.ebpfapi import api as win
from aperf._native.ebpfapi import binding as c
from aperf._waiting import current_binding
from aperf._waiting.asyncio import ProactorHandleBinding
from aperf._waiting.win32 import HandleWaiterThread, Win32Waiter

from .conftest import FakeEbpf

pytestmark = pytest.mark.standin


SEQ = struct.Struct("<Q")


class _WaitFuture(asyncio.Future[bool]):
    def __init__(self, loop: asyncio.AbstractEventLoop, handle: int) -> None:
        super().__init__(loop=loop)
        self._cancel = win.Event(manual_reset=True)
        self._thread = threading.Thread(target=self._run, args=(loop, handle))
        self._thread.start()

    def _run(self, loop: asyncio.AbstractEventLoop, handle: int) -> None:
        if win.wait_any([handle, self._cancel.handle], c.INFINITE) == 0:
            loop.call_soon_threadsafe(self._finish)

    def _finish(self) -> None:
        self._thread.join()
        self._cancel.close()
        if not self.done():
            self.set_result(True)

    def cancel(self, msg: Any = None) -> bool:
        if self._cancel.handle:  # unregister: the wait is over when this returns
            self._cancel.set()
            self._thread.join()
            self._cancel.close()
        return super().cancel(msg)


class ThreadProactor:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.registrations = 0

    def wait_for_handle(self, handle: int, timeout: float | None = None) -> _WaitFuture:
        self.registrations += 1
        return _WaitFuture(self._loop, handle)


def run_on_proactor_stand_in(main: Callable[[ThreadProactor], Any]) -> Any:
    loop = asyncio.new_event_loop()
    proactor = ThreadProactor(loop)
    loop._proactor = proactor  # type: ignore[attr-defined]
    try:
        return loop.run_until_complete(main(proactor))
    finally:
        loop.close()


def test_proactor_binding_reads_every_sample(
    fake: FakeEbpf, perf_map: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "platform", "win32")

    async def main(proactor: ThreadProactor) -> tuple[list[int], int]:
        seqs: list[int] = []
        lost = 0
        # Per-sample wakeups: no drain timer, only the handle brings samples in.
        async with aperf.PerfStream(perf_map, decoder=SEQ, wakeup="lowest-latency") as stream:
            assert isinstance(stream._loop, ProactorHandleBinding)
            for seq in range(200):  # the loop does not run: 4096 / 16-byte records = 256 fit
                assert fake.output(perf_map, 0, SEQ.pack(seq))
            for seq in range(200, 400):
                fake.output(perf_map, 0, SEQ.pack(seq))
            async for event in stream:
                if isinstance(event, aperf.Lost):
                    lost += event.count
                else:
                    seqs.append(event.value[0])
                if len(seqs) + lost == 400:
                    break
            # and again, now that the first registration completed and was renewed
            fake.output(perf_map, 1, SEQ.pack(1000))
            event = await asyncio.wait_for(anext(stream), 5)
            assert event.cpu == 1 and event.value[0] == 1000
        assert proactor.registrations >= 2
        return seqs, lost

    seqs, lost = run_on_proactor_stand_in(main)
    assert lost == fake.lost(perf_map, 0) == 144
    assert seqs == list(range(256))


def test_proactor_binding_does_not_renew_a_forgotten_handle(fake: FakeEbpf) -> None:
    async def main(proactor: ThreadProactor) -> None:
        event = fake.new_event()
        binding = current_binding("win32")
        assert isinstance(binding, ProactorHandleBinding)
        fired: list[int] = []

        def on_ready(handle: int) -> None:
            fired.append(handle)
            win.reset(handle)
            binding.forget(handle)  # e.g. its rings broke

        binding.watch([event], on_ready)
        fake.set_event(event)
        while not fired:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.02)
        assert fired == [event] and proactor.registrations == 1
        binding.stop()
        fake.close_handle(event)

    run_on_proactor_stand_in(main)


def test_waiter_thread_waits_again_only_once_rearmed(fake: FakeEbpf) -> None:
    handle = fake.new_event(manual=True)
    posted: list[Callable[[], None]] = []
    ready: list[int] = []

    def post(fn: Callable[[], None]) -> bool:
        posted.append(fn)
        return True

    def on_ready(h: int) -> None:
        ready.append(h)
        win.reset(h)  # what the reader's acknowledge does

    errors: list[BaseException] = []
    waiter = HandleWaiterThread([handle], on_ready, post, errors.append)
    try:
        fake.wait_until(lambda: fake.waiters(handle) == 1)
        fake.set_event(handle)
        fake.wait_until(lambda: len(posted) == 1)
        time.sleep(0.05)
        assert len(posted) == 1, "the handle stays signalled: one hand-over until re-armed"
        assert fake.waiters(handle) == 0
        posted.pop()()  # the loop runs on_ready: resets, re-arms
        fake.wait_until(lambda: fake.waiters(handle) == 1)
        fake.set_event(handle)
        fake.wait_until(lambda: len(posted) == 1)
        posted.pop()()
        assert ready == [handle, handle] and not errors
    finally:
        waiter.stop()
    assert fake.waiters(handle) == 0  # stop() returned after the thread left its wait
    fake.close_handle(handle)


def test_waiter_thread_reports_a_failed_wait(fake: FakeEbpf) -> None:
    errors: list[BaseException] = []
    ran = threading.Event()

    def post(fn: Callable[[], None]) -> bool:
        fn()
        ran.set()
        return True

    waiter = HandleWaiterThread([4001], lambda h: None, post, errors.append)
    assert ran.wait(5)
    waiter.stop()
    assert len(errors) == 1 and isinstance(errors[0], aperf._errors.Win32Error)


def test_win32_waiter(fake: FakeEbpf) -> None:
    a, b = fake.new_event(), fake.new_event()
    waiter = Win32Waiter([a, b, a])
    try:
        assert waiter.wait(0) == []
        start = time.monotonic()
        assert waiter.wait(0.05) == []
        assert time.monotonic() - start >= 0.04
        fake.set_event(b)
        assert waiter.wait(-1) == [b]
        fake.set_event(a)
        assert waiter.wait(1) == [a, b]  # every signalled handle, lowest first
        fake.lib.ResetEvent.argtypes = [ctypes.c_void_p]
        fake.lib.ResetEvent(a)
        fake.lib.ResetEvent(b)
        threading.Timer(0.05, waiter.interrupt).start()
        assert waiter.wait(-1) == []  # interrupted (close() from another thread does that)
    finally:
        waiter.close()
        waiter.close()
    fake.close_handle(a)
    fake.close_handle(b)
