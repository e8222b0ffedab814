"""Flight-recorder snapshots: the newest records of every overwritable ring as events.

The source reads its rings with the producer paused (``_rings/perf/backward.py`` walks each
one, newest to oldest); here they become events in stream order, per CPU, or
merged across CPUs by a field of the decoded values.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from typing import Any

from .._errors import ArgumentError, DecodeError, UnsupportedError
from .._events import BadSample, Event, Lost, Sample
from .._rings.seam import Run, SnapshotSource, payloads_of
from .build import EventBuilder
from .reader import Reader

__all__ = ["snapshot"]

def _field(value: Any, name: str) -> Any:
    if isinstance(value, Mapping):
        return value[name]
    return getattr(value, name)


def _ordered(per_ring: list[list[Event[Any]]], order_by: str) -> list[Event[Any]]:
    """Every ring's events merged by the ``order_by`` field of their values; a lost
    notice or bad sample keeps its place behind the sample before it on its ring."""
    keyed: list[list[tuple[Any, int, int, Event[Any]]]] = []
    for index, events in enumerate(per_ring):
        samples = [e for e in events if isinstance(e, Sample)]
        if not samples:
            keyed.append([(None, index, n, e) for n, e in enumerate(events)])
            continue
        try:
            last = _field(samples[0].value, order_by)
        except (AttributeError, KeyError, TypeError):
            raise ArgumentError(
                "order_by", f"order_by={order_by!r}: the decoded samples have no field "
                f"{order_by!r} (a value: {samples[0].value!r})"
            ) from None
        rows = []
        for n, event in enumerate(events):
            if isinstance(event, Sample):
                last = _field(event.value, order_by)
            rows.append((last, index, n, event))
        keyed.append(rows)
    timed = [rows for rows in keyed if rows and rows[0][0] is not None]
    untimed = [row[3] for rows in keyed if rows and rows[0][0] is None for row in rows]
    return untimed + [row[3] for row in heapq.merge(*timed)]


def snapshot(reader: Reader, order_by: str | None = None) -> list[Event[Any]]:
    """What ``PerfStream.snapshot()``/``PerfBuffer.snapshot()`` do (see there)."""
    if order_by is not None:
        if not isinstance(order_by, str):
            raise TypeError(f"order_by must be a field name, not {type(order_by).__name__}")
        if reader.decoder is None:
            raise ArgumentError("order_by", f"order_by={order_by!r} needs a decoder whose "
                                "values have that field")
    source = reader.source
    if not isinstance(source, SnapshotSource):
        raise UnsupportedError(
            f"snapshot() reads flight-recorder rings, which only a Linux perf event array "
            f"has (overwritable=True); {source.name} is a {type(source).__name__}"
        )
    spans = source.newest()
    policy = reader.builder.decode_errors
    builder = EventBuilder(reader.decoder, "item" if policy == "raise" else policy,
                           _no_requeue)
    per_ring: list[list[Event[Any]]] = []
    for key, span in spans:
        events: list[Event[Any]] = []
        segments, _ = source.records.split(key, span)
        for segment in segments:
            if isinstance(segment, int):
                events.append(Lost(key, segment))
            else:
                uniform = True if isinstance(segment, Run) else segment[1]
                builder.payloads(key, payloads_of(segment), uniform, events)
        if policy == "raise":
            bad = next((e for e in events if isinstance(e, BadSample)), None)
            if bad is not None:
                raise bad.error
        per_ring.append(events)
    if order_by is None:
        return [event for events in per_ring for event in events]
    return _ordered(per_ring, order_by)


def _no_requeue(error: DecodeError, rest: Any) -> None:  # "item"/"skip" never requeue
    raise error
