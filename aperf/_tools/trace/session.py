"""What the tracer's loop is made of, for the tracer and its shards alike: the loaded
and attached object, the stop signals, the printer of each item and the loop over the
stream, and the order events come in."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import signal
import sys
from collections.abc import Callable, Iterator
from typing import Any

import aperf

from .output import LineOutput
from .preflight import OptionError
from .render import HEADER, json_record, table_line

# Events come out in time order across CPUs (an EXIT never before its EXEC): ordered
# by the event's bpf_ktime_get_boot_ns() stamp, each held at most ORDER_LATENESS
# seconds (docs/ordering.md); --unordered gives ring order, as the C original.
ORDER_BY = "timestamp_ns"
RINGBUF = aperf.RingBufferSource.MAP_TYPE


@contextlib.contextmanager
def tracer_object(
    path: str | os.PathLike[str], min_duration_ns: int = 0, ringbuf_bytes: int | None = None,
    buffer: aperf.BufferChoice | None = None, *, strict: bool = False,
) -> Iterator[aperf.BPFObject]:
    """Open the BPF object, make its buffer the ring ``buffer`` says (an object with an
    ``APERF_BUFFER``, tracer.bpf.c: ``"perf"`` when None, as the C original), set its
    ``min_duration_ns`` global and the size of its ring buffer (``ringbuf_bytes``, if
    the object's ring is one), load it and attach it. An object without such a buffer
    (bootstrap_legacy.bpf.c, bootstrap.bpf.c) stays as it is; ``strict``: that is an
    error (``--buffer`` was given).

    Closing the object (leaving the ``with`` block) detaches both programs and
    frees the maps.
    """
    with aperf.BPFObject(path) as declared:  # opened, never loaded: what it declares
        chooses = declared.buffer is not None
    if strict and not chooses:
        raise OptionError(
            f"--buffer chooses the ring of an object declaring APERF_BUFFER "
            f"(<aperf/buffer.bpf.h>); {os.fspath(path)} has none: leave --buffer out"
        )
    with aperf.BPFObject(path, buffer=(buffer or "perf") if chooses else None) as obj:
        # A ``const volatile`` global lives in .rodata: it can only be set before
        # load, and the verifier then treats it as a constant (dead branches vanish).
        obj.set_global("min_duration_ns", min_duration_ns)
        events = event_map(obj)
        if ringbuf_bytes is not None and events.type == RINGBUF:
            events.set_max_entries(ringbuf_bytes)  # a ring buffer is sized at load
        obj.load()
        obj.attach()
        yield obj


def event_map(obj: aperf.BPFObject) -> aperf.Map:
    """The map the object's events go to: its ``APERF_BUFFER`` (tracer.bpf.c), its ring
    buffer ``rb`` (bootstrap.bpf.c) or its perf event array ``perf_buffer``."""
    for name in ("events", "rb"):
        if name in obj.maps and (name == "rb" or obj.buffer is not None):
            return obj.maps[name]
    return obj.maps["perf_buffer"]


def lost_message(lost: aperf.Lost) -> str:
    if lost.cpu == aperf.NO_CPU:  # one ring buffer for every CPU
        return f"Lost {lost.count} events!"
    return f"Lost {lost.count} events on CPU #{lost.cpu}!"


def warn(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class StopSignals(aperf.SignalCloser):
    """While entered, SIGINT and SIGTERM run the registered stop actions
    ([`aperf.closing_on_signals`][aperf.closing_on_signals], with the tracer's names).

    The loop runs them in its own thread, between two callbacks: nothing is
    interrupted mid-line, no task is cancelled. Installed before the (synchronous)
    load, so that a signal during the load is held and acted on right after it.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        super().__init__((), self.SIGNALS)

    @property
    def requested(self) -> bool:
        """Whether a stop signal came."""
        return self.signal is not None

    def on_stop(self, action: Callable[[], None]) -> None:
        """Run ``action`` at the stop signal (at once if it already came)."""
        self.add(action)


class Printer:
    """How the tracer shows each item of the stream: events on stdout, trouble on stderr;
    and, with ``--record DIR``, writes them to a recording too (``recorder``)."""

    def __init__(self, out: LineOutput, as_json: bool) -> None:
        self.out = out
        self.as_json = as_json
        self.recorder: Any = None

    async def record(self, items: list[Any]) -> None:
        """Hand items to the recorder (in a worker thread: Parquet writes take time)."""
        if self.recorder is not None and items:
            await asyncio.to_thread(self.recorder.write, items)

    async def header(self) -> None:
        if not self.as_json:
            await self.out.write(HEADER)

    async def sample(self, sample: aperf.Sample) -> None:
        now = datetime.datetime.now().astimezone()  # when read, as in the C original
        if self.as_json:
            await self.out.write(json.dumps(json_record(sample, now)))
        else:
            await self.out.write(table_line(sample.value, now))

    async def show(self, item: aperf.Sample | aperf.Lost | aperf.BadSample) -> None:
        if isinstance(item, aperf.Sample):
            await self.sample(item)
        elif isinstance(item, aperf.Lost):
            warn(lost_message(item))
        else:
            warn(f"Bad sample on CPU #{item.cpu}: {item.error}")


async def show_all(stream: aperf.PerfStream[Any], printer: Printer) -> None:
    """Print every item until the stream ends; close it if stdout's reader went away."""
    if printer.recorder is not None:  # a batch at a time, each printed, then recorded
        async for batch in stream.batches():
            await show_batch(stream, printer, batch)
        return
    async for item in stream:
        await printer.show(item)
        if printer.out.broken:
            stream.close()


async def show_batch(stream: aperf.PerfStream[Any], printer: Printer, batch: list[Any]) -> None:
    """Print a batch, then record it (``--record``); close the stream if stdout's reader
    went away."""
    for item in batch:
        await printer.show(item)
    await printer.record(batch)
    if printer.out.broken:
        stream.close()


def order_by(args: argparse.Namespace) -> str | None:
    """The field events are ordered by (None: --unordered, ring order)."""
    return None if args.unordered else ORDER_BY
