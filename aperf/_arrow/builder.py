"""Events to Arrow record batches, with bounded memory: ``aperf.ArrowBuilder``."""

from __future__ import annotations

import struct
from typing import Any

from .._decoding.decode import SizedDecoder, from_ctypes, from_struct, is_ctypes_structure
from .._events import BadSample, Lost, Sample, Tails
from .columns import Tabler

DEFAULT_MAX_ROWS = 65_536
DEFAULT_MAX_BYTES = 16 << 20


def sized_decoder(decoder: object, what: str) -> SizedDecoder | None:
    """A decoder with a layout, from what a stream's ``decoder=`` takes (but a BTF name:
    that needs the object, ``aperf.decoders.from_btf(obj, name)``); None for None."""
    if decoder is None or isinstance(decoder, SizedDecoder):
        return decoder
    if is_ctypes_structure(decoder):
        return from_ctypes(decoder)  # type: ignore[arg-type]
    if isinstance(decoder, struct.Struct):
        return from_struct(decoder)
    raise TypeError(
        f"{what}: decoder must be None, a ctypes.Structure subclass, a struct.Struct or a "
        "decoder with a layout (aperf.decoders.from_btf(obj, 'name'), from_struct, "
        f"from_ctypes), not {decoder!r}")


class ArrowBuilder:
    """Events (``aperf.Sample`` and ``aperf.BadSample``, from ``async for``, ``batches()``,
    callbacks or an ``aperf.fleet`` reader) as ``pyarrow.RecordBatch``es of the same
    schema as ``SampleArray.to_arrow()`` gives, at most ``max_rows`` rows and about
    ``max_bytes`` of samples each: the memory it holds is bounded by them.

    ```python
    import struct

    import aperf

    builder = aperf.ArrowBuilder(struct.Struct("<QQ"))
    for seq in range(3):
        builder.add(aperf.Sample(0, struct.pack("<QQ", seq, 7)))
    batch = builder.flush()
    print(batch.num_rows, batch.column("f0").to_pylist())  # 3 [0, 1, 2]
    ```

    The columns are decoded again from each sample's bytes (``Sample.data``) with the
    builder's ``decoder`` (a ctypes structure, a ``struct.Struct`` or a decoder with a
    layout; None: no decoded columns), at C speed, a batch at a time; a sample too
    short for it (a ``BadSample``) is a row whose decoded columns are null. ``raw``
    adds the bytes themselves (``_data``), ``maps`` the map of each event (``_map``),
    ``fleet`` the host and stream of an ``aperf.fleet.FleetEvent`` (``_host``,
    ``_stream``: give those events to ``add`` as they come).

    A ``Lost`` notice is not a sample: ``add`` refuses it (``TypeError``), so that no
    loss disappears into a table unnoticed; count it where you iterate.
    """

    def __init__(self, decoder: object = None, *, max_rows: int = DEFAULT_MAX_ROWS,
                 max_bytes: int = DEFAULT_MAX_BYTES, raw: bool = False, maps: bool = False,
                 fleet: bool = False) -> None:
        for name, value in (("max_rows", max_rows), ("max_bytes", max_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int of at least 1, not {value!r}")
        sized = sized_decoder(decoder, "ArrowBuilder")
        laid_out = sized is not None and sized.layout is not None
        self._tabler = Tabler(sized, maps=maps, fleet=fleet, raw=raw or not laid_out,
                              what="ArrowBuilder")
        self.schema = self._tabler.schema
        self.max_rows = max_rows
        self.max_bytes = max_bytes
        self._size = sized.size if sized is not None and sized.layout is not None else 0
        self._dtype = sized.dtype if sized is not None and self._tabler.layout else None
        self._rows: list[tuple[Any, ...]] = []  # (cpu, map, late, host, stream, data, bad)
        self._bytes = 0

    def __len__(self) -> int:
        """Rows held, not yet handed out."""
        return len(self._rows)

    @property
    def nbytes(self) -> int:
        """Bytes of the samples held, not yet handed out."""
        return self._bytes

    def add(self, event: Any) -> Any:
        """Hold one event as a row; a full batch (``max_rows`` rows or ``max_bytes``)
        when this one filled it, else None."""
        host = stream = None
        if self._tabler.fleet:
            host, stream, event = event  # an aperf.fleet.FleetEvent
        if isinstance(event, Sample | BadSample):
            data = event.data
            bad = isinstance(event, BadSample) or len(data) < self._size
            self._rows.append((event.cpu, event.map, event.late, host, stream, data, bad))
            self._bytes += len(data)
            if len(self._rows) >= self.max_rows or self._bytes >= self.max_bytes:
                return self.flush()
            return None
        if isinstance(event, Lost):
            raise TypeError("ArrowBuilder.add: a Lost notice is not a sample; count its "
                            "samples where you iterate (event.count), none goes in a batch")
        raise TypeError(f"ArrowBuilder.add takes aperf.Sample and aperf.BadSample events, not "
                        f"{type(event).__name__}")

    def flush(self) -> Any:
        """The rows held, as one record batch (None if there are none)."""
        rows, self._rows, self._bytes = self._rows, [], 0
        if not rows:
            return None
        pa = self._tabler.pa
        pieces = []
        start = 0
        for index in range(1, len(rows) + 1):  # runs of decodable rows, and of refused ones
            if index == len(rows) or rows[index][6] != rows[start][6]:
                pieces.append(self._piece(rows[start:index]))
                start = index
        if len(pieces) == 1:
            return pieces[0]
        return pa.Table.from_batches(pieces, schema=self.schema).combine_chunks().to_batches()[0]

    def _piece(self, rows: list[tuple[Any, ...]]) -> Any:
        tabler = self._tabler
        np = tabler.np
        count = len(rows)
        cpus, maps, late, hosts, streams, data, bad = zip(*rows, strict=True)
        decoded = None
        if not bad[0] and self._dtype is not None:
            lengths = np.fromiter(map(len, data), np.int64, count)
            blob = np.frombuffer(b"".join(data), np.uint8)
            starts = np.cumsum(lengths) - lengths
            index = starts[:, None] + np.arange(self._size, dtype=np.int64)
            values = blob[index].view(self._dtype)[:, 0]
            tails = None
            if tabler.tail is not None:
                tails = Tails(blob, starts + self._size, starts + lengths)
            decoded = tabler.decoded(values, tails)
        one_map = maps[0] if all(m == maps[0] for m in maps) else None
        batch = tabler.batch(
            count, decoded, cpus=np.fromiter(cpus, np.int32, count), late=np.array(late),
            map=one_map, hosts=hosts, streams=streams,
            raw=tabler.pa.array(data, tabler.pa.binary()) if tabler.raw else None)
        if tabler.maps and one_map is None and count:  # events of several maps
            names = tabler.schema.get_field_index("_map")
            batch = batch.set_column(names, tabler.schema.field(names),
                                     tabler.pa.array(maps, tabler.pa.string()))
        return batch

