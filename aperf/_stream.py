"""The asyncio driver: ``async for`` over events, batches, and callback mode."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from ._core import DEFAULT_BATCH, DEFAULT_MAX_PENDING, DecodeErrorPolicy, StreamCore
from ._decode import DecoderSpec, resolve_decoder
from ._errors import BusyResourceError, ClosedResourceError
from ._events import Lost, Sample, StreamStatistics
from ._log import log
from ._options import IDLE_AFTER, Wakeup, resolve_wakeup, ring_pages
from ._rings import MapSource, RingSet
from ._watch import FdWatcher, RingWatcher

Callback = Callable[[Any], Any]
_ITER_BATCH = DEFAULT_BATCH


async def _call(callback: Callable[[Any], Any], arg: Any) -> None:
    result = callback(arg)
    if result is not None and inspect.isawaitable(result):
        await result


class PerfStream:
    """Every CPU ring of a PERF_EVENT_ARRAY map, as an asyncio event stream.

    ``source`` is an :class:`aperf.Map`, the fd of a perf event array loaded by
    anything else, or the path of a pinned map. Open it with ``async with``
    (or ``await stream.open()`` and ``await stream.aclose()``), then either
    iterate it (``async for event in stream``, or ``stream.batches()``) or,
    given callbacks, ``await stream.run()``.
    """

    def __init__(
        self,
        source: MapSource,
        *,
        pages: int | None = None,
        ring_bytes: int | None = None,
        decoder: DecoderSpec = None,
        wakeup: Wakeup | str | None = None,
        max_pending: int = DEFAULT_MAX_PENDING,
        decode_errors: DecodeErrorPolicy = "item",
        on_sample: Callback | None = None,
        on_lost: Callback | None = None,
        on_batch: Callable[[list[Any]], Any] | None = None,
        on_decode_error: Callback | None = None,
    ) -> None:
        # Everything is validated here, before any ring exists.
        self._source = source
        self._pages = ring_pages(pages, ring_bytes)
        self._wakeup = resolve_wakeup(wakeup)
        self._decoder = resolve_decoder(decoder, source)
        self._max_pending = max_pending
        self._decode_errors = decode_errors
        if on_batch is not None and (on_sample or on_lost):
            raise ValueError("give on_batch, or on_sample/on_lost, not both")
        self._on_sample = on_sample
        self._on_lost = on_lost
        self._on_batch = on_batch
        self._on_decode_error = on_decode_error
        self._rings: RingSet | None = None
        self._core: StreamCore | None = None
        self._watcher: RingWatcher | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._quiet_ticks = 0  # drain-timer ticks in a row that found nothing
        self._idle = False  # the drain timer runs at idle_latency
        self._timer_parked = False  # stopped while the queue is full
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False
        self._held: deque[Any] = deque()  # built events, handed out before the core's

    # --- opening and closing -----------------------------------------------------------

    async def open(self) -> None:
        """Open the rings and register them with the running loop."""
        if self._closed:
            raise ClosedResourceError("this PerfStream was closed; make a new one")
        if self._rings is not None:
            return
        loop = asyncio.get_running_loop()
        rings = RingSet(self._source, self._pages, self._wakeup)
        try:
            self._core = StreamCore(
                rings.readers,
                decoder=self._decoder,
                decode_errors=self._decode_errors,
                max_pending=self._max_pending,
                ring_bytes=rings.ring_bytes,
                memory_bytes=rings.memory_bytes,
            )
            self._watcher = FdWatcher(loop, rings.fds, self._on_ready)
        except BaseException:
            rings.free()
            raise
        self._rings = rings
        self._loop = loop
        if self._wakeup.batched and self._wakeup.max_latency is not None:
            self._start_timer()
        log.info(
            "perf stream opened",
            map=rings.name,
            cpus=sorted(rings.readers),
            ring_bytes=rings.ring_bytes,
            memory_bytes=rings.memory_bytes,
            wakeup=self._wakeup,
        )

    async def __aenter__(self) -> PerfStream:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop watching, take what the rings still hold, free them. Idempotent.

        Events taken out of the rings stay readable: a consumer iterating the
        stream gets them, then the iteration ends.
        """
        self._close_now()

    def close(self) -> None:
        """Close from any thread (blocks until the loop thread has closed the stream)."""
        loop = self._loop
        if loop is None or loop.is_closed() or not loop.is_running():
            self._close_now()
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._close_now()
            return
        done = threading.Event()

        def close_in_loop() -> None:
            try:
                self._close_now()
            finally:
                done.set()

        loop.call_soon_threadsafe(close_in_loop)
        done.wait()

    def _close_now(self) -> None:
        if self._closed:
            return
        self._closed = True  # 1. mark closed
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        watcher, self._watcher = self._watcher, None
        rings, self._rings = self._rings, None
        core = self._core
        try:
            if watcher is not None:
                watcher.stop()  # 2. no loop callback may touch the rings from now on
            if core is not None:
                core.drain_all(force=True)
                core.detach_rings()  # freed next: nothing may read them again
        finally:
            try:
                if rings is not None:
                    rings.free()  # 3. views dropped, rings unmapped, fds closed, slots deleted
            finally:
                if core is not None:
                    core.closed = True
                    core.log_summary("perf stream closed")
                self._wake()

    @property
    def closed(self) -> bool:
        return self._closed

    # --- loop callbacks -----------------------------------------------------------------

    def _on_ready(self, cpu: int) -> None:
        core = self._core
        if core is None or self._closed:
            return
        try:
            added = core.woken(cpu)
        except Exception as exc:  # never let it reach the loop's handler to be printed
            core.push_failure(exc)
            added = 1
        if self._idle:
            self._end_idle()
        if cpu in core.broken and self._watcher is not None:
            self._watcher.forget(cpu)
        if added:
            self._wake()

    def _tick(self) -> None:
        core = self._core
        if core is None or self._closed or self._loop is None:
            return
        try:
            added = core.drain_all()  # when full, this marks the rings stalled
        except Exception as exc:
            core.push_failure(exc)
            added = 1
        if added:
            self._wake()
        if core.paused:
            # Backpressure is not silence, and a full queue takes nothing: park the
            # timer (no ticks while nobody reads); resuming restarts it at max_latency.
            self._quiet_ticks = 0
            self._timer = None
            self._timer_parked = True
            return
        if added:
            self._quiet_ticks = 0
        else:
            self._quiet_ticks += 1
        self._timer = self._loop.call_later(self._timer_period(), self._tick)

    def _start_timer(self) -> None:
        assert self._loop is not None and self._wakeup.max_latency is not None
        self._timer_parked = False
        self._idle = False
        self._timer = self._loop.call_later(self._wakeup.max_latency, self._tick)

    def _timer_period(self) -> float:
        wakeup = self._wakeup
        assert wakeup.max_latency is not None
        idle = wakeup.idle_latency
        if idle is not None and self._quiet_ticks * wakeup.max_latency >= IDLE_AFTER:
            self._idle = True
            return idle
        self._idle = False
        return wakeup.max_latency

    def _end_idle(self) -> None:
        """Traffic after a silence: bring the drain timer back to max_latency now."""
        self._quiet_ticks = 0
        if self._timer is not None:
            self._timer.cancel()
            self._start_timer()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def flush(self) -> int:
        """Take everything the rings hold now (below any wakeup threshold); events added."""
        core = self._require_open()
        added = core.drain_all(force=True)
        if added:
            self._wake()
        return added

    # --- consuming ---------------------------------------------------------------------

    def _require_open(self) -> StreamCore:
        if self._core is None:
            raise ClosedResourceError(
                "the stream is not open: use 'async with PerfStream(...)' or 'await stream.open()'"
            )
        return self._core

    async def _wait(self) -> None:
        if self._waiter is not None:
            raise BusyResourceError("another task is already reading this stream")
        loop = self._loop
        assert loop is not None
        waiter = loop.create_future()
        self._waiter = waiter
        try:
            await waiter
        finally:
            self._waiter = None

    def __aiter__(self) -> AsyncIterator[Any]:
        # An async generator costs less per item than a coroutine per __anext__.
        return self._events()

    async def __anext__(self) -> Any:
        """One event (``await anext(stream)``); ``async for`` uses a cheaper path."""
        core = self._require_open()
        while True:
            batch = self._take(core, 1)
            if batch:
                return batch[0]
            if self._closed:
                raise StopAsyncIteration
            await self._wait()

    def _take(self, core: StreamCore, max_items: int) -> list[Any]:
        held = self._held
        if held:
            if len(held) <= max_items:
                batch = list(held)
                held.clear()
                return batch
            return [held.popleft() for _ in range(max_items)]
        # Drain before taking: what this drains must be in this batch, or a consumer
        # that finds the batch empty would wait for a wakeup that never comes.
        try:
            if core.paused:
                core.maybe_resume()
                if not core.paused and self._timer_parked:
                    self._start_timer()
            else:
                # A consumer with events in hand never yields to the loop, so no
                # readiness callback runs meanwhile: do their work for them before
                # a ring overflows.
                core.drain_filling()
        except Exception as exc:  # pragma: no cover - drain converts ring errors itself
            core.push_failure(exc)
        return core.take(max_items)

    def _put_back(self, events: list[Any]) -> None:
        self._held.extendleft(reversed(events))

    async def _events(self) -> AsyncIterator[Any]:
        # Events are built a batch at a time into self._held and handed out one by
        # one. The batch lives on the stream, not in this generator, so when a
        # consumer stops (break, cancellation, an exception in its loop body) the
        # next iteration continues exactly where it left off: nothing is dropped.
        core = self._require_open()
        held = self._held
        popleft = held.popleft
        while True:
            if held:
                yield popleft()
                continue
            batch = self._take(core, _ITER_BATCH)
            if batch:
                held.extend(batch)
            elif self._closed:
                return
            else:
                await self._wait()

    async def batches(self, max_items: int = DEFAULT_BATCH) -> AsyncIterator[list[Any]]:
        """Yield lists of up to ``max_items`` events, in stream order, without a per-item await."""
        if max_items < 1:
            raise ValueError(f"max_items must be at least 1, not {max_items}")
        core = self._require_open()
        while True:
            batch = self._take(core, max_items)
            if batch:
                yield batch
            elif self._closed:
                return
            else:
                await self._wait()

    async def run(self) -> None:
        """Callback mode: hand every event to the callbacks until the stream closes.

        Callbacks may be plain functions or coroutines. An exception raised by a
        callback propagates out of ``run()``; the events after it stay queued.
        """
        if self._on_batch is None and self._on_sample is None:
            raise ValueError("run() needs on_sample (and on_lost) or on_batch callbacks")
        self._require_open()
        async for batch in self.batches():
            if self._on_batch is not None:
                await _call(self._on_batch, batch)
                continue
            await self._dispatch(batch)

    async def _dispatch(self, batch: list[Any]) -> None:
        # The callback is called inline and awaited only when it returned an
        # awaitable: a coroutine layer per event cost ~290 ns (measured).
        on_sample, on_lost = self._on_sample, self._on_lost
        isawaitable = inspect.isawaitable
        index = 0
        try:
            for index, event in enumerate(batch):  # noqa: B007 - index is used on error
                cls = event.__class__
                if cls is Sample:
                    result = on_sample(event)  # type: ignore[misc]
                elif cls is Lost:
                    if on_lost is None:
                        continue
                    result = on_lost(event)
                elif self._on_decode_error is not None:
                    result = self._on_decode_error(event)
                else:
                    raise event.error
                if result is not None and isawaitable(result):  # isawaitable(None): ~150 ns
                    await result
        except BaseException:
            self._put_back(batch[index + 1 :])
            raise

    # --- introspection -------------------------------------------------------------------

    def statistics(self) -> StreamStatistics:
        """Per-CPU samples, lost, bytes and wakeups; queue depth; memory."""
        stats = self._require_open().statistics()
        period = None
        if self._timer is not None or self._timer_parked:
            period = self._wakeup.idle_latency if self._idle else self._wakeup.max_latency
        return dataclasses.replace(
            stats, pending=stats.pending + len(self._held), drain_period=period
        )

    @property
    def cpus(self) -> list[int]:
        return sorted(self._require_open().counters)

    @property
    def wakeup(self) -> Wakeup:
        return self._wakeup

