"""The only ctypes in aperf: C libraries as Python calls.

``prototypes`` (declared once, bound on first call, errno-carrying), ``libbpf/``
(libbpf), ``ebpfapi/`` (eBPF for Windows' ebpfapi.dll) and ``libc/`` (libc's functions
declared on first use, a timer on an fd, a perf ring mapped a second time for leases).
Nothing here loads a library at import time.
"""
