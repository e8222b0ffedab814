"""The core shared by every driver (asyncio, callbacks, synchronous poll).

It takes spans out of rings, splits them into records in ring order, keeps
them in a bounded queue and counts everything. Drivers decide *when* to drain
(readiness, timers, poll) and how to hand events over; the core never waits.

Samples wait in the queue as raw payloads, a chunk per drained span; event
objects (and decoded values) are built only when a consumer takes them, in
batches. Building hundreds of thousands of objects that then sit in a queue
makes CPython's cyclic GC walk them over and over (measured: 2.4x the cost of
the whole drain); built on demand, they die young.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from typing import Any, Literal

from ._decode import SizedDecoder
from ._errors import BrokenRingError, DecodeError
from ._events import BadSample, CpuStatistics, Lost, Sample, StreamStatistics, _Failure
from ._log import log
from ._ring import RingReader, split_span

DecodeErrorPolicy = Literal["item", "raise", "skip"]
DEFAULT_MAX_PENDING = 65536
# Events built at a time for a consumer. Larger batches keep more young objects
# alive at once and CPython's GC then runs far more often: measured 424 ns/event
# at 4096, 269 at 256 (244 and 248 with the GC off).
DEFAULT_BATCH = 256
Decoder = Callable[[bytes], Any]

# Per-CPU counter slots.
_SAMPLES, _LOST, _BYTES, _WAKEUPS, _DECODE_ERRORS, _OTHER = range(6)
_tuple_new = tuple.__new__
_repeat = itertools.repeat
_NONES = itertools.repeat(None)


class _Chunk:
    """Raw sample payloads of one drained span of one CPU, consumed from ``pos``."""

    __slots__ = ("cpu", "payloads", "pos", "uniform")

    def __init__(self, cpu: int, payloads: list[bytes], uniform: bool) -> None:
        self.cpu = cpu
        self.payloads = payloads
        self.pos = 0
        self.uniform = uniform  # every payload has the same length


class StreamCore:
    """Drains rings into a bounded queue; hands out events in batches."""

    def __init__(
        self,
        readers: dict[int, RingReader],
        *,
        decoder: Decoder | None = None,
        decode_errors: DecodeErrorPolicy = "item",
        max_pending: int = DEFAULT_MAX_PENDING,
        ring_bytes: int = 0,
        memory_bytes: int = 0,
    ) -> None:
        if decode_errors not in ("item", "raise", "skip"):
            raise ValueError(
                f"decode_errors must be 'item', 'raise' or 'skip', not {decode_errors!r}"
            )
        if max_pending < 1:
            raise ValueError(f"max_pending must be at least 1, not {max_pending}")
        self.readers = dict(readers)
        self.decoder = decoder
        self.decode_errors = decode_errors
        self.max_pending = max_pending
        self.resume_below = max(1, max_pending // 2)
        self.ring_bytes = ring_bytes
        self.memory_bytes = memory_bytes
        self.queue: deque[Any] = deque()  # _Chunk, Lost, _Failure, or built events put back
        self.pending = 0  # events in the queue (each sample of a chunk counts)
        self.stalled: set[int] = set()  # CPUs with data left in the ring while we were full
        self.paused = False
        self.closed = False
        self.counters = {cpu: [0, 0, 0, 0, 0, 0] for cpu in readers}
        self.broken: set[int] = set()

    # --- draining -------------------------------------------------------------------

    def count_wakeup(self, cpu: int) -> None:
        counters = self.counters.get(cpu)
        if counters is not None:
            counters[_WAKEUPS] += 1

    def woken(self, cpu: int) -> int:
        """A kernel wakeup for ``cpu``: drain it unless the queue is full. Events added."""
        self.count_wakeup(cpu)
        return self.drain(cpu)

    def _pause(self, cpu: int) -> None:
        self.stalled.add(cpu)
        if not self.paused:
            self.paused = True
            log.debug("perf stream paused", pending=self.pending, max_pending=self.max_pending)

    def drain(self, cpu: int, *, force: bool = False) -> int:
        """Take everything from one ring into the queue. A corrupt ring becomes a queued failure."""
        reader = self.readers.get(cpu)
        if reader is None:
            return 0
        if not force and self.pending >= self.max_pending:
            self._pause(cpu)
            return 0
        self.stalled.discard(cpu)
        try:
            span = reader.take()
            if not span:
                return 0
            segments, other = split_span(cpu, span)
        except BrokenRingError as exc:
            reader.broken = exc
            self.readers.pop(cpu, None)
            self.broken.add(cpu)
            self.push_failure(exc)
            return 1
        counters = self.counters[cpu]
        counters[_BYTES] += len(span)
        counters[_OTHER] += other
        queue = self.queue
        added = 0
        for segment in segments:
            if isinstance(segment, int):
                queue.append(Lost(cpu, segment))
                counters[_LOST] += segment
                added += 1
            else:
                payloads, uniform = segment
                queue.append(_Chunk(cpu, payloads, uniform))
                counters[_SAMPLES] += len(payloads)
                added += len(payloads)
        self.pending += added
        return added

    def detach_rings(self) -> None:
        """Forget the rings (before they are freed); queued events stay available."""
        self.readers = {}
        self.stalled.clear()
        self.paused = False

    def push_failure(self, exc: BaseException) -> None:
        """Queue an exception, in order, for the consumer to raise when it gets there."""
        self.queue.append(_Failure(exc))
        self.pending += 1

    def drain_all(self, *, force: bool = False) -> int:
        """Check every ring: waking up userspace is expensive, make the most of it."""
        added = 0
        for cpu in list(self.readers):
            added += self.drain(cpu, force=force)
        return added

    def drain_filling(self) -> int:
        """Drain the rings that are at least a quarter full, while the queue is below a quarter.

        The cap keeps a consumer that falls behind from working through a whole
        queue of old events (measured: p50 7 ms instead of 21-37 ms, at the same
        or better throughput).
        """
        if self.pending >= self.max_pending >> 2:
            return 0
        threshold = self.ring_bytes >> 2
        added = 0
        for cpu, reader in list(self.readers.items()):
            if reader.pending_bytes() >= threshold:
                added += self.drain(cpu)
        return added

    def maybe_resume(self) -> int:
        """After the consumer took events: resume draining once below the low-water mark."""
        if not self.paused or self.pending >= self.resume_below:
            return 0
        self.paused = False
        log.debug("perf stream resumed", pending=self.pending, stalled=sorted(self.stalled))
        # A ring's readiness fires once per wakeup; the stalled ones will not fire again
        # for the data they already hold, so drain every ring now.
        return self.drain_all()

    # --- handing out -----------------------------------------------------------------

    def take(self, max_items: int) -> list[Any]:
        """Up to ``max_items`` events from the front of the queue, built now.

        Raises a queued failure (a broken ring; a bad sample under
        ``decode_errors="raise"``) when it reaches the front with nothing
        before it in the batch; otherwise stops the batch in front of it.
        """
        queue = self.queue
        out: list[Any] = []
        while queue and len(out) < max_items:
            seg = queue[0]
            cls = seg.__class__
            if cls is _Chunk:
                payloads = seg.payloads
                start = seg.pos
                stop = min(len(payloads), start + max_items - len(out))
                part = payloads if start == 0 and stop == len(payloads) else payloads[start:stop]
                seg.pos = stop
                if stop == len(payloads):
                    queue.popleft()
                self.pending -= stop - start
                # A decode failure under "raise" is queued at the front: the next
                # round raises it, or ends the batch in front of it.
                self._build(seg, part, out)
                continue
            if cls is _Failure:
                if out:
                    break
                queue.popleft()
                self.pending -= 1
                raise seg.error
            queue.popleft()  # Lost, or an event put back by put_back()
            self.pending -= 1
            out.append(seg)
        return out

    def _build(self, chunk: _Chunk, payloads: list[bytes], out: list[Any]) -> None:
        cpu = chunk.cpu
        decoder = self.decoder
        if decoder is None:
            rows = zip(_repeat(cpu), payloads, _NONES, strict=False)
            out.extend(map(_tuple_new, _repeat(Sample), rows))
            return
        if (
            chunk.uniform
            and isinstance(decoder, SizedDecoder)
            and len(payloads[0]) >= decoder.size
        ):
            # Fixed-size records, all long enough: decode the whole run at C speed.
            values = decoder.decode_many(payloads)
            rows = zip(_repeat(cpu), payloads, values, strict=False)
            out.extend(map(_tuple_new, _repeat(Sample), rows))
            return
        for index, data in enumerate(payloads):
            try:
                value = decoder(data)
            except Exception as exc:
                if not self._decode_failed(chunk, payloads, index, exc, out):
                    return  # "raise": the rest went back to the queue behind the error
                continue
            out.append(_tuple_new(Sample, (cpu, data, value)))

    def _decode_failed(
        self, chunk: _Chunk, payloads: list[bytes], index: int, exc: Exception, out: list[Any]
    ) -> bool:
        cpu, data = chunk.cpu, payloads[index]
        self.counters[cpu][_DECODE_ERRORS] += 1
        error = exc if isinstance(exc, DecodeError) else DecodeError(cpu, data, str(exc))
        if error is not exc:
            error.__cause__ = exc
        if self.decode_errors == "skip":
            return True
        if self.decode_errors == "item":
            out.append(BadSample(cpu, data, error))
            return True
        # "raise": what follows the bad sample goes back, behind the error.
        rest = payloads[index + 1 :]
        if rest:
            self.queue.appendleft(_Chunk(cpu, rest, chunk.uniform))
            self.pending += len(rest)
        self.queue.appendleft(_Failure(error))
        self.pending += 1
        return False

    def put_back(self, events: list[Any]) -> None:
        """Return built events to the front of the queue, in order (nothing is dropped)."""
        if events:
            self.queue.extendleft(reversed(events))
            self.pending += len(events)

    # --- statistics -----------------------------------------------------------------

    def statistics(self) -> StreamStatistics:
        cpus = tuple(
            CpuStatistics(
                cpu=cpu,
                samples=c[_SAMPLES],
                lost=c[_LOST],
                bytes=c[_BYTES],
                wakeups=c[_WAKEUPS],
                decode_errors=c[_DECODE_ERRORS],
                other_records=c[_OTHER],
                broken=cpu in self.broken,
            )
            for cpu, c in sorted(self.counters.items())
        )
        return StreamStatistics(
            cpus=cpus,
            pending=self.pending,
            max_pending=self.max_pending,
            paused=self.paused,
            ring_bytes=self.ring_bytes,
            memory_bytes=self.memory_bytes,
            closed=self.closed,
        )

    def log_summary(self, event: str) -> None:
        stats = self.statistics()
        log.info(
            event,
            samples=stats.samples,
            lost=stats.lost,
            lost_by_cpu={c.cpu: c.lost for c in stats.cpus if c.lost},
            decode_errors=stats.decode_errors,
            undelivered=stats.pending,
        )
