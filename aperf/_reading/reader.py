"""The one reading policy, sans I/O, shared by every driver.

A ``Reader`` takes spans out of a source's rings, splits them into
records in ring order, keeps them in one bounded queue, counts everything,
and dispatches events to callbacks. Drivers only wait (readiness handles, a
timer at ``deadline``, ``poll``) and call it; the reader itself never waits
and imports no binding. Its parts have rooms of their own: the ring set
(``rings.py``), the drain clock (``clock.py``), the loss ledger (``losses.py``), the
statistics (``stats.py``), the event builder (``build.py``), the callbacks
(``callbacks.py``) and the columnar arrays (``columnar.py``); and so do the features a
stream may not use, which cost nothing when it does not: gathered wakeups
(``gather.py``), ordering (``ordering.py``, an ordered take instead of the plain build)
and several maps (``multi.py``). The reader knows no particular source: it asks the
seam's protocols what a source can do.

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
from typing import TYPE_CHECKING, Any, Union, cast

from .._decoding.decode import NUMPY_HINT
from .._errors import BrokenRingError, DecodeError
from .._events import Event, Lost, SampleArray, StreamStatistics, _Failure
from .._log import log
from .._options import DEFAULT_MAX_PENDING, DecodeErrorPolicy, Wakeup
from .._rings.seam import Ring, RingSource, Run, SeveralMapsSource, SourceEnded, Split
from . import multi
from .build import Decoder, EventBuilder, Payloads, RunPiece
from .callbacks import Handlers, dispatch
from .clock import Clock, DrainClock
from .gather import Gathering
from .losses import LossLedger, LostCounter
from .order import DEFAULT_LATENESS, OrderKey
from .ordering import Ordering, rows
from .rings import RingSet
from .stats import RingStats, log_summary

if TYPE_CHECKING:
    from .columnar import ArrayItem, Columns

# Events built at a time for a consumer. Larger batches keep more young objects
# alive at once and CPython's GC then runs far more often: measured 424 ns/event
# at 4096, 269 at 256 (244 and 248 with the GC off).
DEFAULT_BATCH = 256


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


def load_columns(decoder: Decoder | None, *, map: str | None = None, offset: int = 0) -> Columns:
    """What makes arrays for ``decoder``: ImportError saying what to install without
    NumPy, TypeError if the decoder has no layout (checked when a driver is made).
    ``map`` and ``offset``: for one map of several (``multi.py``)."""
    try:
        from . import columnar as _columnar
    except ModuleNotFoundError as exc:
        if exc.name != "numpy":
            raise
        raise ImportError(f"columnar batches need NumPy: {NUMPY_HINT}") from exc
    return _columnar.Columns(decoder, map=map, offset=offset)


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
        order_by: OrderKey | None = None,
        order_field: str | None = None,
        lateness: float = DEFAULT_LATENESS,
    ) -> None:
        self.source = source
        self.split: Split = source.records.split
        self.rings = RingSet(source, rings)
        # Several maps: a builder per map, by ring key (``multi.py``).
        self.builder = EventBuilder(decoder, decode_errors, self._requeue) if not isinstance(
            source, SeveralMapsSource) else cast(EventBuilder, multi.event_builder(
                source, decode_errors, self._requeue))  # it has an EventBuilder's calls
        self.max_pending = max_pending
        self.resume_below = max(1, max_pending // 2)
        self.held: deque[Event[Any]] = deque()  # built events, served before the queue
        self.next_event = self.held.popleft  # IndexError when the front is empty
        self.held_arrays: deque[ArrayItem] = deque()
        self.next_array = self.held_arrays.popleft
        self.queue: deque[Queued] = deque()
        self.pending = 0  # events in the queue (each sample of a chunk counts)
        # Rings a drain refused while the queue was full, the longest-refused first: each
        # pass drains them before the others (_in_turn), so that every ring gets its turn.
        self.stalled: dict[int, None] = {}
        self.paused = False
        self.closed = False
        self.finished = False  # the source came to its end (SourceEnded(None))
        self.stats = RingStats(self.rings)
        self.columnar: Columns | None = None  # once a consumer took arrays (columns())
        self.losses = LossLedger(rings)
        self.wakeup = wakeup
        self.clock = DrainClock(wakeup, clock, self.rings)
        # The features a stream may not use: None when it does not (they cost nothing).
        period = wakeup.max_latency if wakeup.batched else None
        self.order = None if order_by is None else Ordering(
            self, order_by, order_field, lateness, period)
        self.gather = Gathering.of(source, wakeup, self.rings.ring_bytes, self.clock)
        # What a drain tells them after it took a span (None: nobody listens).
        self._took = _after_take(self.gather, self.order)

    # --- what drivers ask -----------------------------------------------------------

    @property
    def decoder(self) -> Decoder | None:
        return self.builder.decoder

    @property
    def ring_bytes(self) -> int:
        return self.rings.ring_bytes

    @property
    def memory_bytes(self) -> int:
        return self.rings.memory_bytes

    @property
    def deadline(self) -> float | None:
        """Loop time at which ``tick()`` is due (None: no timer)."""
        order = self.order
        return self.clock.deadline if order is None else order.deadline(self.clock.deadline)

    @deadline.setter
    def deadline(self, at: float | None) -> None:
        self.clock.deadline = at

    def keys(self) -> list[int]:
        """The ring keys (CPU ids) the reader was opened on, broken ones included."""
        return self.stats.keys()

    def cpus(self) -> list[int]:
        """The real CPUs of the rings (a ring key is composite in a stream of several maps)."""
        return sorted({self.builder.cpu_of(key) for key in self.stats.counters})

    def keys_of(self, cpu: int) -> list[int]:
        """The keys of the rings on ``cpu`` (one per map)."""
        return [key for key in self.keys() if self.builder.cpu_of(key) == cpu]

    def handles(self) -> list[int]:
        """Every readiness handle the drivers wait on: the rings', then the source's notices."""
        return self.rings.handles()

    def watches(self, handle: int) -> bool:
        """Whether any live ring still has this readiness handle."""
        return self.rings.watches(handle)

    def handle_of(self, key: int) -> int | None:
        """The readiness handle of ring ``key`` (None: no such live ring)."""
        return self.rings.handle_of(key)

    def handle_changes(self) -> tuple[list[int], list[int]]:
        """Handles to watch (new rings) and to forget (retired rings) since the last call."""
        return self.rings.changes()

    def queued(self) -> int:
        """Events taken out of the rings and not handed out yet (an array counts as its
        rows), held for ordering included."""
        return self.pending + len(self.held) + rows(self.held_arrays)

    def has_events(self) -> bool:
        """Whether anything waits to be taken (queued, or built in a front queue); of
        events held for ordering, only those that can go now."""
        if self.held or self.held_arrays:
            return True
        order = self.order
        return self.pending > 0 if order is None else order.has_events()

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
        # A full queue holds every ring back (the drain refuses and pauses), also one
        # drained since the last tick: else a tick that looked at no ring would take the
        # silence for idleness, and the timer would come back only in idle_latency.
        full = self.pending >= self.max_pending
        for key in self._in_turn():
            if full or clock.due(key, since):
                added += self.drain(key)
                clock.looked(key, now)
        clock.end_tick(now, bool(added), self.rings, parked=self.paused or self.closed)
        if self.order is not None:
            added += self.order.tick(now)
        return added

    # --- draining -------------------------------------------------------------------

    def on_ready(self, handle: int) -> int:
        """A handle fired: clear it, then drain its rings unless the queue is full."""
        rings = self.rings.of_handle(handle)
        if rings is None:
            return 0
        try:
            self.source.acknowledge(handle)
        except SourceEnded as end:
            return self.end(end.error, drain=end.drain)
        added = 0
        if not rings and self.rings.cpus_changed is not None:  # a notice: maybe hotplug
            added += self._cpus_changed(*self.rings.cpus_changed())
        gather = self.gather
        for ring in rings:
            self.stats.woke(ring.key)
            if gather is not None and gather.leaves(ring):
                continue
            added += self.drain(ring.key)
        self.clock.traffic()
        return added

    def look(self, handle: int) -> int:
        """A driver's loop armed ``handle``: drain its rings (events added). Arming a perf
        fd polls it, and that poll takes a wakeup that came before it without the loop
        reporting it: whatever was written before the arm is taken here, anything
        after it wakes the armed handle. Not a wakeup: nothing is counted, but what it
        finds is traffic for the drain clock, as a tick's finds are."""
        added = 0
        for ring in list(self.rings.of_handle(handle) or ()):
            added += self.drain(ring.key)
        if added:
            self.clock.traffic()
        return added

    def drain_gathered(self) -> int:
        """Drain the rings whose wakeup waits for the drain timer (a sync poll's timeout)."""
        gather = self.gather
        if gather is None:
            return 0
        added = 0
        for key in list(gather.gathering):
            if key not in self.rings:
                gather.gathering.discard(key)  # retired since
            added += self.drain(key)
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
        for ring in new:
            self.rings.add(ring)
            self.stats.add(ring.key)
            self.losses.reopened(ring)
        return added

    def _pause(self, key: int) -> None:
        self.stalled.setdefault(key)  # keeps its place if it was refused before
        if not self.paused:
            self.paused = True
            # From now on the full queue holds back every ring, not only this one: drops
            # on a ring no wakeup or tick has reached yet are the queue's as much.
            for ring in self.rings.values():
                self.losses.held_back(ring)
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
            if self.order is not None:
                self.order.looked(key, False)  # unseen: it may hold earlier events
            return 0
        if self.stalled:
            self.stalled.pop(key, None)
        failure: BrokenRingError | None = None
        full_mark = self.rings.full_mark(key)
        samples = 0
        try:
            # The producer's drop count, read before the head (_losses.py says why).
            total = losses.count_before_take(ring, full_mark)
            span = ring.take()
            self.clock.drained(key)
            took = self._took
            if took is not None:
                took(ring, len(span))
            # Caught up at an earlier drain without an exact count: a lost record at
            # the front of this span announces the drops made while it was held back.
            after = bool(losses.after) and key in losses.after
            if losses.marks:
                losses.caught_up(ring, total)
            if not span:
                return 0 if total is None else self._report_unannounced(ring, total)
            self.stats.took(key, len(span))
            segments, other = self.split(key, span)
            if after and segments:
                losses.first_record(key, segments[0])
        except BrokenRingError as exc:
            # The records before the corrupt one are intact: hand them over, then fail.
            self._retire(ring)
            failure, segments, other, span = exc, exc.partial, 0, b""
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
            samples += count
        added += samples
        self.stats.counted(key, len(span), samples, other)
        self.pending += added
        if failure is not None:
            self.push_failure(failure)
            return added + 1
        if total is not None:
            added += self._report_unannounced(ring, total)
        if len(span) > full_mark:
            losses.took_full(key)
        return added

    def _lost_record(self, key: int, count: int) -> int:
        """A lost record: report what an earlier exact count did not report already."""
        count = self.losses.announced(key, count)
        if not count:
            return 0
        self.queue.append(self.builder.lost(key, count))
        return 1

    def _report_unannounced(self, ring: Ring, total: int | None = None) -> int:
        """Queue a Lost notice for drops the producer counted but no lost record announced
        (``total``: the count read before the drain; see ``LossLedger.unannounced``).

        Only a ring that was full can have dropped, so drains call this only when
        the ring was nearly full before they took it.
        """
        missing = self.losses.unannounced(ring, total)
        if not missing:
            return 0
        self.queue.append(self.builder.lost(ring.key, missing))
        self.pending += 1
        return 1

    def _retire(self, ring: Ring, *, broken: bool = True) -> None:
        self.rings.retire(ring, broken=broken)
        self.stalled.pop(ring.key, None)

    def push_failure(self, exc: BaseException) -> None:
        """Queue an exception, in order, for the consumer to raise when it gets there."""
        self.queue.append(_Failure(exc))
        self.pending += 1

    def end(self, error: BaseException | None, *, drain: bool) -> int:
        """The source is over for good: queue what the rings hold (unless ``drain`` is
        False: then they are no longer ours), then ``error``; look at nothing more.
        No error: the source came to its end (``finished``: the drivers close)."""
        if not drain:
            self.rings.drop_rings()
        self.close()
        if error is None:
            self.finished = True
        else:
            self.push_failure(error)
        return 1

    def _requeue(self, error: DecodeError, rest: Payloads) -> None:
        """decode_errors="raise": the error at the front, the samples after it behind it
        (while the orderer builds, its own: see ``Ordering.build_raw``)."""
        order = self.order
        if order is not None and order.stopped is not None:
            order.stopped.append((error, rest))
            return
        if rest.payloads:
            self.queue.appendleft(_Chunk(*rest))
            self.pending += len(rest.payloads)
        self.queue.appendleft(_Failure(error))
        self.pending += 1

    def drain_all(self, *, force: bool = False) -> int:
        """Check every ring: waking up userspace is expensive, make the most of it.
        Each in its turn (``_in_turn``), unless ``force``: then the queue refuses none."""
        added = 0
        for key in list(self.rings) if force else self._in_turn():
            added += self.drain(key, force=force)
        return added

    def _in_turn(self) -> list[int]:
        """The live rings in the order a pass drains them: those the full queue refused,
        the longest-refused first, then the others by key.

        One ring's drain may fill the queue: the rings after it in the pass are refused
        until the consumer took enough. In key order, the pass after that would begin
        with the first ring again (filled meanwhile) and refuse the same others, every
        time: a consumer that never yields (its takes are all that drains) read one ring
        and the others' drops were all the queue's. Refused first, each ring gets its
        turn whenever the queue has room."""
        stalled = self.stalled
        if not stalled:
            return list(self.rings)
        rings = self.rings
        return [*(key for key in stalled if key in rings),
                *(key for key in rings if key not in stalled)]

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
        rings = self.rings
        added = 0
        for key in self._in_turn():
            ring = rings.get(key)
            if ring is not None and ring.pending_bytes() >= rings.size_of(key) >> 2:
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
            self.rings.close()
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
            columns = self.columnar
            assert columns is not None
            events = columns.events(self.held_arrays, self.builder)
            self.held_arrays.clear()
            held.extendleft(reversed(events))
        if held:
            if len(held) >= max_items:
                return [held.popleft() for _ in range(max_items)]
            out = list(held)
            held.clear()
        self._build(out, max_items)
        return out

    def _build(self, out: list[Any], max_items: int) -> None:
        """Build events from the front of the queue into ``out`` until it holds
        ``max_items`` (``take()``'s list, or ``fill()``'s empty front queue itself)."""
        self._before_taking()
        if self.order is not None:
            self.order.take(out, max_items)  # a list: fill() takes this way too
            return
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

    def fill(self, max_items: int) -> bool:
        """Take a batch into the front queue if it is empty (then ``next_event()`` serves
        it); whether the front has events."""
        held = self.held
        if not held:
            if self.held_arrays or self.order is not None:
                # In front: taking may leave events behind it (a columnar
                # consumer's arrays, turned back into events; released events of an
                # ordered stream past the batch).
                held.extendleft(reversed(self.take(max_items)))
            else:
                # Built straight into the front queue: no batch list in between. (A
                # deque has the list methods building uses; it stays empty until then.)
                self._build(held, max_items)  # type: ignore[arg-type]
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
        if self.columnar is None:
            source = self.source
            columns = cast("Columns", multi.columns(source, load_columns)) if isinstance(
                source, SeveralMapsSource) else load_columns(self.decoder)  # one per map
            # From now on runs are found with NumPy too.
            self.split = columns.split_for(source.records)
            self.columnar = columns
        return self.columnar

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
        if self.order is not None:
            out.extend(self.order.take_arrays(columns, max_rows))
            return out
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

    def queued_rings(self) -> set[int]:
        """The rings whose samples wait in the queue, not built yet."""
        return {seg.key for seg in self.queue
                if seg.__class__ is _Chunk or seg.__class__ is _RunChunk}

    def put_back(self, events: list[Any]) -> None:
        """Return built events to the front, in order (nothing is dropped)."""
        if any(e.__class__ is SampleArray for e in events):
            self.held_arrays.extendleft(reversed(events))
        elif events:
            self.held.extendleft(reversed(events))

    def dispatch(
        self, batch: list[Any], handlers: Handlers
    ) -> Generator[Awaitable[Any], None, None]:
        """Hand each event to its callback (``callbacks.dispatch``); what follows a
        failure is put back, in order."""
        return dispatch(batch, handlers, self.put_back)

    # --- statistics (stats.py) ---------------------------------------------------------

    @property
    def lost_counter(self) -> LostCounter:
        """Where loss counts come from (``LossLedger.counter``)."""
        return self.losses.counter(self.source.records)

    def statistics(self) -> StreamStatistics:
        order = self.order
        return StreamStatistics(
            cpus=self.stats.cpus(self.rings, self.losses, self.builder,
                                 _never if order is None else order.late),
            pending=self.queued(),
            max_pending=self.max_pending,
            paused=self.paused,
            ring_bytes=self.ring_bytes,
            memory_bytes=self.memory_bytes,
            closed=self.closed,
            drain_period=None if self.closed else self.period(self.clock.now()),
            lost_counter=self.lost_counter,
            _maps=self.source.map_facts(self.losses.exact) if isinstance(
                self.source, SeveralMapsSource) else None,
        )

    def log_summary(self, event: str) -> None:
        log_summary(event, self.source.name, self.statistics())


def _never(key: int) -> int:
    return 0


def _after_take(gather: Gathering | None,
                order: Ordering | None) -> Callable[[Ring, int], None] | None:
    """What a drain calls after it took a span (``(ring, its length)``): the features
    that listen, or None."""
    if gather is None:
        return None if order is None else lambda ring, length: order.took(ring.key, length)
    if order is None:
        return gather.took

    def both(ring: Ring, length: int) -> None:
        gather.took(ring, length)
        order.took(ring.key, length)

    return both
