"""The synchronous driver: libbpf's ``perf_buffer__poll``/``consume`` API, no event loop."""

from __future__ import annotations

import dataclasses
import select
import time
from collections.abc import Callable
from typing import Any

from ._core import DEFAULT_BATCH, DecodeErrorPolicy, StreamCore
from ._decode import DecoderSpec, resolve_decoder
from ._errors import ClosedResourceError
from ._events import BadSample, Lost, Sample, StreamStatistics
from ._log import log
from ._options import IDLE_AFTER, Wakeup, resolve_wakeup, ring_pages
from ._rings import MapSource, RingSet


class PerfBuffer:
    """Perf rings read synchronously, with libbpf's names and meanings.

    ``poll(timeout_ms)`` waits up to the timeout for a ring to be woken, then
    hands every pending event to the callbacks and returns how many it handled
    (samples, lost notices and bad samples; 0 on timeout), like
    ``perf_buffer__poll``. ``consume()`` handles everything pending on every
    ring without waiting; ``consume_buffer(cpu)`` one CPU's ring.

    Exceptions raised by callbacks propagate out of these calls; the events
    after the failing one stay queued and are handed over by the next call.
    """

    def __init__(
        self,
        source: MapSource,
        *,
        pages: int | None = None,
        ring_bytes: int | None = None,
        on_sample: Callable[[Sample], Any] | None = None,
        on_lost: Callable[[Lost], Any] | None = None,
        on_decode_error: Callable[[BadSample], Any] | None = None,
        decoder: DecoderSpec = None,
        decode_errors: DecodeErrorPolicy = "item",
        wakeup: Wakeup | str | None = None,
    ) -> None:
        if on_sample is None:
            raise ValueError("PerfBuffer needs an on_sample callback")
        self._on_sample = on_sample
        self._on_lost = on_lost
        self._on_decode_error = on_decode_error
        self._decode_errors = decode_errors
        self._wakeup = resolve_wakeup(wakeup)
        decode = resolve_decoder(decoder, source)
        self._epoll: select.epoll | None = None
        self._last_traffic = time.monotonic()
        self._rings: RingSet | None = RingSet(source, ring_pages(pages, ring_bytes), self._wakeup)
        try:
            self._core = StreamCore(
                self._rings.readers,
                decoder=decode,
                decode_errors=decode_errors,
                ring_bytes=self._rings.ring_bytes,
                memory_bytes=self._rings.memory_bytes,
            )
            self._epoll = select.epoll()
            for fd in self._rings.fds.values():
                self._epoll.register(fd, select.EPOLLIN)
            self._cpu_of_fd = {fd: cpu for cpu, fd in self._rings.fds.items()}
        except BaseException:
            self.close()
            raise
        log.info("perf buffer opened", map=self._rings.name, cpus=sorted(self._rings.readers),
                 ring_bytes=self._rings.ring_bytes, wakeup=self._wakeup)

    # --- libbpf's API -------------------------------------------------------------------

    @property
    def buffer_cnt(self) -> int:
        """Number of rings (one per online CPU that has a map slot)."""
        return len(self._require_open().readers)

    @property
    def cpus(self) -> list[int]:
        """The CPU id of each ring, in order."""
        return sorted(self._require_open().counters)

    def buffer_fd(self, cpu: int) -> int:
        """The perf event fd of ``cpu``'s ring (to wait on it in your own loop)."""
        self._require_open()
        assert self._rings is not None
        return self._rings.fds[cpu]

    def poll(self, timeout_ms: int = -1) -> int:
        """Wait up to ``timeout_ms`` (negative: for ever) and handle what is ready.

        Returns the number of events handled. EINTR is retried with the time
        left; KeyboardInterrupt and callback exceptions propagate.
        """
        core = self._require_open()
        if core.pending:
            return self._dispatch()
        assert self._epoll is not None
        deadline = None if timeout_ms < 0 else time.monotonic() + timeout_ms / 1000
        while True:
            now = time.monotonic()
            wait = -1.0 if deadline is None else max(0.0, deadline - now)
            slice_s = self._drain_period(now)
            if slice_s is not None and (wait < 0 or wait > slice_s):
                wait = slice_s  # batched wakeups: look at the rings at least this often
            ready = self._epoll.poll(wait)  # retries EINTR itself (PEP 475)
            for fd, _ in ready:
                core.count_wakeup(self._cpu_of_fd[fd])
            if ready or slice_s is not None:
                if core.drain_all(force=True) or ready:
                    self._last_traffic = time.monotonic()
                if core.pending:
                    return self._dispatch()
            if deadline is not None and time.monotonic() >= deadline:
                return 0

    def _drain_period(self, now: float) -> float | None:
        """How long poll() may wait before looking at the rings (None: only on wakeups).

        As the async stream's drain timer: max_latency while samples flow,
        idle_latency after IDLE_AFTER seconds without any.
        """
        wakeup = self._wakeup
        if not wakeup.batched:
            return None
        if wakeup.idle_latency is not None and now - self._last_traffic >= IDLE_AFTER:
            return wakeup.idle_latency
        return wakeup.max_latency

    def consume(self) -> int:
        """Handle everything every ring holds now, without waiting. Events handled."""
        self._require_open().drain_all(force=True)
        return self._dispatch()

    def consume_buffer(self, cpu: int) -> int:
        """Handle what ``cpu``'s ring holds now (aperf keys rings by CPU id, see ``cpus``)."""
        core = self._require_open()
        if cpu not in core.counters:
            raise ValueError(f"no ring for CPU {cpu}; rings: {sorted(core.counters)}")
        core.drain(cpu, force=True)
        return self._dispatch()

    def flush(self) -> int:
        """Same as :meth:`consume`: hand over what sits below the wakeup threshold."""
        return self.consume()

    def _dispatch(self) -> int:
        core = self._core
        handled = 0
        while True:
            batch = core.take(DEFAULT_BATCH)
            if not batch:
                return handled
            for index, event in enumerate(batch):
                try:
                    self._handle(event)
                except BaseException:
                    core.put_back(batch[index + 1 :])
                    raise
            handled += len(batch)

    def _handle(self, event: Any) -> None:
        cls = event.__class__
        if cls is Sample:
            self._on_sample(event)
        elif cls is Lost:
            if self._on_lost is not None:
                self._on_lost(event)
        elif cls is BadSample:
            if self._on_decode_error is None:
                raise event.error
            self._on_decode_error(event)

    # --- lifecycle ----------------------------------------------------------------------

    def _require_open(self) -> StreamCore:
        if self._rings is None:
            raise ClosedResourceError("this PerfBuffer is closed")
        return self._core

    @property
    def closed(self) -> bool:
        return self._rings is None

    def statistics(self) -> StreamStatistics:
        """Per-CPU samples, lost, bytes and wakeups; memory; the drain period in force."""
        stats = self._core.statistics()
        return dataclasses.replace(stats, drain_period=self._drain_period(time.monotonic()))

    def close(self) -> None:
        """Stop waiting, then free the rings (fds closed, map slots deleted). Idempotent."""
        rings, self._rings = self._rings, None
        epoll, self._epoll = self._epoll, None
        try:
            if epoll is not None:
                epoll.close()
        finally:
            if rings is not None:
                rings.free()
                core = getattr(self, "_core", None)
                if core is not None:
                    core.closed = True
                    core.log_summary("perf buffer closed")

    def __enter__(self) -> PerfBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
