"""Ring sizing and wakeup policy: validated before any C call is made."""

from __future__ import annotations

import math
import mmap
import warnings
from dataclasses import dataclass
from typing import Any, Literal, cast

from ._errors import ArgumentError, RingSizeError

PAGE_SIZE = mmap.PAGESIZE
MAX_RING_BYTES = 1 << 28
"""Largest ring aperf opens: 256 MiB per CPU (a bigger request is a mistake, not a ring)."""
DEFAULT_PAGES = 128
"""Default per-CPU ring: 128 pages (512 KiB). At the producer's peak here (about 4 M
32-byte samples/s per CPU) that holds 3 ms of samples: three drain-timer periods of
the balanced policy, enough to ride out a scheduling hiccup of the consumer."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def ring_data_bytes(
    pages: int | None, ring_bytes: int | None, page_size: int = PAGE_SIZE
) -> int | None:
    """Data bytes per ring from ``pages`` or ``ring_bytes`` (rounded up to a power-of-two
    page count of ``page_size`` bytes); None when neither is given (the source's own
    default). ``ring_bytes`` means the same on every host: with 64 KiB pages,
    ``ring_bytes=4096`` gets one 64 KiB page, never sixteen times what was asked."""
    if pages is not None and ring_bytes is not None:
        raise RingSizeError("give pages or ring_bytes, not both")
    limit = f"at most {MAX_RING_BYTES // page_size} pages ({MAX_RING_BYTES >> 20} MiB) per ring"
    if ring_bytes is not None:
        if not _is_int(ring_bytes) or ring_bytes <= 0:
            raise RingSizeError(f"ring_bytes must be a positive int, not {ring_bytes!r}")
        if ring_bytes > MAX_RING_BYTES:
            raise RingSizeError(f"ring_bytes={ring_bytes} is too large: {limit}")
        needed = -(-ring_bytes // page_size)
        return (1 << (needed - 1).bit_length()) * page_size
    if pages is None:
        return None
    if not _is_int(pages):
        raise RingSizeError(f"pages must be an int, not {type(pages).__name__}")
    if pages <= 0 or pages & (pages - 1):
        raise RingSizeError(
            f"pages={pages}: the per-CPU page count must be a power of two (1, 2, 4, ... 8192)"
        )
    if pages * page_size > MAX_RING_BYTES:
        raise RingSizeError(f"pages={pages} is too large: {limit}")
    return pages * page_size


def check_memory_bytes(
    memory_bytes: int | None, pages: int | None, ring_bytes: int | None
) -> int | None:
    """``memory_bytes=`` checked on its own (the ring count is known only at open)."""
    if memory_bytes is None:
        return None
    if pages is not None or ring_bytes is not None:
        raise RingSizeError("give one of pages, ring_bytes or memory_bytes, not several")
    if not _is_int(memory_bytes) or memory_bytes <= 0:
        raise RingSizeError(f"memory_bytes must be a positive int, not {memory_bytes!r}")
    return memory_bytes


def budget_ring_bytes(memory_bytes: int, rings: int, page_size: int = PAGE_SIZE) -> int:
    """Data bytes per ring for a budget of ``memory_bytes`` in all over ``rings`` rings.

    Each perf ring takes one metadata page plus a power-of-two count of data pages,
    so the budget is rounded down: every ring gets the largest power-of-two page
    count for which ``rings * (pages + 1) * page_size`` stays within the budget.
    A budget below one data page per ring, or above the largest ring per ring, is
    an error that says the smallest and largest possible.
    """
    max_pages = MAX_RING_BYTES // page_size
    smallest = rings * 2 * page_size
    largest = rings * (max_pages + 1) * page_size
    if not smallest <= memory_bytes <= largest:
        raise RingSizeError(
            f"memory_bytes={memory_bytes} cannot be met by {rings} perf ring(s) of "
            f"{page_size}-byte pages (a metadata page plus a power of two of data pages "
            f"each): the smallest possible is {smallest}, the largest {largest}"
        )
    per_ring = memory_bytes // rings // page_size - 1
    return (1 << (per_ring.bit_length() - 1)) * page_size


DecodeErrorPolicy = Literal["item", "raise", "skip"]
"""What ``decode_errors=`` takes: yield a ``BadSample``, raise ``DecodeError``, or skip it."""
DEFAULT_MAX_PENDING = 65536
"""Events a stream queues before it stops draining its rings (``max_pending=``)."""


def check_max_pending(max_pending: Any) -> int:
    if not _is_int(max_pending) or max_pending < 1:
        raise ArgumentError("max_pending", f"max_pending must be an int of at least 1, not "
                            f"{max_pending!r}")
    return int(max_pending)


def check_decode_errors(policy: Any) -> DecodeErrorPolicy:
    if policy not in ("item", "raise", "skip"):
        raise ArgumentError("decode_errors", f"decode_errors must be 'item', 'raise' or 'skip', "
                            f"not {policy!r}")
    return cast(DecodeErrorPolicy, policy)


def check_max_rows(max_rows: int | None) -> int | None:
    """``max_rows`` of the drivers' arrays, run_arrays and lease: None (no limit), or >= 1."""
    if max_rows is not None and (
        isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1
    ):
        raise ValueError(f"max_rows must be None or an int of at least 1, not {max_rows!r}")
    return max_rows


def _check_seconds(name: str, value: float | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be seconds (a number), not {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ArgumentError(name, f"{name} must be a positive, finite number of seconds, not "
                            f"{value!r}")


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
    idle_after: float = 1.0
    """Seconds without a sample after which the drain timer stretches to ``idle_latency``."""

    def __post_init__(self) -> None:
        for name in ("events", "watermark_bytes"):
            if not _is_int(getattr(self, name)):
                raise TypeError(f"Wakeup {name} must be an int, not {getattr(self, name)!r}")
        chosen = sum(bool(x) for x in (self.events, self.watermark_bytes, self.watermark_fraction))
        if chosen != 1:
            raise ArgumentError("wakeup", "a Wakeup needs exactly one of events, "
                                "watermark_bytes, fraction")
        if self.events < 0 or self.watermark_bytes < 0 or not 0 <= self.watermark_fraction < 1:
            raise ArgumentError("wakeup", f"invalid wakeup threshold in {self!r}")
        _check_seconds("max_latency", self.max_latency)
        _check_seconds("idle_latency", self.idle_latency)
        _check_seconds("idle_after", self.idle_after)
        if self.idle_latency is not None and (
            self.max_latency is None or self.idle_latency < self.max_latency
        ):
            raise ArgumentError("idle_latency", "idle_latency must be at least max_latency")
        if self.batched and self.max_latency is None:
            raise ArgumentError(
                "max_latency",
                "batched wakeups need max_latency: samples below the threshold would never be read",
            )

    @property
    def batched(self) -> bool:
        """Whether the kernel wakes the reader less than once per sample (a drain timer runs)."""
        return self.events != 1

    @classmethod
    def per_sample(cls) -> Wakeup:
        """Wake the reader for every sample (libbpf's default; no drain timer)."""
        return cls(events=1)

    @classmethod
    def every(
        cls,
        samples: int,
        max_latency: float = 0.001,
        idle_latency: float | None = None,
        idle_after: float = 1.0,
    ) -> Wakeup:
        """Wake the reader every ``samples`` samples; a drain timer takes the rest."""
        if not _is_int(samples) or samples < 1:
            raise ArgumentError("samples", f"Wakeup.every needs an int of at least 1 sample, "
                                f"not {samples!r}")
        if samples == 1:
            return cls(events=1)
        return cls(
            events=samples, max_latency=max_latency, idle_latency=idle_latency,
            idle_after=idle_after,
        )

    @classmethod
    def watermark(
        cls,
        nbytes: int,
        max_latency: float = 0.001,
        idle_latency: float | None = None,
        idle_after: float = 1.0,
    ) -> Wakeup:
        """Wake the reader when ``nbytes`` are pending; a drain timer takes the rest."""
        if not _is_int(nbytes) or nbytes < 1:
            raise ArgumentError("nbytes", f"Wakeup.watermark needs an int of at least 1 byte, "
                                f"not {nbytes!r}")
        return cls(
            watermark_bytes=nbytes, max_latency=max_latency, idle_latency=idle_latency,
            idle_after=idle_after,
        )

    @classmethod
    def balanced(
        cls, max_latency: float = 0.001, idle_latency: float = 0.050, idle_after: float = 1.0
    ) -> Wakeup:
        """A quarter-ring watermark, a 1 ms drain timer, 50 ms when idle (the default)."""
        return cls(
            watermark_fraction=0.25, max_latency=max_latency, idle_latency=idle_latency,
            idle_after=idle_after,
        )

    @classmethod
    def throughput(cls) -> Wakeup:
        """A half-ring watermark, a 10 ms drain timer, 250 ms when idle."""
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
            raise ArgumentError(
                "wakeup", f"unknown wakeup preset {name!r}; use one of {sorted(presets)}"
            ) from None

    def kernel_settings(self, ring_bytes: int) -> tuple[int, int]:
        """(wakeup_events, wakeup_watermark) for perf_event_attr.

        Deprecated: what the perf event array source sets is its own business
        now (``DeprecationWarning``); this copy goes in the next release.
        """
        warnings.warn(
            "Wakeup.kernel_settings() is deprecated: the perf event array source "
            "translates a Wakeup for perf_event_attr itself",
            DeprecationWarning, stacklevel=2,
        )
        if self.events:
            return self.events, 0
        nbytes = self.watermark_bytes or int(ring_bytes * self.watermark_fraction)
        return 0, max(1, min(nbytes, ring_bytes - PAGE_SIZE if ring_bytes > PAGE_SIZE else 1))


def resolve_wakeup(wakeup: Wakeup | str | None) -> Wakeup:
    if wakeup is None:
        return Wakeup.balanced()
    if isinstance(wakeup, str):
        return Wakeup.named(wakeup)
    if isinstance(wakeup, Wakeup):
        return wakeup
    raise TypeError(f"wakeup must be a Wakeup or a preset name, not {type(wakeup).__name__}")
