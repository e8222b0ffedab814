"""A timer on an fd, to the nanosecond (``timerfd_create(2)``)."""

from __future__ import annotations

import ctypes
import os

from .functions import libc_function


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


_CLOCK_MONOTONIC = 1
_TFD_NONBLOCK, _TFD_CLOEXEC = os.O_NONBLOCK, os.O_CLOEXEC  # as timerfd.h defines them


class TimerFd:
    """A one-shot ``CLOCK_MONOTONIC`` timer on an fd (``timerfd_create(2)``), to the nanosecond.

    Event loops round a timer's wait up to the millisecond (``epoll_wait``'s unit):
    a 1 ms timer re-armed after some work fires 1 ms after that work, and a drain
    timer drifts to about 1.2 ms. This one fires when it is due; the loop waits on
    its fd like on any other (Python has ``os.timerfd_create`` only from 3.13).
    """

    __slots__ = ("_ref", "_settime", "_spec", "fd")

    def __init__(self) -> None:
        create = libc_function("timerfd_create", ctypes.c_int, ctypes.c_int, ctypes.c_int)
        fd = create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"timerfd_create: {os.strerror(err)}")
        self.fd = fd
        self._settime = libc_function("timerfd_settime", ctypes.c_int, ctypes.c_int,
                                      ctypes.c_int, ctypes.POINTER(_Itimerspec), ctypes.c_void_p)
        self._spec = _Itimerspec()
        self._ref = ctypes.byref(self._spec)

    def arm(self, delay: float | None) -> None:
        """Fire once ``delay`` seconds from now (at once if not positive); None: disarm."""
        value = self._spec.it_value
        if delay is None:
            value.tv_sec = value.tv_nsec = 0
        else:
            value.tv_sec, value.tv_nsec = divmod(max(1, int(delay * 1e9)), 1_000_000_000)
        if self._settime(self.fd, 0, self._ref, None) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"timerfd_settime: {os.strerror(err)}")

    def expired(self) -> bool:
        """Clear the fd; whether the timer had fired (False: a stale report)."""
        try:
            os.read(self.fd, 8)
        except BlockingIOError:
            return False
        return True

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)
