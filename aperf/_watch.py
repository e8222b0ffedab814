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
        self._fds: list[int] = []
        try:
            for cpu, fd in fds.items():
                loop.add_reader(fd, on_ready, cpu)
                self._fds.append(fd)
        except BaseException:
            self.stop()
            raise

    def forget(self, fd: int) -> None:
        if fd in self._fds:
            self._fds.remove(fd)
            self._loop.remove_reader(fd)

    def stop(self) -> None:
        """Remove every registration (before the fds are closed: their numbers get reused)."""
        fds, self._fds = self._fds, []
        if self._loop.is_closed():
            return
        for fd in fds:
            self._loop.remove_reader(fd)
