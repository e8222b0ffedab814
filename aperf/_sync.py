"""The synchronous driver: libbpf's ``perf_buffer__poll``/``consume`` names, no event loop.

It only waits (``epoll`` on the rings' fds, or ``WaitForMultipleObjects`` on
Windows wait handles; bounded by the reader's drain deadline) and calls the
reader; the policy is the reader's, as for the async driver.
"""

from __future__ import annotations

import select
import struct
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Generic, Protocol, TypeVar, overload

from ._errors import ClosedResourceError
from ._events import BadSample, Lost, Sample, StreamStatistics
from ._log import log
from ._options import Wakeup
from ._reader import DEFAULT_BATCH, DecodeErrorPolicy, Handlers, Reader
from ._setup import ReaderOptions, SourceSpec
from ._source import HandleKind

T = TypeVar("T")


class HandleWaiter(Protocol):
    def wait(self, timeout: float) -> list[int]:
        """The handles ready within ``timeout`` seconds (negative: no limit); [] on timeout."""
        ...

    def close(self) -> None: ...


class _EpollWaiter:
    """Ring fds, polled for input."""

    def __init__(self, fds: Iterable[int]) -> None:
        self._epoll = select.epoll()
        try:
            for fd in fds:
                self._epoll.register(fd, select.EPOLLIN)
        except BaseException:
            self._epoll.close()
            raise

    def wait(self, timeout: float) -> list[int]:
        return [fd for fd, _ in self._epoll.poll(timeout)]  # retries EINTR itself (PEP 475)

    def close(self) -> None:
        self._epoll.close()


def handle_waiter(kind: HandleKind, handles: Iterable[int]) -> HandleWaiter:
    """What waits on a source's readiness handles without an event loop."""
    if kind == "win32":
        from ._ebpfwin import Win32Waiter

        return Win32Waiter(handles)
    return _EpollWaiter(handles)


class PerfBuffer(Generic[T]):
    """Rings read synchronously, with libbpf's names.

    ``poll(timeout_ms)`` waits up to the timeout for a ring to be woken (or for
    the drain timer of batched wakeups), then hands every pending event to the
    callbacks and returns how many it handled (samples, lost notices and bad
    samples; 0 on timeout), like ``perf_buffer__poll``. ``consume()`` handles
    everything pending on every ring without waiting; ``consume_buffer(cpu)``
    one CPU's ring (aperf keys rings by CPU id where libbpf takes an index:
    see ``cpus``).

    Exceptions raised by callbacks propagate out of these calls; the events
    after the failing one stay queued and are handed over by the next call.
    """

    @overload
    def __init__(
        self: PerfBuffer[None],
        source: SourceSpec,
        *,
        pages: int | None = ...,
        ring_bytes: int | None = ...,
        on_sample: Callable[[Sample[None]], Any],
        on_lost: Callable[[Lost], Any] | None = ...,
        on_decode_error: Callable[[BadSample], Any] | None = ...,
        decoder: None = ...,
        decode_errors: DecodeErrorPolicy = ...,
        wakeup: Wakeup | str | None = ...,
    ) -> None: ...

    @overload
    def __init__(
        self: PerfBuffer[Any],
        source: SourceSpec,
        *,
        pages: int | None = ...,
        ring_bytes: int | None = ...,
        on_sample: Callable[[Sample[Any]], Any],
        on_lost: Callable[[Lost], Any] | None = ...,
        on_decode_error: Callable[[BadSample], Any] | None = ...,
        decoder: str | type | struct.Struct,
        decode_errors: DecodeErrorPolicy = ...,
        wakeup: Wakeup | str | None = ...,
    ) -> None: ...

    @overload
    def __init__(
        self: PerfBuffer[T],
        source: SourceSpec,
        *,
        pages: int | None = ...,
        ring_bytes: int | None = ...,
        on_sample: Callable[[Sample[T]], Any],
        on_lost: Callable[[Lost], Any] | None = ...,
        on_decode_error: Callable[[BadSample], Any] | None = ...,
        decoder: Callable[[bytes], T],
        decode_errors: DecodeErrorPolicy = ...,
        wakeup: Wakeup | str | None = ...,
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
    ) -> None:
        if on_sample is None:
            raise ValueError("PerfBuffer needs an on_sample callback")
        self._handlers = Handlers(on_sample, on_lost, on_decode_error)
        options = ReaderOptions.check(
            source, pages=pages, ring_bytes=ring_bytes, wakeup=wakeup, decoder=decoder,
            max_pending=DEFAULT_BATCH * 256, decode_errors=decode_errors,
        )
        self._lock = threading.Lock()  # one poll at a time; close waits for it
        self._waiter: HandleWaiter | None = None
        self._reader: Reader | None = options.open(time.monotonic)
        try:
            self._waiter = handle_waiter(
                options.source.handle_kind, {ring.handle for ring in self._reader.rings.values()}
            )
        except BaseException:
            self.close()
            raise
        self._wakeup = options.wakeup
        log.info("perf buffer opened", source=options.source.name,
                 cpus=sorted(self._reader.rings), ring_bytes=self._reader.ring_bytes,
                 wakeup=self._wakeup, lost_counter=self._reader.lost_counter)

    # --- libbpf's API -------------------------------------------------------------------

    @property
    def buffer_cnt(self) -> int:
        """Number of rings (one per online CPU that has a map slot)."""
        return len(self._require_open().counters)

    @property
    def cpus(self) -> list[int]:
        """The CPU id of each ring, in order."""
        return sorted(self._require_open().counters)

    def buffer_fd(self, cpu: int) -> int:
        """The perf event fd of ``cpu``'s ring (to wait on it in your own loop).

        On Windows: the perf buffer's wait handle, which every ring shares."""
        ring = self._require_open().rings.get(cpu)
        if ring is None:
            raise ValueError(f"no ring for CPU {cpu!r}; rings: {self.cpus}")
        return ring.handle

    def poll(self, timeout_ms: int = -1) -> int:
        """Wait up to ``timeout_ms`` (negative: for ever) and handle what is ready.

        Returns the number of events handled. EINTR is retried with the time
        left; KeyboardInterrupt and callback exceptions propagate.
        """
        reader = self._require_open()
        if reader.pending or reader.held:
            return self._dispatch(reader)
        waiter = self._waiter
        assert waiter is not None
        deadline = None if timeout_ms < 0 else time.monotonic() + timeout_ms / 1000
        while True:
            now = time.monotonic()
            wait = -1.0 if deadline is None else max(0.0, deadline - now)
            tick_at = reader.deadline
            ticking = tick_at is not None and (wait < 0 or tick_at - now < wait)
            if ticking:
                assert tick_at is not None
                wait = max(0.0, tick_at - now)  # batched wakeups: look at the rings then
            ready = waiter.wait(wait)
            for handle in ready:
                reader.on_ready(handle)
            if not ready and ticking:
                reader.tick()
            if reader.pending:
                return self._dispatch(reader)
            if deadline is not None and time.monotonic() >= deadline:
                return 0

    def consume(self) -> int:
        """Handle everything every ring holds now, without waiting. Events handled."""
        reader = self._require_open()
        reader.flush()
        return self._dispatch(reader)

    def consume_buffer(self, cpu: int) -> int:
        """Handle what ``cpu``'s ring holds now (aperf keys rings by CPU id, see ``cpus``)."""
        reader = self._require_open()
        if cpu not in reader.counters:
            raise ValueError(f"no ring for CPU {cpu!r}; rings: {sorted(reader.counters)}")
        reader.drain(cpu, force=True)
        return self._dispatch(reader)

    def flush(self) -> int:
        """Same as :meth:`consume`: hand over what sits below the wakeup threshold."""
        return self.consume()

    def _dispatch(self, reader: Reader) -> int:
        handled = 0
        while True:
            batch = reader.take(DEFAULT_BATCH)
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
            handled += len(batch)

    # --- lifecycle ----------------------------------------------------------------------

    def _require_open(self) -> Reader:
        reader = self._reader
        if reader is None or reader.closed:
            raise ClosedResourceError("this PerfBuffer is closed")
        return reader

    @property
    def closed(self) -> bool:
        return self._reader is None or self._reader.closed

    def statistics(self) -> StreamStatistics:
        """Per-CPU samples, lost, bytes and wakeups; memory; the drain period in force."""
        reader = self._reader
        if reader is None:
            raise ClosedResourceError("this PerfBuffer is closed")
        return reader.statistics()

    @property
    def wakeup(self) -> Wakeup:
        return self._wakeup

    def close(self) -> None:
        """Stop waiting, then free the rings (fds closed, map slots deleted). Idempotent."""
        waiter, self._waiter = self._waiter, None
        reader = self._reader
        try:
            if waiter is not None:
                waiter.close()
        finally:
            if reader is not None and not reader.closed:
                try:
                    reader.close()
                finally:
                    reader.source.free()
                    reader.log_summary("perf buffer closed")

    def __enter__(self) -> PerfBuffer[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
