"""The one reading policy, sans I/O, shared by every driver.

A ``Reader`` takes spans out of a source's rings, splits them into
records in ring order, keeps them in one bounded queue, counts everything,
keeps the drain clock, and dispatches events to callbacks. Drivers only wait
(readiness handles, a timer at ``deadline``, ``poll``) and call
it; the reader itself never waits and imports no binding.

Samples wait in the queue raw: a run of equal-sized records as it sits in the
copied span (a ``Run``), other samples as payload lists; event objects (and
decoded values) are built only when a consumer takes them, in batches.
Building hundreds of thousands of objects that then sit in a queue makes
CPython's cyclic GC walk them over and over (measured: 2.4x the cost of the
whole drain); built on demand, they die young. Columnar consumers take the
same queue as NumPy arrays (``take_arrays``), viewing runs in place.
"""

from __future__ import annotations

import inspect
import itertools
from collections import deque
from collections.abc import Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from ._decode import NUMPY_HINT, SizedDecoder
from ._errors import BrokenRingError, DecodeError
from ._events import (
    BadSample,
    CpuStatistics,
    Lost,
    Sample,
    SampleArray,
    StreamStatistics,
    _Failure,
)
from ._log import log
from ._options import Wakeup
from ._source import Ring, RingSource, Run, Segment, SourceEnded

if TYPE_CHECKING:
    from ._columnar import Columns

DecodeErrorPolicy = Literal["item", "raise", "skip"]
DECODE_ERROR_POLICIES = ("item", "raise", "skip")
DEFAULT_MAX_PENDING = 65536
# Events built at a time for a consumer. Larger batches keep more young objects
# alive at once and CPython's GC then runs far more often: measured 424 ns/event
# at 4096, 269 at 256 (244 and 248 with the GC off).
DEFAULT_BATCH = 256
# A perf record is at most 64 KiB (its size is a u16): a ring with more free
# space than that cannot have dropped a sample since it was last emptied.
MAX_RECORD = 1 << 16
Decoder = Callable[[bytes], Any]
Clock = Callable[[], float]

# Per-ring counter slots.
_SAMPLES, _LOST, _BYTES, _WAKEUPS, _DECODE_ERRORS, _OTHER = range(6)
_tuple_new = tuple.__new__
_repeat = itertools.repeat
_starmap = itertools.starmap
_NONES = itertools.repeat(None)


class _Chunk:
    """Raw sample payloads of one drained span of one ring, consumed from ``pos``."""

    __slots__ = ("key", "payloads", "pos", "uniform")

    def __init__(self, key: int, payloads: list[bytes], uniform: bool) -> None:
        self.key = key
        self.payloads = payloads
        self.pos = 0
        self.uniform = uniform  # every payload has the same length


class _RunChunk:
    """A run of identical records still in the span they were copied in, consumed from ``pos``."""

    __slots__ = ("key", "pos", "run")

    def __init__(self, key: int, run: Run) -> None:
        self.key = key
        self.run = run
        self.pos = 0


@dataclass(frozen=True)
class Handlers:
    """The callbacks of callback mode, checked when they are given."""

    on_sample: Callable[[Any], Any] | None
    on_lost: Callable[[Any], Any] | None = None
    on_decode_error: Callable[[Any], Any] | None = None
    on_array: Callable[[Any], Any] | None = None  # columnar: SampleArray items

    def __post_init__(self) -> None:
        for name in ("on_sample", "on_lost", "on_decode_error", "on_array"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(f"{name} must be callable, not {type(value).__name__}")
        if (self.on_sample is None) == (self.on_array is None):
            raise ValueError("give on_sample or on_array (columnar), one of them")

    @property
    def columnar(self) -> bool:
        return self.on_array is not None


def load_columns(decoder: Decoder | None) -> Columns:
    """What makes arrays for ``decoder``: ImportError saying what to install without
    NumPy, TypeError if the decoder has no layout (checked when a driver is made)."""
    try:
        from . import _columnar
    except ModuleNotFoundError as exc:
        if exc.name != "numpy":
            raise
        raise ImportError(f"columnar batches need NumPy: {NUMPY_HINT}") from exc
    return _columnar.Columns(decoder)


class Reader:
    """Drains rings into a bounded queue; hands out events in batches; keeps the drain clock.

    ``held`` is the front of the queue: built events handed back (put back
    after a failing callback, or the rest of a batch being iterated). It is
    the only put-back queue; ``take()`` serves it first.
    """

    def __init__(
        self,
        source: RingSource,
        rings: Sequence[Ring],
        *,
        wakeup: Wakeup,
        clock: Clock,
        decoder: Decoder | None = None,
        decode_errors: DecodeErrorPolicy = "item",
        max_pending: int = DEFAULT_MAX_PENDING,
    ) -> None:
        self.source = source
        self.split: Callable[[int, bytes], tuple[list[Segment], int]] = source.records.split
        self.rings: dict[int, Ring] = {ring.key: ring for ring in rings}
        self._handles: dict[int, list[Ring]] = {}
        for ring in rings:
            self._handles.setdefault(ring.handle, []).append(ring)
        for handle in getattr(source, "notices", ()):  # handles of no ring (see SourceEnded)
            self._handles.setdefault(handle, [])
        self.decoder = decoder
        self.decode_errors = decode_errors
        self.max_pending = max_pending
        self.resume_below = max(1, max_pending // 2)
        self.ring_bytes = source.ring_bytes
        self.memory_bytes = source.memory_bytes
        self._full_mark = max(0, self.ring_bytes - MAX_RECORD)
        self.held: deque[Any] = deque()  # built events, served before the queue
        # Columnar consumers' front: built arrays (and the Lost and BadSample between
        # them). At most one of held and held_arrays has anything: each kind of take
        # turns the other's into its own kind first.
        self.held_arrays: deque[Any] = deque()
        self.queue: deque[Any] = deque()  # _Chunk, Lost, _Failure
        self.pending = 0  # events in the queue (each sample of a chunk counts)
        self.stalled: set[int] = set()  # rings with data left while we were full
        self.paused = False
        self.closed = False
        self.counters = {key: [0, 0, 0, 0, 0, 0] for key in self.rings}
        self.broken: set[int] = set()
        self._columns: Columns | None = None
        # Exact losses: the producer's own count at open, and how much of what we
        # reported from it is still ahead of the lost records that will announce it.
        self._lost_base: dict[int, int] = {}
        for ring in rings:
            total = ring.lost_total()
            if total is not None:
                self._lost_base[ring.key] = total
        self._lost_ahead = dict.fromkeys(self._lost_base, 0)
        # The drain clock.
        self.wakeup = wakeup
        self._clock = clock
        self._max_latency = wakeup.max_latency if wakeup.batched else None
        self._last_traffic = clock()
        self._drained_at = dict.fromkeys(self.rings, self._last_traffic)  # key -> last take
        self._ticked_at = self._last_traffic
        self.deadline: float | None = (
            None if self._max_latency is None else self._last_traffic + self._max_latency
        )

    # --- the drain clock ------------------------------------------------------------

    def period(self, now: float) -> float | None:
        """How long the drain timer waits from ``now`` (None: batched wakeups off, no timer).

        ``max_latency`` while samples flow or the queue is full (backpressure is
        not silence); ``idle_latency`` once ``idle_after`` seconds passed
        without traffic.
        """
        max_latency = self._max_latency
        if max_latency is None:
            return None
        wakeup = self.wakeup
        idle = wakeup.idle_latency
        if idle is not None and not self.paused and now - self._last_traffic >= wakeup.idle_after:
            return idle
        return max_latency

    def tick(self) -> int:
        """The drain timer fired: look at every ring not drained since the last tick.
        Events added; sets the next deadline.

        A ring drained at ``t`` (by its wakeup, a take) need not be looked at before
        ``t + period``, so the deadline is the earliest such time over the rings: a
        busy ring that wakes its reader more often than the timer fires is not cut
        into extra small drains by the timer (each drain has a fixed cost, most of
        all to columnar consumers), and no sample waits longer than before.
        """
        now = self._clock()
        since = self._ticked_at
        self._ticked_at = now
        added = 0
        drained_at = self._drained_at
        for key in list(self.rings):
            if drained_at.get(key, since) <= since:
                added += self.drain(key)
                if drained_at.get(key, now) > now:
                    drained_at[key] = now  # this tick's look, not a later one
        if added:
            self._last_traffic = now
        period = self.period(now)
        # A full queue takes nothing: park the timer until the consumer resumes it.
        if period is None or self.paused or self.closed:
            self.deadline = None
        else:
            earliest = min((drained_at.get(key, now) for key in self.rings), default=now)
            # Never in the past: a ring that could not be drained (full queue) must not
            # make the timer spin.
            self.deadline = max(earliest + period, now + period / 4)
        return added

    def _traffic(self) -> None:
        """Samples arrived: after a silence, bring the timer back to max_latency now."""
        if self._max_latency is None:
            return
        now = self._clock()
        self._last_traffic = now
        soon = now + self._max_latency
        if self.deadline is not None and self.deadline > soon:
            self.deadline = soon

    # --- draining -------------------------------------------------------------------

    def handles(self) -> list[int]:
        """Every readiness handle the drivers wait on: the rings', then the source's notices."""
        return list(self._handles)

    def watches(self, handle: int) -> bool:
        """Whether any live ring still has this readiness handle."""
        return handle in self._handles

    def on_ready(self, handle: int) -> int:
        """A handle fired: clear it, then drain its rings unless the queue is full."""
        rings = self._handles.get(handle)
        if rings is None:
            return 0
        try:
            self.source.acknowledge(handle)
        except SourceEnded as end:
            return self.end(end.error, drain=end.drain)
        added = 0
        for ring in rings:
            counters = self.counters.get(ring.key)
            if counters is not None:
                counters[_WAKEUPS] += 1
            added += self.drain(ring.key)
        self._traffic()
        return added

    def _pause(self, key: int) -> None:
        self.stalled.add(key)
        if not self.paused:
            self.paused = True
            log.debug("perf stream paused", pending=self.pending, max_pending=self.max_pending)

    def drain(self, key: int, *, force: bool = False) -> int:
        """Take everything from one ring into the queue. A corrupt ring becomes a queued failure."""
        ring = self.rings.get(key)
        if ring is None:
            return 0
        if not force and self.pending >= self.max_pending:
            self._pause(key)
            return 0
        self.stalled.discard(key)
        failure: BrokenRingError | None = None
        try:
            span = ring.take()
            self._drained_at[key] = self._clock()
            if not span:
                return 0
            segments, other = self.split(key, span)
        except BrokenRingError as exc:
            # The records before the corrupt one are intact: hand them over, then fail.
            self._retire(ring)
            failure, segments, other, span = exc, exc.partial, 0, b""
        counters = self.counters[key]
        counters[_BYTES] += len(span)
        counters[_OTHER] += other
        queue = self.queue
        added = 0
        for segment in segments:
            if segment.__class__ is Run:
                queue.append(_RunChunk(key, segment))
                count = segment.count
            elif isinstance(segment, int):
                added += self._lost_record(key, segment)
                continue
            else:
                payloads, uniform = segment  # type: ignore[misc]
                queue.append(_Chunk(key, payloads, uniform))
                count = len(payloads)
            counters[_SAMPLES] += count
            added += count
        self.pending += added
        if failure is not None:
            self.push_failure(failure)
            return added + 1
        if len(span) > self._full_mark and key in self._lost_base:
            added += self._report_unannounced(key)
        return added

    def _lost_record(self, key: int, count: int) -> int:
        """A lost record: report what an earlier exact count did not report already."""
        ahead = self._lost_ahead.get(key, 0)
        if ahead:
            absorbed = min(ahead, count)
            self._lost_ahead[key] = ahead - absorbed
            count -= absorbed
        if not count:
            return 0
        self.queue.append(Lost(key, count))
        self.counters[key][_LOST] += count
        return 1

    def _report_unannounced(self, key: int) -> int:
        """Queue a Lost notice for drops the producer counted but no lost record announced.

        Such drops come after every record taken so far: a sample written after
        a drop is preceded by its lost record. Only a ring that was full can have
        dropped, so drains call this only when they took nearly a whole ring.
        """
        ring = self.rings.get(key)
        total = ring.lost_total() if ring is not None else None
        if total is None:
            return 0
        counters = self.counters[key]
        missing = total - self._lost_base[key] - counters[_LOST]
        if missing <= 0:
            return 0
        self.queue.append(Lost(key, missing))
        counters[_LOST] += missing
        self._lost_ahead[key] += missing
        self.pending += 1
        return 1

    def _retire(self, ring: Ring) -> None:
        self.rings.pop(ring.key, None)
        self.broken.add(ring.key)
        self.stalled.discard(ring.key)
        siblings = [r for r in self._handles.get(ring.handle, ()) if r is not ring]
        if siblings:
            self._handles[ring.handle] = siblings
        else:
            self._handles.pop(ring.handle, None)

    def push_failure(self, exc: BaseException) -> None:
        """Queue an exception, in order, for the consumer to raise when it gets there."""
        self.queue.append(_Failure(exc))
        self.pending += 1

    def end(self, error: BaseException, *, drain: bool) -> int:
        """The source is over for good: queue what the rings hold (unless ``drain`` is
        False: then they are no longer ours), then ``error``; look at nothing more."""
        if not drain:
            self.rings = {}
        self.close()
        self.push_failure(error)
        return 1

    def drain_all(self, *, force: bool = False) -> int:
        """Check every ring: waking up userspace is expensive, make the most of it."""
        added = 0
        for key in list(self.rings):
            added += self.drain(key, force=force)
        return added

    def flush(self) -> int:
        """Take everything the rings hold now, below any wakeup threshold and past the bound."""
        return self.drain_all(force=True)

    def _drain_filling(self) -> int:
        """Drain the rings that are at least a quarter full, while the queue is below a quarter.

        A consumer with events in hand never yields to its loop, so no readiness
        callback runs meanwhile: this does their work before a ring overflows.
        The cap keeps a consumer that falls behind from working through a whole
        queue of old events (measured: p50 7 ms instead of 21-37 ms, at the same
        or better throughput).
        """
        if self.pending >= self.max_pending >> 2:
            return 0
        threshold = self.ring_bytes >> 2
        added = 0
        for key, ring in list(self.rings.items()):
            if ring.pending_bytes() >= threshold:
                added += self.drain(key)
        return added

    def _maybe_resume(self) -> None:
        """After the consumer took events: resume draining once below the low-water mark."""
        if self.pending >= self.resume_below:
            return
        self.paused = False
        log.debug("perf stream resumed", pending=self.pending, stalled=sorted(self.stalled))
        # A ring's readiness fires once per wakeup; the stalled ones will not fire again
        # for the data they already hold, so drain every ring now.
        self.drain_all()
        if self._max_latency is not None and not self.paused and not self.closed:
            now = self._clock()
            self._last_traffic = now
            self.deadline = now + self._max_latency

    def close(self) -> None:
        """Take what the rings still hold and forget them (they are freed next). Idempotent.

        Queued events stay available to the consumer.
        """
        if self.closed:
            return
        try:
            self.drain_all(force=True)
            for key in list(self.rings):
                if key in self._lost_base:
                    self._report_unannounced(key)
        finally:
            self.closed = True
            self.rings = {}
            self._handles = {}
            self.stalled.clear()
            self.paused = False
            self.deadline = None

    # --- handing out -----------------------------------------------------------------

    def take(self, max_items: int) -> list[Any]:
        """Up to ``max_items`` events from the front of the queue, built now.

        Drains first (so that a consumer never sleeps on events its own look
        found), resuming after backpressure. Raises a queued failure (a broken
        ring; a bad sample under ``decode_errors="raise"``) when it reaches the
        front with nothing before it in the batch; otherwise stops the batch in
        front of it.
        """
        held = self.held
        out: list[Any] = []
        if self.held_arrays:
            self._unbuild_arrays()  # a columnar consumer stopped: its arrays as events
        if held:
            if len(held) >= max_items:
                return [held.popleft() for _ in range(max_items)]
            out = list(held)
            held.clear()
        self._before_taking()
        queue = self.queue
        while queue and len(out) < max_items:
            seg = queue[0]
            cls = seg.__class__
            if cls is _RunChunk:
                run = seg.run
                start = seg.pos
                stop = min(run.count, start + max_items - len(out))
                seg.pos = stop
                if stop == run.count:
                    queue.popleft()
                self.pending -= stop - start
                self._build_run(seg.key, run, start, stop, out)
                continue
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
                self._build(seg.key, part, seg.uniform, out)
                continue
            if not self._take_notice(seg, out):
                break
        return out

    def _before_taking(self) -> None:
        """Resume after backpressure, or drain the rings that are filling."""
        if self.paused:
            self._maybe_resume()
        elif self.rings:
            self._drain_filling()

    def _take_notice(self, seg: Any, out: list[Any]) -> bool:
        """The front of the queue is no sample: a failure (raised; or, with events
        before it in the batch, False: the batch ends in front of it) or a Lost notice."""
        if seg.__class__ is _Failure:
            if out:
                return False
            self.queue.popleft()
            self.pending -= 1
            raise seg.error
        self.queue.popleft()
        self.pending -= 1
        out.append(seg)
        return True

    def _build_run(self, key: int, run: Run, start: int, stop: int, out: list[Any]) -> None:
        """Sample events of records ``start`` to ``stop`` of a run, straight out of its span."""
        payloads = run.payloads(start, stop)
        decoder = self.decoder
        if decoder is None:
            rows = zip(_repeat(key), payloads, _NONES, strict=False)
            out.extend(map(_tuple_new, _repeat(Sample), rows))
            return
        if isinstance(decoder, SizedDecoder) and run.size >= decoder.size:
            # Fixed-size records, all long enough: decode the whole run at C speed, the
            # fields unpacked from the span itself where the format allows.
            fields = decoder.strided(run.skip, run.stride)
            if fields is None:
                values = decoder.decode_many(payloads)
            else:
                at = run.start + start * run.stride
                view = memoryview(run.span)[at : at + (stop - start) * run.stride]
                values = decoder.decode_rows(fields.iter_unpack(view))
            # starmap hands zip's (Sample, row) tuple over as the call's arguments: one
            # tuple less per event than map(tuple.__new__, repeat(Sample), rows).
            rows = zip(_repeat(key), payloads, values, strict=False)
            out.extend(_starmap(_tuple_new, zip(_repeat(Sample), rows, strict=False)))
            return
        self._build(key, payloads, True, out)

    def _build(self, key: int, payloads: list[bytes], uniform: bool, out: list[Any]) -> None:
        decoder = self.decoder
        if decoder is None:
            rows = zip(_repeat(key), payloads, _NONES, strict=False)
            out.extend(map(_tuple_new, _repeat(Sample), rows))
            return
        if uniform and isinstance(decoder, SizedDecoder) and len(payloads[0]) >= decoder.size:
            # Fixed-size records, all long enough: decode the whole run at C speed.
            values = decoder.decode_many(payloads)
            rows = zip(_repeat(key), payloads, values, strict=False)
            out.extend(map(_tuple_new, _repeat(Sample), rows))
            return
        for index, data in enumerate(payloads):
            try:
                value = decoder(data)
            except Exception as exc:
                if not self._decode_failed(key, payloads, uniform, index, exc, out):
                    return  # "raise": the rest went back to the queue behind the error
                continue
            out.append(_tuple_new(Sample, (key, data, value)))

    def _decode_failed(
        self, key: int, payloads: list[bytes], uniform: bool, index: int, exc: Exception,
        out: list[Any],
    ) -> bool:
        data = payloads[index]
        self.counters[key][_DECODE_ERRORS] += 1
        error = exc if isinstance(exc, DecodeError) else DecodeError(key, data, str(exc))
        if error is not exc:
            error.__cause__ = exc
        if self.decode_errors == "skip":
            return True
        if self.decode_errors == "item":
            out.append(BadSample(key, data, error))
            return True
        # "raise": what follows the bad sample goes back, behind the error.
        rest = payloads[index + 1 :]
        if rest:
            self.queue.appendleft(_Chunk(key, rest, uniform))
            self.pending += len(rest)
        self.queue.appendleft(_Failure(error))
        self.pending += 1
        return False

    def _unbuild_arrays(self) -> None:
        """Turn the columnar front into Sample events, at the front of ``held``."""
        events: list[Any] = []
        for event in self.held_arrays:
            if event.__class__ is not SampleArray:
                events.append(event)
            elif isinstance(event._source, Run):
                self._build_run(event.cpu, event._source, 0, event._source.count, events)
            else:
                self._build(event.cpu, event._source, False, events)
        self.held_arrays.clear()
        self.held.extendleft(reversed(events))

    # --- columnar batches ------------------------------------------------------------

    def columns(self) -> Columns:
        """Switch on columnar batches (NumPy, imported now) for this reader's decoder.

        ImportError saying what to install without NumPy; TypeError without a
        decoder that has a layout.
        """
        if self._columns is None:
            self._columns = load_columns(self.decoder)
            # From now on runs are found with NumPy too.
            self.split = self._columns.split_for(self.source.records)
        return self._columns

    def take_arrays(self, max_rows: int | None = None) -> list[Any]:
        """Everything queued, as :class:`SampleArray` items (one per run of one CPU's
        samples, at most ``max_rows`` rows each), ``Lost`` and ``BadSample`` in place.

        The same drains, backpressure and failure rules as :meth:`take`.
        """
        columns = self.columns()
        held = self.held
        out = list(self.held_arrays)
        self.held_arrays.clear()
        if held:
            samples: list[Any] = []
            for event in held:
                if event.__class__ is Sample:
                    samples.append(event)
                    continue
                if samples:
                    out.extend(columns.from_samples(samples))
                    samples = []
                out.append(event)
            if samples:
                out.extend(columns.from_samples(samples))
            held.clear()
        self._before_taking()
        queue = self.queue
        while queue:
            seg = queue[0]
            cls = seg.__class__
            if cls is _RunChunk:
                queue.popleft()
                run = seg.run
                self.pending -= run.count - seg.pos
                self._arrays_of_run(seg.key, run, seg.pos, max_rows, out)
                continue
            if cls is _Chunk:
                queue.popleft()
                payloads = seg.payloads[seg.pos :] if seg.pos else seg.payloads
                self.pending -= len(payloads)
                self._arrays_of_payloads(seg.key, payloads, seg.uniform, max_rows, out)
                continue
            if not self._take_notice(seg, out):
                break
        return out

    def _arrays_of_run(
        self, key: int, run: Run, first: int, max_rows: int | None, out: list[Any]
    ) -> None:
        columns = self._columns
        assert columns is not None
        if run.size < columns.size:  # all of them too short for the decoder
            self._bad_rows(key, run.payloads(first), True, range(run.count - first), out)
            return
        step = max_rows or run.count
        for at in range(first, run.count, step):
            out.append(columns.from_run(key, run, at, min(run.count, at + step)))

    def _arrays_of_payloads(
        self, key: int, payloads: list[bytes], uniform: bool, max_rows: int | None,
        out: list[Any],
    ) -> None:
        columns = self._columns
        assert columns is not None
        start = 0
        for index in [*columns.too_short(payloads), len(payloads)]:
            step = max_rows or max(1, index - start)
            for at in range(start, index, step):
                out.append(columns.from_payloads(key, payloads[at : min(index, at + step)]))
            if index == len(payloads):
                return
            if not self._bad_rows(key, payloads, uniform, (index,), out):
                return
            start = index + 1

    def _bad_rows(
        self, key: int, payloads: list[bytes], uniform: bool, indexes: Sequence[int] | range,
        out: list[Any],
    ) -> bool:
        """Samples too short for the decoder, under the decode_errors policy (False: raised)."""
        decoder = self.decoder
        assert decoder is not None
        for index in indexes:
            try:
                decoder(payloads[index])
            except Exception as exc:
                if not self._decode_failed(key, payloads, uniform, index, exc, out):
                    return False
        return True

    def put_back(self, events: list[Any]) -> None:
        """Return built events to the front, in order (nothing is dropped)."""
        if any(e.__class__ is SampleArray for e in events):
            self.held_arrays.extendleft(reversed(events))
        elif events:
            self.held.extendleft(reversed(events))

    def dispatch(
        self, batch: list[Any], handlers: Handlers
    ) -> Generator[Awaitable[Any], None, None]:
        """Hand each event to its callback; yield what a callback returned to be awaited.

        A driver awaits (or refuses) each yielded awaitable and throws its
        exception back in here. Whatever the failure, the events after the
        failing one are put back, in order, for the next round.
        """
        on_sample = handlers.on_sample
        on_lost = handlers.on_lost
        on_bad = handlers.on_decode_error
        on_array = handlers.on_array
        isawaitable = inspect.isawaitable
        index = 0
        try:
            for index, event in enumerate(batch):  # noqa: B007 - index is used on error
                cls = event.__class__
                if cls is Sample:
                    result = on_sample(event)  # type: ignore[misc]
                elif cls is Lost:
                    if on_lost is None:
                        continue
                    result = on_lost(event)
                elif cls is SampleArray:
                    result = on_array(event)  # type: ignore[misc]
                elif on_bad is not None:
                    result = on_bad(event)
                else:
                    raise event.error
                # The callback is called inline and awaited only when it returned an
                # awaitable: a coroutine layer per event cost ~290 ns (measured);
                # `is not None` first, because isawaitable(None) costs ~150 ns.
                if result is not None and isawaitable(result):
                    yield result
        except BaseException:
            self.put_back(batch[index + 1 :])
            raise

    # --- statistics -----------------------------------------------------------------

    @property
    def lost_counter(self) -> Literal["exact", "records", "none"]:
        """Where loss counts come from: the producer's exact count, lost records, or nowhere
        (a BPF ring buffer without the BPF side's count: the kernel keeps none)."""
        if self._lost_base:
            return "exact"
        return "records" if getattr(self.source.records, "lost_records", True) else "none"

    def _kernel_lost(self, key: int, reported: int) -> int:
        """What the producer counts as lost on this ring, if more than the stream reported yet."""
        ring = self.rings.get(key)
        total = ring.lost_total() if ring is not None and key in self._lost_base else None
        return reported if total is None else max(reported, total - self._lost_base[key])

    def statistics(self) -> StreamStatistics:
        cpus = tuple(
            CpuStatistics(
                cpu=key,
                samples=c[_SAMPLES],
                lost=self._kernel_lost(key, c[_LOST]),
                bytes=c[_BYTES],
                wakeups=c[_WAKEUPS],
                decode_errors=c[_DECODE_ERRORS],
                other_records=c[_OTHER],
                broken=key in self.broken,
            )
            for key, c in sorted(self.counters.items())
        )
        return StreamStatistics(
            cpus=cpus,
            pending=self.pending + len(self.held) + sum(
                len(e) if e.__class__ is SampleArray else 1 for e in self.held_arrays
            ),
            max_pending=self.max_pending,
            paused=self.paused,
            ring_bytes=self.ring_bytes,
            memory_bytes=self.memory_bytes,
            closed=self.closed,
            drain_period=None if self.closed else self.period(self._clock()),
            lost_counter=self.lost_counter,
        )

    def log_summary(self, event: str) -> None:
        stats = self.statistics()
        log.info(
            event,
            source=self.source.name,
            samples=stats.samples,
            lost=stats.lost,
            lost_by_cpu={c.cpu: c.lost for c in stats.cpus if c.lost},
            lost_counter=stats.lost_counter,
            decode_errors=stats.decode_errors,
            undelivered=stats.pending,
        )
