"""The sync driver's wait on Linux: the rings' fds in an epoll set."""

from __future__ import annotations

import contextlib
import os
import select
from collections.abc import Iterable


class EpollWaiter:
    """Ring fds in an epoll set, with an eventfd in that set for ``interrupt()``."""

    def __init__(self, fds: Iterable[int]) -> None:
        self.wake_fd = -1
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
        if self.wake_fd >= 0:
            os.eventfd_write(self.wake_fd, 1)

    def close(self) -> None:
        self.epoll.close()
        if self.wake_fd >= 0:
            os.close(self.wake_fd)
            self.wake_fd = -1
