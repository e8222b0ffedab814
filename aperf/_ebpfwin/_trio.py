"""Windows wait handles watched from a trio run: the piece a trio ``LoopBinding`` needs.

:class:`TrioHandleWatcher` has the handle half of ``LoopBinding`` (``watch``,
``forget``, ``stop``); a trio binding delegates to it for the "win32" handle
kind. On Windows it runs a task per handle awaiting
``trio.lowlevel.WaitForSingleObject``; where that does not exist (or with
``thread=True``) a :class:`~aperf._ebpfwin._waits.HandleWaiterThread` hands
each firing over through the run's ``TrioToken``. Either way ``on_ready``
runs on the trio thread, resets the manual-reset handle, then reads; the
handle is waited on again only after that.

Caveat of the task mode: trio abandons the thread behind a cancelled
``WaitForSingleObject`` (it signals a cancel event the thread also waits on),
so that thread may still be in its wait for a moment after :meth:`stop`
returns; the thread mode joins its thread. A binding that closes the handle
right after ``stop()`` should prefer ``thread=True``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import trio

from ._waits import HandleWaiterThread

WaitForObject = Callable[[int], Awaitable[Any]]


class TrioHandleWatcher:
    """Call ``on_ready(handle)`` on the trio thread each time a watched handle fires.

    ``nursery`` hosts the watching tasks (task mode); ``on_error`` gets, on the
    trio thread, what a wait or ``on_ready`` raised (the handle is then no
    longer watched). ``wait_for_object`` replaces
    ``trio.lowlevel.WaitForSingleObject`` (tests on Linux give one built on a
    stand-in kernel32).
    """

    def __init__(
        self,
        nursery: trio.Nursery,
        on_error: Callable[[BaseException], None],
        *,
        wait_for_object: WaitForObject | None = None,
        thread: bool | None = None,
    ) -> None:
        self._nursery = nursery
        self._on_error = on_error
        wait = wait_for_object or getattr(trio.lowlevel, "WaitForSingleObject", None)
        self._wait: WaitForObject | None = wait
        self.uses_thread = thread if thread is not None else wait is None
        if not self.uses_thread and wait is None:
            raise RuntimeError("trio.lowlevel.WaitForSingleObject exists on Windows only")
        self._token = trio.lowlevel.current_trio_token()
        self._scopes: dict[int, trio.CancelScope] = {}
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
            if handle not in self._scopes:
                scope = trio.CancelScope()
                self._scopes[handle] = scope
                self._nursery.start_soon(self._watch_one, handle, scope)

    def forget(self, handle: int) -> None:
        if self.uses_thread:
            if self._waiter is not None and handle in self._waiter.handles:
                self._restart([h for h in self._waiter.handles if h != handle])
            return
        scope = self._scopes.pop(handle, None)
        if scope is not None:
            scope.cancel()

    def stop(self) -> None:
        """Stop watching every handle (the thread mode returns once its thread has ended)."""
        waiter, self._waiter = self._waiter, None
        if waiter is not None:
            waiter.stop()
        scopes, self._scopes = self._scopes, {}
        for scope in scopes.values():
            scope.cancel()

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

    async def _watch_one(self, handle: int, scope: trio.CancelScope) -> None:
        wait = self._wait
        assert wait is not None
        with scope:
            try:
                while True:
                    await wait(handle)
                    if self._scopes.get(handle) is not scope:
                        return
                    self._ready(handle)  # resets the handle before reading
                    # WaitForSingleObject returns at once, with no checkpoint, on a
                    # handle still signalled: let the other tasks run.
                    await trio.lowlevel.checkpoint()
            except Exception as exc:
                self._scopes.pop(handle, None)
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
