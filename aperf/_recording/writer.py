"""``aperf.Recorder``: a stream's items written to Parquet segments (``files.py``).

Items come in stream order (arrays, events, lost notices) and go out in the same
order: samples as rows of ``samples-N.parquet``, row groups of about
``row_group_bytes``; lost notices as rows of ``losses-N.parquet`` that say before which
sample row they came. A segment is closed (and a new one begun) once its samples file
reaches ``max_file_bytes`` or it is ``max_file_seconds`` old.

Nothing is lost silently: a segment that cannot be written (the disk is full, a
permission) is abandoned (its partial files removed), the samples it held are counted
(``statistics().unwritten``) and written down, per ring and map, as lost notices of
cause ``"recorder"`` at the start of the next segment, which also keeps the
segment's own lost notices; ``on_write_error="raise"`` (the default) then raises
``aperf.RecordingError`` naming the file and the cause, ``"count"`` goes on.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import platform
import socket
import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from .._arrow.builder import ArrowBuilder, sized_decoder
from .._arrow.columns import Tabler
from .._arrow.schema import CPU, DATA, ENUM_KEY, LATE, MAP, TIME
from .._boottime import boot_offset_ns, boottime_ns, monotonic_offset_ns
from .._errors import RecordingError
from .._events import BadSample, Lost, Sample, SampleArray
from .files import (
    FORMAT,
    LOSSES,
    PARTIAL,
    SAMPLES,
    loss_schema,
    open_new,
    prepare_directory,
    segment_name,
)
from .layouts import decoder_json

DEFAULT_FILE_BYTES = 64 << 20
DEFAULT_FILE_SECONDS = 60.0
DEFAULT_ROW_GROUP_BYTES = 8 << 20
WriteErrorPolicy = Literal["raise", "count"]


@dataclass(frozen=True)
class RecorderStatistics:
    """What a recorder wrote: closed ``files`` (segments), the sample ``rows`` and the
    ``lost`` samples (the kernel's lost notices) they hold, and their ``bytes``;
    ``unwritten`` samples it could not write (counted, and noted in the recording as
    losses of cause ``"recorder"``) after ``errors`` write failures, the last one
    ``last_error``."""

    files: int
    rows: int
    lost: int
    bytes: int
    unwritten: int
    errors: int
    last_error: str | None


class _Segment:
    """The segment being written: its file, writer and what it holds so far."""

    def __init__(self, number: int, first_row: int, opened_ns: int) -> None:
        self.number = number
        self.first_row = first_row
        self.opened_ns = opened_ns
        self.file: Any = None
        self.writer: Any = None
        self.rows = 0  # rows written to the file or pending
        self.losses: list[tuple[int, int, str | None, int, int, str]] = []
        self.keys: Counter[tuple[int, str | None]] = Counter()  # rows per ring, map


class Recorder:
    """Writes a stream's items to a recording's directory (docs/recording.md).

    ```python
    import struct
    import tempfile

    import aperf

    with tempfile.TemporaryDirectory() as tmp, aperf.Recorder(
            f"{tmp}/rec", struct.Struct("<QQ")) as recorder:
        recorder.write(aperf.Sample(0, struct.pack("<QQ", 1, 2)))
        recorder.write(aperf.Lost(0, 5))
    ```

    ``write(item)`` takes what a stream hands out, in stream order: an
    ``aperf.SampleArray`` (``arrays()``, ``run_arrays()``, ``PerfBuffer(on_array=)``, a
    lease: converted at once, so that nothing of the lease is kept), an
    ``aperf.Sample`` or ``aperf.BadSample``, an ``aperf.Lost``, or a list of them (a
    batch). ``aperf.record(stream, directory)`` does that for a whole stream.

    ``decoder`` is the stream's (a ctypes structure, a ``struct.Struct``, a decoder
    with a layout; None: the samples' bytes only); ``maps`` the names of a stream of
    several maps that share it; ``rings`` the (map, key) of each ring of the stream,
    kept for replays. The directory is made (mode 0o750) or must be this user's,
    writable by no one else, and hold no recording. Closing writes what is held.
    """

    def __init__(
        self, directory: str | os.PathLike[str], decoder: object = None, *,
        maps: Sequence[str] | None = None, rings: Iterable[tuple[str | None, int]] = (),
        source: str = "", max_file_bytes: int = DEFAULT_FILE_BYTES,
        max_file_seconds: float = DEFAULT_FILE_SECONDS,
        row_group_bytes: int = DEFAULT_ROW_GROUP_BYTES, compression: str = "snappy",
        on_write_error: WriteErrorPolicy = "raise",
    ) -> None:
        for name, value in (("max_file_bytes", max_file_bytes),
                            ("row_group_bytes", row_group_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int of at least 1, not {value!r}")
        if isinstance(max_file_seconds, bool) or not isinstance(
                max_file_seconds, int | float) or not max_file_seconds > 0:
            raise ValueError(f"max_file_seconds must be a positive number, not "
                             f"{max_file_seconds!r}")
        if on_write_error not in ("raise", "count"):
            raise ValueError(f"on_write_error must be 'raise' or 'count', not "
                             f"{on_write_error!r}")
        self.decoder = sized_decoder(decoder, "Recorder")
        self._builder = ArrowBuilder(self.decoder, raw=True, maps=maps is not None)
        self._tabler = Tabler(self.decoder, maps=maps is not None, raw=True, time=True,
                              what="aperf.Recorder")
        self.pa = pa = self._tabler.pa
        import pyarrow.parquet as pq

        self._pq = pq
        self.schema = self._tabler.schema
        # Dictionaries only where values repeat (the stream's columns, strings, enums: a
        # dictionary tried on every column cost a fifth more time, measured), and min/max
        # statistics on every column but the samples' bytes (row groups a query can skip).
        types = pa.types
        self._encoding = {
            "use_dictionary": [f.name for f in self.schema if f.name in (
                CPU, MAP, LATE) or types.is_string(f.type) or (f.metadata and ENUM_KEY in (
                    f.metadata))],
            "write_statistics": [f.name for f in self.schema if f.name != DATA],
        }
        self._loss_schema = loss_schema(pa, maps=maps is not None)
        self.directory = os.fspath(directory)
        prepare_directory(self.directory)
        self.maps = list(maps) if maps is not None else None
        self.max_file_bytes = max_file_bytes
        self.max_file_ns = int(max_file_seconds * 1e9)
        self.row_group_bytes = row_group_bytes
        self.compression = compression
        self.on_write_error = on_write_error
        offset = boot_offset_ns()
        self._boot_offset = 0 if offset is None else offset
        self._metadata = {
            "aperf.format": FORMAT,
            "aperf.version": _version(),
            "aperf.host": socket.gethostname(),
            "aperf.kernel": " ".join(platform.uname()[2:4]),
            "aperf.source": source,
            "aperf.decoder": json.dumps(
                decoder_json(self.decoder) if self.decoder is not None and (
                    self._tabler.layout is not None) else None),
            "aperf.maps": json.dumps(self.maps),
            "aperf.rings": json.dumps(sorted(rings, key=lambda r: (r[0] or "", r[1]))),
            "aperf.boot_offset_ns": str(self._boot_offset),
            "aperf.monotonic_offset_ns": str(monotonic_offset_ns()),
        }
        self._lock = threading.RLock()
        self._segment: _Segment | None = None
        self._pending: list[Any] = []
        self._pending_bytes = 0
        self._next_number = 1
        self._rows = 0  # sample rows in the recording so far (closed and being written)
        self._carry: list[tuple[int, int, str | None, int, int, str]] = []  # for the next
        self._closed = False
        self._stats = {"files": 0, "rows": 0, "lost": 0, "bytes": 0, "unwritten": 0,
                       "errors": 0}
        self._last_error: str | None = None
        self._event_times: list[int] = []  # when each event the builder holds came (us)

    # --- taking items --------------------------------------------------------------

    def now_ns(self) -> int:
        """The wall clock, as the recording counts it (CLOCK_BOOTTIME plus the offset
        measured when it started: never steps back within a recording)."""
        return boottime_ns() + self._boot_offset

    def write(self, item: Any) -> None:
        """Take one item (or a list of items) of the stream, in stream order."""
        with self._lock:
            if self._closed:
                raise ValueError("this Recorder is closed")
            for one in item if isinstance(item, list) else (item,):
                self._take(one)
                self._maybe_flush()  # a large batch fills row groups and segments too

    __call__ = write  # a recorder is a callback too: PerfBuffer(on_array=recorder, ...)

    def _take(self, item: Any) -> None:
        if item.__class__ is SampleArray or isinstance(item, SampleArray):
            self._flush_events()
            columns = item._columns
            if columns is None:
                raise TypeError("Recorder.write: this SampleArray was not made by a stream")
            batch = columns.to_arrow(item, raw=True, time_ns=self.now_ns())
            if not batch.schema.equals(self.schema):
                raise TypeError("Recorder.write: this array's decoder is not the recorder's "
                                f"({columns.decoder!r} against {self.decoder!r})")
            self._add(batch)
        elif isinstance(item, Sample | BadSample):
            self._segment_now()
            self._event_times.append(self.now_ns() // 1000)
            self._rows += 1
            self._add_keys(((item.cpu, item.map),))
            batch = self._builder.add(item)
            if batch is not None:
                self._add_events(batch)
        elif isinstance(item, Lost):
            self._flush_events()  # the samples before it, stamped before it
            segment = self._segment_now()
            segment.losses.append((self.now_ns(), item.cpu, item.map, item.count, self._rows,
                                   "ring"))
        else:
            raise TypeError(f"Recorder.write takes SampleArray, Sample, BadSample and Lost "
                            f"items, not {type(item).__name__}")

    def _add(self, batch: Any) -> None:
        """A batch of sample rows (counted in the segment where it goes)."""
        self._segment_now()
        rows = batch.num_rows
        self._rows += rows
        np = self._tabler.np
        cpus = batch.column(CPU).to_numpy()
        maps = batch.column(MAP).to_pylist() if self.maps is not None else None
        if maps is None:
            keys, counts = np.unique(cpus, return_counts=True)
            self._add_keys_counted(((int(k), None) for k in keys), (int(c) for c in counts))
        else:
            self._add_keys(zip(cpus.tolist(), maps, strict=True))
        self._pending.append(batch)
        self._pending_bytes += batch.nbytes

    def _add_keys_counted(self, keys: Iterable[tuple[int, str | None]],
                          counts: Iterable[int]) -> None:
        assert self._segment is not None
        self._segment.keys.update(dict(zip(keys, counts, strict=True)))

    def _add_keys(self, keys: Iterable[tuple[int, str | None]]) -> None:
        assert self._segment is not None
        self._segment.keys.update(keys)

    def _add_events(self, batch: Any) -> None:
        """A batch of the builder's rows (already counted), with their receive time."""
        pa = self.pa
        np = self._tabler.np
        times, self._event_times = self._event_times, []
        micros = np.array(times[: batch.num_rows], np.int64)
        self._event_times = times[batch.num_rows:]
        stamp = pa.Array.from_buffers(self.schema.field(0).type, batch.num_rows,
                                      [None, pa.py_buffer(micros)])
        self._pending.append(batch.add_column(0, self.schema.field(0), stamp))
        self._pending_bytes += batch.nbytes

    def _flush_events(self) -> None:
        batch = self._builder.flush()
        if batch is not None:
            self._add_events(batch)

    # --- segments ------------------------------------------------------------------

    def _segment_now(self) -> _Segment:
        """The segment being written (begun now if there is none)."""
        segment = self._segment
        if segment is None:
            segment = self._segment = _Segment(self._next_number, self._rows,
                                               self.now_ns())
            self._next_number += 1
            segment.losses.extend(self._carry)
            self._carry = []
        return segment

    def _maybe_flush(self) -> None:
        segment = self._segment
        if segment is None:
            return
        if self._pending_bytes + self._builder.nbytes >= self.row_group_bytes:
            self._guard(self._write_group)
        segment = self._segment
        if segment is not None and (
                self.now_ns() - segment.opened_ns >= self.max_file_ns or (
                segment.file is not None and segment.file.tell() >= self.max_file_bytes)):
            self._guard(self._close_segment)

    def tick(self) -> None:
        """Close the segment if it is ``max_file_seconds`` old (a stream with nothing to
        write for a while calls this to keep the time rotation)."""
        with self._lock:
            segment = self._segment
            if segment is not None and self.now_ns() - segment.opened_ns >= self.max_file_ns:
                self._flush_events()
                self._guard(self._close_segment)

    def rotate(self) -> None:
        """Close the segment being written now (what it holds is then readable)."""
        with self._lock:
            if self._segment is not None:
                self._flush_events()
                self._guard(self._close_segment)

    def _path(self, kind: str, segment: _Segment) -> str:
        return os.path.join(self.directory, segment_name(kind, segment.number))

    def _open_file(self, segment: _Segment) -> None:
        metadata = dict(self._metadata, **{"aperf.segment": str(segment.number),
                                            "aperf.first_row": str(segment.first_row)})
        segment.file = open_new(self._path(SAMPLES, segment) + PARTIAL)
        segment.writer = self._pq.ParquetWriter(
            segment.file, self.schema.with_metadata(metadata), compression=self.compression,
            **self._encoding)

    def _write_group(self) -> None:
        """The pending batches as one row group of the segment's samples file."""
        segment = self._segment
        assert segment is not None
        self._flush_events()
        if segment.writer is None:
            self._open_file(segment)
        if self._pending:
            table = self.pa.Table.from_batches(self._pending, schema=self.schema)
            segment.writer.write_table(table, row_group_size=table.num_rows)
        self._pending.clear()
        self._pending_bytes = 0
        segment.rows = self._rows - segment.first_row

    def _close_segment(self) -> None:
        """Write what the segment holds, its losses file, then close and rename both."""
        segment = self._segment
        assert segment is not None
        self._write_group()
        pa = self.pa
        metadata = dict(self._metadata, **{"aperf.segment": str(segment.number),
                                            "aperf.first_row": str(segment.first_row)})
        losses = pa.table(self._loss_columns(segment.losses),
                          schema=self._loss_schema.with_metadata(metadata))
        loss_path = self._path(LOSSES, segment)
        with open_new(loss_path + PARTIAL) as out:
            self._pq.write_table(losses, out, compression=self.compression)
            out.flush()
            os.fsync(out.fileno())
        lost = sum(row[3] for row in segment.losses if row[5] == "ring")
        segment.writer.add_key_value_metadata({
            "aperf.rows": str(segment.rows), "aperf.lost": str(lost),
            "aperf.closed_ns": str(self.now_ns())})
        segment.writer.close()
        segment.file.flush()
        os.fsync(segment.file.fileno())
        size = segment.file.tell()
        segment.file.close()
        os.replace(loss_path + PARTIAL, loss_path)  # the losses first: see files.py
        os.replace(self._path(SAMPLES, segment) + PARTIAL, self._path(SAMPLES, segment))
        self._segment = None
        stats = self._stats
        stats["files"] += 1
        stats["rows"] += segment.rows
        stats["lost"] += lost
        stats["bytes"] += size

    def _loss_columns(self, rows: list[tuple[int, int, str | None, int, int, str]]) -> dict[
            str, Any]:
        times, cpus, maps, counts, at, causes = (list(c) for c in zip(*rows, strict=True)) if (
            rows) else ([], [], [], [], [], [])
        columns = {TIME: [t // 1000 for t in times], CPU: cpus}  # the column keeps us
        if self.maps is not None:
            columns[MAP] = maps
        columns.update({"count": counts, "_row": at, "cause": causes})
        return columns

    # --- failures ------------------------------------------------------------------

    def _guard(self, step: Any) -> None:
        try:
            step()
        except OSError as exc:
            self._abandon(exc)

    def _abandon(self, exc: OSError) -> None:
        """A segment that cannot be written: remove its partial files, count its samples
        and note them, per ring and map, as losses at the start of the next segment,
        which keeps the segment's own lost notices too; then raise or go on."""
        segment = self._segment
        assert segment is not None
        self._segment = None
        for closing in (segment.writer, segment.file):
            if closing is not None:
                with contextlib.suppress(Exception):
                    closing.close()
        for kind in (SAMPLES, LOSSES):
            with contextlib.suppress(OSError):
                os.unlink(self._path(kind, segment) + PARTIAL)
        self._pending.clear()
        self._pending_bytes = 0
        self._builder.flush()  # its rows were counted in the segment
        self._event_times = []
        unwritten = self._rows - segment.first_row
        self._rows = segment.first_row  # the recording's rows go on from here
        now = self.now_ns()
        self._carry = [(now, cpu, map_, count, self._rows, "recorder")
                       for (cpu, map_), count in sorted(segment.keys.items(),
                                                        key=lambda kv: (kv[0][1] or "", kv[0][0]))]
        self._carry += [(t, c, m, n, self._rows, cause) for t, c, m, n, _, cause in
                        segment.losses]
        code = exc.errno or _errno_of(exc)
        error = RecordingError(
            code, os.strerror(code) if code else str(exc), self._path(SAMPLES, segment),
            f"segment {segment.number} abandoned: its {unwritten} samples are counted as "
            "lost (cause 'recorder') in the next segment")
        self._stats["unwritten"] += unwritten
        self._stats["errors"] += 1
        self._last_error = str(error)
        if self.on_write_error == "raise":
            raise error from exc

    # --- the end -------------------------------------------------------------------

    def statistics(self) -> RecorderStatistics:
        """What was written so far (closed files), and what could not be."""
        with self._lock:
            return RecorderStatistics(last_error=self._last_error, **self._stats)

    def close(self) -> None:
        """Write what is held and close the segment (idempotent). A recording that got
        nothing still gets one (empty) segment, so that it can be read back."""
        with self._lock:
            if self._closed:
                return
            self._flush_events()
            if self._segment is None and (self._carry or not self._stats["files"]):
                self._segment_now()
            self._closed = True
            if self._segment is not None:
                self._guard(self._close_segment)

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        try:
            self.close()
        except RecordingError:
            if kind is None:
                raise
            # The error in flight goes on; this one is counted (statistics().errors).


def _errno_of(exc: OSError) -> int:
    """pyarrow's IOError says the errno in its text ("[errno 28] ..."), not in errno."""
    text = str(exc)
    marker = text.find("errno ")
    if marker >= 0:
        digits = text[marker + 6:].split("]", 1)[0].strip()
        if digits.isdigit():
            return int(digits)
    return errno.EIO


def _version() -> str:
    """aperf's version, as installed (``aperf.__version__``, which this floor cannot import)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("aperf-bpf")
    except PackageNotFoundError:
        return "unknown"
