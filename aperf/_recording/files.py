"""A recording's directory: the files' names, what each says about itself, and
``aperf.Recording``, which reads them back.

A recording is a directory of segments. Segment N is two Parquet files:
``samples-N.parquet`` (a row per sample, in stream order) and ``losses-N.parquet``
(a row per lost notice: when it came, its ring and map, how many, and before which
sample row). A segment is written under ``*.parquet.partial`` names and renamed once
complete (losses first, then samples), so that ``*.parquet`` only ever matches closed
files: any of them can be read while recording goes on, and a crash leaves at most the
segment being written incomplete (its ``.partial`` files), the others intact.

Every file carries the recording's metadata in its Parquet key-value metadata
(``aperf.*`` keys: host, kernel, aperf version, the decoder's C layout as JSON, the
offsets of the boot-time and monotonic clocks to the wall clock...), so each file can
be read on its own.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .._arrow.schema import CPU, MAP, TIME, require_pyarrow
from .._decoding.decode import SizedDecoder
from .._errors import RecordingError, RecordingFormatError
from .layouts import decoder_from_json

FORMAT = "1"
SAMPLES = "samples"
LOSSES = "losses"
PARTIAL = ".partial"
_NAME = re.compile(r"^(samples|losses)-(\d{6,12})\.parquet$")
COUNT = "count"  # samples dropped (a losses column)
ROW = "_row"  # the sample row a lost notice comes before, counted across the recording
CAUSE = "cause"  # "ring": the producer dropped them; "recorder": they could not be written
MAX_METADATA = 1 << 20  # bytes of aperf.* metadata a reader accepts per file


def segment_name(kind: str, number: int) -> str:
    return f"{kind}-{number:06d}.parquet"


def loss_schema(pa: Any, *, maps: bool) -> Any:
    fields = [pa.field(TIME, pa.timestamp("us", tz="UTC"), nullable=False),
              pa.field(CPU, pa.int32(), nullable=False)]
    if maps:
        fields.append(pa.field(MAP, pa.string()))
    fields += [pa.field(COUNT, pa.int64(), nullable=False),
               pa.field(ROW, pa.int64(), nullable=False),
               pa.field(CAUSE, pa.string(), nullable=False)]
    return pa.schema(fields)


# --- the directory, as a root process writing into it -----------------------------


def prepare_directory(path: str) -> None:
    """Make the recording's directory (mode 0o750), or check an existing one: a
    directory owned by this user that no one else may write to (aperf runs as root: a
    directory others can write to would let them swap files under it), holding no
    recording yet."""
    try:
        os.makedirs(path, mode=0o750, exist_ok=True)
        info = os.lstat(path)
    except OSError as exc:
        raise RecordingError(exc.errno or errno.EIO, exc.strerror or str(exc), path) from None
    if not stat.S_ISDIR(info.st_mode):
        raise RecordingError(errno.ENOTDIR, "not a directory", path)
    if info.st_uid != os.geteuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise RecordingError(
            errno.EPERM, "another user owns it or may write to it", path,
            "record into a directory of this user's that no one else can write to")
    if any(_NAME.match(name.removesuffix(PARTIAL)) for name in os.listdir(path)):
        raise RecordingError(errno.EEXIST, "it already holds a recording", path,
                             "record into a new or empty directory")


def open_new(path: str) -> Any:
    """A new file for writing, never one that existed (nor a symlink planted there)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(
        os, "O_CLOEXEC", 0)
    return os.fdopen(os.open(path, flags, 0o640), "wb")


# --- reading ---------------------------------------------------------------------


@dataclass(frozen=True)
class Segment:
    """One closed segment of a recording: its number and its two files."""

    number: int
    samples: str
    losses: str | None


class Recording:
    """A recording's directory, read back (``aperf.record`` and ``aperf.Recorder`` write
    one; docs/recording.md).

    ``segments`` are the closed segments, in order (the one being written, and one a
    crash left incomplete, are in ``partial``); ``metadata`` is what the first file
    says (``aperf.*`` keys); ``decoder`` the decoder the samples were recorded with,
    compiled again from the C layout the files keep (None: recorded without one);
    ``samples()`` and ``losses()`` are pyarrow Tables of every closed file;
    ``boot_offset_ns`` turns ``bpf_ktime_get_boot_ns()`` timestamps into wall-clock
    nanoseconds. A file that is not an aperf recording, or is damaged, raises
    ``aperf.RecordingFormatError`` naming it.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.pa = require_pyarrow("aperf.Recording")
        import pyarrow.parquet as pq

        self._pq = pq
        self.path = os.fspath(path)
        try:
            names = sorted(os.listdir(self.path))
        except OSError as exc:
            raise RecordingError(exc.errno or errno.EIO, exc.strerror or str(exc),
                                 self.path) from None
        found: dict[int, dict[str, str]] = {}
        self.partial = [os.path.join(self.path, n) for n in names if n.endswith(PARTIAL)]
        for name in names:
            match = _NAME.match(name)
            if match:
                found.setdefault(int(match.group(2)), {})[match.group(1)] = os.path.join(
                    self.path, name)
        self.segments = [Segment(number, files[SAMPLES], files.get(LOSSES))
                         for number, files in sorted(found.items()) if SAMPLES in files]
        if not self.segments:
            raise RecordingFormatError(self.path, "no closed segment (samples-*.parquet) here")
        self.metadata = self.file_metadata(self.segments[0].samples)
        self.decoder = self._decoder(self.segments[0].samples, self.metadata)

    def file_metadata(self, path: str) -> dict[str, str]:
        """The ``aperf.*`` metadata of one file (checked: it is an aperf recording)."""
        try:
            raw = self._pq.read_schema(path).metadata or {}
        except (OSError, self.pa.ArrowException) as exc:
            raise RecordingFormatError(path, f"not a readable Parquet file ({exc})") from None
        out: dict[str, str] = {}
        size = 0
        for key, value in raw.items():
            if key.startswith(b"aperf."):
                size += len(key) + len(value)
                if size > MAX_METADATA:
                    raise RecordingFormatError(path, "its aperf metadata is too large")
                out[key.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
        if out.get("aperf.format") != FORMAT:
            raise RecordingFormatError(path, "not an aperf recording file (format "
                                             f"{out.get('aperf.format')!r}, expected {FORMAT})")
        return out

    @staticmethod
    def _decoder(path: str, metadata: dict[str, str]) -> SizedDecoder | None:
        text = metadata.get("aperf.decoder", "null")
        try:
            value = json.loads(text)
            return None if value is None else decoder_from_json(value)
        except (ValueError, TypeError, RecursionError) as exc:
            raise RecordingFormatError(path, f"its decoder cannot be read: {exc}") from None

    def _int(self, key: str) -> int | None:
        text = self.metadata.get(key)
        try:
            return None if text is None or text == "" else int(text)
        except ValueError:
            raise RecordingFormatError(self.segments[0].samples,
                                       f"{key} is not an integer") from None

    @property
    def boot_offset_ns(self) -> int | None:
        """The wall clock minus CLOCK_BOOTTIME when recording started (ns)."""
        return self._int("aperf.boot_offset_ns")

    @property
    def monotonic_offset_ns(self) -> int | None:
        """The wall clock minus CLOCK_MONOTONIC when recording started (ns)."""
        return self._int("aperf.monotonic_offset_ns")

    @property
    def maps(self) -> list[str] | None:
        """The maps of a stream of several maps (None: one map)."""
        value = json.loads(self.metadata.get("aperf.maps", "null"))
        return value if isinstance(value, list) else None

    @property
    def rings(self) -> list[tuple[str | None, int]]:
        """The (map, key) of every ring the recorded stream had."""
        try:
            value = json.loads(self.metadata.get("aperf.rings", "[]"))
            return [(None if m is None else str(m), int(k)) for m, k in value]
        except (ValueError, TypeError) as exc:
            raise RecordingFormatError(self.segments[0].samples,
                                       f"aperf.rings cannot be read: {exc}") from None

    def _read(self, path: str, columns: list[str] | None = None) -> Any:
        try:
            return self._pq.read_table(path, columns=columns)
        except (OSError, self.pa.ArrowException) as exc:
            raise RecordingFormatError(path, f"cannot be read ({exc})") from None

    def samples(self, columns: list[str] | None = None) -> Any:
        """Every sample of the closed segments, in order, as one pyarrow Table."""
        return self.pa.concat_tables([self._read(s.samples, columns) for s in self.segments])

    def losses(self) -> Any:
        """Every lost notice of the closed segments, in order, as one pyarrow Table."""
        tables = [self._read(s.losses) for s in self.segments if s.losses is not None]
        if not tables:
            return loss_schema(self.pa, maps=self.maps is not None).empty_table()
        return self.pa.concat_tables(tables)

    def batches(self, segment: Segment, columns: list[str] | None = None) -> Iterator[Any]:
        """The record batches of one segment's samples file, a row group at a time (of
        these ``columns``, or all)."""
        try:
            reader = self._pq.ParquetFile(segment.samples)
            names = reader.schema_arrow.names
            yield from reader.iter_batches(
                columns=None if columns is None else [c for c in columns if c in names])
        except (OSError, self.pa.ArrowException) as exc:
            raise RecordingFormatError(segment.samples, f"cannot be read ({exc})") from None

    def __repr__(self) -> str:
        return f"<aperf.Recording {self.path!r}: {len(self.segments)} segments>"
