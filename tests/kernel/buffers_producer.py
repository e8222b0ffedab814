"""bpf/buffers.bpf.o loaded: the kernel emits exactly N samples on a chosen CPU into the
buffer of ``<aperf/buffer.bpf.h>`` (``APERF_BUFFER``, a ring buffer or a perf event array
as the loader chose) or into that CPU's ring of its per-CPU ring buffers
(``APERF_RINGBUF_PER_CPU``). Samples are laid out as aperf.testing.Producer's: a u64
sequence number, a u64 ``bpf_ktime_get_ns()``, zeros."""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass

import aperf
from aperf._native import libbpf as lb

from ..helpers import BPF_DIR

OBJECT = BPF_DIR / "buffers.bpf.o"
TARGETS = {"output": 0, "reserve": 1, "rings": 2, "user_rings": 3}
RESERVED_SIZE = 512  # what target "reserve" always sends (struct buffers_sample)
_CONFIG = struct.Struct("<QQQQQ")  # count, size, first_seq, target, discard_every
_KEY = struct.Struct("<I")


@dataclass(frozen=True)
class Counts:
    """The program's own counts: outputs that succeeded, failed, were discarded."""

    ok: int
    failed: int
    discarded: int
    runs: int


class Buffers:
    """The object, opened with ``buffer=`` and loaded (``events`` and each ring of
    ``rings`` resized first if asked)."""

    def __init__(self, buffer: str | None = None, *, events_bytes: int | None = None,
                 ring_bytes: int | None = None) -> None:
        self.obj = aperf.BPFObject(OBJECT, buffer=buffer)  # type: ignore[arg-type]
        try:
            if events_bytes is not None:
                self.obj.maps["events"].set_max_entries(events_bytes)
            if ring_bytes is not None:  # each CPU's ring of "rings"
                self.obj.maps["rings"].set_inner_max_entries(ring_bytes)
            self.obj.load()
        except BaseException:
            self.obj.close()
            raise
        self._prog = self.obj.programs["produce"].fd
        self._lock = threading.Lock()

    def emit(self, count: int, *, cpu: int, target: str = "output", size: int = 32,
             first_seq: int = 0, discard_every: int = 0) -> None:
        """``count`` samples of ``size`` bytes on ``cpu``, numbered from ``first_seq``."""
        if target == "reserve":
            size = RESERVED_SIZE
        with self._lock:  # one config slot per CPU: a run reads it while it runs
            self.obj.maps["config"].update(
                _KEY.pack(cpu),
                _CONFIG.pack(count, size, first_seq, TARGETS[target], discard_every),
            )
            assert lb.test_run_on_cpu(self._prog, cpu) == 0, "the program refused the config"

    def spawn(self, count: int, **kwargs: object) -> threading.Thread:
        thread = threading.Thread(target=self.emit, args=(count,), kwargs=kwargs)
        thread.start()
        return thread

    def counts(self) -> Counts:
        """The program's counts, kept in .bss globals and read live."""
        read = self.obj.read_global
        return Counts(read("produced_ok"), read("produced_failed"),
                      read("produced_discarded"), read("produced_runs"))

    def close(self) -> None:
        self.obj.close()

    def __enter__(self) -> Buffers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def seq(sample: aperf.Sample) -> int:
    return int.from_bytes(sample.data[:8], "little")


def stamp(sample: aperf.Sample) -> int:
    return int.from_bytes(sample.data[8:16], "little")
