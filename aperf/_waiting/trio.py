"""trio's ``LoopBinding`` for the async driver (``trio.run``, ``anyio.run(..., backend="trio")``).

Each stream gets one system task (``trio.lowlevel.spawn_system_task``), so
that rings are drained while the consumer is busy, as on asyncio, without the
user passing a nursery. Inside it:

- a *watcher* per readiness handle loops on ``trio.lowlevel.wait_readable``;
  when its handle fires it acknowledges it, hands it to the pump and at once
  waits again;
- the *pump* calls the driver's ``on_armed`` for the handles the watchers
  armed for the first time and ``on_ready`` for those that fired, and runs
  the drain timer: it parks in a cancel scope whose deadline is the timer's
  (trio's own timeouts are cancel scopes too).

Windows wait handles (eBPF for Windows, handle kind ``win32``) are watched by
``trio_win32``'s ``TrioHandleWatcher`` in the same system task instead: worker
threads wait on the handles, and ``on_ready`` (which resets the handle before
the rings are read) runs on the trio thread for each firing.

Why the watcher re-arms before the pump drains: trio waits with
``EPOLLONESHOT`` and re-arms with ``EPOLL_CTL_MOD``, and the kernel polls the
fd at that moment. A perf event fd clears its readiness when polled, so a
wakeup that arrives after a wakeup was reported but before the re-arm is
consumed by the re-arm and never reported (measured: a sample pending, nothing
reported). Re-arming first and draining after means that every sample written
before the re-arm is taken by the drain that follows it, and every later one
wakes the armed watcher. The first arm is no different: the watcher marks its
fd armed before its first wait, and the pump looks at the fd's rings
(``on_armed``) after that wait registered it.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterable
from typing import Any

import trio

from .._errors import AperfError, BusyResourceError
from .base import HandleKind, OnHandle

_SUCCEEDED = trio.lowlevel.Abort.SUCCEEDED


def _nothing() -> None:
    pass


class TrioBinding:
    """trio: a watcher task per handle, one pump task for drains and the timer."""

    def __init__(self, kind: HandleKind) -> None:
        if kind not in ("fd", "win32"):
            raise AperfError(f"the trio binding cannot wait on {kind} handles")
        self._kind = kind
        self._handles: Any = None  # win32: the TrioHandleWatcher, once the task runs
        self._error: BaseException | None = None  # win32: a failed wait, for the consumer
        self._token = trio.lowlevel.current_trio_token()
        # The run's clock object can be read from any thread (statistics() may be);
        # trio.current_time() only inside the run.
        self.time: Callable[[], float] = trio.lowlevel.current_clock().current_time
        self._thread = threading.get_ident()
        self._fds: set[int] = set()
        self._ready: dict[int, None] = {}  # handles that fired, in order, for the pump
        self._on_ready: Callable[[int], None] = lambda handle: None
        self._acknowledge: Callable[[int], None] = lambda handle: None
        self._on_armed: Callable[[int], None] | None = None
        self._armed: dict[int, None] = {}  # handles armed for the first time, for the pump
        self._at: float | None = None
        self._callback: Callable[[], None] = _nothing
        self._pump: trio.lowlevel.Task | None = None  # the pump while parked
        self._pump_scope: trio.CancelScope | None = None  # its deadline is the timer
        self._waiter: trio.lowlevel.Task | None = None  # the parked consumer
        self._scope = trio.CancelScope()
        self._nursery: trio.Nursery | None = None
        self._spawned = False
        self._stopped = False

    # --- the system task ------------------------------------------------------------

    def _spawn(self) -> None:
        if not self._spawned:
            self._spawned = True
            trio.lowlevel.spawn_system_task(self._run, name="aperf stream pump")

    async def _run(self) -> None:
        with self._scope:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                if self._kind == "win32":
                    from .trio_win32 import TrioHandleWatcher

                    self._handles = TrioHandleWatcher(nursery, self._failed)
                    self._handles.watch(list(self._fds), self._handle_fired)
                    self._armed.update(dict.fromkeys(self._fds))  # as after a first arm
                else:
                    for fd in list(self._fds):
                        nursery.start_soon(self._watch_one, fd)
                await self._pump_loop()
                nursery.cancel_scope.cancel()
        self._nursery = None

    def _handle_fired(self, handle: int) -> None:
        # On the trio thread, before the worker waits again: on_ready resets the
        # manual-reset handle, then reads (a deferred reset would spin the wait).
        if handle in self._fds:
            self._on_ready(handle)

    def _failed(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc
        self.wake()

    async def _watch_one(self, fd: int) -> None:
        wait_readable = trio.lowlevel.wait_readable
        # The first arm can eat a wakeup as every re-arm can (see the module's
        # docstring): the pump looks at this fd's rings after the wait below
        # registered it (the pump runs in a later batch).
        self._armed[fd] = None
        self._kick()
        # forget() and stop() take the fd out of the set (and wake us through
        # notify_closing) before it is closed: never wait on a closed fd number.
        while fd in self._fds:
            try:
                await wait_readable(fd)
            except trio.ClosedResourceError:
                return
            if fd not in self._fds:
                return
            # Clear level-triggered readiness before re-arming, or the re-arm reports
            # it again. A failure here is reported by the pump's own acknowledge.
            with contextlib.suppress(Exception):
                self._acknowledge(fd)
            self._ready[fd] = None
            self._kick()

    async def _pump_loop(self) -> None:
        checkpoint = trio.lowlevel.checkpoint
        while not self._stopped:
            armed = self._armed
            if armed:
                handles = list(armed)
                armed.clear()
                on_armed = self._on_armed
                for fd in handles:
                    if on_armed is not None and fd in self._fds:
                        on_armed(fd)
                # Every round that did work yields: a task that does not lets no other
                # run (the consumer, trio's own timeouts, Ctrl-C), whatever it is fed.
                await checkpoint()
                continue
            ready = self._ready
            if ready:
                handles = list(ready)
                ready.clear()
                for fd in handles:
                    if fd in self._fds:
                        self._on_ready(fd)
                await checkpoint()
                continue
            at = self._at
            if at is not None and self.time() >= at:
                self._at = None
                self._callback()
                await checkpoint()
                continue
            with trio.CancelScope(deadline=math.inf if at is None else at) as scope:
                self._pump_scope = scope
                self._pump = trio.lowlevel.current_task()
                try:
                    await trio.lowlevel.wait_task_rescheduled(self._abort_pump)
                finally:
                    self._pump = None
                    self._pump_scope = None

    def _abort_pump(self, raise_cancel: object) -> trio.lowlevel.Abort:
        self._pump = None
        return _SUCCEEDED

    def _kick(self) -> None:
        task = self._pump
        if task is not None:
            self._pump = None
            trio.lowlevel.reschedule(task)

    # --- LoopBinding ------------------------------------------------------------------

    def watch(
        self, handles: Iterable[int], on_ready: OnHandle, acknowledge: OnHandle | None = None,
        on_armed: OnHandle | None = None,
    ) -> None:
        self._on_ready = on_ready
        if acknowledge is not None:
            self._acknowledge = acknowledge
        if on_armed is not None:
            self._on_armed = on_armed
        new = [fd for fd in handles if fd not in self._fds]
        self._fds.update(new)
        if self._handles is not None:
            self._handles.watch(new, self._handle_fired)
            self._armed.update(dict.fromkeys(new))
            self._kick()
        elif self._nursery is not None:
            for fd in new:
                self._nursery.start_soon(self._watch_one, fd)
        self._spawn()

    def forget(self, handle: int) -> None:
        if handle in self._fds:
            self._fds.discard(handle)
            self._ready.pop(handle, None)
            self._armed.pop(handle, None)
            if self._handles is not None:
                self._handles.forget(handle)
                return
            with contextlib.suppress(RuntimeError):  # not inside the run any more
                trio.lowlevel.notify_closing(handle)

    def schedule(self, at: float | None, callback: Callable[[], None]) -> None:
        self._at = at
        self._callback = callback
        scope = self._pump_scope
        if scope is not None:
            scope.deadline = math.inf if at is None else at
        self._spawn()

    async def wait(self) -> None:
        if self._waiter is not None:
            raise BusyResourceError("another task is already reading this stream")
        self._waiter = trio.lowlevel.current_task()

        def abort(raise_cancel: object) -> trio.lowlevel.Abort:
            self._waiter = None
            return _SUCCEEDED

        if self._error is None:
            await trio.lowlevel.wait_task_rescheduled(abort)
        else:
            self._waiter = None
        error, self._error = self._error, None
        if error is not None:
            raise error

    def wake(self) -> None:
        task = self._waiter
        if task is not None:
            self._waiter = None
            trio.lowlevel.reschedule(task)

    def in_loop_thread(self) -> bool:
        return threading.get_ident() == self._thread

    def _inside_run(self) -> bool:
        try:
            return trio.lowlevel.current_trio_token() is self._token
        except RuntimeError:
            return False

    def running(self) -> bool:
        if self.in_loop_thread():
            return self._inside_run()
        return self.call_soon_threadsafe(_nothing)

    def call_soon_threadsafe(self, fn: Callable[[], None]) -> bool:
        try:
            self._token.run_sync_soon(fn)
        except trio.RunFinishedError:
            return False
        return True

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        fds, self._fds = self._fds, set()
        self._ready.clear()
        self._armed.clear()
        self._at = None
        if not self._inside_run():
            return  # the run is over: its tasks and fd registrations are gone
        handles, self._handles = self._handles, None
        if handles is not None:
            handles.stop()  # returns once no thread waits on a handle: they close next
            self._scope.cancel()
            return
        for fd in fds:
            # Unregister from trio's epoll now: the fds are closed right after this.
            trio.lowlevel.notify_closing(fd)
        self._scope.cancel()
