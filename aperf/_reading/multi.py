"""Several maps, one stream: what the reader builds per map.

A stream of several maps (``_rings/multi.py``, a ``SeveralMapsSource``) hands the
reader rings under composite keys (``map_key_offset(index) + cpu``). Each map has an
``EventBuilder`` (and a ``Columns``) of its own that builds the map's tagged event
classes (``tagged(Sample, name)``) with the real CPU; ``MultiBuilder`` and
``MultiColumns`` send each piece to its map's, by ring key.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from .._events import Event, Lost, SampleArray
from .._options import DecodeErrorPolicy
from .._rings.seam import (
    MAP_KEY_STRIDE,
    RecordFormat,
    Run,
    SeveralMapsSource,
    Split,
    map_key_offset,
)
from .build import Decoder, EventBuilder, Payloads, Requeue, RunPiece

if TYPE_CHECKING:
    from .columnar import ArrayItem, Columns


class MultiBuilder:
    """The reader's event builder over several maps: each piece goes to its map's builder
    (by ring key); decode errors are counted in one dict by ring key."""

    __slots__ = ("decode_errors", "decoder", "errors", "members")

    def __init__(self, members: Sequence[EventBuilder], errors: dict[int, int],
                 decode_errors: DecodeErrorPolicy) -> None:
        self.members = list(members)
        self.errors = errors
        self.decode_errors = decode_errors
        self.decoder: Decoder | None = None  # one per map: see members

    def run(self, key: int, run: Run, start: int, stop: int, out: list[Any]) -> None:
        self.members[key // MAP_KEY_STRIDE].run(key, run, start, stop, out)

    def payloads(self, key: int, payloads: list[bytes], uniform: bool, out: list[Any]) -> None:
        self.members[key // MAP_KEY_STRIDE].payloads(key, payloads, uniform, out)

    def failed(
        self, key: int, payloads: list[bytes], uniform: bool, index: int, exc: Exception,
        out: list[Event[Any]],
    ) -> bool:
        return self.members[key // MAP_KEY_STRIDE].failed(key, payloads, uniform, index, exc, out)

    def lost(self, key: int, count: int) -> Lost:
        return self.members[key // MAP_KEY_STRIDE].lost(key, count)

    def cpu_of(self, key: int) -> int:
        return key - map_key_offset(key // MAP_KEY_STRIDE)

    def key_of(self, event: Lost) -> int:
        """The ring key of a notice a member made: its map's offset plus its real CPU."""
        for index, member in enumerate(self.members):
            if member.map == event.map:
                return int(event.cpu) + map_key_offset(index)
        raise LookupError(f"no map named {event.map!r} in this stream")

    def map_of(self, key: int) -> str | None:
        return self.members[key // MAP_KEY_STRIDE].map


class MultiColumns:
    """Columnar batches over several maps: a ``Columns`` per map (each its own dtype),
    by ring key; the front queues' items go to the ``Columns`` of their map."""

    def __init__(self, source: SeveralMapsSource, members: Sequence[Columns]) -> None:
        self.source = source
        self.members = list(members)
        self._index = {columns.map: index for index, columns in enumerate(members)}

    def split_for(self, records: RecordFormat) -> Split:
        """The reader's split, with each map's runs found as its ``Columns`` finds them
        (``records``: the source's, which dispatches by ring key)."""
        return self.source.split_with([
            columns.split_for(member.source.records)
            for columns, member in zip(self.members, self.source.members, strict=True)
        ])

    def arrays(self, piece: RunPiece | Payloads, builder: MultiBuilder, max_rows: int | None,
               out: list[Any]) -> None:
        index = piece.key // MAP_KEY_STRIDE
        self.members[index].arrays(piece, builder.members[index], max_rows, out)

    def front(self, events: Iterable[Event[Any]]) -> list[ArrayItem]:
        """Built events as arrays: each run of one map's events by its ``Columns``."""
        out: list[ArrayItem] = []
        group: list[Any] = []
        for event in events:
            if group and event.map != group[0].map:
                out.extend(self.members[self._index[group[0].map]].front(group))
                group = []
            group.append(event)
        if group:
            out.extend(self.members[self._index[group[0].map]].front(group))
        return out

    def events(self, items: Iterable[ArrayItem], builder: MultiBuilder) -> list[Event[Any]]:
        """Built arrays as events again, each by its map's builder."""
        events: list[Event[Any]] = []
        for item in items:
            if item.__class__ is SampleArray:
                index = self._index[item.map]
                events.extend(self.members[index].events([item], builder.members[index]))
            else:
                events.append(item)  # type: ignore[arg-type]
        return events


def event_builder(source: SeveralMapsSource, decode_errors: DecodeErrorPolicy,
                  requeue: Requeue) -> MultiBuilder:
    """The reader's event builder over the maps of ``source``: one per map."""
    errors: dict[int, int] = {}
    return MultiBuilder([
        EventBuilder(m.decoder, decode_errors, requeue, map=m.name, offset=map_key_offset(i),
                     errors=errors)
        for i, m in enumerate(source.members)
    ], errors, decode_errors)


def columns(source: SeveralMapsSource, load_columns: Callable[..., Columns]) -> MultiColumns:
    """A ``Columns`` per map of ``source``, each made by ``load_columns``
    (``reader.load_columns``): ImportError without NumPy; TypeError naming the map whose
    decoder has no layout."""
    members = []
    for index, member in enumerate(source.members):
        try:
            members.append(load_columns(member.decoder, map=member.name,
                                        offset=map_key_offset(index)))
        except TypeError as exc:
            raise TypeError(f"map {member.name!r}: {exc}") from None
    return MultiColumns(source, members)
