"""The drain clock: when a reader with batched wakeups looks at its rings unasked.

A function of an injected clock (the loop's time, ``time.monotonic``, a test's
fake), so it is tested without waiting. The reader tells it what happened
(a ring drained, traffic, a tick, backpressure lifted); drivers read
``deadline`` and set their one timer to it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable

from .._options import Wakeup

Clock = Callable[[], float]


class DrainClock:
    """The deadline of the next look at the rings, from when each ring was last drained.

    A ring's last drain is ``_drained_at[key]`` if it was drained since the last tick
    that looked at every ring (or could not be drained then), else ``_all_at``, that
    tick's time: so a tick that finds most rings empty records that in one step
    (``looked_all``), and what a tick costs grows with the busy rings only.
    """

    __slots__ = ("_all_at", "_drained_at", "_last_traffic", "_max_latency", "_ticked_at",
                 "deadline", "now", "wakeup")

    def __init__(self, wakeup: Wakeup, clock: Clock, keys: Iterable[int]) -> None:
        self.wakeup = wakeup
        self.now = clock
        self._max_latency = wakeup.max_latency if wakeup.batched else None
        start = clock()
        self._last_traffic = start
        self._all_at = start  # the last drain of every ring not in _drained_at
        self._drained_at: dict[int, float] = {}  # key -> last take, since then
        self._ticked_at = start
        self.deadline: float | None = (
            None if self._max_latency is None else start + self._max_latency
        )
        """Loop time of the next tick (None: no timer)."""

    def period(self, now: float, *, paused: bool = False) -> float | None:
        """How long the drain timer waits from ``now`` (None: batched wakeups off, no timer).

        ``max_latency`` while samples flow or the queue is full (``paused``:
        backpressure is not silence); ``idle_latency`` once ``idle_after``
        seconds passed without traffic.
        """
        max_latency = self._max_latency
        if max_latency is None:
            return None
        wakeup = self.wakeup
        idle = wakeup.idle_latency
        if idle is not None and not paused and now - self._last_traffic >= wakeup.idle_after:
            return idle
        return max_latency

    def drained(self, key: int) -> None:
        """A ring was just taken from."""
        self._drained_at[key] = self.now()

    def recently_drained(self, key: int) -> bool:
        """Whether the ring was taken from less than ``max_latency`` ago (so a look at it
        is due by then anyway)."""
        max_latency = self._max_latency
        return max_latency is not None and (
            self.now() - self._drained_at.get(key, self._all_at) < max_latency)

    def start_tick(self) -> tuple[float, float]:
        """The timer fired: (now, the time of the tick before)."""
        now = self.now()
        since, self._ticked_at = self._ticked_at, now
        return now, since

    def due(self, key: int, since: float) -> bool:
        """Whether a tick must look at this ring: not drained since the tick before."""
        return self._drained_at.get(key, self._all_at) <= since

    def looked(self, key: int, now: float) -> None:
        """A tick looked at this ring at ``now`` (not at a later time a drain recorded)."""
        if self._drained_at.get(key, now) > now:
            self._drained_at[key] = now

    def looked_all(self, now: float, since: float) -> None:
        """A tick at ``now`` looked at every ring due (not drained since ``since``, the tick
        before): those it did not drain were empty, looked at now. One step however many
        there are: the rings drained since ``since`` keep their own times."""
        self._all_at = now
        drained_at = self._drained_at
        for key in [key for key, at in drained_at.items() if at <= since]:
            del drained_at[key]

    def end_tick(self, now: float, found: bool, keys: Collection[int], *,
                 parked: bool) -> None:
        """Set the deadline after a tick at ``now``.

        A ring drained at ``t`` (by its wakeup, a take) need not be looked at before
        ``t + period``, so the deadline is the earliest such time over the rings: a
        busy ring that wakes its reader more often than the timer fires is not cut
        into extra small drains by the timer (each drain has a fixed cost, most of
        all to columnar consumers), and no sample waits longer than before.
        ``parked`` (a full queue, or closed): no timer until the consumer resumes it.
        """
        if found:
            self._last_traffic = now
        period = self.period(now, paused=parked)
        if period is None or parked:
            self.deadline = None
            return
        drained_at = self._drained_at
        own = [at for key, at in drained_at.items() if key in keys]
        earliest = min(own, default=now)
        if len(own) < len(keys):  # the others were last drained at _all_at
            earliest = min(earliest, self._all_at)
        # Never in the past: a ring that could not be drained (full queue) must not
        # make the timer spin.
        self.deadline = max(earliest + period, now + period / 4)

    def traffic(self) -> None:
        """Samples arrived: after a silence, bring the timer back to max_latency now."""
        if self._max_latency is None:
            return
        now = self.now()
        self._last_traffic = now
        soon = now + self._max_latency
        if self.deadline is not None and self.deadline > soon:
            self.deadline = soon

    def resumed(self) -> None:
        """Backpressure lifted: the timer runs again, ``max_latency`` from now."""
        if self._max_latency is not None:
            now = self.now()
            self._last_traffic = now
            self.deadline = now + self._max_latency

    def stop(self) -> None:
        self.deadline = None
