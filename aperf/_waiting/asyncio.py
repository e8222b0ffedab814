"""The async driver's ``LoopBinding`` on asyncio and uvloop.

``AsyncioBinding`` watches each ring fd with ``loop.add_reader`` and keeps
the drain timer with ``loop.call_at``. Arming a perf fd polls it, and the poll
takes a wakeup that came before it unreported (docs/rings.md, "Event loops"), so
once the loop has armed new fds the driver looks at their rings. When that is
differs: asyncio's selector loop arms in ``add_reader`` itself, uvloop (libuv)
only at the start of the poll phase of its next iteration, after its timers and
ready callbacks. Both arm fds in the order they were added, before they wait: so
the binding adds an fd that is always readable after them (``_Probe``), and the
first report of it says that every fd added before it is armed.

Windows wait handles ("win32", eBPF for Windows): on the Proactor loop (the
default on Windows) ``ProactorHandleBinding`` registers each handle with
the IOCP through ``IocpProactor.wait_for_handle``, as asyncio itself does for
subprocesses; any other loop gets ``ThreadedHandleBinding``, a waiter
thread that hands each firing to the loop. Either way the handle (manual
reset) is waited on again only after the reader reset it and read the rings,
and a failed wait is raised to the consumer from ``LoopBinding.wait()``.
"""

from __future__ import annotations

import asyncio
import functools
import os
import sys
import threading
from asyncio.selector_events import BaseSelectorEventLoop
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from .._errors import AperfError, BusyResourceError
from .base import HandleKind, OnHandle

if TYPE_CHECKING:
    from .._native.libc.timerfd import TimerFd
    from .win32 import HandleWaiterThread


class _Probe:
    """An fd that stays readable: an eventfd (a pipe where there is none) holding a
    count nobody reads."""

    def __init__(self) -> None:
        self._write_fd = -1
        if hasattr(os, "eventfd"):
            self.fd = os.eventfd(1, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        else:  # pragma: no cover - platforms without eventfd
            self.fd, self._write_fd = os.pipe()
            os.write(self._write_fd, b"\0")

    def close(self) -> None:
        for fd in (self.fd, self._write_fd):
            if fd >= 0:
                os.close(fd)
        self.fd = self._write_fd = -1


class AsyncioBinding:
    """asyncio and uvloop: ``add_reader`` per fd; the drain timer with ``call_at``, or on
    asyncio's selector loop on Linux, a timerfd.

    The selector loop rounds a timer's wait up to the millisecond, from when it
    computes it, after the consumer's work: the 1 ms drain timer fired about 1.2 ms
    apart (median 0.2 ms late, 1 ms at p99 here), and samples waited that much
    longer. A timerfd armed for the deadline fires within tens of microseconds of
    it. uvloop's timers are not rounded up: they stay.
    """

    kind: HandleKind = "fd"

    def __init__(self, loop: asyncio.AbstractEventLoop, kind: HandleKind) -> None:
        if kind != self.kind:
            raise AperfError(f"{type(self).__name__} cannot wait on {kind} handles")
        self._loop = loop
        self._fds: set[int] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._thread = threading.get_ident()
        self.time = loop.time
        self._timerfd: TimerFd | None = None  # made by the first schedule()
        # The selector loop's wait is rounded up (uvloop's is not: its timers stay).
        self._timerfd_wanted = (kind == "fd" and sys.platform == "linux"
                                and isinstance(loop, BaseSelectorEventLoop))
        self._timer_callback: Callable[[], None] | None = None
        self._probe: _Probe | None = None  # made by the first watch() with on_armed
        self._arming: list[tuple[list[int], OnHandle]] = []  # fds the probe reports armed

    def watch(
        self, handles: Iterable[int], on_ready: OnHandle, acknowledge: OnHandle | None = None,
        on_armed: OnHandle | None = None,
    ) -> None:
        added: list[int] = []
        try:
            for fd in handles:
                self._loop.add_reader(fd, on_ready, fd)
                self._fds.add(fd)
                added.append(fd)
            if on_armed is not None and added:
                self._arming.append((added, on_armed))
                self._add_probe()
        except BaseException:
            self.stop()
            raise

    def _add_probe(self) -> None:
        """(Re-)add the probe after every fd added so far: its first report says they
        are armed."""
        probe = self._probe
        if probe is None:
            probe = self._probe = _Probe()
        else:
            self._loop.remove_reader(probe.fd)  # added again: after the new fds
        self._loop.add_reader(probe.fd, self._probe_fired)

    def _probe_fired(self) -> None:
        probe = self._probe
        if probe is not None:
            self._loop.remove_reader(probe.fd)
        arming, self._arming = self._arming, []
        for fds, on_armed in arming:
            for fd in fds:
                if fd in self._fds:  # not forgotten meanwhile
                    on_armed(fd)

    def _drop_probe(self) -> None:
        self._arming = []
        probe, self._probe = self._probe, None
        if probe is not None:
            if not self._loop.is_closed():
                self._loop.remove_reader(probe.fd)
            probe.close()

    def forget(self, handle: int) -> None:
        if handle in self._fds:
            self._fds.discard(handle)
            if not self._loop.is_closed():
                self._loop.remove_reader(handle)

    def schedule(self, at: float | None, callback: Callable[[], None]) -> None:
        timerfd = self._timerfd
        if timerfd is None and self._timerfd_wanted:
            timerfd = self._timerfd = self._make_timerfd()
        if timerfd is not None:
            self._timer_callback = None if at is None else callback
            timerfd.arm(None if at is None else at - self.time())
            return
        self._cancel_timer()
        if at is not None:
            self._timer = self._loop.call_at(at, callback)

    def _make_timerfd(self) -> TimerFd:
        from .._native.libc.timerfd import TimerFd

        timerfd = TimerFd()
        try:
            self._loop.add_reader(timerfd.fd, self._timer_fired)
        except BaseException:
            timerfd.close()
            raise
        return timerfd

    def _timer_fired(self) -> None:
        timerfd, callback = self._timerfd, self._timer_callback
        if timerfd is not None and timerfd.expired() and callback is not None:
            self._timer_callback = None
            callback()

    def _cancel_timer(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        timerfd, self._timerfd = self._timerfd, None
        self._timerfd_wanted = False  # stopped: call_at from now on
        self._timer_callback = None
        if timerfd is not None:
            if not self._loop.is_closed():
                self._loop.remove_reader(timerfd.fd)
            timerfd.close()

    async def wait(self) -> None:
        if self._waiter is not None:
            raise BusyResourceError("another task is already reading this stream")
        waiter = self._loop.create_future()
        self._waiter = waiter
        try:
            await waiter
        finally:
            self._waiter = None

    def wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def in_loop_thread(self) -> bool:
        return threading.get_ident() == self._thread

    def running(self) -> bool:
        return self._loop.is_running() and not self._loop.is_closed()

    def call_soon_threadsafe(self, fn: Callable[[], None]) -> bool:
        try:
            self._loop.call_soon_threadsafe(fn)
        except RuntimeError:  # the loop is closed
            return False
        return True

    def stop(self) -> None:
        self._cancel_timer()
        self._drop_probe()
        fds, self._fds = self._fds, set()
        if self._loop.is_closed():
            return
        for fd in fds:
            self._loop.remove_reader(fd)


class _HandleBinding(AsyncioBinding):
    """asyncio with Windows wait handles: a failed wait reaches the consumer in ``wait()``."""

    kind: HandleKind = "win32"

    def __init__(self, loop: asyncio.AbstractEventLoop, kind: HandleKind) -> None:
        super().__init__(loop, kind)
        self._error: BaseException | None = None

    def _failed(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc
        self.wake()

    def _look_soon(self, handles: list[int], on_armed: OnHandle | None) -> None:
        """A wait handle stays signalled until the reader resets it: waiting on it takes
        nothing, and the look at its rings can come at once."""
        if on_armed is not None:
            for handle in handles:
                self._loop.call_soon(self._look, handle, on_armed)

    def _look(self, handle: int, on_armed: OnHandle) -> None:
        if self._watching(handle):
            on_armed(handle)

    def _watching(self, handle: int) -> bool:
        raise NotImplementedError

    async def wait(self) -> None:
        if self._error is None:
            await super().wait()
        error, self._error = self._error, None
        if error is not None:
            raise error


class ThreadedHandleBinding(_HandleBinding):
    """Any asyncio loop (selector, uvloop; every loop off Windows): a waiter thread.

    The thread waits on the handles with ``WaitForMultipleObjects`` and hands
    each firing to the loop with ``call_soon_threadsafe``; it waits again once
    ``on_ready`` ran. ``stop()`` joins it before the handles are closed.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, kind: HandleKind) -> None:
        super().__init__(loop, kind)
        self._watcher: HandleWaiterThread | None = None
        self._on_ready: Callable[[int], None] | None = None

    def watch(
        self, handles: Iterable[int], on_ready: OnHandle, acknowledge: OnHandle | None = None,
        on_armed: OnHandle | None = None,
    ) -> None:
        self._on_ready = on_ready
        new = list(handles)
        watched = [*(self._watcher.handles if self._watcher else ()), *new]
        self._restart(watched)
        self._look_soon(new, on_armed)

    def _restart(self, handles: list[int]) -> None:
        from .win32 import HandleWaiterThread

        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.stop()
        if handles and self._on_ready is not None:
            self._watcher = HandleWaiterThread(
                handles, self._on_ready, self.call_soon_threadsafe, self._failed
            )

    def _watching(self, handle: int) -> bool:
        return self._watcher is not None and handle in self._watcher.handles

    def forget(self, handle: int) -> None:
        watcher = self._watcher
        if watcher is not None and handle in watcher.handles:
            self._restart([h for h in watcher.handles if h != handle])

    def stop(self) -> None:
        self._cancel_timer()
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.stop()


class ProactorHandleBinding(_HandleBinding):
    """asyncio's Proactor loop (Windows): ``IocpProactor.wait_for_handle`` per handle.

    Each registration is one-shot (``RegisterWaitForSingleObject`` with
    ``WT_EXECUTEONLYONCE``): when it completes, ``on_ready`` resets the handle
    and reads, then the handle is registered again. Cancelling a registration
    unregisters the wait (``UnregisterWaitEx``) before the handle is closed.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, kind: HandleKind, proactor: Any) -> None:
        super().__init__(loop, kind)
        self._proactor = proactor
        self._waits: dict[int, asyncio.Future[Any]] = {}  # the registration in flight
        self._watched: set[int] = set()
        self._on_ready: Callable[[int], None] | None = None

    def watch(
        self, handles: Iterable[int], on_ready: OnHandle, acknowledge: OnHandle | None = None,
        on_armed: OnHandle | None = None,
    ) -> None:
        self._on_ready = on_ready
        new: list[int] = []
        try:
            for handle in handles:
                if handle not in self._watched:
                    self._watched.add(handle)
                    self._register(handle)
                    new.append(handle)
        except BaseException:
            self.stop()
            raise
        self._look_soon(new, on_armed)

    def _watching(self, handle: int) -> bool:
        return handle in self._watched

    def _register(self, handle: int) -> None:
        fut = self._proactor.wait_for_handle(handle)
        self._waits[handle] = fut
        fut.add_done_callback(functools.partial(self._fired, handle))

    def _fired(self, handle: int, fut: asyncio.Future[Any]) -> None:
        if self._waits.get(handle) is not fut or fut.cancelled():
            return  # forgotten or stopped meanwhile
        del self._waits[handle]
        error = fut.exception()
        if error is not None:
            self._failed(error)
            return
        try:
            if self._on_ready is not None:
                self._on_ready(handle)  # resets the handle, then reads
        finally:
            # Again, unless on_ready forgot it (its rings broke) or the stream stopped.
            if handle in self._watched and not self._loop.is_closed():
                try:
                    self._register(handle)
                except Exception as exc:
                    self._failed(exc)

    def forget(self, handle: int) -> None:
        self._watched.discard(handle)
        fut = self._waits.pop(handle, None)
        if fut is not None:
            fut.cancel()

    def stop(self) -> None:
        self._cancel_timer()
        self._on_ready = None
        self._watched.clear()
        waits, self._waits = self._waits, {}
        for fut in waits.values():
            fut.cancel()
