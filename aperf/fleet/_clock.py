"""The host's kernel clock against its wall clock, sent with every message.

BPF programs stamp events with the kernel's boot-time clock
(``bpf_ktime_get_boot_ns()``, CLOCK_BOOTTIME), which means nothing on another
host: each host boots at its own time. So a sink sends, in a NATS header of each
message, its host's wall clock minus CLOCK_BOOTTIME, and a reader can turn a
host's kernel timestamps into wall-clock time (``FleetReader.boot_offset_ns``).
CLOCK_BOOTTIME goes on during suspend, so one offset stays right across one; a
step of the wall clock (settimeofday, NTP's first sync) is not followed until the
sink is made again. ``bpf_ktime_get_ns()`` (CLOCK_MONOTONIC) stops during suspend:
the offset fits it only on a host that never slept.
"""

from __future__ import annotations

from .._boottime import boot_offset_ns as boot_offset_ns  # measured where recordings use it

BOOT_OFFSET_HEADER = "Aperf-Boot-Offset-Ns"
_MAX_DIGITS = 21  # a signed 64-bit nanosecond count, and its sign


def parse_boot_offset(text: str | None) -> int | None:
    """The header's value, or None if absent or not a plain integer (untrusted input)."""
    if text is None or not 0 < len(text) <= _MAX_DIGITS:
        return None
    digits = text[1:] if text[0] == "-" else text
    if not (digits.isascii() and digits.isdigit()):
        return None
    return int(text)
