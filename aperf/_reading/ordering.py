"""An ordered reader's take (``order_by=``): everything taken out of the rings goes
through an orderer (``order.py``), which releases it in key order.

A reader has an ``Ordering`` only when a stream is ordered; it then calls
``take``/``take_arrays`` here instead of its plain build, and tells it what each look
at a ring found (a ring seen empty is idle and holds nobody back). The events' orderer
keeps what it was handed raw and builds it as a release needs it (``build_raw``); a
columnar consumer gets an ``ArrayOrderer`` the first time it takes arrays. Held
events count in the reader's ``pending``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from .._errors import DecodeError
from .._events import Event, Lost, SampleArray
from .build import Payloads, RunPiece
from .order import ArrayOrderer, Orderer, OrderKey

if TYPE_CHECKING:
    from .columnar import Columns
    from .reader import Piece, Reader


def rows(items: Iterable[Any]) -> int:
    """Events in columnar items: an array counts as its rows."""
    return sum(len(e) if e.__class__ is SampleArray else 1 for e in items)


class Ordering:
    """The orderers of one reader: for events (always), for arrays (once asked for)."""

    __slots__ = ("_field", "_lateness", "_period", "arrays", "events", "orderers", "reader",
                 "stopped")

    def __init__(self, reader: Reader, order_by: OrderKey, field: str | None,
                 lateness: float, period: float | None) -> None:
        self.reader = reader
        self._field = field  # order_by= a field name (arrays need one)
        self._lateness = lateness
        self._period = period
        self.events = Orderer(order_by, lateness, period, field=field is not None,
                              build=self.build_raw)
        self.arrays: ArrayOrderer | None = None
        self.orderers: list[Orderer | ArrayOrderer] = [self.events]  # those in use
        # While the orderer builds (build_raw): a decode error under "raise" and the
        # samples after it, which the reader's requeue hands here instead of its queue.
        self.stopped: list[tuple[DecodeError, Payloads]] | None = None

    # --- what the reader asks -----------------------------------------------------------

    def deadline(self, at: float | None) -> float | None:
        """The drain clock's deadline ``at``, or sooner: events held for ordering are
        looked at again then (docs/ordering.md)."""
        for orderer in self.orderers:
            due = orderer.deadline()
            if due is not None and (at is None or due < at):
                at = due
        return at

    def has_events(self) -> bool:
        """Whether a take would hand anything out: of the events held for ordering, only
        those that can go now."""
        reader = self.reader
        waiting = 0
        for orderer in self.orderers:
            if orderer.count:
                if orderer.releasable(reader.clock.now()) or reader.closed:
                    return True
                waiting += orderer.count
        return reader.pending > waiting

    def tick(self, now: float) -> int:
        """The drain timer fired: with events held, a fresh look at every ring, then
        wake the consumer (1) if some can go now."""
        reader = self.reader
        added = 0
        for orderer in self.orderers:
            if orderer.count:
                if reader.pending < reader.max_pending:
                    added += reader.drain_all()
                if orderer.releasable(now):
                    added += 1
                orderer.checked(now)
        return added

    def looked(self, key: int, empty: bool) -> None:
        """A look at ring ``key`` found it ``empty`` (idle) or not."""
        for orderer in self.orderers:
            orderer.looked(key, empty)

    def took(self, key: int, length: int) -> None:
        """A drain took ``length`` bytes out of ring ``key`` (none: it is idle)."""
        for orderer in self.orderers:
            orderer.looked(key, not length)

    def late(self, key: int) -> int:
        """Samples of ring ``key`` delivered late."""
        return sum(o.late.get(key, 0) for o in self.orderers)

    # --- taking --------------------------------------------------------------------------

    def take(self, out: list[Any], max_items: int) -> list[Event[Any]]:
        """The reader's take: what can go now, in order, after what ``out`` holds (a
        columnar consumer's held rows first, as events); past ``max_items``, the rest
        waits in the reader's front queue."""
        reader = self.reader
        orderer = self.events
        if self.arrays is not None and self.arrays.count:
            # A columnar consumer stopped: what it held, as events, in front.
            arrays = self._released_all(self.arrays)
            out.extend(reader.columns().events(arrays, reader.builder))
        self._feed(self.events, self._queue_raw)
        out.extend(self._released(orderer, out, max(max_items - len(out), 1)))
        if len(out) > max_items:
            reader.held.extend(out[max_items:])
            del out[max_items:]
        return out

    def take_arrays(self, columns: Columns, max_rows: int | None) -> list[Any]:
        """The reader's columnar take: what can go now, in order, as arrays."""
        reader = self.reader
        if self.arrays is None:
            if self._field is None:
                raise TypeError("arrays() of an ordered stream needs order_by= a field name "
                                "(a callable key orders events, not arrays)")
            self.arrays = ArrayOrderer(self._field, self._lateness, columns, self._period)
            self.orderers.append(self.arrays)
            self.arrays.empty.update(self.events.empty)  # what the looks so far saw
        orderer = self.arrays
        out: list[Any] = []
        if self.events.count:
            out.extend(columns.front(self._released_all(self.events)))  # a per-item consumer's
        builder = reader.builder

        def add(key: int, piece: Piece, samples: int, now: float) -> int:
            items: list[Any] = []
            if isinstance(piece, Lost):
                items.append(piece)
            else:
                columns.arrays(piece, builder, None, items)
            orderer.add_items(key, items, now)
            return rows(items)

        self._feed(orderer, add)
        orderer.max_rows = max_rows
        released = orderer.release(reader.clock.now(), everything=reader.closed)
        reader.pending -= rows(released)
        out.extend(released)
        return out

    def _feed(self, orderer: Orderer | ArrayOrderer,
              add: Callable[[int, Piece, int, float], int]) -> None:
        """Look at the rings with nothing queued (which are idle now), then hand
        everything queued to an orderer (``add``: how many events it holds for it now),
        so that what aperf took out of every ring is ordered together; held events
        count in ``pending``.

        A look reads a ring's head only: one that holds samples is busy (it holds the
        others back until its wakeup or the drain timer takes them), one that holds
        none is idle. Taking them here would cut the stream into small drains."""
        reader = self.reader
        queued = reader.queued_rings()
        for key, ring in reader.rings.items():
            if key not in queued:
                self.looked(key, not ring.pending_bytes())
        now = reader.clock.now()
        pop = reader.pop
        builder = reader.builder
        started = False
        while True:
            piece = pop(None, started)
            if piece is None:
                break
            started = True
            if isinstance(piece, Lost):
                key, samples = builder.key_of(piece), 1  # its ring's (a map's offset + CPU)
            else:
                key = piece.key
                samples = piece.stop - piece.start if isinstance(piece, RunPiece) else len(
                    piece.payloads)
            reader.pending += add(key, piece, samples, now)
        # A queued failure ends the batch in front of it (``pop``): the rings of the
        # samples behind it are busy, they come after the ones handed over.
        for key in reader.queued_rings():
            orderer.looked(key, False)

    def _queue_raw(self, key: int, piece: Piece, samples: int, now: float) -> int:
        """``_feed`` for events: the orderer keeps the piece raw until a release needs it."""
        self.events.queue(key, piece, samples, now)
        return samples

    def build_raw(self, piece: Piece, limit: int) -> tuple[list[Any], list[tuple[Any, int]]]:
        """Build up to ``limit`` samples of a piece the orderer held raw (``Orderer.build``):
        the events and the rest. A decode error under "raise" becomes the orderer's error
        (raised once what can go went back to the front), the samples after it the rest."""
        out: list[Any] = []
        rest: list[tuple[Any, int]] = []
        if isinstance(piece, Lost):
            return [piece], rest
        reader = self.reader
        builder = reader.builder
        self.stopped = []
        try:
            if isinstance(piece, RunPiece):
                stop = min(piece.stop, piece.start + limit)
                builder.run(piece.key, piece.run, piece.start, stop, out)
                built = stop - piece.start
                if stop < piece.stop:
                    rest.append((RunPiece(piece.key, piece.run, stop, piece.stop),
                                 piece.stop - stop))
            else:
                payloads = piece.payloads
                built = min(limit, len(payloads))
                builder.payloads(piece.key, payloads[:built], piece.uniform, out)
                if built < len(payloads):
                    rest.append((Payloads(piece.key, payloads[built:], piece.uniform),
                                 len(payloads) - built))
            stopped, self.stopped = self.stopped, None
        finally:
            self.stopped = None
        reader.pending += len(out) - built  # samples skipped (or stopped at) leave the count
        if stopped:
            error, after = stopped[0]
            if self.events.error is None:
                self.events.error = error
            if after.payloads:
                rest.insert(0, (after, len(after.payloads)))
                reader.pending += len(after.payloads)
        return out, rest

    def _released(self, orderer: Orderer, out: list[Any], want: int) -> list[Any]:
        reader = self.reader
        released = orderer.release(reader.clock.now(), everything=reader.closed, want=want)
        reader.pending -= len(released)
        error = orderer.take_error()
        if error is not None:
            reader.put_back(out + released)  # nothing lost: served before the error's cause
            raise error
        return released

    def _released_all(self, orderer: Orderer | ArrayOrderer) -> list[Any]:
        released = orderer.release(self.reader.clock.now(), everything=True)
        self.reader.pending -= len(released) if isinstance(orderer, Orderer) else rows(released)
        return released
