"""The tracer's stdout: lines written without ever blocking the event loop.

A plain ``sys.stdout.write`` blocks the whole process while the pipe is full
(``aperf-trace | sleep 1000``): the loop then never runs its signal handlers,
and SIGTERM is ignored until the reader drains the pipe, if ever. Here a pipe
or terminal on stdout is written through the loop (``connect_write_pipe``), so
a full pipe makes ``write()`` wait while signals, the rings' timers and the
stop still run; a stop ends the wait at once.

The loop's transport needs a non-blocking fd. O_NONBLOCK belongs to the open
file description, which stdout shares with the shell or the processes around
it (a terminal left non-blocking breaks the shell), so the pipe or terminal is
opened anew through /proc/self/fd/1, a description of our own. Regular files
(they never stay full) and sockets (they cannot be reopened) keep plain writes.
"""

from __future__ import annotations

import asyncio
import os
import stat
import sys
from typing import IO

CLOSE_GRACE = 0.25
"""Seconds the last buffered lines get to reach a reader at exit, before they are dropped."""


class _Pipe(asyncio.Protocol):
    """Flow control of a write pipe: is the transport's buffer over its high-water mark?"""

    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        self.lost = loop.create_future()  # done once the transport is closed
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self.wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.wake()
        if not self.lost.done():
            self.lost.set_result(None)

    def wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def writable(self) -> None:
        """Return once the buffer is below its low-water mark (or the pipe is gone)."""
        if self._paused and not self.lost.done():
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None


def _reopen_nonblocking(fd: int) -> int | None:
    """A non-blocking file description of our own for the pipe or terminal at ``fd``."""
    try:
        mode = os.fstat(fd).st_mode
        if not (stat.S_ISFIFO(mode) or stat.S_ISCHR(mode)):
            return None
        return os.open(
            f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
        )
    except OSError:  # a socket (ENXIO), a pipe whose reader is gone, no /proc...
        return None


class LineOutput:
    """Lines to stdout, each handed to the kernel as soon as the reader has room.

    ``broken`` turns true when the reader went away (``... | head``): later
    writes do nothing. ``stop()`` (at SIGINT/SIGTERM) ends any wait for room.
    """

    def __init__(self, fd: int, transport: asyncio.WriteTransport | None, pipe: _Pipe | None):
        self._fd = fd
        self._transport = transport
        self._pipe = pipe
        self._stopping = False
        self.broken = False

    @classmethod
    async def open(cls, stream: IO[str] | None = None) -> LineOutput:
        """Lines to ``stream`` (stdout by default)."""
        stream = sys.stdout if stream is None else stream
        stream.flush()
        fd = stream.fileno()
        own = _reopen_nonblocking(fd)
        if own is None:
            return cls(fd, None, None)
        loop = asyncio.get_running_loop()
        transport, pipe = await loop.connect_write_pipe(_Pipe, os.fdopen(own, "wb", buffering=0))
        return cls(fd, transport, pipe)

    async def write(self, line: str) -> None:
        if self.broken:
            return
        data = (line + "\n").encode("utf-8", "backslashreplace")
        if self._transport is None or self._pipe is None:
            self._write_blocking(data)
            return
        if self._transport.is_closing():  # a write failed (EPIPE): the reader is gone
            self.broken = True
            return
        self._transport.write(data)
        if not self._stopping:
            await self._pipe.writable()
        self.broken = self._transport.is_closing()

    def _write_blocking(self, data: bytes) -> None:
        try:
            while data:
                data = data[os.write(self._fd, data) :]
        except BrokenPipeError:
            self.broken = True

    def stop(self) -> None:
        """Stop waiting for the reader: what is written from now on is only buffered."""
        self._stopping = True
        if self._pipe is not None:
            self._pipe.wake()

    async def aclose(self) -> None:
        """Hand the buffered lines to the reader, for CLOSE_GRACE seconds at most."""
        if self._transport is None or self._pipe is None:
            return
        self._transport.close()
        try:
            await asyncio.wait_for(asyncio.shield(self._pipe.lost), CLOSE_GRACE)
        except asyncio.TimeoutError:
            self._transport.abort()  # the reader is stuck: drop the rest
            await self._pipe.lost
