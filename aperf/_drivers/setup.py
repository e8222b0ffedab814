"""What every driver does before reading: check the options, resolve the source
and the decoder, then open the rings and build the one reader.

Everything a user can get wrong is checked in the driver's constructor, before
any ring exists: the arguments are resolved here once, with typed errors that
name the argument.
"""

from __future__ import annotations

import keyword
import os
import re
import struct
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._bpf.object import BPFObject, Map
from .._decoding.decode import Decoder, from_ctypes, from_struct, is_ctypes_structure
from .._errors import ArgumentError, UnsupportedError
from .._options import (
    DecodeErrorPolicy,
    Wakeup,
    budget_ring_bytes,
    check_decode_errors,
    check_max_pending,
    check_memory_bytes,
    resolve_wakeup,
    ring_data_bytes,
)
from .._reading import multi
from .._reading.clock import Clock
from .._reading.order import DEFAULT_LATENESS, OrderKey, check_lateness, check_order_by
from .._reading.reader import Reader, load_columns
from .._rings.map_spec import (
    BPF_MAP_TYPE_ARRAY_OF_MAPS,
    BPF_MAP_TYPE_RINGBUF,
    MapSpec,
    check_map_source,
    map_type_of,
)
from .._rings.multi import Member, MultiSource, check_names, several_maps
from .._rings.perf.source import PerfEventArraySource, check_layout
from .._rings.ringbuf.array import RingBufferArraySource
from .._rings.ringbuf.source import RingBufferSource
from .._rings.seam import (
    RING_SOURCE_MEMBERS,
    MapSource,
    RecordedSource,
    RingConfig,
    RingSource,
)

DecoderSpec = Callable[[bytes], Any] | struct.Struct | str | type | None
"""What ``decoder=`` takes: a callable, a ``struct.Struct``, a ``ctypes.Structure``
subclass, the name of a struct (or typedef) in the map's object's BTF, or None."""

SourceSpec = RingSource | MapSpec | Mapping[str, RingSource | MapSpec] | Sequence[
    RingSource | MapSpec]
"""What ``source`` takes: one map (or ring source), or several (a mapping of names, or a
list or tuple: docs/rings.md, "Several maps in one stream")."""
_C_NAME = re.compile(r"^(struct\s+)?[A-Za-z_][A-Za-z0-9_]*$")


def missing_members(value: object) -> list[str]:
    """The members of ``aperf.abc.RingSource`` that ``value`` lacks."""
    return [name for name in RING_SOURCE_MEMBERS if not hasattr(value, name)]


def is_ring_source(value: object) -> bool:
    """Whether ``value`` has every member of a RingSource (``_rings/seam.py``)."""
    return not missing_members(value)


def resolve_source(spec: object) -> RingSource:
    """A ring source from what the user passed: a source itself, or a map, by its type:
    a BPF ring buffer, an array of ring buffers (one per CPU), or a perf event array
    (of eBPF for Windows on Windows, else of the Linux kernel), whose open says what
    is wrong with anything else."""
    missing = missing_members(spec)
    if not missing:
        return spec  # type: ignore[return-value]
    if len(missing) < len(RING_SOURCE_MEMBERS) and (
        isinstance(spec, bool) or not isinstance(spec, Map | int | str | os.PathLike)
    ):
        # Meant as a ring source (it has some members): say which it lacks, now,
        # not with an AttributeError when the stream first uses one.
        raise TypeError(
            f"source {type(spec).__name__} is not a ring source: it lacks "
            f"{', '.join(missing)} (see aperf.abc.RingSource)"
        )
    if sys.platform == "win32":
        from .._rings.windows.ringbuf import WindowsMapSource

        return WindowsMapSource(spec)  # type: ignore[arg-type, return-value]  # by type, at open
    source = check_map_source(spec)
    map_type = map_type_of(source)
    if map_type == BPF_MAP_TYPE_RINGBUF:
        return RingBufferSource(source)
    if map_type == BPF_MAP_TYPE_ARRAY_OF_MAPS:
        return RingBufferArraySource(source)
    return PerfEventArraySource(source)


def _owner_object(source: RingSource) -> BPFObject | None:
    owner = source.object if isinstance(source, MapSource) else None
    return owner if isinstance(owner, BPFObject) else None


def resolve_decoder(spec: DecoderSpec, source: RingSource) -> Decoder | None:
    """The decoder for ``decoder=``. A string always names a BTF struct or typedef."""
    if spec is None:
        return None
    if is_ctypes_structure(spec):
        return from_ctypes(spec)  # type: ignore[arg-type]
    if isinstance(spec, struct.Struct):
        return from_struct(spec)
    if isinstance(spec, str):
        return _decoder_from_string(spec, source)
    if callable(spec):
        return spec
    raise TypeError(
        "decoder must be a callable, a struct.Struct, a ctypes.Structure subclass or a BTF "
        f"type name, not {type(spec).__name__}"
    )


def _decoder_from_string(spec: str, source: RingSource) -> Decoder:
    if _C_NAME.match(spec) and not keyword.iskeyword(spec):
        owner = _owner_object(source)
        if owner is None:
            raise TypeError(
                f"decoder={spec!r} names a BTF type, but the source is not a map of an "
                f"aperf.BPFObject; pass decoder=aperf.decoders.from_btf(obj, {spec!r})"
            )
        try:
            return owner._btf_decoder(spec)
        except LookupError as exc:
            exc.args = (
                f"{exc.args[0]} (a decoder string names a BTF struct or typedef; for a struct "
                f"format pass struct.Struct({spec!r}))",
            )
            raise
    try:
        packed = struct.Struct(spec)
    except struct.error:
        raise ArgumentError(
            "decoder", f"decoder={spec!r} is not a C identifier: a decoder string names a "
            "struct or typedef in the object's BTF (struct formats go in as struct.Struct(...))"
        ) from None
    warnings.warn(
        f"decoder={spec!r}: struct format strings are deprecated, since a string names a BTF "
        f"type; pass decoder=struct.Struct({spec!r})",
        DeprecationWarning,
        stacklevel=5,
    )
    return from_struct(packed)


@dataclass(frozen=True)
class ReaderOptions:
    """Everything a driver needs to open a reader, validated."""

    source: RingSource
    ring_bytes: int | None
    wakeup: Wakeup
    decoder: Decoder | None
    max_pending: int
    decode_errors: DecodeErrorPolicy
    cpus: tuple[int, ...] | None = None
    map_keys: tuple[int, ...] | None = None
    memory_bytes: int | None = None
    overwritable: bool = False
    order_by: OrderKey | None = None
    order_field: str | None = None
    lateness: float = DEFAULT_LATENESS

    @classmethod
    def check(
        cls,
        source: object,
        *,
        pages: int | None,
        ring_bytes: int | None,
        wakeup: Wakeup | str | None,
        decoder: DecoderSpec,
        max_pending: int,
        decode_errors: DecodeErrorPolicy,
        cpus: Iterable[int] | None = None,
        map_keys: Iterable[int] | None = None,
        memory_bytes: int | None = None,
        take_over: bool = False,
        overwritable: bool = False,
        order_by: str | Callable[[Any], Any] | None = None,
        lateness: float = DEFAULT_LATENESS,
    ) -> ReaderOptions:
        if isinstance(source, Mapping) or (
            isinstance(source, Sequence) and not isinstance(source, str | bytes)
        ):
            return cls._check_several(
                source, pages=pages, ring_bytes=ring_bytes, wakeup=wakeup, decoder=decoder,
                max_pending=max_pending, decode_errors=decode_errors, cpus=cpus,
                map_keys=map_keys, memory_bytes=memory_bytes, take_over=take_over,
                overwritable=overwritable, order_by=order_by, lateness=lateness,
            )
        if isinstance(decoder, Mapping):
            raise TypeError(
                "decoder= as a mapping of map names goes with several maps: "
                "PerfStream({'name': map, ...}, decoder={'name': ...})"
            )
        ring_source = resolve_source(source)
        if take_over is not False:
            if take_over is not True:
                raise TypeError(f"take_over must be True or False, not {take_over!r}")
            if not isinstance(ring_source, MapSource):
                raise TypeError(
                    "take_over=True: only a map (or a map's source) has a reader in another "
                    f"process to take it from, not {type(ring_source).__name__}"
                )
            ring_source.take_over = True
        cpu_ids, keys = check_layout(cpus, map_keys)
        budget = check_memory_bytes(memory_bytes, pages, ring_bytes)
        if (cpu_ids, budget) != (None, None) and not isinstance(
            ring_source, PerfEventArraySource
        ):
            raise UnsupportedError(
                f"cpus=, map_keys= and memory_bytes= choose the rings of a Linux perf event "
                f"array; {ring_source.name} is a {type(ring_source).__name__}"
            )
        if overwritable is not False:
            if overwritable is not True:
                raise TypeError(f"overwritable must be True or False, not {overwritable!r}")
            if not isinstance(ring_source, PerfEventArraySource):
                raise UnsupportedError(
                    f"overwritable=True makes flight-recorder perf rings; {ring_source.name} "
                    f"is a {type(ring_source).__name__} (a Linux perf event array only)"
                )
        if budget is not None and cpu_ids is not None:
            budget_ring_bytes(budget, len(cpu_ids))  # the ring count is known: check now
        resolved = resolve_decoder(decoder, ring_source)
        if isinstance(ring_source, RecordedSource):  # a replay: its recording's decoder
            ring_source.check_decoder(resolved)
        order_key = check_order_by(order_by, resolved)
        lateness = check_lateness(lateness)
        return cls(
            source=ring_source,
            ring_bytes=ring_data_bytes(pages, ring_bytes),
            wakeup=resolve_wakeup(wakeup),
            decoder=resolved,
            max_pending=check_max_pending(max_pending),
            decode_errors=check_decode_errors(decode_errors),
            cpus=cpu_ids,
            map_keys=keys,
            memory_bytes=budget,
            overwritable=overwritable,
            order_by=order_key,
            order_field=order_by if isinstance(order_by, str) else None,
            lateness=lateness,
        )

    @classmethod
    def _check_several(
        cls,
        source: Mapping[str, object] | Sequence[object],
        *,
        pages: int | None,
        ring_bytes: int | None,
        wakeup: Wakeup | str | None,
        decoder: DecoderSpec | Mapping[str, DecoderSpec],
        max_pending: int,
        decode_errors: DecodeErrorPolicy,
        cpus: Iterable[int] | None,
        map_keys: Iterable[int] | None,
        memory_bytes: int | None,
        take_over: bool,
        overwritable: bool,
        order_by: str | Callable[[Any], Any] | None,
        lateness: float,
    ) -> ReaderOptions:
        """Several maps in one stream (``_rings/multi.py``): each spec resolved as a single
        source is, each decoder against its own map's source."""
        if isinstance(source, Mapping):
            pairs = list(source.items())
        else:
            pairs = [(spec.name if isinstance(spec, Map) else f"map{index}", spec)
                     for index, spec in enumerate(source)]
        if not pairs:
            raise ArgumentError("source", "source: an empty mapping (or list) of maps: give at "
                                "least one")
        names = [name for name, _ in pairs]
        check_names(names)
        if memory_bytes is not None:
            raise UnsupportedError(
                "memory_bytes= shares one budget among the rings of one perf event array; a "
                "stream of several maps cannot split it among them: give pages= or ring_bytes= "
                "(the size of each perf event array's rings)"
            )
        if overwritable is not False:
            raise UnsupportedError(
                "overwritable=True makes the flight-recorder rings of one perf event array, "
                "read by snapshot(); a stream of several maps cannot: one stream per map"
            )
        if isinstance(decoder, Mapping):
            unknown = [name for name in decoder if name not in names]
            if unknown:
                raise ArgumentError(
                    "decoder", f"decoder: no map named {', '.join(map(repr, unknown))} in this "
                    f"stream (its maps: {', '.join(map(repr, names))})"
                )
            specs = {name: decoder.get(name) for name in names}
        else:
            specs = dict.fromkeys(names, decoder)
        sources = [resolve_source(spec) for _, spec in pairs]
        if take_over is not False:
            if take_over is not True:
                raise TypeError(f"take_over must be True or False, not {take_over!r}")
            takers = [s for s in sources if isinstance(s, MapSource)]
            if not takers:
                raise TypeError("take_over=True: none of these sources is a map, to take from "
                                "a reader in another process")
            for taker in takers:
                taker.take_over = True
        cpu_ids, keys = check_layout(cpus, map_keys)
        laid_out = [isinstance(s, PerfEventArraySource) for s in sources]
        if cpu_ids is not None and not any(laid_out):
            raise UnsupportedError(
                "cpus= and map_keys= choose the rings of a Linux perf event array; none of "
                f"these maps is one ({', '.join(names)})"
            )
        sized = [not isinstance(s, RingBufferSource | RingBufferArraySource) for s in sources]
        size = ring_data_bytes(pages, ring_bytes)
        if size is not None and not any(sized):
            raise UnsupportedError(
                "pages= and ring_bytes= size perf rings; every map here is a BPF ring buffer, "
                "whose size is the map's own (max_entries): leave them out"
            )
        members = [
            Member(name, src, resolve_decoder(specs[name], src), sized=s, laid_out=lay)
            for name, src, s, lay in zip(names, sources, sized, laid_out, strict=True)
        ]
        for member in members:
            if isinstance(member.source, RecordedSource):
                member.source.check_decoder(member.decoder)
        # Ordered across maps by one key: a field every map's decoder has, checked for each,
        # and a mistake names the map whose decoder lacks it.
        order_keys = []
        for member in members:
            try:
                order_keys.append(check_order_by(order_by, member.decoder))
            except ArgumentError as exc:
                raise ArgumentError("order_by", f"map {member.name!r}: {exc}") from None
        return cls(
            source=several_maps(members),
            ring_bytes=size,
            wakeup=resolve_wakeup(wakeup),
            decoder=None,
            max_pending=check_max_pending(max_pending),
            decode_errors=check_decode_errors(decode_errors),
            cpus=cpu_ids,
            map_keys=keys,
            order_by=order_keys[0],
            order_field=order_by if isinstance(order_by, str) else None,
            lateness=check_lateness(lateness),
        )

    def recorded(self) -> tuple[Decoder | None, list[str] | None, bool]:
        """What a recording of this stream is made with: its decoder, the names of its
        maps (None: one map), and whether it is read as arrays (a decoder with a layout,
        NumPy, arrays allowed) or as events. Several maps need one decoder for all."""
        source = self.source
        if isinstance(source, MultiSource):
            decoders = [member.decoder for member in source.members]
            first = decoders[0]
            shapes = {None if d is None else repr(getattr(d, "layout", d)) for d in decoders}
            if len(shapes) > 1:
                raise UnsupportedError(
                    "record(): a stream of several maps is recorded into one table, so its "
                    "maps need one decoder; record one stream per map")
            decoder, maps = first, [member.name for member in source.members]
        else:
            decoder, maps = self.decoder, None
        try:
            self.check_columns()
            check_arrays_order(self)
            columnar = True
        except (ImportError, TypeError, UnsupportedError):
            columnar = False
        return decoder, maps, columnar

    def check_columns(self) -> None:
        """That columnar batches can be made (NumPy; a decoder with a layout for each map),
        when a driver is made."""
        if isinstance(self.source, MultiSource):
            multi.columns(self.source, load_columns)
        else:
            load_columns(self.decoder)

    def open(self, clock: Clock) -> Reader:
        """Open the rings and build the reader on them (all or nothing)."""
        source = self.source
        rings = source.open(
            RingConfig(
                self.ring_bytes, self.wakeup, cpus=self.cpus, map_keys=self.map_keys,
                memory_bytes=self.memory_bytes, overwritable=self.overwritable,
            )
        )
        try:
            return Reader(
                source,
                rings,
                wakeup=self.wakeup,
                clock=clock,
                decoder=self.decoder,
                decode_errors=self.decode_errors,
                max_pending=self.max_pending,
                order_by=self.order_by,
                order_field=self.order_field,
                lateness=self.lateness,
            )
        except BaseException:
            source.free()
            raise



def check_arrays_order(options: ReaderOptions) -> None:
    """Arrays are ordered by a field of their rows, not by a key function of samples."""
    if options.order_by is not None and isinstance(options.source, MultiSource):
        # Each map's arrays have their own dtype: rows of several maps make no one array.
        raise UnsupportedError(
            "order_by= with arrays() over several maps: each map's rows have their own "
            "dtype; iterate the events (async for, batches()) to merge several maps in time "
            "order, or open one ordered stream per map")
    if options.order_by is not None and options.order_field is None:
        raise TypeError("order_by=: arrays are ordered by a field name (order_by=\"ts\"); a "
                        "callable key(sample) orders events, not arrays")
