"""NumPy columns and raw samples as ``pyarrow.RecordBatch``es, for one decoder.

A sample's fields sit side by side in the ring (a row per record); Arrow keeps each
field in a buffer of its own. So each fixed-width column is gathered once, at C speed
(``numpy.ascontiguousarray`` of the strided field: the only copy), and that NumPy
array *is* the Arrow buffer (``pyarrow.py_buffer``, no second copy; a column that is
already contiguous and native is not copied at all). Strings, bools and byte runs are
built from NumPy too: no Python code runs per sample, except for the rows of a
``char[N]`` that is not valid UTF-8 (decoded with replacement, as records are).

Nothing built here views ring memory: every column of a record in a ring is strided
(the record header sits between two rows), so it is gathered into memory of its own,
and the lease rule (what a lease views is copied before the lease ends) holds for
every batch made from a lease.
"""

from __future__ import annotations

from typing import Any

from .._decoding.decode import SizedDecoder, require_numpy
from .._decoding.layout import (
    ArrayType,
    CType,
    EnumType,
    FloatType,
    IntType,
    PointerType,
    RecordType,
    is_byte,
)
from .schema import (
    DATA,
    TIME,
    arrow_field,
    arrow_type,
    decoded_fields,
    layout_fields,
    require_pyarrow,
    stream_fields,
)

_INT32_MAX = (1 << 31) - 1


class Tabler:
    """Record batches of one decoder's samples: the stream's columns (``_cpu``, ``_map``
    with several maps, ``_host`` and ``_stream`` for fleet events, ``_late``), the
    decoder's fields, its tail (a flexible array member) and, for a recording, the
    receive time (``_time``, first) and the raw sample (``_data``, last).

    ``decoder`` None, or one without a layout: no decoded columns (``raw`` then holds
    the samples)."""

    def __init__(self, decoder: object, *, maps: bool = False, fleet: bool = False,
                 raw: bool = False, time: bool = False, what: str = "Arrow batches") -> None:
        self.pa = pa = require_pyarrow(what)
        self.np = require_numpy(what)
        layout = decoder.layout if isinstance(decoder, SizedDecoder) else None
        self.decoder = decoder if layout is not None else None
        self.layout: RecordType | None = layout
        self.tail = decoder.tail if isinstance(decoder, SizedDecoder) and layout else None
        self.members = decoded_fields(layout) if layout is not None else []
        self.maps, self.fleet, self.raw, self.time = maps, fleet, raw, time
        fields = [pa.field(TIME, pa.timestamp("us", tz="UTC"), nullable=False)] if time else []
        fields += stream_fields(pa, maps=maps, fleet=fleet)
        self.first_decoded = len(fields)
        if layout is not None:
            fields += layout_fields(pa, layout, self.tail)
        if raw:
            fields.append(pa.field(DATA, pa.binary(), nullable=False))
        self.schema = pa.schema(fields)
        self._decoded_fields = fields[self.first_decoded: len(fields) - (1 if raw else 0)]

    # --- the decoder's columns -----------------------------------------------------

    def decoded(self, values: Any, tails: Any = None) -> list[Any]:
        """The decoded columns of a structured array (``SampleArray.values``), and the
        tail's column from ``tails`` (an ``aperf.Tails``)."""
        out = [self.column(t, values[name]) for name, _, t in self.members]
        if self.tail is not None:
            if tails is None:
                out.append(self.pa.nulls(len(values), self.pa.binary()))
            else:
                out.append(self.binary(self.np.frombuffer(tails.data, self.np.uint8),
                                       tails.starts, tails.stops - tails.starts))
        return out

    def column(self, t: CType, col: Any) -> Any:
        """One NumPy column (``len(col)`` rows of ``t``) as an Arrow array."""
        pa, np = self.pa, self.np
        rows = len(col)
        if isinstance(t, IntType) and t.kind == "bool":
            return pa.array(np.ascontiguousarray(col), pa.bool_())
        if col.dtype.kind == "V" and not col.dtype.names:  # odd sizes: their bytes
            return pa.Array.from_buffers(pa.binary(col.dtype.itemsize), rows,
                                         [None, pa.py_buffer(np.ascontiguousarray(col))])
        if isinstance(t, IntType | EnumType | FloatType | PointerType):
            native = np.ascontiguousarray(col, dtype=col.dtype.newbyteorder("="))
            return pa.Array.from_buffers(arrow_type(pa, t), rows, [None, pa.py_buffer(native)])
        if isinstance(t, ArrayType):
            elem = t.elem
            if isinstance(elem, IntType) and elem.kind == "char":
                return self.strings(col)
            if is_byte(elem):
                flat = np.ascontiguousarray(col).view(np.uint8)
                return pa.Array.from_buffers(pa.binary(t.count), rows,
                                             [None, pa.py_buffer(flat)])
            inner = self.column(elem, col.reshape((rows * t.count, *col.shape[2:])))
            return pa.FixedSizeListArray.from_arrays(inner, t.count)
        assert isinstance(t, RecordType)
        members = decoded_fields(t)
        children = [self.column(member, col[name]) for name, _, member in members]
        return pa.StructArray.from_arrays(
            children, fields=[arrow_field(pa, name, member) for name, _, member in members])

    def strings(self, col: Any) -> Any:
        """A ``char[N]`` column (NumPy ``S{N}``) as strings: each cut at its first NUL,
        invalid UTF-8 replaced by U+FFFD (as records have it; never an exception)."""
        pa, np = self.pa, self.np
        rows, width = len(col), col.dtype.itemsize
        chars = np.ascontiguousarray(col).view(np.uint8).reshape(rows, width)
        nul = chars == 0
        lengths = np.where(nul.any(axis=1), nul.argmax(axis=1), width)
        data = chars[np.arange(width) < lengths[:, None]]  # the kept bytes, row after row
        offsets = self.offsets(lengths)
        if not data.size or int(data.max()) < 0x80:  # ASCII: valid UTF-8 as it is
            return pa.Array.from_buffers(pa.string(), rows, [None, offsets, pa.py_buffer(data)])
        binary = pa.Array.from_buffers(pa.binary(), rows, [None, offsets, pa.py_buffer(data)])
        try:
            return binary.cast(pa.string())
        except pa.ArrowInvalid:  # some row is not UTF-8: those rows, with replacement
            return pa.array([b.decode("utf-8", "replace") for b in binary.to_pylist()],
                            pa.string())

    def offsets(self, lengths: Any) -> Any:
        """Arrow's int32 offsets buffer for rows of these lengths."""
        np = self.np
        offsets = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        if offsets[-1] > _INT32_MAX:
            raise ValueError("more than 2 GiB of variable-length bytes in one batch")
        return self.pa.py_buffer(offsets.astype(np.int32))

    def binary(self, data: Any, starts: Any, lengths: Any) -> Any:
        """Rows ``data[starts[i]:starts[i] + lengths[i]]`` (NumPy uint8 ``data``) as a
        ``binary`` array, gathered at C speed into memory of its own."""
        np = self.np
        lengths = np.asarray(lengths, np.int64)
        total = int(lengths.sum())
        ends = np.cumsum(lengths)
        index = np.repeat(np.asarray(starts, np.int64) - (ends - lengths), lengths)
        index += np.arange(total, dtype=np.int64)
        gathered = data[index]
        return self.pa.Array.from_buffers(self.pa.binary(), len(lengths),
                                          [None, self.offsets(lengths),
                                           self.pa.py_buffer(gathered)])

    # --- batches -------------------------------------------------------------------

    def batch(
        self, rows: int, decoded: list[Any] | None, *, cpu: int = 0, cpus: Any = None,
        late: Any = False, map: str | None = None, hosts: Any = None, streams: Any = None,
        raw: Any = None, time_ns: int | None = None,
    ) -> Any:
        """A record batch of ``rows`` samples: the decoded columns (None: nulls, for
        samples the decoder refused), the ring key of each (``cpus``) or of all
        (``cpu``), ``late`` (one flag, or one per row), and, as the schema says, the
        map, the fleet's host and stream, the raw samples (an Arrow binary array) and
        the receive time (wall-clock ns; the column keeps microseconds)."""
        pa, np = self.pa, self.np
        columns: list[Any] = []
        if self.time:
            stamp = np.full(rows, 0 if time_ns is None else time_ns // 1000, np.int64)  # us
            columns.append(pa.Array.from_buffers(self.schema.field(0).type, rows,
                                                 [None, pa.py_buffer(stamp)]))
        keys = np.full(rows, cpu, np.int32) if cpus is None else np.asarray(cpus, np.int32)
        columns.append(pa.Array.from_buffers(pa.int32(), rows, [None, pa.py_buffer(keys)]))
        if self.maps:
            columns.append(pa.repeat(pa.scalar(map, pa.string()), rows))
        if self.fleet:
            columns += [pa.array(hosts, pa.string()), pa.array(streams, pa.string())]
        if isinstance(late, bool):
            columns.append(pa.repeat(pa.scalar(late, pa.bool_()), rows))
        else:
            columns.append(pa.array(np.asarray(late, np.bool_), pa.bool_()))
        if decoded is None:
            decoded = [pa.nulls(rows, field.type) for field in self._decoded_fields]
        columns += decoded
        if self.raw:
            columns.append(raw)
        return pa.RecordBatch.from_arrays(columns, schema=self.schema)

    def empty(self) -> Any:
        """A batch of no rows, of this schema."""
        return self.pa.RecordBatch.from_pylist([], schema=self.schema)
