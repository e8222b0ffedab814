"""The hub: every event rendered once, kept in one bounded replay window that all clients read.

Each published event gets the next sequence number and an SSE ``id:`` of the form
``<run>-<seq>``, where ``run`` tells this run of the service from earlier ones. The hub keeps
the last ``window`` events. A client is a cursor into that window: its writer takes what lies
between its cursor and the newest event, and waits when there is nothing. The pump therefore
never waits for a client, and memory is bounded by the window, however many clients there are.

A client whose cursor falls out of the window (it reads too slowly, or it reconnects with a
``Last-Event-ID`` older than the window) skips to the oldest event still kept and first gets an
``event: missed`` notice saying how many events it missed. A client that reconnects with an id
still in the window gets every event after it: nothing is lost across a short disconnection.

A client that asks for ``history`` (a page that opens) starts that many events back instead of
with the next one, and gets an ``event: ready`` once it has everything published when it came:
a page shows what happened before it opened, and knows when its first view is complete.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

import structlog
from sse_starlette import ServerSentEvent

log = structlog.get_logger("examples.service")

MAX_WRITE_BATCH = 256  # events written to a socket at once
SEP = "\n"  # SSE line separator (sse-starlette's default is CRLF; LF reads better in curl)
RETRY_MS = 2000  # how long a browser waits before it reconnects
# An event id as this service hands them out: ASCII only (str.isdigit() takes "²", which
# int() refuses), and at most 19 digits (int() refuses 5000 digits; no run gets that far).
EVENT_ID = re.compile(r"(?P<run>[0-9A-Za-z]{1,32})-(?P<seq>[1-9][0-9]{0,18})", re.ASCII)


class BadEventIdError(ValueError):
    """A ``Last-Event-ID`` that this run of the service did not hand out."""


@dataclass(frozen=True)
class Message:
    """One event to publish: its SSE ``data`` (one line of JSON) and its SSE event name."""

    data: str
    event: str | None = None  # None: a plain "message" event


def sse(data: str | None = None, *, event: str | None = None, id: str | None = None,
        comment: str | None = None, retry: int | None = None) -> bytes:
    """One encoded SSE message, as sse-starlette writes it."""
    return ServerSentEvent(data, event=event, id=id, comment=comment, retry=retry,
                           sep=SEP).encode()


def missed_notice(missed: int | None, reason: str) -> bytes:
    """``event: missed``: how many events a client did not get (None: unknown), and why."""
    return sse(json.dumps({"missed": missed, "reason": reason}), event="missed")


def ready_notice(clients: int) -> bytes:
    """``event: ready``: the client has had every event published when it came, and is one
    of ``clients`` connected clients."""
    return sse(json.dumps({"clients": clients}), event="ready")


class Hub:
    """Publishes events into a bounded replay window; clients read it through cursors.

    Use it from the event loop's thread only (``close_threadsafe`` excepted).
    """

    def __init__(self, window: int, run: str | None = None) -> None:
        if window < 2:
            raise ValueError(f"window must be at least 2 events, not {window}")
        self.window = window
        # Ids of another run of the service (a restart) are recognised as such.
        self.run = run if run is not None else format(time.time_ns() // 1000, "x")
        self._ring: list[bytes] = [b""] * window  # event `seq` is at seq % window
        self.next_seq = 1  # sequence number of the next event
        self._published = asyncio.Event()  # set, then replaced, at each publish
        self.closed = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.cursors: set[Cursor] = set()
        # Event stream responses under way (app.py counts them, from the request on, and
        # refuses one more at the cap with 503: `refused`).
        self.clients = 0
        self.refused = 0
        # Events clients did not get, all clients together, by reason: too slow, back
        # too late, or cut off at shutdown with events still to take.
        self.missed: dict[str, int] = {"slow": 0, "reconnect": 0, "shutdown": 0}
        self.replayed = 0  # events sent again to clients that reconnected
        # Events handed to publish() after close(): none by design (the source stops
        # reading and publishes what it read before the hub closes), counted if ever.
        self.unpublished = 0

    @property
    def oldest_seq(self) -> int:
        """Sequence number of the oldest event still in the window."""
        return max(1, self.next_seq - self.window)

    @property
    def published(self) -> int:
        return self.next_seq - 1

    def event_id(self, seq: int) -> str:
        return f"{self.run}-{seq}"

    def publish(self, messages: Iterable[Message]) -> None:
        """Add events to the window (each gets its id) and wake the clients' writers once."""
        if self.closed:
            self.unpublished += sum(1 for _ in messages)
            return
        ring, window = self._ring, self.window
        seq = self.next_seq
        for m in messages:
            ring[seq % window] = sse(m.data, event=m.event, id=self.event_id(seq))
            seq += 1
        if seq != self.next_seq:
            self.next_seq = seq
            self._wake()

    def _wake(self) -> None:
        published, self._published = self._published, asyncio.Event()
        published.set()

    def events(self, start: int, end: int) -> bytes:
        """The encoded events ``start <= seq < end`` (all of them in the window)."""
        assert self.oldest_seq <= start <= end <= self.next_seq
        ring, window = self._ring, self.window
        return b"".join(ring[seq % window] for seq in range(start, end))

    async def wait_published(self, seq: int) -> None:
        """Wait until event ``seq`` is published or the hub closes."""
        while self.next_seq <= seq and not self.closed:
            await self._published.wait()

    def subscribe(self, last_event_id: str | None, peer: str,
                  history: int | None = None) -> Cursor:
        """A cursor for a new client, after ``last_event_id`` if it reconnects.

        With ``history`` (events, at most the window), a client without ``last_event_id``
        starts that many events back, and every client gets ``event: ready`` once it has
        what was published when it came. Raises BadEventIdError for an id this run did not
        hand out.
        """
        cursor = self._cursor(last_event_id, peer, history)
        if history is not None:
            cursor.ready_at = self.next_seq
        return cursor

    def _cursor(self, last_event_id: str | None, peer: str, history: int | None) -> Cursor:
        if last_event_id is None:
            start = self.next_seq if history is None else \
                max(self.oldest_seq, self.next_seq - history)
            return Cursor(self, start, peer)
        match = EVENT_ID.fullmatch(last_event_id)
        if match is None:
            shown = last_event_id if len(last_event_id) <= 60 else last_event_id[:60] + "..."
            raise BadEventIdError(f"Last-Event-ID {shown!r} is not an event id (<run>-<seq>)")
        if match["run"] != self.run:
            # An id of an earlier run: how much happened in between is unknown.
            return Cursor(self, self.next_seq, peer, missed_notice(None, "restart"))
        seq = int(match["seq"])
        if seq >= self.next_seq:
            raise BadEventIdError(
                f"Last-Event-ID {last_event_id!r} is newer than the newest event "
                f"({self.event_id(self.published)})"
            )
        start = seq + 1
        if start < self.oldest_seq:
            missed = self.oldest_seq - start
            self.missed["reconnect"] += missed
            start = self.oldest_seq
            cursor = Cursor(self, start, peer, missed_notice(missed, "reconnect"))
        else:
            cursor = Cursor(self, start, peer)
        self.replayed += self.next_seq - start
        return cursor

    def close(self) -> None:
        """End every event stream once it has written what is left for it (at shutdown).

        Idempotent; call it in the loop's thread (see close_threadsafe).
        """
        if not self.closed:
            self.closed = True
            self._wake()

    def close_threadsafe(self) -> None:
        """close() from a signal handler or another thread."""
        loop = self.loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self.close)

    def max_lag(self) -> int:
        """How many events the slowest connected client has yet to take."""
        return max((self.next_seq - c.seq for c in self.cursors), default=0)


class Cursor:
    """One client's place in the hub's window; ``chunks()`` is its event stream."""

    def __init__(self, hub: Hub, seq: int, peer: str, notice: bytes | None = None) -> None:
        self.hub = hub
        self.seq = seq  # the next event this client gets
        self.peer = peer
        self.notice = notice  # said first, before any event
        self.missed = 0
        # With history asked for: the next_seq of the hub when the client came; once the
        # client has everything before it, it gets `event: ready` (then None).
        self.ready_at: int | None = None

    async def chunks(self) -> AsyncIterator[bytes]:
        """What to write to this client: events, notices; ends when the hub closes.

        Never waits for anything but new events: the response's writer waits for its
        socket between two chunks, and only this client's events wait meanwhile.
        """
        hub = self.hub
        hub.cursors.add(self)
        finished = False
        log.info("client connected", peer=self.peer, clients=len(hub.cursors),
                 replay=hub.next_seq - self.seq)
        try:
            yield sse(comment="connected", retry=RETRY_MS) + (self.notice or b"")
            while True:
                if self.seq < hub.oldest_seq:
                    # Too slow: what it had not taken yet has left the window.
                    missed = hub.oldest_seq - self.seq
                    self.missed += missed
                    hub.missed["slow"] += missed
                    self.seq = hub.oldest_seq
                    yield missed_notice(missed, "slow")
                    continue
                if self.ready_at is not None and self.seq >= self.ready_at:
                    # Counted now, with this client among them: a page never shows
                    # itself missing.
                    yield ready_notice(len(hub.cursors))
                    self.ready_at = None
                    continue
                if self.seq < hub.next_seq:
                    end = min(hub.next_seq, self.seq + MAX_WRITE_BATCH)
                    if self.ready_at is not None:
                        end = min(end, self.ready_at)  # ready comes between, exactly
                    chunk = hub.events(self.seq, end)
                    self.seq = end
                    yield chunk
                    continue
                if hub.closed:
                    finished = True
                    return
                await hub.wait_published(self.seq)
        finally:
            hub.cursors.discard(self)
            if hub.closed and not finished:
                # Shutting down, and this client stopped reading: its writer waited for
                # room in a full socket until the grace period ended. Count what it
                # did not get, and say so once.
                missed = hub.next_seq - self.seq
                self.missed += missed
                hub.missed["shutdown"] += missed
                log.warning("client cut off at shutdown: it stopped reading",
                            peer=self.peer, missed=self.missed, missed_at_shutdown=missed)
            else:
                log.info("client disconnected", peer=self.peer, missed=self.missed,
                         clients=len(hub.cursors))
