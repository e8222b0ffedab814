"""Leases for the drivers: ``async with stream.lease()``, ``with perf_buffer.lease()``.

The adapters only wait, as the drivers do: the lease itself (its rings read in place,
its batch's lifetime) is ``_reading/lease.py``'s, its perf rings
``_rings/perf/lease_ring.py``'s. A driver hands an adapter what it needs as calls of
its own (take a batch, wait, whether it is closed, its lock): the adapters call into no
driver's private members.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from typing import Any

from .._reading.columnar import ArrayItem
from .._reading.lease import Lease
from .._reading.rings import RingSet
from .._rings.perf.lease_ring import leased


def lease(rings: RingSet) -> Lease:
    """A lease on a reader's rings (its columns switched on): perf rings read in place."""
    return Lease(rings, leased)


class AsyncLease:
    """``async with stream.lease() as batch``: waits for data as ``arrays()`` does."""

    __slots__ = ("_closed", "_lease", "_take", "_wait")

    def __init__(self, held: Lease, take: Callable[[], list[Any]],
                 wait: Callable[[], Awaitable[None]], closed: Callable[[], bool]) -> None:
        self._lease = held
        self._take = take  # the stream's columnar take
        self._wait = wait  # until the stream has something
        self._closed = closed

    async def __aenter__(self) -> list[ArrayItem]:
        while True:
            batch = self._take()
            if batch or self._closed():
                return self._lease.started(batch)
            await self._wait()

    async def __aexit__(self, *exc: object) -> None:
        self._lease.end()


class SyncLease:
    """``with perf_buffer.lease() as batch``: ``batch()`` waits as ``poll()`` does."""

    __slots__ = ("_batch", "_lease", "_lock")

    def __init__(self, held: Lease, batch: Callable[[], list[Any]],
                 lock: AbstractContextManager[Any]) -> None:
        self._lease = held
        self._batch = batch  # the buffer's columnar take, waiting up to the timeout
        self._lock = lock  # the buffer's: the end gives ring space back under it

    def __enter__(self) -> list[ArrayItem]:
        return self._lease.started(self._batch())

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._lease.end()
