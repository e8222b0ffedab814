"""Windows wait handles watched from a trio run: the piece a trio ``LoopBinding`` needs.

``TrioHandleWatcher`` has the handle half of ``LoopBinding`` (``watch``,
``forget``, ``stop``); a trio binding delegates to it for the "win32" handle
kind. By default it runs a task per handle that waits in a worker thread of
trio's (``trio.to_thread.run_sync``) on the handle and a cancel event of its
own; with ``thread=True`` one ``HandleWaiterThread``
hands each firing over through the run's ``TrioToken``. Either way
``on_ready`` runs on the trio thread, resets the manual-reset handle, then
reads; the handle is waited on again only after that.

Why not ``trio.lowlevel.WaitForSingleObject``: it abandons its waiting thread
when cancelled (it signals a cancel event that thread also waits on, and
returns), so that thread may still be waiting on the handle after the task
ended; the stream closes the handle right after ``stop()``, and closing a
handle another thread waits on is undefined on Windows. Here ``stop()``
signals the cancel event and returns only once the worker left its wait
(microseconds); the stand-in kernel32 of the tests counts any such misuse.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import trio

from .._native.ebpfapi import api as win
from .._native.ebpfapi import binding as c
from .win32 import HandleWaiterThread


@dataclass
class _Watch:
    """One handle's task: its scope, its cancel event, and whether its worker waits."""

    scope: trio.CancelScope
    cancel: win.Event
    lock: threading.Lock = field(default_factory=threading.Lock)
    waiting: bool = False
    ended: bool = False
    left: threading.Event = field(default_factory=threading.Event)

    def wait(self, handle: int) -> int | None:
        """In a worker thread: wait on the handle and the cancel event (unless ended)."""
        with self.lock:
            if self.ended:
                return None
            self.waiting = True
            self.left.clear()
        try:
            return win.wait_any([handle, self.cancel.handle], c.INFINITE)
        finally:
            with self.lock:
                self.waiting = False
                self.left.set()

    def end(self) -> None:
        """On the trio thread: no worker waits on the handle once this returns."""
        with self.lock:
            self.ended = True
            waiting = self.waiting
        self.scope.cancel()
        self.cancel.set()
        if waiting:
            self.left.wait()  # it leaves as soon as the cancel event is set
        self.cancel.close()


class TrioHandleWatcher:
    """Call ``on_ready(handle)`` on the trio thread each time a watched handle fires.

    ``nursery`` hosts the watching tasks; ``on_error`` gets, on the trio thread,
    what a wait or ``on_ready`` raised (the handle is then no longer watched).
    Create it, and call its methods, on the trio thread.
    """

    def __init__(
        self,
        nursery: trio.Nursery,
        on_error: Callable[[BaseException], None],
        *,
        thread: bool = False,
    ) -> None:
        self._nursery = nursery
        self._on_error = on_error
        self.uses_thread = thread
        self._token = trio.lowlevel.current_trio_token()
        self._watches: dict[int, _Watch] = {}
        self._limiter = trio.CapacityLimiter(math.inf)  # a wait holds its thread for long
        self._waiter: HandleWaiterThread | None = None
        self._on_ready: Callable[[int], None] | None = None

    # --- the handle half of LoopBinding ------------------------------------------------

    def watch(self, handles: Iterable[int], on_ready: Callable[[int], None]) -> None:
        """Start watching; call from the trio thread."""
        handles = list(dict.fromkeys(handles))
        self._on_ready = on_ready
        if self.uses_thread:
            watched = [*(self._waiter.handles if self._waiter else ()), *handles]
            self._restart(watched)
            return
        for handle in handles:
            if handle not in self._watches:
                watch = _Watch(trio.CancelScope(), win.Event(manual_reset=True))
                self._watches[handle] = watch
                self._nursery.start_soon(self._watch_one, handle, watch)

    def forget(self, handle: int) -> None:
        if self.uses_thread:
            if self._waiter is not None and handle in self._waiter.handles:
                self._restart([h for h in self._waiter.handles if h != handle])
            return
        watch = self._watches.pop(handle, None)
        if watch is not None:
            watch.end()

    def stop(self) -> None:
        """Stop watching every handle; returns once no thread waits on any of them."""
        waiter, self._waiter = self._waiter, None
        if waiter is not None:
            waiter.stop()
        watches, self._watches = self._watches, {}
        for watch in watches.values():
            watch.end()

    # --- the two ways of waiting ---------------------------------------------------------

    def _ready(self, handle: int) -> None:
        on_ready = self._on_ready
        if on_ready is None:
            return
        try:
            on_ready(handle)
        except Exception as exc:
            self.forget(handle)
            self._on_error(exc)

    async def _watch_one(self, handle: int, watch: _Watch) -> None:
        with watch.scope:
            try:
                while True:
                    fired = await trio.to_thread.run_sync(
                        watch.wait, handle, abandon_on_cancel=True, limiter=self._limiter
                    )
                    if fired != 0 or self._watches.get(handle) is not watch:
                        return  # the cancel event: forget() or stop()
                    self._ready(handle)  # resets the handle before reading
            except Exception as exc:
                if self._watches.pop(handle, None) is watch:
                    watch.end()
                self._on_error(exc)

    def _restart(self, handles: list[int]) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None:
            waiter.stop()
        if handles:
            self._waiter = HandleWaiterThread(
                handles, self._ready, self._post, self._on_error, name="aperf-trio-win32-waiter"
            )

    def _post(self, fn: Callable[[], None]) -> bool:
        try:
            self._token.run_sync_soon(fn)
        except trio.RunFinishedError:
            return False
        return True
