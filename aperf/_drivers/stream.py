"""The async driver: ``async for`` over events, batches, and callback mode.

It only waits: on the rings' readiness handles, on the drain timer at the
reader's deadline, and for the consumer. What to do then is the reader's.
"""

from __future__ import annotations

import inspect
import os
import struct
import threading
import warnings
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import AbstractAsyncContextManager as AsyncContextManager
from functools import partial
from typing import TYPE_CHECKING, Any, overload

from .._errors import BusyResourceError, ClosedResourceError
from .._events import BadSample, Event, Lost, Sample, SampleArray, StreamStatistics, T
from .._naming import Subscriptable
from .._options import DEFAULT_MAX_PENDING, DecodeErrorPolicy, Wakeup, check_max_rows
from .._reading.callbacks import Handlers, check_callback
from .._reading.order import DEFAULT_LATENESS
from .._reading.reader import DEFAULT_BATCH, Reader
from .._reading.snapshot import snapshot
from .._rings.seam import set_paused
from .._waiting import current_binding
from .._waiting.base import LoopBinding
from .items import Items, batches, fast
from .lifetime import OpenReader, weak_callback
from .setup import ReaderOptions, SourceSpec, check_arrays_order

if TYPE_CHECKING:
    from .._reading.columnar import ArrayItem
    from .._recording.writer import RecorderStatistics

Callback = Callable[[Any], Any]
CLOSE_TIMEOUT = 10.0
"""Seconds ``close()`` from another thread waits for the loop to run the close."""


def _on_loop_thread(loop: LoopBinding) -> Callable[[Callable[[], None]], bool]:
    """How a dropped stream's release gets to its loop's thread, when that runs elsewhere."""

    def hand_over(release: Callable[[], None]) -> bool:
        return loop.running() and not loop.in_loop_thread() and loop.call_soon_threadsafe(release)

    return hand_over


# scripts/driver_keywords.py copies the Args: entries of the keywords PerfBuffer shares
# into its docstring, and writes the overloads of __init__ from its signature: run it
# after editing either (scripts/check.sh fails until then).
class PerfStream(Subscriptable[T]):
    """Every ring of a source as an async stream: one per CPU of a perf event array,
    the one ring of a BPF ring buffer (``BPF_MAP_TYPE_RINGBUF``, ``Sample.cpu`` -1).

    It runs on asyncio, uvloop and trio (directly or through anyio). Open it with
    ``async with`` (or ``await stream.open()`` and ``await stream.aclose()``), then
    iterate it (``async for event in stream``, ``stream.batches()``, or
    ``stream.arrays()`` for NumPy arrays: docs/columnar.md) or hand the events to
    callbacks (``await stream.run(on_sample)``, ``run_batches(on_batch)``,
    ``run_arrays(on_array)``). Events are ``aperf.Sample[T] | aperf.Lost |
    aperf.BadSample``, where ``T`` is what the decoder returns.

    Opened on every online CPU (no ``cpus=``), it follows CPU hotplug: a CPU that goes
    offline has its ring drained and its losses reported, one that comes online gets a
    ring (docs/rings.md, "CPU hotplug").

    Args:
        source: what to read: an ``aperf.Map``, the fd of such a map loaded by anything
            else, or the path of a pinned map (the map's type picks how it is read: a
            perf event array, or a BPF ring buffer); or a ring source
            (``aperf.RingBufferSource``, ``aperf.testing.FakeRingSource``). Or several
            of them, perf event arrays and ring buffers mixed: a mapping of names to
            them, or a list or tuple (named by ``aperf.Map.name``, else "map0", "map1"...);
            events then say their map (``event.map``) and real CPU, and the options
            apply to each map where they make sense (docs/rings.md, "Several maps in
            one stream").
        pages: pages per ring, a power of two (default ``aperf.DEFAULT_PAGES``, 128, per
            CPU). Give ``pages`` or ``ring_bytes``, not both; neither for a BPF ring
            buffer, whose size is the map's own.
        ring_bytes: bytes per ring instead, rounded up to a power-of-two page count.
        decoder: what ``Sample.value`` holds: None (only the raw ``Sample.data``), the
            name of a struct or typedef in the BTF of the map's ``aperf.BPFObject``, a
            ``ctypes.Structure`` subclass, a ``struct.Struct``, or any callable that
            takes a sample's ``bytes`` and returns its value (docs/decoding.md). With
            several maps: one for all, or a mapping of map names to decoders (a map left
            out gets raw samples).
        wakeup: when the kernel wakes the reader: an ``aperf.Wakeup``, or a preset name
            ("lowest-latency", "balanced", "throughput"); None: ``Wakeup.balanced()``.
        max_pending: events the stream queues before it stops draining its rings
            (backpressure: the rings then fill, and the producer's drops are counted
            as lost); an int of at least 1.
        decode_errors: what becomes of a sample the decoder cannot decode: "item" (a
            ``BadSample`` in the stream, in order), "raise" (a ``DecodeError`` raised to
            the consumer where the sample was) or "skip"; each is counted in
            ``statistics().decode_errors``.
        on_sample: deprecated: give it to ``await stream.run(on_sample)``.
        on_lost: deprecated: ``run(on_sample, on_lost=...)``.
        on_decode_error: deprecated: ``run(on_sample, on_decode_error=...)``.
        on_array: deprecated: ``run_arrays(on_array)``.
        on_batch: deprecated: ``run_batches(on_batch)``.
        cpus: the CPUs to open rings on (a perf event array only; default: every online
            CPU whose id is a slot of the map). A CPU that is not possible on the host,
            or offline at open, is an ``ArgumentError``; samples the BPF program emits on
            another CPU find an empty slot and fail there with ``-ENOENT``, counted by the
            BPF side only, never in this stream's ``Lost`` or ``statistics()``
            (docs/rings.md, "Some CPUs, or several channels per CPU").
        map_keys: index for index with ``cpus``, the map slot of each ring instead of its
            CPU id (a BPF program picks it with ``BPF_F_INDEX_MASK``: several channels per
            CPU); each ring's key, what ``Sample.cpu``, ``Lost.cpu`` and ``statistics()``
            say, is then its map key. Unique, and below the map's ``max_entries``.
        memory_bytes: instead of ``pages``/``ring_bytes``, a budget for all the rings
            together, rounded down: each ring gets the largest power-of-two page count for
            which the rings, with their metadata pages, stay within it; a budget no ring
            size meets is a ``RingSizeError`` naming the smallest and largest possible
            (docs/rings.md, "A memory budget").
        take_over: False (the default): opening a map that another aperf reader holds,
            in any process, raises ``BusyResourceError`` naming its pid. True: ask that
            reader to give the map up; its stream then ends with
            ``aperf.TakenOverError`` (docs/rings.md, "Two readers of one map").
        overwritable: True: flight-recorder rings (a perf event array only): the kernel
            keeps overwriting the oldest records with the newest and never drops; the rings
            are not read on wakeups (nothing is delivered or counted as lost) but on demand,
            by ``snapshot()`` (docs/rings.md, "The last N seconds before an incident").
        order_by: None (the default): each ring's events in ring order, the rings one
            after another. A field of the decoded value (e.g. ``"ts"``, a
            ``bpf_ktime_get_ns()`` timestamp; dotted for a nested struct), or a callable
            ``key(sample)`` (events only, not arrays): events in that order across every
            ring, each held until no ring can still bring an earlier one, or for at most
            ``lateness``; one that comes later than that is delivered anyway, flagged
            ``late`` and counted (``statistics().late``). docs/ordering.md.
        lateness: seconds an ordered stream holds an event at most (default 0.1).
    """

    @overload
    def __init__(
        self: PerfStream[None],
        source: SourceSpec,
        *,
        pages: int | None = ...,
        ring_bytes: int | None = ...,
        decoder: None = ...,
        wakeup: Wakeup | str | None = ...,
        max_pending: int = ...,
        decode_errors: DecodeErrorPolicy = ...,
        on_sample: Callback | None = ...,
        on_lost: Callback | None = ...,
        on_decode_error: Callback | None = ...,
        on_array: Callable[[SampleArray], Any] | None = ...,
        on_batch: Callable[[list[Event[None]]], Any] | None = ...,
        cpus: Iterable[int] | None = ...,
        map_keys: Iterable[int] | None = ...,
        memory_bytes: int | None = ...,
        take_over: bool = ...,
        overwritable: bool = ...,
        order_by: str | Callable[[Any], Any] | None = ...,
        lateness: float = ...,
    ) -> None: ...

    @overload
    def __init__(
        self: PerfStream[Any],
        source: SourceSpec,
        *,
        pages: int | None = ...,
        ring_bytes: int | None = ...,
        decoder: str | type | struct.Struct | Mapping[str, Any],
        wakeup: Wakeup | str | None = ...,
        max_pending: int = ...,
        decode_errors: DecodeErrorPolicy = ...,
        on_sample: Callback | None = ...,
        on_lost: Callback | None = ...,
        on_decode_error: Callback | None = ...,
        on_array: Callable[[SampleArray], Any] | None = ...,
        on_batch: Callable[[list[Event[Any]]], Any] | None = ...,
        cpus: Iterable[int] | None = ...,
        map_keys: Iterable[int] | None = ...,
        memory_bytes: int | None = ...,
        take_over: bool = ...,
        overwritable: bool = ...,
        order_by: str | Callable[[Any], Any] | None = ...,
        lateness: float = ...,
    ) -> None: ...

    @overload
    def __init__(
        self: PerfStream[T],
        source: SourceSpec,
        *,
        pages: int | None = ...,
        ring_bytes: int | None = ...,
        decoder: Callable[[bytes], T],
        wakeup: Wakeup | str | None = ...,
        max_pending: int = ...,
        decode_errors: DecodeErrorPolicy = ...,
        on_sample: Callback | None = ...,
        on_lost: Callback | None = ...,
        on_decode_error: Callback | None = ...,
        on_array: Callable[[SampleArray], Any] | None = ...,
        on_batch: Callable[[list[Event[T]]], Any] | None = ...,
        cpus: Iterable[int] | None = ...,
        map_keys: Iterable[int] | None = ...,
        memory_bytes: int | None = ...,
        take_over: bool = ...,
        overwritable: bool = ...,
        order_by: str | Callable[[Any], Any] | None = ...,
        lateness: float = ...,
    ) -> None: ...

    def __init__(
        self,
        source: SourceSpec,
        *,
        pages: int | None = None,
        ring_bytes: int | None = None,
        decoder: Any = None,
        wakeup: Wakeup | str | None = None,
        max_pending: int = DEFAULT_MAX_PENDING,
        decode_errors: DecodeErrorPolicy = "item",
        on_sample: Callback | None = None,
        on_lost: Callback | None = None,
        on_decode_error: Callback | None = None,
        on_array: Callable[[SampleArray], Any] | None = None,
        on_batch: Callable[[list[Any]], Any] | None = None,
        cpus: Iterable[int] | None = None,
        map_keys: Iterable[int] | None = None,
        memory_bytes: int | None = None,
        take_over: bool = False,
        overwritable: bool = False,
        order_by: str | Callable[[Any], Any] | None = None,
        lateness: float = DEFAULT_LATENESS,
    ) -> None:
        # Everything is checked here, before any ring exists.
        self._options = ReaderOptions.check(
            source, pages=pages, ring_bytes=ring_bytes, wakeup=wakeup, decoder=decoder,
            max_pending=max_pending, decode_errors=decode_errors, cpus=cpus, map_keys=map_keys,
            memory_bytes=memory_bytes, take_over=take_over,
            overwritable=overwritable,
            order_by=order_by, lateness=lateness,
        )
        if on_batch is not None and (on_sample or on_lost):
            raise ValueError("give on_batch, or on_sample/on_lost, not both")
        if on_batch is not None:
            check_callback("on_batch", on_batch)
        self._on_batch = on_batch
        self._handlers: Handlers | None = None
        if on_array is not None:
            if on_batch is not None or on_sample is not None:
                raise ValueError("give on_array (columnar), or on_sample/on_batch, not both")
            self._handlers = Handlers(None, on_lost, on_decode_error, on_array)
            self._options.check_columns()  # NumPy and a decoder with a layout, now
        elif on_sample is not None:
            self._handlers = Handlers(on_sample, on_lost, on_decode_error)
        elif on_lost is not None or on_decode_error is not None:
            raise ValueError("on_lost and on_decode_error go with an on_sample or on_array "
                             "callback")
        if self._handlers is not None or on_batch is not None:
            warnings.warn(
                "PerfStream's callback keywords are deprecated: give the callbacks to the "
                "method that uses them, await stream.run(on_sample, on_lost=..., "
                "on_decode_error=...), run_batches(on_batch) or run_arrays(on_array, ...)",
                DeprecationWarning,
                stacklevel=2,
            )
        self._reader: Reader | None = None
        self._loop: LoopBinding | None = None
        self._held: OpenReader | None = None
        self._timer_at: float | None = None
        self._closed = False
        self._close_lock = threading.Lock()

    # --- opening and closing -----------------------------------------------------------

    async def open(self) -> None:
        """Open the rings and register their readiness handles with the running loop."""
        if self._closed:
            raise ClosedResourceError("this PerfStream was closed; make a new one")
        if self._reader is not None:
            return
        source = self._options.source
        loop = current_binding(source.handle_kind)
        reader = self._options.open(loop.time)
        held = OpenReader(reader, loop.stop, what="PerfStream", noun="perf stream",
                          stop_in_child=False, hand_over=_on_loop_thread(loop))
        try:
            # Weakly: a registration must not keep a dropped stream alive. Arming a
            # perf fd polls it, which takes a wakeup that came between opening the rings
            # and arming them, unreported: the binding calls _on_armed once the loop has
            # armed each handle (uvloop arms on its next iteration), to look then.
            loop.watch(reader.handles(), weak_callback(self._on_ready), source.acknowledge,
                       weak_callback(self._on_armed))
        except BaseException:
            held.release()
            raise
        self._reader = reader
        self._loop = loop
        self._held = held
        self._tick_callback = weak_callback(self._tick)
        held.opened(self, "'async with' or aclose()")
        self._sync_timer()

    async def __aenter__(self) -> PerfStream[T]:
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

    def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Close from any thread. From another thread it waits for the loop to do it;
        if the loop stops running meanwhile, it closes here. After ``timeout`` seconds
        of a loop that runs but never gets to it, BusyResourceError."""
        loop = self._loop
        if loop is None or loop.in_loop_thread() or not loop.running():
            self._close_now()
            return
        done = threading.Event()
        failed: list[BaseException] = []

        def close_in_loop() -> None:
            # Hand a failure back to the closing thread: raised on the loop it would
            # only be logged (asyncio) or crash the run (trio).
            try:
                self._close_now()
            except BaseException as exc:
                failed.append(exc)
            finally:
                done.set()

        if not loop.call_soon_threadsafe(close_in_loop):
            self._close_now()
            return
        waited = 0.0
        while not done.wait(0.02):
            waited += 0.02
            if not loop.running():
                self._close_now()  # the loop stopped before running it: nobody else reads
                return
            if waited >= timeout:
                raise BusyResourceError(
                    f"the event loop did not run the close of this stream within {timeout} s"
                )
        if failed:
            raise failed[0]

    def _close_now(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True  # mark closed, then close in the lifetime's order
        held = self._held
        if held is None:
            return
        forked = held.forked
        try:
            held.close()
        finally:
            if not forked:
                self._wake()  # then a parked consumer sees the end

    @property
    def closed(self) -> bool:
        """Whether the stream was closed (its queued events stay readable)."""
        return self._closed

    # --- loop callbacks -----------------------------------------------------------------

    def _live_reader(self) -> Reader | None:
        """The reader, while the loop's callbacks may act on it."""
        reader, held = self._reader, self._held
        if reader is None or held is None or held.forked or self._closed:
            return None
        return reader

    @staticmethod
    def _step(reader: Reader, step: Callable[[], int]) -> int:
        """Events a reader's step added; a failure is queued for the consumer (counted 1)."""
        try:
            return step()
        except Exception as exc:  # never let it reach the loop's handler to be printed
            reader.push_failure(exc)
            return 1

    def _on_ready(self, handle: int) -> None:
        # Once per wakeup: inline, no helper calls (see _step).
        reader, held = self._reader, self._held
        if reader is None or held is None or held.forked or self._closed:
            return
        try:
            added = reader.on_ready(handle)
        except Exception as exc:  # never let it reach the loop's handler to be printed
            reader.push_failure(exc)
            added = 1
        if reader.finished:  # the source came to its end (a replay): close, as aclose()
            self._close_now()
            return
        if not reader.watches(handle) and self._loop is not None:
            self._loop.forget(handle)
        watch, forget = reader.handle_changes()  # CPU hotplug: rings retired and added
        if self._loop is not None and (watch or forget):
            for gone in forget:
                self._loop.forget(gone)
            # The new rings are looked at once they are armed (_on_armed).
            self._loop.watch(watch, weak_callback(self._on_ready), reader.source.acknowledge,
                             weak_callback(self._on_armed))
        if added:
            self._wake()
        if reader.deadline != self._timer_at:
            self._sync_timer()

    def _on_armed(self, handle: int) -> None:
        """The loop armed ``handle``: look at its rings (the arm may have taken a wakeup)."""
        reader = self._live_reader()
        if reader is None:
            return
        if self._step(reader, partial(reader.look, handle)):
            self._wake()
        if reader.deadline != self._timer_at:
            self._sync_timer()

    def _tick(self) -> None:
        self._timer_at = None
        reader = self._live_reader()
        if reader is None:
            return
        if self._step(reader, reader.tick):
            self._wake()
        self._sync_timer()

    def _sync_timer(self) -> None:
        """Set the loop's timer to the reader's deadline."""
        reader, loop = self._reader, self._loop
        if reader is None or loop is None or self._closed:
            return
        at = reader.deadline
        self._timer_at = at
        loop.schedule(at, self._tick_callback)

    def _wake(self) -> None:
        loop = self._loop
        if loop is None:
            return
        if loop.in_loop_thread():
            loop.wake()
        else:
            loop.call_soon_threadsafe(loop.wake)

    def flush(self) -> int:
        """Take everything the rings hold now (below any wakeup threshold); events added."""
        reader = self._require_open()
        added = reader.flush()
        if added:
            self._wake()
        return added

    def pause(self) -> None:
        """Stop the producer at the source: the map's slots for this stream's rings are
        emptied, so the BPF program's ``bpf_perf_event_output()`` fails with
        ``-ENOENT`` instead of filling the rings. Samples already in the rings are
        still delivered; those refused while paused are neither delivered nor
        counted as lost by aperf (the BPF side's own failure count is the truth).
        Idempotent. A BPF ring buffer has no slots: ``UnsupportedError``."""
        set_paused(self._require_live().source, True)

    def resume(self) -> None:
        """Put this stream's rings back into the map's slots (idempotent)."""
        set_paused(self._require_live().source, False)

    def snapshot(self, order_by: str | None = None) -> list[Event[Any]]:
        """The newest records of every flight-recorder ring (``overwritable=True``), as
        events in stream order: each CPU's oldest first, the CPUs one after another in
        key order, or, with ``order_by`` (a field of the decoded values, e.g. a
        ``bpf_ktime_get_ns()`` timestamp), merged across CPUs by that field.

        Synchronous, and short: the producer is paused (``pause()``) while each ring is
        read from its newest record back to its oldest complete one, then resumed
        (unless it was paused already). The rings keep their records: a second
        snapshot sees them again, with what came since. Decoding follows
        ``decode_errors``. ``UnsupportedError`` without flight-recorder rings."""
        return snapshot(self._require_live(), order_by)

    # --- consuming ---------------------------------------------------------------------

    def _require_open(self) -> Reader:
        held = self._held
        if held is None:
            raise ClosedResourceError(
                "the stream is not open: use 'async with PerfStream(...)' or 'await stream.open()'"
            )
        return held.usable()

    def _require_live(self) -> Reader:
        """The reader, for what needs the rings themselves (not only what the close left
        queued, or the final counts): ClosedResourceError once closed."""
        reader = self._require_open()
        if self._closed:
            raise ClosedResourceError("this PerfStream is closed")
        return reader

    def _take(self, reader: Reader, max_items: int) -> list[Event[T]]:
        batch = reader.take(max_items)
        if reader.deadline != self._timer_at:
            self._sync_timer()  # taking resumed a parked timer
        return batch

    def _fill(self, reader: Reader, max_items: int) -> bool:
        filled = reader.fill(max_items)
        if reader.deadline != self._timer_at:
            self._sync_timer()  # taking resumed a parked timer
        return filled

    def _fill_arrays(self, reader: Reader, max_rows: int | None) -> bool:
        filled = reader.fill_arrays(max_rows)
        if reader.deadline != self._timer_at:
            self._sync_timer()
        return filled

    async def _wait(self) -> None:
        assert self._loop is not None
        await self._loop.wait()

    def _ended(self) -> bool:
        return self._closed

    def __aiter__(self) -> AsyncIterator[Event[T]]:
        reader = self._require_open()
        return fast(Items(reader.next_event, partial(self._fill, reader, DEFAULT_BATCH),
                          self._ended, self._wait))

    async def __anext__(self) -> Event[T]:
        """One event (``await anext(stream)``); ``async for`` takes them a batch at a time."""
        reader = self._require_open()
        while True:
            batch = self._take(reader, 1)
            if batch:
                return batch[0]
            if self._closed:
                raise StopAsyncIteration
            await self._wait()

    def batches(self, max_items: int = DEFAULT_BATCH) -> AsyncIterator[list[Event[T]]]:
        """Lists of up to ``max_items`` events, in stream order, without a per-item await:
        ``async for batch in stream.batches(): ...``."""
        if isinstance(max_items, bool) or not isinstance(max_items, int) or max_items < 1:
            raise ValueError(f"max_items must be an int of at least 1, not {max_items!r}")
        reader = self._require_open()
        return self._batches(partial(self._take, reader, max_items))

    def _batches(self, take: Callable[[], list[Any]]) -> AsyncIterator[list[Any]]:
        return fast(batches(take, self._ended, self._wait))

    async def run(
        self,
        on_sample: Callable[[Sample[T]], Any] | None = None,
        *,
        on_lost: Callable[[Lost], Any] | None = None,
        on_decode_error: Callable[[BadSample], Any] | None = None,
    ) -> None:
        """Callback mode: hand every event to the callbacks until the stream closes.

        Args:
            on_sample: called as ``on_sample(sample)`` with each ``aperf.Sample``:
                ``sample.cpu`` (the ring's CPU, -1 for a BPF ring buffer),
                ``sample.data`` (the raw bytes, the caller's own) and ``sample.value``
                (what the decoder made of them; None without one).
            on_lost: called as ``on_lost(lost)`` with each ``aperf.Lost`` notice, in
                order: ``lost.cpu`` and ``lost.count`` (samples the producer dropped
                there). None: losses are only counted (``statistics()``).
            on_decode_error: called as ``on_decode_error(bad)`` with each
                ``aperf.BadSample`` under ``decode_errors="item"``: ``bad.cpu``,
                ``bad.data`` and ``bad.error`` (the ``DecodeError``). None: that
                ``DecodeError`` is raised out of ``run()``.

        Callbacks may be plain functions or coroutine functions (awaited in turn). An
        exception raised by a callback propagates out of ``run()``; the events after
        it stay queued for the next ``run()`` or iteration.
        """
        if on_sample is None:
            handlers, on_batch = self._constructor_callbacks(on_lost, on_decode_error)
            if on_batch is not None:
                await self._run_batches(on_batch)
                return
        else:
            if self._handlers is not None or self._on_batch is not None:
                raise ValueError("callbacks were given to the constructor (deprecated) and to "
                                 "run(): give them to run() only")
            handlers = Handlers(on_sample, on_lost, on_decode_error)
        await self._dispatch(handlers)

    def _constructor_callbacks(
        self, on_lost: object, on_decode_error: object
    ) -> tuple[Handlers, Callable[[list[Any]], Any] | None]:
        handlers, on_batch = self._handlers, self._on_batch
        if handlers is None and on_batch is None:
            raise TypeError("run() needs on_sample: await stream.run(on_sample, on_lost=..., "
                            "on_decode_error=...)")
        if on_lost is not None or on_decode_error is not None:
            raise TypeError("on_lost and on_decode_error go with run(on_sample, ...)")
        warnings.warn(
            "run() with the constructor's callbacks is deprecated: await stream.run(on_sample, "
            "on_lost=..., on_decode_error=...), run_batches(on_batch) or run_arrays(on_array)",
            DeprecationWarning,
            stacklevel=3,
        )
        return handlers, on_batch  # type: ignore[return-value]

    async def run_batches(self, on_batch: Callable[[list[Event[T]]], Any]) -> None:
        """Hand the events to ``on_batch`` a list at a time, until the stream closes.

        Args:
            on_batch: called as ``on_batch(batch)`` with each batch: a list of up to 256
                events (``aperf.Sample``, ``aperf.Lost`` and ``aperf.BadSample``, in
                stream order) as ``batches()`` yields them. A plain function or a
                coroutine function; an exception it raises propagates out of
                ``run_batches()``.
        """
        check_callback("on_batch", on_batch)
        await self._run_batches(on_batch)

    async def _run_batches(self, on_batch: Callable[[list[Any]], Any]) -> None:
        self._require_open()
        isawaitable = inspect.isawaitable
        async for batch in self.batches():
            result = on_batch(batch)
            if result is not None and isawaitable(result):
                await result

    async def run_arrays(
        self,
        on_array: Callable[[SampleArray], Any],
        *,
        on_lost: Callable[[Lost], Any] | None = None,
        on_decode_error: Callable[[BadSample], Any] | None = None,
        max_rows: int | None = None,
    ) -> None:
        """Columnar callback mode: samples as NumPy arrays, until the stream closes.

        Args:
            on_array: called as ``on_array(array)`` with each ``aperf.SampleArray``:
                the samples of one run of one CPU (``array.cpu``), at most ``max_rows``
                of them; ``array.values`` is a read-only NumPy structured array of the
                decoded fields, ``array.tails`` the bytes past the fixed part (a
                flexible array member), if any.
            on_lost: called as ``on_lost(lost)`` with each ``aperf.Lost`` notice
                (``lost.cpu``, ``lost.count``), in order. None: only counted.
            on_decode_error: called as ``on_decode_error(bad)`` with each
                ``aperf.BadSample`` (a sample too short for the decoder). None: the
                ``DecodeError`` is raised out of ``run_arrays()``.
            max_rows: the most rows in one array (None: a whole run), as for ``arrays()``.

        Needs NumPy and a decoder with a layout, as ``arrays()`` does (checked now).
        """
        max_rows = check_max_rows(max_rows)
        handlers = Handlers(None, on_lost, on_decode_error, on_array)
        self._options.check_columns()  # NumPy and a decoder with a layout, now
        check_arrays_order(self._options)
        await self._dispatch(handlers, max_rows)

    async def _dispatch(self, handlers: Handlers, max_rows: int | None = None) -> None:
        reader = self._require_open()
        batches = self._array_batches(max_rows) if handlers.columnar else self.batches()
        async for batch in batches:
            pending = reader.dispatch(batch, handlers)
            for awaitable in pending:
                try:
                    await awaitable
                except BaseException as exc:
                    pending.throw(exc)  # puts the rest of the batch back, re-raises

    # --- columnar batches ----------------------------------------------------------------

    def arrays(self, max_rows: int | None = None) -> AsyncIterator[SampleArray | Lost | BadSample]:
        """Yield samples as NumPy structured arrays, in stream order: an
        ``aperf.SampleArray`` per run of one CPU's samples (at most ``max_rows``
        rows each; None: the whole run), with ``Lost`` and ``BadSample`` in place.

        Needs NumPy (``pip install 'aperf-bpf[numpy]'``: ImportError otherwise) and a
        decoder with a layout (a BTF struct name, ``from_btf``, a ctypes structure or
        a ``struct.Struct``: TypeError otherwise), checked now. Ends, and is
        cancelled, as `batches()` is; see docs/columnar.md.
        """
        max_rows = check_max_rows(max_rows)
        check_arrays_order(self._options)
        reader = self._require_open()
        reader.columns()
        return fast(Items(reader.next_array, partial(self._fill_arrays, reader, max_rows),
                          self._ended, self._wait))

    def lease(self, max_rows: int | None = None) -> AsyncContextManager[list[ArrayItem]]:
        """Columnar batches that view the rings' memory in place, for as long as the
        lease is held: ``async with stream.lease() as batch: ...``.

        ``batch`` is a list of ``aperf.SampleArray``, ``aperf.Lost`` and
        ``aperf.BadSample`` items, in stream order, as ``arrays()`` yields them (at
        most ``max_rows`` rows per array); entering waits for data as ``arrays()``
        does; an empty batch: the stream is closed and has nothing left. The
        arrays of a run view the ring itself; that ring space goes back to the
        kernel when the lease ends, and not before nothing views it: when the lease
        ends, the batch is emptied and its arrays raise ``ClosedResourceError``; a
        NumPy array taken out of one and kept still shows its own records and holds
        its ring space until it is dropped (``.copy()`` what you keep). Needs NumPy
        and a decoder with a layout, as ``arrays()`` does. See docs/columnar.md,
        "Leases: arrays in the ring itself".
        """
        max_rows = check_max_rows(max_rows)
        reader = self._require_open()
        reader.columns()  # NumPy and a decoder with a layout, now
        from .lease import AsyncLease, lease

        return AsyncLease(lease(reader.rings), partial(self._take_arrays, reader, max_rows),
                          self._wait, lambda: self.closed)

    def _array_batches(self, max_rows: int | None) -> AsyncIterator[list[Any]]:
        reader = self._require_open()
        reader.columns()
        return self._batches(partial(self._take_arrays, reader, max_rows))

    def _take_arrays(self, reader: Reader, max_rows: int | None) -> list[Any]:
        batch = reader.take_arrays(max_rows)
        if reader.deadline != self._timer_at:
            self._sync_timer()  # taking resumed a parked timer
        return batch

    # --- recording (docs/recording.md) ----------------------------------------------------

    async def record(
        self, directory: str | os.PathLike[str], *, seconds: float | None = None,
        samples: int | None = None, **options: Any,
    ) -> RecorderStatistics:
        """Write everything this open stream hands out to Parquet files in ``directory``
        until it closes (or ``seconds`` passed, or at least ``samples`` were written):
        the samples, the lost notices with when they came, and per file what it takes
        to read them back (host, kernel, the decoder's layout, the clock offsets).
        ``aperf.replay(directory)`` plays it back. ``options`` are
        ``aperf.Recorder``'s (``max_file_bytes``, ``max_file_seconds``,
        ``on_write_error``, ``compression``...). Needs pyarrow (``aperf-bpf[arrow]``);
        the iteration it does is this stream's: do not iterate it meanwhile."""
        from .._recording.record import record_stream
        from .._recording.writer import Recorder

        reader = self._require_open()
        decoder, maps, columnar = self._options.recorded()
        rings = [(c.map, c.cpu) for c in reader.statistics().cpus]
        recorder = Recorder(directory, decoder, maps=maps, rings=rings,
                            source=reader.source.name, **options)
        return await record_stream(self, recorder, columnar=columnar, max_seconds=seconds,
                                   max_samples=samples)

    # --- introspection -------------------------------------------------------------------

    def statistics(self) -> StreamStatistics:
        """Per-CPU samples, lost, bytes and wakeups; queue depth; memory; the drain period."""
        return self._require_open().statistics()

    @property
    def cpus(self) -> list[int]:
        """The CPUs of the open stream's rings (-1: a BPF ring buffer's), sorted; with
        several maps, each CPU once."""
        return self._require_open().cpus()

    @property
    def wakeup(self) -> Wakeup:
        """The wakeup policy in force."""
        return self._options.wakeup
