"""The one reading policy, sans I/O, shared by every driver.

A ``Reader`` takes spans out of a source's rings, splits them into
records in ring order, keeps them in one bounded queue, counts everything,
and dispatches events to callbacks. Drivers only wait (readiness handles, a
timer at ``deadline``, ``poll``) and call it; the reader itself never waits
and imports no binding. Its parts have rooms of their own: the drain clock
(``_clock.py``), the loss ledger (``_losses.py``), the event builder
(``_build.py``), the callbacks (``_callbacks.py``) and the columnar arrays
(``_columnar.py``).

Samples wait in the queue raw: a run of equal-sized records as it sits in the
copied span (a ``Run``), other samples as payload lists; event objects (and
decoded values) are built only when a consumer takes them, in batches.
Building hundreds of thousands of objects that then sit in a queue makes
CPython's cyclic GC walk them over and over (measured: 2.4x the cost of the
whole drain); built on demand, they die young. One walk over the queue
(``pop``) hands out raw pieces to both kinds of take: events (``take``) and
NumPy arrays (``take_arrays``, viewing runs in place).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable, Generator, Sequence
from typing import TYPE_CHECKING, Any, Union

from ._build import Decoder, EventBuilder, Payloads, RunPiece
from ._callbacks import Handlers, dispatch
from ._clock import Clock, DrainClock
from ._decode import NUMPY_HINT
from ._errors import BrokenRingError, DecodeError
from ._events import (
    CpuStatistics,
    Event,
    Lost,
    SampleArray,
    StreamStatistics,
    _Failure,
)
from ._log import log
from ._losses import LossLedger, LostCounter
from ._options import DEFAULT_MAX_PENDING, DecodeErrorPolicy, Wakeup
from ._source import Ring, RingSource, Run, Segment, SourceEnded

if TYPE_CHECKING:
    from ._columnar import ArrayItem, Columns

# Events built at a time for a consumer. Larger batches keep more young objects
# alive at once and CPython's GC then runs far more often: measured 424 ns/event
# at 4096, 269 at 256 (244 and 248 with the GC off).
DEFAULT_BATCH = 256
# A perf record is at most 64 KiB (its size is a u16): a ring with more free
# space than that cannot have dropped a sample since it was last emptied.
MAX_RECORD = 1 << 16

# Per-ring counter slots.
_SAMPLES, _BYTES, _WAKEUPS, _OTHER = range(4)


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


Queued = Union[_Chunk, _RunChunk, Lost, _Failure]  # noqa: UP007 - as Event
"""What waits in a reader's queue, in ring order."""
Piece = Union[RunPiece, Payloads, Lost]  # noqa: UP007
"""What ``Reader.pop`` hands out: samples not built yet, or a lost notice."""


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
    """Drains rings into a bounded queue; hands out events in batches.

    ``held`` is the front of the queue: built events handed back (put back
    after a failing callback, or the rest of a batch being iterated). It is
    the only put-back queue; ``take()`` serves it first. ``held_arrays`` is a
    columnar consumer's front; at most one of the two has anything: each kind
    of take turns the other's into its own kind first.
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
        self.builder = EventBuilder(decoder, decode_errors, self._requeue)
        self.max_pending = max_pending
        self.resume_below = max(1, max_pending // 2)
        self.ring_bytes = source.ring_bytes
        self.memory_bytes = source.memory_bytes
        self._full_mark = max(0, self.ring_bytes - MAX_RECORD)
        self.held: deque[Event[Any]] = deque()  # built events, served before the queue
        self.next_event = self.held.popleft  # IndexError when the front is empty
        self.held_arrays: deque[ArrayItem] = deque()
        self.next_array = self.held_arrays.popleft
        self.queue: deque[Queued] = deque()
        self.pending = 0  # events in the queue (each sample of a chunk counts)
        self.stalled: set[int] = set()  # rings with data left while we were full
        self.paused = False
        self.closed = False
        self.counters = {key: [0, 0, 0, 0] for key in self.rings}
        self.high_water: dict[int, int] = {}  # per ring: the largest span one drain took
        self.broken: set[int] = set()
        self._watch: list[int] = []  # handles of rings added at run time, for the drivers
        self._forget: list[int] = []  # and of rings retired (their CPU went offline)
        self._columns: Columns | None = None
        self.losses = LossLedger(rings)
        self.wakeup = wakeup
        self.clock = DrainClock(wakeup, clock, self.rings)

    # --- what drivers ask -----------------------------------------------------------

    @property
    def decoder(self) -> Decoder | None:
        return self.builder.decoder

    @property
    def deadline(self) -> float | None:
        """Loop time at which ``tick()`` is due (None: no timer)."""
        return self.clock.deadline

    @deadline.setter
    def deadline(self, at: float | None) -> None:
        self.clock.deadline = at

    def keys(self) -> list[int]:
        """The ring keys (CPU ids) the reader was opened on, broken ones included."""
        return sorted(self.counters)

    def handle_of(self, key: int) -> int | None:
        """The readiness handle of ring ``key`` (None: no such live ring)."""
        ring = self.rings.get(key)
        return None if ring is None else ring.handle

    def has_events(self) -> bool:
        """Whether anything waits to be taken (queued, or built in a front queue)."""
        return bool(self.pending or self.held or self.held_arrays)

    # --- the drain clock ------------------------------------------------------------

    def period(self, now: float) -> float | None:
        """How long the drain timer waits from ``now`` (None: batched wakeups off, no timer)."""
        return self.clock.period(now, paused=self.paused)

    def tick(self) -> int:
        """The drain timer fired: look at every ring not drained since the last tick.
        Events added; sets the next deadline (see ``DrainClock.end_tick``)."""
        clock = self.clock
        now, since = clock.start_tick()
        added = 0
        for key in list(self.rings):
            if clock.due(key, since):
                added += self.drain(key)
                clock.looked(key, now)
        clock.end_tick(now, bool(added), self.rings, parked=self.paused or self.closed)
        return added

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
        changed = None if rings else getattr(self.source, "cpus_changed", None)
        if changed is not None:
            added += self._cpus_changed(*changed())
        for ring in rings:
            counters = self.counters.get(ring.key)
            if counters is not None:
                counters[_WAKEUPS] += 1
            added += self.drain(ring.key)
        self.clock.traffic()
        return added

    def _cpus_changed(self, gone: list[int], new: Sequence[Ring]) -> int:
        """CPU hotplug: drain the rings of CPUs gone offline (what the kernel wrote to them
        is delivered, what it dropped counted), retire them, then take the new rings.
        The drivers pick up the handles to watch and to forget (``handle_changes``)."""
        added = 0
        for key in gone:
            ring = self.rings.get(key)
            if ring is None:
                continue
            added += self.drain(key, force=True) + self._report_unannounced(ring)
            self._retire(ring, broken=False)
            self._forget.append(ring.handle)
        for ring in new:
            self.rings[ring.key] = ring
            self._handles.setdefault(ring.handle, []).append(ring)
            self.counters.setdefault(ring.key, [0, 0, 0, 0])
            self.losses.reopened(ring)
            self._watch.append(ring.handle)
        return added

    def swap_ring(self, ring: Ring) -> None:
        """Put ``ring`` in place of the live ring with its key and handle (a lease reads
        it in place: ``_lease.LeaseRing``)."""
        old = self.rings.get(ring.key)
        if old is None:
            return
        self.rings[ring.key] = ring
        self._handles[ring.handle] = [
            ring if r is old else r for r in self._handles.get(ring.handle, [])
        ]

    def handle_changes(self) -> tuple[list[int], list[int]]:
        """Handles to watch (new rings) and to forget (retired rings) since the last call."""
        watch, forget = self._watch, self._forget
        self._watch, self._forget = [], []
        return watch, [handle for handle in forget if handle not in self._handles]

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
        losses = self.losses
        if not force and self.pending >= self.max_pending:
            losses.held_back(ring)
            self._pause(key)
            return 0
        self.stalled.discard(key)
        failure: BrokenRingError | None = None
        try:
            span = ring.take()
            self.clock.drained(key)
            # Caught up at an earlier drain without an exact count: a lost record at
            # the front of this span announces the drops made while it was held back.
            after = bool(losses.after) and key in losses.after
            if losses.marks:
                losses.caught_up(ring)
            if not span:
                return 0
            if len(span) > self.high_water.get(key, 0):
                self.high_water[key] = len(span)
            segments, other = self.split(key, span)
            if after and segments:
                losses.first_record(key, segments[0])
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
        if len(span) > self._full_mark and self.losses.exact(key):
            added += self._report_unannounced(ring)
        return added

    def _lost_record(self, key: int, count: int) -> int:
        """A lost record: report what an earlier exact count did not report already."""
        count = self.losses.announced(key, count)
        if not count:
            return 0
        self.queue.append(Lost(key, count))
        return 1

    def _report_unannounced(self, ring: Ring) -> int:
        """Queue a Lost notice for drops the producer counted but no lost record announced.

        Only a ring that was full can have dropped, so drains call this only when
        they took nearly a whole ring.
        """
        missing = self.losses.unannounced(ring)
        if not missing:
            return 0
        self.queue.append(Lost(ring.key, missing))
        self.pending += 1
        return 1

    def _retire(self, ring: Ring, *, broken: bool = True) -> None:
        self.rings.pop(ring.key, None)
        if broken:
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

    def _requeue(self, error: DecodeError, rest: Payloads) -> None:
        """decode_errors="raise": the error at the front, the samples after it behind it."""
        if rest.payloads:
            self.queue.appendleft(_Chunk(*rest))
            self.pending += len(rest.payloads)
        self.queue.appendleft(_Failure(error))
        self.pending += 1

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
        if not self.paused and not self.closed:
            self.clock.resumed()

    def close(self) -> None:
        """Take what the rings still hold and forget them (they are freed next). Idempotent.

        Queued events stay available to the consumer.
        """
        if self.closed:
            return
        try:
            self.drain_all(force=True)
            for ring in list(self.rings.values()):
                self._report_unannounced(ring)
        finally:
            self.closed = True
            self.rings = {}
            self._handles = {}
            self.stalled.clear()
            self.paused = False
            self.clock.stop()

    # --- handing out -----------------------------------------------------------------

    def pop(self, max_items: int | None, started: bool) -> Piece | None:
        """The next piece of the queue: at most ``max_items`` samples (None: no limit) of
        its front chunk, or a lost notice; None when the queue is empty.

        A queued failure (a broken ring; a bad sample under ``decode_errors="raise"``)
        is raised when nothing was ``started`` in this batch; otherwise it stays at
        the front and the batch ends in front of it (None).
        """
        queue = self.queue
        if not queue:
            return None
        seg = queue[0]
        cls = seg.__class__
        if cls is _RunChunk:
            run = seg.run  # type: ignore[union-attr]
            start = seg.pos  # type: ignore[union-attr]
            stop = run.count if max_items is None else min(run.count, start + max_items)
            seg.pos = stop  # type: ignore[union-attr]
            if stop == run.count:
                queue.popleft()
            self.pending -= stop - start
            return RunPiece(seg.key, run, start, stop)  # type: ignore[union-attr]
        if cls is _Chunk:
            payloads = seg.payloads  # type: ignore[union-attr]
            start = seg.pos  # type: ignore[union-attr]
            size = len(payloads)
            stop = size if max_items is None else min(size, start + max_items)
            part = payloads if start == 0 and stop == size else payloads[start:stop]
            seg.pos = stop  # type: ignore[union-attr]
            if stop == size:
                queue.popleft()
            self.pending -= stop - start
            return Payloads(seg.key, part, seg.uniform)  # type: ignore[union-attr]
        if cls is _Failure:
            if started:
                return None
            queue.popleft()
            self.pending -= 1
            raise seg.error  # type: ignore[union-attr]
        queue.popleft()
        self.pending -= 1
        return seg  # type: ignore[return-value]  # a Lost notice

    def take(self, max_items: int) -> list[Event[Any]]:
        """Up to ``max_items`` events from the front of the queue, built now.

        Drains first (so that a consumer never sleeps on events its own look
        found), resuming after backpressure. Raises a queued failure when it
        reaches the front with nothing before it in the batch (see ``pop``).
        """
        held = self.held
        out: list[Any] = []
        if self.held_arrays:
            # A columnar consumer stopped: its arrays as events, in front.
            columns = self._columns
            assert columns is not None
            events = columns.events(self.held_arrays, self.builder)
            self.held_arrays.clear()
            held.extendleft(reversed(events))
        if held:
            if len(held) >= max_items:
                return [held.popleft() for _ in range(max_items)]
            out = list(held)
            held.clear()
        self._before_taking()
        pop = self.pop
        builder = self.builder
        while len(out) < max_items:
            piece = pop(max_items - len(out), bool(out))
            if piece is None:
                break
            if isinstance(piece, RunPiece):
                builder.run(piece.key, piece.run, piece.start, piece.stop, out)
            elif isinstance(piece, Payloads):
                # A decode failure under "raise" is queued at the front: the next
                # piece raises it, or ends the batch in front of it.
                builder.payloads(piece.key, piece.payloads, piece.uniform, out)
            else:
                out.append(piece)
        return out

    def fill(self, max_items: int) -> bool:
        """Take a batch into the front queue if it is empty (then ``next_event()`` serves
        it); whether the front has events."""
        held = self.held
        if not held:
            # In front: taking may have left events behind it (a columnar
            # consumer's arrays, turned back into events).
            held.extendleft(reversed(self.take(max_items)))
        return bool(held)

    def _before_taking(self) -> None:
        """Resume after backpressure, or drain the rings that are filling."""
        if self.paused:
            self._maybe_resume()
        elif self.rings:
            self._drain_filling()

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

    def take_arrays(self, max_rows: int | None = None) -> list[ArrayItem]:
        """Everything queued, as :class:`SampleArray` items (one per run of one CPU's
        samples, at most ``max_rows`` rows each), ``Lost`` and ``BadSample`` in place.

        The same walk over the queue, drains, backpressure and failure rules as
        :meth:`take`.
        """
        columns = self.columns()
        out = list(self.held_arrays)
        self.held_arrays.clear()
        if self.held:
            out.extend(columns.front(self.held))  # a per-item consumer stopped
            self.held.clear()
        self._before_taking()
        pop = self.pop
        builder = self.builder
        while True:
            piece = pop(None, bool(out))
            if piece is None:
                return out
            if isinstance(piece, Lost):
                out.append(piece)
            else:
                columns.arrays(piece, builder, max_rows, out)

    def fill_arrays(self, max_rows: int | None) -> bool:
        """``fill`` for a columnar consumer (``next_array()`` serves the front)."""
        held = self.held_arrays
        if not held:
            held.extend(self.take_arrays(max_rows))
        return bool(held)

    def put_back(self, events: list[Any]) -> None:
        """Return built events to the front, in order (nothing is dropped)."""
        if any(e.__class__ is SampleArray for e in events):
            self.held_arrays.extendleft(reversed(events))
        elif events:
            self.held.extendleft(reversed(events))

    def dispatch(
        self, batch: list[Any], handlers: Handlers
    ) -> Generator[Awaitable[Any], None, None]:
        """Hand each event to its callback (``_callbacks.dispatch``); what follows a
        failure is put back, in order."""
        return dispatch(batch, handlers, self.put_back)

    # --- statistics -----------------------------------------------------------------

    @property
    def lost_counter(self) -> LostCounter:
        """Where loss counts come from (``LossLedger.counter``)."""
        return self.losses.counter(self.source.records)

    def statistics(self) -> StreamStatistics:
        cpus = tuple(self._cpu_statistics(key, c) for key, c in sorted(self.counters.items()))
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
            drain_period=None if self.closed else self.period(self.clock.now()),
            lost_counter=self.lost_counter,
        )

    def _cpu_statistics(self, key: int, c: list[int]) -> CpuStatistics:
        losses, ring = self.losses, self.rings.get(key)
        lost = losses.lost(key, ring)
        queue_lost, _ = losses.split(key, lost)
        size = self.ring_bytes
        return CpuStatistics(
            cpu=key,
            samples=c[_SAMPLES],
            lost=lost,
            bytes=c[_BYTES],
            wakeups=c[_WAKEUPS],
            decode_errors=self.builder.errors.get(key, 0),
            other_records=c[_OTHER],
            broken=key in self.broken,
            backlog_bytes=0 if ring is None else ring.pending_bytes(),
            high_water=self.high_water.get(key, 0) / size if size else 0.0,
            queue_lost=queue_lost,
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
