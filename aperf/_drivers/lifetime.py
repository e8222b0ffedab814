"""The lifetime of open rings, one for both drivers: open, fork, garbage collection, close.

- ``OpenReader`` is what an open ``PerfStream`` or ``PerfBuffer`` holds: the
  reader, how the driver stops waiting on its handles, the fork flag, the
  finalizer and the opened/closed log lines. It closes in one fixed order:
  stop waiting (no callback may touch the rings from then on), stop the
  producer writing into them (a perf event array's slots emptied, programs
  already writing waited for), take what the rings still hold, free them, log
  the summary. Drained before the producer stopped, a ring would be written
  into again and freed with what it got.
- fork: a child inherits a copy of every open stream or buffer, but not the
  rings' memory (perf mmaps are not inherited) and shares the parent's map
  slots and event-loop registrations. ``track()`` marks each open one
  ``forked`` in the child, where the drivers then refuse to use it and closing
  it releases only the child's own fds.
- garbage collection: a driver registers a ``weakref.finalize`` that releases
  what it holds, with a ``ResourceWarning``, as files and sockets do.
- loop callbacks hold the driver weakly (``weak_callback()``), or a
  registered callback would keep a dropped stream alive for ever.
"""

from __future__ import annotations

import os
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from .._errors import ClosedResourceError
from .._log import log
from .._reading.reader import Reader
from .._rings.seam import quiesce


class Inherited(Protocol):
    forked: bool


_open: weakref.WeakSet[Any] = weakref.WeakSet()
_open_lock = threading.Lock()


def _mark_inherited() -> None:
    for state in list(_open):
        state.forked = True
    _open.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_mark_inherited)


def track(state: Inherited) -> None:
    """Mark ``state.forked = True`` in a child process forked while it is tracked."""
    with _open_lock:
        _open.add(state)


def untrack(state: Inherited) -> None:
    with _open_lock:
        _open.discard(state)


def forked_error(what: str) -> str:
    return (
        f"this {what} was opened by the parent process and inherited across fork: it is "
        "inert here (its rings are not mapped in this process); open a new one in the child"
    )


def weak_callback(method: Callable[..., Any]) -> Callable[..., None]:
    """A function calling the bound ``method`` while its object lives, else nothing."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> None:
        bound = ref()
        if bound is not None:
            bound(*args)

    return call


class OpenReader:
    """What an open driver holds: released by its close, or at garbage collection.

    ``stop`` stops the driver waiting on the rings' handles (a loop binding's
    ``stop``, a waiter's ``close``). It runs before the handles are closed:
    their numbers are reused at once. In a child that inherited it, ``stop``
    runs only when ``stop_in_child`` (a waiter of its own; never an event
    loop's registrations, which the child shares with its parent).
    """

    __slots__ = ("__weakref__", "_finalizer", "_hand_over", "_stop", "_stop_in_child",
                 "forked", "noun", "reader", "what")

    def __init__(
        self, reader: Reader, stop: Callable[[], None], *, what: str, noun: str,
        stop_in_child: bool, hand_over: Callable[[Callable[[], None]], bool] | None = None,
    ) -> None:
        self.reader = reader
        self.what = what  # the driver's class name, for errors and warnings
        self.noun = noun  # for the log lines: "perf stream"
        self.forked = False  # set in a child process that inherited it
        self._stop = stop
        self._stop_in_child = stop_in_child
        # How a dropped driver's release reaches the thread it must run on (a loop's
        # thread); False when it must run here.
        self._hand_over = hand_over
        self._finalizer: weakref.finalize[Any, Any] | None = None

    def opened(self, owner: object, hint: str) -> None:
        """The driver is open: track it across fork, release it if ``owner`` is dropped
        unclosed (a ResourceWarning saying to use ``hint``), log it."""
        reader = self.reader
        name = reader.source.name
        track(self)
        warning = (f"unclosed {self.what} on {name}: use {hint}; its rings were released at "
                   "garbage collection")
        self._finalizer = weakref.finalize(owner, _release_dropped, self, warning)
        log.info(
            f"{self.noun} opened",
            source=name,
            cpus=reader.keys(),
            ring_bytes=reader.ring_bytes,
            memory_bytes=reader.memory_bytes,
            wakeup=reader.wakeup,
            lost_counter=reader.lost_counter,
        )

    def usable(self) -> Reader:
        """The reader, unless this process inherited it across fork."""
        if self.forked:
            raise ClosedResourceError(forked_error(self.what))
        return self.reader

    def release(self) -> None:
        """Stop waiting, then free the rings (after a fork only this process's fds: the
        rings, the map slots and any loop registrations are the parent's)."""
        source = self.reader.source
        try:
            if not self.forked or self._stop_in_child:
                self._stop()
        finally:
            if self.forked:
                source.after_fork()
            else:
                source.free()

    def close(self) -> None:
        """The driver's close (once): stop waiting, take what the rings hold, free them."""
        finalizer = self._finalizer
        if finalizer is not None:
            finalizer.detach()
        untrack(self)
        if self.forked:
            self.release()  # the child's fds only; the parent's rings and loop untouched
            return
        reader = self.reader
        try:
            self._stop()  # 1. no callback may touch the rings from now on
            try:
                quiesce(reader.source)  # 2. nothing writes into the rings from now on
            finally:
                reader.close()  # 3. takes what the rings hold; forgets them
        finally:
            try:
                reader.source.free()  # 4. rings unmapped, handles closed
            finally:
                reader.log_summary(f"{self.noun} closed")


def _release_dropped(held: OpenReader, warning: str) -> None:
    """The driver was garbage-collected without being closed."""
    warnings.warn(warning, ResourceWarning, stacklevel=2)
    hand_over = held._hand_over
    if hand_over is not None and not held.forked and hand_over(held.release):
        return  # the loop thread stops waiting and frees
    held.release()
