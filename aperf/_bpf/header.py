"""The BPF side aperf ships: ``<aperf/buffer.bpf.h>``, where a compiler finds it, and the
globals it declares beside each map, by which the loader and the readers know the map.

The header lies in the package (``aperf/include/aperf/buffer.bpf.h``) and ships in the
wheel, as NumPy's C headers do (``numpy.get_include()``): ``aperf.include_dir()`` or
``python -m aperf --include-dir`` gives the directory to pass to ``clang -I``.
"""

from __future__ import annotations

from importlib import resources

HEADER = "aperf/buffer.bpf.h"
"""The header's name under the include directory (``#include <aperf/buffer.bpf.h>``)."""

BUFFER_MARK = "aperf_buffer_ringbuf__"
"""``.rodata`` u32 beside each ``APERF_BUFFER`` map: 1 a ring buffer, 0 a perf event array."""
BUFFER_DROPS = "aperf_buffer_dropped__"
"""``.bss`` u64 beside each ``APERF_BUFFER`` map: its outputs that found no room."""
RINGS_MARK = "aperf_ringbuf_per_cpu__"
"""``.rodata`` u32 beside each ``APERF_RINGBUF_PER_CPU`` map: its slots."""
RINGS_DROPS = "aperf_ringbuf_dropped__"
"""``.bss`` u64 array beside each ``APERF_RINGBUF_PER_CPU`` map: each CPU's drops."""


def include_dir() -> str:
    """The directory holding aperf's BPF header, for ``clang -I``.

    ``#include <aperf/buffer.bpf.h>`` in a ``.bpf.c`` then declares buffers that
    [`BPFObject(path, buffer=...)`][aperf.BPFObject] makes a BPF ring buffer or a
    perf event array before load, and per-CPU ring buffers (docs/own-program.md).
    The same path is printed by ``python -m aperf --include-dir``.
    """
    return str(resources.files("aperf") / "include")
