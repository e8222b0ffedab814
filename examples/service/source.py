"""The BPF side: the tracer's object and perf stream, read into the hub while the app runs."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import structlog

import aperf

from ..bootstrap_legacy import event_decoder, json_record, tracer_object
from .hub import Hub, Message

log = structlog.get_logger("examples.service")

MAX_PUBLISH_BATCH = 256  # events handed to the hub between two yields to the loop


def boot_to_wall_offset_ns(tries: int = 5) -> int:
    """Wall clock minus boot time, read between two boot-time reads.

    The narrowest of a few tries: a read that was preempted (milliseconds, on a busy
    machine) would put every event that far off.
    """
    best_width, best_offset = None, 0
    for _ in range(tries):
        before = time.clock_gettime_ns(time.CLOCK_BOOTTIME)
        wall = time.time_ns()
        after = time.clock_gettime_ns(time.CLOCK_BOOTTIME)
        if best_width is None or after - before < best_width:
            best_width, best_offset = after - before, wall - (before + after) // 2
    return best_offset


class KernelClock:
    """Turns the tracer's ``timestamp_ns`` (CLOCK_BOOTTIME) into wall-clock time.

    The offset between the two clocks is taken once, when the source starts. Boot time
    goes on during suspend, so the offset stays right across one; a step of the wall
    clock (settimeofday, NTP's first sync) is not followed until the service restarts.
    """

    def __init__(self) -> None:
        self.offset_ns = boot_to_wall_offset_ns()
        self.zone = datetime.datetime.now().astimezone().tzinfo

    def wall_ns(self, boot_ns: int) -> int:
        return boot_ns + self.offset_ns

    def wall(self, boot_ns: int) -> datetime.datetime:
        micros = self.wall_ns(boot_ns) // 1000
        return datetime.datetime.fromtimestamp(micros // 1_000_000, self.zone).replace(
            microsecond=micros % 1_000_000
        )


def event_message(sample: aperf.Sample, clock: KernelClock) -> Message:
    """An exec or exit as the tracer's ``--json`` prints it, timed by the kernel."""
    return Message(json.dumps(json_record(sample, clock.wall(sample.value.timestamp_ns))))


class TraceSource:
    """The tracer's BPF object and perf stream, published to the hub while the app runs."""

    def __init__(self, hub: Hub, object_path: Path, *, min_duration_ms: int = 0,
                 pages: int, wakeup: str, ordered: bool = True) -> None:
        self.hub = hub
        self.object_path = object_path
        self.min_duration_ms = min_duration_ms
        self.pages = pages
        self.wakeup = wakeup
        # Events in time order across CPUs (docs/ordering.md): the SSE stream never
        # shows a process's EXIT before its EXEC.
        self.order_by = "timestamp_ns" if ordered else None
        self.stream: aperf.PerfStream | None = None
        self.state = "starting"  # -> running -> stopping -> stopped, or failed
        self.error: BaseException | None = None  # why it failed to start
        self.clock = KernelClock()
        # What the pump took from the stream: samples (handed to the hub as events),
        # Lost (handed on as notices), bad samples (logged and counted only).
        self.events = 0
        self.lost_notices = 0
        self.bad_samples = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: anyio.Event | None = None  # set: stop reading, then close the hub

    @property
    def stream_open(self) -> bool:
        return self.state == "running" and self.stream is not None and not self.stream.closed

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[TraceSource]:
        """Load and attach, open the stream, read it in a background task; undo it all."""
        try:
            with tracer_object(self.object_path, self.min_duration_ms * 1_000_000) as obj:
                async with aperf.PerfStream(
                    obj.maps["perf_buffer"], pages=self.pages, decoder=event_decoder(obj),
                    wakeup=self.wakeup, order_by=self.order_by,
                ) as stream, anyio.create_task_group() as tg:
                    self.stream = stream
                    self._loop, self._stop = asyncio.get_running_loop(), anyio.Event()
                    pumped = anyio.Event()
                    tg.start_soon(self._pump, stream, pumped)
                    tg.start_soon(self._stopper, stream, self._stop, pumped)
                    self.state = "running"
                    try:
                        yield self
                    finally:
                        self._stop.set()  # usually done already, at the signal
        except BaseException as exc:
            if self.state == "starting":
                self.error = exc  # main() says it in one line
            self.state = "failed"
            raise
        self.state = "stopped"

    def stop_threadsafe(self) -> None:
        """Begin the stop from a signal handler: ``_stopper`` does it in the loop."""
        loop, stop = self._loop, self._stop
        if loop is None or stop is None or loop.is_closed():
            self.hub.close_threadsafe()  # not running (yet): nothing read to publish
        else:
            loop.call_soon_threadsafe(stop.set)

    async def _stopper(self, stream: aperf.PerfStream, stop: anyio.Event,
                       pumped: anyio.Event) -> None:
        """Stop reading, publish everything read, and only then end the clients' streams.

        Closing the stream takes what the rings still hold and frees them; the pump
        publishes what was read, then its loop ends. The hub closes after that, so
        every event read reaches every client still reading (nothing read is dropped).
        """
        await stop.wait()
        if self.state == "running":
            self.state = "stopping"
        await stream.aclose()
        await pumped.wait()
        self.hub.close()

    async def _pump(self, stream: aperf.PerfStream, pumped: anyio.Event) -> None:
        """Publish every event until the stream closes. Never raises into the task group."""
        try:
            await self._publish_all(stream)
        finally:
            pumped.set()

    async def _publish_all(self, stream: aperf.PerfStream) -> None:
        # At most half the window per batch: a client that keeps up never falls out of it.
        batch_size = min(MAX_PUBLISH_BATCH, max(1, self.hub.window // 2))
        while True:
            try:
                async for batch in stream.batches(batch_size):
                    self.hub.publish(self._messages(batch))
                    # Let the clients' writers take what was just published before the
                    # next batch: the loop runs every task made ready meanwhile.
                    await anyio.sleep(0)
                return  # the stream was closed
            except aperf.BrokenRingError as exc:
                # One CPU's ring is corrupt and was stopped; the others go on.
                # /health reports it (503), /metrics has aperf_ring_broken.
                log.error("perf ring broken", cpu=exc.cpu, error=str(exc))
            except Exception:
                # The service stays up (the metrics tell what happened) but is unhealthy.
                self.state = "failed"
                log.exception("perf stream failed")
                return

    def _messages(self, batch: list[Any]) -> Iterator[Message]:
        for item in batch:
            match item:
                case aperf.Sample():
                    self.events += 1
                    yield event_message(item, self.clock)
                case aperf.Lost(cpu=cpu, count=count):
                    log.warning("events lost", cpu=cpu, count=count)
                    self.lost_notices += 1
                    yield Message(json.dumps({"cpu": cpu, "count": count}), "lost")
                case aperf.BadSample(cpu=cpu, error=error):
                    self.bad_samples += 1
                    log.warning("bad sample", cpu=cpu, error=str(error))

    def healthy(self) -> bool:
        if not self.stream_open:
            return False
        assert self.stream is not None
        return not any(c.broken for c in self.stream.statistics().cpus)
