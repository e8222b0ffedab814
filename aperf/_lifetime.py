"""Process-level lifetime of open rings: fork, garbage collection, loop callbacks.

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
import weakref
from collections.abc import Callable
from typing import Any, Protocol


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
