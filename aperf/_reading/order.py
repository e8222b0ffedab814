"""Events in time order across rings, with bounded lateness (sans I/O).

Per-CPU rings each keep their own order; a consumer reading them one after
another sees CPU 0's burst, then CPU 1's, out of time order (bcc #5047,
tracee #1113). An ``Orderer`` holds everything aperf took out of the rings and
releases it sorted by a key (a timestamp field of the decoded value) once no
ring can still bring an earlier one:

- each ring's *watermark* is the key of the newest sample aperf took out of it
  (a ring is in order); a ring seen empty at its latest look is *idle* and holds
  nobody back;
- the release point ``W`` is the lowest watermark of the rings that are not
  idle (everything, when all are);
- an event held ``lateness`` seconds is released whatever the rings say (an
  added batch that expired raises ``W`` to its largest key), but never ahead of
  what aperf already took out of another ring: that is ordered first, so it is
  never late;
- an event whose key is below one already released is *late*: released at
  once, flagged (``Sample.late``) and counted, never dropped.

What was taken waits raw, per ring, and is built a batch at a time from the ring
whose built samples end lowest: a merge of the rings, as far as a release needs
(a backlog of many thousand samples is ordered without building it all at once).
Batches, not a heap: built events are concatenated and sorted with ``sorted``
(timsort merges the already-sorted runs, each ring's, at C speed) and cut at
``W`` with ``bisect``. The columnar twin (``ArrayOrderer``) builds every array at
once (arrays are few objects) and does the same with NumPy
(``argsort(kind="stable")``, ``searchsorted``).
"""

from __future__ import annotations

import operator
from bisect import bisect_right, insort
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import islice
from typing import TYPE_CHECKING, Any, cast

from .._errors import ArgumentError
from .._events import BadSample, Lost, Sample, SampleArray, Tails, tagged

if TYPE_CHECKING:
    from .build import Decoder

DEFAULT_LATENESS = 0.1
"""Seconds an event is held at most for ordering: tracee's choice (100 ms)."""

OrderKey = Callable[[Any], Any]
Build = Callable[[Any, int], tuple[list[Any], list[tuple[Any, int]]]]
"""Builds up to ``n`` samples of a piece held raw: (its events, the rest as (piece,
samples) pairs, in ring order; none when the piece is all built)."""
BUILD_BATCH = 256
"""Samples built at a time out of a raw piece (``_reader.DEFAULT_BATCH``: the GC's sweet spot)."""
NEG = float("-inf")
POS = float("inf")
_FIRST = operator.itemgetter(0)
_SECOND = operator.itemgetter(1)


def check_lateness(lateness: object) -> float:
    """``lateness=``: seconds, a number above 0."""
    if isinstance(lateness, bool) or not isinstance(lateness, int | float) or not (
        0 < lateness < POS
    ):
        raise ArgumentError("lateness", f"lateness must be a number of seconds above 0, "
                            f"not {lateness!r}")
    return float(lateness)


def _layout_fields(decoder: Decoder | None) -> list[str] | None:
    """The field names of a decoder with a layout (None: not knowable)."""
    layout = getattr(decoder, "layout", None)
    if layout is None:
        return None
    from .._decoding.layout import record_fields

    return [name for name, _, _ in record_fields(layout)]


def check_order_by(order_by: object, decoder: Decoder | None) -> OrderKey | None:
    """``order_by=``: None, a field of the decoded value (dotted for nested structs), or a
    callable ``key(sample)``. The key function on samples, checked now."""
    if order_by is None:
        return None
    if isinstance(order_by, str):
        if decoder is None:
            raise ArgumentError(
                "order_by", f"order_by={order_by!r} names a field of the decoded value: it "
                "needs a decoder= (or give a callable key(sample))"
            )
        parts = order_by.split(".")
        if not all(part.isidentifier() for part in parts):
            raise ArgumentError("order_by", f"order_by={order_by!r} is not a field name (or "
                                "dotted names)")
        fields = _layout_fields(decoder)
        if fields is not None and parts[0] not in fields:
            raise ArgumentError(
                "order_by", f"order_by={order_by!r}: the decoder's records have no field "
                f"{parts[0]!r} (fields: {', '.join(fields)})"
            )
        return operator.attrgetter("value." + order_by)
    if callable(order_by):
        return order_by
    raise TypeError(
        f"order_by must be None, a field name or a callable key(sample), not "
        f"{type(order_by).__name__}"
    )


def late_event(event: Any) -> Any:
    """The same event, flagged late (its map tag kept)."""
    kind = type(event)
    tag = kind.map if hasattr(kind, "_untagged") else None  # a plain event's map is a property
    return tuple.__new__(tagged(cast(Any, kind), tag, True), event)


class _Rings:
    """What the orderer knows of each ring: its watermark, whether it was idle."""

    __slots__ = ("_checked", "batches", "empty", "last", "late", "lateness", "period",
                 "released")

    def __init__(self, lateness: float, period: float | None) -> None:
        self.lateness = lateness
        self.period = lateness / 4 if period is None else min(period, lateness / 4)
        self.last: dict[Any, Any] = {}  # ring key -> key of its last sample
        self.empty: dict[Any, bool] = {}  # ring key -> seen empty at its latest look
        self.late: dict[Any, int] = {}  # ring key -> late samples
        self.released: Any = NEG  # the largest key released so far
        # (arrival time, largest key) of each added batch still (maybe) held, by arrival
        self.batches: list[tuple[float, Any]] = []
        self._checked = 0.0

    def arrived(self, now: float, top: Any) -> None:
        """A batch taken out of the rings at ``now`` was added; ``top`` its largest key."""
        batches = self.batches
        if batches and now < batches[-1][0]:
            insort(batches, (now, top), key=_FIRST)  # built after later ones
        else:
            batches.append((now, top))

    def checked(self, now: float) -> None:
        """A tick looked for releasable events at ``now``."""
        self._checked = now

    def looked(self, ring: Any, empty: bool) -> None:
        """A drain just looked at ``ring`` (``empty``: it held nothing)."""
        self.empty[ring] = empty

    def rings_watermark(self) -> Any:
        """The lowest watermark of the rings not seen idle (POS: every ring is)."""
        last = self.last
        w: Any = POS
        for ring, empty in self.empty.items():
            # A ring not seen empty (or not looked at: held back by a full queue) holds
            # the others at its last sample; one that never gave a sample, at all.
            if not empty and last.get(ring, NEG) < w:
                w = last.get(ring, NEG)
        return w

    def watermark(self, now: float) -> Any:
        """The key up to which events can be released now: the rings' watermark, raised
        to the largest key of every batch held ``lateness`` or more."""
        self._checked = now
        w = self.rings_watermark()
        batches, expire = self.batches, now - self.lateness
        gone = 0
        for arrived, top in batches:
            if arrived > expire:
                break
            gone += 1
            if top > w:
                w = top
        del batches[:gone]
        return w

    def expired_top(self, now: float) -> Any:
        """The largest key of the batches held ``lateness`` or more (NEG: none)."""
        top: Any = NEG
        for arrived, key in self.batches:
            if arrived > now - self.lateness:
                break
            if key > top:
                top = key
        return top

    @property
    def count(self) -> int:
        """Events held."""
        raise NotImplementedError

    def raw_arrivals(self) -> Iterable[float]:
        """When the oldest raw piece of each ring was taken out of it (``Orderer``)."""
        return ()

    def deadline(self) -> float | None:
        """When a look is due for held events (None: nothing held).

        Never at or before the latest check: what had expired by then was seen (the
        consumer was woken for it) and waits for the consumer to take it; a past
        deadline would run the tick again and again until it does (on trio, a system
        task that never yields: the whole program frozen)."""
        if not self.count:
            self.batches.clear()
            return None
        checked, lateness = self._checked, self.lateness
        at = checked + self.period
        for arrived, _ in self.batches:  # by arrival: the first one not expired then
            if arrived + lateness > checked:
                at = min(at, arrived + lateness)
                break
        for arrived in self.raw_arrivals():
            if checked < arrived + lateness < at:
                at = arrived + lateness
        return at


class Orderer(_Rings):
    """Holds what was taken out of the rings; releases it as events, in key order (see
    the module).

    Samples wait raw, per ring (``queue``), and are built a batch at a time when a
    release needs them (``build``): always from the ring whose watermark is the lowest,
    so that everything held is merged across rings without building it all at once
    (events built and left waiting would make CPython's GC walk them again and again).
    Built events are two parallel lists: keys and events, sorted when a release needs
    them; a batch that comes in order after them (the usual case) is appended as it is.
    """

    __slots__ = ("_events", "_keys", "_late_held", "_raw", "_raw_count", "_sorted", "build",
                 "error", "field", "key")

    def __init__(self, key: OrderKey, lateness: float, period: float | None = None,
                 field: bool = False, build: Build | None = None) -> None:
        super().__init__(lateness, period)
        self.key = key
        self.field = field  # the key reads a field: it fails on a Lost or BadSample
        self.build = build  # what builds the pieces given to ``queue``
        self._keys: list[Any] = []
        self._events: list[Any] = []
        self._sorted = True  # held events are in key order (else sorted when needed)
        self._late_held: list[tuple[Any, Any]] = []
        # ring -> [arrival time, piece, samples] not built yet, in ring order
        self._raw: dict[Any, deque[list[Any]]] = {}
        self._raw_count = 0
        # A key that failed, or a decode error under "raise" (``build``): raised after
        # the release that met it.
        self.error: Exception | None = None

    @property
    def count(self) -> int:
        """Events held, raw samples included."""
        return len(self._events) + len(self._late_held) + self._raw_count

    def queue(self, ring: Any, piece: Any, samples: int, now: float) -> None:
        """A piece of ``ring``'s samples (or a lost notice: 1), taken out of it at ``now``,
        in ring order; built by ``build`` when a release needs it."""
        raw = self._raw.get(ring)
        if raw is None:
            raw = self._raw[ring] = deque()
        raw.append([now, piece, samples])
        self._raw_count += samples

    def _raw_low(self) -> Any:
        """The lowest last built key of the rings with raw samples (POS: none). Their raw
        samples come after it (a ring is in order), so it bounds every release: what
        aperf took out of the rings is never late, whatever ``lateness`` says."""
        raw, last = self._raw, self.last
        if len(raw) < 2:
            return last.get(next(iter(raw)), NEG) if raw else POS
        return min(last.get(ring, NEG) for ring in raw)

    def watermark(self, now: float) -> Any:
        """The release point (``_Rings.watermark``), never above ``_raw_low``."""
        return min(super().watermark(now), self._raw_low())

    def raw_arrivals(self) -> Iterator[float]:
        return (pieces[0][0] for pieces in self._raw.values())

    def _build_raw(self, now: float, everything: bool, want: int) -> None:
        """Build raw samples until ``want`` events can go, or building more could not
        release more: a batch at a time from the ring with raw samples whose last built
        key is the lowest (which holds the release point there), so the rings are merged
        as far as a release needs, however much they hold. Raw pieces held ``lateness``
        keep it building past a busy ring's watermark (once built, they go whatever the
        rings say). ``everything``: build it all."""
        raw, last, build = self._raw, self.last, self.build
        if not raw or build is None:
            return
        expire = now - self.lateness
        while raw:
            ring = min(raw, key=lambda r: last.get(r, NEG)) if len(raw) > 1 else next(iter(raw))
            if not everything:
                low = last.get(ring, NEG)
                allowed = max(self.rings_watermark(), self.expired_top(now))
                if self._keys:
                    self._sort()
                    if bisect_right(self._keys, min(low, allowed)) >= want:
                        break  # enough can go
                if low > allowed and all(pieces[0][0] > expire for pieces in raw.values()):
                    break  # a busy ring holds the release point below all that is raw
            pieces = raw[ring]
            arrived, piece, samples = pieces.popleft()
            events, rest = build(piece, max(want, BUILD_BATCH))
            left = 0
            for part, count in reversed(rest):  # back in front, in ring order
                pieces.appendleft([arrived, part, count])
                left += count
            self._raw_count -= samples - left
            if not pieces:
                del raw[ring]
            self.add(ring, events, arrived)
            if self.error is not None:
                break  # raised first (``take_error``): what follows waits, raw or built

    def add(self, ring: Any, events: list[Any], now: float) -> None:
        """A batch of one ring's events, in ring order."""
        if not events:
            return
        keys: list[Any]
        if self.field or all(issubclass(kind, Sample) for kind in set(map(type, events))):
            try:
                keys = list(map(self.key, events))
            except Exception:
                keys = self._keys_of(ring, events)
        else:
            keys = self._keys_of(ring, events)
        last = self.last.get(ring, NEG)
        for key, event in zip(reversed(keys), reversed(events), strict=True):
            if not isinstance(event, Lost | BadSample):
                last = key
                break
        self.last[ring] = last
        low = min(keys)
        self.arrived(now, max(keys))
        if low < self.released:
            self._split_late(ring, keys, events)
        else:
            self._hold(keys, events)

    def _hold(self, keys: list[Any], events: list[Any]) -> None:
        held_keys = self._keys
        if self._sorted and not ((not held_keys or keys[0] >= held_keys[-1]) and all(
                map(operator.le, keys, islice(keys, 1, None)))):
            self._sorted = False  # falls among what is held: sorted once, when needed
        held_keys.extend(keys)  # in order after what is held (the usual case): as it is
        self._events.extend(events)

    def _sort(self) -> None:
        """Held events in key order: one sort for every batch added since the last (a
        backlog comes as many batches of several rings)."""
        if self._sorted:
            return
        keys = self._keys
        # Positions, not (key, event) pairs: ints are not tracked by the cyclic GC, and
        # tens of thousands of tuples made it walk every held event again and again.
        # Timsort merges the sorted runs; stable: ties in arrival order.
        order = sorted(range(len(keys)), key=keys.__getitem__)
        self._keys = list(map(keys.__getitem__, order))
        self._events = list(map(self._events.__getitem__, order))
        self._sorted = True

    def _keys_of(self, ring: Any, events: list[Any]) -> list[Any]:
        """Keys one by one: a lost notice or bad sample takes its ring's previous key."""
        prev = self.last.get(ring, NEG)
        key = self.key
        keys = []
        for event in events:
            if not isinstance(event, Lost | BadSample):
                try:
                    prev = key(event)
                except Exception as exc:
                    if self.error is None:
                        self.error = ArgumentError(
                            "order_by", f"order_by: no ordering key in sample {event!r} ({exc})"
                        )
            keys.append(prev)
        return keys

    def _split_late(self, ring: Any, keys: list[Any], events: list[Any]) -> None:
        released, late = self.released, self._late_held
        count = 0
        on_time_keys, on_time = [], []
        for key, event in zip(keys, events, strict=True):
            if key < released:
                if not isinstance(event, Lost):
                    event = late_event(event)
                    count += 1
                late.append((key, event))
            else:
                on_time_keys.append(key)
                on_time.append(event)
        if on_time:
            self._hold(on_time_keys, on_time)
        if count:
            self.late[ring] = self.late.get(ring, 0) + count

    def take_error(self) -> Exception | None:
        error, self.error = self.error, None
        return error

    def release(self, now: float, everything: bool = False, want: int = BUILD_BATCH) -> list[Any]:
        """The events that can go now, in order: late ones first; raw samples built as far
        as ``want`` events can go (more may come: a built batch goes whole)."""
        self._build_raw(now, everything, want)
        out: list[Any] = []
        if self._late_held:
            late = self._late_held
            late.sort(key=_FIRST)
            out.extend(map(_SECOND, late))
            late.clear()
        self._sort()
        keys = self._keys
        if not keys:
            self._checked = now
            return out
        w = POS if everything else self.watermark(now)
        cut = len(keys) if w is POS else bisect_right(keys, w)
        if cut:
            if keys[cut - 1] > self.released:
                self.released = keys[cut - 1]
            events = self._events
            if cut == len(keys):
                out.extend(events)
                self._keys, self._events = [], []
            else:
                out.extend(events[:cut])
                del keys[:cut], events[:cut]
        return out

    def releasable(self, now: float) -> bool:
        """Whether a release now would hand anything out (looking at what is known)."""
        if self._late_held:
            return True
        allowed = max(self.rings_watermark(), self.expired_top(now))
        raw = self._raw
        if raw:
            # Raw samples a take would build, then release: held `lateness`, or from the
            # ring that holds the release point.
            expire = now - self.lateness
            if any(pieces[0][0] <= expire for pieces in raw.values()):
                return True
            if self._raw_low() <= allowed:
                return True
        self._sort()
        keys = self._keys
        return bool(keys) and keys[0] <= min(allowed, self._raw_low())

# --- the columnar twin ---------------------------------------------------------------------


class _Rows:
    """Rows held for ordering: records of one length as ``recs`` (a NumPy array of
    ``V<length>`` items, moved whole), or of several, packed in ``blob``."""

    __slots__ = ("blob", "cpus", "in_order", "keys", "lengths", "origin", "recs", "starts")

    def __init__(self, keys: Any, cpus: Any, blob: Any = None, starts: Any = None,
                 lengths: Any = None, recs: Any = None) -> None:
        self.origin: SampleArray | None = None  # the one array these rows are, unchanged
        self.in_order = False  # keys known to be sorted
        self.keys = keys
        self.cpus = cpus
        self.recs = recs
        self.blob = blob  # uint8 array
        self.starts = starts
        self.lengths = lengths

    def packed(self, np: Any) -> _Rows:
        """The same rows with their records in ``blob`` (for rows of several lengths)."""
        if self.recs is None:
            return self
        recs = np.ascontiguousarray(self.recs)
        size = recs.dtype.itemsize
        count = len(recs)
        return _Rows(self.keys, self.cpus, recs.view(np.uint8).reshape(-1),
                     np.arange(count, dtype=np.int64) * size, np.full(count, size, np.int64))


def _gather(np: Any, blob: Any, starts: Any, lengths: Any) -> tuple[Any, Any]:
    """The byte ranges ``blob[starts[i]:starts[i]+lengths[i]]``, packed one after another:
    (packed bytes as uint8, their new starts), at C speed."""
    total = int(lengths.sum())
    new_starts = np.cumsum(lengths) - lengths
    if not total:
        return np.zeros(0, np.uint8), new_starts
    if len(lengths) and lengths.min() == lengths.max():
        size = int(lengths[0])
        index = starts[:, None] + np.arange(size, dtype=np.int64)
        return blob[index].reshape(-1), new_starts
    index = np.repeat(starts - new_starts, lengths) + np.arange(total, dtype=np.int64)
    return blob[index], new_starts


class ArrayOrderer(_Rings):
    """``Orderer`` for columnar consumers: rows of ``SampleArray`` items, merged with NumPy.

    Released rows come out as one ``SampleArray`` per release (``cpu`` -1 when its
    rows come from several rings; ``cpus`` says each row's), late rows as their own
    ``SampleArray`` with ``late`` True, before it. Lost notices and bad samples take
    their ring's previous key and split the released rows where they fall.
    """

    __slots__ = ("_items", "_parts", "_placed", "_records", "columns", "field", "max_rows", "np")

    def __init__(self, field: str, lateness: float, columns: Any,
                 period: float | None = None) -> None:
        super().__init__(lateness, period)
        import numpy as np

        self.np = np
        self.field = field.split(".")
        self.columns = columns
        self._parts: list[_Rows] = []  # held rows, merged only when they must be sorted
        self._items: list[tuple[Any, Any]] = []  # (key, Lost or BadSample), in arrival order
        # How many held arrays came before each item, while all of them did (None: some
        # items came before a sort; then the items go by their keys).
        self._placed: list[int] | None = []
        self.max_rows: int | None = None  # the most rows in one released array
        self._records: dict[tuple[int, int, int], Any] = {}  # run shape -> its records' dtype

    @property
    def count(self) -> int:
        return sum(len(part.keys) for part in self._parts) + len(self._items)

    def _column(self, values: Any) -> Any:
        for part in self.field:
            values = values[part]
        return values

    def _raw(self, array: SampleArray, keys: Any, cpus: Any) -> _Rows:
        """An array's raw records as rows: of one length, viewed in place as ``recs``."""
        np = self.np
        source = array._source
        if isinstance(source, _Gathered):
            return _Rows(keys, cpus, source.blob, source.starts, source.lengths, source.recs)
        if isinstance(source, list):  # payloads
            lengths = np.fromiter(map(len, source), np.int64, len(source))
            blob = b"".join(source)
            if len(lengths) and lengths.min() == lengths.max():
                return _Rows(keys, cpus, recs=np.frombuffer(blob, f"V{int(lengths[0])}"))
            return _Rows(keys, cpus, np.frombuffer(blob, np.uint8),
                         np.cumsum(lengths) - lengths, lengths)
        run = source  # a Run: records at a stride in the copied span
        shape = (run.size, run.skip, run.stride)
        dtype = self._records.get(shape)
        if dtype is None:  # made once: a dtype from a dict costs microseconds
            dtype = self._records[shape] = np.dtype({
                "names": ["r"], "formats": [f"V{run.size}"], "offsets": [run.skip],
                "itemsize": run.stride})
        return _Rows(keys, cpus, recs=np.frombuffer(run.span, dtype, run.count, run.start)["r"])

    def add_items(self, ring: Any, items: Sequence[Any], now: float) -> None:
        """One ring's pieces (``SampleArray``, ``Lost``, ``BadSample``), in ring order."""
        np = self.np
        parts = self._parts
        last = self.last.get(ring, NEG)
        top: Any = NEG
        for item in items:
            if item.__class__ is SampleArray:
                if not len(item):
                    continue
                # One copy of the key column, aligned: the records are not (a perf record's
                # data starts 4 bytes in), and NumPy works on unaligned arrays through buffers.
                keys = np.ascontiguousarray(self._column(item.values))
                cpus = item.cpus if item.cpus is not None else np.full(
                    len(keys), item.cpu, dtype=np.int64)
                rows = self._raw(item, keys, cpus)
                rows.origin = item
                # One pass: a ring's rows are in order, as a rule; then the last is the top.
                rows.in_order = len(keys) < 2 or bool((keys[1:] >= keys[:-1]).all())
                parts.append(rows)
                last = keys[-1].item()
                top = max(top, last if rows.in_order else keys.max().item())
            else:
                self._items.append((last, item))
                if self._placed is not None:
                    self._placed.append(len(parts))
        self.last[ring] = last
        self.arrived(now, top)

    def _merge(self, parts: list[_Rows]) -> _Rows:
        np = self.np
        if len(parts) == 1:
            return parts[0]
        keys = np.concatenate([p.keys for p in parts])
        cpus = np.concatenate([p.cpus for p in parts])
        if len({None if p.recs is None else p.recs.dtype.itemsize for p in parts}) == 1 and (
                parts[0].recs is not None):
            # Records of one length: moved whole, at C speed.
            return _Rows(keys, cpus, recs=np.concatenate([p.recs for p in parts]))
        parts = [p.packed(np) for p in parts]
        blobs, starts = [], []
        offset = 0
        for part in parts:
            packed, new_starts = _gather(np, part.blob, part.starts, part.lengths)
            blobs.append(packed)
            starts.append(new_starts + offset)
            offset += packed.size
        return _Rows(keys, cpus, np.concatenate(blobs), np.concatenate(starts),
                     np.concatenate([p.lengths for p in parts]))

    def _pick(self, rows: _Rows, index: Any) -> _Rows:
        if isinstance(index, slice):
            index = self.np.arange(len(rows.keys))[index] if rows.recs is None else index
        if rows.recs is not None:
            return _Rows(rows.keys[index], rows.cpus[index], recs=rows.recs[index])
        packed, starts = _gather(self.np, rows.blob, rows.starts[index], rows.lengths[index])
        return _Rows(rows.keys[index], rows.cpus[index], packed, starts, rows.lengths[index])

    def _arrays(self, rows: _Rows, late: bool, out: list[Any]) -> None:
        """Released rows as arrays of at most ``max_rows`` rows each."""
        step = self.max_rows
        count = len(rows.keys)
        if not step or count <= step:
            out.append(self._array(rows, late))
            return
        for at in range(0, count, step):
            out.append(self._array(self._pick(rows, self.np.arange(at, min(count, at + step))),
                                   late))

    def _array(self, rows: _Rows, late: bool) -> SampleArray:
        np = self.np
        columns = self.columns
        cpus = rows.cpus
        one = len(cpus) and bool((cpus == cpus[0]).all())
        if rows.recs is not None and not columns.has_tail:
            recs = np.ascontiguousarray(rows.recs)
            values = recs.view(columns.strided_dtype(recs.dtype.itemsize, 0))
            values.flags.writeable = False
            array = SampleArray(int(cpus[0]) if one else -1, values,
                                _source=_Gathered(None, None, None, cpus, recs),
                                _columns=columns)
            array.cpus = None if one else cpus
            array.late = late
            return array
        rows = rows.packed(np)
        size = columns.size
        data = rows.blob.tobytes()
        if len(rows.lengths) and rows.lengths.min() == rows.lengths.max():
            stride = int(rows.lengths[0])
            values = np.frombuffer(data, columns.strided_dtype(stride, 0), len(rows.keys), 0)
        else:
            index = rows.starts[:, None] + np.arange(size, dtype=np.int64)
            values = np.frombuffer(data, np.uint8)[index].view(columns.dtype)[:, 0]
            values.flags.writeable = False
        tails = (Tails(data, rows.starts + size, rows.starts + rows.lengths)
                 if columns.has_tail else None)
        array = SampleArray(int(cpus[0]) if one else -1, values, tails,
                            _source=_Gathered(np.frombuffer(data, np.uint8), rows.starts,
                                              rows.lengths, cpus), _columns=columns)
        array.cpus = None if one else cpus
        array.late = late
        return array

    def _in_order(self, w: Any) -> bool:
        """Whether the held arrays go out as they are: each sorted, one after another in
        order, none late, all at or below ``w``, and nothing to put between them."""
        parts, step = self._parts, self.max_rows
        if self._placed is None or any(p.origin is None or (step and len(p.keys) > step)
                                       for p in parts):
            return False
        previous = self.released
        for part in parts:
            keys = part.keys
            if not part.in_order or keys[0] < previous:
                return False
            previous = keys[-1].item()
        return bool(w is POS or previous <= w)

    def release(self, now: float, everything: bool = False) -> list[Any]:
        np = self.np
        out: list[Any] = []
        w: Any = POS if everything else self.watermark(now)
        parts = self._parts
        if parts and self._in_order(w):
            # The common case (one busy ring): the arrays as they came, no copy, lost
            # notices and bad samples where they came among them.
            items, placed = self._items, self._placed
            at = 0
            for index, array in enumerate(part.origin for part in parts):
                while at < len(items) and placed[at] <= index:  # type: ignore[index]
                    out.append(items[at][1])
                    at += 1
                out.append(array)
            out.extend(item for _, item in items[at:])
            top = parts[-1].keys[-1].item()
            if top > self.released:
                self.released = top
            parts.clear()
            items.clear()
            self._placed = []
            return out
        rows = self._merge(parts) if parts else None
        parts.clear()
        self._placed = None if self._items else []
        if rows is not None:
            keys = rows.keys
            # Rows of one ring, or merged runs that happen to be in order: no sort, and
            # slices instead of gathers.
            order = None if len(keys) < 2 or bool((keys[1:] >= keys[:-1]).all()) else (
                np.argsort(keys, kind="stable"))
            if order is not None:
                keys = keys[order]
            released = self.released
            late_n = 0 if released is NEG else int(np.searchsorted(keys, released, "left"))
            if w is POS:
                cut = len(keys)
            elif w is NEG:
                cut = 0
            else:
                cut = int(np.searchsorted(keys, w, "right"))
            cut = max(cut, late_n)
            sorted_order = order

            def part(a: int, b: int | None) -> Any:  # in order already: slices, no gather
                return slice(a, b) if sorted_order is None else sorted_order[a:b]

            if late_n:
                late_rows = self._pick(rows, part(0, late_n))
                for ring, n in zip(*np.unique(late_rows.cpus, return_counts=True), strict=True):
                    self.late[int(ring)] = self.late.get(int(ring), 0) + int(n)
                self._arrays(late_rows, True, out)
            if cut > late_n:
                picked = part(late_n, cut)
                self._release_rows(self._pick(rows, picked), w, out)
                top = keys[cut - 1].item()
                if top > self.released:
                    self.released = top
            if cut < len(keys):
                parts.append(self._pick(rows, part(cut, None)))
        self._release_items(w, out)
        return out

    def _release_rows(self, rows: _Rows, w: Any, out: list[Any]) -> None:
        """Released rows, split where a releasable lost notice or bad sample falls."""
        items = [(k, i) for k, i in self._items if k <= w]
        if not items:
            self._arrays(rows, False, out)
            return
        self._items = [(k, i) for k, i in self._items if k > w]
        start = 0
        for key, item in items:
            at = int(self.np.searchsorted(rows.keys, key, "right")) if key is not NEG else 0
            if at > start:
                self._arrays(self._pick(rows, self.np.arange(start, at)), False, out)
                start = at
            out.append(item)
        if start < len(rows.keys):
            self._arrays(self._pick(rows, self.np.arange(start, len(rows.keys))), False, out)

    def _release_items(self, w: Any, out: list[Any]) -> None:
        if not self._items:
            return
        go = [i for k, i in self._items if k <= w]
        self._items = [(k, i) for k, i in self._items if k > w]
        out.extend(go)
        if not self._items:
            self._placed = []

    def releasable(self, now: float) -> bool:
        if not self._parts:
            return bool(self._items)
        lowest = min(part.keys.min().item() for part in self._parts)
        if lowest < self.released or lowest <= self.expired_top(now):
            return True
        return bool(lowest <= self.rings_watermark())

class _Gathered:
    """The raw records of a merged ``SampleArray`` (to rebuild its events): ``recs`` of
    one length, or packed in ``blob``."""

    __slots__ = ("blob", "cpus", "lengths", "recs", "starts")

    def __init__(self, blob: Any, starts: Any, lengths: Any, cpus: Any,
                 recs: Any = None) -> None:
        self.blob = blob
        self.starts = starts
        self.lengths = lengths
        self.cpus = cpus
        self.recs = recs

    def payloads(self) -> list[tuple[int, bytes]]:
        if self.recs is not None:
            return [(int(c), bytes(r)) for c, r in zip(self.cpus.tolist(), self.recs.tolist(),
                                                       strict=True)]
        data = self.blob.tobytes()
        return [(int(c), data[s : s + n]) for c, s, n in zip(
            self.cpus.tolist(), self.starts.tolist(), self.lengths.tolist(), strict=True)]
