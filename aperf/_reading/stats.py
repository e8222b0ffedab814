"""The reader's statistics: what it counted per ring, and the figures ``statistics()`` says.

Per ring key (every ring the reader was opened on or that came since, broken and
retired ones included): samples, bytes, wakeups and other records (skipped), and the
largest span one drain took (``high_water``). The loss counts are the loss ledger's
(``losses.py``); ``cpus()`` puts both together, with what the ring holds now.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from .._events import CpuStatistics, StreamStatistics
from .._log import log
from .losses import LossLedger
from .rings import RingSet

if TYPE_CHECKING:
    from .build import EventBuilder

# Per-ring counter slots.
_SAMPLES, _BYTES, _WAKEUPS, _OTHER = range(4)


class RingStats:
    """Per ring key: ``[samples, bytes, wakeups, other records]``, and the high water."""

    __slots__ = ("counters", "high_water")

    def __init__(self, keys: Iterable[int]) -> None:
        self.counters = {key: [0, 0, 0, 0] for key in keys}
        self.high_water: dict[int, int] = {}  # per ring: the largest span one drain took

    def add(self, key: int) -> None:
        """A ring came (its CPU came online): counted from now on, after its earlier ones."""
        self.counters.setdefault(key, [0, 0, 0, 0])

    def keys(self) -> list[int]:
        """Every ring key counted, sorted."""
        return sorted(self.counters)

    def woke(self, key: int) -> None:
        """A wakeup of ring ``key``."""
        counters = self.counters.get(key)
        if counters is not None:
            counters[_WAKEUPS] += 1

    def took(self, key: int, length: int) -> None:
        """A drain took a ``length``-byte span (not empty) out of ring ``key``."""
        if length > self.high_water.get(key, 0):
            self.high_water[key] = length

    def counted(self, key: int, length: int, samples: int, other: int) -> None:
        """What a drain of ring ``key`` added: bytes, samples and other records."""
        counters = self.counters[key]
        counters[_BYTES] += length
        counters[_OTHER] += other
        counters[_SAMPLES] += samples

    def cpus(
        self, rings: RingSet, losses: LossLedger, builder: EventBuilder,
        late: Callable[[int], int],
    ) -> tuple[CpuStatistics, ...]:
        """Each ring's figures, by key: its counts, its losses (``losses``), what it holds
        now and its size (``rings``), its CPU and map (``builder``), late samples."""
        out = []
        for key, c in sorted(self.counters.items()):
            ring = rings.get(key)
            lost = losses.lost(key, ring)
            queue_lost, _ = losses.split(key, lost)
            size = rings.size_of(key)
            out.append(CpuStatistics(
                cpu=builder.cpu_of(key),
                samples=c[_SAMPLES],
                lost=lost,
                bytes=c[_BYTES],
                wakeups=c[_WAKEUPS],
                decode_errors=builder.errors.get(key, 0),
                other_records=c[_OTHER],
                broken=key in rings.broken,
                backlog_bytes=0 if ring is None else ring.pending_bytes(),
                high_water=self.high_water.get(key, 0) / size if size else 0.0,
                queue_lost=queue_lost,
                map=builder.map_of(key),
                late=late(key),
            ))
        return tuple(out)


def log_summary(event: str, source: str, stats: StreamStatistics) -> None:
    """The closing log line: what was delivered, lost and left undelivered."""
    log.info(
        event,
        source=source,
        samples=stats.samples,
        lost=stats.lost,
        lost_by_cpu={c.cpu if c.map is None else f"{c.map}:{c.cpu}": c.lost
                     for c in stats.cpus if c.lost},
        lost_counter=stats.lost_counter,
        decode_errors=stats.decode_errors,
        undelivered=stats.pending,
    )
