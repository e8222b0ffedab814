"""The async driver: ``async for`` over events, batches, and callback mode.

It only waits: on the rings' readiness handles, on the drain timer at the
reader's deadline, and for the consumer. What to do then is the reader's.
"""

from __future__ import annotations

import inspect
import struct
import threading
import warnings
import weakref
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, Generic, overload

from ._errors import BusyResourceError, ClosedResourceError
from ._events import BadSample, Event, Lost, SampleArray, StreamStatistics, T
from ._lifetime import forked_error, track, untrack, weak_callback
from ._log import log
from ._loops import LoopBinding, current_binding
from ._options import Wakeup
from ._reader import (
    DEFAULT_BATCH,
    DEFAULT_MAX_PENDING,
    DecodeErrorPolicy,
    Handlers,
    Reader,
    load_columns,
)
from ._setup import ReaderOptions, SourceSpec
from ._source import set_paused

Callback = Callable[[Any], Any]
CLOSE_TIMEOUT = 10.0
"""Seconds ``close()`` from another thread waits for the loop to run the close."""


class _Held:
    """What an open stream holds: released by close, or at garbage collection."""

    __slots__ = ("__weakref__", "forked", "loop", "reader")

    def __init__(self, loop: LoopBinding, reader: Reader) -> None:
        self.loop = loop
        self.reader = reader
        self.forked = False  # set in a child process that inherited the stream

    def release(self) -> None:
        """Unwatch, then free the rings (the stream's own close drains first)."""
        if self.forked:
            self.reader.source.after_fork()  # never the loop: its epoll is the parent's too
            return
        try:
            self.loop.stop()
        finally:
            self.reader.source.free()


def _release_dropped(held: _Held, name: str) -> None:
    """The stream was garbage-collected without being closed."""
    warnings.warn(
        f"unclosed PerfStream on {name}: use 'async with' or aclose(); its rings were "
        "released at garbage collection",
        ResourceWarning,
        stacklevel=2,
    )
    loop = held.loop
    in_other_thread = not held.forked and loop.running() and not loop.in_loop_thread()
    if in_other_thread and loop.call_soon_threadsafe(held.release):
        return  # the loop thread unwatches and frees
    held.release()


class PerfStream(Generic[T]):
    """Every ring of a source as an async stream: one per CPU of a perf event array,
    the one ring of a BPF ring buffer (``BPF_MAP_TYPE_RINGBUF``, ``Sample.cpu`` -1).

    ``source`` is an [`aperf.Map`][aperf.Map], the fd of such a map loaded by anything
    else, the path of a pinned map (the map's type picks how it is read), or a ring
    source ([`aperf.RingBufferSource`][aperf.RingBufferSource],
    [`aperf.testing.FakeRingSource`][aperf.testing.FakeRingSource]). It runs on
    asyncio, uvloop and trio (directly or through anyio). Open it with ``async with`` (or
    ``await stream.open()`` and ``await stream.aclose()``), then either iterate
    it (``async for event in stream``, or ``stream.batches()``) or, given
    callbacks, ``await stream.run()``. Events are ``Sample[T] | Lost |
    BadSample`` where ``T`` is what the decoder returns. ``stream.arrays()``
    (and ``on_array=`` in callback mode) gives NumPy arrays of samples instead
    (docs/columnar.md).

    A perf event array gets one ring per online CPU, in the slot keyed by its CPU id.
    ``cpus=[...]`` opens rings on those CPUs only (a CPU that is not possible on the
    host, or offline at open, is an ``ArgumentError``); samples the BPF program emits on
    another CPU find an empty slot and fail there with ``-ENOENT``. ``map_keys=[...]``,
    index for index with ``cpus``, puts each ring in that slot of the map instead (a
    BPF program picks it with ``BPF_F_INDEX_MASK``: several channels per CPU); each
    ring's key, what ``Sample.cpu``, ``Lost.cpu`` and ``statistics()`` say, is then its
    map key. Keys must be unique and below the map's ``max_entries``
    (docs/rings.md, "Some CPUs, or several channels per CPU").

    Sizes: ``pages=`` or ``ring_bytes=`` per ring (rounded up to a power-of-two page
    count), or ``memory_bytes=``, a budget for all the rings together (rounded down:
    each ring gets the largest power-of-two page count for which the rings, with
    their metadata pages, stay within it). Sizes in bytes mean the same on hosts with
    64 KiB pages; a budget that no ring size meets is a ``RingSizeError`` that says
    the smallest and largest possible (docs/rings.md, "A memory budget").
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
        on_batch: Callable[[list[Event[None]]], Any] | None = ...,
        on_decode_error: Callback | None = ...,
        on_array: Callable[[SampleArray], Any] | None = ...,
        cpus: Iterable[int] | None = ...,
        map_keys: Iterable[int] | None = ...,
        memory_bytes: int | None = ...,
    ) -> None: ...

    @overload
    def __init__(
        self: PerfStream[Any],
        source: SourceSpec,
        *,
        pages: int | None = ...,
        ring_bytes: int | None = ...,
        decoder: str | type | struct.Struct,
        wakeup: Wakeup | str | None = ...,
        max_pending: int = ...,
        decode_errors: DecodeErrorPolicy = ...,
        on_sample: Callback | None = ...,
        on_lost: Callback | None = ...,
        on_batch: Callable[[list[Event[Any]]], Any] | None = ...,
        on_decode_error: Callback | None = ...,
        on_array: Callable[[SampleArray], Any] | None = ...,
        cpus: Iterable[int] | None = ...,
        map_keys: Iterable[int] | None = ...,
        memory_bytes: int | None = ...,
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
        on_batch: Callable[[list[Event[T]]], Any] | None = ...,
        on_decode_error: Callback | None = ...,
        on_array: Callable[[SampleArray], Any] | None = ...,
        cpus: Iterable[int] | None = ...,
        map_keys: Iterable[int] | None = ...,
        memory_bytes: int | None = ...,
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
        on_batch: Callable[[list[Any]], Any] | None = None,
        on_decode_error: Callback | None = None,
        on_array: Callable[[SampleArray], Any] | None = None,
        cpus: Iterable[int] | None = None,
        map_keys: Iterable[int] | None = None,
        memory_bytes: int | None = None,
    ) -> None:
        # Everything is checked here, before any ring exists.
        self._options = ReaderOptions.check(
            source, pages=pages, ring_bytes=ring_bytes, wakeup=wakeup, decoder=decoder,
            max_pending=max_pending, decode_errors=decode_errors, cpus=cpus, map_keys=map_keys,
            memory_bytes=memory_bytes,
        )
        if on_batch is not None and (on_sample or on_lost):
            raise ValueError("give on_batch, or on_sample/on_lost, not both")
        if on_batch is not None and not callable(on_batch):
            raise TypeError(f"on_batch must be callable, not {type(on_batch).__name__}")
        self._on_batch = on_batch
        self._handlers: Handlers | None = None
        if on_array is not None:
            if on_batch is not None or on_sample is not None:
                raise ValueError("give on_array (columnar), or on_sample/on_batch, not both")
            self._handlers = Handlers(None, on_lost, on_decode_error, on_array)
            load_columns(self._options.decoder)  # NumPy and a decoder with a layout, now
        elif on_sample is not None:
            self._handlers = Handlers(on_sample, on_lost, on_decode_error)
        elif on_lost is not None or on_decode_error is not None:
            raise ValueError("on_lost and on_decode_error go with an on_sample or on_array "
                             "callback")
        self._reader: Reader | None = None
        self._loop: LoopBinding | None = None
        self._held: _Held | None = None
        self._finalizer: Any = None  # weakref.finalize, once open
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
        held = _Held(loop, reader)
        try:
            # Weakly: a registration must not keep a dropped stream alive.
            handles = list({ring.handle: None for ring in reader.rings.values()})
            loop.watch(handles, weak_callback(self._on_ready), source.acknowledge)
        except BaseException:
            held.release()
            raise
        self._reader = reader
        self._loop = loop
        self._held = held
        self._tick_callback = weak_callback(self._tick)
        track(held)
        self._finalizer = weakref.finalize(self, _release_dropped, held, source.name)
        # Arming a perf fd polls it, which clears a wakeup that came between opening the
        # rings and arming them; uvloop arms on its next iteration. So the first look
        # at the rings is a tick of the drain timer, due now: it runs on the loop after
        # the arm (the trio binding looks once more after its own first arm).
        reader.deadline = loop.time()
        self._sync_timer()
        log.info(
            "perf stream opened",
            source=source.name,
            cpus=sorted(reader.rings),
            ring_bytes=reader.ring_bytes,
            memory_bytes=reader.memory_bytes,
            wakeup=reader.wakeup,
            lost_counter=reader.lost_counter,
        )

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
            self._closed = True  # 1. mark closed
        held, finalizer = self._held, self._finalizer
        if finalizer is not None:
            finalizer.detach()
        if held is None:
            return
        untrack(held)
        if held.forked:
            held.release()  # the child's fds only; the parent's rings and loop untouched
            return
        try:
            held.loop.stop()  # 2. no loop callback may touch the rings from now on
            held.reader.close()  # takes what the rings hold; forgets them
        finally:
            try:
                held.reader.source.free()  # 3. rings unmapped, handles closed
            finally:
                held.reader.log_summary("perf stream closed")
                self._wake()  # 4. a parked consumer sees the end

    @property
    def closed(self) -> bool:
        """Whether the stream was closed (its queued events stay readable)."""
        return self._closed

    # --- loop callbacks -----------------------------------------------------------------

    def _on_ready(self, handle: int) -> None:
        reader, held = self._reader, self._held
        if reader is None or held is None or held.forked or self._closed:
            return
        try:
            added = reader.on_ready(handle)
        except Exception as exc:  # never let it reach the loop's handler to be printed
            reader.push_failure(exc)
            added = 1
        if not reader.watches(handle) and self._loop is not None:
            self._loop.forget(handle)
        if added:
            self._wake()
        if reader.deadline != self._timer_at:
            self._sync_timer()

    def _tick(self) -> None:
        self._timer_at = None
        reader, held = self._reader, self._held
        if reader is None or held is None or held.forked or self._closed:
            return
        try:
            added = reader.tick()
        except Exception as exc:
            reader.push_failure(exc)
            added = 1
        if added:
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
        set_paused(self._require_open().source, True)

    def resume(self) -> None:
        """Put this stream's rings back into the map's slots (idempotent)."""
        set_paused(self._require_open().source, False)

    # --- consuming ---------------------------------------------------------------------

    def _require_open(self) -> Reader:
        if self._reader is None:
            raise ClosedResourceError(
                "the stream is not open: use 'async with PerfStream(...)' or 'await stream.open()'"
            )
        if self._held is not None and self._held.forked:
            raise ClosedResourceError(forked_error("PerfStream"))
        return self._reader

    def _take(self, reader: Reader, max_items: int) -> list[Event[T]]:
        batch = reader.take(max_items)
        if reader.deadline != self._timer_at:
            self._sync_timer()  # taking resumed a parked timer
        return batch

    async def _wait(self) -> None:
        assert self._loop is not None
        await self._loop.wait()

    def __aiter__(self) -> AsyncIterator[Event[T]]:
        # An async generator costs less per item than a coroutine per __anext__. But
        # trio warns (ResourceWarning) whenever one is collected unfinished, as after a
        # break out of ``async for``: there, an iterator object serves.
        if self._generators_warn():
            reader = self._require_open()
            return _Items(self, reader.held, lambda: self._take(reader, DEFAULT_BATCH))
        return self._events()

    def _generators_warn(self) -> bool:
        loop = self._loop
        return loop is not None and loop.warns_on_unfinished_generators

    async def __anext__(self) -> Event[T]:
        """One event (``await anext(stream)``); ``async for`` uses a cheaper path."""
        reader = self._require_open()
        while True:
            batch = self._take(reader, 1)
            if batch:
                return batch[0]
            if self._closed:
                raise StopAsyncIteration
            await self._wait()

    async def _events(self) -> AsyncIterator[Event[T]]:
        # Events are built a batch at a time into the reader's front queue and handed
        # out one by one. The queue lives in the reader, not in this generator, so
        # when a consumer stops (break, cancellation, an exception in its loop body)
        # the next iteration continues exactly where it left off: nothing is dropped.
        reader = self._require_open()
        held = reader.held
        popleft = held.popleft
        while True:
            if held:
                yield popleft()
                continue
            batch = self._take(reader, DEFAULT_BATCH)
            if batch:
                # In front: taking may have left events behind it (a columnar
                # consumer's arrays, turned back into events).
                held.extendleft(reversed(batch))
            elif self._closed:
                return
            else:
                await self._wait()

    def batches(self, max_items: int = DEFAULT_BATCH) -> AsyncIterator[list[Event[T]]]:
        """Lists of up to ``max_items`` events, in stream order, without a per-item await:
        ``async for batch in stream.batches(): ...``."""
        if isinstance(max_items, bool) or not isinstance(max_items, int) or max_items < 1:
            raise ValueError(f"max_items must be an int of at least 1, not {max_items!r}")
        reader = self._require_open()
        return _Batches(self, lambda: self._take(reader, max_items))

    async def run(self) -> None:
        """Callback mode: hand every event to the callbacks until the stream closes.

        Callbacks may be plain functions or coroutines. An exception raised by a
        callback propagates out of ``run()``; the events after it stay queued.
        """
        handlers, on_batch = self._handlers, self._on_batch
        if handlers is None and on_batch is None:
            raise ValueError("run() needs on_sample (and on_lost), on_batch or on_array callbacks")
        reader = self._require_open()
        columnar = handlers is not None and handlers.columnar
        async for batch in self._array_batches(None) if columnar else self.batches():
            if on_batch is not None:
                result = on_batch(batch)
                if result is not None and inspect.isawaitable(result):
                    await result
                continue
            assert handlers is not None
            pending = reader.dispatch(batch, handlers)
            for awaitable in pending:
                try:
                    await awaitable
                except BaseException as exc:
                    pending.throw(exc)  # puts the rest of the batch back, re-raises

    # --- columnar batches ----------------------------------------------------------------

    def arrays(self, max_rows: int | None = None) -> AsyncIterator[SampleArray | Lost | BadSample]:
        """Yield samples as NumPy structured arrays, in stream order: a
        [`SampleArray`][aperf.SampleArray] per run of one CPU's samples (at most ``max_rows``
        rows each; None: the whole run), with ``Lost`` and ``BadSample`` in place.

        Needs NumPy (``pip install 'aperf[numpy]'``: ImportError otherwise) and a
        decoder with a layout (a BTF struct name, ``from_btf``, a ctypes structure or
        a ``struct.Struct``: TypeError otherwise), checked now. Ends, and is
        cancelled, as `batches()` is; see docs/columnar.md.
        """
        if max_rows is not None and (
            isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1
        ):
            raise ValueError(f"max_rows must be None or an int of at least 1, not {max_rows!r}")
        reader = self._require_open()
        reader.columns()
        if self._generators_warn():  # trio: see __aiter__
            return _Items(self, reader.held_arrays, lambda: self._take_arrays(reader, max_rows))
        return self._arrays(reader, max_rows)

    async def _arrays(self, reader: Reader, max_rows: int | None) -> AsyncIterator[Any]:
        # As _events: items wait in the reader's front queue, so a consumer that stops
        # iterating (break, cancellation, an exception) loses none of them.
        held = reader.held_arrays
        popleft = held.popleft
        while True:
            if held:
                yield popleft()
                continue
            batch = self._take_arrays(reader, max_rows)
            if batch:
                held.extend(batch)
            elif self._closed:
                return
            else:
                await self._wait()

    def _array_batches(self, max_rows: int | None) -> AsyncIterator[list[Any]]:
        reader = self._require_open()
        reader.columns()
        return _Batches(self, lambda: self._take_arrays(reader, max_rows))

    def _take_arrays(self, reader: Reader, max_rows: int | None) -> list[Any]:
        batch = reader.take_arrays(max_rows)
        if reader.deadline != self._timer_at:
            self._sync_timer()  # taking resumed a parked timer
        return batch

    # --- introspection -------------------------------------------------------------------

    def statistics(self) -> StreamStatistics:
        """Per-CPU samples, lost, bytes and wakeups; queue depth; memory; the drain period."""
        return self._require_open().statistics()

    @property
    def cpus(self) -> list[int]:
        """The ring keys (CPU ids) of the open stream."""
        return sorted(self._require_open().counters)

    @property
    def wakeup(self) -> Wakeup:
        """The wakeup policy in force."""
        return self._options.wakeup


class _Items(Generic[T]):
    """``async for`` over a stream's events (or arrays) without an async generator (see
    ``__aiter__``).

    Like the generators, it keeps nothing of its own: items built and not yet
    handed out wait in the reader's front queue ``held``, so a consumer that stops
    (break, cancellation) loses nothing.
    """

    __slots__ = ("_held", "_stream", "_take")

    def __init__(self, stream: PerfStream[T], held: Any, take: Callable[[], list[Any]]) -> None:
        self._stream = stream
        self._held = held
        self._take = take

    def __aiter__(self) -> _Items[T]:
        return self

    async def __anext__(self) -> Any:
        held = self._held
        while not held:
            stream = self._stream
            batch = self._take()
            if batch:
                # In front: taking may have left items behind it (as in _events).
                held.extendleft(reversed(batch))
            elif stream.closed:
                raise StopAsyncIteration
            else:
                await stream._wait()
        return held.popleft()


class _Batches(Generic[T]):
    """What ``stream.batches()`` returns (and callback mode reads): what ``take`` gives,
    a list at a time, until the stream is closed and nothing is left."""

    __slots__ = ("_stream", "_take")

    def __init__(self, stream: PerfStream[T], take: Callable[[], list[Any]]) -> None:
        self._stream = stream
        self._take = take

    def __aiter__(self) -> _Batches[T]:
        return self

    async def __anext__(self) -> list[Any]:
        stream = self._stream
        while True:
            batch = self._take()
            if batch:
                return batch
            if stream.closed:
                raise StopAsyncIteration
            await stream._wait()
