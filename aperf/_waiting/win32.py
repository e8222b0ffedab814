"""Waiting on Windows wait handles: for the sync driver, and for event loops that cannot.

- ``Win32Waiter``: ``PerfBuffer.poll`` waits with ``WaitForMultipleObjects``
  on the rings' handles plus an event of its own, so that ``close()`` from
  another thread ends a wait before the handles are closed.
- ``HandleWaiterThread``: the fallback for any event loop that cannot wait
  on a handle itself (a selector loop, uvloop, trio without
  ``WaitForSingleObject``; and every loop on Linux, where the tests run it on
  a stand-in kernel32). One thread waits, hands each firing to the loop
  thread, and waits again only once the loop has re-armed it: the handles are
  manual-reset and stay signalled until the loop's reader resets them.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable

from .._native.ebpfapi import api as win
from .._native.ebpfapi import binding as c

_SLICE_MS = 100
"""Longest single wait on the main thread: Ctrl-C is handled between waits
(a thread blocked in WaitForMultipleObjects does not run signal handlers)."""


class Win32Waiter:
    """What ``PerfBuffer`` waits with when its source's handles are Windows wait handles.

    Its own auto-reset event, waited on with the handles, is what
    ``interrupt()`` signals; ``PerfBuffer.close()`` interrupts, then frees
    once the poll holding its lock has returned, so no handle is closed under a
    wait.
    """

    def __init__(self, handles: Iterable[int]) -> None:
        self._handles = list(dict.fromkeys(handles))
        if not 0 < len(self._handles) < c.MAXIMUM_WAIT_OBJECTS:
            raise ValueError(f"can wait on 1 to {c.MAXIMUM_WAIT_OBJECTS - 1} handles, not "
                             f"{len(self._handles)}")
        self._interrupt = win.Event(manual_reset=False)

    def watch(self, handle: int) -> None:
        if handle not in self._handles:
            self._handles.append(handle)

    def forget(self, handle: int) -> None:
        if handle in self._handles:
            self._handles.remove(handle)

    def wait(self, timeout: float) -> list[int]:
        """The handles signalled within ``timeout`` seconds (negative: no limit), lowest
        first; [] on timeout or interrupt."""
        handles = self._handles
        watched = [*handles, self._interrupt.handle]
        main = threading.current_thread() is threading.main_thread()
        deadline = None if timeout < 0 else time.monotonic() + timeout
        while True:
            if deadline is None:
                ms = _SLICE_MS if main else c.INFINITE
            else:
                ms = max(0, math.ceil((deadline - time.monotonic()) * 1000))
                if main:
                    ms = min(ms, _SLICE_MS)
            index = win.wait_any(watched, ms)
            if index is None:
                if deadline is not None and time.monotonic() >= deadline:
                    return []
                continue
            if index == len(handles):
                return []  # interrupt()
            return [handles[index]] + [h for h in handles[index + 1 :] if win.is_signalled(h)]

    def interrupt(self) -> None:
        if self._interrupt.handle:
            self._interrupt.set()

    def close(self) -> None:
        """Release the interrupt event (no wait may be in progress). Idempotent."""
        self._interrupt.close()


Post = Callable[[Callable[[], None]], bool]
"""Run a function on the loop's thread; False if the loop no longer runs."""


class HandleWaiterThread:
    """A thread waiting on handles for a loop: ``on_ready(handle)`` runs on the loop's thread.

    Each firing is handed over with ``post``; the thread then waits for the
    loop to re-arm it (after ``on_ready`` returned, which reset the handle)
    before it waits on the handles again. ``on_error`` gets, on the loop's
    thread, what ``on_ready`` raised, or what the thread met (then it ends). ``stop()``
    returns once the thread no longer waits on any handle, so the caller may
    close them.
    """

    def __init__(
        self,
        handles: Iterable[int],
        on_ready: Callable[[int], None],
        post: Post,
        on_error: Callable[[BaseException], None],
        *,
        name: str = "aperf-win32-waiter",
    ) -> None:
        self._handles = list(dict.fromkeys(handles))
        if not 0 < len(self._handles) < c.MAXIMUM_WAIT_OBJECTS:
            raise ValueError(f"can watch 1 to {c.MAXIMUM_WAIT_OBJECTS - 1} handles, not "
                             f"{len(self._handles)}")
        self._on_ready = on_ready
        self._post = post
        self._on_error = on_error
        self._control = win.Event(manual_reset=False)  # re-arm, or stop
        self._lock = threading.Lock()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def handles(self) -> list[int]:
        return list(self._handles)

    def _run(self) -> None:
        handles = self._handles
        watched = [*handles, self._control.handle]
        try:
            while not self._stopping:
                index = win.wait_any(watched, c.INFINITE)
                if index is None or index == len(handles):
                    continue  # stop() (or a stray re-arm): look at _stopping again
                handle = handles[index]
                if not self._post(lambda handle=handle: self._deliver(handle)):  # type: ignore[misc]
                    return  # the loop is gone
                win.wait_one(self._control.handle, c.INFINITE)
        except BaseException as exc:
            if not self._stopping:
                self._post(lambda error=exc: self._on_error(error))  # type: ignore[misc]

    def _deliver(self, handle: int) -> None:
        """On the loop's thread: the handle fired. Re-arm the waiter whatever happens."""
        try:
            if not self._stopping:
                self._on_ready(handle)
        except Exception as exc:
            self._on_error(exc)
        finally:
            with self._lock:
                if self._control.handle:
                    self._control.set()

    def stop(self) -> None:
        """Make the thread leave its waits and end, wait for it, release the control event."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            self._control.set()
        if threading.current_thread() is not self._thread:
            self._thread.join()
        with self._lock:
            self._control.close()
