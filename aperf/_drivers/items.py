"""One iterator class for every async stream aperf has: ``async for`` over a stream, its
``batches()`` and ``arrays()``, and a fleet reader's (``aperf.fleet``).

It keeps nothing of its own across an await: items built and not yet handed out wait
where their driver keeps them (a reader's front queue), so a consumer that stops (break,
an exception, a cancelled ``anext()``: a timeout around it) loses nothing, and the same
iterator goes on where it stopped. An async generator would be finished by a
cancellation: its next ``anext()`` would say the stream ended.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Generic, TypeVar

from .._native import speedups

I = TypeVar("I")  # noqa: E741 - what an iterator hands out


class Items(Generic[I]):
    """``next_item()`` hands out the front (IndexError: empty); ``fill()`` takes the next
    batch into it, without waiting, and says whether there is anything; ``ended()`` says,
    when there is not, that nothing more will come; else ``wait()`` waits for more."""

    __slots__ = ("_ended", "_fill", "_next", "_wait")

    def __init__(
        self, next_item: Callable[[], I], fill: Callable[[], bool], ended: Callable[[], bool],
        wait: Callable[[], Awaitable[None]],
    ) -> None:
        self._next = next_item
        self._fill = fill
        self._ended = ended
        self._wait = wait

    def __aiter__(self) -> Items[I]:
        return self

    async def __anext__(self) -> I:
        try:
            return self._next()
        except IndexError:
            pass
        while not self._fill():
            if self._ended():
                raise StopAsyncIteration
            await self._wait()
        return self._next()


def batches(
    take: Callable[[], list[Any]], ended: Callable[[], bool],
    wait: Callable[[], Awaitable[None]],
) -> Items[list[Any]]:
    """Lists from ``take()`` (empty: nothing now). A batch is taken into a slot and handed
    out in the same step: nothing waits in it across an await."""
    slot: deque[list[Any]] = deque()

    def fill() -> bool:
        batch = take()
        if batch:
            slot.append(batch)
        return bool(batch)

    return Items(slot.popleft, fill, ended, wait)


_FastItems = speedups.Items


def fast(items: Items[I]) -> AsyncIterator[I]:
    """``items``, or with the compiled fast path its C iterator: it hands out what the front
    holds without a coroutine, and turns to ``items``' own step when it is empty (the same
    waits, the same cancellation: nothing is taken before the step runs)."""
    if _FastItems is None:
        return items
    return _FastItems(items._next, items.__anext__)
