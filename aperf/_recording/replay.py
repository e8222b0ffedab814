"""``aperf.replay()``: a recording played back as a ring source, so that ``PerfStream``
and ``PerfBuffer`` read it with the code that read the live stream.

The recording's items, samples and lost notices in stream order, are cut into chunks:
the items of one ring in a row (at most ``CHUNK_BYTES``). One chunk at a time is
*published*: it is what its ring's ``take()`` hands over; once taken, the next one is
published (at once, or, with ``speed``, when its recorded time comes: ``speed=1`` is
the recorded pace, 2 twice as fast), and the rings' shared eventfd is signalled. So the
reader drains the rings in the recorded order and hands out the same samples and lost
notices in the same order, whatever the reading mode, on every loop, without root; and
its backpressure holds the replay back (a chunk waits, nothing is dropped). When the
last chunk was taken, the end notice fires (``SourceEnded(None)``): the stream takes
what it holds and closes, so ``async for`` ends after the last event.

A chunk is a ``bytes`` of its samples, one after another (so ``statistics().bytes``
counts them), carrying its segments for the record format: a ``Run`` of samples of one
size viewed in place, lists of payloads, lost counts.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from .._arrow.schema import CPU, DATA, MAP, TIME
from .._decoding.decode import SizedDecoder
from .._errors import BusyResourceError, DecoderMismatchError, RecordingFormatError
from .._rings.seam import HandleKind, RecordFormat, RingConfig, Run, Segment, SourceEnded
from .files import COUNT, ROW, Recording
from .layouts import same_decoding

CHUNK_BYTES = 256 << 10  # samples per chunk, at most (and a ring's "size")


class _Span(bytes):
    """A chunk of samples, with the segments the record format hands the reader (a
    lost notice's holds no bytes, and is something all the same)."""

    segments: list[Segment]

    def __bool__(self) -> bool:
        return True


class ReplayRecords:
    """The record format of a replay: each span says its own segments."""

    name = "replay"
    lost_records = True  # the recording's lost notices come as records, as the kernel's

    @staticmethod
    def split(key: int, span: bytes) -> tuple[list[Segment], int]:
        segments = getattr(span, "segments", None)
        return (list(segments) if segments is not None else []), 0


REPLAY_RECORDS = ReplayRecords()


def _chunks(recording: Recording, map: str | None) -> Iterator[tuple[int, int, _Span]]:
    """(ring key, recorded time in us, chunk) in stream order, for one map's rings."""
    pa = recording.pa
    import pyarrow.compute as pc

    for segment in recording.segments:
        first = recording.file_metadata(segment.samples).get("aperf.first_row", "0")
        if not first.isdigit():
            raise RecordingFormatError(segment.samples, f"aperf.first_row is {first!r}")
        row = int(first)
        losses = recording._read(segment.losses) if segment.losses else None
        notices: list[tuple[int, int, int, int, str | None]] = []
        if losses is not None and losses.num_rows:
            maps = losses.column(MAP).to_pylist() if MAP in losses.column_names else (
                [None] * losses.num_rows)
            times = pc.cast(losses.column(TIME), pa.int64()).to_pylist()
            notices = sorted(zip(losses.column(ROW).to_pylist(), range(losses.num_rows),
                                 losses.column(CPU).to_pylist(),
                                 losses.column(COUNT).to_pylist(), maps, times, strict=True))
        pending = [(r, key, count, m, t) for r, _, key, count, m, t in notices]  # type: ignore[misc]
        at = 0
        for batch in recording.batches(segment, [TIME, CPU, MAP, DATA]):
            rows = batch.num_rows
            keys = batch.column(CPU).to_numpy()
            times = pc.cast(batch.column(TIME), pa.int64()).to_numpy()
            maps = batch.column(MAP).to_pylist() if MAP in batch.schema.names else None
            data = batch.column(DATA)
            start = 0
            while start < rows:
                # The lost notices due before this row, then a run of rows of one ring.
                while at < len(pending) and pending[at][0] <= row + start:
                    _, key, count, m, when = pending[at]
                    at += 1
                    if m == map and count > 0:
                        yield key, when, _lost_span(count)
                stop = start + 1
                limit = min(rows, start + CHUNK_BYTES)  # rows; bytes are checked below
                next_notice = pending[at][0] - row if at < len(pending) else rows
                limit = min(limit, max(next_notice, start + 1))
                key = keys[start]
                while stop < limit and keys[stop] == key and (
                        maps is None or maps[stop] == maps[start]):
                    stop += 1
                if maps is None or maps[start] == map:
                    yield from _sample_spans(int(key), int(times[start]), data, start, stop)
                start = stop
            row += rows
        for _, key, count, m, when in pending[at:]:  # after the segment's last sample
            if m == map and count > 0:
                yield key, when, _lost_span(count)


def _lost_span(count: int) -> _Span:
    span = _Span()
    span.segments = [count]
    return span


def _sample_spans(key: int, when: int, data: Any, start: int, stop: int) -> Iterator[
        tuple[int, int, _Span]]:
    """Rows ``start`` to ``stop`` (one ring's) of a binary column, as chunks."""
    import numpy as np
    import pyarrow.compute as pc

    part = data.slice(start, stop - start)
    lengths = pc.binary_length(part).to_numpy()
    offsets = part.buffers()[1]
    first = int(np.frombuffer(offsets, np.int32, 1, part.offset * 4)[0])
    blob = part.buffers()[2]
    ends = np.cumsum(lengths)
    at = 0
    while at < len(lengths):
        base = int(ends[at] - lengths[at])
        # At most CHUNK_BYTES of samples (one sample at least).
        end = int(np.searchsorted(ends, base + CHUNK_BYTES, side="right"))
        end = max(end, at + 1)
        chunk = lengths[at:end]
        raw = bytes(memoryview(blob)[first + base: first + int(ends[end - 1])])
        span = _Span(raw)
        size = int(chunk[0])
        if len(chunk) > 1 and bool((chunk == size).all()):
            span.segments = [Run(span, 0, len(chunk), size, 0, size)]
        else:
            cuts = np.concatenate(([0], np.cumsum(chunk))).tolist()
            span.segments = [([raw[a:b] for a, b in itertools.pairwise(cuts)],
                              bool((chunk == size).all()))]
        yield key, when, span
        at = end


class _ReplayRing:
    """One recorded ring: ``take()`` hands over the published chunk if it is this ring's."""

    __slots__ = ("_player", "handle", "key")

    def __init__(self, player: ReplaySource, key: int, handle: int) -> None:
        self._player = player
        self.key = key
        self.handle = handle

    def take(self) -> bytes:
        return self._player._take(self.key)

    def pending_bytes(self) -> int:
        return self._player._pending(self.key)

    def lost_total(self) -> int | None:
        return None  # the recording's lost notices are the count


class ReplaySource:
    """A recording played back: a ring source for ``PerfStream`` and ``PerfBuffer``
    (``aperf.replay(path)`` makes one; docs/recording.md).

    The stream hands out the recorded samples and lost notices, in the recorded
    order, each ring under its recorded key, in every reading mode, on every loop,
    without root: as fast as the stream takes them (``speed=None``), or at the recorded
    pace times ``speed``. At the end of the recording the stream closes itself: its
    iteration ends after the last event, ``run()`` returns, and a ``PerfBuffer`` is
    closed once ``poll()`` handed out the last events (``while not pb.closed: pb.poll()``).

    ``decoder`` is the decoder the recording was made with, compiled from the layout
    it keeps: ``PerfStream(source, decoder=source.decoder)``. A stream whose decoder has
    another layout is refused with ``aperf.DecoderMismatchError`` naming both.
    """

    handle_kind: HandleKind = "fd"
    records: RecordFormat = REPLAY_RECORDS

    def __init__(self, path: str | os.PathLike[str] | Recording, *, speed: float | None = None,
                 map: str | None = None) -> None:
        if speed is not None and (isinstance(speed, bool) or not isinstance(
                speed, int | float) or not speed > 0):
            raise ValueError(f"speed must be None (as fast as possible) or a positive number, "
                             f"not {speed!r}")
        self.recording = path if isinstance(path, Recording) else Recording(path)
        maps = self.recording.maps
        if maps is not None and map not in maps:
            raise ValueError(f"this recording holds several maps ({', '.join(maps)}): "
                             "replay one with map=NAME")
        if maps is None and map is not None:
            raise ValueError(f"map={map!r}: this recording is of a stream of one map")
        self.map = map
        self.speed = speed
        self.name = f"replay of {self.recording.path}" + (f" ({map})" if map else "")
        # A SizedDecoder, or None (recorded without one); typed Any so that
        # PerfStream(source, decoder=source.decoder) type-checks whichever it is.
        self.decoder: Any = self.recording.decoder
        self._recorded = json.loads(self.recording.metadata.get("aperf.decoder", "null"))
        keys = sorted({k for m, k in self.recording.rings if m == map})
        if not keys:  # a recording made without its rings listed: the keys its rows have
            table = self.recording.samples([CPU])
            keys = sorted(set(table.column(CPU).to_pylist()) | set(
                self.recording.losses().column(CPU).to_pylist())) or [0]
        self.keys = keys
        self._lock = threading.Lock()
        self._event = -1
        self._end = -1
        self._chunks: Iterator[tuple[int, int, _Span]] | None = None
        self._published: tuple[int, int, _Span] | None = None
        self.finished = False
        self._pacer: threading.Thread | None = None
        self._stop = threading.Event()
        self._taken = threading.Event()  # paced: the published chunk was taken
        self._failure: RecordingFormatError | None = None  # a damaged file, met while playing

    # --- the ring source protocol ----------------------------------------------------

    @property
    def notices(self) -> list[int]:
        """The end notice: signalled when the last chunk was taken."""
        return [self._end] if self._end >= 0 else []

    @property
    def ring_bytes(self) -> int:
        """The most bytes of samples one ring hands over at a time (a chunk)."""
        return CHUNK_BYTES

    @property
    def memory_bytes(self) -> int:
        """The samples held at a time: one chunk (the files are read as it plays)."""
        return CHUNK_BYTES

    def open(self, config: RingConfig) -> Sequence[_ReplayRing]:
        """The recorded rings (the RingSource protocol; streams call it). A replay plays
        once: open a new one to play it again."""
        with self._lock:
            if self._event >= 0:
                raise BusyResourceError(f"{self.name} is already open")
            if self._chunks is not None:
                raise BusyResourceError(f"{self.name} was played already: make a new one")
            flags = os.EFD_NONBLOCK | os.EFD_CLOEXEC
            self._event = os.eventfd(0, flags)
            self._end = os.eventfd(0, flags)
            self._chunks = _chunks(self.recording, self.map)
            rings = [_ReplayRing(self, key, self._event) for key in self.keys]
        if self.speed is None:
            with self._lock:
                self._publish_next()
        else:
            self._pacer = threading.Thread(target=self._pace, name="aperf-replay", daemon=True)
            self._pacer.start()
        return rings

    def acknowledge(self, handle: int) -> None:
        """Clear a handle's readiness (the RingSource protocol); the end notice ends the
        source (the stream then closes once it handed out what it holds)."""
        for fd in (self._event, self._end):
            if handle == fd:
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(fd)
        if handle == self._end and handle >= 0:
            raise SourceEnded(self._failure, drain=True)

    def free(self) -> None:
        """Stop playing and close the handles (the RingSource protocol; idempotent)."""
        self._stop.set()
        pacer = self._pacer
        if pacer is not None and pacer is not threading.current_thread():
            pacer.join()
        with self._lock:
            for fd in (self._event, self._end):
                if fd >= 0:
                    os.close(fd)
            self._event = self._end = -1
            self._published = None

    def after_fork(self) -> None:
        """In a child that inherited the open source: close its copies of the handles."""
        self._stop.set()
        self._lock = threading.Lock()  # one held by another thread stays held in the child
        for fd in (self._event, self._end):
            if fd >= 0:
                os.close(fd)
        self._event = self._end = -1

    def check_decoder(self, decoder: object) -> None:
        """``DecoderMismatchError`` if a stream's ``decoder`` is not the recording's: one
        with another layout (a plain callable or None are not checked: they get the
        recorded bytes)."""
        if not isinstance(decoder, SizedDecoder) or decoder.layout is None:
            return
        recorded = self._recorded
        if recorded is None:
            raise DecoderMismatchError("none (raw samples)", repr(decoder))
        try:
            differs = same_decoding(recorded, decoder)
        except (TypeError, ValueError, AttributeError) as exc:  # a damaged recording
            raise RecordingFormatError(self.recording.path, f"its decoder: {exc}") from None
        if differs is not None:
            raise DecoderMismatchError(repr(self.decoder) if self.decoder else str(
                recorded.get("name")), repr(decoder), differs)

    # --- playing -----------------------------------------------------------------------

    def _publish_next(self) -> None:  # under self._lock
        chunks = self._chunks
        if chunks is None or self._event < 0:
            return
        self._published = self._next_chunk(chunks)
        if self._published is not None:
            os.eventfd_write(self._event, 1)
        else:
            self._finish()

    def _next_chunk(self, chunks: Iterator[tuple[int, int, _Span]]) -> tuple[
            int, int, _Span] | None:
        """The next chunk, or None at the end (or at a fault in the files: the stream then
        raises it, where it is)."""
        try:
            chunk = next(chunks, None)
        except RecordingFormatError as exc:
            self._failure = exc
            return None
        if chunk is not None and chunk[0] not in self.keys:
            self._failure = RecordingFormatError(
                self.recording.path, f"a sample of ring {chunk[0]}, which the recording does "
                f"not list (its rings: {self.keys})")
            return None
        return chunk

    def _finish(self) -> None:  # under self._lock
        if not self.finished and self._end >= 0:
            self.finished = True
            os.eventfd_write(self._end, 1)

    def _take(self, key: int) -> bytes:
        with self._lock:
            published = self._published
            if published is None or published[0] != key:
                return b""
            self._published = None
            if self.speed is None:
                self._publish_next()
            else:
                self._taken.set()
            return published[2]

    def _pending(self, key: int) -> int:
        published = self._published
        return len(published[2]) if published is not None and published[0] == key else 0

    def _pace(self) -> None:
        """Publish each chunk at its recorded time, scaled, once the last was taken."""
        taken = self._taken
        speed = self.speed
        assert speed is not None
        first: int | None = None
        started = 0.0
        while not self._stop.is_set():
            with self._lock:
                chunks = self._chunks
                item = None if chunks is None else self._next_chunk(chunks)
                if item is None:
                    self._finish()
                    return
            if first is None:
                first, started = item[1], time.monotonic()
            due = started + (item[1] - first) / 1e6 / speed
            if self._stop.wait(max(0.0, due - time.monotonic())):
                return
            with self._lock:
                if self._event < 0:
                    return
                taken.clear()
                self._published = item
                os.eventfd_write(self._event, 1)
            while not taken.wait(0.05):
                if self._stop.is_set():
                    return

    def __repr__(self) -> str:
        return f"<aperf.ReplaySource {self.name!r}>"


def replay(path: str | os.PathLike[str] | Recording, *, speed: float | None = None,
           map: str | None = None) -> ReplaySource:
    """A recording (a directory ``aperf.record`` or ``aperf.Recorder`` wrote) as a ring
    source: ``PerfStream(aperf.replay(path), decoder=...)`` reads it back as the live
    stream was read. ``speed``: None, as fast as the stream takes it; else the recorded
    pace times ``speed``. ``map``: the map to replay, of a recording of several maps.
    See ``aperf.ReplaySource``."""
    return ReplaySource(path, speed=speed, map=map)

