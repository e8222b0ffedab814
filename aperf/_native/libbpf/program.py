"""Programs (libbpf-rs: ``program.rs``): attaching one, and running one through
``BPF_PROG_TEST_RUN``."""

from __future__ import annotations

import ctypes

from . import binding as c


class _bpf_test_run_opts(ctypes.Structure):
    _fields_ = (
        ("sz", ctypes.c_size_t),
        ("data_in", ctypes.c_void_p),
        ("data_out", ctypes.c_void_p),
        ("data_size_in", ctypes.c_uint32),
        ("data_size_out", ctypes.c_uint32),
        ("ctx_in", ctypes.c_void_p),
        ("ctx_out", ctypes.c_void_p),
        ("ctx_size_in", ctypes.c_uint32),
        ("ctx_size_out", ctypes.c_uint32),
        ("retval", ctypes.c_uint32),
        ("repeat", ctypes.c_int),
        ("duration", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("cpu", ctypes.c_uint32),
        ("batch_size", ctypes.c_uint32),
    )


BPF_F_TEST_RUN_ON_CPU = 1 << 0


def test_run_on_cpu(prog_fd: int, cpu: int | None) -> int:
    """Run a raw_tp program once on ``cpu`` (None: this thread's), the GIL released
    meanwhile; its return value."""
    opts = _bpf_test_run_opts()
    opts.sz = ctypes.sizeof(opts)
    if cpu is not None:
        opts.flags = BPF_F_TEST_RUN_ON_CPU
        opts.cpu = cpu
    c.bpf_prog_test_run_opts(prog_fd, ctypes.byref(opts))
    return int(opts.retval)


def attach_program(prog: int) -> int:
    return int(c.bpf_program__attach(prog))
