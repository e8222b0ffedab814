"""eBPF for Windows' ``ebpfapi.dll`` (and kernel32's waits), through ctypes:
``binding`` (the prototypes) and ``api`` (a Pythonic surface over them).

Nothing here loads a library at import time; aperf imports it only on Windows
(``_drivers/setup.resolve_source``), for a "win32" handle kind (``_waiting``), or in
tests. See docs/windows.md.
"""
