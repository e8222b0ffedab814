"""The only ctypes in aperf: C libraries as Python calls.

``prototypes`` (declared once, bound on first call, errno-carrying), ``libbpf/``
(libbpf), ``ebpfapi/`` (eBPF for Windows' ebpfapi.dll) and ``shared_ring`` (a perf
ring mapped a second time, for leases). Nothing here loads a library at import time.
"""
