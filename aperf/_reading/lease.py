"""A lease's batch and its lifetime (docs/columnar.md, "Leases").

Once a stream gives its first lease, each ring that can be read in place is (the
driver says how: ``_rings/perf/lease_ring.leased``, a ring that releases its space only
once nothing views it); the reader's ring set holds those rings instead. A lease hands
out what is queued, as ``arrays()`` does; when it ends, every ``SampleArray`` it handed
out is switched to ``_EndedArray`` (its ``values`` and ``tails`` raise
``ClosedResourceError``; its references to the ring are dropped), the batch list is
emptied, and each ring's space is given back, past every span nothing references any
more.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from .._errors import ClosedResourceError
from .._events import SampleArray
from .._rings.seam import Ring
from .rings import RingSet

_ENDED = ("this array's lease ended: its ring memory was released. Keep what you need "
          "while the lease is held (arr.values.copy())")


class HeldRing(Ring, Protocol):
    """A ring read in place: its space goes back to the producer on ``release()``, past
    the spans nothing views any more."""

    def release(self) -> None: ...


class _EndedArray(SampleArray):
    """A ``SampleArray`` whose lease ended: it no longer shows anything."""

    __slots__ = ()

    @property
    def values(self) -> Any:
        raise ClosedResourceError(_ENDED)

    @property
    def tails(self) -> Any:  # type: ignore[override]
        raise ClosedResourceError(_ENDED)

    def __len__(self) -> int:
        raise ClosedResourceError(_ENDED)

    def __repr__(self) -> str:
        return f"<SampleArray cpu={self.cpu}, lease ended>"


_SLOTS: dict[str, Any] = dict(vars(SampleArray))
_set_values, _set_tails = _SLOTS["values"].__set__, _SLOTS["tails"].__set__


class Lease:
    """One lease on a reader's rings: ``started(batch)``, then ``end()`` (idempotent).

    ``in_place(ring)`` is the ring read in place (the same one if it already is), or
    None: that ring is copied.
    """

    __slots__ = ("_batch", "_rings")

    def __init__(self, rings: RingSet, in_place: Callable[[Ring], HeldRing | None]) -> None:
        held: list[HeldRing] = []
        for ring in list(rings.values()):  # rings added since (CPU hotplug) are switched too
            kept = in_place(ring)
            if kept is None:
                continue
            if kept is not ring:
                rings.swap(kept)
            held.append(kept)
        self._rings = held
        self._batch: list[Any] | None = None

    def started(self, batch: list[Any]) -> list[Any]:
        self._batch = batch
        return batch

    def end(self) -> None:
        batch, self._batch = self._batch, None
        if batch is not None:
            for item in batch:
                if item.__class__ is SampleArray:
                    _set_values(item, None)
                    _set_tails(item, None)
                    item._source = None
                    item.__class__ = _EndedArray
            batch.clear()
        for ring in self._rings:
            ring.release()
