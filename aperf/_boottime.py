"""The host's wall clock against its kernel clocks, to read BPF timestamps as dates.

BPF programs stamp events with ``bpf_ktime_get_boot_ns()`` (CLOCK_BOOTTIME) or
``bpf_ktime_get_ns()`` (CLOCK_MONOTONIC): nanoseconds since boot, which mean nothing
on another host or after a reboot. Adding the wall clock minus that clock, read once,
gives dates. CLOCK_BOOTTIME goes on during suspend, so one offset stays right across
one; CLOCK_MONOTONIC stops, so its offset fits only a host that never slept. A step of
the wall clock (settimeofday, NTP's first sync) is not followed until it is read again.
"""

from __future__ import annotations

import time


def clock_offset_ns(clock: int, tries: int = 5) -> int:
    """The wall clock minus ``clock`` (ns): the narrowest of a few reads between two
    reads of ``clock`` (one preempted read, milliseconds on a busy machine, would put
    every event that far off)."""
    best_width, best = None, 0
    for _ in range(tries):
        before = time.clock_gettime_ns(clock)
        wall = time.time_ns()
        after = time.clock_gettime_ns(clock)
        if best_width is None or after - before < best_width:
            best_width, best = after - before, wall - (before + after) // 2
    return best


def boot_offset_ns(tries: int = 5) -> int | None:
    """This host's wall clock minus CLOCK_BOOTTIME (ns), or None where there is none."""
    boottime = getattr(time, "CLOCK_BOOTTIME", None)
    if boottime is None:  # not Linux
        return None
    return clock_offset_ns(boottime, tries)


def monotonic_offset_ns(tries: int = 5) -> int:
    """This host's wall clock minus CLOCK_MONOTONIC (ns)."""
    return clock_offset_ns(time.CLOCK_MONOTONIC, tries)


def boottime_ns() -> int:
    """CLOCK_BOOTTIME now (CLOCK_MONOTONIC where there is none)."""
    return time.clock_gettime_ns(getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC))
