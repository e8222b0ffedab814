"""Ring sizing and wakeup policy: validated before any C call is made."""

from __future__ import annotations

import mmap
from dataclasses import dataclass

from ._errors import RingSizeError

PAGE_SIZE = mmap.PAGESIZE
DEFAULT_PAGES = 128
"""Default per-CPU ring: 128 pages (512 KiB). At the producer's peak here (about 4 M
32-byte samples/s per CPU) that holds 3 ms of samples: three drain-timer periods of
the balanced policy, enough to ride out a scheduling hiccup of the consumer."""


def ring_pages(pages: int | None, ring_bytes: int | None) -> int:
    """The per-CPU data page count from ``pages`` or ``ring_bytes`` (rounded up)."""
    if pages is not None and ring_bytes is not None:
        raise RingSizeError("give pages or ring_bytes, not both")
    if ring_bytes is not None:
        if isinstance(ring_bytes, bool) or not isinstance(ring_bytes, int) or ring_bytes <= 0:
            raise RingSizeError(f"ring_bytes must be a positive int, not {ring_bytes!r}")
        needed = -(-ring_bytes // PAGE_SIZE)
        return 1 << (needed - 1).bit_length()
    if pages is None:
        return DEFAULT_PAGES
    if isinstance(pages, bool) or not isinstance(pages, int):
        raise RingSizeError(f"pages must be an int, not {type(pages).__name__}")
    if pages <= 0 or pages & (pages - 1):
        raise RingSizeError(
            f"pages={pages}: the per-CPU page count must be a power of two (1, 2, 4, ... 8192)"
        )
    return pages


@dataclass(frozen=True)
class Wakeup:
    """When the kernel wakes the reader, and how long a sample may wait regardless.

    - ``Wakeup.per_sample()``: every sample wakes the reader (lowest latency; the
      traced workload pays a wakeup, about 8 us here, per sample).
    - ``Wakeup.every(n)``: every n-th sample wakes it.
    - ``Wakeup.watermark(nbytes)``: it wakes when nbytes are pending.
    - ``Wakeup.balanced()`` (default): a watermark of a quarter ring, with a drain timer.

    With batched wakeups, samples below the threshold would wait for ever;
    ``max_latency`` (seconds) is the period of a drain timer that bounds that wait.

    The timer adapts to the traffic: after ``IDLE_AFTER`` seconds in which it
    found nothing, its period stretches to ``idle_latency`` (so an idle stream
    costs next to nothing), and the first sample or wakeup brings it back to
    ``max_latency``. The first sample after a silence may therefore wait up to
    ``idle_latency``; set ``idle_latency=max_latency`` for a strict bound.
    """

    events: int = 0
    watermark_bytes: int = 0
    watermark_fraction: float = 0.0
    max_latency: float | None = None
    idle_latency: float | None = None

    def __post_init__(self) -> None:
        chosen = sum(bool(x) for x in (self.events, self.watermark_bytes, self.watermark_fraction))
        if chosen != 1:
            raise ValueError("a Wakeup needs exactly one of events, watermark_bytes, fraction")
        if self.events < 0 or self.watermark_bytes < 0 or not 0 <= self.watermark_fraction < 1:
            raise ValueError(f"invalid wakeup threshold in {self!r}")
        if self.max_latency is not None and self.max_latency <= 0:
            raise ValueError(f"max_latency must be positive seconds, not {self.max_latency!r}")
        if self.idle_latency is not None and (
            self.max_latency is None or self.idle_latency < self.max_latency
        ):
            raise ValueError("idle_latency must be at least max_latency")
        if self.batched and self.max_latency is None:
            raise ValueError(
                "batched wakeups need max_latency: samples below the threshold would never be read"
            )

    @property
    def batched(self) -> bool:
        return self.events != 1

    @classmethod
    def per_sample(cls) -> Wakeup:
        return cls(events=1)

    @classmethod
    def every(
        cls, samples: int, max_latency: float = 0.001, idle_latency: float | None = None
    ) -> Wakeup:
        if samples < 1:
            raise ValueError(f"Wakeup.every needs at least 1 sample, not {samples}")
        if samples == 1:
            return cls(events=1)
        return cls(events=samples, max_latency=max_latency, idle_latency=idle_latency)

    @classmethod
    def watermark(
        cls, nbytes: int, max_latency: float = 0.001, idle_latency: float | None = None
    ) -> Wakeup:
        if nbytes < 1:
            raise ValueError(f"Wakeup.watermark needs at least 1 byte, not {nbytes}")
        return cls(watermark_bytes=nbytes, max_latency=max_latency, idle_latency=idle_latency)

    @classmethod
    def balanced(cls, max_latency: float = 0.001, idle_latency: float = 0.050) -> Wakeup:
        return cls(watermark_fraction=0.25, max_latency=max_latency, idle_latency=idle_latency)

    @classmethod
    def throughput(cls) -> Wakeup:
        return cls(watermark_fraction=0.5, max_latency=0.010, idle_latency=0.250)

    @classmethod
    def named(cls, name: str) -> Wakeup:
        """"lowest-latency", "balanced" (the default) or "throughput"."""
        presets = {
            "lowest-latency": cls.per_sample,
            "balanced": cls.balanced,
            "throughput": cls.throughput,
        }
        try:
            return presets[name]()
        except KeyError:
            raise ValueError(
                f"unknown wakeup preset {name!r}; use one of {sorted(presets)}"
            ) from None

    def kernel_settings(self, ring_bytes: int) -> tuple[int, int]:
        """(wakeup_events, wakeup_watermark) for perf_event_attr."""
        if self.events:
            return self.events, 0
        nbytes = self.watermark_bytes or int(ring_bytes * self.watermark_fraction)
        return 0, max(1, min(nbytes, ring_bytes - PAGE_SIZE if ring_bytes > PAGE_SIZE else 1))


IDLE_AFTER = 1.0
"""Seconds without a sample after which the drain timer stretches to ``idle_latency``."""


def resolve_wakeup(wakeup: Wakeup | str | None) -> Wakeup:
    if wakeup is None:
        return Wakeup.balanced()
    if isinstance(wakeup, str):
        return Wakeup.named(wakeup)
    if isinstance(wakeup, Wakeup):
        return wakeup
    raise TypeError(f"wakeup must be a Wakeup or a preset name, not {type(wakeup).__name__}")
