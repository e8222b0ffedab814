"""The sync driver's wait on Linux: the rings' fds in an epoll set."""

from __future__ import annotations

import contextlib
import os
import select
import threading
from collections.abc import Iterable


class EpollWaiter:
    """Ring fds in an epoll set, with an eventfd in that set for ``interrupt()``.

    ``interrupt()`` may come from any thread, also while another one closes the
    waiter (two ``PerfBuffer.close()`` calls at once): the eventfd is given up under a
    lock before it is closed, so an interrupt never writes into a closed fd, whose
    number may already be another file's."""

    def __init__(self, fds: Iterable[int]) -> None:
        self.wake_fd = -1
        self._wake_lock = threading.Lock()
        self.epoll = select.epoll()
        try:
            for fd in fds:
                self.epoll.register(fd, select.EPOLLIN)
            self.wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            self.epoll.register(self.wake_fd, select.EPOLLIN)
        except BaseException:
            self.close()
            raise

    def wait(self, timeout: float) -> list[int]:
        ready = []
        for fd, _ in self.epoll.poll(timeout):  # retries EINTR itself (PEP 475)
            if fd == self.wake_fd:
                # close()'s, or not ours (e.g. a forked child's close)
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(self.wake_fd)
            else:
                ready.append(fd)
        return ready

    def watch(self, handle: int) -> None:
        self.epoll.register(handle, select.EPOLLIN)

    def forget(self, handle: int) -> None:
        with contextlib.suppress(OSError):  # never registered, or closed already
            self.epoll.unregister(handle)

    def interrupt(self) -> None:
        with self._wake_lock:
            if self.wake_fd >= 0:
                os.eventfd_write(self.wake_fd, 1)

    def close(self) -> None:
        self.epoll.close()
        with self._wake_lock:
            fd, self.wake_fd = self.wake_fd, -1
        if fd >= 0:
            os.close(fd)
