"""What the async driver needs from an event loop, one class per loop.

``PerfStream`` is written once against ``LoopBinding``: watch
readiness handles, keep one timer, park one consumer until woken, and run a
function on the loop from another thread. ``AsyncioBinding`` serves
asyncio and uvloop (``loop.add_reader`` on each ring fd, ``loop.call_at``);
``TrioBinding`` (``aperf._trio``) serves trio (and anyio on trio). The running
library is told by ``sniffio``.

another loop or another kind of handle plugs in here.

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
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

import sniffio

from ._errors import AperfError, BusyResourceError
from ._source import HandleKind, OnHandle

if TYPE_CHECKING:
    from ._ebpfwin import HandleWaiterThread


class LoopBinding(Protocol):
    warns_on_unfinished_generators: bool
    """Whether the loop warns when an async generator is collected unfinished (trio)."""

    def time(self) -> float:
        """The loop's clock (the reader's deadlines are on it)."""
        ...

    def watch(
        self, handles: Iterable[int], on_ready: OnHandle, acknowledge: OnHandle | None = None
    ) -> None:
        """Call ``on_ready(handle)`` on the loop each time a handle fires.

        ``acknowledge`` is the source's: a binding that must re-arm a handle
        before ``on_ready`` runs clears its readiness with it first (trio).
        """
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

    warns_on_unfinished_generators = False
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

    def watch(
        self, handles: Iterable[int], on_ready: OnHandle, acknowledge: OnHandle | None = None
    ) -> None:
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
        self, handles: Iterable[int], on_ready: OnHandle, acknowledge: OnHandle | None = None
    ) -> None:
        self._on_ready = on_ready
        watched = [*(self._watcher.handles if self._watcher else ()), *handles]
        self._restart(watched)

    def _restart(self, handles: list[int]) -> None:
        from ._ebpfwin import HandleWaiterThread

        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.stop()
        if handles and self._on_ready is not None:
            self._watcher = HandleWaiterThread(
                handles, self._on_ready, self.call_soon_threadsafe, self._failed
            )

    def forget(self, handle: int) -> None:
        watcher = self._watcher
        if watcher is not None and handle in watcher.handles:
            self._restart([h for h in watcher.handles if h != handle])

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
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
        self, handles: Iterable[int], on_ready: OnHandle, acknowledge: OnHandle | None = None
    ) -> None:
        self._on_ready = on_ready
        try:
            for handle in handles:
                if handle not in self._watched:
                    self._watched.add(handle)
                    self._register(handle)
        except BaseException:
            self.stop()
            raise

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
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._on_ready = None
        self._watched.clear()
        waits, self._waits = self._waits, {}
        for fut in waits.values():
            fut.cancel()


def current_binding(kind: HandleKind) -> LoopBinding:
    """The binding for the running event loop (called inside the loop)."""
    try:
        library = sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        raise AperfError(
            "PerfStream needs a running event loop (asyncio, uvloop or trio, directly or "
            "through anyio); for no event loop use aperf.PerfBuffer"
        ) from None
    if library == "trio":
        from ._trio import TrioBinding  # trio is an optional dependency

        return TrioBinding(kind)
    if library != "asyncio":
        raise AperfError(f"PerfStream runs on asyncio, uvloop or trio, not on {library}")
    loop = asyncio.get_running_loop()
    if kind == "win32":
        proactor = getattr(loop, "_proactor", None)
        if proactor is not None and hasattr(proactor, "wait_for_handle"):
            return ProactorHandleBinding(loop, kind, proactor)
        return ThreadedHandleBinding(loop, kind)
    return AsyncioBinding(loop, kind)
