"""The seam between rings and an event loop.

A watcher tells the loop to call ``on_ready(cpu)`` when a CPU's ring is woken
and undoes that on ``stop()``. On Linux each ring is an fd, registered once
with ``loop.add_reader``. A Windows backend (eBPF for Windows gives one wait
handle per perf buffer, registered with the Proactor loop) would provide
another class with this shape; the stream code does not change.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol


class RingWatcher(Protocol):
    def forget(self, cpu: int) -> None: ...

    def stop(self) -> None: ...


class FdWatcher:
    """``loop.add_reader`` on each ring fd (Linux: default asyncio loop and uvloop)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        fds: dict[int, int],
        on_ready: Callable[[int], None],
    ) -> None:
        self._loop = loop
        self._fds: dict[int, int] = {}  # cpu -> registered fd
        try:
            for cpu, fd in fds.items():
                loop.add_reader(fd, on_ready, cpu)
                self._fds[cpu] = fd
        except BaseException:
            self.stop()
            raise

    def forget(self, cpu: int) -> None:
        """Stop watching one CPU's ring (it broke: its wakeups would only be ignored)."""
        fd = self._fds.pop(cpu, None)
        if fd is not None and not self._loop.is_closed():
            self._loop.remove_reader(fd)

    def stop(self) -> None:
        """Remove every registration (before the fds are closed: their numbers get reused)."""
        fds, self._fds = list(self._fds.values()), {}
        if self._loop.is_closed():
            return
        for fd in fds:
            self._loop.remove_reader(fd)
