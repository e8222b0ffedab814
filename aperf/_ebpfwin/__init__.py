"""eBPF for Windows: perf event arrays and ring buffers read through ``ebpfapi.dll``
(ctypes, only here and in ``_libbpf/``), and the Windows wait handles they signal.

Nothing here loads a library at import time; aperf imports this package only
on Windows (``_setup.resolve_source``), for a "win32" handle kind
(``_waiting``), or in tests. ``_trio`` (needs trio) is imported by
its user only. See docs/windows.md.
"""

from ._binding import EBPFAPI_ENV, KERNEL32_ENV
from ._ringbuf import WindowsMapSource, WindowsRingBufferSource
from ._source import WINDOWS_RECORDS, WindowsPerfSource, WindowsRecords
from ._waits import HandleWaiterThread, Win32Waiter

__all__ = [
    "EBPFAPI_ENV",
    "KERNEL32_ENV",
    "WINDOWS_RECORDS",
    "HandleWaiterThread",
    "Win32Waiter",
    "WindowsMapSource",
    "WindowsPerfSource",
    "WindowsRecords",
    "WindowsRingBufferSource",
]
