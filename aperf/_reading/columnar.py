"""Columnar batches: NumPy structured arrays straight from the spans a reader took.

A run of identical sample records (``_rings/seam.Run``) becomes a strided view
of the copied span: ``numpy.frombuffer(span, dtype, count, offset)`` with a
dtype whose itemsize is the record size and whose fields skip the record
header and the padding, so no Python code runs per sample. Samples parsed one
by one (mixed sizes, a struct with a flexible array member) are joined and
gathered in one NumPy operation. Imported only when a consumer asks for arrays:
``import aperf`` never imports NumPy.

A record format may find its runs for columnar consumers at C speed too
(``ColumnarRecords``: perf records, ``_rings/perf/runs.py``). The reader's one walk over
its queue hands the pieces to ``Columns.arrays``;
the front queues a consumer leaves behind when it switches between events and
arrays are turned into the other kind here (``Columns.front``, ``Columns.events``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Union, cast

import numpy as np

from .._arrow.columns import Tabler
from .._decoding.decode import SizedDecoder
from .._decoding.layout import byte_order, dtype_spec
from .._events import BadSample, Event, Lost, Sample, SampleArray, Tails
from .._rings.seam import ColumnarRecords, RecordFormat, Run, Split
from .build import EventBuilder, Payloads, RunPiece
from .order import _Gathered

ArrayItem = Union[SampleArray, Lost, BadSample]  # noqa: UP007 - as Event
"""What a columnar consumer gets."""


class Columns:
    """Makes ``aperf.SampleArray`` items for one decoder (in a stream of several maps: for
    one map, whose arrays say ``map`` and the ring's real CPU, its key less ``offset``)."""

    def __init__(self, decoder: object, *, map: str | None = None, offset: int = 0) -> None:
        if not isinstance(decoder, SizedDecoder) or decoder.layout is None:
            raise TypeError(
                "columnar batches need a decoder with a layout: a BTF struct name, "
                "aperf.decoders.from_btf(...), a ctypes.Structure or a struct.Struct "
                f"(not {decoder!r})"
            )
        self.decoder = decoder
        self.size = decoder.size
        self.has_tail = decoder.tail is not None
        self._spec = dtype_spec(decoder.layout, byte_order(decoder.struct.format),
                                size=decoder.size)
        self.dtype: np.dtype[Any] = np.dtype(cast(Any, self._spec))
        self._strided: dict[tuple[int, int], np.dtype[Any]] = {}
        self.map = map
        self.offset = offset
        self._tablers: dict[tuple[bool, bool], Tabler] = {}

    @staticmethod
    def split_for(records: RecordFormat) -> Split:
        """The format's split, or its own for columnar consumers (``ColumnarRecords``:
        perf records, whose runs NumPy finds)."""
        if isinstance(records, ColumnarRecords):
            return records.columnar_split()
        return records.split

    def strided_dtype(self, stride: int, skip: int) -> np.dtype[Any]:
        """The decoder's fields ``skip`` bytes into records of ``stride`` bytes."""
        key = (stride, skip)
        dtype = self._strided.get(key)
        if dtype is None:
            spec = self._spec
            dtype = self._strided[key] = np.dtype({
                "names": spec["names"], "formats": spec["formats"],
                "offsets": [offset + skip for offset in spec["offsets"]], "itemsize": stride,
            })
        return dtype

    def from_run(self, key: int, run: Run, first: int, stop: int) -> SampleArray:
        """Records ``first`` to ``stop`` of a run (each long enough), viewed in place."""
        count = stop - first
        at = run.start + first * run.stride
        values = np.frombuffer(run.span, self.strided_dtype(run.stride, run.skip), count, at)
        tails = None
        if self.has_tail:
            starts = at + run.skip + self.size + np.arange(count, dtype=np.int64) * run.stride
            tails = Tails(run.span, starts, starts + (run.size - self.size))
        source = Run(run.span, at, count, run.stride, run.skip, run.size)
        return SampleArray(key - self.offset, values, tails, map=self.map, _source=source,
                           _columns=self)

    def from_payloads(self, key: int, payloads: list[bytes]) -> SampleArray:
        """Samples parsed one by one (each long enough): joined, then gathered at C speed."""
        count = len(payloads)
        lengths = np.fromiter(map(len, payloads), np.int64, count)
        blob = b"".join(payloads)
        ends = np.cumsum(lengths)
        starts = ends - lengths
        if count and lengths.min() == lengths.max():
            values = np.frombuffer(blob, self.strided_dtype(int(lengths[0]), 0), count, 0)
        else:
            index = starts[:, None] + np.arange(self.size, dtype=np.int64)
            values = np.frombuffer(blob, np.uint8)[index].view(self.dtype)[:, 0]
            values.flags.writeable = False  # like the views: read-only
        tails = Tails(blob, starts + self.size, ends) if self.has_tail else None
        return SampleArray(key - self.offset, values, tails, map=self.map, _source=payloads,
                           _columns=self)

    def too_short(self, payloads: list[bytes]) -> list[int]:
        """Indexes of the payloads shorter than the decoder's fixed part."""
        lengths = np.fromiter(map(len, payloads), np.int64, len(payloads))
        return [int(i) for i in np.flatnonzero(lengths < self.size)]

    def from_samples(self, samples: list[Sample[Any]]) -> list[SampleArray]:
        """Built samples (put back by a per-item consumer) as arrays, one per CPU run."""
        out: list[SampleArray] = []
        start = 0
        for index in range(1, len(samples) + 1):
            if index == len(samples) or samples[index].cpu != samples[start].cpu:
                out.append(self.from_payloads(
                    samples[start].cpu + self.offset, [s.data for s in samples[start:index]]
                ))
                start = index
        return out

    # --- as Arrow record batches (docs/arrow.md) --------------------------------------

    def tabler(self, *, raw: bool = False, time: bool = False) -> Tabler:
        """What makes this decoder's record batches (pyarrow imported now)."""
        tabler = self._tablers.get((raw, time))
        if tabler is None:
            tabler = self._tablers[raw, time] = Tabler(
                self.decoder, maps=self.map is not None, raw=raw, time=time,
                what="SampleArray.to_arrow()")
        return tabler

    def to_arrow(self, item: SampleArray, *, raw: bool = False,
                 time_ns: int | None = None) -> Any:
        """``item`` as a record batch; with ``raw``, its samples' bytes too (``_data``);
        with ``time_ns``, a receive time (``_time``)."""
        tabler = self.tabler(raw=raw, time=time_ns is not None)
        values = item.values  # raises once a lease ended
        return tabler.batch(
            len(values), tabler.decoded(values, item.tails), cpu=item.cpu, cpus=item.cpus,
            late=item.late, map=item.map, time_ns=time_ns,
            raw=self.raw_column(tabler, item) if raw else None)

    @staticmethod
    def raw_column(tabler: Tabler, item: SampleArray) -> Any:
        """The samples of ``item`` as ``Sample.data`` has them, an Arrow binary array."""
        pa = tabler.pa
        source = item._source
        if isinstance(source, Run):  # in place in the span: every payload one size
            rows = source.count
            records = np.frombuffer(source.span, np.uint8, rows * source.stride, source.start)
            payloads = np.ascontiguousarray(
                records.reshape(rows, source.stride)[:, source.skip : source.skip + source.size])
            return pa.Array.from_buffers(
                pa.binary(), rows, [None, tabler.offsets(np.full(rows, source.size)),
                                    pa.py_buffer(payloads)])
        if isinstance(source, _Gathered):  # rows an ordered stream merged
            if source.recs is not None:
                recs = np.ascontiguousarray(source.recs)
                size = recs.dtype.itemsize
                return pa.Array.from_buffers(
                    pa.binary(), len(recs), [None, tabler.offsets(np.full(len(recs), size)),
                                             pa.py_buffer(recs.view(np.uint8))])
            return tabler.binary(source.blob, source.starts, source.lengths)
        return pa.array(source, pa.binary())  # payloads parsed one by one

    # --- the reader's pieces, as arrays -------------------------------------------------

    def arrays(
        self, piece: RunPiece | Payloads, builder: EventBuilder, max_rows: int | None,
        out: list[Any],
    ) -> None:
        """One piece of the reader's queue as arrays of at most ``max_rows`` rows each
        (``BadSample`` where a sample is too short, under the decode_errors policy)."""
        if isinstance(piece, RunPiece):
            key, run, first, stop = piece
            if run.size < self.size:  # all of them too short for the decoder
                self._bad_rows(builder, key, run.payloads(first, stop), True,
                               range(stop - first), out)
                return
            step = max_rows or stop - first
            for at in range(first, stop, step):
                out.append(self.from_run(key, run, at, min(stop, at + step)))
            return
        key, payloads, uniform = piece
        start = 0
        for index in [*self.too_short(payloads), len(payloads)]:
            step = max_rows or max(1, index - start)
            for at in range(start, index, step):
                out.append(self.from_payloads(key, payloads[at : min(index, at + step)]))
            if index == len(payloads):
                return
            if not self._bad_rows(builder, key, payloads, uniform, (index,), out):
                return
            start = index + 1

    @staticmethod
    def _bad_rows(
        builder: EventBuilder, key: int, payloads: list[bytes], uniform: bool,
        indexes: Sequence[int] | range, out: list[Any],
    ) -> bool:
        """Samples too short for the decoder, under the decode_errors policy (False: raised)."""
        decoder = builder.decoder
        assert decoder is not None
        for index in indexes:
            try:
                decoder(payloads[index])
            except Exception as exc:
                if not builder.failed(key, payloads, uniform, index, exc, out):
                    return False
        return True

    def front(self, events: Iterable[Event[Any]]) -> list[ArrayItem]:
        """Built events (a per-item consumer's front queue) as arrays, one per CPU run."""
        out: list[ArrayItem] = []
        samples: list[Any] = []
        for event in events:
            if isinstance(event, Sample):  # a tagged one too (several maps)
                samples.append(event)
                continue
            if samples:
                out.extend(self.from_samples(samples))
                samples = []
            out.append(event)  # Lost or BadSample
        if samples:
            out.extend(self.from_samples(samples))
        return out

    def events(self, items: Iterable[ArrayItem], builder: EventBuilder) -> list[Event[Any]]:
        """Built arrays (a columnar consumer's front queue) as events again."""
        events: list[Any] = []
        for item in items:
            if item.__class__ is not SampleArray:
                events.append(item)
                continue
            source = item._source
            key = item.cpu + self.offset
            if isinstance(source, _Gathered):  # rows merged by an ordered stream
                for cpu, data in source.payloads():
                    builder.payloads(cpu + self.offset, [data], False, events)
            elif isinstance(source, Run):
                builder.run(key, source, 0, source.count, events)
            else:
                builder.payloads(key, source, False, events)
        return events
