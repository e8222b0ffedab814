"""What the drivers need from whatever waits: the protocols, and the handle vocabulary.

``PerfStream`` is written once against ``LoopBinding`` (an event loop: watch
readiness handles, keep one timer, park one consumer until woken, run a
function on the loop from another thread); ``PerfBuffer`` against
``HandleWaiter`` (no loop: wait on the handles with a timeout, be interrupted
from another thread). The implementations are this package's other modules;
``aperf._waiting`` chooses one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Literal, Protocol

OnHandle = Callable[[int], None]
"""A function of a readiness handle: a driver's ``on_ready``, a source's ``acknowledge``."""

HandleKind = Literal["fd", "win32"]
"""What a readiness handle is: a file descriptor to poll for input, or a Windows wait handle."""


class LoopBinding(Protocol):
    """What the async driver needs from one event loop."""

    def time(self) -> float:
        """The loop's clock (the reader's deadlines are on it)."""
        ...

    def watch(
        self, handles: Iterable[int], on_ready: OnHandle, acknowledge: OnHandle | None = None,
        on_armed: OnHandle | None = None,
    ) -> None:
        """Call ``on_ready(handle)`` on the loop each time a handle fires.

        ``acknowledge`` is the source's: a binding that must re-arm a handle
        before ``on_ready`` runs clears its readiness with it first (trio).
        ``on_armed(handle)`` runs on the loop once, after the loop's wait has
        taken the handle in: arming a perf fd polls it, and that poll takes a
        wakeup that came before it without the wait reporting it, so the driver
        looks at the handle's rings then. A loop may arm later than ``watch()``
        returns (uvloop arms in the poll phase of its next iteration, after its
        timers): the binding knows when.
        """
        ...

    def forget(self, handle: int) -> None:
        """Stop watching one handle (its rings broke)."""
        ...

    def schedule(self, at: float | None, callback: Callable[[], None]) -> None:
        """Run ``callback`` at loop time ``at`` (None: no timer); replaces the last one."""
        ...

    async def wait(self) -> None:
        """Park the consumer until ``wake()``; BusyResourceError if one is parked already."""
        ...

    def wake(self) -> None:
        """Wake the parked consumer, if any (from the loop's thread)."""
        ...

    def in_loop_thread(self) -> bool:
        """Whether the caller runs on the loop's thread (and the loop runs)."""
        ...

    def call_soon_threadsafe(self, fn: Callable[[], None]) -> bool:
        """Run ``fn`` on the loop from another thread; False if the loop no longer runs."""
        ...

    def running(self) -> bool:
        """Whether the loop still runs (a callback handed over would be called)."""
        ...

    def stop(self) -> None:
        """Unwatch every handle and cancel the timer (before the handles are closed:
        fd numbers are reused at once)."""
        ...


class HandleWaiter(Protocol):
    """What waits on a source's readiness handles without an event loop."""

    def wait(self, timeout: float) -> list[int]:
        """The handles ready within ``timeout`` seconds (negative: no limit); [] on
        timeout or ``interrupt()``."""
        ...

    def interrupt(self) -> None:
        """Wake a wait in another thread (close() does, before taking the lock)."""
        ...

    def watch(self, handle: int) -> None:
        """Wait on one more handle (a ring added at run time: CPU hotplug)."""
        ...

    def forget(self, handle: int) -> None:
        """Stop waiting on a handle (before it is closed)."""
        ...

    def close(self) -> None: ...
