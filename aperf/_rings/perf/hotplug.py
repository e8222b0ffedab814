"""CPU hotplug as the kernel announces it: the ``online``/``offline`` uevents of cpu
devices, heard on a netlink socket (``NETLINK_KOBJECT_UEVENT``) whose fd a perf source
hands the drivers as one more readiness handle (see docs/rings.md, "CPU hotplug").

A perf ring's fd says nothing when its CPU goes offline (measured on Linux 6.18: no
poll event, the ring still holds what was written), and its event never runs again
once the CPU is back (outputs there fail): only the uevent tells.
"""

from __future__ import annotations

import socket

__all__ = ["CpuWatch", "parse_uevent"]

NETLINK_KOBJECT_UEVENT = 15
_KERNEL_GROUP = 1  # the kernel's own uevents (udev re-sends them on group 2)
_CPU_DEVICE = b"/devices/system/cpu/cpu"
RESYNC = ("resync", -1)
"""Uevents were dropped (the socket's queue overflowed): compare with sysfs instead."""


def parse_uevent(message: bytes) -> tuple[str, int] | None:
    """``("online" | "offline", cpu)`` from a kernel uevent, None for any other message."""
    head = message.split(b"\0", 1)[0]
    action, _, path = head.partition(b"@")
    if action not in (b"online", b"offline") or not path.startswith(_CPU_DEVICE):
        return None
    digits = path[len(_CPU_DEVICE):]
    if not digits.isdigit() or len(digits) > 6:
        return None
    return action.decode(), int(digits)


class CpuWatch:
    """The kernel's uevent socket, non-blocking; ``fd`` turns readable on any uevent."""

    def __init__(self) -> None:
        sock = socket.socket(
            socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC,
            NETLINK_KOBJECT_UEVENT,
        )
        try:
            sock.bind((0, _KERNEL_GROUP))
        except BaseException:
            sock.close()
            raise
        self._sock: socket.socket | None = sock
        self.fd = sock.fileno()

    def changes(self) -> list[tuple[str, int]]:
        """The CPU changes announced since the last call, in order (``RESYNC`` if some
        were dropped). Messages not from the kernel (pid 0) are ignored."""
        sock = self._sock
        found: list[tuple[str, int]] = []
        while sock is not None:
            try:
                message, sender = sock.recvfrom(8192)
            except BlockingIOError:
                break
            except OSError:  # ENOBUFS: the queue overflowed, uevents were lost
                found.append(RESYNC)
                continue
            change = parse_uevent(message) if sender[0] == 0 else None
            if change is not None:
                found.append(change)
        return found

    def close(self) -> None:
        sock, self._sock = self._sock, None
        self.fd = -1
        if sock is not None:
            sock.close()
