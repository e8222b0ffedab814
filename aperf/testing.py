"""Tools for testing code that reads perf rings.

:class:`Producer` makes the kernel emit exactly N perf samples of S bytes on a
chosen CPU, as fast as it can, with no attachment to any hook: a ``raw_tp``
program looping with ``bpf_loop`` and run through ``BPF_PROG_TEST_RUN`` on that
CPU. Each sample starts with a little-endian u64 sequence number (if S >= 8)
and a u64 ``bpf_ktime_get_ns()`` timestamp (if S >= 16); smaller samples hold
the low S bytes of the sequence number; the rest is zero.

:class:`FakeRingSource` gives ``PerfStream`` and ``PerfBuffer`` per-CPU rings in
memory that behave like the kernel's, with real fds for the event loop: test
your own consumers without root. :class:`FakeRingMemory` and the record
encoders build single rings for tests of ring-reading code.
"""

from __future__ import annotations

import os
import struct
import threading
import time
from dataclasses import dataclass
from importlib import resources
from typing import Any

from . import _libbpf as lb
from ._fake import FakeRingMemory, FakeRingSource
from ._object import BPFObject, Map
from ._perf_format import encode_lost, encode_sample

__all__ = [
    "MAX_RUN",
    "FakeRingMemory",
    "FakeRingSource",
    "Producer",
    "ProducerCounters",
    "encode_lost",
    "encode_sample",
    "object_path",
    "sample_header",
]

MAX_RUN = 1 << 23
"""Most samples one program run emits (bpf_loop's limit); larger counts take several runs."""

_CONFIG = struct.Struct("<QQQ")  # struct producer_config { u64 count, size, first_seq; }
_KEY = struct.Struct("<I")
_SEQ_TS = struct.Struct("<QQ")


def object_path(name: str) -> str:
    """Path of a BPF object shipped in the package (``producer``, ``kinds``)."""
    override = os.environ.get("APERF_OBJECT_DIR")
    if override:
        return os.path.join(override, f"{name}.bpf.o")
    return str(resources.files("aperf") / "_objects" / f"{name}.bpf.o")


def sample_header(data: bytes) -> tuple[int, int]:
    """(sequence number, ktime ns) from a producer sample of at least 16 bytes."""
    return _SEQ_TS.unpack_from(data)


@dataclass(frozen=True)
class ProducerCounters:
    """The BPF side's own counts since load: outputs that succeeded, that failed (ring full)."""

    ok: int
    failed: int
    tag: int
    runs: int


class Producer:
    """The deterministic sample producer (``producer.bpf.o``), loaded and ready.

    >>> with Producer() as producer, PerfBuffer(producer.map, on_sample=...) as pb:
    ...     producer.emit(1000, size=32, cpu=0)
    """

    def __init__(self, *, tag: int = 0, path: str | None = None) -> None:
        self._obj = BPFObject(path or object_path("producer"))
        try:
            if tag:
                self._obj.set_global("tag", tag)
            self._obj.load()
            self._prog_fd = self._obj.programs["produce"].fd
            self._config = self._obj.maps["config"]
            self._counters = self._obj.maps["counters"]
        except BaseException:
            self._obj.close()
            raise
        self._next_seq = 0
        self._lock = threading.Lock()

    @property
    def object(self) -> BPFObject:
        """The loaded BPFObject behind the producer."""
        return self._obj

    @property
    def map(self) -> Map:
        """The perf event array the samples go to (``samples``)."""
        return self._obj.maps["samples"]

    def emit(
        self, count: int, *, size: int = 32, cpu: int = 0, first_seq: int | None = None
    ) -> int:
        """Emit ``count`` samples of ``size`` bytes on ``cpu``; returns the first sequence number.

        Blocks the calling thread (not the GIL) while the kernel runs the program,
        so it can run in a worker thread while a consumer reads on another CPU.
        """
        if not 1 <= size <= 4096:
            raise ValueError(f"sample size must be 1..4096 bytes, not {size}")
        if count < 0:
            raise ValueError(f"count must be >= 0, not {count}")
        with self._lock:
            seq = self._next_seq if first_seq is None else first_seq
            self._next_seq = seq + count
        start = seq
        while count > 0:
            batch = min(count, MAX_RUN)
            self._config.update(_KEY.pack(cpu), _CONFIG.pack(batch, size, seq))
            retval = lb.test_run_on_cpu(self._prog_fd, cpu)
            if retval != 0:
                raise RuntimeError(f"producer program refused the run (returned {retval})")
            seq += batch
            count -= batch
        return start

    def spawn(
        self, count: int, *, size: int = 32, cpu: int = 0, then_flush: bool = False
    ) -> threading.Thread:
        """Emit from a new thread pinned to ``cpu`` (started; ``join()`` it).

        Pinning matters: a run on another CPU than the caller's makes the caller
        busy-wait in the kernel for the whole run, starving a consumer there.
        With ``then_flush``, one more sample follows after 50 ms, so that the
        kernel writes the lost record of an overflow (it only does so in front
        of the next sample that fits).
        """

        def run() -> None:
            os.sched_setaffinity(0, {cpu})
            self.emit(count, size=size, cpu=cpu)
            if then_flush:
                time.sleep(0.05)
                self.emit(1, size=size, cpu=cpu)

        thread = threading.Thread(target=run, name=f"aperf-producer-cpu{cpu}", daemon=True)
        thread.start()
        return thread

    def counters(self) -> ProducerCounters:
        """The BPF side's own counts since load."""
        values = [
            struct.unpack("<Q", self._counters.lookup(_KEY.pack(i)))[0] for i in range(4)
        ]
        return ProducerCounters(*values)

    def close(self) -> None:
        """Close the BPF object (idempotent)."""
        self._obj.close()

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
