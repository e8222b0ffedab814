"""``await stream.record(directory)``: a whole stream written by a ``Recorder``.

The loop takes what the stream hands out (NumPy arrays where the decoder has a layout,
else batches of events), and hands a batch at a time to the recorder in a worker
thread: converting to Arrow and writing Parquet (pyarrow releases the GIL while it
compresses and writes) go on while the event loop keeps draining the rings. Items
taken are always handed over, even when the task is cancelled: nothing taken out of
the stream is dropped on the way.
"""

from __future__ import annotations

import math
import time
from typing import Any

import anyio

from .writer import Recorder, RecorderStatistics

BATCH_ROWS = 65_536  # rows handed to the writer thread at a time, at most
FLUSH_SECONDS = 0.5  # what waits longer is handed over anyway


def _rows(item: Any) -> int:
    return len(item) if item.__class__.__name__ == "SampleArray" else 1


async def record_stream(stream: Any, recorder: Recorder, *, columnar: bool,
                        max_seconds: float | None = None,
                        max_samples: int | None = None) -> RecorderStatistics:
    """Write every item of ``stream`` until it ends (or, if given, ``max_seconds``
    passed or ``max_samples`` were written); then close the recorder."""
    items = stream.arrays() if columnar else stream.batches()
    held: list[Any] = []
    rows = 0
    total = 0
    flushed = time.monotonic()
    ends = math.inf if max_seconds is None else time.monotonic() + max_seconds
    try:
        while True:
            now = time.monotonic()
            if now >= ends or (max_samples is not None and total >= max_samples):
                break
            got: Any = None
            done = False
            with anyio.move_on_after(min(FLUSH_SECONDS, ends - now)):
                try:
                    got = await items.__anext__()
                except StopAsyncIteration:
                    done = True
            if got is not None:
                if columnar:
                    held.append(got)
                    rows += _rows(got)
                else:
                    held.extend(got)
                    rows += len(got)
            if done or rows >= BATCH_ROWS or time.monotonic() - flushed >= FLUSH_SECONDS:
                batch, held, total, rows = held, [], total + rows, 0
                flushed = time.monotonic()
                await anyio.to_thread.run_sync(_write, recorder, batch)
            if done:
                break
    finally:
        with anyio.CancelScope(shield=True):
            batch, held = held, []
            await anyio.to_thread.run_sync(_finish, recorder, batch)
    return recorder.statistics()


def _write(recorder: Recorder, batch: list[Any]) -> None:
    if batch:
        recorder.write(batch)
    else:
        recorder.tick()


def _finish(recorder: Recorder, batch: list[Any]) -> None:
    try:
        if batch:
            recorder.write(batch)
    finally:
        recorder.close()
