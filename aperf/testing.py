"""Tools for testing code that reads BPF rings.

``Producer`` makes the kernel emit exactly N samples of S bytes on a
chosen CPU, as fast as it can, with no attachment to any hook: a ``raw_tp``
program looping with ``bpf_loop`` and run through ``BPF_PROG_TEST_RUN`` on that
CPU, into a perf event array (``Producer()``) or a BPF ring buffer
(``Producer(ring="ringbuf")``). Each sample starts with a little-endian u64
sequence number (if S >= 8) and a u64 ``bpf_ktime_get_ns()`` timestamp (if
S >= 16); smaller samples hold the low S bytes of the sequence number; the rest is zero.

``FakeRingSource`` gives ``PerfStream`` and ``PerfBuffer`` per-CPU rings in
memory that behave like the kernel's, with real fds for the event loop: test
your own consumers without root. ``FakeRingMemory`` and the record
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

from ._bpf.object import BPFObject, Map
from ._naming import show_public_names as _show_public_names
from ._rings.perf.fake import FakeRingMemory, FakeRingSource
from ._rings.perf.format import MAX_SAMPLE_BYTES as MAX_SAMPLE_BYTES
from ._rings.perf.format import encode_lost, encode_sample
from ._rings.ringbuf.source import RingBufferSource

__all__ = [
    "MAX_RUN",
    "MAX_SAMPLE_BYTES",
    "RB_FORCE_WAKEUP",
    "RB_NO_WAKEUP",
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

# struct producer_config { u64 count, size, first_seq, target, rb_flags, discard_every,
# perf_flags; }
_CONFIG = struct.Struct("<QQQQQQQ")
_TARGETS = {"perf": 0, "ringbuf": 1}
RB_NO_WAKEUP = 1
"""``bpf_ringbuf_output`` flag: commit without waking the reader (it finds the record later)."""
RB_FORCE_WAKEUP = 2
"""``bpf_ringbuf_output`` flag: wake the reader for this record whatever its position."""
_KEY = struct.Struct("<I")
_SEQ_TS = struct.Struct("<QQ")
_FAIL_RUNS = 2047  # struct failure_log in producer.bpf.c: u64 n, u64 reserved, runs[2047]
_FAIL_RUN = struct.Struct("<QQ")  # first, count


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
    """The BPF side's own counts since load: outputs that succeeded, that failed (ring
    full), and ring buffer records reserved and discarded on purpose (``discard_every``);
    ``no_ring``: of the failed perf outputs, those that found the map slot empty
    (``-ENOENT``: no reader yet, paused, or closed), which no reader can count."""

    ok: int
    failed: int
    tag: int
    runs: int
    discarded: int = 0
    no_ring: int = 0


class Producer:
    """The deterministic sample producer (``producer.bpf.o``), loaded and ready.

    <!-- needs root -->
    ```python
    import aperf
    from aperf.testing import Producer

    with Producer() as producer, aperf.PerfBuffer(producer.map, on_sample=print) as pb:
        producer.emit(3, size=32, cpu=0)  # exactly 3 samples of 32 bytes, on CPU 0
        pb.poll(100)
    ```

    ``ring="ringbuf"`` makes it write into its BPF ring buffer (``ringbuf_bytes``
    big, 1 MiB by default) instead of its perf event array; ``map`` is then
    that ring buffer, and ``source()`` gives a stream it with the BPF side's
    count of failed outputs, so that drops arrive as ``Lost`` events.
    ``perf_slots`` sets the perf event array's ``max_entries`` (default: one slot per
    possible CPU), for channels at other slots (``emit(..., map_key=)``).
    """

    def __init__(
        self, *, tag: int = 0, path: str | None = None, ring: str = "perf",
        ringbuf_bytes: int | None = None, perf_slots: int | None = None,
    ) -> None:
        if ring not in _TARGETS:
            raise ValueError(f"ring must be 'perf' or 'ringbuf', not {ring!r}")
        self._target = _TARGETS[ring]
        self._obj = BPFObject(path or object_path("producer"))
        try:
            if tag:
                self._obj.set_global("tag", tag)
            if ringbuf_bytes is not None:
                self._obj.maps["ringbuf"].set_max_entries(ringbuf_bytes)
            if perf_slots is not None:
                self._obj.maps["samples"].set_max_entries(perf_slots)
            self._obj.load()
            self._program = self._obj.programs["produce"]
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
        """The map the samples go to: the perf event array ``samples``, or ``ringbuf``."""
        return self._obj.maps["ringbuf" if self._target else "samples"]

    def source(self) -> Map | RingBufferSource:
        """What to stream: the perf event array (the kernel counts its drops), or the
        ring buffer with the BPF side's count of failed outputs."""
        if not self._target:
            return self.map
        return RingBufferSource(self.map, dropped=lambda: self.counters().failed)

    def emit(
        self, count: int, *, size: int = 32, cpu: int = 0, first_seq: int | None = None,
        rb_flags: int = 0, discard_every: int = 0, map_key: int | None = None,
    ) -> int:
        """Emit ``count`` samples of ``size`` bytes on ``cpu``; returns the first sequence number.

        Blocks the calling thread (not the GIL) while the kernel runs the program,
        so it can run in a worker thread while a consumer reads on another CPU.
        Ring buffer only: ``rb_flags`` (``RB_NO_WAKEUP``, ``RB_FORCE_WAKEUP``)
        go to ``bpf_ringbuf_output``; with ``discard_every=N`` every sample whose
        sequence number is a multiple of N is reserved and discarded instead.
        Perf event array only: ``map_key`` makes the samples go to that slot of the
        map (``BPF_F_INDEX_MASK``) instead of the running CPU's; the kernel takes
        them only if the ring in that slot is ``cpu``'s.
        """
        if not 1 <= size <= 4096:
            raise ValueError(f"sample size must be 1..4096 bytes, not {size}")
        if count < 0:
            raise ValueError(f"count must be >= 0, not {count}")
        if (rb_flags or discard_every) and not self._target:
            raise ValueError("rb_flags and discard_every are for Producer(ring='ringbuf')")
        if map_key is not None and (self._target or not 0 <= map_key < 0xFFFFFFFF):
            raise ValueError(f"map_key={map_key!r}: a slot of the perf event array, 0 to 2**32-2")
        perf_flags = 0 if map_key is None else map_key + 1
        if rb_flags not in (0, RB_NO_WAKEUP, RB_FORCE_WAKEUP) or discard_every < 0:
            raise ValueError(f"bad rb_flags {rb_flags!r} or discard_every {discard_every!r}")
        with self._lock:
            seq = self._next_seq if first_seq is None else first_seq
            self._next_seq = seq + count
        start = seq
        while count > 0:
            batch = min(count, MAX_RUN)
            self._config.update(
                _KEY.pack(cpu),
                _CONFIG.pack(batch, size, seq, self._target, rb_flags, discard_every, perf_flags),
            )
            retval = self._program.test_run(cpu=cpu)
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
            struct.unpack("<Q", self._counters.lookup(_KEY.pack(i)))[0] for i in range(6)
        ]
        return ProducerCounters(*values)

    def failures(self, cpu: int) -> list[range]:
        """Where outputs failed on ``cpu`` since load (a full ring): each run of
        consecutive failed sequence numbers as a ``range``, in the order they failed.

        ``failed`` in ``counters()`` is their total over every CPU. RuntimeError if
        ``cpu`` had more runs than the BPF side records (2047).
        """
        if not isinstance(cpu, int) or isinstance(cpu, bool) or cpu < 0:
            raise ValueError(f"cpu must be a CPU id (an int of at least 0), not {cpu!r}")
        log_map = self._obj.maps["failures"]
        slots = log_map.lookup(_KEY.pack(0))  # per CPU: one value each, possible CPUs
        size = log_map.value_size
        if (cpu + 1) * size > len(slots):
            raise ValueError(f"cpu={cpu} is not a possible CPU")
        log = memoryview(slots)[cpu * size : (cpu + 1) * size]
        n = struct.unpack_from("<Q", log)[0]
        if n > _FAIL_RUNS:
            raise RuntimeError(f"CPU {cpu} had {n} runs of failed outputs; the producer "
                               f"records the first {_FAIL_RUNS}")
        return [range(first, first + count)
                for first, count in _FAIL_RUN.iter_unpack(log[16 : 16 + n * _FAIL_RUN.size])]

    def close(self) -> None:
        """Close the BPF object (idempotent)."""
        self._obj.close()

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

_show_public_names(globals())  # shown as this module's, not its private one's
