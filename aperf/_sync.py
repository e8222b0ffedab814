"""The synchronous driver: libbpf's ``perf_buffer__poll``/``consume`` names, no event loop.

It only waits (``epoll`` on the rings' fds, or ``WaitForMultipleObjects`` on
Windows wait handles; bounded by the reader's drain deadline) and calls the
reader; the policy is the reader's, as for the async driver.
"""

from __future__ import annotations

import contextlib
import os
import select
import struct
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Generic, Protocol, overload

from ._errors import ClosedResourceError
from ._events import BadSample, Lost, Sample, SampleArray, StreamStatistics, T
from ._lifetime import forked_error, track, untrack
from ._log import log
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
from ._source import HandleKind, set_paused


class HandleWaiter(Protocol):
    """What waits on a source's readiness handles without an event loop."""

    def wait(self, timeout: float) -> list[int]:
        """The handles ready within ``timeout`` seconds (negative: no limit); [] on
        timeout or ``interrupt()``."""
        ...

    def interrupt(self) -> None:
        """Wake a wait in another thread (close() does, before taking the lock)."""
        ...

    def close(self) -> None: ...


class _EpollWaiter:
    """Ring fds in an epoll set, with an eventfd in that set for ``interrupt()``."""

    def __init__(self, fds: Iterable[int]) -> None:
        self.wake_fd = -1
        self.epoll = select.epoll()
        try:
            for fd in fds:
                self.epoll.register(fd, select.EPOLLIN)
            self.wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            self.epoll.register(self.wake_fd, select.EPOLLIN)
        except BaseException:
            self.close()
            raise

    def wait(self, timeout: float) -> list[int]:
        ready = []
        for fd, _ in self.epoll.poll(timeout):  # retries EINTR itself (PEP 475)
            if fd == self.wake_fd:
                # close()'s, or not ours (e.g. a forked child's close)
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(self.wake_fd)
            else:
                ready.append(fd)
        return ready

    def interrupt(self) -> None:
        if self.wake_fd >= 0:
            os.eventfd_write(self.wake_fd, 1)

    def close(self) -> None:
        self.epoll.close()
        if self.wake_fd >= 0:
            os.close(self.wake_fd)
            self.wake_fd = -1


def handle_waiter(kind: HandleKind, handles: Iterable[int]) -> HandleWaiter:
    if kind == "win32":
        from ._ebpfwin import Win32Waiter

        return Win32Waiter(handles)
    return _EpollWaiter(handles)


class _Held:
    """What an open buffer holds: the reader, and a waiter on its handles that
    close() interrupts to wake a waiting poll()."""

    __slots__ = ("__weakref__", "forked", "reader", "waiter")

    def __init__(self, reader: Reader) -> None:
        self.reader = reader
        self.forked = False
        try:
            self.waiter = handle_waiter(
                reader.source.handle_kind, {ring.handle for ring in reader.rings.values()}
            )
        except BaseException:
            reader.source.free()
            raise

    def interrupt(self) -> None:
        """Wake a poll() waiting in another thread (never from a forked child: the
        eventfd is shared with the parent)."""
        if not self.forked:
            self.waiter.interrupt()

    def release(self) -> None:
        """Close the waiter, then free the rings (only the child's fds after a fork:
        the rings and map slots are the parent's)."""
        try:
            self.waiter.close()
        finally:
            if self.forked:
                self.reader.source.after_fork()
            else:
                self.reader.source.free()


def _release_dropped(held: _Held, name: str) -> None:
    """The buffer was garbage-collected without being closed."""
    warnings.warn(
        f"unclosed PerfBuffer on {name}: use 'with' or close(); its rings were released "
        "at garbage collection",
        ResourceWarning,
        stacklevel=2,
    )
    held.release()


class PerfBuffer(Generic[T]):
    """Rings read synchronously, with libbpf's names (a perf event array's, or a BPF ring
    buffer's: its one ring has the key -1).

    ``poll(timeout_ms)`` waits up to the timeout for a ring to be woken (or for
    the drain timer of batched wakeups), then hands every pending event to the
    callbacks and returns how many it handled (samples, lost notices and bad
    samples; 0 on timeout), like ``perf_buffer__poll``. ``consume()`` handles
    everything pending on every ring without waiting; ``consume_buffer(cpu)``
    one CPU's ring (aperf keys rings by CPU id where libbpf takes an index:
    see ``cpus``).

    Exceptions raised by callbacks propagate out of these calls; the events
    after the failing one stay queued and are handed over by the next call.
    ``on_array=`` instead of ``on_sample=`` hands samples over as NumPy arrays
    ([`SampleArray`][aperf.SampleArray], docs/columnar.md); the counts are still of samples.

    ``cpus=`` and ``map_keys=`` choose which rings open, and ``memory_bytes=`` sets a
    budget for all of them, as for [`PerfStream`][aperf.PerfStream].
    """

    @overload
    def __init__(
        self: PerfBuffer[None],
        source: SourceSpec,
        *,
        pages: int | None = ...,
        ring_bytes: int | None = ...,
        on_sample: Callable[[Sample[None]], Any] | None = ...,
        on_lost: Callable[[Lost], Any] | None = ...,
        on_decode_error: Callable[[BadSample], Any] | None = ...,
        decoder: None = ...,
        decode_errors: DecodeErrorPolicy = ...,
        wakeup: Wakeup | str | None = ...,
        on_array: Callable[[SampleArray], Any] | None = ...,
        cpus: Iterable[int] | None = ...,
        map_keys: Iterable[int] | None = ...,
        memory_bytes: int | None = ...,
    ) -> None: ...

    @overload
    def __init__(
        self: PerfBuffer[Any],
        source: SourceSpec,
        *,
        pages: int | None = ...,
        ring_bytes: int | None = ...,
        on_sample: Callable[[Sample[Any]], Any] | None = ...,
        on_lost: Callable[[Lost], Any] | None = ...,
        on_decode_error: Callable[[BadSample], Any] | None = ...,
        decoder: str | type | struct.Struct,
        decode_errors: DecodeErrorPolicy = ...,
        wakeup: Wakeup | str | None = ...,
        on_array: Callable[[SampleArray], Any] | None = ...,
        cpus: Iterable[int] | None = ...,
        map_keys: Iterable[int] | None = ...,
        memory_bytes: int | None = ...,
    ) -> None: ...

    @overload
    def __init__(
        self: PerfBuffer[T],
        source: SourceSpec,
        *,
        pages: int | None = ...,
        ring_bytes: int | None = ...,
        on_sample: Callable[[Sample[T]], Any] | None = ...,
        on_lost: Callable[[Lost], Any] | None = ...,
        on_decode_error: Callable[[BadSample], Any] | None = ...,
        decoder: Callable[[bytes], T],
        decode_errors: DecodeErrorPolicy = ...,
        wakeup: Wakeup | str | None = ...,
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
        on_sample: Callable[[Any], Any] | None = None,
        on_lost: Callable[[Lost], Any] | None = None,
        on_decode_error: Callable[[BadSample], Any] | None = None,
        decoder: Any = None,
        decode_errors: DecodeErrorPolicy = "item",
        wakeup: Wakeup | str | None = None,
        on_array: Callable[[SampleArray], Any] | None = None,
        cpus: Iterable[int] | None = None,
        map_keys: Iterable[int] | None = None,
        memory_bytes: int | None = None,
    ) -> None:
        if on_sample is None and on_array is None:
            raise ValueError("PerfBuffer needs an on_sample (or, columnar, an on_array) callback")
        self._handlers = Handlers(on_sample, on_lost, on_decode_error, on_array)
        options = ReaderOptions.check(
            source, pages=pages, ring_bytes=ring_bytes, wakeup=wakeup, decoder=decoder,
            max_pending=DEFAULT_MAX_PENDING, decode_errors=decode_errors, cpus=cpus,
            map_keys=map_keys, memory_bytes=memory_bytes,
        )
        if on_array is not None:
            load_columns(options.decoder)  # NumPy and a decoder with a layout, now
        self._wakeup = options.wakeup
        # One caller at a time inside poll/consume; close() interrupts a waiting poll,
        # then takes the lock, so it never frees rings under a reader. Reentrant: a
        # callback may close the buffer it is called from.
        self._lock = threading.RLock()
        self._closing = False
        self._held: _Held | None = _Held(options.open(time.monotonic))
        self._finalizer = weakref.finalize(self, _release_dropped, self._held, options.source.name)
        track(self._held)
        reader = self._held.reader
        log.info("perf buffer opened", source=options.source.name,
                 cpus=sorted(reader.rings), ring_bytes=reader.ring_bytes,
                 wakeup=self._wakeup, lost_counter=reader.lost_counter)

    # --- libbpf's API -------------------------------------------------------------------

    @property
    def buffer_cnt(self) -> int:
        """Number of rings (one per online CPU that has a map slot)."""
        return len(self._require_open().reader.counters)

    @property
    def cpus(self) -> list[int]:
        """The CPU id of each ring, in order."""
        return sorted(self._require_open().reader.counters)

    def buffer_fd(self, cpu: int) -> int:
        """The perf event fd of ``cpu``'s ring (to wait on it in your own loop).

        On Windows: the perf buffer's wait handle, which every ring shares."""
        ring = self._require_open().reader.rings.get(cpu)
        if ring is None:
            raise ValueError(f"no ring for CPU {cpu!r}; rings: {self.cpus}")
        return ring.handle

    def poll(self, timeout_ms: int = -1) -> int:
        """Wait up to ``timeout_ms`` (negative: for ever) and handle what is ready.

        Returns the number of events handled. EINTR is retried with the time
        left; KeyboardInterrupt and callback exceptions propagate; a close from
        another thread meanwhile ends the wait with ClosedResourceError.
        """
        if isinstance(timeout_ms, bool) or not isinstance(timeout_ms, int | float):
            raise TypeError(f"timeout_ms must be a number, not {type(timeout_ms).__name__}")
        with self._lock:
            held = self._require_open()
            reader = held.reader
            if reader.pending or reader.held or reader.held_arrays:
                return self._dispatch(reader)
            deadline = None if timeout_ms < 0 else time.monotonic() + timeout_ms / 1000
            while True:
                now = time.monotonic()
                wait = -1.0 if deadline is None else max(0.0, deadline - now)
                tick_at = reader.deadline
                ticking = tick_at is not None and (wait < 0 or tick_at - now < wait)
                if tick_at is not None and ticking:
                    wait = max(0.0, tick_at - now)  # batched wakeups: look at the rings then
                ready = held.waiter.wait(wait)
                if self._closing:
                    raise ClosedResourceError("this PerfBuffer was closed while polling")
                for handle in ready:
                    reader.on_ready(handle)
                if ticking and tick_at is not None and time.monotonic() >= tick_at:
                    reader.tick()
                if reader.pending:
                    return self._dispatch(reader)
                if deadline is not None and time.monotonic() >= deadline:
                    return 0

    def consume(self) -> int:
        """Handle everything every ring holds now, without waiting. Events handled."""
        with self._lock:
            reader = self._require_open().reader
            reader.flush()
            return self._dispatch(reader)

    def consume_buffer(self, cpu: int) -> int:
        """Handle what ``cpu``'s ring holds now (aperf keys rings by CPU id, see ``cpus``)."""
        with self._lock:
            reader = self._require_open().reader
            if cpu not in reader.counters:
                raise ValueError(f"no ring for CPU {cpu!r}; rings: {sorted(reader.counters)}")
            reader.drain(cpu, force=True)
            return self._dispatch(reader)

    def flush(self) -> int:
        """Hand over what sits below the wakeup threshold: the same as ``consume()``."""
        return self.consume()

    def pause(self) -> None:
        """Stop the producer at the source, as
        [`PerfStream.pause`][aperf.PerfStream.pause] does: the map's slots are emptied
        and the BPF side's output fails with ``-ENOENT``; what the rings hold is still
        delivered, nothing is counted as lost. Idempotent."""
        set_paused(self._require_open().reader.source, True)

    def resume(self) -> None:
        """Put this buffer's rings back into the map's slots (idempotent)."""
        set_paused(self._require_open().reader.source, False)

    def _dispatch(self, reader: Reader) -> int:  # under self._lock
        handled = 0
        columnar = self._handlers.columnar
        while True:
            batch = reader.take_arrays() if columnar else reader.take(DEFAULT_BATCH)
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

    # --- lifecycle ----------------------------------------------------------------------

    def _require_open(self) -> _Held:
        held = self._held
        if held is None or self._closing:
            raise ClosedResourceError("this PerfBuffer is closed")
        if held.forked:
            raise ClosedResourceError(forked_error("PerfBuffer"))
        return held

    @property
    def closed(self) -> bool:
        """Whether the buffer was closed."""
        return self._held is None

    def statistics(self) -> StreamStatistics:
        """Per-CPU samples, lost, bytes and wakeups; memory; the drain period in force."""
        with self._lock:
            held = self._held
            if held is None:
                raise ClosedResourceError("this PerfBuffer is closed")
            return held.reader.statistics()

    @property
    def wakeup(self) -> Wakeup:
        """The wakeup policy in force."""
        return self._wakeup

    def close(self) -> None:
        """Stop waiting, then free the rings (fds closed, map slots deleted). Idempotent.

        From any thread: a poll() waiting in another thread is woken and raises
        ClosedResourceError; the rings are freed once no call is inside them.
        """
        held = self._held
        if held is None:
            return
        self._closing = True
        held.interrupt()
        with self._lock:
            if self._held is None:
                return
            self._held = None
            self._finalizer.detach()
            untrack(held)
            if held.forked:
                held.release()
                return
            try:
                held.reader.close()
            finally:
                held.release()
                held.reader.log_summary("perf buffer closed")

    def __enter__(self) -> PerfBuffer[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
