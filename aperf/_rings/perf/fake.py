"""Perf rings in memory that behave like the kernel's, for tests without root.

``FakeRingSource`` is a ring source (see ``_rings/seam.py``): bounded per-CPU
rings in plain memory, written as the kernel writes perf rings, with one
eventfd per ring as its readiness handle, so ``PerfStream`` and
``PerfBuffer`` run on it exactly as on a perf event array.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Sequence

from ..._errors import BusyResourceError, ClosedResourceError, RingSizeError
from ..._options import MAX_RING_BYTES, Wakeup
from ..seam import HandleKind, RecordFormat, RingConfig
from .format import PERF_RECORDS, PerfRing, encode_lost, encode_sample
from .source import perf_wakeup


class FakeRingMemory:
    """A ring in plain memory, shaped like a perf ring's (head, tail, data)."""

    def __init__(self, size: int = 4096) -> None:
        if size <= 0 or size & (size - 1):
            raise ValueError(f"size must be a power of two, not {size!r}")
        self.size = size
        self.data = bytearray(size)
        self.head = 0
        self.tail = 0

    def positions(self) -> tuple[int, int]:
        """(head, tail): bytes ever written, and bytes ever released."""
        return self.head, self.tail

    def copy(self, offset: int, length: int) -> bytes:
        """``length`` bytes from ``offset`` of the data area."""
        if offset < 0 or length < 0 or offset + length > self.size:
            raise IndexError(f"{length} bytes at {offset} are outside a {self.size}-byte ring")
        return bytes(self.data[offset : offset + length])

    def set_tail(self, tail: int) -> None:
        """Release everything below ``tail``."""
        self.tail = tail

    def free_bytes(self) -> int:
        """Room left in the ring."""
        return self.size - (self.head - self.tail)

    def write(self, record: bytes) -> bool:
        """Append a record as the kernel would (wrapping); False if it does not fit."""
        if self.free_bytes() < len(record):
            return False
        start = self.head % self.size
        first = min(len(record), self.size - start)
        self.data[start : start + first] = record[:first]
        self.data[: len(record) - first] = record[first:]
        self.head += len(record)
        return True


class _Readiness:
    """An eventfd (a pipe where there is none) that a loop polls for input."""

    def __init__(self) -> None:
        if hasattr(os, "eventfd"):
            self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            self._write_fd = self.fd
        else:  # pragma: no cover - platforms without eventfd
            self.fd, self._write_fd = os.pipe()
            os.set_blocking(self.fd, False)

    def signal(self) -> None:
        os.write(self._write_fd, (1).to_bytes(8, "little"))

    def clear(self) -> None:
        try:
            while os.read(self.fd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        if self._write_fd != self.fd:
            os.close(self._write_fd)
        os.close(self.fd)


class _FakeRing(PerfRing):
    __slots__ = (
        "_lock",
        "_lost",
        "_ready",
        "bytes_since_wakeup",
        "dropped",
        "exact",
        "since_wakeup",
    )

    def __init__(self, cpu: int, size: int, lock: threading.Lock, exact: bool) -> None:
        self._ready = _Readiness()
        super().__init__(cpu, self._ready.fd, FakeRingMemory(size))
        self._lock = lock
        self._lost = 0  # dropped since the last lost record was written
        self.dropped = 0  # dropped in all
        self.exact = exact
        self.since_wakeup = 0
        self.bytes_since_wakeup = 0

    def take(self) -> bytes:
        with self._lock:
            return super().take()

    def pending_bytes(self) -> int:
        with self._lock:
            return super().pending_bytes()

    def lost_total(self) -> int | None:
        return self.dropped if self.exact else None


class FakeRingSource:
    """Per-CPU perf rings in memory, for testing code that reads aperf streams without root.

    It behaves like the kernel, not like a queue: each ring holds ``ring_bytes``
    of records; a sample that does not fit is dropped and counted, and a lost
    record is written in front of the next sample that fits; readiness follows
    the stream's wakeup setting (per sample, every N samples, a byte
    watermark) through a real fd per ring that the event loop watches, and
    fires once per wakeup. Corrupt records can be injected.

    ```python
    import asyncio
    import struct

    import aperf
    from aperf.testing import FakeRingSource


    async def main() -> None:
        src = FakeRingSource(cpus=[0, 1], ring_bytes=4096)
        async with aperf.PerfStream(src, decoder=struct.Struct("<QQ")) as stream:
            assert src.write(0, struct.pack("<QQ", 1, 2))  # False: full, counted as lost
            async for event in stream:
                print(event)  # Sample(cpu=0, data=b'...', value=(1, 2))
                break


    asyncio.run(main())
    ```

    ``exact_lost=False`` makes it behave like a kernel before Linux 6.0, which
    counts drops only through lost records. Writing is thread-safe.
    """

    handle_kind: HandleKind = "fd"
    records: RecordFormat = PERF_RECORDS

    def __init__(
        self, cpus: Iterable[int] = (0,), ring_bytes: int = 4096, *, exact_lost: bool = True,
        name: str = "fake",
    ) -> None:
        keys = list(cpus)
        if not keys or any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in keys):
            raise ValueError(f"cpus must be non-negative ints, not {cpus!r}")
        if len(set(keys)) != len(keys):
            raise ValueError(f"cpus must not repeat: {keys}")
        if isinstance(ring_bytes, bool) or not isinstance(ring_bytes, int) or (
            ring_bytes < 32 or ring_bytes & (ring_bytes - 1)
        ):
            raise ValueError(f"ring_bytes must be a power of two >= 32, not {ring_bytes!r}")
        if ring_bytes > MAX_RING_BYTES:  # as for kernel rings (pages=, ring_bytes=)
            raise RingSizeError(
                f"ring_bytes={ring_bytes} is too large: at most {MAX_RING_BYTES} "
                f"({MAX_RING_BYTES >> 20} MiB) per ring"
            )
        self.name = name
        self.cpus = keys
        self._ring_bytes = ring_bytes
        self._exact = exact_lost
        self._lock = threading.Lock()
        self._rings: dict[int, _FakeRing] = {}
        self._dropped_at_free: dict[int, int] = {}
        self._wakeup = Wakeup.per_sample()
        self._events, self._watermark = 1, 0

    # --- the ring source protocol ----------------------------------------------------

    @property
    def ring_bytes(self) -> int:
        """Bytes of each ring (a stream's ``pages``/``ring_bytes`` override it at open)."""
        return self._ring_bytes

    @property
    def memory_bytes(self) -> int:
        """Bytes of all rings."""
        return len(self.cpus) * self._ring_bytes

    def open(self, config: RingConfig) -> Sequence[PerfRing]:
        """Create the rings for a reader (the RingSource protocol; streams call it)."""
        with self._lock:
            if self._rings:
                raise BusyResourceError(f"fake ring source {self.name!r} is already open")
            if config.ring_bytes is not None:
                self._ring_bytes = config.ring_bytes
            self._events, self._watermark = perf_wakeup(config.wakeup, self._ring_bytes)
            rings: dict[int, _FakeRing] = {}
            try:
                for cpu in self.cpus:
                    rings[cpu] = _FakeRing(cpu, self._ring_bytes, self._lock, self._exact)
            except BaseException:
                for ring in rings.values():
                    ring._ready.close()
                raise
            self._rings = rings
            return list(rings.values())

    def acknowledge(self, handle: int) -> None:
        """Clear a ring's readiness before it is read (the RingSource protocol)."""
        for ring in self._rings.values():
            if ring.handle == handle:
                ring._ready.clear()

    def after_fork(self) -> None:
        """In a child: the memory is a private copy; close the child's eventfds only.

        No lock: one held by another thread at the fork stays held in the child.
        """
        self._lock = threading.Lock()
        rings, self._rings = self._rings, {}
        for ring in rings.values():
            ring._ready.close()

    def free(self) -> None:
        """Close the rings' fds (the RingSource protocol; idempotent; write() then fails)."""
        with self._lock:
            rings, self._rings = self._rings, {}
            if rings:
                self._dropped_at_free = {cpu: ring.dropped for cpu, ring in rings.items()}
        for ring in rings.values():
            ring._ready.close()

    # --- producing -----------------------------------------------------------------

    def _ring(self, cpu: int) -> _FakeRing:
        ring = self._rings.get(cpu)
        if ring is None:
            if cpu not in self.cpus:
                raise ValueError(f"no ring for CPU {cpu!r}; rings: {self.cpus}")
            raise ClosedResourceError(f"fake ring source {self.name!r} is not open")
        return ring

    def write(self, cpu: int, payload: bytes) -> bool:
        """Output one sample on ``cpu``'s ring, as ``bpf_perf_event_output`` does.

        False if it did not fit: it is dropped and counted, and the lost
        record goes in front of the next sample that fits.
        """
        if not isinstance(payload, bytes | bytearray | memoryview):
            raise TypeError(f"payload must be bytes, not {type(payload).__name__}")
        record = encode_sample(bytes(payload))  # ArgumentError past MAX_SAMPLE_BYTES
        with self._lock:
            ring = self._ring(cpu)
            lost = encode_lost(ring._lost) if ring._lost else b""
            if ring.memory.free_bytes() < len(lost) + len(record):  # type: ignore[attr-defined]
                ring._lost += 1
                ring.dropped += 1
                return False
            ring._lost = 0
            ring.memory.write(lost + record)  # type: ignore[attr-defined]
            self._count_output(ring, len(lost) + len(record))
            return True

    def inject(self, cpu: int, raw: bytes) -> bool:
        """Write raw bytes into ``cpu``'s ring (e.g. a corrupt record) and wake the reader."""
        if not isinstance(raw, bytes | bytearray | memoryview):
            raise TypeError(f"raw must be bytes, not {type(raw).__name__}")
        with self._lock:
            ring = self._ring(cpu)
            if not ring.memory.write(bytes(raw)):  # type: ignore[attr-defined]
                return False
            ring._ready.signal()
            return True

    def _count_output(self, ring: _FakeRing, nbytes: int) -> None:
        ring.since_wakeup += 1
        ring.bytes_since_wakeup += nbytes
        if self._watermark:
            due = ring.bytes_since_wakeup >= self._watermark
        else:
            due = ring.since_wakeup >= self._events
        if due:
            ring.since_wakeup = ring.bytes_since_wakeup = 0
            ring._ready.signal()

    def dropped(self, cpu: int) -> int:
        """Samples dropped on ``cpu``'s ring since it last opened (what the kernel counts)."""
        if cpu not in self.cpus:
            raise ValueError(f"no ring for CPU {cpu!r}; rings: {self.cpus}")
        with self._lock:
            ring = self._rings.get(cpu)
            return ring.dropped if ring is not None else self._dropped_at_free.get(cpu, 0)

    def pending_bytes(self, cpu: int) -> int:
        """Bytes written to ``cpu``'s ring and not yet taken by a reader."""
        return self._ring(cpu).pending_bytes()

    def __repr__(self) -> str:
        state = "open" if self._rings else "closed"
        return f"<FakeRingSource {self.name!r} cpus={self.cpus} {self._ring_bytes} B {state}>"
