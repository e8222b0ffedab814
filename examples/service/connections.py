"""How many connections the service holds, how long one may take to ask, and the fds kept back.

Any local user can connect to a loopback port. Without limits, idle connections that never
send a request each hold a file descriptor for ever: about a thousand of them exhaust the
process's ``RLIMIT_NOFILE`` (1024 under systemd by default), after which nobody is served
(``/health`` included) and aperf cannot open the ring of a CPU coming online (``EMFILE``).
So, at the HTTP protocol (uvicorn's h11 protocol, subclassed):

- **A deadline for request headers**: a connection that has not sent a whole request head
  ``header_timeout`` seconds after it was accepted, or after its previous response, is
  closed (uvicorn times out only idle keep-alive connections, and only until their first
  byte).
- **A connection limit**: at most ``max_connections`` connections are held. One more
  pushes out the oldest connection still waiting for its request head, so a client that
  asks at once is always served, whoever hoards connections; if every connection is busy
  with a request (event streams are capped lower, in the app), the new one is closed.
- **File descriptors in reserve**: ``reserve_descriptors()`` makes sure that the soft
  ``RLIMIT_NOFILE`` covers the connections, those accepted but not yet seen by the guard
  (``ACCEPT_BURST``) and a reserve for the rings and the BPF object (``RING_RESERVE_FDS``
  and ``FDS_PER_CPU`` for each possible CPU), raising the soft limit up to the hard one if
  it must. With the defaults that is about 800, under systemd's soft limit of 1024.
"""

from __future__ import annotations

import asyncio
import os
import resource
from collections import OrderedDict
from pathlib import Path

from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT = 10.0  # seconds to send a request head
MAX_CONNECTIONS = 256
BACKLOG = 64  # listen(2) backlog, also what asyncio accepts in one turn of its loop
# Connections accepted before the guard sees them: asyncio accepts up to BACKLOG a turn,
# makes the transport a turn later, calls connection_made() the turn after, and closes a
# pushed-out socket one more turn later.
ACCEPT_BURST = 4 * BACKLOG
RING_RESERVE_FDS = 256  # the BPF object, its maps and programs, logs, libraries
FDS_PER_CPU = 4  # a ring's perf event fd and what aperf opens with it, per possible CPU
DROP_REASONS = ("header_timeout", "pushed_out", "refused")


class DescriptorLimitError(Exception):
    """RLIMIT_NOFILE's hard limit is too low for the connections asked for."""


def possible_cpus() -> int:
    """CPUs that may ever come online (``/sys/devices/system/cpu/possible``)."""
    try:
        text = Path("/sys/devices/system/cpu/possible").read_text().strip()
    except OSError:
        return os.cpu_count() or 1
    count = 0
    for part in text.split(","):
        first, _, last = part.partition("-")
        count += int(last or first) - int(first) + 1
    return count


def descriptors_needed(max_connections: int) -> int:
    """File descriptors the service may hold at once, the reserve included."""
    in_use = len(os.listdir("/proc/self/fd"))
    return in_use + max_connections + ACCEPT_BURST + RING_RESERVE_FDS + \
        FDS_PER_CPU * possible_cpus()


def reserve_descriptors(max_connections: int) -> int:
    """Raise the soft RLIMIT_NOFILE to what the service needs, if it is lower; the soft limit.

    Raises DescriptorLimitError if the hard limit is lower than that.
    """
    needed = descriptors_needed(max_connections)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            raise DescriptorLimitError(
                f"--max-connections {max_connections} needs {needed} file descriptors, but "
                f"RLIMIT_NOFILE allows {hard}: lower --max-connections, or raise the limit "
                "(ulimit -n, or LimitNOFILE= in a systemd unit)"
            )
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
        soft = needed
    return soft


class ConnectionGuard:
    """The connections of one server: the limit, and those still waiting for a request head.

    Used from the event loop's thread only.
    """

    def __init__(self, max_connections: int = MAX_CONNECTIONS,
                 header_timeout: float = HEADER_TIMEOUT) -> None:
        if max_connections < 1 or not header_timeout > 0:
            raise ValueError("max_connections must be at least 1, header_timeout positive")
        self.max_connections = max_connections
        self.header_timeout = header_timeout
        self.held: set[GuardedH11Protocol] = set()
        # Oldest first: each with the timer of its deadline.
        self.waiting: OrderedDict[GuardedH11Protocol, asyncio.TimerHandle] = OrderedDict()
        self.dropped = dict.fromkeys(DROP_REASONS, 0)  # connections closed by the guard
        self.most_held = 0  # the most connections held at once

    def protocol(self) -> type[GuardedH11Protocol]:
        """The uvicorn ``http`` protocol class that reports to this guard."""

        class Protocol(GuardedH11Protocol):
            guard = self

        return Protocol

    def admit(self, conn: GuardedH11Protocol) -> bool:
        """A new connection: make room for it, or close it; whether it was admitted."""
        if len(self.held) >= self.max_connections:
            if not self.waiting:
                self.dropped["refused"] += 1
                conn.transport.close()
                return False
            oldest = next(iter(self.waiting))
            self.drop(oldest, "pushed_out")
        self.held.add(conn)
        self.most_held = max(self.most_held, len(self.held))
        self.wait(conn)
        return True

    def wait(self, conn: GuardedH11Protocol) -> None:
        """``conn`` is waiting for a request head: its deadline starts now."""
        self.stop_waiting(conn)
        self.waiting[conn] = conn.loop.call_later(self.header_timeout, self.drop, conn,
                                                  "header_timeout")

    def stop_waiting(self, conn: GuardedH11Protocol) -> None:
        timer = self.waiting.pop(conn, None)
        if timer is not None:
            timer.cancel()

    def drop(self, conn: GuardedH11Protocol, reason: str) -> None:
        """Close a connection that sent no request head in time, or that makes room."""
        self.dropped[reason] += 1
        self.forget(conn)
        conn.transport.close()

    def forget(self, conn: GuardedH11Protocol) -> None:
        self.stop_waiting(conn)
        self.held.discard(conn)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, under a ConnectionGuard (made by ``ConnectionGuard.protocol``).

    It leans on uvicorn's own hooks and state (``cycle``, ``on_response_complete``), as
    they have been since uvicorn 0.29; uvicorn has no option for a head deadline.
    """

    guard: ConnectionGuard

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.guard.admit(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.forget(self)
        super().connection_lost(exc)

    def _idle(self) -> bool:
        """No request under way: the next thing due is a request head."""
        return self.cycle is None or self.cycle.response_complete

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if not self._idle() and self in self.guard.waiting:
            self.guard.stop_waiting(self)  # a whole request head came in time

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # Keep-alive: the next request head has its own deadline (unless it is already
        # here, pipelined, or the connection is closing).
        if self._idle() and not self.transport.is_closing() and self in self.guard.held:
            self.guard.wait(self)
