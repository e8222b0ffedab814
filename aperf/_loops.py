"""What the async driver needs from an event loop, one class per loop.

``PerfStream`` is written once against ``LoopBinding``: watch
readiness handles, keep one timer, park one consumer until woken, and run a
function on the loop from another thread. ``AsyncioBinding`` serves
asyncio and uvloop (``loop.add_reader`` on each ring fd, ``loop.call_at``);
another loop or another kind of handle plugs in here.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterable
from typing import Protocol

from ._errors import AperfError, BusyResourceError
from ._source import HandleKind


class LoopBinding(Protocol):
    def time(self) -> float:
        """The loop's clock (the reader's deadlines are on it)."""
        ...

    def watch(self, handles: Iterable[int], on_ready: Callable[[int], None]) -> None:
        """Call ``on_ready(handle)`` on the loop each time a handle fires."""
        ...

    def forget(self, handle: int) -> None:
        """Stop watching one handle (its rings broke)."""
        ...

    def schedule(self, at: float | None, callback: Callable[[], None]) -> None:
        """Run ``callback`` at loop time ``at`` (None: no timer); replaces the last one."""
        ...

    async def wait(self) -> None:
        """Park the consumer until ``wake()``; BusyResourceError if one is parked already."""
        ...

    def wake(self) -> None:
        """Wake the parked consumer, if any (from the loop's thread)."""
        ...

    def in_loop_thread(self) -> bool:
        """Whether the caller runs on the loop's thread (and the loop runs)."""
        ...

    def call_soon_threadsafe(self, fn: Callable[[], None]) -> bool:
        """Run ``fn`` on the loop from another thread; False if the loop no longer runs."""
        ...

    def running(self) -> bool:
        """Whether the loop still runs (a callback handed over would be called)."""
        ...

    def stop(self) -> None:
        """Unwatch every handle and cancel the timer (before the handles are closed:
        fd numbers are reused at once)."""
        ...


class AsyncioBinding:
    """asyncio and uvloop: ``add_reader`` per fd, ``call_at`` for the drain timer."""

    def __init__(self, loop: asyncio.AbstractEventLoop, kind: HandleKind) -> None:
        if kind != "fd":
            raise AperfError(f"this asyncio loop cannot wait on {kind} handles")
        self._loop = loop
        self._fds: set[int] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._thread = threading.get_ident()
        self.time = loop.time

    def watch(self, handles: Iterable[int], on_ready: Callable[[int], None]) -> None:
        try:
            for fd in handles:
                self._loop.add_reader(fd, on_ready, fd)
                self._fds.add(fd)
        except BaseException:
            self.stop()
            raise

    def forget(self, handle: int) -> None:
        if handle in self._fds:
            self._fds.discard(handle)
            if not self._loop.is_closed():
                self._loop.remove_reader(handle)

    def schedule(self, at: float | None, callback: Callable[[], None]) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None if at is None else self._loop.call_at(at, callback)

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
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        fds, self._fds = self._fds, set()
        if self._loop.is_closed():
            return
        for fd in fds:
            self._loop.remove_reader(fd)


def current_binding(kind: HandleKind) -> LoopBinding:
    """The binding for the running event loop (called inside the loop)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        raise AperfError(
            "PerfStream needs a running asyncio event loop (asyncio or uvloop); "
            "for no event loop use aperf.PerfBuffer"
        ) from None
    return AsyncioBinding(loop, kind)
