"""The synchronous driver: libbpf's ``perf_buffer__poll``/``consume`` names, no event loop.

It only waits (``epoll`` on the rings' fds, or ``WaitForMultipleObjects`` on
Windows wait handles; bounded by the reader's drain deadline) and calls the
reader; the policy is the reader's, as for the async driver.
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar, overload

from .._errors import ClosedResourceError
from .._events import BadSample, Event, Lost, Sample, SampleArray, StreamStatistics, T
from .._naming import Subscriptable
from .._options import DEFAULT_MAX_PENDING, DecodeErrorPolicy, Wakeup, check_max_rows
from .._reading.callbacks import Handlers
from .._reading.order import DEFAULT_LATENESS
from .._reading.reader import DEFAULT_BATCH, Reader
from .._reading.snapshot import snapshot
from .._rings.seam import set_paused
from .._waiting import handle_waiter
from .lifetime import OpenReader
from .setup import ReaderOptions, SourceSpec, check_arrays_order

if TYPE_CHECKING:
    from .lease import SyncLease

R = TypeVar("R")  # what a wait for events gives: events handled, or a lease's batch


# The Args: entries of the keywords shared with PerfStream are PerfStream's, and the
# overloads of __init__ are written from its signature, by scripts/driver_keywords.py:
# edit PerfStream's entries (or __init__), then run it.
class PerfBuffer(Subscriptable[T]):
    """Rings read synchronously, with libbpf's names (a perf event array's, or a BPF ring
    buffer's: its one ring has the key -1).

    ``poll(timeout_ms)`` waits up to the timeout for a ring to be woken (or for
    the drain timer of batched wakeups), then hands every pending event to the
    callbacks and returns how many it handled (samples, lost notices and bad
    samples; 0 on timeout), like ``perf_buffer__poll``. ``consume()`` handles
    everything pending on every ring without waiting; ``consume_buffer(cpu)``
    one CPU's ring (aperf keys rings by CPU id where libbpf takes an index:
    see ``cpus``). ``poll()`` also follows CPU hotplug, as ``PerfStream`` does
    (docs/rings.md, "CPU hotplug").

    The callbacks are given here, as to libbpf's ``perf_buffer__new``, and are plain
    functions (coroutines need ``aperf.PerfStream``). Exceptions raised by callbacks
    propagate out of these calls; the events after the failing one stay queued and
    are handed over by the next call. Use it with ``with`` (or call ``close()``).

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
        max_pending: events the buffer queues before it stops draining its rings
            (backpressure: the rings then fill, and the producer's drops are counted as
            lost); an int of at least 1.
        decode_errors: what becomes of a sample the decoder cannot decode: "item" (a
            ``BadSample`` in the stream, in order), "raise" (a ``DecodeError`` raised out of
            ``poll()``/``consume()`` where the sample was) or "skip"; each is counted in
            ``statistics().decode_errors``.
        on_sample: called as ``on_sample(sample)`` with each ``aperf.Sample``:
            ``sample.cpu`` (the ring's CPU, -1 for a BPF ring buffer), ``sample.data``
            (the raw bytes, the caller's own) and ``sample.value`` (what the decoder
            made of them; None without one). Give it or ``on_array``.
        on_lost: called as ``on_lost(lost)`` with each ``aperf.Lost`` notice, in order:
            ``lost.cpu`` and ``lost.count`` (samples the producer dropped there).
            None: losses are only counted (``statistics()``).
        on_decode_error: called as ``on_decode_error(bad)`` with each
            ``aperf.BadSample`` under ``decode_errors="item"``: ``bad.cpu``,
            ``bad.data`` and ``bad.error`` (the ``DecodeError``). None: that
            ``DecodeError`` is raised out of ``poll()``/``consume()``.
        on_array: instead of ``on_sample``, called as ``on_array(array)`` with each
            ``aperf.SampleArray``: the samples of one run of one CPU as a NumPy
            structured array (``array.values``; docs/columnar.md). The counts
            ``poll()`` returns are still of samples.
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
        take_over: False (the default): opening a map that another aperf reader holds, in
            any process, raises ``BusyResourceError`` naming its pid. True: ask that reader
            to give the map up; its stream then ends with ``aperf.TakenOverError``
            (docs/rings.md, "Two readers of one map"). This buffer, if taken over, learns it
            in ``poll()``, which then raises ``aperf.TakenOverError`` after the events it
            had.
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
        self: PerfBuffer[None],
        source: SourceSpec,
        *,
        pages: int | None = ...,
        ring_bytes: int | None = ...,
        decoder: None = ...,
        wakeup: Wakeup | str | None = ...,
        max_pending: int = ...,
        decode_errors: DecodeErrorPolicy = ...,
        on_sample: Callable[[Sample[None]], Any] | None = ...,
        on_lost: Callable[[Lost], Any] | None = ...,
        on_decode_error: Callable[[BadSample], Any] | None = ...,
        on_array: Callable[[SampleArray], Any] | None = ...,
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
        self: PerfBuffer[Any],
        source: SourceSpec,
        *,
        pages: int | None = ...,
        ring_bytes: int | None = ...,
        decoder: str | type | struct.Struct | Mapping[str, Any],
        wakeup: Wakeup | str | None = ...,
        max_pending: int = ...,
        decode_errors: DecodeErrorPolicy = ...,
        on_sample: Callable[[Sample[Any]], Any] | None = ...,
        on_lost: Callable[[Lost], Any] | None = ...,
        on_decode_error: Callable[[BadSample], Any] | None = ...,
        on_array: Callable[[SampleArray], Any] | None = ...,
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
        self: PerfBuffer[T],
        source: SourceSpec,
        *,
        pages: int | None = ...,
        ring_bytes: int | None = ...,
        decoder: Callable[[bytes], T],
        wakeup: Wakeup | str | None = ...,
        max_pending: int = ...,
        decode_errors: DecodeErrorPolicy = ...,
        on_sample: Callable[[Sample[T]], Any] | None = ...,
        on_lost: Callable[[Lost], Any] | None = ...,
        on_decode_error: Callable[[BadSample], Any] | None = ...,
        on_array: Callable[[SampleArray], Any] | None = ...,
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
        on_sample: Callable[[Any], Any] | None = None,
        on_lost: Callable[[Lost], Any] | None = None,
        on_decode_error: Callable[[BadSample], Any] | None = None,
        on_array: Callable[[SampleArray], Any] | None = None,
        cpus: Iterable[int] | None = None,
        map_keys: Iterable[int] | None = None,
        memory_bytes: int | None = None,
        take_over: bool = False,
        overwritable: bool = False,
        order_by: str | Callable[[Any], Any] | None = None,
        lateness: float = DEFAULT_LATENESS,
    ) -> None:
        if on_sample is None and on_array is None:
            raise ValueError("PerfBuffer needs an on_sample (or, columnar, an on_array) callback")
        self._handlers = Handlers(on_sample, on_lost, on_decode_error, on_array)
        options = ReaderOptions.check(
            source, pages=pages, ring_bytes=ring_bytes, wakeup=wakeup, decoder=decoder,
            max_pending=max_pending, decode_errors=decode_errors, cpus=cpus,
            map_keys=map_keys, memory_bytes=memory_bytes, take_over=take_over,
            overwritable=overwritable,
            order_by=order_by, lateness=lateness,
        )
        if on_array is not None:
            options.check_columns()  # NumPy and a decoder with a layout, now
            check_arrays_order(options)
        self._wakeup = options.wakeup
        # One caller at a time inside poll/consume; close() interrupts a waiting poll,
        # then takes the lock, so it never frees rings under a reader. Reentrant: a
        # callback may close the buffer it is called from.
        self._lock = threading.RLock()
        self._closing = False
        self._closed = False
        reader = options.open(time.monotonic)
        try:
            # close() interrupts it to wake a waiting poll().
            self._waiter = handle_waiter(options.source.handle_kind, reader.handles())
        except BaseException:
            reader.source.free()
            raise
        self._held = OpenReader(reader, self._waiter.close, what="PerfBuffer", noun="perf buffer",
                                stop_in_child=True)
        self._held.opened(self, "'with' or close()")
        # Adding a perf fd to the epoll set polls it, which takes the wakeup of a sample
        # written since the rings opened without epoll reporting it: look once now.
        try:
            for handle in reader.handles():
                reader.look(handle)
        except Exception as exc:  # raised by the first poll or consume, in order
            reader.push_failure(exc)

    # --- libbpf's API -------------------------------------------------------------------

    @property
    def buffer_cnt(self) -> int:
        """Number of rings (one per online CPU that has a map slot; of every map, with
        several)."""
        return len(self._require_open().keys())

    @property
    def cpus(self) -> list[int]:
        """The CPU id of each ring, in order (with several maps: the CPUs that have rings)."""
        return self._require_open().cpus()

    def buffer_fd(self, cpu: int) -> int:
        """The perf event fd of ``cpu``'s ring (to wait on it in your own loop).

        On Windows: the perf buffer's wait handle, which every ring shares."""
        reader = self._require_open()
        keys = reader.keys_of(cpu)
        if len(keys) > 1:
            raise ValueError(f"several maps have a ring on CPU {cpu!r}: buffer_fd() is for a "
                             "buffer of one map")
        handle = reader.handle_of(keys[0]) if keys else None
        if handle is None:
            raise ValueError(f"no ring for CPU {cpu!r}; rings: {self.cpus}")
        return handle

    def poll(self, timeout_ms: int = -1) -> int:
        """Wait up to ``timeout_ms`` (negative: for ever) and handle what is ready.

        Returns the number of events handled: at most what was taken out of the rings
        when it began to hand them out, as libbpf's ``perf_buffer__poll()`` handles what
        epoll reported and returns (a producer writing flat out does not keep it from
        returning; what comes meanwhile is for the next call). EINTR is retried with the time
        left; KeyboardInterrupt and callback exceptions propagate; a close from
        another thread meanwhile ends the wait with ClosedResourceError.
        """
        if isinstance(timeout_ms, bool) or not isinstance(timeout_ms, int | float):
            raise TypeError(f"timeout_ms must be a number, not {type(timeout_ms).__name__}")
        with self._lock:
            if self._closed:
                return self._left_by_close()
            reader = self._require_open()
            handled = self._wait_for(reader, timeout_ms, partial(self._dispatch, reader), 0)
            self._close_if_finished(reader)
            return handled

    def _close_if_finished(self, reader: Reader) -> None:
        """The source came to its end (a replay) and everything was handed out: close."""
        if reader.finished and not reader.has_events():
            self.close()

    def _wait_for(self, reader: Reader, timeout_ms: float, take: Callable[[], R],
                  nothing: R) -> R:  # under self._lock
        """Wait up to ``timeout_ms`` until ``take()`` gives something (an ordered buffer
        may hold events it cannot release yet); what it gave, or ``nothing``."""
        if reader.has_events():
            got = take()
            if got:
                return got
        deadline = None if timeout_ms < 0 else time.monotonic() + timeout_ms / 1000
        while True:
            now = time.monotonic()
            wait = -1.0 if deadline is None else max(0.0, deadline - now)
            tick_at = reader.deadline
            ticking = tick_at is not None and (wait < 0 or tick_at - now < wait)
            if tick_at is not None and ticking:
                wait = max(0.0, tick_at - now)  # batched wakeups: look at the rings then
            ready = self._waiter.wait(wait)
            if self._closing:
                raise ClosedResourceError("this PerfBuffer was closed while polling")
            for handle in ready:
                reader.on_ready(handle)
            if reader.finished:  # the source came to its end: nothing more will come
                return take() if reader.has_events() else nothing
            watch, forget = reader.handle_changes()  # CPU hotplug: rings retired and added
            for handle in forget:
                self._waiter.forget(handle)
            for handle in watch:
                self._waiter.watch(handle)
                reader.drain_all()  # what the new ring got before it was watched
            if ticking and tick_at is not None and time.monotonic() >= tick_at:
                reader.tick()
            if reader.has_events():
                got = take()
                if got:
                    return got
            if deadline is not None and time.monotonic() >= deadline:
                # A ring buffer's wakeup waits for the drain timer (records gather
                # meanwhile): within the timeout, not past it.
                if reader.drain_gathered():
                    return take()
                return nothing

    def lease(self, max_rows: int | None = None, timeout_ms: float = -1) -> SyncLease:
        """Columnar batches that view the rings' memory in place while the lease is held:
        ``with perf_buffer.lease() as batch: ...``, as ``PerfStream.lease()`` (the
        callbacks are not called). Entering waits up to ``timeout_ms`` (negative: for
        ever) for data, as ``poll()`` does; the batch is empty if none came.
        """
        max_rows = check_max_rows(max_rows)
        if isinstance(timeout_ms, bool) or not isinstance(timeout_ms, int | float):
            raise TypeError(f"timeout_ms must be a number, not {type(timeout_ms).__name__}")
        with self._lock:
            reader = self._require_open()
            reader.columns()  # NumPy and a decoder with a layout, now
            from .lease import SyncLease, lease

            return SyncLease(lease(reader.rings),
                             partial(self._lease_batch, max_rows, timeout_ms), self._lock)

    def _lease_batch(self, max_rows: int | None, timeout_ms: float) -> list[Any]:
        with self._lock:
            reader = self._require_open()
            nothing: list[Any] = []
            batch = self._wait_for(reader, timeout_ms, partial(reader.take_arrays, max_rows),
                                   nothing)
            self._close_if_finished(reader)
            return batch

    def consume(self) -> int:
        """Handle everything every ring holds now, without waiting (what comes while the
        callbacks run is for the next call). Events handled.

        After ``close()``: the events the close took out of the rings (see there)."""
        with self._lock:
            if self._closed:
                return self._left_by_close()
            reader = self._require_open()
            reader.flush()
            return self._dispatch(reader)

    def _left_by_close(self) -> int:  # under self._lock, closed
        """Hand over the events ``close()`` took out of the rings; ClosedResourceError
        once none is left."""
        held = self._held
        handled = 0 if held.forked else self._dispatch(held.reader)
        if not handled:
            raise ClosedResourceError("this PerfBuffer is closed")
        return handled

    def consume_buffer(self, cpu: int) -> int:
        """Handle what ``cpu``'s ring holds now (aperf keys rings by CPU id, see ``cpus``)."""
        with self._lock:
            reader = self._require_open()
            keys = reader.keys_of(cpu)  # one per map
            if not keys:
                raise ValueError(f"no ring for CPU {cpu!r}; rings: {reader.cpus()}")
            for key in keys:
                reader.drain(key, force=True)
            return self._dispatch(reader)

    def flush(self) -> int:
        """Hand over what sits below the wakeup threshold: the same as ``consume()``."""
        return self.consume()

    def pause(self) -> None:
        """Stop the producer at the source, as
        ``PerfStream.pause()`` does: the map's slots are emptied
        and the BPF side's output fails with ``-ENOENT``; what the rings hold is still
        delivered, nothing is counted as lost. Idempotent."""
        set_paused(self._require_open().source, True)

    def resume(self) -> None:
        """Put this buffer's rings back into the map's slots (idempotent)."""
        set_paused(self._require_open().source, False)

    def snapshot(self, order_by: str | None = None) -> list[Event[Any]]:
        """The newest records of this buffer's flight-recorder rings (``overwritable=True``)
        as events, each CPU's oldest first, or merged across CPUs by the ``order_by``
        field of the decoded values, as ``PerfStream.snapshot()`` returns them: read
        with the producer paused, then resumed. The callbacks are not called. One call
        at a time: a ``poll()`` running in another thread is waited for."""
        with self._lock:
            return snapshot(self._require_open(), order_by)

    def _dispatch(self, reader: Reader) -> int:  # under self._lock
        """Hand what the reader holds now to the callbacks, and no more; events handed.

        Taking drains the rings that fill meanwhile (so that none overflows while the
        callbacks run): under a producer faster than the callbacks, handing those over
        too would never end, and poll() would never return to its caller."""
        handled = 0
        budget = reader.queued()
        columnar = self._handlers.columnar
        while handled < budget:
            if self._closing and not self._closed:
                # A close() in another thread waits for the lock: let it in (taking
                # also drains the rings, so a producer writing flat out would keep this
                # loop going for ever). What the rings hold is the close's to take.
                return handled
            batch = reader.take_arrays() if columnar else reader.take(
                min(DEFAULT_BATCH, budget - handled))
            if not batch:
                return handled
            pending = reader.dispatch(batch, self._handlers)
            for result in pending:
                close = getattr(result, "close", None)
                if close is not None:
                    close()  # a coroutine never awaited would warn
                pending.throw(
                    TypeError("PerfBuffer callbacks run without an event loop: a callback "
                              "returned an awaitable; use PerfStream for coroutine callbacks")
                )
            # Columnar: an array counts as its samples.
            handled += sum(len(e) if e.__class__ is SampleArray else 1 for e in batch) if (
                columnar) else len(batch)
        return handled

    # --- lifecycle ----------------------------------------------------------------------

    def _require_open(self) -> Reader:
        if self._closing:
            raise ClosedResourceError("this PerfBuffer is closed")
        return self._held.usable()

    @property
    def closed(self) -> bool:
        """Whether the buffer was closed."""
        return self._closed

    def statistics(self) -> StreamStatistics:
        """Per-CPU samples, lost, bytes and wakeups; memory; the drain period in force.

        Readable after ``close()`` too: the final counts (``closed`` True)."""
        with self._lock:
            return self._held.reader.statistics()

    @property
    def wakeup(self) -> Wakeup:
        """The wakeup policy in force."""
        return self._wakeup

    def close(self) -> None:
        """Stop waiting, stop the producer (map slots emptied), take what the rings hold,
        then free them (fds closed). Idempotent.

        From any thread: a poll() waiting in another thread is woken and raises
        ClosedResourceError; the rings are freed once no call is inside them. What the
        close took out of the rings (``statistics().pending``) is handed to the
        callbacks by the next ``poll()`` or ``consume()``; once none is left they raise
        ClosedResourceError.
        """
        if self._closed:
            return
        held = self._held
        self._closing = True
        if not held.forked:  # a forked child's eventfd is the parent's too
            self._waiter.interrupt()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            held.close()

    def __enter__(self) -> PerfBuffer[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
